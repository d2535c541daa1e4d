"""Pick a model's tokenizer from the files of its Hugging Face folder."""

import json
import re
from pathlib import Path

from toolkit.errors import UserError
from toolkit.tokenizers.chat_templates import Llama3ChatFormat
from toolkit.tokenizers.hf_json import TokenizerJSONEngine, qwen2_5_tokenizer, qwen3_tokenizer
from toolkit.tokenizers.model_tokenizer import ModelTokenizer
from toolkit.tokenizers.sentencepiece import gemma_tokenizer, llama2_tokenizer, mistral_tokenizer
from toolkit.tokenizers.tiktoken_bpe import llama3_tokenizer

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+$")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("gemma", "gemma2", "llama", "mistral", "qwen2", "qwen3")


def _is_tiktoken(path: Path) -> bool:
    with path.open("rb") as f:
        return bool(_TIKTOKEN_LINE.match(f.readline().strip()))


def _model_type(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise UserError(f"{config}: not valid JSON ({e})") from None


def _llama(folder: Path, max_seq_len: int | None) -> ModelTokenizer:
    # Hub repos keep Meta's tiktoken file under original/; Llama 2 repos hold a sentencepiece tokenizer.model.
    for candidate in (folder / "original" / "tokenizer.model", folder / "tokenizer.model"):
        if candidate.is_file():
            if _is_tiktoken(candidate):
                return llama3_tokenizer(str(candidate), max_seq_len=max_seq_len)
            return llama2_tokenizer(str(candidate), max_seq_len=max_seq_len)
    if (folder / "tokenizer.json").is_file():  # Llama 3 without Meta's file: the same vocabulary in HF's format
        return ModelTokenizer(
            engine=TokenizerJSONEngine(folder / "tokenizer.json"), chat_format=Llama3ChatFormat(),
            bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|finetune_right_pad_id|>",
            stop_tokens=["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], max_seq_len=max_seq_len,
        )
    raise UserError(f"{folder}: no tokenizer.model or tokenizer.json for this Llama checkpoint")


def from_pretrained(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """The tokenizer of a Hugging Face model folder, chosen by ``config.json``'s ``model_type``.

    Without a ``config.json``, the files decide: a tiktoken ``tokenizer.model`` is Llama 3, a ``tokenizer.json``
    with ``<|im_start|>`` is Qwen3-style ChatML, a sentencepiece model with ``<start_of_turn>`` is Gemma, one with
    ``[INST]`` Mistral, and any other sentencepiece model Llama 2.

    Args:
        path: the model folder.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.

    Raises:
        UserError: no tokenizer files, or a ``model_type`` without a tokenizer here (the message lists those).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"tokenizer path: {folder} is not a folder")
    model_type = _model_type(folder)
    sp_model = next((folder / n for n in ("tokenizer.model.v3", "tokenizer.model") if (folder / n).is_file()), None)
    if model_type is None:
        if (folder / "tokenizer.json").is_file() and "<|im_start|>" in (folder / "tokenizer.json").read_text():
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
    if model_type in ("mistral", "gemma", "gemma2"):
        if sp_model is None:
            raise UserError(f"{folder}: no sentencepiece tokenizer.model for this {model_type} checkpoint")
        build = mistral_tokenizer if model_type == "mistral" else gemma_tokenizer
        return build(str(sp_model), max_seq_len=max_seq_len)
    raise UserError(
        f"{folder / 'config.json'}: no tokenizer for model_type {model_type!r}; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
