"""The tokenized-dataset cache: hits, misses on any change of source, tokenizer or options, one build for
concurrent processes, no half-written stores, and datasets that travel to DataLoader workers."""

import json
import os
import pickle
import threading
import time
from functools import partial
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from toolkit.data import GlobalBatchSampler, chat_dataset, padded_collate
from toolkit.errors import UserError
from toolkit.tokenizers import ByteTokenizer

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}" * (i % 7 + 1)}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(40)
]


class CountingTokenizer(ByteTokenizer):
    """Counts conversations tokenized (shared by its copies); optionally slow, to make builds overlap."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.calls = [0]
        self.delay_s = delay_s

    def tokenize_messages(self, messages: list[dict], **kwargs) -> tuple[list[int], list[bool]]:
        self.calls[0] += 1
        time.sleep(self.delay_s)
        return super().tokenize_messages(messages, **kwargs)


PROBES = 3  # tokenize_messages calls of the tokenizer fingerprint (one per train_on)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_hit_after_miss_and_miss_on_any_change(tmp_path: Path, source: Path) -> None:
    cache = str(tmp_path / "cache")
    tokenizer = CountingTokenizer()
    build = partial(chat_dataset, tokenizer, source=str(source), max_seq_len=64, cache_dir=cache)

    first = build()
    assert not first.cache_hit and tokenizer.calls[0] == PROBES + len(ROWS)
    second = build()
    assert second.cache_hit and tokenizer.calls[0] == 2 * PROBES + len(ROWS)  # nothing tokenized
    assert [second[i] for i in range(len(ROWS))] == [first[i] for i in range(len(ROWS))]
    assert build(packed=True).cache_hit  # packing reuses the tokenized samples

    assert not build(train_on="last_turn").cache_hit
    assert not build(max_seq_len=48).cache_hit
    assert not build(system_prompt="S").cache_hit
    other = CountingTokenizer()
    other.start_header_id = other.eot_id  # same class, different output: the probe tells them apart
    assert not chat_dataset(other, source=str(source), max_seq_len=64, cache_dir=cache).cache_hit

    # The source's modification time (or size) changing is a miss, even with identical content.
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert not build().cache_hit
    assert build().cache_hit


def test_concurrent_builders_tokenize_once(tmp_path: Path, source: Path) -> None:
    # Threads stand in for a node's torchrun ranks: the file lock is per open file, not per process.
    tokenizer = CountingTokenizer(delay_s=0.002)
    results: list = []
    threads = [
        threading.Thread(
            target=lambda: results.append(chat_dataset(tokenizer, source=str(source), cache_dir=str(tmp_path / "c")))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(d.cache_hit for d in results) == [False, True]
    assert tokenizer.calls[0] == 2 * PROBES + len(ROWS)


def test_failed_build_leaves_no_store(tmp_path: Path, source: Path) -> None:
    cache = tmp_path / "cache"
    with open(source, "a") as f:
        f.write('{"messages": []}\n')
    with pytest.raises(UserError, match="line 41: empty conversation"):
        chat_dataset(ByteTokenizer(), source=str(source), cache_dir=str(cache))
    assert not [p for p in cache.iterdir() if p.is_dir()]  # no store, no temporary folder
    # Fixing the file (a new modification time) builds it.
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert len(chat_dataset(ByteTokenizer(), source=str(source), cache_dir=str(cache))) == len(ROWS)


def test_cached_dataset_pickles_as_a_path_and_serves_workers(tmp_path: Path, source: Path) -> None:
    tokenizer = ByteTokenizer()
    cache = str(tmp_path / "cache")
    dataset = chat_dataset(tokenizer, source=str(source), cache_dir=cache, packed=True, max_seq_len=48)
    blob = pickle.dumps(dataset)
    assert len(blob) < 2000  # the arrays stay on disk; workers map them
    restored = pickle.loads(blob)
    assert [restored[i] for i in range(len(dataset))] == [dataset[i] for i in range(len(dataset))]

    def batches(num_workers: int) -> list:
        sampler = GlobalBatchSampler(len(dataset), global_batch_size=4, seed=3)
        collate = partial(padded_collate, pad_id=tokenizer.pad_id)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate, num_workers=num_workers)
        return [{k: v.tolist() for k, v in batch.items()} for batch in loader]

    assert batches(2) == batches(0)
