"""Weak-scaling efficiency of each data-parallel strategy on CPU, and the bytes each communicates per step.

    python benchmarks/scaling.py                                   # demo model, ddp zero1 zero2 zero3, ~3 min
    python benchmarks/scaling.py --steps 100 --micro_batch_size 32 --strategies ddp zero3
    python benchmarks/scaling.py --model toolkit.models.llama3.llama3_demo --override max_seq_len=128
    python benchmarks/scaling.py --recipe lora_finetune --strategies ddp  # LoRA: adapters' bytes vs full fine-tuning

Weak scaling: every process gets the same ``micro_batch_size``, so 2 processes do twice the work of 1 per optimizer
step (no accumulation). Each process runs one thread (``OMP_NUM_THREADS=1``): on a 2-core machine, 1 process x 1
thread against 2 processes x 1 thread is the fair comparison. For each strategy the 1-process run and the
2-process run are launched back to back through ``tune run ... full_finetune_distributed`` (the real recipe, the
real launcher), and timed from their ``metrics.jsonl``: the median ``step_time_s`` over the steps after a warmup.

    efficiency = (throughput_2p / throughput_1p) / 2 = step_time_1p / step_time_2p

(throughput in sequences per second; the 2-process step holds twice the sequences). Linear scaling is 1.0.

Two more rows separate the two reasons a 2-process step is slower than a 1-process one:

* ``2 x 1p, no comm``: two independent 1-process runs at the same time. They communicate nothing, so their slowdown
  is what sharing the machine costs (memory bandwidth, caches, the other engineers' load): a ceiling for every
  strategy's efficiency here.
* below the table, one all-reduce of every gradient, timed alone on 2 ranks: DDP's communication per step.

Bytes per step per rank are *measured*: a short 2-rank gloo job (spawned here, not through the recipe) applies the
toolkit's own ``apply_data_parallel``/``shard_optimizer_state`` to the same model and runs ``forward_backward`` and
``optimizer_step``, with a ``TorchDispatchMode`` that sees every ``c10d`` and functional collective (DDP's C++
reducer and FSDP2's all-gathers and reduce-scatters included, since ProcessGroup calls go through the dispatcher).
A collective's payload is turned into bytes sent per rank with the ring-algorithm costs: all-reduce
2(W-1)/W x S, all-gather and reduce-scatter (W-1)/W x S of the full tensor, broadcast (W-1)/W x S on average.
The ``formula`` column is the textbook estimate from the parameter bytes P for comparison (ddp: an all-reduce of
the gradients; zero1: that plus a broadcast of the updated parameters; zero2: a reduce-scatter of the gradients and
one all-gather of the parameters; zero3: two all-gathers and a reduce-scatter). The recipe's per-rank statistics
(an all-gather of three numbers every ``log_every_n_steps``) are not counted.

Numbers depend on the machine and its load; not a test, it prints a table (benchmarks/README.md keeps one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


# --- Timing through the recipe ----------------------------------------------------------------------------------


def recipe_args(args: argparse.Namespace, *, nproc: int) -> list[str]:
    """Config overrides for a weak-scaling run with ``nproc`` processes."""
    # Enough samples that no run wraps into a second epoch (a new permutation costs a little time).
    num_samples = (args.steps + 1) * 2 * args.micro_batch_size
    overrides = [
        f"batch_size={nproc * args.micro_batch_size}", f"micro_batch_size={args.micro_batch_size}",
        f"max_steps={args.steps}", f"dataset.num_samples={num_samples}", "progress_bar=false", "~eval_tasks",
        # The per-rank statistics gather is a collective the 1-process run does not pay; keep it out of the timed
        # steps (it runs at the last step only).
        f"log_every_n_steps={args.steps}",
        "save_every_n_steps=null",  # no step checkpoints: only training is timed
    ]
    if args.model:
        overrides.append(f"model._component_={args.model}")
    return overrides + list(args.override)


def launch(out: Path, args: argparse.Namespace, *, nproc: int, strategy: str) -> subprocess.Popen:
    """Start ``tune run --nproc_per_node nproc <recipe>_distributed`` (one thread per process)."""
    cmd = [
        sys.executable, "-m", "toolkit.cli.main", "run", "--nproc_per_node", str(nproc), f"{args.recipe}_distributed",
        "--config", args.config, f"output_dir={out}", "overwrite=true", f"data_parallel={strategy}",
        *recipe_args(args, nproc=nproc),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen, out: Path, warmup: int) -> float:
    """Wait for a run and return its median step time after ``warmup`` steps."""
    output, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(proc.args)}):\n{output[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(records) <= warmup:
        sys.exit(f"--steps ({len(records)}) must exceed --warmup ({warmup})")
    return statistics.median(r["step_time_s"] for r in records[warmup:])


def time_run(root: Path, args: argparse.Namespace, *, nproc: int, strategy: str, name: str) -> float:
    out = root / name
    return finish(launch(out, args, nproc=nproc, strategy=strategy), out, args.warmup)


def time_independent_pair(root: Path, args: argparse.Namespace) -> float:
    """Median step time of two 1-process runs sharing the machine, communicating nothing (the slower of the two)."""
    outs = [root / "independent_a", root / "independent_b"]
    procs = [launch(out, args, nproc=1, strategy="ddp") for out in outs]
    return max(finish(proc, out, args.warmup) for proc, out in zip(procs, outs))


# --- Bytes, measured in a 2-rank job -----------------------------------------------------------------------------


def ring_factor(kind: str, world_size: int, *, backend: str = "nccl") -> float:
    """Bytes one rank sends per byte of the collective's full tensor, for the ring algorithms.

    gloo has no reduce-scatter of its own: it all-reduces the whole tensor and keeps its shard (the profiler shows
    each ``c10d::_reduce_scatter_base_`` as a ``gloo:all_reduce``), so on gloo a reduce-scatter costs an all-reduce.
    """
    share = (world_size - 1) / world_size
    if kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo"):
        return 2 * share
    return share


def collective_payload(name: str, args: tuple, kwargs: dict) -> tuple[str, int] | None:
    """The kind of a collective op and the bytes of its full (unsharded) tensor; None for other ops.

    Argument layouts are those of the ``c10d`` and ``_c10d_functional`` op schemas in torch 2.x.
    """

    def nbytes(x: Any) -> int:
        leaves = torch.utils._pytree.tree_leaves(x)
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))

    op = name.split(".")[1] if "." in name else name
    if name.startswith("c10d."):
        if op in ("allreduce_", "allreduce_coalesced_"):
            return "all_reduce", nbytes(args[0])
        if op == "broadcast_":
            return "broadcast", nbytes(args[0])
        if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
            return "all_gather", nbytes(args[0])  # output: the gathered tensor(s)
        if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            return "reduce_scatter", nbytes(args[1])  # input: the full tensor(s)
        return None  # barrier, send/recv, ... (none in a training step)
    if name.startswith("_c10d_functional."):
        if op.startswith("all_reduce"):
            return "all_reduce", nbytes(args[0])
        if op.startswith("all_gather_into_tensor"):
            return "all_gather", nbytes(args[0]) * int(args[1])  # input shard x group size
        if op.startswith("reduce_scatter_tensor"):
            return "reduce_scatter", nbytes(args[0])
        if op == "broadcast":
            return "broadcast", nbytes(args[0])
    return None


def group_size(args: tuple, kwargs: dict, default: int) -> int:
    """The size of the process group a collective op runs on: its ProcessGroup argument (``c10d`` ops) or its group
    name (functional collectives); ``default`` where neither is found."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for value in (*args, *kwargs.values()):
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if isinstance(value, str):
            try:
                return _resolve_process_group(value).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return default


