"""Worker for test_cpu_offload.py, run under torchrun on 2 processes: the demo Llama under ZeRO-3 with and without
FSDP2's CPU offload (on a CPU mesh, whose offload keeps the shards where they are), each trained 3 steps from the
same initialization. Rank zero writes, per layout, what ``fill`` was handed (sharded parameters or whole ones), the
losses and the final weights' sum, as JSON to ``sys.argv[1]``.

With ``cuda`` as ``sys.argv[2]`` (one process, one GPU, NCCL): FSDP2 on a mesh of that one rank, with and without
offload, materialized as ``parallelize`` does it under offload (parameters in host memory, buffers on the GPU):
there the shards and their gradients really are in host memory while NCCL takes only GPU tensors, which is what
the gradient norm and the gathered state must cope with."""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from toolkit.models.llama3 import llama3_demo
from toolkit.modules._dtensor import full_tensor
from toolkit.parallel import parallel_dims
from toolkit.parallel.data_parallel import apply_fsdp
from toolkit.training import (
    forward_backward,
    init_distributed,
    init_weights,
    materialize,
    optimizer_step,
    parallelize,
    set_seed,
)

STEPS, BATCH, SEQ = 3, 4, 32


def train(env, *, cpu_offload: bool) -> dict:
    dims = parallel_dims(strategy="zero3", world_size=env.world_size, local_world_size=env.world_size,
                         device_type="cpu")
    # parallel_dims refuses cpu_offload on a CPU (training already runs there); the FSDP2 path is the GPU's.
    dims = dataclasses.replace(dims, cpu_offload=cpu_offload)
    filled = []

    def fill(model: torch.nn.Module) -> None:
        filled.extend((isinstance(p, DTensor), p.to_local().numel() if isinstance(p, DTensor)
                       else p.numel(), p.numel()) for p in model.parameters())
        init_weights(model)

    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=SEQ)
    model = parallelize(model, dims=dims, device=env.device, dtype=torch.float32, fill=fill)
    return {
        "sharded_when_filled": all(sharded for sharded, _, _ in filled),
        "filled_elements": sum(local for _, local, _ in filled),
        "model_elements": sum(whole for _, _, whole in filled),
        **train_steps(model, env, max_grad_norm=1.0),
    }


def train_on_one_gpu(env, *, cpu_offload: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=SEQ)
    model = apply_fsdp(model, mesh=mesh, reshard_after_forward=True, cpu_offload=cpu_offload)
    materialize(model, device=torch.device("cpu") if cpu_offload else env.device, buffer_device=env.device)
    init_weights(model)  # drawn on the GPU either way (init_full_): the same values with and without offload
    where = {p.to_local().device.type for p in model.parameters()}
    return {"parameters_on": sorted(where), "buffers_on": sorted({b.device.type for b in model.buffers()}),
            **train_steps(model, env, max_grad_norm=0.5)}  # clipped: the norm is all-reduced


def train_steps(model: torch.nn.Module, env, *, max_grad_norm: float) -> dict:
    """STEPS AdamW steps of this rank's share of the same global batches; the losses, the gradient norms and the sum
    of the final weights (gathered whole)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    share = BATCH // env.world_size
    rows = slice(env.rank * share, (env.rank + 1) * share)
    losses, norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator)
        micro = [{"tokens": tokens[rows, :-1], "labels": tokens[rows, 1:]}]
        result = forward_backward(model, micro, device=env.device, data_parallel_size=env.world_size)
        norms.append(optimizer_step(model, optimizer, max_grad_norm=max_grad_norm))
        losses.append(result.loss)
    weights = sum(float(full_tensor(p.detach()).double().sum()) for p in model.parameters())
    return {"losses": losses, "norms": norms, "weights": weights}


def main(out: str, device: str = "cpu") -> None:
    env = init_distributed(device=device)
    run = train_on_one_gpu if device == "cuda" else train
    records = {str(offload): run(env, cpu_offload=offload) for offload in (False, True)}
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
