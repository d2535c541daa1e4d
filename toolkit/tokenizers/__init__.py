"""Tokenizers and chat formats.

Every tokenizer follows :class:`ChatTokenizer`: ``encode``/``decode`` for text, ``tokenize_messages`` for
training conversations (tokens plus a per-token "trained on" mask) and ``prompt_tokens`` for generation.
:class:`ByteTokenizer` needs no files; the model families' tokenizers compose a vocabulary engine (tiktoken,
sentencepiece, ``tokenizer.json``) with the model's chat format (:mod:`toolkit.tokenizers.chat_templates`), and
:func:`from_pretrained` picks the right one for a Hugging Face model folder.
"""

from toolkit.tokenizers.auto import from_pretrained
from toolkit.tokenizers.base import TRAIN_ON, ChatTokenizer
from toolkit.tokenizers.byte import ByteTokenizer, byte_tokenizer
from toolkit.tokenizers.chat_templates import Llama3ChatFormat, Phi4ChatFormat, Phi4MiniChatFormat, Qwen3ChatFormat
from toolkit.tokenizers.hf_json import phi4_mini_tokenizer, phi4_tokenizer, qwen2_5_tokenizer, qwen3_tokenizer
from toolkit.tokenizers.model_tokenizer import ModelTokenizer
from toolkit.tokenizers.sentencepiece import gemma_tokenizer, llama2_tokenizer, mistral_tokenizer
from toolkit.tokenizers.tiktoken_bpe import llama3_tokenizer

__all__ = [
    "TRAIN_ON",
    "ByteTokenizer",
    "ChatTokenizer",
    "Llama3ChatFormat",
    "ModelTokenizer",
    "Phi4ChatFormat",
    "Phi4MiniChatFormat",
    "Qwen3ChatFormat",
    "byte_tokenizer",
    "from_pretrained",
    "gemma_tokenizer",
    "llama2_tokenizer",
    "llama3_tokenizer",
    "mistral_tokenizer",
    "phi4_mini_tokenizer",
    "phi4_tokenizer",
    "qwen2_5_tokenizer",
    "qwen3_tokenizer",
]
