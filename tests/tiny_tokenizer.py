"""Tokenizers trained in a moment on a few strings, for the tests that build a tiny Hugging Face checkpoint folder of
their own: a byte-level BPE with ChatML's special tokens (Qwen's layout, or Phi-4's) or Phi-4-mini's, and a
sentencepiece model in Gemma's layout."""

import io
from collections.abc import Iterable
from pathlib import Path


CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PHI4_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>")
PHI4_MINI_SPECIALS = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>")


def chatml_byte_level_bpe(texts: Iterable[str], *, vocab_size: int, special_tokens: Iterable[str] = CHATML_SPECIALS):
    """A ``tokenizers.Tokenizer`` trained on ``texts``: byte-level BPE with ``special_tokens`` as the first ids
    (by default ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``; Phi-4's add ``<|im_sep|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def gemma_sentencepiece(texts: Iterable[str], path: Path, *, vocab_size: int) -> None:
    """Write to ``path`` a sentencepiece BPE model trained on ``texts`` with Gemma's special pieces: ``<pad>``,
    ``<eos>``, ``<bos>``, ``<unk>`` as ids 0 to 3, and the turn markers ``<start_of_turn>`` and ``<end_of_turn>``
    as user-defined pieces (byte fallback: any text encodes)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, add_dummy_prefix=False, minloglevel=2, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
    )
    Path(path).write_bytes(model.getvalue())
