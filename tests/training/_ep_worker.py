"""Worker for test_expert_parallel.py, run under torchrun on 4 processes (gloo, CPU): a tiny mixture-of-experts
decoder (8 experts, top-2, 2 layers, the load-balancing loss on), full fine-tune and LoRA on attention and every
expert, trained on each expert-parallel layout of the 4 ranks in turn:

- ``zero3_ep2``: 4 ZeRO-3 ranks in 2 expert-parallel pairs (each pair shares out the 8 experts; the experts are
  then ZeRO-3-sharded over the 2 ranks holding the same ones);
- ``zero3_ep4``: the 4 ranks share out the experts (2 each), nothing left to shard them over;
- ``zero2_ep2``: as ``zero3_ep2``, parameters kept gathered from forward to backward;
- ``zero3_ep2_ac``: ``zero3_ep2`` with activation checkpointing (the exchange runs again in the recomputation).

Every run trains 4 steps of a global batch of 8 rows of different lengths (prompts and padding ignored; the
batch carries each row's length, so the routers' load statistics skip the padding), with AdamW and the gradient
norm clipped, then a fifth under routing replay (online RL's MoE option): each rank records its rows' routing in a
forward without grad and replays it with every expert shifted by one, so that no token goes where its router sends
it; the exchange, and the recomputation under activation checkpointing, must carry the replayed experts. Rank zero saves, per case and layout, the losses, the routing metrics, the gradient norms and the
final weights (gathered whole) to ``sys.argv[1]``; the test trains the one-process references itself (:func:`train`).
Each layout without activation checkpointing also measures, in its first step, what every rank holds
(:class:`tests.training._ep_memory.Meter`, for test_memory_ep.py); rank zero saves that too, one entry per rank.
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.training._ep_memory import Meter
from tests.training._tp_worker import full
from toolkit.models._decoder import attention_projections, grouped_experts, plain_linear, prenorm_decoder
from toolkit.models._lora import lora_linear
from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings
from toolkit.modules._dtensor import copy_full_
from toolkit.modules.moe import MoEFeedForward, RoutingRecord, TopKRouter, record_routing, replay_routing
from toolkit.modules.peft import get_adapter_params, init_adapters, set_trainable_params
from toolkit.parallel import ParallelDims, parallel_dims
from toolkit.training import forward_backward, init_weights, optimizer_step, parallelize

STEPS, BATCH, VOCAB, DIM, EXPERTS = 4, 8, 64, 32, 8
LAYOUTS = {  # name: (data_parallel, expert_parallel, activation_checkpointing)
    "zero3_ep2": ("zero3", 2, False), "zero3_ep4": ("zero3", 4, False), "zero2_ep2": ("zero2", 2, False),
    "zero3_ep2_ac": ("zero3", 2, True),
}
RUNS = [("full", "zero3_ep2"), ("full", "zero3_ep4"), ("full", "zero2_ep2"), ("lora", "zero3_ep2"),
        ("lora", "zero3_ep4"), ("full", "zero3_ep2_ac")]


def build(mode: str) -> nn.Module:
    """The tiny MoE decoder on the meta device (with LoRA on q/v and every expert in ``lora`` mode)."""
    linear = plain_linear
    if mode == "lora":
        linear = lora_linear(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_experts=True, lora_rank=4)
    with torch.device("meta"):
        rope = RotaryPositionalEmbeddings(8, max_seq_len=32)
        model = prenorm_decoder(
            vocab_size=VOCAB, embed_dim=DIM, num_layers=2, max_seq_len=32, norm_eps=1e-6,
            attention=lambda: GroupedQueryAttention(
                num_heads=4, num_kv_heads=2, head_dim=8, pos_embeddings=rope,
                **attention_projections(linear, embed_dim=DIM, num_heads=4, num_kv_heads=2, head_dim=8),
            ),
            mlp=lambda: MoEFeedForward(
                gate=TopKRouter(DIM, EXPERTS, 2, norm_topk_prob=True),
                experts=grouped_experts(linear, num_experts=EXPERTS, dim=DIM, hidden_dim=16),
            ),
            output=lambda: linear("output", DIM, VOCAB),
        )
    model.router_aux_loss_coef = 0.1
    if mode == "lora":
        set_trainable_params(model, get_adapter_params(model))
    return model


def fill(model: nn.Module) -> None:
    torch.manual_seed(0)
    init_weights(model)  # every layout draws the whole tensors and keeps its part: the same values
    init_adapters(model)
    with torch.no_grad():
        for name, param in model.named_parameters():  # B away from zero, so that A's gradients are not zero either
            if name.endswith("lora_b.weight"):
                copy_full_(param, torch.empty(param.shape).normal_(0.0, 0.05))


def global_batch(step: int) -> list[dict[str, torch.Tensor]]:
    """The step's rows, each its own micro-batch with its length (5 to 20 tokens, the first 2 a prompt)."""
    generator = torch.Generator().manual_seed(step)
    rows = []
    for _ in range(BATCH):
        length = int(torch.randint(5, 21, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[:2] = -100
        rows.append({"tokens": tokens[None, :-1], "labels": labels[None], "lengths": torch.tensor([length])})
    return rows


def train(mode: str, dims: ParallelDims, mesh=None, *, activation_checkpointing: bool = False) -> dict:
    """Train the case on the layout ``dims``: losses, routing metrics, gradient norms, whole final weights and what
    this rank held in the first step (without activation checkpointing, whose own saved-tensor hooks would hide the
    layers' from the meter)."""
    model = parallelize(build(mode), dims=dims, device=torch.device("cpu"), dtype=torch.float32, fill=fill, mesh=mesh,
                        activation_checkpointing=activation_checkpointing)
    # lr and eps as test_tensor_parallel.py has them: AdamW divides by sqrt(v), which turns rounding-level gradient
    # differences on entries with near-zero gradients into larger update differences (the gradients agree).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    losses, routing, norms, meter = [], [], [], Meter(model)
    for step in range(STEPS):
        share = BATCH // dims.dp_size
        mine = global_batch(step)[dims.dp_rank * share : (dims.dp_rank + 1) * share]
        measure = step == 0 and not activation_checkpointing
        with meter.watch() if measure else contextlib.nullcontext():
            result = forward_backward(model, mine, device=torch.device("cpu"), data_parallel_size=dims.dp_size)
        if measure:
            meter.grads()
        norms.append(optimizer_step(model, optimizer, max_grad_norm=1.0))
        if measure:
            meter.state(optimizer)
        losses.append(result.loss)
        routing.append(result.metrics)
    mine = global_batch(STEPS)[dims.dp_rank * share : (dims.dp_rank + 1) * share]
    result, replayed = replayed_step(model, mine, dims)
    norms.append(optimizer_step(model, optimizer, max_grad_norm=1.0))
    losses.append(result.loss)
    routing.append(result.metrics)
    return {"losses": losses, "routing": routing, "norms": norms, "memory": meter.numbers, "replayed": replayed,
            "weights": {k: full(v) for k, v in model.state_dict().items()}}


def replayed_step(model: nn.Module, mine: list[dict[str, torch.Tensor]], dims: ParallelDims) -> tuple:
    """The step's forward and backward under a replay of its rows' routing with every expert shifted by one, and
    whether every forward of the first MoE layer, on every rank, used the replayed experts."""
    with torch.no_grad(), record_routing(model) as chosen:
        for row in mine:
            model(row["tokens"])
    shifted = RoutingRecord({path: [(experts + 1) % EXPERTS for experts in chosen.forwards(path)]
                             for path in chosen.paths()})
    first = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    used = []  # its forwards' experts, the recomputations' too
    hook = first.register_forward_hook(lambda block, args, out: used.append(block.routing.experts.flatten(0, 1)))
    with replay_routing(model, shifted):
        result = forward_backward(model, mine, device=torch.device("cpu"), data_parallel_size=dims.dp_size)
    hook.remove()
    expected = shifted.forwards(shifted.paths()[0])
    replayed = torch.tensor(int(len(used) >= len(mine) and all(
        any(torch.equal(experts, replay) for replay in expected) for experts in used
    )))
    if dist.is_initialized():
        dist.all_reduce(replayed, op=dist.ReduceOp.MIN)
    return result, bool(replayed)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for mode, layout in RUNS:
        strategy, ep, activation_checkpointing = LAYOUTS[layout]
        dims = parallel_dims(strategy=strategy, world_size=world, local_world_size=world, device_type="cpu",
                             rank=rank, expert_parallel=ep)
        result = train(mode, dims, dims.build_mesh("cpu"), activation_checkpointing=activation_checkpointing)
        memory = [None] * world
        dist.all_gather_object(memory, result["memory"])
        if rank == 0:
            results[f"{mode}/{layout}"] = {**result, "memory": memory}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
