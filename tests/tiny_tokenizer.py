"""A byte-level BPE tokenizer trained in a moment on a few strings, with ChatML's special tokens (Qwen's layout, or
Phi-4's) or Phi-4-mini's, for the tests that build a tiny Hugging Face checkpoint folder of their own."""

from collections.abc import Iterable


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
