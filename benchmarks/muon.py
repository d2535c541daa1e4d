"""Optimizer step time of toolkit.optim.Muon against AdamW, on 1 and 2 processes under ddp and zero3 (CPU, gloo).

    python benchmarks/muon.py                                   # demo model, ~1 min
    python benchmarks/muon.py --steps 20 --model toolkit.models.llama3.llama3_demo

One job per world size (1, then 2 processes; gloo, one thread each) builds the model through the toolkit's own
``parallelize`` and ``shard_optimizer_state`` (the recipes' path), takes one forward and backward on random tokens
for gradients, then times ``optimizer.step()`` alone (the median of ``--steps`` steps, each ended by a barrier) for
AdamW (torch's, foreach) and Muon (bfloat16 Newton-Schulz, torch.optim.Muon's defaults). Bytes sent per step per rank
are counted from every collective the step issues (``benchmarks/scaling.py``'s counter, ring costs; it does not see
the all-to-all of zero3's row exchange), and by Muon itself (``Muon.stats.bytes_sent``: what rank 0 sent to other
ranks, in the iteration's dtype); the matrices rank 0 orthogonalized per step are Muon's own count
(``Muon.stats.orthogonalized``): under ddp and zero3 they fall with the world size, since each matrix has one owner.
Not a test; it prints a table (benchmarks/README.md keeps one).
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
# (the benchmarks folder is no package)
from scaling import collective_counter, end_worker, free_port, print_markdown_table  # noqa: E402

OPTIMIZERS = {"adamw": "torch.optim.AdamW", "muon": "toolkit.optim.Muon"}


def _barrier() -> None:
    if dist.is_initialized():  # (one process has no group)
        dist.barrier()


def _worker(rank: int, world_size: int, port: int, options: dict, result_file: str) -> None:
    from omegaconf import OmegaConf

    from toolkit.config import instantiate
    from toolkit.parallel import parallel_dims, shard_optimizer_state
    from toolkit.training import (
        forward_backward, init_distributed, init_weights, optimizer_parameters, parallelize, set_seed,
    )

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    results = []
    for strategy in options["strategies"]:
        dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size,
                             device_type="cpu", rank=rank)
        set_seed(0)
        with torch.device("meta"):
            model = instantiate({"_component_": options["model"], "max_seq_len": options["seq_len"]})
        mesh = dims.build_mesh("cpu")
        model = parallelize(model, dims=dims, device=env.device, dtype=torch.float32, fill=init_weights, mesh=mesh)
        generator = torch.Generator().manual_seed(dims.dp_rank)
        tokens = torch.randint(0, 256, (options["micro_batch_size"], options["seq_len"] + 1), generator=generator)
        forward_backward(model, [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}], device=env.device,
                         data_parallel_size=dims.dp_size, data_parallel_group=dims.dp_group(mesh))
        for name, component in OPTIMIZERS.items():
            cfg = OmegaConf.create({"_component_": component, "lr": 1e-5})
            optimizer = shard_optimizer_state(instantiate(cfg, optimizer_parameters(model, cfg)), dims=dims)
            optimizer.step()  # warmup: the state is made
            counter = collective_counter(world_size=world_size, backend=env.backend, per_group=True)
            with counter:
                optimizer.step()
            stats = getattr(optimizer, "stats", None)  # Muon's own count of the step: matrices and bytes sent
            times = []
            for _ in range(options["steps"]):
                _barrier()
                start = time.perf_counter()
                optimizer.step()
                _barrier()
                times.append(time.perf_counter() - start)
            results.append({"strategy": dims.label if world_size > 1 else "one process", "optimizer": name,
                            "step_s": statistics.median(times), "bytes": sum(counter.bytes.values()),
                            "orthogonalized": getattr(stats, "orthogonalized", None),
                            "muon_bytes": getattr(stats, "bytes_sent", None)})
    end_worker(rank, results, result_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps (after one warmup step)")
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--model", default="toolkit.models.llama3.llama3_demo", help="a model builder's _component_")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune_muon_bench_") as tmp:
        for world_size, strategies in ((1, ["ddp"]), (2, ["ddp", "zero3"])):
            result_file = Path(tmp) / f"results_{world_size}.json"
            options = {**vars(args), "strategies": strategies}
            mp.spawn(_worker, args=(world_size, free_port(), options, str(result_file)), nprocs=world_size)
            rows += [(world_size, r) for r in json.loads(result_file.read_text())]
    load_after = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} CPU core(s), gloo, fp32 parameters, 1 thread per process; {args.model}; median of "
          f"{args.steps} optimizer steps; 1-minute load average {load_before:.1f} before, {load_after:.1f} after\n")
    table = [("processes", "layout", "optimizer", "step time (ms)", "KB sent/step/rank (counter)",
              "KB sent by Muon's exchanges (rank 0)", "matrices orthogonalized by rank 0")]
    for world_size, r in rows:
        muon = r["orthogonalized"] is not None
        table.append((str(world_size), r["strategy"], r["optimizer"], f"{r['step_s'] * 1e3:.1f}",
                      f"{r['bytes'] / 1e3:.0f}", f"{r['muon_bytes'] / 1e3:.0f}" if muon else "-",
                      str(r["orthogonalized"]) if muon else "-"))
    print_markdown_table(table)


if __name__ == "__main__":
    main()
