"""sentencepiece vocabularies: Llama 2, Mistral 7B and Gemma ``tokenizer.model`` files."""

from pathlib import Path

import sentencepiece as spm

from toolkit.errors import UserError
from toolkit.tokenizers.chat_templates import GemmaChatFormat, Llama2ChatFormat, MistralChatFormat
from toolkit.tokenizers.model_tokenizer import ModelTokenizer

# sentencepiece's ModelProto: field 1 holds the pieces, and a piece's field 3 its type (4: user-defined).
_PIECES_FIELD, _TYPE_FIELD, _USER_DEFINED = 1, 3, 4


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes):
    # Minimal protobuf reader (varint, 64-bit, length-delimited, 32-bit): enough to walk a ModelProto without
    # depending on protobuf, which the sentencepiece wheel does not require.
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def user_defined_ids(model_proto: bytes) -> list[int]:
    """Ids of the user-defined pieces (Gemma's ``<start_of_turn>``...), which the Python API does not flag."""
    pieces = (value for field, value in _fields(model_proto) if field == _PIECES_FIELD)
    return [
        i for i, piece in enumerate(pieces)
        if any(field == _TYPE_FIELD and value == _USER_DEFINED for field, value in _fields(piece))
    ]


class SentencePieceEngine:
    """Text to ids with a sentencepiece model; its control and user-defined pieces are the special tokens.

    Args:
        path: the ``tokenizer.model`` file.

    Raises:
        UserError: the file is missing or not a sentencepiece model.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: tokenizer file not found")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise UserError(f"{path}: not a sentencepiece model ({e})") from None
        sp = self._sp
        special = [i for i in range(sp.GetPieceSize()) if sp.IsControl(i)]
        special += user_defined_ids(sp.serialized_model_proto())
        self._special_ids = {i: sp.IdToPiece(i) for i in sorted(special)}
        self._specials = {piece: i for i, piece in self._special_ids.items()}

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def special_ids(self) -> dict[int, str]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds(ids)

    def token_to_id(self, token: str) -> int | None:
        # The unknown piece is a control-like piece sentencepiece does not flag; Llama 2 pads with it.
        if token == self._sp.IdToPiece(self._sp.unk_id()):
            return self._sp.unk_id()
        return self._specials.get(token)


def llama2_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Llama 2's tokenizer (``[INST]`` chat format) from its sentencepiece ``tokenizer.model``.

    Args:
        path: the sentencepiece model.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    return ModelTokenizer(
        engine=SentencePieceEngine(path), chat_format=Llama2ChatFormat(), bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", stop_tokens=["</s>"], max_seq_len=max_seq_len,
    )


def mistral_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Mistral's and Mixtral's tokenizer from its sentencepiece model, with the instruct format its vocabulary
    implies: ``[INST]``/``[/INST]`` as control tokens where it has them (v3: Mistral 7B v0.3, Mixtral 8x22B), as
    text where it does not (the first vocabulary: Mistral 7B v0.1/v0.2, Mixtral 8x7B).

    Args:
        path: the sentencepiece model (``tokenizer.model`` or ``tokenizer.model.v3``).
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    engine = SentencePieceEngine(path)
    chat_format = MistralChatFormat(control_tokens=engine.token_to_id("[INST]") is not None)
    return ModelTokenizer(
        engine=engine, chat_format=chat_format, bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", stop_tokens=["</s>"], max_seq_len=max_seq_len,
    )


def gemma_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Gemma's tokenizer (``<start_of_turn>`` chat format) from its sentencepiece ``tokenizer.model``.

    Args:
        path: the sentencepiece model.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    return ModelTokenizer(
        engine=SentencePieceEngine(path), chat_format=GemmaChatFormat(), bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", stop_tokens=["<end_of_turn>", "<eos>"], max_seq_len=max_seq_len,
    )
