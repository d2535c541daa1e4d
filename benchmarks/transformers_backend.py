"""What a native family buys over the transformers backend: the same Llama checkpoint trained by both.

    python benchmarks/transformers_backend.py                        # CPU, a small Llama (7M parameters)
    python benchmarks/transformers_backend.py --steps 3 --warmup 1   # checks the script (seconds)
    python benchmarks/transformers_backend.py --device cuda --shape 1b --dtype bf16

A random Llama checkpoint is written with ``transformers`` (``save_pretrained``) and built twice on the meta
device, as the recipes build models: by the native family (``toolkit.models.build_from_hf``, Llama's ``llama3``) and
by the transformers backend (``toolkit.models.transformers_backend.from_folder``), each then materialized and
loaded from the same files. Each trains the same batches (unpacked rows, then packed rows of several documents:
the dense per-document mask) with AdamW: forward with the fused projection and loss, backward, step.

Columns: the median step time over ``--steps`` after ``--warmup`` steps (the two models' steps taken in turns, so
that other work on the machine slows both alike) and its tokens per second; the bytes the step keeps for backward
(every tensor autograd saves, counted once per storage: activation memory, which sets the largest micro batch that
fits); on CUDA the peak allocated memory of a step; the first step's loss (the two must agree: the same model); and
the backend's time and memory relative to the native family's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolkit.data.packing import packed_attention_mask
from toolkit.models import build_from_hf
from toolkit.models.transformers_backend import from_folder
from toolkit.training import HFCheckpointer, materialize

# (hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {"small": (256, 704, 4, 8, 4, 8192), "1b": (2048, 8192, 16, 32, 8, 128256)}


def write_checkpoint(folder: Path, shape: str) -> None:
    import transformers

    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def load(kind: str, folder: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_from_hf(path=folder) if kind == "native" else from_folder(path=folder)
    materialize(model, device=device, dtype=dtype)
    family = "llama3" if kind == "native" else "transformers_backend"
    HFCheckpointer(str(folder), model_family=family).load(model)
    return model.train()


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()``'s forward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


class Trainer:
    """One model's training step on one batch, AdamW, with its times and first loss."""

    def __init__(self, model: torch.nn.Module, batch: dict, device: torch.device) -> None:
        self.model, self.batch, self.device = model, batch, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self) -> None:
        batch = self.batch
        loss = self.model(batch["tokens"], labels=batch["labels"], mask=batch.get("mask"),
                          input_pos=batch.get("input_pos"))
        num_tokens = int((batch["labels"] != -100).sum())
        (loss / num_tokens).backward()
        self.losses.append(loss.item() / num_tokens)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter() - start)


def measure(trainers: dict[str, Trainer], *, steps: int, warmup: int, device: torch.device) -> dict[str, dict]:
    """Each trainer's saved bytes, then warm-up steps, then ``steps`` timed steps taken in turns (one step of each
    model after the other), so that a busy machine slows both alike."""
    saved = {kind: saved_bytes(trainer.step) for kind, trainer in trainers.items()}
    for _ in range(warmup):
        for trainer in trainers.values():
            trainer.step()
    peaks = {}
    for kind, trainer in trainers.items():  # the peak of each alone (CUDA)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.timed_step()
        peaks[kind] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    for _ in range(steps - 1):
        for trainer in trainers.values():
            trainer.timed_step()
    return {kind: {"seconds": statistics.median(t.times), "saved": saved[kind], "peak": peaks[kind],
                   "loss": t.losses[0]} for kind, t in trainers.items()}


def batches(batch_size: int, seq_len: int, vocab: int, device: torch.device) -> dict[str, dict]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    quarter = seq_len // 4  # four documents a row
    input_pos = torch.arange(seq_len).remainder(quarter).expand(batch_size, seq_len).contiguous()
    plain = {"tokens": tokens.to(device), "labels": labels.to(device)}
    packed = {**plain, "input_pos": input_pos.to(device), "mask": packed_attention_mask(input_pos).to(device)}
    return {"unpacked": plain, "packed": packed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args.shape)
        print(f"Llama {args.shape}, {args.dtype}, {args.device}, batch {args.batch_size} x {args.seq_len}, "
              f"median of {args.steps} steps after {args.warmup}; torch {torch.__version__} "
              f"({torch.get_num_threads()} threads)")
        print("| rows | model | step ms | tokens/s | saved for backward MiB | peak MiB | first loss | time / native "
              "| saved / native |")
        print("|---|---|---|---|---|---|---|---|---|")
        for rows, batch in batches(args.batch_size, args.seq_len, SHAPES[args.shape][5], device).items():
            trainers = {kind: Trainer(load(kind, folder, device, dtype), batch, device)
                        for kind in ("native", "backend")}
            results = measure(trainers, steps=args.steps, warmup=args.warmup, device=device)
            for kind, r in results.items():
                peak = "-" if r["peak"] is None else f"{r['peak'] / 2**20:.0f}"
                tokens_per_s = args.batch_size * args.seq_len / r["seconds"]
                print(f"| {rows} | {kind} | {r['seconds'] * 1e3:.1f} | {tokens_per_s:.0f} | {r['saved'] / 2**20:.1f} "
                      f"| {peak} | {r['loss']:.6f} | {r['seconds'] / results['native']['seconds']:.2f} "
                      f"| {r['saved'] / results['native']['saved']:.2f} |")


if __name__ == "__main__":
    main()
