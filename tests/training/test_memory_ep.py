"""The memory plan under expert parallelism: per-rank parameter, gradient and optimizer bytes, the parameters FSDP2
holds gathered and what the mixture-of-experts blocks save, against the expert-parallel layouts of
:mod:`tests.training._ep_worker` (measured by :mod:`tests.training._ep_memory` in the 4-process launch
test_expert_parallel.py shares: conftest.py's ``ep_layouts``); and the rules: which degrees and strategies combine,
and the refusals.

The worker's model: 2 layers of width 32, 8 experts of width 16 (top-2), vocabulary 64, fp32 (4 bytes), on 4
data-parallel ranks. Per rank, gathered whole in fp32:

- the root (embedding and output 64 x 32 each, final norm 32): 4,128 parameters, 16,512 bytes;
- a layer's rest (q and o 32 x 32, k and v 16 x 32, two norms of 32, router 8 x 32): 3,392, 13,568 bytes;
- a layer's experts (3 x 8 x 16 x 32 = 12,288 parameters), of which a rank holds 1/ep: 24,576 bytes at ep 2, 12,288
  at ep 4.
"""

from __future__ import annotations

import pytest
import torch

from tests.training import _ep_worker as worker
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_demo
from toolkit.models.qwen3_moe import qwen3_moe_30b_a3b
from toolkit.modules.moe import MoEFeedForward, _has_grouped_mm
from toolkit.planning.activation_memory import _moe_bytes_per_token, activation_bytes, all_to_all_bytes
from toolkit.planning.memory import estimate_memory
from toolkit.planning.layout import choose_strategy, expert_parallel_degrees, plan_parallelism

GIB = 1024**3
# The layouts measured (activation checkpointing's own saved-tensor hooks hide the layers' from the meter).
MEASURED = [run for run in worker.RUNS if not worker.LAYOUTS[run[1]][2]]
ROOT, REST, EXPERTS = 16_512, 13_568, 4 * 3 * 8 * 16 * 32  # bytes, see the module docstring


def _estimate(mode: str, layout: str, **overrides):
    strategy, ep, _ = worker.LAYOUTS[layout]
    args = dict(strategy=strategy, world_size=4, expert_parallel=ep, micro_batch_size=1, max_seq_len=20, dtype="fp32")
    return estimate_memory(worker.build(mode), **{**args, **overrides})


@pytest.mark.parametrize("run", MEASURED, ids="/".join)
def test_state_bytes_equal_every_ranks_shards(ep_layouts, run) -> None:
    # Exact: each rank holds E/ep experts, FSDP2-sharded over the 4/ep ranks holding the same ones, and 1/4 of the
    # rest; its gradients and AdamW state likewise. Per rank, the experts' share is what zero3 without EP gives it.
    mode, layout = run
    estimate = _estimate(mode, layout)
    for rank in ep_layouts["/".join(run)]["memory"]:
        assert (estimate.params, estimate.grads, estimate.optimizer_state) == (
            rank["params"], rank["grads"], rank["optimizer_state"]
        )
    plain = _estimate(mode, layout, strategy="zero3", expert_parallel=1)
    assert (estimate.params, estimate.grads, estimate.optimizer_state) == (
        plain.params, plain.grads, plain.optimizer_state
    )


