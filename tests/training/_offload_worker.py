"""Worker for test_activations.py, run under torchrun on 2 processes: one training step of a seeded tiny Llama under
DDP and FSDP2 (ZeRO-3), with and without activation checkpointing, each with activation offloading (the CPU
target: a copy into separate host tensors) and without. Rank zero writes, per case and rank, whether the loss and
the full gradients are identical, and the bytes brought back."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.checkpoint._export_worker import DIMS, tiny_model
from toolkit.parallel import apply_data_parallel, parallel_dims
from toolkit.training import ActivationOffloader, apply_activation_checkpointing
from toolkit.modules.loss import cross_entropy_sum

CPU = torch.device("cpu")


def train_step(strategy: str, *, checkpointing: bool, offloading: bool) -> tuple[torch.Tensor, list, int]:
    model = tiny_model()
    if checkpointing:
        apply_activation_checkpointing(model)
    offloader = ActivationOffloader(device=CPU, min_bytes=0) if offloading else None
    if offloader is not None:
        offloader.apply(model)
    world_size = dist.get_world_size()
    dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size, device_type="cpu")
    model = apply_data_parallel(model, dims=dims, device=CPU)
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
    tokens = torch.randint(0, DIMS["vocab_size"], (2, 16), generator=generator)
    loss = cross_entropy_sum(model(tokens), tokens)
    loss.backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    return loss.detach(), grads, offloader.bytes_restored if offloader is not None else 0


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    results = {}
    for strategy in ("ddp", "zero3"):
        for checkpointing in (False, True):
            loss, grads, _ = train_step(strategy, checkpointing=checkpointing, offloading=False)
            offloaded_loss, offloaded_grads, restored = train_step(strategy, checkpointing=checkpointing, offloading=True)
            result = {
                "same_loss": torch.equal(loss, offloaded_loss),
                "same_grads": all(torch.equal(a, b) for a, b in zip(grads, offloaded_grads, strict=True)),
                "bytes_restored": restored,
            }
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            results[strategy + ("+ac" if checkpointing else "")] = gathered
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown, as the recipes' torchrun workers do: torch 2.13's gloo destructors can abort there.
    sys.stdout.flush()
    os._exit(0)
