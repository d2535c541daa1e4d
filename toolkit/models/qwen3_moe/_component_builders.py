"""The Qwen3 mixture-of-experts architecture composed from ``toolkit.modules`` (Qwen Team, 2025,
https://arxiv.org/abs/2505.09388): Qwen3's attention (per-head q/k norms, an independent head_dim) with top-k routed
SwiGLU experts in place of the feed-forward, on every layer or on those ``mlp_only_layers`` and
``decoder_sparse_step`` leave sparse (no shared expert)."""

from collections.abc import Sequence

from toolkit.models._decoder import LinearFactory, moe_mlp, plain_linear, prenorm_decoder
from toolkit.models.llama3 import llama3_mlp
from toolkit.models.qwen3 import qwen3_attention
from toolkit.modules import FeedForward, RotaryPositionalEmbeddings, TransformerDecoder, YarnRopeScaling
from toolkit.modules.moe import MoEFeedForward


def sparse_layers(*, num_layers: int, mlp_only_layers: Sequence[int] = (), decoder_sparse_step: int = 1) -> list[bool]:
    """Per layer, whether its feed-forward is the mixture of experts (else dense), as Qwen3-MoE's config says: every
    ``decoder_sparse_step``-th layer (the last of each group of that many) unless listed in ``mlp_only_layers``."""
    if decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {decoder_sparse_step}")
    return [i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 for i in range(num_layers)]


def qwen3_moe(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    embed_dim: int,
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    norm_topk_prob: bool = True,
    intermediate_dim: int | None = None,
    mlp_only_layers: Sequence[int] = (),
    decoder_sparse_step: int = 1,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    rope_scaling: YarnRopeScaling | None = None,
    router_aux_loss_coef: float = 0.001,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Qwen3-MoE decoder.

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head.
        embed_dim: model width.
        moe_intermediate_dim: each expert's hidden width.
        num_experts: routed experts per MoE layer.
        num_experts_per_tok: experts each token goes through.
        max_seq_len: the rotary cache length.
        norm_topk_prob: renormalize the kept routing weights to sum to one (every released size does).
        intermediate_dim: the dense feed-forwards' hidden width; needed only where a layer is dense.
        mlp_only_layers: indices of the layers with a dense feed-forward.
        decoder_sparse_step: every this-many-th layer is MoE, the others dense (1: all).
        norm_eps: epsilon of every RMSNorm, the per-head q/k norms included.
        rope_base: rotary theta.
        rope_scaling: YaRN, for sequences longer than the context the model was trained at.
        router_aux_loss_coef: weight of the load-balancing loss in the training loss.
        tie_word_embeddings: reuse the embedding as output projection.
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers): the
            attention's and the dense feed-forwards', and the experts' where it adapts them (``apply_lora_to_experts``).

    Raises:
        ValueError: a dense layer without ``intermediate_dim``.
    """
    sparse = sparse_layers(
        num_layers=num_layers, mlp_only_layers=mlp_only_layers, decoder_sparse_step=decoder_sparse_step
    )
    if not all(sparse) and intermediate_dim is None:
        raise ValueError("intermediate_dim is needed: some layers have a dense feed-forward")
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling)

    def moe() -> MoEFeedForward:
        return moe_mlp(
            embed_dim=embed_dim, hidden_dim=moe_intermediate_dim, num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok, norm_topk_prob=norm_topk_prob, linear=linear,
        )

    def dense() -> FeedForward:
        return llama3_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear)

    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=lambda: qwen3_attention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
            norm_eps=norm_eps, linear=linear,
        ),
        mlp=[moe if is_sparse else dense for is_sparse in sparse],
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
        router_aux_loss_coef=router_aux_loss_coef,
    )
