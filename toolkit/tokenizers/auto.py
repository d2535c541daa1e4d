"""Pick a model's tokenizer from the files of its Hugging Face folder."""

import re
from pathlib import Path

from toolkit.errors import UserError, read_json
from toolkit.tokenizers.chat_templates import ChatFormat
from toolkit.tokenizers.hf_json import (
    TokenizerJSONEngine,
    phi4_mini_tokenizer,
    phi4_tokenizer,
    qwen2_5_tokenizer,
    qwen3_tokenizer,
)
from toolkit.tokenizers.model_tokenizer import ModelTokenizer
from toolkit.tokenizers.sentencepiece import gemma_tokenizer, llama2_tokenizer, mistral_tokenizer
from toolkit.tokenizers.tiktoken_bpe import llama3_model_tokenizer, llama3_tokenizer

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+$")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "gemma", "gemma2", "gemma3", "gemma3_text", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe",
)
# Releases that share another family's tokenizer: mixtures of experts their dense family's, Gemma 3 Gemma 2's
# (a larger sentencepiece vocabulary with the same turn markers).
_SAME_TOKENIZER = {"mixtral": "mistral", "qwen3_moe": "qwen3", "gemma3": "gemma2", "gemma3_text": "gemma2"}


def _is_tiktoken(path: Path) -> bool:
    with path.open("rb") as f:
        return bool(_TIKTOKEN_LINE.match(f.readline().strip()))


def _read_json(path: Path) -> dict:
    # A missing file (or one that is not an object) says nothing; a broken one is the user's to fix.
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path) -> str:
    # transformers saves the template as chat_template.jinja (recent versions) or in tokenizer_config.json, as
    # one string or a list of named ones.
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = "".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def is_dated_llama3(folder: Path) -> bool:
    """Whether a Llama 3 folder is Llama 3.1, 3.2 or 3.3, whose chat template dates the system turn.

    The folder's chat template decides when it is a Llama 3 one: dated when it states "Cutting Knowledge
    Date", Llama 3.0's plain headers when it does not. Without such a template (base models, stripped folders)
    the architecture decides: 3.1+ introduced the ``llama3`` RoPE scaling (``config.json``'s
    ``rope_scaling.rope_type``, or ``use_scaled_rope`` in Meta's ``original/params.json``), which 3.0 lacks.
    """
    template = _chat_template(folder)
    if "Cutting Knowledge Date" in template:
        return True
    if "<|start_header_id|>" in template:
        return False
    rope = _read_json(folder / "config.json").get("rope_scaling")
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "llama3":
        return True
    return _read_json(folder / "original" / "params.json").get("use_scaled_rope") is True


def _llama(folder: Path, max_seq_len: int | None) -> ModelTokenizer:
    # Hub repos keep Meta's tiktoken file under original/; Llama 2 repos hold a sentencepiece tokenizer.model.
    for candidate in (folder / "original" / "tokenizer.model", folder / "tokenizer.model"):
        if candidate.is_file():
            if _is_tiktoken(candidate):
                return llama3_tokenizer(str(candidate), max_seq_len=max_seq_len, dated=is_dated_llama3(folder))
            return llama2_tokenizer(str(candidate), max_seq_len=max_seq_len)
    if (folder / "tokenizer.json").is_file():  # Llama 3 without Meta's file: the same vocabulary in HF's format
        return llama3_model_tokenizer(
            TokenizerJSONEngine(folder / "tokenizer.json"), max_seq_len=max_seq_len, dated=is_dated_llama3(folder)
        )
    raise UserError(f"{folder}: no tokenizer.model or tokenizer.json for this Llama checkpoint")


