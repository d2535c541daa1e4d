"""Attention over packed rows: SDPA with a dense per-document mask against FlexAttention block masks.

    python benchmarks/attention.py --device cuda                 # Llama 3.1 8B's attention layer, bf16, 2 x 4096
    python benchmarks/attention.py --device cuda --shape 3b      # Llama 3.2 3B's
    python benchmarks/attention.py --device cpu --shape tiny     # checks the script (forward only: see below)

One of our attention layers (``GroupedQueryAttention``: q/k/v/o projections, rotary embeddings, attention) with the
model's head layout, random weights, run forward and backward on one batch of packed rows, as training does. Rows
are filled with documents of random lengths (``--mean-doc``, exponential, at least 16 tokens; a fixed seed), the
same rows for every kernel:

* **sdpa causal, unpacked**: the same tokens as rows of one document each, SDPA's causal (flash) kernel: what
  attention costs when nothing is packed, the floor;
* **sdpa dense mask**: packed rows, the ``[b, s, s]`` boolean mask made on the device
  (:func:`toolkit.training.batch_attention_mask` with ``flex_attention=False``), which SDPA cannot hand to its
  flash kernel;
* **flex block mask**: packed rows, :class:`toolkit.modules.DocumentMasks` (the recipes' default on CUDA), compiled
  FlexAttention skipping the blocks masked whole;
* **..., made before the timing**: the two rows above with the mask made once, outside the timing: the kernels'
  own time (a model builds the mask once per batch for all its layers, so a layer's share of it is small);
* **sdpa causal, unpacked, cuDNN** (CUDA only): the first row with SDPA held to its cuDNN backend, which PyTorch
  ranks last in most versions (torch 2.11 on an H200 picked it by default: then the two rows are the same kernel).
  cuDNN's kernels are reported faster on Hopper; this row measures that on the machine
  at hand, for our layer's shapes (grouped-query heads), and prints how far its output is from the flash kernel's.
  A backend that cannot serve the call is reported as such.

Times are medians over ``--iters`` after ``--warmup`` iterations (compilation happens there), each from the
mask's construction (unless made before) to the end of backward (``torch.cuda.synchronize``). Memory is the peak
allocated above what the layer and its input hold. The last column is the time relative to the dense mask.

On CPU, PyTorch has no FlexAttention backward, so ``--device cpu`` times forward passes without gradients, and
unfused (no compile): it checks that the script runs, not the speed of the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings
from toolkit.training import batch_attention_mask

# (embed_dim, num_heads, num_kv_heads, head_dim): the models' attention layers.
SHAPES = {"8b": (4096, 32, 8, 128), "3b": (3072, 24, 8, 128), "1b": (2048, 32, 8, 64), "tiny": (64, 4, 2, 16)}


def attention_layer(shape: str, *, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    d, n_h, n_kv, h_d = SHAPES[shape]
    torch.manual_seed(0)
    return GroupedQueryAttention(
        num_heads=n_h, num_kv_heads=n_kv, head_dim=h_d,
        q_proj=nn.Linear(d, n_h * h_d, bias=False), k_proj=nn.Linear(d, n_kv * h_d, bias=False),
        v_proj=nn.Linear(d, n_kv * h_d, bias=False), o_proj=nn.Linear(n_h * h_d, d, bias=False),
        pos_embeddings=RotaryPositionalEmbeddings(h_d, max_seq_len=max_seq_len, base=500_000.0),
    ).to(device=device, dtype=dtype)


def packed_positions(batch_size: int, seq_len: int, mean_doc: int, seed: int = 0) -> torch.Tensor:
    """``input_pos`` of rows filled with documents of exponentially distributed lengths (at least 16)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch_size):
        lengths: list[int] = []
        while sum(lengths) < seq_len:
            draw = torch.empty(1).exponential_(1 / mean_doc, generator=generator).item()
            lengths.append(min(max(16, int(draw)), seq_len - sum(lengths)))
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def build_mask(layer: nn.Module, batch: dict, *, flex: bool):
    mask = batch_attention_mask(batch, flex_attention=flex)
    return mask.for_layer(layer) if hasattr(mask, "for_layer") else mask


