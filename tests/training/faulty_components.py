"""Components that fail on purpose, for fault-reporting tests (imported by recipes through PYTHONPATH)."""

import os

from toolkit.data import demo_dataset


def dataset_failing_on_rank_one(tokenizer, **kwargs):
    """The demo dataset, except that rank 1 raises while the others go on to their first collective."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    return demo_dataset(tokenizer, **kwargs)
