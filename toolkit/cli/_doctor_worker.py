"""One process of ``tune doctor --nproc_per_node N``, started by torch's elastic launcher.

Every process runs the local checks; then the group measures all-reduce and all-gather bus bandwidth per message
size, and each process times a fixed local workload and one send/recv step around a ring, so that a process much
slower than the others is named. Each node's local rank 0 prints the table and leaves the exit code for its
``tune doctor`` in the file ``TUNE_DOCTOR_VERDICT_FILE`` names.

Test hook: ``TUNE_DOCTOR_TEST_SLOW_RANK=R`` makes rank R sleep in its timed local workload, for the tests that check
the slowest rank is named. It exists for those tests only.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a file, this folder would come first on the import path: put the checkout holding it there instead, so
    # the workers import the same toolkit as the `tune doctor` that started them.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from toolkit.cli.doctor import (
    FAIL,
    OK,
    VERDICT_FILE_ENV,
    WARN,
    Row,
    checks_table,
    combine,
    exit_code,
    format_table,
    local_checks,
    row_to_dict,
)

SLOW_RANK_ENV = "TUNE_DOCTOR_TEST_SLOW_RANK"  # test hook, see the module's docstring
_SLOW_RANK_SLEEP_S = 0.5
KIB, MIB = 1024, 1024**2
CPU_SIZES = (1 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
GPU_SIZES = (1 * KIB, 1 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB)
_ITERATIONS = 5
# A rank whose time is above this many times the median of the other ranks' is named as the slowest.
OUTLIER_RATIO = 1.5


def bus_bandwidth(collective: str, size_bytes: int, seconds: float, world: int) -> float:
    """Bus bandwidth in bytes/s as nccl-tests defines it: the algorithm bandwidth (bytes / time) times
    2(n-1)/n for all-reduce and (n-1)/n for all-gather (whose size is the gathered output)."""
    algbw = size_bytes / seconds
    factor = 2 * (world - 1) / world if collective == "all_reduce" else (world - 1) / world
    return algbw * factor


def slowest(times: list[float], hosts: list[str], what: str) -> Row:
    """A warning naming the rank whose time is above ``OUTLIER_RATIO`` x the median of the others', else ok."""
    shown = ", ".join(f"{t * 1000:.0f}" for t in times)
    if len(times) < 2:
        return Row(f"slowest rank ({what})", OK, f"one rank: {shown} ms")
    rank = max(range(len(times)), key=times.__getitem__)
    others = statistics.median(t for r, t in enumerate(times) if r != rank)
    if times[rank] > OUTLIER_RATIO * others:
        return Row(f"slowest rank ({what})", WARN,
                   f"rank {rank} on {hosts[rank]}: {times[rank] * 1000:.0f} ms, "
                   f"the others' median {others * 1000:.0f} ms",
                   f"look for load, throttling or a slow link on {hosts[rank]}")
    return Row(f"slowest rank ({what})", OK, f"none; per rank, ms: {shown}")


def _timed(step, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``step()`` over a few runs, after one warm-up; every rank starts each run together."""
    step()
    times = []
    for _ in range(_ITERATIONS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bandwidths(device: torch.device, world: int) -> list[tuple[str, str, float, float]]:
    """(collective, size, seconds, bus bandwidth) per collective and message size; a size's time is the slowest
    rank's, as a collective ends when its last rank does."""
    results = []
    for size in GPU_SIZES if device.type == "cuda" else CPU_SIZES:
        elements = max(size // 4 // world * world, world)
        full = torch.ones(elements, device=device)
        part = torch.ones(elements // world, device=device)
        chunks = list(full.chunk(world))
        steps = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda chunks=chunks, part=part: dist.all_gather(chunks, part),
        }
        for name, step in steps.items():
            seconds = torch.tensor(_timed(step, device), device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            taken = float(seconds)
            results.append((name, _size(elements * 4), taken, bus_bandwidth(name, elements * 4, taken, world)))
    return results


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.2f} MB/s"


def _size(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _local_workload(rank: int) -> float:
    """Seconds this rank takes for a fixed amount of CPU arithmetic (with the test hook's sleep on its rank)."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a)
    if os.environ.get(SLOW_RANK_ENV) == str(rank):
        time.sleep(_SLOW_RANK_SLEEP_S)
    return time.perf_counter() - start


def _ring_step(rank: int, world: int, device: torch.device) -> float:
    """Seconds for this rank to send 1 MiB to the next rank and receive as much from the previous one."""
    out, into = torch.ones(MIB // 4, device=device), torch.empty(MIB // 4, device=device)

    def step() -> None:
        requests = [dist.isend(out, (rank + 1) % world), dist.irecv(into, (rank - 1) % world)]
        for request in requests:
            request.wait()

    return _timed(step, device)


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--timeout_s", type=int, required=True)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    uses_gpus = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if uses_gpus else torch.device("cpu")
    if uses_gpus:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if uses_gpus else "gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        host = socket.gethostname()
        rows = local_checks(args.output_dir)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (host, [row_to_dict(row) for row in rows]))
        per_rank = [(h, [Row(**r) for r in rs]) for h, rs in gathered]
        hosts = [h for h, _ in per_rank]
        bandwidths = _bandwidths(device, world) if world > 1 else []
        dist.barrier()
        timings: list = [None] * world
        dist.all_gather_object(timings, (_local_workload(rank), _ring_step(rank, world, device) if world > 1 else 0.0))
        combined = combine(per_rank)
        combined.append(slowest([t for t, _ in timings], hosts, "local workload"))
        if world > 1:
            combined.append(slowest([t for _, t in timings], hosts, "ring send/recv 1 MiB"))
        if local_rank == 0:
            backend = dist.get_backend()
            print(f"tune doctor: {world} processes on {len(set(hosts))} host(s), backend {backend}\n")
            print(checks_table(combined))
            if bandwidths:
                print(f"\nbus bandwidth ({backend}, median of {_ITERATIONS}, slowest rank's time):")
                print(format_table(("COLLECTIVE", "SIZE", "TIME", "BUS BANDWIDTH"), [
                    (name, size, f"{seconds * 1e3:.2f} ms", _rate(busbw))
                    for name, size, seconds, busbw in bandwidths
                ]))
            verdicts = {row.verdict for row in combined}
            summary = FAIL if FAIL in verdicts else WARN if WARN in verdicts else OK
            print(f"\nverdict: {summary}", flush=True)
            path = os.environ.get(VERDICT_FILE_ENV)
            if path:
                Path(path).write_text(str(exit_code(combined)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
