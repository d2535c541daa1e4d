"""FlexAttention block masks (DocumentMasks) against SDPA with dense masks and Gemma 2's explicit soft-capped scores.

On the CPU PyTorch runs FlexAttention forward only (unfused, no backward), so the CPU tests compare forward
passes without gradients: same logits, for packed rows with several documents and padding, sliding windows and
soft-capping. The gradients are compared on CUDA, in the test marked ``gpu``.
"""

import importlib.util

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from toolkit.data import packed_attention_mask, padded_collate
from toolkit.errors import UserError
from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3
from toolkit.models.mistral import mistral
from toolkit.modules import DocumentMasks, KVCache
from toolkit.training import batch_attention_mask, resolve_flex_attention
from toolkit.training.compile import compile_model

VOCAB, MAX_SEQ_LEN = 96, 512
# Heads of 16 features: the least FlexAttention's CUDA kernels take.
SMALL = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=48,
             max_seq_len=MAX_SEQ_LEN)
MODELS = {
    "llama3": lambda: llama3(**SMALL),
    # Windows shorter than the documents, so the band cuts into them and block masks differ per layer.
    "mistral": lambda: mistral(**SMALL, head_dim=16, sliding_window=37),
    "gemma2": lambda: gemma2(**SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=37, attn_logit_softcap=2.0),
}


def model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = MODELS[name]()
    for p in m.parameters():  # random weights at a scale that makes the soft-cap bite (scores beyond +-cap)
        torch.nn.init.normal_(p, std=0.3)
    return m.eval()


