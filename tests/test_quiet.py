"""Third-party start-up noise is hidden, by name, unless TUNE_VERBOSE=1; nothing else is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from tests.launch import REPO
from toolkit.quiet import NOISE, quiet_third_party_noise

# A config check that imports torchao, through the 8-bit AdamW it names (what a user's first QLoRA or 8-bit run does).
_COMMAND = [sys.executable, "-m", "toolkit.cli.main", "validate", "full_finetune/demo",
            "optimizer._component_=torchao.optim.AdamW8bit"]
_NOISY = ("Failed to load", "is an Enum subclass")


def _validate(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "TUNE_VERBOSE"}
    return subprocess.run(_COMMAND, capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
                          env={**environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})


def test_tune_hides_torchaos_import_noise_and_shows_it_when_verbose() -> None:
    pytest.importorskip("torchao")
    quiet = _validate()
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", quiet.stderr
    loud = _validate(TUNE_VERBOSE="1")
    assert loud.returncode == 0, loud.stderr
    # Where torchao's kernels load and its enums register quietly (a GPU build that matches), there is nothing to
    # show; here, where they do not, the messages are back.
    if loud.stderr:
        assert all(line.startswith(_NOISY) or "torch/utils/_pytree.py" in line
                   for line in loud.stderr.splitlines()), loud.stderr


def test_only_the_named_messages_are_dropped(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    monkeypatch.delenv("TUNE_VERBOSE", raising=False)
    for name in NOISE:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])  # this test's filters only, removed after
    quiet_third_party_noise()
    quiet_third_party_noise()  # twice: still one filter each
    assert all(len(logging.getLogger(name).filters) == 1 for name in NOISE)
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING):
        torchao.warning("Failed to load /x/_C_mxfp8.so: Could not load this library: /x/_C_mxfp8.so")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value",
                       "<enum 'KernelPreference'>")
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton, on systems without Triton "
                                                          "certain kernels will not work")
        torchao.warning("NF4 quantization of this layer lost precision")  # the same logger, another message
        logging.getLogger("toolkit").warning("Failed to load x.so")  # ours: never hidden
    assert [r.getMessage() for r in caplog.records] == [
        "NF4 quantization of this layer lost precision", "Failed to load x.so",
    ]


def test_the_named_python_warning_is_dropped_and_others_are_not(monkeypatch) -> None:
    monkeypatch.delenv("TUNE_VERBOSE", raising=False)
    with warnings.catch_warnings(record=True) as caught:  # the filters are restored on leaving
        warnings.simplefilter("always")
        quiet_third_party_noise()
        warnings.warn("OptimState8bit does not implement _stable_hash_for_caching. For PT2-compatible ...",
                      UserWarning, stacklevel=1)
        warnings.warn("lr_scheduler: 10 warmup steps of 5 in all", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["lr_scheduler: 10 warmup steps of 5 in all"]


def test_verbose_adds_no_filter(monkeypatch) -> None:
    for name in NOISE:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    quiet_third_party_noise({"TUNE_VERBOSE": "1"})
    assert all(logging.getLogger(name).filters == [] for name in NOISE)
