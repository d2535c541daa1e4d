"""The memory plan under tensor parallelism: per-rank parameter, gradient and optimizer bytes against a real
``apply_tp`` model on pairs of processes (:mod:`tests.training._tp_memory`, measured in the 4-process launch the
training tests share: conftest.py's ``four_processes``), the activation and logits scaling rules, and
``tensor_parallel: auto``'s choice."""

from __future__ import annotations


import pytest
import torch

from tests.training import _tp_memory as memory
from tests.training._tp_worker import build
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3, llama3_1_8b, llama3_1_70b
from toolkit.planning.activation_memory import activation_bytes, logits_bytes
from toolkit.planning.memory import estimate_memory
from toolkit.planning.layout import candidate_layouts, plan_parallelism, tensor_parallel_degrees
from toolkit.parallel.tp_shapes import tensor_parallel_local_parameters

GIB = 1024**3


@pytest.fixture(scope="module")
def measured(four_processes) -> dict:
    return torch.load(four_processes / "memory.pt", weights_only=True)


def test_the_recipe_picks_tp2_where_only_the_split_fits_and_says_why(four_processes) -> None:
    stdout = (four_processes / "auto.stdout").read_text()  # the run of memory.AUTO_RECIPE on 4 processes
    (line,) = [line for line in stdout.splitlines() if "tensor_parallel: auto ->" in line]
    assert line.startswith("data_parallel, tensor_parallel: auto -> ddp, tensor_parallel 2 (ddp x tp2 needs ")
    assert "without tensor parallelism the smallest, zero3, would need" in line
    assert "ddp x tensor_parallel 2" in stdout  # the run's summary line: the layout it built
    assert (four_processes / "auto" / "final").is_dir()


@pytest.mark.parametrize(("name", "mode"), memory.CASES, ids=lambda v: str(v))
def test_state_bytes_equal_the_local_shards_of_a_real_tp_model(measured, name: str, mode: str) -> None:
    # Exact: the plan's parameters, gradients and AdamW state (fp32, no data parallelism) are the bytes of the
    # shards apply_tp leaves on each rank, for every rank (the ranks of a pair hold the same sizes here).
    model = build(name, mode, models=memory.MODELS)
    estimate = estimate_memory(
        model, strategy="ddp", world_size=1, micro_batch_size=memory.BATCH, max_seq_len=memory.SEQ, dtype="fp32",
        tensor_parallel=2,
    )
    for rank in measured[f"{name} {mode}"]:
        assert (estimate.params, estimate.grads, estimate.optimizer_state) == (
            rank["params"], rank["grads"], rank["optimizer_state"]
        )
    whole = estimate_memory(model, strategy="ddp", world_size=1, micro_batch_size=memory.BATCH,
                            max_seq_len=memory.SEQ, dtype="fp32")
    assert estimate.params < whole.params  # the premise: something was split


# The layers' saved tensors on a TP rank against the formula with tensor_parallel=2: the Llama-style layers are
# counted exactly as without TP (see test_memory.py), within 0.1%; Gemma 2's explicit soft-capped attention also
# saves masks the formula leaves out, within 5% as without TP.
ACTIVATION_TOLERANCE = {"llama": 1e-3, "qwen": 1e-3, "gemma": 0.05}


@pytest.mark.parametrize(("name", "mode"), [c for c in memory.CASES if c[1] == "full"], ids=lambda v: str(v))
def test_layer_activations_match_a_real_tp_model(measured, name: str, mode: str) -> None:
    model = build(name, mode, models=memory.MODELS)
    tokens = memory.BATCH * memory.SEQ
    args = dict(micro_batch_size=memory.BATCH, seq_len=memory.SEQ, dtype="fp32")
    # The model's own terms (token ids, final norm, the hidden states before the head) are whole on every rank.
    head = activation_bytes(model, **args) - _layers_only(model, tensor_parallel=1, tokens=tokens)
    expected = activation_bytes(model, tensor_parallel=2, **args) - head
    for rank in measured[f"{name} {mode}"]:
        assert expected == pytest.approx(rank["layer_activations"], rel=ACTIVATION_TOLERANCE[name])


