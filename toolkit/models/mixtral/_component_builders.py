"""The Mixtral architecture composed from ``toolkit.modules`` (Jiang et al., 2024, https://arxiv.org/abs/2401.04088):
Mistral's attention with a sparse mixture of SwiGLU experts in place of every feed-forward, each token routed to
its top-k experts, their weights renormalized to sum to one."""

from toolkit.models._decoder import LinearFactory, moe_mlp, plain_linear, prenorm_decoder
from toolkit.models.mistral import mistral_attention
from toolkit.modules import RotaryPositionalEmbeddings, TransformerDecoder


def mixtral(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    embed_dim: int,
    intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    norm_eps: float = 1e-5,
    rope_base: float = 1_000_000.0,
    sliding_window: int | None = None,
    router_aux_loss_coef: float = 0.001,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Mixtral decoder.

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head.
        embed_dim: model width.
        intermediate_dim: each expert's hidden width.
        num_experts: experts per layer.
        num_experts_per_tok: experts each token goes through.
        max_seq_len: the rotary cache length.
        norm_eps: RMSNorm epsilon.
        rope_base: rotary theta.
        sliding_window: attention window of every layer, or ``None`` for full attention.
        router_aux_loss_coef: weight of the load-balancing loss in the training loss.
        tie_word_embeddings: reuse the embedding as output projection.
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers): the
            attention's, and the experts' where it adapts them (``apply_lora_to_experts``).
    """
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base)
    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=lambda: mistral_attention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
            sliding_window=sliding_window, linear=linear,
        ),
        mlp=lambda: moe_mlp(
            embed_dim=embed_dim, hidden_dim=intermediate_dim, num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok, norm_topk_prob=True, linear=linear,
        ),
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
        router_aux_loss_coef=router_aux_loss_coef,
    )
