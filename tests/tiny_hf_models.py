"""Tiny random Hugging Face checkpoints of architectures without a native family here, for the transformers
backend's tests: each folder is what ``transformers`` writes with ``save_pretrained``, plus a tokenizer."""

from pathlib import Path

import torch

from tests.tiny_tokenizer import chatml_byte_level_bpe

VOCAB_SIZE = 512  # at least the tokenizer's (400)
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
# model_type -> its own fields: grouped-query attention where it has it, tied embeddings (starcoder2, cohere: their
# defaults), a partial rotary (persimmon, phi), biased output projection (phi), scaled logits (granite, cohere).
ARCHITECTURES = {
    "olmo2": dict(num_key_value_heads=2),
    "granite": dict(num_key_value_heads=2, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5),
    "stablelm": dict(num_key_value_heads=2),
    "phi": dict(partial_rotary_factor=0.5),
    "persimmon": dict(partial_rotary_factor=0.5),
    "starcoder2": dict(num_key_value_heads=2),
    "cohere": dict(num_key_value_heads=2, logit_scale=0.5),
}
# Each architecture's attention projections, by their names in its layers (what LoRA targets).
ATTENTION_NAMES = {"persimmon": ["query_key_value", "dense"], "phi": ["q_proj", "v_proj", "dense"]}


def _perturb(model: torch.nn.Module) -> None:
    # transformers initializes norms to one and biases to zero; random values make a dropped one visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))


def save_tiny(model_type: str, folder: Path, **fields) -> Path:
    """Write a tiny random ``model_type`` checkpoint (and a trained byte-level BPE tokenizer) to ``folder``."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_byte_level_bpe(["reverse: abcd dcba", "upper: word WORD", "sort: dcba abcd"] * 50,
                                      vocab_size=400)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **ARCHITECTURES.get(model_type, {}), **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _perturb(model)
    model.save_pretrained(folder)
    return folder
