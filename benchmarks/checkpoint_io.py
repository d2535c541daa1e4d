"""Step-checkpoint save and load, and Hugging Face export, against plain file I/O of the same bytes on the same disk.

    python benchmarks/checkpoint_io.py                        # a ~2 GB (fp32) Llama-shaped model, 1 and 2 processes
    python benchmarks/checkpoint_io.py --layers 2 --nprocs 2  # smaller and quicker

For each world size, a fresh ``torch.distributed.run`` job builds the model (random weights, no download), shards it
(1 process: plain; 2 processes: FSDP2 ``zero3``, so each rank holds half of every parameter), gives AdamW a state
(one step), then per rank, timed between barriers:

* ``save``: ``StepCheckpointer.save`` (``torch.distributed.checkpoint``: model + optimizer state + resume state),
  and ``plain write``: the same number of bytes (this rank's tensors) written with ``file.write`` of the raw
  buffers, then ``fsync`` (DCP syncs its files too).
* ``load``: ``StepCheckpointer.load`` into the same model and optimizer (checks included), and ``plain read``:
  reading those plain files back into preallocated buffers.
* ``export``: ``HFCheckpointer.export`` to Hugging Face safetensors (each rank writes its share of the files; the
  sharded model is first written as shards and read back by each file's owner, never gathered), and the peak
  resident memory above the training state while it runs (sampled every 5 ms, worst rank).

Times are the slowest rank's. The ratio columns are ours over plain I/O (target: save and load within 1.5x). The
page cache is dropped before each read when the machine allows it (root, not in a container); otherwise the reads
are from memory for both, which the ``cold cache`` column says. Numbers vary with the disk and its load; not a
test, it prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak - start`` is what a block added at worst."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor

    from toolkit.data import GlobalBatchSampler
    from toolkit.models.llama3 import llama3
    from toolkit.parallel import apply_data_parallel, parallel_dims
    from toolkit.training import (
        HFCheckpointer,
        StepCheckpointer,
        TrainingState,
        barrier,
        cosine_with_warmup,
        init_distributed,
    )

    env = init_distributed(device="cpu", timeout_s=1800)
    dims = dict(
        vocab_size=args.vocab_size, num_layers=args.layers, num_heads=16, num_kv_heads=8, embed_dim=args.embed_dim,
        intermediate_dim=args.intermediate_dim, max_seq_len=256,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama3(**dims)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    strategy = "zero3" if env.world_size > 1 else "ddp"
    par = parallel_dims(strategy=strategy, world_size=env.world_size, local_world_size=env.world_size,
                        shard_size=None, cpu_offload=False, device_type="cpu")
    model = apply_data_parallel(model, dims=par, device=env.device, mp_policy=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the AdamW state (two tensors per parameter)
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler = cosine_with_warmup(optimizer, warmup_steps=1, total_steps=10)
    sampler = GlobalBatchSampler(64, global_batch_size=8, rank=env.rank, world_size=env.world_size)
    state = TrainingState(model, optimizer, lr_scheduler, sampler)
    config = OmegaConf.create({"model": dims, "seed": 0})

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    local_bytes = sum(t.numel() * t.element_size() for t in tensors)

    root = Path(args.dir)
    results: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        results[name] = time.perf_counter() - start

    checkpointer = StepCheckpointer(root / "run", every_n_steps=1)
    path: list[Path] = []
    timed("save", lambda: path.append(checkpointer.save(1, state, config=config)))

    plain = root / "plain" / f"rank_{env.rank}"
    plain.mkdir(parents=True, exist_ok=True)

    def plain_write() -> None:
        with open(plain / "data.bin", "wb") as f:
            for t in tensors:
                f.write(t.contiguous().view(-1).view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())

    timed("plain_write", plain_write)
    cold = True
    if env.rank == 0:
        cold = _drop_page_cache()
    barrier()
    timed("load", lambda: checkpointer.load(path[0], state, config=config))
    if env.rank == 0:
        _drop_page_cache()
    barrier()
    buffer = torch.empty(os.path.getsize(plain / "data.bin"), dtype=torch.uint8)

    def plain_read() -> None:
        with open(plain / "data.bin", "rb", buffering=0) as f:
            view = memoryview(buffer.numpy())
            done = 0
            while done < len(view):
                done += f.readinto(view[done:])

    timed("plain_read", plain_read)
    buffer = None  # noqa: F841 (free it before the export is measured)
    hf = HFCheckpointer(None, model_family="llama3")
    with PeakRSS() as rss:
        timed("export", lambda: hf.export(model, root / "hf"))
    results["export_peak_extra_gb"] = (rss.peak - rss.start) / 2**30
    results["bytes_per_rank"] = local_bytes
    gathered = [None] * env.world_size if env.world_size > 1 else None
    if env.world_size > 1:
        dist.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if env.rank == 0:
        worst = {k: max(r[k] for r in gathered) for k in results}
        worst["bytes_total"] = sum(r["bytes_per_rank"] for r in gathered)
        worst["cold_cache"] = cold
        worst["params"] = sum(p.numel() for p in model.parameters())
        Path(args.result).write_text(json.dumps(worst))
    barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embed_dim", type=int, default=2048)
    parser.add_argument("--intermediate_dim", type=int, default=5632)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the /tmp disk)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    rows = []
    for nproc in args.nprocs:
        work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
        result = work / "result.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(_free_port()), __file__, "--worker", "--dir", str(work), "--result", str(result),
            "--layers", str(args.layers), "--embed_dim", str(args.embed_dim),
            "--intermediate_dim", str(args.intermediate_dim), "--vocab_size", str(args.vocab_size),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
        try:
            subprocess.run(command, check=True, env=env)
            rows.append((nproc, json.loads(result.read_text())))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'procs':>5} {'params':>8} {'ckpt GB':>8} | {'save s':>7} {'write s':>8} {'ratio':>6} | "
          f"{'load s':>7} {'read s':>7} {'ratio':>6} | {'export s':>8} {'peak +GB':>8} | cold cache")
    for nproc, r in rows:
        print(
            f"{nproc:>5} {r['params'] / 1e9:>7.2f}B {r['bytes_total'] / 1e9:>8.2f} | {r['save']:>7.2f} "
            f"{r['plain_write']:>8.2f} {r['save'] / r['plain_write']:>6.2f} | {r['load']:>7.2f} "
            f"{r['plain_read']:>7.2f} {r['load'] / r['plain_read']:>6.2f} | {r['export']:>8.2f} "
            f"{r['export_peak_extra_gb']:>8.2f} | {r['cold_cache']}"
        )


if __name__ == "__main__":
    main()