def collective_counter(*, world_size: int, backend: str, per_group: bool = False):  # noqa: ANN201 (a dispatch mode)
    """A ``TorchDispatchMode`` that adds up the bytes each kind of collective sends from this rank (ring costs,
    :func:`ring_factor`) and counts its calls, in ``.bytes`` and ``.calls``. The costs are for ``world_size`` ranks,
    or, ``per_group``, for each collective's own process group (a tensor-parallel all-reduce spans its pair).

    A mode sees an op before any tensor subclass does, and is switched off while it handles one, so DTensor ops are
    handed back (NotImplemented) to DTensor: the collectives DTensor issues on its local tensors (the gradient-norm
    all-reduce, tensor parallelism's) then reach this mode too."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, float] = defaultdict(float)
            self.calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if any(isinstance(t, DTensor) for t in torch.utils._pytree.tree_leaves((args, kwargs))):
                return NotImplemented
            payload = collective_payload(str(func), args, kwargs)
            if payload is not None:
                kind, size = payload
                ranks = group_size(args, kwargs, world_size) if per_group else world_size
                self.bytes[kind] += size * ring_factor(kind, ranks, backend=backend)
                self.calls[kind] += 1
            return func(*args, **kwargs)

    return CollectiveCounter()


def _probe_worker(rank: int, world_size: int, port: int, recipe: str, config: str, overrides: list[str],
                  strategy: str, micro_batch_size: int, steps: int, result_file: str, profile: bool,
                  train_all: bool) -> None:
    """One rank of the byte-counting job: the recipe's model and data-parallel setup, random tokens. For LoRA,
    only the adapters train, as in the recipe, unless ``train_all`` (the full fine-tuning of the same model)."""
    from toolkit.cli._catalog import config_for_recipe
    from toolkit.config import apply_overrides, instantiate, load_config
    from toolkit.parallel import apply_data_parallel, parallel_dims, shard_optimizer_state
    from toolkit.training import (
        destroy_distributed,
        forward_backward,
        init_distributed,
        init_weights,
        materialize,
        optimizer_step,
        set_seed,
    )

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    cfg = load_config(config_for_recipe(config, recipe))
    apply_overrides(cfg, overrides)
    env = init_distributed(device="cpu")
    dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size, device_type="cpu")
    set_seed(0)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    materialize(model, device=env.device)
    init_weights(model)
    if recipe == "lora_finetune" and not train_all:
        from toolkit.modules.peft import get_adapter_params, init_adapters, set_trainable_params

        init_adapters(model)
        set_trainable_params(model, get_adapter_params(model))
    # Bytes of what trains: the gradients DDP reduces have this size.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model = apply_data_parallel(model, dims=dims, device=env.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = shard_optimizer_state(instantiate(cfg.optimizer, trainable), dims=dims)
    generator = torch.Generator().manual_seed(rank)
    # Token ids below 256 fit any vocabulary; what is communicated does not depend on the values.
    tokens = torch.randint(0, 256, (micro_batch_size, int(cfg.max_seq_len)), generator=generator)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, dims=1)}

    def train_step() -> None:
        forward_backward(model, [batch], device=env.device, data_parallel_size=world_size)
        optimizer_step(model, optimizer, max_grad_norm=cfg.get("clip_grad_norm"))

    train_step()  # warmup, not counted: DDP rebuilds its buckets in the first iteration
    counter = collective_counter(world_size=world_size, backend=env.backend)
    with counter:
        for _ in range(steps):
            train_step()
    # Profiled separately: the counting mode's own dispatch would otherwise show up as a large cost.
    profiler = torch.profiler.profile() if profile and rank == 0 else contextlib.nullcontext()
    with profiler:
        for _ in range(steps if profile else 0):
            train_step()
    # How long the gradient all-reduce alone takes on this machine: DDP's communication time per step.
    flat = torch.zeros(param_bytes // 4, dtype=torch.float32)
    times = []
    for _ in range(12):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - start)
    if rank == 0:
        result = {
            "param_bytes": param_bytes,
            "bytes_per_step": {k: v / steps for k, v in counter.bytes.items()},
            "calls_per_step": {k: v / steps for k, v in counter.calls.items()},
            "all_reduce_s": statistics.median(times[2:]),
        }
        if profile:
            result["profile"] = profiler.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        Path(result_file).write_text(json.dumps(result))
    # Both ranks leave together: a rank tearing down its gloo connections while its peer still reads from them
    # can abort the peer.
    dist.barrier()
    destroy_distributed()
    # Skip the interpreter's teardown: freeing DDP's reducer destroys the gloo process group, whose destructor joins
    # gloo's worker thread while holding the GIL, and that thread may need the GIL to free a finished work's
    # tensors: a deadlock we saw (torch 2.13, py-spy: ~ProcessGroupGloo in std::thread::join). The results are
    # written; nothing is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_worker(rank: int, results: object, result_file: str) -> None:
    """The end of a benchmark worker: rank 0 writes ``results`` (JSON) to ``result_file``, every rank leaves the
    process group together, and the process exits without the interpreter's teardown (see :func:`_probe_worker`:
    gloo's destructors can deadlock there)."""
    if rank == 0:
        Path(result_file).write_text(json.dumps(results))
    if dist.is_initialized():  # (one process has no group)
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def host_high_water_kib() -> int:
    """This process's peak resident memory since the last :func:`reset_host_high_water` (Linux ``VmHWM``), KiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def reset_host_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def print_markdown_table(rows: list[tuple[str, ...]]) -> None:
    """``rows`` (the header first) as a Markdown table, columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice from the ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_communication(
    args: argparse.Namespace, strategy: str, root: Path, world_size: int = 2, *, train_all: bool = False
) -> dict[str, Any]:
    """Bytes each rank sends per optimizer step under ``strategy`` (by kind of collective), from a 2-rank job."""
    result_file = root / f"comm_{strategy}{'_all' if train_all else ''}.json"
    overrides = [f"model._component_={args.model}"] if args.model else []
    overrides += list(args.override)
    for attempt in range(2):
        try:
            mp.spawn(
                _probe_worker,
                args=(world_size, free_port(), args.recipe, args.config, overrides, strategy, args.micro_batch_size,
                      args.comm_steps, str(result_file), strategy in args.profile, train_all),
                nprocs=world_size,
            )
            break
        except ProcessException as e:
            # One retry: on a crowded machine a probe port can be taken between our probe and gloo's bind.
            if attempt == 1:
                raise
            print(f"  {strategy}: byte measurement failed ({e}); retrying", file=sys.stderr)
    return json.loads(result_file.read_text())