@pytest.mark.parametrize("run", MEASURED, ids="/".join)
def test_gathered_parameters_are_what_fsdp2_holds_unsharded(ep_layouts, run) -> None:
    """Under zero3 each layer's experts are a unit of their own: a layer's rest and its experts are gathered while
    they run, and beside them the larger unit's all-gather buffer (in forward kept until the next unit is copied
    out, in backward the next unit prefetched). Full fine-tune (LoRA adds its adapters to both units):

    - ep 2: ROOT + REST + 2 x EXPERTS/2 = 79,232 bytes, in forward (the experts' buffer); backward's, ROOT + 2 x
      REST + EXPERTS/2 = 68,224, is less;
    - ep 4: experts a rank holds whole are copied, not all-gathered, so the buffer is the rest's: ROOT + 2 x REST +
      EXPERTS/4 = 55,936, in backward;
    - zero2, ep 2: every unit stays gathered from forward to backward, ROOT + 2 x (REST + EXPERTS/2) = 92,800; in
      forward the last unit's buffer exists too until the end of forward (one experts unit, 24,576, not counted).
    """
    mode, layout = run
    # trainable_params=0: the gathered parameters alone, without the unsharded gradients (which come on top).
    expected = _estimate(mode, layout, trainable_params=0).gathered
    if run == ("full", "zero3_ep2"):
        assert expected == ROOT + REST + EXPERTS == 79_232
    if run == ("full", "zero3_ep4"):
        assert expected == ROOT + 2 * REST + EXPERTS // 4 == 55_936
    for rank in ep_layouts["/".join(run)]["memory"]:
        if worker.LAYOUTS[layout][0] == "zero3":
            assert max(rank["forward_gathered"], rank["backward_gathered"]) == expected
        else:
            assert rank["backward_gathered"] == expected
            if mode == "full":
                assert rank["forward_gathered"] == expected + EXPERTS // 2


