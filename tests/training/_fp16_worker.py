"""Worker for test_fp16.py, run under torchrun: the demo Llama in fp16-mixed under DDP, a few steps from a loss scale
high enough that the first steps overflow and are skipped. Rank zero writes, per step, the loss, whether the step
was skipped, and the sum of the weights, as JSON to ``sys.argv[1]``.

Every process trains its share of the same global batches (8 sequences, in micro-batches of 2: 4 per step on 1
process, 2 on each of 2), so the runs differ only in the world size."""

import json
import sys

import torch
import torch.distributed as dist

from toolkit.models.llama3 import llama3_demo
from toolkit.parallel import parallel_dims
from toolkit.training import (
    forward_backward,
    init_distributed,
    init_weights,
    optimizer_step,
    parallelize,
    precision_policy,
    set_seed,
)
from toolkit.training.step import make_grad_scaler

STEPS, BATCH, SEQ = 5, 8, 32
INIT_SCALE = 2.0**22  # overflows the demo's first steps; the default 2**16 would not, this soon


def main(out: str) -> None:
    env = init_distributed(device="cpu")
    ws = env.world_size
    precision = precision_policy("fp16-mixed", device=env.device)
    dims = parallel_dims(strategy="ddp", world_size=ws, local_world_size=ws, device_type="cpu")
    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=SEQ)
    model = parallelize(
        model, dims=dims, device=env.device, dtype=precision.param_dtype, fill=init_weights,
        mp_policy=precision.fsdp_policy(),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_grad_scaler(
        enabled=True, device=env.device, sharded=False, data_parallel_size=ws, init_scale=INIT_SCALE
    )
    autocast = precision.autocast(env.device, sharded=False)
    generator = torch.Generator().manual_seed(1)
    records = []
    share = BATCH // ws
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[:, : step + 3] = -100  # unequal token counts per step
        first = env.rank * share  # this process's rows, in micro-batches of 2
        micro = [{"tokens": tokens[i : i + 2, :-1], "labels": labels[i : i + 2]} for i in range(first, first + share, 2)]
        result = forward_backward(
            model, micro, device=env.device, data_parallel_size=ws, autocast=autocast, grad_scaler=scaler
        )
        scale = scaler.get_scale()
        optimizer_step(model, optimizer, max_grad_norm=1.0, grad_scaler=scaler)
        weights = sum(float(p.detach().double().sum()) for p in model.parameters())
        records.append({"loss": result.loss, "skipped": scaler.get_scale() < scale, "weights": weights})
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1])
    # Only now, with the DDP model freed at main's return: destroying the group while its reducer still held it let
    # the group's destructor run at exit, joining a gloo thread that waited for the GIL (a rare hang).
    if dist.is_initialized():
        dist.destroy_process_group()
