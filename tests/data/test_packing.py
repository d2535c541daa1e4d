"""Packing: plans, the block-diagonal mask, and a packed batch giving the same per-token losses as the documents
run one at a time."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from toolkit.data import (
    CROSS_ENTROPY_IGNORE_INDEX,
    chat_dataset,
    document_ids,
    pack_documents,
    packed_attention_mask,
    padded_collate,
    text_completion_dataset,
)
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3
from toolkit.tokenizers import byte_tokenizer
from toolkit.training import batch_attention_mask


@pytest.mark.parametrize("strategy", ["best_fit", "in_order"])
def test_every_document_once_and_no_pack_overflows(strategy: str) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    packs = pack_documents(lengths, 128, strategy=strategy)
    assert sorted(doc for pack in packs for doc in pack) == list(range(500))
    assert all(sum(lengths[d] for d in pack) <= 128 for pack in packs)
    if strategy == "in_order":
        assert [doc for pack in packs for doc in pack] == list(range(500))
        # Next-fit: a pack closes only when the following document would not fit.
        assert all(sum(lengths[d] for d in a) + lengths[b[0]] > 128 for a, b in zip(packs, packs[1:]))


def test_best_fit_packs_tighter_than_in_order() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 120) for _ in range(2000)]
    lower_bound = -(-sum(lengths) // 128)
    best, in_order = (len(pack_documents(lengths, 128, strategy=s)) for s in ("best_fit", "in_order"))
    assert lower_bound <= best < in_order
    assert best <= lower_bound * 1.02
    # Deterministic, so every rank and every resumed run sees the same packs.
    assert pack_documents(lengths, 128) == pack_documents(lengths, 128)


def test_pack_documents_rejects_bad_input() -> None:
    with pytest.raises(UserError, match="packing_strategy"):
        pack_documents([1], 8, strategy="random")
    with pytest.raises(ValueError, match="document 1 has 9 tokens"):
        pack_documents([1, 9], 8)


def test_mask_is_block_diagonal_causal() -> None:
    input_pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_ids(input_pos).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    mask = packed_attention_mask(input_pos)
    assert mask.shape == (2, 6, 6) and mask.dtype == torch.bool
    docs = document_ids(input_pos)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert mask[b, i, j] == (j <= i and docs[b, i] == docs[b, j])
    assert packed_attention_mask(input_pos[0]).shape == (6, 6)


def test_collate_of_packed_samples_pads_as_its_own_document() -> None:
    batch = [
        {"tokens": [1, 2, 3, 4], "labels": [2, -100, 4, -100], "input_pos": [0, 1, 0, 1]},
        {"tokens": [5, 6], "labels": [6, -100], "input_pos": [0, 1]},
    ]
    out = padded_collate(batch, pad_id=0, pad_to_multiple_of=4)
    assert out["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert out["labels"].tolist() == [[2, -100, 4, -100], [6, -100, -100, -100]]
    assert out["input_pos"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert torch.equal(out["mask"], packed_attention_mask(out["input_pos"]))
    # An unpacked sample in the same batch is one document.
    mixed = padded_collate([batch[0], {"tokens": [7, 8, 9], "labels": [8, 9, -100]}], pad_id=0)
    assert mixed["input_pos"][1].tolist() == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="input_pos"):
        padded_collate([{"tokens": [1, 2], "labels": [2, -100], "input_pos": [0]}], pad_id=0)


def _conversations(n: int) -> list[dict]:
    rng = random.Random(0)
    word = lambda: "".join(rng.choices("abcdefghij ", k=rng.randint(1, 30)))  # noqa: E731
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": word()}, {"role": "assistant", "content": word()}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": word()}, {"role": "assistant", "content": word()}]
        rows.append({"messages": messages})
    return rows


def _per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # [b, s]; 0 where the label is ignored.
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=CROSS_ENTROPY_IGNORE_INDEX, reduction="none")


def test_packed_batch_matches_documents_run_alone(tmp_path: Path) -> None:
    """No attention or loss crosses a document boundary.

    Per-token losses of a packed, padded batch equal those of each document run alone, unpadded, with plain
    causal attention. Tolerance 1e-5 in fp32: each document sees exactly the same keys at the same positions
    (masked scores get weight exactly 0), so only the accumulation order of matmuls of other shapes differs
    (observed <= 1e-6 on losses of ~5.6); a leak across a boundary moves them by ~0.1 (checked below, without
    the mask).
    """
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _conversations(12)))
    tokenizer = byte_tokenizer()
    options = dict(source=str(path), max_seq_len=128, train_on="all", cache_dir=None)
    documents = chat_dataset(tokenizer, **options)
    packed = chat_dataset(tokenizer, **options, packed=True)
    assert len(packed) < len(documents)  # several documents per pack

    batch = padded_collate([packed[i] for i in range(len(packed))], pad_id=tokenizer.pad_id, pad_to_multiple_of=8)
    torch.manual_seed(0)
    model = llama3(
        vocab_size=300, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=128
    ).eval()
    with torch.no_grad():
        logits = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
        packed_loss = _per_token_loss(logits, batch["labels"])
        # FlexAttention's block masks (on CUDA, the recipes' default) give the same losses (forward only on CPU).
        flex = batch_attention_mask(batch, flex_attention=True)
        flex_loss = _per_token_loss(model(batch["tokens"], mask=flex, input_pos=batch["input_pos"]), batch["labels"])
        torch.testing.assert_close(flex_loss, packed_loss, rtol=0, atol=1e-5)
        leaky_loss = _per_token_loss(model(batch["tokens"]), batch["labels"])

        seen = []
        leak = 0.0
        for row in range(len(packed)):
            n = len(packed[row]["tokens"])
            docs = document_ids(batch["input_pos"][row, :n])
            for doc in docs.unique().tolist():
                at = (docs == doc).nonzero().squeeze(1)
                tokens, labels = batch["tokens"][row, at], batch["labels"][row, at]
                seen.append(tokens.tolist())
                alone = _per_token_loss(model(tokens[None]), labels[None])[0]
                torch.testing.assert_close(packed_loss[row, at], alone, rtol=0, atol=1e-5)
                assert labels[-1] == CROSS_ENTROPY_IGNORE_INDEX  # no target across the boundary
                leak = max(leak, (leaky_loss[row, at] - alone).abs().max().item())
    # The packs hold exactly the documents, each once, and the padding carries no loss.
    assert sorted(seen) == sorted(documents[i]["tokens"] for i in range(len(documents)))
    assert (batch["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum() == sum(
        sum(label != CROSS_ENTROPY_IGNORE_INDEX for label in documents[i]["labels"]) for i in range(len(documents))
    )
    assert leak > 1e-3  # without the mask, later documents attend to earlier ones: the check above has teeth


def test_packing_efficiency_and_options(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    rng = random.Random(0)
    path.write_text("".join("x" * rng.randint(5, 60) + "\n" for _ in range(300)))
    tokenizer = byte_tokenizer()
    packed = text_completion_dataset(tokenizer, source=str(path), max_seq_len=64, packed=True, cache_dir=None)
    assert all(len(packed[i]["tokens"]) <= 64 for i in range(len(packed)))
    assert packed.num_tokens() / (len(packed) * 64) > 0.95
    with pytest.raises(UserError, match="packed: true needs a max_seq_len"):
        text_completion_dataset(tokenizer, source=str(path), packed=True, cache_dir=None)
    with pytest.raises(UserError, match="packing_strategy"):
        text_completion_dataset(tokenizer, source=str(path), max_seq_len=64, packed=True, packing_strategy="x")
