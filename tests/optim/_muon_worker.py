"""Worker for test_muon.py, run under torchrun on 2 processes (gloo): the same parameters and gradients on every
rank, stepped by toolkit.optim.Muon (float32 iteration) whole under DDP's shared orthogonalization and as FSDP2's
row shards; each rank saves the weights after 3 steps and what it orthogonalized to ``<out>/rank_<r>.pt``.
:func:`expected` is the same steps on one process."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from toolkit.training import Muon

# Uneven rows (5 and 7 over 2 ranks), a wide and a tall matrix, a stack of 3 experts, and a bias for AdamW.
SHAPES = {"a.weight": (5, 8), "b.weight": (7, 4), "c.weight": (6, 10), "d.weight": (16, 6), "e.weight": (3, 3),
          "experts.up_proj": (3, 6, 4), "f.weight": (9, 9), "a.bias": (5,)}
STEPS = 3
HYPER = dict(lr=0.02, momentum=0.9, ns_dtype="float32")


def parameters() -> dict[str, nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return {name: nn.Parameter(torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()}


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def expected() -> dict[str, torch.Tensor]:
    params = parameters()
    optimizer = Muon(list(params.items()), **HYPER)
    for step in range(STEPS):
        for name, grad in gradients(step).items():
            params[name].grad = grad
        optimizer.step()
    return {name: p.detach() for name, p in params.items()}


def ddp() -> tuple[dict[str, torch.Tensor], Muon]:
    params = parameters()
    optimizer = Muon(list(params.items()), **HYPER).share_orthogonalization()
    for step in range(STEPS):
        for name, grad in gradients(step).items():
            params[name].grad = grad
        optimizer.step()
    return {name: p.detach() for name, p in params.items()}, optimizer


def fsdp() -> tuple[dict[str, torch.Tensor], Muon]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = {name: nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for name, p in parameters().items()}
    optimizer = Muon(list(params.items()), **HYPER)
    for step in range(STEPS):
        for name, grad in gradients(step).items():
            params[name].grad = distribute_tensor(grad, mesh, [Shard(0)])
        optimizer.step()
    return {name: p.detach().full_tensor() for name, p in params.items()}, optimizer


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    whole, shared = ddp()
    rows, sharded = fsdp()
    torch.save({"ddp": whole, "fsdp": rows, "ddp_orthogonalized": shared.stats.orthogonalized,
                "ddp_bytes_sent": shared.stats.bytes_sent, "fsdp_orthogonalized": sharded.stats.orthogonalized},
               Path(sys.argv[1]) / f"rank_{dist.get_rank()}.pt")
    dist.destroy_process_group()
