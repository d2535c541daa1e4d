"""A byte-level BPE tokenizer trained in a moment on a few strings, with ChatML's special tokens (Qwen's layout),
for the tests that build a tiny Hugging Face checkpoint folder of their own."""

from collections.abc import Iterable


def chatml_byte_level_bpe(texts: Iterable[str], *, vocab_size: int):
    """A ``tokenizers.Tokenizer`` trained on ``texts``: byte-level BPE, ``<|endoftext|>``, ``<|im_start|>`` and
    ``<|im_end|>`` as ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
