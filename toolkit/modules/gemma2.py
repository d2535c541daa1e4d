"""The blocks Gemma 2 adds to the standard decoder (Gemma Team, 2024, https://arxiv.org/abs/2408.00118):
a zero-centred RMSNorm, norms after attention and after the MLP, scaled embeddings and soft-capped logits."""

import torch
from torch import nn

from toolkit.modules.attention import GroupedQueryAttention
from toolkit.modules.transformer import TransformerDecoder


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32 then cast back.

    The weight is stored as an offset from one (zero-initialized), and the scale is applied before the cast,
    unlike :class:`~toolkit.modules.RMSNorm`; both details are how Gemma checkpoints were trained.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square for numerical stability.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose output is multiplied by ``scale`` (Gemma: ``sqrt(embed_dim)``), rounded to the weight's
    dtype first as the reference implementation does."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * torch.tensor(self.scale, dtype=self.weight.dtype)


class Gemma2DecoderLayer(nn.Module):
    """Residual block with a norm before and after each of attention and MLP (the "sandwich" norm)::

        h = x + post_attention_layernorm(attn(input_layernorm(x)))
        out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    """

    def __init__(
        self,
        *,
        self_attn: GroupedQueryAttention,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
        pre_feedforward_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(x), mask=mask, input_pos=input_pos)
        h = x + self.post_attention_layernorm(attn_out)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class SoftcappedTransformerDecoder(TransformerDecoder):
    """A :class:`~toolkit.modules.TransformerDecoder` whose logits become ``cap * tanh(logits / cap)``.

    Args:
        final_logit_softcap: the cap (Gemma 2: 30).
        **kwargs: as for :class:`~toolkit.modules.TransformerDecoder`.
    """

    def __init__(self, *, final_logit_softcap: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.final_logit_softcap = final_logit_softcap

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection, soft-capped (also per chunk when the output is chunked)."""
        logits = super().compute_logits(h)
        return torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
