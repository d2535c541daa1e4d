"""Promise 1 across tensor-parallel layouts: one process, tp=2, tp=4, ddp x tp=2, zero3 x tp=2 and hsdp x tp=2
train the same model from the same global batches.

One torchrun launch of 4 processes (tests/training/_tp_worker.py) runs every layout of a tiny Llama 3 (rope
scaling), Qwen 2.5 (q/k/v biases, tied embeddings) and Gemma 2 (soft-caps, sliding window, tied), full fine-tune,
LoRA (on Llama's output projection too) and DoRA; this process trains the one-process reference of each case
with the same code and compares. fp32 on CPU: the layouts differ only in the order of float sums (split matmuls,
reductions over ranks, micro-batches padded differently), so losses agree to about 1e-7 relative and the weights
after 5 AdamW steps to about 1e-6; we allow 1e-5 for both.
"""

import pytest
import torch

from tests.launch import run_workers
from tests.training import _tp_worker as worker
from toolkit.parallel import ParallelDims


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "results.pt"
    result = run_workers(worker.__file__, str(out), nproc=4, timeout_s=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def references() -> dict:
    # One thread, as each worker has: these tiny matmuls run 30x slower on a pool of threads that another process
    # keeps busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_process = ParallelDims("ddp", dp_replicate=1, dp_shard=1)
        return {case: worker.train(*case, one_process) for case in sorted({(n, m) for n, m, _ in worker.RUNS})}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_layout_trains_like_one_process(run, layouts, references):
    name, mode, layout = run
    ours, reference = layouts[f"{name}/{mode}/{layout}"], references[(name, mode)]
    torch.testing.assert_close(ours["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["norms"], reference["norms"], rtol=1e-5, atol=0)
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-5, atol=1e-5, msg=key)
    # The run trained: weights that did not move would agree with anything.
    assert reference["moved"] > 1e-3
