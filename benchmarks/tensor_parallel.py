"""Bytes communicated and time per step of data-parallel and tensor-parallel layouts of one job, on CPU (gloo).

    python benchmarks/tensor_parallel.py                        # demo model, 4 processes, ~2 min
    python benchmarks/tensor_parallel.py --layouts ddp tp2 --steps 10 --micro_batch_size 4
    python benchmarks/tensor_parallel.py --model toolkit.models.llama3.llama3_demo --seq_len 128
    python benchmarks/tensor_parallel.py --device cuda --nproc 8 --model toolkit.models.llama3.llama3_2_1b

One job of ``--nproc`` processes (4 by default; gloo, one thread each) trains the same model on every layout, one
after the other, through the toolkit's own ``parallelize`` (the recipes' path: tensor parallelism, then FSDP2 or
DDP), ``forward_backward`` and ``optimizer_step`` with AdamW and the gradient norm clipped, on random tokens: every
data-parallel rank ``--micro_batch_size`` sequences of ``--seq_len`` tokens per step, so every layout trains the same
global batch (4 data-parallel ranks x micro batch under ddp; 2 x micro batch x 2 under tp2, whose pairs read
the same rows: each pair's micro-batch holds twice the sequences).

Bytes per step per rank are counted from every collective the step issues, as ``benchmarks/scaling.py`` counts
them (a ``TorchDispatchMode`` sees the ``c10d`` and functional collectives of DDP, FSDP2 and DTensor), each turned
into bytes sent by one rank with the ring costs for the size of ITS process group (a TP all-reduce spans the pair,
a ZeRO-3 all-gather the data-parallel ranks). Time per step: the median of the timed steps on rank 0, each step
ended by a barrier.

The layouts (``--layouts``): ``ddp``, ``zero3`` (4 data-parallel ranks), ``tp2``, ``tp4`` (tensor parallelism over
pairs or all 4; under ``tp2`` the two pairs are data-parallel, ddp semantics), ``tp2_sp`` (``tp2`` with sequence
parallelism), ``zero3_tp2`` (2 ZeRO-3 ranks of tensor-parallel pairs).

``--device cuda`` runs one process per GPU on NCCL (benchmarks/gpu/run_checks.py does so where a machine has
several GPUs). On a CPU machine with fewer cores than processes, every collective waits for a rank that lost its
core: the times say which layout communicates more often, not what a GPU node does. Not a test; it prints a table
(benchmarks/README.md keeps one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import collective_counter, end_worker, free_port, print_markdown_table  # noqa: E402 (the benchmarks folder is no package)

# name: (data_parallel, tensor_parallel, sequence_parallel)
LAYOUTS = {
    "ddp": ("ddp", 1, False), "zero3": ("zero3", 1, False), "tp2": ("ddp", 2, False), "tp2_sp": ("ddp", 2, True),
    "tp4": ("ddp", 4, False), "zero3_tp2": ("zero3", 2, False),
}


def _worker(rank: int, world_size: int, port: int, options: dict, result_file: str) -> None:
    from toolkit.config import instantiate
    from toolkit.parallel import parallel_dims
    from toolkit.training import forward_backward, init_distributed, init_weights, optimizer_step, parallelize, set_seed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    env = init_distributed(device=options["device"])
    results = {}
    for name in options["layouts"]:
        strategy, tp, sequence_parallel = LAYOUTS[name]
        dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size,
                             device_type=env.device.type, tensor_parallel=tp, rank=rank)
        set_seed(0)
        with torch.device("meta"):
            model = instantiate({"_component_": options["model"], "max_seq_len": options["seq_len"]})
        params = sum(p.numel() for p in model.parameters())
        mesh = dims.build_mesh(env.device.type)
        dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
        model = parallelize(model, dims=dims, device=env.device, dtype=dtype, fill=init_weights, mesh=mesh,
                            sequence_parallel=sequence_parallel)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        generator = torch.Generator().manual_seed(dims.dp_rank)  # a TP group's ranks read the same rows
        tokens = torch.randint(0, 256, (options["micro_batch_size"], options["seq_len"] + 1), generator=generator)
        batch = {"tokens": tokens[:, :-1].to(env.device), "labels": tokens[:, 1:].to(env.device)}
        group = dims.dp_group(mesh)  # the tokens are counted over the data-parallel ranks only

        def step() -> None:
            forward_backward(model, [batch], device=env.device, data_parallel_size=dims.dp_size,
                             data_parallel_group=group)
            optimizer_step(model, optimizer, max_grad_norm=1.0)

        step()  # warmup: DDP builds its buckets, FSDP2 its buffers
        counter = collective_counter(world_size=world_size, backend=env.backend, per_group=True)
        with counter:
            step()
        times = []
        for _ in range(options["steps"]):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[name] = {
            "label": dims.label + (" + sequence parallel" if sequence_parallel else ""), "params": params, "step_s": statistics.median(times),
            "bytes": dict(counter.bytes), "calls": dict(counter.calls),
        }
    end_worker(rank, results, result_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # (tp4 needs 4 key/value heads; the demo model has 2.)
    parser.add_argument("--layouts", nargs="+", default=["ddp", "zero3", "tp2", "tp2_sp", "zero3_tp2"], choices=LAYOUTS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one process per GPU")
    parser.add_argument("--nproc", type=int, default=4, help="processes (with --device cuda, at most the GPUs)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per layout (after one warmup step)")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="sequences per data-parallel rank per step")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--model", default="toolkit.models.llama3.llama3_demo", help="a model builder's _component_")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tune_tp_bench_") as tmp:
        result_file = Path(tmp) / "results.json"
        mp.spawn(_worker, args=(args.nproc, free_port(), vars(args), str(result_file)), nprocs=args.nproc)
        results = json.loads(result_file.read_text())
    load_after = os.getloadavg()[0]
    first = next(iter(results.values()))
    print(
        f"\n{args.nproc} processes on "
        + (f"{args.nproc} GPU(s), NCCL, bf16" if args.device == "cuda" else f"{os.cpu_count()} CPU core(s), gloo, fp32")
        + f", 1 thread each; {first['params'] / 1e6:.2f}M parameters;"
        f" {args.micro_batch_size} x {args.seq_len} tokens per data-parallel rank per step; median of "
        f"{args.steps} steps; 1-minute load average {load_before:.1f} before, {load_after:.1f} after\n"
    )
    header = ("layout", "MB sent/step/rank", "by kind (MB)", "collectives/step", "step time (ms)")
    table = [header]
    for name, r in results.items():
        total = sum(r["bytes"].values())
        kinds = ", ".join(f"{kind} {b / 1e6:.2f}" for kind, b in sorted(r["bytes"].items()))
        calls = ", ".join(f"{n} {kind}" for kind, n in sorted(r["calls"].items()))
        table.append((r["label"], f"{total / 1e6:.2f}", kinds, calls, f"{r['step_s'] * 1e3:.0f}"))
    print_markdown_table(table)


if __name__ == "__main__":
    main()