def packed_batch(documents: list[list[int]]) -> dict[str, torch.Tensor]:
    """A batch of packed rows, one per entry of ``documents`` (each a list of document lengths), right-padded to
    the longest row, without the dense mask (as the recipes collate it)."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for lengths in documents:
        n = sum(lengths)
        tokens = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
        samples.append({"tokens": tokens, "labels": tokens, "input_pos": [p for k in lengths for p in range(k)]})
    return padded_collate(samples, pad_id=0, attention_mask=False)


# Rows that span several 128-position blocks: whole blocks are masked (skipped by FlexAttention), some partly.
DOCUMENTS = [[130, 70, 1, 99], [260, 20]]  # the second row ends in 20 padding positions, a document of its own


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_rows_match_sdpa_with_the_dense_mask(name):
    m, batch = model(name), packed_batch(DOCUMENTS)
    with torch.no_grad():
        dense = batch_attention_mask(batch, flex_attention=False)
        assert dense.shape == (2, 300, 300)
        expected = m(batch["tokens"], mask=dense, input_pos=batch["input_pos"])
        flex = batch_attention_mask(batch, flex_attention=True)
        got = m(batch["tokens"], mask=flex, input_pos=batch["input_pos"])
    # fp32 on both sides; measured within 3e-6 (different summation order), logits of order 10.
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    windows = {layer.self_attn.sliding_window for layer in m.layers}
    assert set(flex._block_masks) == windows  # one block mask per window, shared by the layers that have it
    # Blocks of 128 x 128 computed per query block: the first row's last query block (positions 256..299, all in
    # its last document, 201..299) skips key block 0, which causality alone would keep; the second row's does not.
    block_mask = flex.block_mask(None)
    computed = block_mask.kv_num_blocks + block_mask.full_kv_num_blocks  # partly masked + not masked at all
    assert computed[:, 0].tolist() == [[1, 2, 2], [1, 2, 3]]


def test_a_document_mask_is_causal_within_documents_and_its_window():
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    block_mask = DocumentMasks(docs, seq_len=8, device="cpu").block_mask(sliding_window=2)
    q, kv = torch.arange(8)[:, None], torch.arange(8)[None, :]
    expected = (kv <= q) & (docs[0][:, None] == docs[0][None, :]) & (q - kv < 2)
    assert torch.equal(block_mask.to_dense()[0, 0], torch.ones(1, 1, dtype=torch.int32))  # one 128-block: kept
    got = torch.stack([block_mask.mask_mod(torch.tensor(0), torch.tensor(0), i, kv[0]) for i in range(8)])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_unpacked_rows_with_windows_or_softcap_match_the_sdpa_path(name):
    m = model(name)
    tokens = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(2))
    batch = {"tokens": tokens}
    with torch.no_grad():
        expected = m(tokens, mask=batch_attention_mask(batch, flex_attention=False))
        got = m(tokens, mask=batch_attention_mask(batch, flex_attention=True))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_heads_too_narrow_for_flex_kernels_get_sdpa_masks(name):
    # 8 features per head: FlexAttention's GPU kernels need 16, so these layers get the dense mask (or None).
    torch.manual_seed(0)
    narrow = {"llama3": lambda: llama3(**(SMALL | {"embed_dim": 32})),
              "gemma2": lambda: gemma2(**SMALL, head_dim=8, query_pre_attn_scalar=8, sliding_window=37,
                                       attn_logit_softcap=2.0)}[name]().eval()
    batch = packed_batch(DOCUMENTS)
    masks = batch_attention_mask(batch, flex_attention=True)
    assert all(torch.equal(masks.for_layer(layer.self_attn), packed_attention_mask(batch["input_pos"]))
               for layer in narrow.layers)
    with torch.no_grad():
        expected = narrow(batch["tokens"], mask=batch_attention_mask(batch, flex_attention=False),
                          input_pos=batch["input_pos"])
        torch.testing.assert_close(narrow(batch["tokens"], mask=masks, input_pos=batch["input_pos"]), expected,
                                   atol=0, rtol=0)
    assert not masks._block_masks
    unpacked = batch_attention_mask({"tokens": batch["tokens"]}, flex_attention=True)
    assert all(unpacked.for_layer(layer.self_attn) is None for layer in narrow.layers)


def test_plain_causal_layers_keep_sdpa():
    m = model("llama3")
    masks = batch_attention_mask({"tokens": torch.zeros(2, 16, dtype=torch.long)}, flex_attention=True)
    assert all(masks.for_layer(layer.self_attn) is None for layer in m.layers)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(m(tokens, mask=masks), m(tokens))
    assert not masks._block_masks


def test_compiled_layers_take_block_masks():
    # Dynamo traces the layers with a BlockMask argument (compile: true with FlexAttention, as on CUDA).
    torch._dynamo.reset()
    try:
        eager, compiled = model("gemma2"), model("gemma2")
        compile_model(compiled, device=torch.device("cpu"))
        batch = packed_batch(DOCUMENTS)
        with torch.no_grad():
            expected = eager(batch["tokens"], mask=batch_attention_mask(batch, flex_attention=False),
                             input_pos=batch["input_pos"])
            got = compiled(batch["tokens"], mask=batch_attention_mask(batch, flex_attention=True),
                           input_pos=batch["input_pos"])
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def test_new_documents_do_not_recompile():
    # Every batch brings new block masks (and mask functions over its document ids): the same compiled graphs serve.
    torch._dynamo.reset()
    try:
        m, counter = model("gemma2"), CompileCounter()
        compile_model(m, device=torch.device("cpu"), backend=counter)
        frames = []
        with torch.no_grad():
            for documents in (DOCUMENTS, [[100, 200], [50, 250]], [[300], [299, 1]]):
                batch = packed_batch(documents)
                m(batch["tokens"], mask=batch_attention_mask(batch, flex_attention=True), input_pos=batch["input_pos"])
                frames.append(counter.frame_count)
        assert frames == [2, 2, 2]  # one graph per layer (a windowed and a global one), compiled by the first batch
    finally:
        torch._dynamo.reset()


def test_the_dense_mask_built_on_the_device_equals_the_collated_one():
    batch = packed_batch(DOCUMENTS)
    assert "mask" not in batch
    collated = padded_collate(
        [{"tokens": [1] * 5, "labels": [1] * 5, "input_pos": [0, 1, 0, 1, 2]}, {"tokens": [1] * 3, "labels": [1] * 3}],
        pad_id=0,
    )
    rebuilt = batch_attention_mask({k: v for k, v in collated.items() if k != "mask"}, flex_attention=False)
    assert torch.equal(rebuilt, collated["mask"])
    # Unpacked rows: causal (None), or the batch's own mask as it is.
    assert batch_attention_mask({"tokens": torch.zeros(1, 4)}, flex_attention=False) is None
    own = torch.ones(4, 4, dtype=torch.bool).tril()
    assert batch_attention_mask({"tokens": torch.zeros(1, 4), "mask": own}, flex_attention=True) is own


def test_a_kv_cache_refuses_a_block_mask():
    m = model("llama3")
    attn = m.layers[0].self_attn
    attn.kv_cache = KVCache(batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    block_mask = DocumentMasks(None, seq_len=4, device="cpu").block_mask()
    with pytest.raises(ValueError, match="KV cache"):
        attn(torch.zeros(1, 4, 64), mask=block_mask, input_pos=torch.arange(4))


def test_resolve_flex_attention(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_flex_attention("auto", cpu) is False
    assert resolve_flex_attention(False, cuda) is False
    with pytest.raises(UserError, match="CUDA"):
        resolve_flex_attention(True, cpu)
    with pytest.raises(UserError, match="auto, true or false"):
        resolve_flex_attention("yes", cpu)
    # On CUDA, auto needs what compiles FlexAttention's kernels: Triton (and a C compiler for its launcher).
    find_spec = importlib.util.find_spec
    for triton in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (find_spec("torch") if triton else None) if name == "triton"
                            else find_spec(name, *a))
        monkeypatch.setenv("CC", "cc")
        assert resolve_flex_attention(None, cuda) is triton
        if triton:
            assert resolve_flex_attention(True, cuda) is True
        else:
            with pytest.raises(UserError, match=r"flex_attention: .*needs Triton .*set flex_attention=false"):
                resolve_flex_attention(True, cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama3", "gemma2"])  # Gemma 2 has windows, soft-caps and a global layer
def test_gradients_match_sdpa_on_cuda(name):
    # Compiled FlexAttention (forward and backward) against SDPA with the dense mask / explicit soft-capped scores.
    results = []
    for flex in (False, True):
        m = model(name).cuda().train()
        batch = {k: v.cuda() for k, v in packed_batch(DOCUMENTS).items()}
        logits = m(batch["tokens"], mask=batch_attention_mask(batch, flex_attention=flex), input_pos=batch["input_pos"])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
        results.append((logits.detach(), [p.grad for p in m.parameters()]))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # fp32 (TF32 off by default for matmuls)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-3)