def _phi3(folder: Path, max_seq_len: int | None) -> ModelTokenizer:
    # model_type phi3 covers Phi-4 (<|im_sep|>), Phi-4-mini (byte-level BPE, <|user|>...<|end|>) and Phi-3/3.5, whose
    # <|user|>\n...<|end|>\n format comes with a sentencepiece-style vocabulary (byte fallback, no byte level).
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder}: no tokenizer.json for this phi3 checkpoint")
    text = path.read_text()
    if "<|im_sep|>" in text:
        return phi4_tokenizer(str(path), max_seq_len=max_seq_len)
    if "<|end|>" in text and '"ByteLevel"' in text:
        return phi4_mini_tokenizer(str(path), max_seq_len=max_seq_len)
    raise UserError(
        f"{path}: neither Phi-4's <|im_sep|> token nor Phi-4-mini's byte-level vocabulary with <|end|>: only their "
        "chat formats are supported for model_type 'phi3' (not Phi-3's or Phi-3.5's)"
    )

def from_pretrained(
    path: str, max_seq_len: int | None = None, chat_format: ChatFormat | None = None
) -> ModelTokenizer:
    """The tokenizer of a Hugging Face model folder, chosen by ``config.json``'s ``model_type``.

    Without a ``config.json``, the files decide: a tiktoken ``tokenizer.model`` is Llama 3, a ``tokenizer.json``
    with ``<|im_sep|>`` is Phi-4, one with ``<|end|>`` Phi-4-mini, one with ``<|im_start|>`` Qwen3, a sentencepiece
    model with ``<start_of_turn>`` is Gemma, one with ``[INST]`` Mistral, and any other sentencepiece model Llama 2. A
    Llama 3 folder gets Llama 3.1+'s dated chat format or Llama 3.0's as :func:`is_dated_llama3` tells.

    Args:
        path: the model folder.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
        chat_format: use this chat format instead of the one the folder implies (in a config, a
            ``_component_`` node such as ``toolkit.tokenizers.Qwen3ChatFormat`` with ``enable_thinking: false``).

    Raises:
        UserError: no tokenizer files, or a ``model_type`` without a tokenizer here (the message lists those).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"tokenizer path: {folder} is not a folder")
    tokenizer = _build(folder, max_seq_len)
    if chat_format is not None:
        tokenizer.chat_format = chat_format
    return tokenizer


def _build(folder: Path, max_seq_len: int | None) -> ModelTokenizer:
    model_type = _read_json(folder / "config.json").get("model_type")
    model_type = _SAME_TOKENIZER.get(model_type, model_type)
    sp_model = next((folder / n for n in ("tokenizer.model.v3", "tokenizer.model") if (folder / n).is_file()), None)
    if model_type is None:
        text = (folder / "tokenizer.json").read_text() if (folder / "tokenizer.json").is_file() else ""
        if "<|im_sep|>" in text or "<|end|>" in text:
            model_type = "phi3"
        elif "<|im_start|>" in text:
            model_type = "qwen3"
        elif sp_model is not None and not _is_tiktoken(sp_model):
            pieces = sp_model.read_bytes()
            model_type = "gemma2" if b"<start_of_turn>" in pieces else "mistral" if b"[INST]" in pieces else "llama"
        else:
            model_type = "llama"
    if model_type == "llama":
        return _llama(folder, max_seq_len)
    if model_type in ("qwen2", "qwen3"):
        build = qwen2_5_tokenizer if model_type == "qwen2" else qwen3_tokenizer
        return build(str(folder / "tokenizer.json"), max_seq_len=max_seq_len)
    if model_type == "phi3":
        return _phi3(folder, max_seq_len)
    if model_type in ("mistral", "gemma", "gemma2"):
        if sp_model is None:
            raise UserError(f"{folder}: no sentencepiece tokenizer.model for this {model_type} checkpoint")
        build = mistral_tokenizer if model_type == "mistral" else gemma_tokenizer
        return build(str(sp_model), max_seq_len=max_seq_len)
    raise UserError(
        f"{folder / 'config.json'}: no tokenizer for model_type {model_type!r}; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}; otherwise set `tokenizer` to one of its chat format (as the "
        "transformers_backend configs do)"
    )
