"""Data pipeline throughput: tokenized samples per second, and packing efficiency (fraction of non-pad tokens).

    python benchmarks/data_throughput.py                    # 100k synthetic conversations, max_seq_len 2048
    python benchmarks/data_throughput.py --num_samples 1000000 --max_seq_len 4096

Writes a synthetic JSONL corpus of chat samples (prompt and response lengths drawn from log-normal distributions,
as in instruction data: mostly short, a long tail), then measures with the byte tokenizer:

* the build pass: reading, checking, tokenizing and writing the cache, in samples/s and tokens/s;
* loading it back from the cache (the cost every later run pays instead);
* serving batches through a DataLoader (sample slicing, labels, collation with the attention mask);
* packing efficiency, non-pad tokens / batch tokens, for padded batches in random order (what training without
  packing sees), for ``in_order`` (next-fit) packing and for ``best_fit`` packing.

Numbers depend on the machine; the efficiency figures do not. Not a test: it prints a table.
"""

import argparse
import json
import logging
import math
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from toolkit.data import GlobalBatchSampler, chat_dataset, padded_collate
from toolkit.tokenizers import byte_tokenizer

_WORDS = "the of and to in is that for it as with was on be by this are from at or an have not which".split()


def write_corpus(path: Path, num_samples: int, seed: int) -> None:
    """Synthetic conversations with log-normal prompt and response lengths (in words)."""
    rng = random.Random(seed)

    def text(median_words: float) -> str:
        n = max(1, min(2000, int(rng.lognormvariate(math.log(median_words), 1.0))))
        return " ".join(rng.choices(_WORDS, k=n))

    with open(path, "w") as f:
        for _ in range(num_samples):
            messages = [{"role": "user", "content": text(20)}, {"role": "assistant", "content": text(60)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_samples", type=int, default=100_000)
    parser.add_argument("--max_seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per batch for the efficiency rows")
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader workers for the serving row")
    parser.add_argument("--serve_batches", type=int, default=100, help="batches timed for the serving row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # The table reports truncation itself; the per-build warnings would only interleave with it.
    logging.getLogger("toolkit.data").setLevel(logging.ERROR)
    tokenizer = byte_tokenizer()
    rows = []

    with tempfile.TemporaryDirectory() as tmp:
        corpus, cache = Path(tmp) / "corpus.jsonl", str(Path(tmp) / "cache")
        write_corpus(corpus, args.num_samples, args.seed)
        size_mb = corpus.stat().st_size / 2**20
        options = dict(source=str(corpus), max_seq_len=args.max_seq_len, cache_dir=cache)

        start = time.perf_counter()
        dataset = chat_dataset(tokenizer, **options)
        elapsed = time.perf_counter() - start
        num_tokens = int(dataset.store.offsets[-1])
        rows.append(("tokenize + cache (build pass)", f"{len(dataset) / elapsed:,.0f} samples/s",
                     f"{num_tokens / elapsed / 1e6:.2f}M tokens/s, {elapsed:.1f} s for {size_mb:.0f} MB"))

        start = time.perf_counter()
        cached = chat_dataset(tokenizer, **options)
        elapsed = time.perf_counter() - start
        assert cached.cache_hit
        rows.append(("load from cache", f"{elapsed * 1e3:.0f} ms", "memory-mapped, nothing tokenized"))

        for strategy in ("in_order", "best_fit"):
            start = time.perf_counter()
            packed = chat_dataset(tokenizer, **options, packed=True, packing_strategy=strategy)
            elapsed = time.perf_counter() - start
            rows.append((f"plan packing ({strategy})", f"{len(dataset) / elapsed:,.0f} samples/s",
                         f"{len(dataset):,} samples into {len(packed):,} packs of {args.max_seq_len}"))

        sampler = GlobalBatchSampler(len(packed), global_batch_size=args.batch_size, seed=args.seed)
        loader = DataLoader(
            packed, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
            collate_fn=partial(padded_collate, pad_id=tokenizer.pad_id, pad_to_multiple_of=args.max_seq_len),
        )
        start, served = time.perf_counter(), 0
        for i, batch in enumerate(loader):
            served += batch["tokens"].shape[0]
            if i == args.serve_batches:
                break
        elapsed = time.perf_counter() - start
        rows.append((f"serve packed batches ({args.num_workers} workers)", f"{served / elapsed:,.0f} packs/s",
                     f"{served * args.max_seq_len / elapsed / 1e6:.2f}M tokens/s incl. the [b, s, s] mask"))

        print(f"\n{args.num_samples:,} synthetic conversations, byte tokenizer, max_seq_len {args.max_seq_len}, "
              f"{num_tokens / len(dataset):.0f} tokens per sample on average, {dataset.report.truncated} truncated\n")
        width = max(len(r[0]) for r in rows)
        print(f"{'stage':<{width}}  {'rate':>18}  detail")
        for name, rate, detail in rows:
            print(f"{name:<{width}}  {rate:>18}  {detail}")

        title = "packing efficiency (non-pad / all tokens)"
        print(f"\n{title:<{width}}  {'fraction':>18}  batches of {args.batch_size}")
        unpacked_eff = padding_efficiency(dataset, args.batch_size, tokenizer.pad_id, args.seed)
        print(f"{'padded, no packing':<{width}}  {unpacked_eff:>18.1%}  padded to the longest in each batch")
        for strategy in ("in_order", "best_fit"):
            packed = chat_dataset(tokenizer, **options, packed=True, packing_strategy=strategy)
            eff = packed.num_tokens() / (len(packed) * args.max_seq_len)
            print(f"{'packed, ' + strategy:<{width}}  {eff:>18.1%}  every pack padded to {args.max_seq_len}")


def padding_efficiency(dataset, batch_size: int, pad_id: int, seed: int) -> float:
    """Non-pad fraction of padded batches in shuffled order, from the lengths alone (no collation needed)."""
    lengths = dataset.store.lengths()
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
    batches = lengths[order[: len(order) // batch_size * batch_size]].view(-1, batch_size)
    return float(batches.sum() / (batches.max(dim=1).values.sum() * batch_size))


if __name__ == "__main__":
    main()
