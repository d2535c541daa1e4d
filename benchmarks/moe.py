"""Mixture-of-experts speed: our grouped experts against ``transformers``' on the same model and batch, and against
a dense model with as many active parameters, as ratios of tokens per second, with peak memory beside each.

    python benchmarks/moe.py                                  # CPU, a small Qwen3-MoE, ~2 min
    python benchmarks/moe.py --steps 10 --seq_len 1024 --micro_batch_size 2
    python benchmarks/moe.py --device cuda --dtype bfloat16 --embed_dim 2048 --num_experts 128 --top_k 8

One random Qwen3-MoE checkpoint (``transformers``' ``save_pretrained``) and one dense Qwen3 checkpoint whose MLP
width is ``top_k x`` the experts' (so each token goes through the same number of MLP weights: the same active
parameters, the router aside) are written to a temporary folder. Each variant then trains on them in a process of
its own, so that one's memory does not count against another's: forward and backward of the mean token loss on
the same random tokens, ``--steps`` timed steps after ``--warmup`` (no optimizer step: the optimizer is the same
work everywhere and says nothing about the experts).

- **ours**: the checkpoint loaded into our model (``toolkit.pretrained.from_pretrained``): tokens sorted by expert, one
  grouped matmul per projection (``torch._grouped_mm`` where the device has it).
- **transformers <impl>**: ``Qwen3MoeForCausalLM`` with each ``experts_implementation`` this ``transformers``
  has (``eager``: its default, a Python loop over the experts that were hit; ``batched_mm``, ``grouped_mm``).
- **dense (ours)**: our dense Qwen3 with the same active parameters.

Tokens/s: the median over timed steps of tokens / step time (``torch.cuda.synchronize()`` first on CUDA). Peak
memory: the high-water mark of the step's tensors above what the process held before the first forward (host
resident memory on CPU, ``max_memory_allocated`` on CUDA). The ratio column is ``ours / variant`` (above 1:
ours is faster). Not a test; it prints a table (benchmarks/README.md keeps one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import host_high_water_kib as _hwm_kib, reset_host_high_water as _reset_hwm  # noqa: E402


def write_checkpoints(folder: Path, args: argparse.Namespace) -> None:
    """The random Qwen3-MoE checkpoint (``moe``) and the dense one with its active parameters (``dense``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.embed_dim, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, intermediate_size=args.top_k * args.expert_dim, moe_intermediate_size=args.expert_dim,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, router_aux_loss_coef=0.0,
    ))
    moe.save_pretrained(folder / "moe")
    dense = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=args.top_k * args.expert_dim))
    dense.save_pretrained(folder / "dense")


def run_variant(variant: str, folder: Path, args: argparse.Namespace) -> dict:
    """Train ``variant`` on the checkpoints of ``folder`` (in this process) and return its figures."""
    import torch

    torch.manual_seed(1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len), device=device)
    if variant in ("ours", "dense"):
        from toolkit.pretrained import from_pretrained

        model = from_pretrained(folder / ("moe" if variant == "ours" else "dense"), dtype=dtype, device=device)
        model.to(dtype).train()
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)

        def loss() -> torch.Tensor:
            return model(tokens, labels=labels) / labels.numel()
    else:
        from transformers import AutoModelForCausalLM

        implementation = variant.removeprefix("transformers ")
        model = AutoModelForCausalLM.from_pretrained(
            folder / "moe", dtype=dtype, experts_implementation=implementation
        ).to(device).train()

        def loss() -> torch.Tensor:
            return model(input_ids=tokens, labels=tokens).loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    else:
        _reset_hwm()
        held = _hwm_kib() * 1024
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss().backward()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _hwm_kib() * 1024
    return {"tokens_per_s": tokens.numel() / statistics.median(times), "peak_mib": (peak - held) / 2**20}


def transformers_implementations() -> list[str]:
    """``eager`` and the other experts implementations this ``transformers`` registers that need no extra kernels."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without selectable implementations: its loop only
        return ["eager"]
    return ["eager", *(name for name in ("batched_mm", "grouped_mm") if name in ALL_EXPERTS_FUNCTIONS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--embed_dim", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--num_kv_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=32)
    parser.add_argument("--num_experts", type=int, default=32)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--expert_dim", type=int, default=128, help="each expert's MLP width")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set for the per-variant child processes
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args.variant, Path(args.folder), args)))
        return

    variants = ["ours", *(f"transformers {name}" for name in transformers_implementations()), "dense"]
    # Each row as its variant ends (a run cut short by a time limit keeps the rows before it); a variant that fails
    # (out of memory, say) gets a row saying so, its error on stderr.
    print(f"{args.device} {args.dtype}: {args.num_layers} layers, width {args.embed_dim}, {args.num_experts} experts "
          f"top-{args.top_k} of width {args.expert_dim}; {args.micro_batch_size} x {args.seq_len} tokens per step")
    print(f"{'variant':<26} {'tokens/s':>10} {'ours / it':>10} {'peak MiB':>10}", flush=True)
    ours = None
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoints(Path(tmp), args)
        for variant in variants:
            child = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--folder", tmp],
                capture_output=True, text=True, cwd=ROOT,
            )
            if child.returncode != 0:
                error = (child.stderr.strip().splitlines() or ["(no message)"])[-1]
                print(f"[moe.py] {variant} failed:\n{child.stderr[-2000:]}", file=sys.stderr, flush=True)
                print(f"{variant:<26} failed: {error[:120]}", flush=True)
                continue
            figures = json.loads(child.stdout.strip().splitlines()[-1])
            ours = figures if variant == "ours" else ours
            ratio = ours["tokens_per_s"] / figures["tokens_per_s"] if ours else float("nan")
            print(f"{variant:<26} {figures['tokens_per_s']:>10.0f} {ratio:>9.2f}x {figures['peak_mib']:>10.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
