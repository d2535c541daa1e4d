"""Llama 3 with low-rank adapters: LoRA (Hu et al., 2021), DoRA (Liu et al., 2024) and QLoRA (Dettmers et al.,
2023), the same architecture as :func:`toolkit.models.llama3.llama3` with adapted projections.

Base weights keep the plain model's state-dict keys (``layers.0.self_attn.q_proj.weight``), so a base checkpoint
loads unchanged; adapters add ``...q_proj.lora_a.weight``, ``...q_proj.lora_b.weight`` (and DoRA's
``...q_proj.magnitude``). ``qlora_*`` builders are the LoRA builders with ``quantize_base=True``.
"""

from collections.abc import Callable, Sequence
from functools import partial

from torch import nn

from toolkit.models.llama3._component_builders import _llama3
from toolkit.models.llama3._model_builders import LLAMA3_1_8B, LLAMA3_1_70B, LLAMA3_2_1B, LLAMA3_2_3B, LLAMA3_DEMO
from toolkit.modules import Llama3RopeScaling, TransformerDecoder
from toolkit.modules.peft import DoRALinear, LoRALinear, NF4Linear

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def lora_llama3(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-5,
    rope_base: float = 500_000.0,
    rope_scaling: Llama3RopeScaling | None = None,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """Build a Llama 3 decoder with LoRA or DoRA on the chosen projections.

    Args:
        lora_attn_modules: attention projections to adapt, a subset of ``q_proj``, ``k_proj``, ``v_proj``,
            ``o_proj``.
        apply_lora_to_mlp: adapt the feed-forward's ``gate_proj``, ``up_proj`` and ``down_proj``.
        apply_lora_to_output: adapt the output projection (not possible with tied embeddings).
        lora_rank: adapter rank ``r``.
        lora_alpha: adapter outputs are scaled by ``lora_alpha / lora_rank``.
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA (learned magnitude) instead of LoRA.
        quantize_base: QLoRA: every decoder-layer projection's frozen weight is stored in NF4, adapted or not
            (Dettmers et al., 2023 quantize all linear layers of the base); the embedding, norms and an unadapted
            output projection keep the model dtype.
        vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim, max_seq_len, norm_eps,
            rope_base, rope_scaling, tie_word_embeddings: as for :func:`toolkit.models.llama3.llama3`.

    Raises:
        ValueError: an unknown attention module, nothing to adapt, or an output adapter on tied embeddings.
    """
    unknown = sorted(set(lora_attn_modules) - set(ATTN_MODULES))
    if unknown:
        raise ValueError(f"lora_attn_modules: unknown {unknown}; choose from {list(ATTN_MODULES)}")
    if apply_lora_to_output and tie_word_embeddings:
        raise ValueError("apply_lora_to_output: this model ties its output projection to the embedding; set it false")
    adapted = set(lora_attn_modules) | (set(MLP_MODULES) if apply_lora_to_mlp else set())
    if apply_lora_to_output:
        adapted.add("output")
    if not adapted:
        raise ValueError("no adapters: set lora_attn_modules, apply_lora_to_mlp or apply_lora_to_output")
    adapter_cls = DoRALinear if use_dora else LoRALinear

    def linear(name: str, in_dim: int, out_dim: int) -> nn.Module:
        if name in adapted:
            return adapter_cls(
                in_dim, out_dim, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, quantize_base=quantize_base
            )
        if quantize_base and name != "output":
            return NF4Linear(in_dim, out_dim)
        return nn.Linear(in_dim, out_dim, bias=False)

    return _llama3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        linear=linear,
    )


def lora_llama3_demo(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    vocab_size: int = 384,
    max_seq_len: int = 256,
) -> TransformerDecoder:
    """:func:`toolkit.models.llama3.llama3_demo` (~1M parameters) with adapters; arguments as :func:`lora_llama3`."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **LLAMA3_DEMO,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
    )


def lora_llama3_2_1b(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    max_seq_len: int = 131_072,
) -> TransformerDecoder:
    """Llama 3.2 1B with adapters (tied embeddings: no output adapter); arguments as :func:`lora_llama3`."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **LLAMA3_2_1B,
        max_seq_len=max_seq_len,
    )


def lora_llama3_2_3b(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    max_seq_len: int = 131_072,
) -> TransformerDecoder:
    """Llama 3.2 3B with adapters (tied embeddings: no output adapter); arguments as :func:`lora_llama3`."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **LLAMA3_2_3B,
        max_seq_len=max_seq_len,
    )


def lora_llama3_1_8b(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    max_seq_len: int = 131_072,
) -> TransformerDecoder:
    """Llama 3.1 8B with adapters; arguments as :func:`lora_llama3`."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **LLAMA3_1_8B,
        max_seq_len=max_seq_len,
    )


def lora_llama3_1_70b(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    max_seq_len: int = 131_072,
) -> TransformerDecoder:
    """Llama 3.1 70B (and 3.3 70B) with adapters; arguments as :func:`lora_llama3`."""
    return lora_llama3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **LLAMA3_1_70B,
        max_seq_len=max_seq_len,
    )


def _qlora(builder: Callable[..., TransformerDecoder], name: str) -> partial:
    # A QLoRA builder is the LoRA builder with quantize_base=True (a partial keeps the signature config
    # validation checks against); the docstring says so in `help()` and docs.
    qlora = partial(builder, quantize_base=True)
    qlora.__doc__ = f"QLoRA: :func:`{builder.__name__}` with ``quantize_base=True`` (NF4 base weights)."
    qlora.__name__ = name  # type: ignore[attr-defined]
    return qlora


qlora_llama3_demo = _qlora(lora_llama3_demo, "qlora_llama3_demo")
qlora_llama3_2_1b = _qlora(lora_llama3_2_1b, "qlora_llama3_2_1b")
qlora_llama3_2_3b = _qlora(lora_llama3_2_3b, "qlora_llama3_2_3b")
qlora_llama3_1_8b = _qlora(lora_llama3_1_8b, "qlora_llama3_1_8b")
qlora_llama3_1_70b = _qlora(lora_llama3_1_70b, "qlora_llama3_1_70b")
