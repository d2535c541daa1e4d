"""The versions a process reports to its peers, which must agree across the nodes of a job.

``TUNE_TEST_FAKE_TORCH_VERSION`` replaces the torch version reported (a test hook, and nothing else: it lets two
"nodes" on one machine disagree, for the tests of ``tune doctor`` and of ``tune run``'s start-up check).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

FAKE_TORCH_VERSION_ENV = "TUNE_TEST_FAKE_TORCH_VERSION"


def torch_version(environ: Mapping[str, str] | None = None) -> str:
    """This process's torch version (or the test hook's)."""
    import torch

    environ = os.environ if environ is None else environ
    return environ.get(FAKE_TORCH_VERSION_ENV) or torch.__version__