def measure(layer: nn.Module, x: torch.Tensor, batch: dict, *, flex: bool, train: bool, warmup: int, iters: int,
            backend: SDPBackend | None = None, prebuilt: bool = False):
    """Median seconds and peak bytes of one forward (and backward) with the mask made inside the timing, or once
    before it (``prebuilt``: the kernels alone); SDPA held to ``backend`` if given."""
    if backend is not None:
        with sdpa_kernel(backend):
            return measure(layer, x, batch, flex=flex, train=train, warmup=warmup, iters=iters, prebuilt=prebuilt)
    device = x.device
    times = []
    ready = build_mask(layer, batch, flex=flex) if prebuilt else None
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if i == warmup:
                torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(train):
            mask = ready if prebuilt else build_mask(layer, batch, flex=flex)
            out = layer(x, mask=mask, input_pos=batch.get("input_pos"))
            if train:
                out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        del out, mask
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="8b", choices=list(SHAPES))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (256 for tiny)")
    parser.add_argument("--mean-doc", type=int, default=None, help="mean document length (default seq_len / 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    seq_len = args.seq_len or (256 if args.shape == "tiny" else 4096)
    mean_doc = args.mean_doc or seq_len // 8
    train = device.type == "cuda"  # no FlexAttention backward on CPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    layer = attention_layer(args.shape, max_seq_len=seq_len, device=device, dtype=dtype)
    x = torch.randn(args.batch_size, seq_len, SHAPES[args.shape][0], device=device, dtype=dtype, requires_grad=train)
    input_pos = packed_positions(args.batch_size, seq_len, mean_doc).to(device)
    tokens = torch.zeros(args.batch_size, seq_len, dtype=torch.long, device=device)
    packed = {"tokens": tokens, "input_pos": input_pos}
    documents = int((input_pos == 0).sum())
    runs = [
        ("sdpa causal, unpacked", {"tokens": tokens}, False, None, False),
        ("sdpa dense mask", packed, False, None, False),
        ("flex block mask", packed, True, None, False),
        ("sdpa dense mask, made before the timing", packed, False, None, True),
        ("flex block mask, made before the timing", packed, True, None, True),
    ]
    if device.type == "cuda":
        runs.append(("sdpa causal, unpacked, cuDNN", {"tokens": tokens}, False, SDPBackend.CUDNN_ATTENTION, False))
    results, notes = [], []
    for name, batch, flex, backend, prebuilt in runs:
        try:
            results.append((name, *measure(layer, x, batch, flex=flex, train=train, warmup=args.warmup,
                                           iters=args.iters, backend=backend, prebuilt=prebuilt)))
        except RuntimeError as e:  # SDPA held to a backend that cannot serve these shapes
            notes.append(f"{name}: not served ({str(e).splitlines()[0][:160]})")
    if device.type == "cuda" and not notes:
        with torch.no_grad():
            flash = layer(x, input_pos=None)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = layer(x, input_pos=None)
        notes.append(f"cuDNN against the default (flash) kernel: outputs differ by at most "
                     f"{(cudnn.float() - flash.float()).abs().max().item():.3g} (output scale "
                     f"{flash.float().abs().max().item():.3g})")

    what = "forward + backward" if train else "forward only, no gradients (CPU)"
    print(f"attention layer of {args.shape} ({SHAPES[args.shape]}: d, heads, kv heads, head dim), {dtype}, "
          f"{args.batch_size} x {seq_len} tokens, {documents} documents (mean {mean_doc}); {what}; "
          f"median of {args.iters} on {torch.cuda.get_device_name(device) if train else 'cpu'}, "
          f"torch {torch.__version__}")
    dense_s = results[1][1]
    print("| kernel | ms | peak MiB above inputs | time / dense mask |\n|---|---|---|---|")
    for name, seconds, peak in results:
        memory = "-" if peak is None else f"{peak / 2**20:.0f}"
        print(f"| {name} | {seconds * 1e3:.2f} | {memory} | {seconds / dense_s:.2f} |")
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
