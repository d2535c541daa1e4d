"""Expert parallelism trains like one process: every layout of tests/training/_ep_worker.py (4 processes, one
launch, conftest.py's ``ep_layouts``: expert-parallel pairs or quads under ZeRO-3 and ZeRO-2, with activation
checkpointing, full fine-tune and LoRA on every expert) against the same training on one process, which this
process runs with the same code; its last step replays a routing record (shifted experts) on every layout.

fp32 on CPU: the layouts differ only in the order of float sums (each rank's micro-batches, the gradient
reductions), so losses, the load-balancing loss's share and gradient norms agree to about 1e-7 relative and the
weights after 4 AdamW steps to about 1e-6; we allow 1e-5. The per-expert token counts are integers: equal.
"""

import pytest
import torch

from tests.launch import as_in_a_subprocess
from tests.training import _ep_worker as worker
from toolkit.parallel import ParallelDims
from toolkit.training import materialize


@pytest.fixture(scope="module")
def references() -> dict:
    with as_in_a_subprocess():  # one thread, as each worker has
        one_process = ParallelDims("ddp", dp_replicate=1, dp_shard=1)
        return {mode: worker.train(mode, one_process) for mode in sorted({m for m, _ in worker.RUNS})}


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_expert_parallel_layout_trains_like_one_process(run, ep_layouts, references):
    mode, layout = run
    ours, reference = ep_layouts[f"{mode}/{layout}"], references[mode]
    assert ours["replayed"] and reference["replayed"], "every forward of the last step took the replayed experts"
    torch.testing.assert_close(ours["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["norms"], reference["norms"], rtol=1e-5, atol=0)
    for step, (mine, theirs) in enumerate(zip(ours["routing"], reference["routing"])):
        assert mine.keys() == theirs.keys() and mine["router_aux_loss"] > 0, step
        torch.testing.assert_close(mine["router_aux_loss"], theirs["router_aux_loss"], rtol=1e-5, atol=0)
        for key in ("expert_load_min", "expert_load_max", "expert_load_busiest_share"):
            assert mine[key] == theirs[key], (step, key)
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-5, atol=1e-6, msg=key)


def test_every_expert_adapter_trains(references):
    # Each expert's adapters moved from where fill() put them: every expert got tokens, hence a gradient.
    start = worker.build("lora")
    materialize(start, device=torch.device("cpu"))
    worker.fill(start)
    initial, final = start.state_dict(), references["lora"]["weights"]
    adapters = [key for key in final if ".experts.lora_" in key]
    assert len(adapters) == 2 * 3 * 2  # 2 layers x 3 projections x (A, B)
    for key in adapters:
        for expert in range(worker.EXPERTS):
            assert not torch.equal(final[key][expert], initial[key][expert]), f"{key}[{expert}] did not train"
    routers = [key for key in final if key.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(final[key], initial[key]) for key in routers), "the routers stay frozen"
