"""Tokenizers and chat formats.

Every tokenizer follows :class:`ChatTokenizer`: ``encode``/``decode`` for text, ``tokenize_messages`` for
training conversations (tokens plus a per-token "trained on" mask) and ``prompt_tokens`` for generation.
"""

from toolkit.tokenizers.base import TRAIN_ON, ChatTokenizer
from toolkit.tokenizers.byte import ByteTokenizer, byte_tokenizer

__all__ = ["TRAIN_ON", "ByteTokenizer", "ChatTokenizer", "byte_tokenizer"]
