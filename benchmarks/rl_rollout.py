"""Rollout speed: the RL recipe's sampler against ``transformers``' ``generate``, on the same model and batch.

    python benchmarks/rl_rollout.py                  # CPU fp32, a 4-layer Llama of width 384, 32 x 64 tokens, ~2 min
    python benchmarks/rl_rollout.py --repeats 3 --max_new_tokens 128 --num_generations 16
    python benchmarks/rl_rollout.py --smoke          # checks the script on a tiny model (seconds)

One random Llama checkpoint is written with ``transformers`` (``save_pretrained``) and loaded twice from the same
files: into our model (``toolkit.models.build_from_hf``, the ``llama3`` family) and into ``LlamaForCausalLM``. The
script first checks that the two give the same logits (else the comparison would be of two models), then samples
the same batch with each: ``--prompts`` random prompts of random lengths (``--prompt_len``), each repeated
``--num_generations`` times (an RL step's groups), every row generating ``--max_new_tokens`` tokens.

- **ours**: :func:`toolkit.rl.rollout.sample_completions`, as the recipe calls it: the prompts right-padded and run
  in one forward, then one token per forward for every row at its own position in a KV cache of ``longest prompt +
  max_new_tokens`` positions (the recipe's cache spans ``max_seq_len``), each row drawing from its own generator
  (seeded by ``completion_seed(seed, step, prompt, sample)``).
- **transformers**: ``model.generate`` with ``do_sample=True``, its default cache (``DynamicCache``), the prompts
  left-padded with an attention mask.

Both sample at temperature 1 from the full distribution (no top-k, no top-p: ``transformers``' generation config
is given ``top_k=0, top_p=1.0`` explicitly) and **neither can stop early**: ours is given no stop token
(``stop_tokens=()``) and ``transformers`` no end-of-sequence token (``eos_token_id=None``), so every row of both
generates exactly ``--max_new_tokens`` tokens, which the script checks on every call. Tokens/s is the generated
tokens (rows x ``max_new_tokens``) over the call's wall time, prefill included; the median of ``--repeats`` calls
after ``--warmup``, the two engines called in turns so that other work on the machine slows both alike.

With ``--rl_step`` (the default), each repeat also takes the rest of one RL step on our rollouts, as the recipe
does with ``updates_per_rollout: 1`` and no KL reference: the sequences laid out with random advantages
(:func:`toolkit.objectives.rl.rollout_batch`), one ``grpo`` forward and backward over them in one micro-batch
(:func:`~toolkit.objectives.rl.rl_forward_backward`) and an AdamW step (learning rate 1e-6: the weights barely
move). The last line gives generation's share of that step (rewards, a few string functions, are left out).
Not a test; it prints a table (benchmarks/README.md keeps one).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from toolkit.models import build_from_hf
from toolkit.objectives.rl import RLSettings, normalizer, rl_forward_backward, rollout_batch
from toolkit.rl.rollout import SamplingSettings, completion_seed, sample_completions
from toolkit.training import HFCheckpointer, materialize

PAD_ID = 0  # prompts never contain it (their tokens are drawn from 1..vocab-1)
# The tiny shape of --smoke: every flag it sets, over the defaults.
SMOKE = {"embed_dim": 64, "intermediate_dim": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "vocab_size": 512, "prompts": 2, "num_generations": 2, "prompt_len": (3, 6), "max_new_tokens": 5,
         "warmup": 0, "repeats": 1}


def write_checkpoint(folder: Path, args: argparse.Namespace) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.embed_dim, intermediate_size=args.intermediate_dim, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, vocab_size=args.vocab_size,
        max_position_embeddings=args.prompt_len[1] + args.max_new_tokens, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def load_models(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and ``transformers``' model, from the same files."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        ours = build_from_hf(path=folder)
    materialize(ours, device=device, dtype=dtype)
    HFCheckpointer(str(folder), model_family="llama3").load(ours)
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return ours.train(), theirs


def check_same_model(ours: torch.nn.Module, theirs: torch.nn.Module, prompt: list[int], device: torch.device) -> float:
    """The largest logit difference of the two models on ``prompt``; raises if they are not the same model."""
    tokens = torch.tensor([prompt], device=device)
    with torch.no_grad():
        a = ours(tokens).float()
        b = theirs(input_ids=tokens).logits.float()
    diff = (a - b).abs().max().item()
    scale = b.abs().max().item()
    if diff > 1e-3 * max(scale, 1.0):
        raise SystemExit(f"rl_rollout.py: the two models disagree (largest logit difference {diff:.3g}): not the "
                         "same weights, the comparison would be meaningless")
    return diff


class Batch:
    """One step's rows: each prompt ``num_generations`` times, with our seeds and transformers' padded inputs."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        rng = random.Random(0)
        low, high = args.prompt_len
        prompts = [[rng.randrange(1, args.vocab_size) for _ in range(rng.randint(low, high))]
                   for _ in range(args.prompts)]
        self.prompts = prompts
        self.rows = [p for p in prompts for _ in range(args.num_generations)]
        self.index = [(i, j) for i in range(args.prompts) for j in range(args.num_generations)]
        width = max(len(r) for r in self.rows)
        self.cache_len = width + args.max_new_tokens
        # transformers: left padding, so that every row's next token is at the end.
        self.input_ids = torch.full((len(self.rows), width), PAD_ID, dtype=torch.long)
        self.attention_mask = torch.zeros((len(self.rows), width), dtype=torch.long)
        for k, row in enumerate(self.rows):
            self.input_ids[k, width - len(row):] = torch.tensor(row)
            self.attention_mask[k, width - len(row):] = 1
        self.input_ids, self.attention_mask = self.input_ids.to(device), self.attention_mask.to(device)

    def seeds(self, step: int) -> list[int]:
        return [completion_seed(0, step, i, j) for i, j in self.index]


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--embed_dim", type=int, default=384)
    parser.add_argument("--intermediate_dim", type=int, default=1024)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=6)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=4, help="B: prompts per step")
    parser.add_argument("--num_generations", type=int, default=8, help="G: completions per prompt")
    parser.add_argument("--prompt_len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"),
                        help="each prompt's length, drawn uniformly from MIN..MAX tokens")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no_rl_step", dest="rl_step", action="store_false",
                        help="time generation only, not the rest of an RL step")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat: checks the script")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.prompt_len[0] < 1 or args.prompt_len[0] > args.prompt_len[1]:
        parser.error(f"--prompt_len {args.prompt_len[0]} {args.prompt_len[1]}: need 1 <= MIN <= MAX")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    import transformers
    from transformers import GenerationConfig

    batch = Batch(args, device)
    rows, new = len(batch.rows), args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args)
        ours, theirs = load_models(Path(tmp), device, dtype)
    diff = check_same_model(ours, theirs, batch.prompts[0], device)
    params = sum(p.numel() for p in ours.parameters())
    print(f"{device.type} {args.dtype}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, transformers "
          f"{transformers.__version__}: Llama {args.num_layers} layers, width {args.embed_dim}, vocab "
          f"{args.vocab_size} ({params / 1e6:.1f}M parameters; largest logit difference {diff:.1e})")
    print(f"{args.prompts} prompts x {args.num_generations} samples = {rows} rows of {args.prompt_len[0]}-"
          f"{args.prompt_len[1]} prompt tokens, {new} new tokens each, temperature 1, no stop; median of "
          f"{args.repeats} after {args.warmup} warm-up", flush=True)

    settings = SamplingSettings(max_new_tokens=new, temperature=1.0, stop_tokens=())
    generation = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                  eos_token_id=None, pad_token_id=PAD_ID)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-6)
    rl = RLSettings(loss="grpo", max_new_tokens=new)

    def generate_ours(step: int) -> list[list[int]]:
        completions = sample_completions(ours, batch.rows, batch.seeds(step), settings=settings,
                                         cache_len=batch.cache_len, pad_id=PAD_ID)
        if any(len(c.tokens) != new for c in completions):
            raise SystemExit("rl_rollout.py: a completion of ours stopped early; the counts would not compare")
        return [c.tokens for c in completions]

    def generate_theirs() -> torch.Tensor:
        with torch.no_grad():
            out = theirs.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  generation_config=generation)
        if out.shape != (rows, batch.input_ids.shape[1] + new):
            raise SystemExit(f"rl_rollout.py: transformers returned {tuple(out.shape)}, not {rows} rows of "
                             f"{new} new tokens")
        return out

    def update(completions: list[list[int]]) -> None:
        advantages = torch.randn(rows, generator=torch.Generator().manual_seed(1)).tolist()
        rollouts = [rollout_batch(batch.rows, completions, advantages, pad_id=PAD_ID)]
        norm = normalizer(rl, num_sequences=rows, num_tokens=rows * new)
        rl_forward_backward(ours, rollouts, settings=rl, norm=norm, device=device, data_parallel_size=1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"ours": [], "transformers": [], "update": []}
    for repeat in range(args.warmup + args.repeats):
        completions, ours_s = timed(partial(generate_ours, repeat), device)
        _, theirs_s = timed(generate_theirs, device)
        update_s = timed(partial(update, completions), device)[1] if args.rl_step else 0.0
        if repeat >= args.warmup:
            for key, value in zip(times, (ours_s, theirs_s, update_s)):
                times[key].append(value)

    median = {key: statistics.median(values) if values else 0.0 for key, values in times.items()}
    tokens = rows * new
    print("\n| engine       | tokens/s | seconds per call | ours / it |\n|--------------|----------|"
          "------------------|-----------|")
    for engine in ("ours", "transformers"):
        ratio = median["transformers"] / median[engine]
        print(f"| {engine:<12} | {tokens / median[engine]:>8.0f} | {median[engine]:>16.3f} | {ratio:>8.2f}x |")
    if args.rl_step:
        step = median["ours"] + median["update"]
        print(f"\none RL step (ours: the rollout, then one grpo forward/backward and AdamW step on its {rows} "
              f"sequences): generation {median['ours']:.3f} s + update {median['update']:.3f} s; generation "
              f"{median['ours'] / step:.0%} of the step")


if __name__ == "__main__":
    main()
