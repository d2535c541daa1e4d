"""tiktoken byte-level BPE vocabularies (Llama 3's ``tokenizer.model``: one ``<base64 token> <rank>`` per line)."""

import base64
from pathlib import Path

import tiktoken

from toolkit.errors import UserError
from toolkit.tokenizers.chat_templates import LLAMA3_DEFAULT_DATE, Llama3ChatFormat
from toolkit.tokenizers.model_tokenizer import ModelTokenizer, TextEngine

# Llama 3's pre-tokenization: contractions, letter runs, digit groups of at most three, punctuation runs, newline
# runs and other whitespace (from Meta's Llama 3 tokenizer).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3.1's 256 special tokens, in id order after the 128,000 BPE ranks; unnamed slots are reserved.
_LLAMA3_NAMED = {
    0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>",
}


def llama3_special_tokens(num_reserved: int = 256) -> list[str]:
    """Llama 3's special tokens in id order (the reserved ones numbered as in Meta's release)."""
    tokens = []
    reserved = 0
    for i in range(num_reserved):
        if i in _LLAMA3_NAMED:
            tokens.append(_LLAMA3_NAMED[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def load_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file.

    Raises:
        UserError: the file is missing or a line is not ``<base64> <int>``.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise UserError(f"{path}:{line_no}: not a tiktoken BPE line ('<base64 token> <rank>')") from None
    return ranks


class TiktokenEngine:
    """Text to ids with tiktoken; special tokens get the ids after the BPE ranks.

    Args:
        path: the rank file.
        pattern: the pre-tokenization regex.
        special_tokens: special tokens in id order.
    """

    def __init__(self, path: str | Path, *, pattern: str, special_tokens: list[str]) -> None:
        ranks = load_bpe_ranks(path)
        specials = {token: len(ranks) + i for i, token in enumerate(special_tokens)}
        self._encoding = tiktoken.Encoding(
            name=Path(path).name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        self._specials = specials
        self._special_ids = {i: token for token, i in specials.items()}

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def special_ids(self) -> dict[int, str]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: special-token strings in text are plain text.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self._specials.get(token)


def llama3_model_tokenizer(
    engine: TextEngine, *, max_seq_len: int | None, dated: bool, date_string: str = LLAMA3_DEFAULT_DATE
) -> ModelTokenizer:
    """Llama 3.x's special tokens and chat format on a vocabulary engine (tiktoken or Hugging Face's file)."""
    return ModelTokenizer(
        engine=engine,
        chat_format=Llama3ChatFormat(dated=dated, date_string=date_string),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
        stop_tokens=["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"],
        max_seq_len=max_seq_len,
    )


def llama3_tokenizer(
    path: str, max_seq_len: int | None = None, *, dated: bool = False, date_string: str = LLAMA3_DEFAULT_DATE
) -> ModelTokenizer:
    """Llama 3.x's tokenizer from its tiktoken ``tokenizer.model`` (``original/tokenizer.model`` in hub repos).

    Args:
        path: the rank file.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
        dated: Llama 3.1/3.2/3.3's chat format, whose system turn states a knowledge cutoff and a date;
            ``False`` is Llama 3.0's (see :class:`~toolkit.tokenizers.chat_templates.Llama3ChatFormat`).
        date_string: the date that turn states.
    """
    engine = TiktokenEngine(path, pattern=LLAMA3_PATTERN, special_tokens=llama3_special_tokens())
    return llama3_model_tokenizer(engine, max_seq_len=max_seq_len, dated=dated, date_string=date_string)