@pytest.mark.parametrize("layout", [layout for mode, layout in MEASURED if mode == "full"])
def test_the_moe_blocks_save_what_the_formula_counts(ep_layouts, layout) -> None:
    # Each rank's experts compute the rows routed to them from every rank of its group, more or fewer than its
    # own tokens' assignments; summed over the ranks they are all the tokens' assignments, which the formula
    # counts per token (at balanced routing). Exact, with the block's input (c * d per token, counted with the
    # projections' inputs) and the grouped matmuls' int32 offsets (3 per layer and micro-batch, one per local
    # expert; the formula leaves those out).
    ep = worker.LAYOUTS[layout][1]
    ranks = ep_layouts[f"full/{layout}"]["memory"]
    model = worker.build("full")
    block = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    per_token = _moe_bytes_per_token(block, embed_dim=worker.DIM, compute=4, expert_parallel=ep) + 4 * worker.DIM
    tokens, micro_batches = sum(sum(r["tokens"]) for r in ranks), sum(len(r["tokens"]) for r in ranks)
    offsets = 3 * 4 * (worker.EXPERTS // ep) if _has_grouped_mm("cpu", torch.float32) else 0
    layers = len(model.layers)
    assert tokens == sum(int(row["lengths"]) for row in worker.global_batch(0))
    assert sum(sum(r["moe_saved"]) for r in ranks) == layers * (tokens * per_token + micro_batches * offsets)
    # What the exchange adds per assignment: the experts' output rows again (c * d) and their sort order (int64).
    without = _moe_bytes_per_token(block, embed_dim=worker.DIM, compute=4, expert_parallel=1)
    assert per_token - 4 * worker.DIM - without == 2 * (4 * worker.DIM + 8)


def _meta(builder, **kwargs):
    with torch.device("meta"):
        return builder(**kwargs)


def test_the_exchange_adds_activations_and_all_to_all_buffers() -> None:
    # Qwen3-30B-A3B: 48 MoE layers of width 2048, top-8, bf16 (c = 2), 1 x 2048 tokens.
    model = _meta(qwen3_moe_30b_a3b, max_seq_len=2048)
    args = dict(micro_batch_size=1, seq_len=2048, dtype="bf16")
    assert all_to_all_bytes(model, **args) == 0  # without expert parallelism there is no exchange
    # Three buffers of 2048 x 8 rows of 2048 bf16 values while a layer's experts run: 192 MiB.
    assert all_to_all_bytes(model, expert_parallel=8, **args) == 3 * 2048 * 8 * 2048 * 2 == 192 * 2**20
    # Every layer keeps k * (c * d + 8) more per token: 48 x 2048 x 8 x (4096 + 8) bytes.
    assert activation_bytes(model, expert_parallel=8, **args) - activation_bytes(model, **args) == (
        48 * 2048 * 8 * (2 * 2048 + 8)
    )
    estimate = estimate_memory(model, strategy="zero3", world_size=8, expert_parallel=8, micro_batch_size=1,
                               max_seq_len=2048, dtype="bf16")
    assert estimate.all_to_all == 192 * 2**20 and estimate.label == "zero3 x ep8"
    assert estimate.total == estimate.params + estimate.grads + estimate.optimizer_state + estimate.activations + (
        estimate.logits + estimate.gathered + estimate.all_to_all
    )
    table = estimate.table()
    assert "x ep8" in table and "all-to-all" in table
    assert "all-to-all" not in estimate_memory(model, strategy="zero3", world_size=8, micro_batch_size=1,
                                               max_seq_len=2048, dtype="bf16").table()


def test_expert_parallel_degrees_divide_the_experts_and_the_data_parallel_ranks() -> None:
    model = _meta(qwen3_moe_30b_a3b, max_seq_len=2048)  # 128 experts
    assert expert_parallel_degrees(model, data_parallel_size=8) == [1, 2, 4, 8]
    assert expert_parallel_degrees(model, data_parallel_size=16) == [1, 2, 4, 8, 16]
    assert expert_parallel_degrees(model, data_parallel_size=6) == [1, 2]
    assert expert_parallel_degrees(_meta(llama3_demo), data_parallel_size=8) == [1]  # no experts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(strategy="ddp"), "data_parallel: ddp cannot combine with expert_parallel=2"),
        (dict(strategy="hsdp", num_nodes=2), "data_parallel: hsdp cannot combine with expert_parallel=2"),
        (dict(expert_parallel=3), "expert_parallel: 3 does not divide the 4 data-parallel processes"),
        (dict(world_size=2, tensor_parallel=2), "tensor_parallel: cannot combine with expert_parallel=2"),
        (dict(world_size=16, expert_parallel=16), "expert_parallel: 16 ranks cannot share the model's 8 experts"),
        (dict(cpu_offload=True), "cpu_offload: cannot combine with expert_parallel=2 (not supported yet)"),
    ],
)
def test_what_expert_parallelism_refuses_is_one_user_error(overrides: dict, message: str) -> None:
    with pytest.raises(UserError) as error:
        _estimate("full", "zero3_ep2", **overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="^expert_parallel: 2 ranks have no experts to share out"):
        estimate_memory(_meta(llama3_demo), strategy="zero3", world_size=4, expert_parallel=2, micro_batch_size=1,
                        max_seq_len=8)


def test_the_plan_chooses_among_what_combines_with_expert_parallelism() -> None:
    # 30B on 8 x 80 GB with activation checkpointing: ddp would fit the device here, but only zero2 and zero3 combine
    # with experts shared out, and the estimates the plan makes count the exchange.
    model = _meta(qwen3_moe_30b_a3b, max_seq_len=2048)
    args = dict(world_size=8, micro_batch_size=1, max_seq_len=2048, dtype="bf16", activation_checkpointing=True)
    strategy, estimate, reason = choose_strategy(model, device_memory_bytes=10_000 * GIB, expert_parallel=8, **args)
    assert (strategy, estimate.expert_parallel) == ("zero2", 8) and reason.startswith("zero2 x ep8 needs")
    plan = plan_parallelism(
        model=model, strategy="zero3", cpu_offload=False, batch_size=32, micro_batch_size="auto",
        device=torch.device("cpu"), device_memory_gb=80, world_size=8, local_world_size=8, max_seq_len=2048,
        dtype="bf16", activation_checkpointing=True, expert_parallel=8,
    )
    (line,) = plan.reasons
    assert line.startswith("micro_batch_size: auto -> 4 sequences per device (1 accumulation step(s)): zero3 x ep8")