def _layers_only(model, *, tensor_parallel: int, tokens: int) -> int:
    from toolkit.planning.activation_memory import _layer_activation_bytes_per_token

    d = model.embed_tokens.embedding_dim
    return tokens * sum(
        _layer_activation_bytes_per_token(layer, embed_dim=d, seq_len=memory.SEQ, compute=4, autocast=False,
                                          tensor_parallel=tensor_parallel)
        for layer in model.layers
    )


def _meta(builder, **kwargs):
    with torch.device("meta"):
        return builder(**kwargs)


def test_activation_scaling_rules_on_the_formula() -> None:
    # Exact, on the formula: per layer and token, the split terms (heads, MLP width) halve and the replicated ones
    # (norms, projection inputs, c*d each) stay. A Llama layer of width d, n_h heads of h_d, n_kv, f, fp32 (c=4):
    # 2 norms x (4d + 4d + 4) + 2 x 4d + 4 x (2 n_h h_d + 2 n_kv h_d) + 4 n_h + 4 x 4f.
    model = _meta(llama3, vocab_size=96, num_layers=1, num_heads=8, num_kv_heads=4, embed_dim=64,
                  intermediate_dim=128, max_seq_len=32)
    d, n_h, n_kv, h_d, f = 64, 8, 4, 8, 128

    def layer(t: int) -> int:
        return 2 * (8 * d + 4) + 8 * d + 4 * (2 * n_h // t * h_d + 2 * n_kv // t * h_d) + 4 * n_h // t + 16 * f // t

    head = 8 + (8 * d + 4) + 4 * d
    for t in (1, 2, 4):
        assert activation_bytes(model, micro_batch_size=1, seq_len=1, dtype="fp32", tensor_parallel=t) == (
            layer(t) + head
        )
    # Logits under the fused vocabulary-parallel loss: one chunk of [tokens, vocab / t], the hidden gradient whole.
    for t in (1, 2, 4):
        fused = logits_bytes(model, micro_batch_size=2, seq_len=16, dtype="fp32", fused=True, loss_chunks=4,
                             tensor_parallel=t)
        assert fused == 8 * (96 // t) * (4 + 4) + 32 * 64 * 4


def test_8b_state_splits_by_the_tp_degree_then_by_the_strategy() -> None:
    # Llama 3.1 8B: with no bias and no replicated matrix, everything but the norms and rotary buffers divides.
    model = _meta(llama3_1_8b, max_seq_len=4096)
    n = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    local = tensor_parallel_local_parameters(model, tp=4)
    assert sum(t.numel() for t in local.values()) == (n - norms) // 4 + norms
    args = dict(micro_batch_size=1, max_seq_len=4096, dtype="bf16-mixed", activation_checkpointing=True)
    tp4 = estimate_memory(model, strategy="zero3", world_size=2, tensor_parallel=4, **args)
    dp8 = estimate_memory(model, strategy="zero3", world_size=8, **args)
    # zero3 over 2 data-parallel ranks of a 4-way split: the same eighth of the state as zero3 over 8.
    assert tp4.optimizer_state == pytest.approx(dp8.optimizer_state, rel=1e-3)
    assert tp4.activations < dp8.activations and tp4.gathered < dp8.gathered
    assert tp4.label == "zero3 x tp4" and tp4.tensor_parallel == 4


def test_tensor_parallel_degrees_divide_the_model_and_the_node() -> None:
    model = _meta(llama3_1_8b, max_seq_len=4096)  # 32 heads, 8 KV heads, 14336 MLP, 128256 vocabulary
    assert tensor_parallel_degrees(model, processes_per_node=8) == [1, 2, 4, 8]
    assert tensor_parallel_degrees(model, processes_per_node=6) == [1, 2]
    small = _meta(llama3, vocab_size=96, num_layers=1, num_heads=8, num_kv_heads=2, embed_dim=64,
                  intermediate_dim=128, max_seq_len=32)
    assert tensor_parallel_degrees(small, processes_per_node=8) == [1, 2]  # 2 key/value heads
    # Layouts: no TP first, then TP within the node, smallest degree first; offloading last (PCIe, a CPU step).
    layouts = candidate_layouts(world_size=8, num_nodes=1, degrees=[1, 2, 4])
    assert layouts[:4] == [("ddp", False, 1), ("zero1", False, 1), ("zero2", False, 1), ("zero3", False, 1)]
    assert layouts[4:10] == [("ddp", False, 2), ("zero2", False, 2), ("zero3", False, 2),
                             ("ddp", False, 4), ("zero2", False, 4), ("zero3", False, 4)]
    assert all(offload and tp == 1 for _, offload, tp in layouts[10:]) and layouts[10:]


def _auto(memory_gb: float, **overrides):
    model = _meta(llama3_1_70b, max_seq_len=4096)
    args = dict(
        model=model, strategy="auto", cpu_offload=False, batch_size=16, micro_batch_size=1,
        device=torch.device("cpu"), device_memory_gb=memory_gb, world_size=8, local_world_size=8, max_seq_len=4096,
        dtype="bf16", activation_checkpointing=True, tensor_parallel="auto",
    )
    return plan_parallelism(**{**args, **overrides})


def test_tensor_parallel_auto_prefers_no_tp_when_it_fits() -> None:
    plan = _auto(1000)
    assert (plan.dims.strategy, plan.dims.tp) == ("ddp", 1)
    (reason,) = plan.reasons
    assert reason.startswith("data_parallel, tensor_parallel: auto -> ddp, tensor_parallel 1 (ddp needs ")


def test_tensor_parallel_auto_splits_when_only_that_fits() -> None:
    # 70B in bf16 on 8 GPUs: under zero3 every rank still gathers the whole root (embedding and output, 2 GiB in
    # bf16) and two whole layers, and holds every layer's activations; tp=2 halves those. Given just the memory
    # zero3 x tp2 needs, nothing without TP fits.
    model = _meta(llama3_1_70b, max_seq_len=4096)
    args = dict(micro_batch_size=1, max_seq_len=4096, dtype="bf16", activation_checkpointing=True)
    tp1 = estimate_memory(model, strategy="zero3", world_size=8, **args)
    tp2 = estimate_memory(model, strategy="zero3", world_size=4, tensor_parallel=2, **args)
    assert tp2.total < tp1.total  # the premise
    memory_gb = (tp2.total / 0.9 + 2**20) / GIB
    plan = _auto(memory_gb, batch_size=8)
    assert plan.dims.tp == 2 and plan.dims.strategy in ("ddp", "zero2", "zero3")
    (reason,) = plan.reasons
    assert "x tp2 needs" in reason and "without tensor parallelism" in reason
    # Given the strategy, only the degree is chosen.
    given = _auto(memory_gb, batch_size=8, strategy="zero3")
    assert (given.dims.strategy, given.dims.tp) == ("zero3", 2)
    assert given.reasons[0].startswith("tensor_parallel: auto -> 2 (zero3 x tp2 needs")


def test_tensor_parallel_auto_refuses_when_nothing_fits() -> None:
    with pytest.raises(UserError) as error:
        _auto(4)
    message = str(error.value)
    assert message.startswith("tensor_parallel: auto: no layout of 8 process(es) fits") and "\n" not in message
    assert "x tp8" in message  # the smallest, named with its numbers


def test_tensor_parallel_auto_never_crosses_nodes_and_keeps_to_what_combines() -> None:
    # 2 nodes x 2 processes: degrees within a node only (1, 2), never 4.
    with pytest.raises(UserError, match=r"x tp2"):
        _auto(4, world_size=4, local_world_size=2, batch_size=4)
    # zero1 cannot combine with TP: only tp=1 is tried.
    plan = _auto(1000, strategy="zero1")
    assert plan.dims.tp == 1


def test_a_given_tensor_parallel_plans_its_data_parallel_ranks() -> None:
    plan = _auto(1000, tensor_parallel=2, micro_batch_size="auto")
    # 16 sequences over 4 data-parallel ranks: 4 each.
    assert plan.dims.tp == 2 and plan.micro_batch_size * plan.accumulation_steps == 4