def formula_bytes(strategy: str, param_bytes: int, world_size: int = 2) -> float:
    """The textbook bytes sent per rank per step, from the parameter bytes (gradients have the same size)."""
    all_reduce = ring_factor("all_reduce", world_size) * param_bytes
    gather = ring_factor("all_gather", world_size) * param_bytes  # = reduce-scatter = broadcast (ring)
    return {"ddp": all_reduce, "zero1": all_reduce + gather, "zero2": 2 * gather, "zero3": 3 * gather}[strategy]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the median")
    parser.add_argument("--micro_batch_size", type=int, default=16, help="sequences per process per step")
    parser.add_argument("--repeats", type=int, default=1, help="run each measurement this often, keep the fastest")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--recipe", default="full_finetune", choices=("full_finetune", "lora_finetune"))
    parser.add_argument("--config", default="demo", help="a config name of that recipe, or a file")
    parser.add_argument("--model", default=None, help="a model builder's _component_ path (default: the config's)")
    parser.add_argument("--override", nargs="*", default=[], help="more key=value config overrides for every run")
    parser.add_argument("--comm_steps", type=int, default=2, help="steps counted by the 2-rank byte measurement")
    parser.add_argument("--profile", nargs="*", default=[], choices=STRATEGIES,
                        help="print a torch.profiler table of the 2-rank job's counted steps for these strategies")
    parser.add_argument("--output_dir", default=None, help="keep the runs' outputs here (default: a temp folder)")
    args = parser.parse_args()

    # Other load on the machine slows the 2-process runs far more than the 1-process ones (each collective waits for
    # the rank that lost its core), so the table says how busy the machine was.
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tune_scaling_") as tmp:
        root = Path(args.output_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = []
        for strategy in args.strategies:
            # Back to back, so the two runs of a row see the same machine load; other load only ever slows a run
            # down, so over repeats the fastest median is the one least disturbed.
            t1 = t2 = float("inf")
            for _ in range(args.repeats):
                t1 = min(t1, time_run(root, args, nproc=1, strategy=strategy, name=f"{strategy}_1p"))
                t2 = min(t2, time_run(root, args, nproc=2, strategy=strategy, name=f"{strategy}_2p"))
            comm = measure_communication(args, strategy, root)
            rows.append((strategy, t1, t2, comm))
            print(f"  {strategy}: 1p {t1 * 1e3:.1f} ms, 2p {t2 * 1e3:.1f} ms", file=sys.stderr, flush=True)
        t1 = t_pair = float("inf")
        for _ in range(args.repeats):
            t1 = min(t1, time_run(root, args, nproc=1, strategy="ddp", name="baseline_1p"))
            t_pair = min(t_pair, time_independent_pair(root, args))

    load_after = os.getloadavg()[0]
    for strategy, *_, comm in rows:
        if "profile" in comm:
            print(f"\nprofile of rank 0, 2 ranks, {strategy}, {args.comm_steps} step(s):\n{comm['profile']}")
    param_bytes = rows[0][3]["param_bytes"]
    print(
        f"\nweak scaling on {os.cpu_count()} CPU core(s), 1 thread per process: micro_batch_size "
        f"{args.micro_batch_size} per process, median step time over steps {args.warmup + 1}-{args.steps}"
        f"{f' (fastest of {args.repeats} runs)' if args.repeats > 1 else ''}; "
        f"{param_bytes / 4 / 1e6:.3f}M trainable fp32 parameters (P = {param_bytes / 1e6:.2f} MB); 1-minute load "
        f"average {load_before:.1f} before, {load_after:.1f} after (above ~0.5 the 2-process runs wait for cores)\n"
    )
    header = ("strategy", "step time 1p (ms)", "step time 2p (ms)", "efficiency", "MB sent/step/rank, measured",
              "formula (NCCL ring)", "collectives/step")
    table = [header]
    for strategy, s1, s2, comm in rows:
        measured = sum(comm["bytes_per_step"].values())
        calls = ", ".join(f"{n:g} {kind}" for kind, n in sorted(comm["calls_per_step"].items()))
        table.append((
            strategy, f"{s1 * 1e3:.1f}", f"{s2 * 1e3:.1f}", f"{s1 / s2:.2f}",
            f"{measured / 1e6:.2f} ({measured / param_bytes:.2f} P)",
            f"{formula_bytes(strategy, param_bytes) / 1e6:.2f}", calls,
        ))
    table.append(("2 x 1p, no comm", f"{t1 * 1e3:.1f}", f"{t_pair * 1e3:.1f}", f"{t1 / t_pair:.2f}", "0", "0", "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    all_reduce_s = statistics.median(comm["all_reduce_s"] for *_, comm in rows)
    ddp = next((r for r in rows if r[0] == "ddp"), None)
    print(
        f"\none all-reduce of all gradients ({param_bytes / 1e6:.2f} MB, 2 ranks, gloo): {all_reduce_s * 1e3:.1f} ms"
        + (f" = {all_reduce_s / ddp[2]:.0%} of the ddp 2-process step" if ddp else "")
    )
    print(
        f"2 independent 1-process runs at once (no communication): efficiency {t1 / t_pair:.2f}, the ceiling that "
        "sharing this machine's cores, caches and memory bandwidth leaves"
    )
    if args.recipe == "lora_finetune" and ddp:
        # The same model with every parameter training: what full fine-tuning would all-reduce.
        full = measure_communication(args, "ddp", Path(tempfile.mkdtemp(prefix="tune_scaling_full_")), train_all=True)
        lora_bytes, full_bytes = sum(ddp[3]["bytes_per_step"].values()), sum(full["bytes_per_step"].values())
        print(
            f"LoRA under ddp sends {lora_bytes / 1e6:.3f} MB/step/rank; full fine-tuning of the same model (every "
            f"parameter training) {full_bytes / 1e6:.2f} MB: LoRA sends {lora_bytes / full_bytes:.2%} of it"
        )


if __name__ == "__main__":
    main()
