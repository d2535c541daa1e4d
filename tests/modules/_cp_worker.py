"""Worker for test_context_parallel.py, run under torchrun on 4 processes (gloo, CPU): one attention layer's forward
and backward over a row split across context-parallel ranks, against the same layer over the whole row on one
process, in float64.

Every rank builds the same layer and inputs (seeded) and computes the reference itself: SDPA (or the layer's
explicit soft-capped scores) over the whole rows. Then, in the 4 ranks as one CP group and as two groups of 2, it
computes the same with the row split (:meth:`ContextParallel.shard`), for each method and case (``ring`` with its
fused block kernel where one applies, and with its explicit kernel everywhere): outputs at its positions, the
gradient of its input positions and the layer's weight gradients (summed over the group: each rank holds its
positions' share). Rank zero writes the largest differences, per case, to ``sys.argv[1]`` (JSON).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from toolkit.data.packing import packed_attention_mask
from toolkit.modules import GroupedQueryAttention
from toolkit.modules.position_embeddings import RotaryPositionalEmbeddings
from toolkit.parallel.context_parallel import ContextParallel, local_positions

DIM, HEAD_DIM, SEQ, BATCH = 32, 8, 48, 2
# name: (heads, kv heads, packed documents, sliding window, soft-cap)
CASES = {
    "gqa": (4, 2, False, None, None),
    "mha": (4, 4, False, None, None),
    "one_kv_head": (4, 1, False, None, None),
    "packed": (4, 2, True, None, None),
    "window": (4, 2, False, 7, None),
    "packed_window_softcap": (4, 2, True, 5, 3.0),
}
# name: (method, the ring's fused kernel where one applies)
SPLITS = {"ring": ("ring", True), "ring_explicit": ("ring", False), "alltoall": ("alltoall", True)}


def layer(heads: int, kv_heads: int, window: int | None, softcap: float | None) -> GroupedQueryAttention:
    torch.manual_seed(0)
    return GroupedQueryAttention(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
        q_proj=nn.Linear(DIM, heads * HEAD_DIM), k_proj=nn.Linear(DIM, kv_heads * HEAD_DIM),
        v_proj=nn.Linear(DIM, kv_heads * HEAD_DIM), o_proj=nn.Linear(heads * HEAD_DIM, DIM, bias=False),
        pos_embeddings=RotaryPositionalEmbeddings(HEAD_DIM, max_seq_len=SEQ), sliding_window=window,
        logit_softcap=softcap,
    ).double()


def inputs(packed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    cotangent = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    if not packed:
        return x, None, cotangent
    # Documents of uneven lengths that cross the chunk boundaries (chunks of 6 and 12 positions).
    rows = []
    for lengths in ([5, 14, 1, 20, 8], [30, 11, 7]):
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return x, torch.stack(rows), cotangent


def run(attn: GroupedQueryAttention, x, input_pos, cotangent, *, mask=None):
    attn.zero_grad()
    x = x.detach().requires_grad_()
    out = attn(x, mask=mask, input_pos=input_pos)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in attn.named_parameters()}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {world: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}
    results = {}
    for name, (heads, kv_heads, packed, window, softcap) in CASES.items():
        attn = layer(heads, kv_heads, window, softcap)
        x, input_pos, cotangent = inputs(packed)
        whole = None if input_pos is None else packed_attention_mask(input_pos)
        ref_out, ref_dx, ref_grads = run(attn, x, input_pos, cotangent, mask=whole)
        for cp_size, (group, cp_rank) in groups.items():
            for split, (method, fused) in SPLITS.items():
                cp = ContextParallel(group, cp_size, cp_rank, method, fused)
                batch = {"tokens": torch.zeros(BATCH, SEQ, dtype=torch.long)}
                if input_pos is not None:
                    batch["input_pos"] = input_pos
                local, mask = cp.shard(batch, full_mask=lambda b: None if "input_pos" not in b else
                                       packed_attention_mask(b["input_pos"]))
                positions = local_positions(SEQ, cp=cp_size, rank=cp_rank)
                out, dx, grads = run(attn, x[:, positions], local["input_pos"], cotangent[:, positions], mask=mask)
                errors = [
                    (out - ref_out[:, positions]).abs().max(),
                    (dx - ref_dx[:, positions]).abs().max(),
                ]
                for key, grad in grads.items():
                    dist.all_reduce(grad, group=group)
                    errors.append((grad - ref_grads[key]).abs().max())
                error = torch.stack(errors).max()
                dist.all_reduce(error, op=dist.ReduceOp.MAX)
                scale = max(float(ref_out.abs().max()), float(ref_dx.abs().max()))
                results[f"{name}/cp{cp_size}/{split}"] = {"error": float(error), "scale": scale}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
