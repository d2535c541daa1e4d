"""Peak memory per rank and tokens per second of one long sequence, whole (cp=1) and split over 2 ranks (cp=2), on CPU.

    python benchmarks/context_parallel.py                       # 8192 tokens, ~2 min on 2 cores
    python benchmarks/context_parallel.py --seq_len 16384 --steps 1
    python benchmarks/context_parallel.py --device cuda --nproc 8 --seq_len 131072 --model toolkit.models.llama3.llama3_1_8b

Each layout is one job (``mp.spawn``, gloo, one thread per process) training the same tiny Llama (``--layers``,
``--dim``; 4 query and 2 key/value heads) on the same random row of ``--seq_len`` tokens through the recipes' path
(``parallelize``, ``forward_backward``, ``optimizer_step`` with AdamW): ``cp1`` on one process, ``ring`` and
``alltoall`` with the row split over ``--nproc`` ranks (2 by default), which are data-parallel (DDP) ranks that read
the same row. ``ring`` scores its blocks with PyTorch's fused attention kernel (the CPU flash kernel; on CUDA flash or
memory-efficient), ``ring_explicit`` with the ring's explicit matmul kernel (``ContextParallel(fused=False)``): the
two differ only there. The global batch is the same row in every layout, so the work is the same.

Memory: the high-water mark of the process above what it held right before the timed steps' first forward, after
one warmup step on a short row (host resident memory on CPU, ``max_memory_allocated`` on CUDA), the largest over the
ranks: what a long row's step adds (its activations, attention's buffers, the gradients). On CPU the workers run
with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set already), so that freed blocks leave resident memory at once and
the high-water mark is that of the live tensors, not of glibc's fragmentation. Tokens per second: the row's
tokens over the median step time. Ratios are to ``cp1`` measured in the same run. Not a test; it prints a table
(benchmarks/README.md keeps one).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from scaling import free_port, host_high_water_kib, print_markdown_table, reset_host_high_water  # noqa: E402 (the benchmarks folder is no package)

# layout: (processes, None for --nproc; context_parallel_method; the ring's fused kernel)
LAYOUTS = {"cp1": (1, None, True), "ring": (None, "ring", True), "ring_explicit": (None, "ring", False),
           "alltoall": (None, "alltoall", True)}


def _worker(rank: int, world_size: int, port: int, options: dict, layout: str, result_file: str) -> None:
    from toolkit.config import instantiate
    from toolkit.parallel import parallel_dims
    from toolkit.training import forward_backward, init_distributed, init_weights, optimizer_step, parallelize, set_seed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(options["threads"])
    env = init_distributed(device=options["device"])
    _, method, fused = LAYOUTS[layout]
    dims = parallel_dims(strategy="ddp", world_size=world_size, local_world_size=world_size,
                         device_type=env.device.type, rank=rank, context_parallel=world_size)
    context_parallel = None
    if method:
        context_parallel = dataclasses.replace(dims.context_parallel(env.device.type, method), fused=fused)
    set_seed(0)
    component = {"_component_": options["model"], "max_seq_len": options["seq_len"]}
    if options["model"] == "toolkit.models.llama3.llama3":
        component.update(vocab_size=256, num_layers=options["layers"], num_heads=4, num_kv_heads=2,
                         embed_dim=options["dim"], intermediate_dim=4 * options["dim"])
    with torch.device("meta"):
        model = instantiate(component)
    mesh = dims.build_mesh(env.device.type)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    model = parallelize(model, dims=dims, device=env.device, dtype=dtype, fill=init_weights, mesh=mesh,
                        activation_checkpointing=options["activation_checkpointing"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, 256, (1, options["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].to(env.device), "labels": tokens[:, 1:].to(env.device)}

    def step(rows: dict = batch) -> None:
        forward_backward(model, [rows], device=env.device, data_parallel_size=dims.dp_size,
                         context_parallel=context_parallel)
        optimizer_step(model, optimizer, max_grad_norm=1.0)

    # Warmup on a short row: DDP's buckets and AdamW's state are made in the first step, and what the allocator keeps
    # of a short step's activations is small, so the high-water mark below measures the long row's step.
    short = 16 * dims.cp
    step({key: value[:, :short] for key, value in batch.items()})
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    else:
        reset_host_high_water()
        held = host_high_water_kib() * 1024
    times = []
    for _ in range(options["steps"]):
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        step()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if env.device.type == "cuda" else host_high_water_kib() * 1024
    figures = torch.tensor([peak - held, statistics.median(times)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the busiest rank's memory, the slowest rank's time
    if rank == 0:
        Path(result_file).write_text(json.dumps({"label": dims.label, "peak_mib": float(figures[0]) / 2**20,
                                                 "tokens_per_s": options["seq_len"] / float(figures[1])}))
    if world_size > 1:
        dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as scaling.py: gloo's destructors can deadlock at interpreter teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one process per GPU")
    parser.add_argument("--nproc", type=int, default=2, help="ranks the split layouts split the row over")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout (memory: their high-water mark)")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--model", default="toolkit.models.llama3.llama3", help="a model builder's _component_")
    args = parser.parse_args()
    if args.device == "cpu":
        # glibc's malloc keeps freed blocks for reuse, so a process's resident high-water mark also counts what
        # fragmentation left behind: identical runs differed by up to 15%. Blocks of 64 KiB and more mapped and
        # unmapped whole make resident memory follow the live tensors (identical runs then agree to 1 MiB). The
        # workers read it at start-up, so it is set before they are spawned.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    load_before = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="tune_cp_bench_") as tmp:
        for layout in args.layouts:
            nproc = LAYOUTS[layout][0] or args.nproc
            result_file = Path(tmp) / f"{layout}.json"
            mp.spawn(_worker, args=(nproc, free_port(), vars(args), layout, str(result_file)), nprocs=nproc)
            results[layout] = json.loads(result_file.read_text())
    load_after = os.getloadavg()[0]
    print(
        f"\none row of {args.seq_len} tokens, a {args.layers}-layer Llama of width {args.dim} (4 heads, 2 key/value "
        f"heads), {'GPU, NCCL, bf16' if args.device == 'cuda' else 'CPU, gloo, fp32'}, {args.threads} thread(s) per "
        f"process, activation checkpointing {'on' if args.activation_checkpointing else 'off'}; median of "
        f"{args.steps} steps; 1-minute load average {load_before:.1f} before, {load_after:.1f} after\n"
    )
    base = results.get("cp1")
    header = ("layout", "peak MiB per rank", "vs cp1", "tokens/s", "vs cp1")
    table = [header]
    for layout, r in results.items():
        mem = f"{r['peak_mib'] / base['peak_mib']:.2f}x" if base else "-"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        name = "one process" if layout == "cp1" else f"{r['label']}, {layout.replace('_', ' ')}"
        table.append((name, f"{r['peak_mib']:.0f}", mem, f"{r['tokens_per_s']:.0f}", speed))
    print_markdown_table(table)


if __name__ == "__main__":
    main()
