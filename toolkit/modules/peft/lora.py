"""Low-rank adapters on a frozen linear layer: LoRA (Hu et al., 2021, https://arxiv.org/abs/2106.09685) and DoRA
(Liu et al., 2024, https://arxiv.org/abs/2402.09353), with the base weight optionally in NF4 (QLoRA, Dettmers et
al., 2023, https://arxiv.org/abs/2305.14314)."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.modules._dtensor import init_full_
from toolkit.modules.peft.float8_base import float8_frozen_linear
from toolkit.modules.peft.nf4 import _apply_keeping_nf4, dequantize, to_nf4


class LoRALinear(nn.Module):
    """``y = x W^T + b + (alpha / rank) * B(A(dropout(x)))`` with ``W``, ``b`` frozen and ``A``, ``B`` trained.

    The base parameters keep a plain linear layer's names (``weight``, ``bias``), so a base checkpoint loads
    into the model unchanged; the adapters are ``lora_a.weight`` (``[rank, in_dim]``) and ``lora_b.weight``
    (``[out_dim, rank]``). ``B`` starts at zero, so an adapted model starts exactly as its base.

    Args:
        in_dim: input features.
        out_dim: output features.
        rank: the adapter's rank ``r``.
        alpha: the adapter's output is scaled by ``alpha / rank``.
        dropout: dropout on the adapter's input (the base path sees the undropped input).
        use_bias: the base layer has a (frozen) bias.
        quantize_base: store ``W`` in NF4 (QLoRA); it is dequantized on the fly in forward and backward.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_bias: bool = False,
        quantize_base: bool = False,
    ) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.quantize_base = quantize_base
        # A plain linear layer's initialization, so a model built without a checkpoint is still sane; the base
        # weights are normally overwritten by a checkpoint load.
        base = nn.Linear(in_dim, out_dim, bias=use_bias)
        weight = to_nf4(base.weight) if quantize_base else base.weight.detach()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(base.bias.detach(), requires_grad=False) if use_bias else None
        self.lora_a = nn.Linear(in_dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dim, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # Set by toolkit.modules.peft.disable_adapters: the layer is then its base (reference-model passes).
        self.disabled = False
        # Set by toolkit.training.apply_float8 (float8: true): the frozen base's matmuls run in float8.
        self.float8_base = False
        self.reset_lora_parameters()

    @property
    def dropout_p(self) -> float:
        """The adapter's dropout probability."""
        return self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """``A`` as a linear layer's default (Kaiming-uniform), ``B`` zero, so the adapter's output starts at zero
        (Hu et al., 2021, section 4.1). Call after materializing from the meta device."""
        init_full_(self.lora_a.weight, lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))  # sharded too
        nn.init.zeros_(self.lora_b.weight)

    def adapter_params(self) -> list[str]:
        """Names (relative to this module) of the trained parameters."""
        return ["lora_a.weight", "lora_b.weight"]

    def base_weight(self) -> torch.Tensor:
        """``W`` in full precision (dequantized when stored in NF4)."""
        return dequantize(self.weight)

    def lora_delta(self) -> torch.Tensor:
        """``(alpha / rank) * B @ A`` (``[out_dim, in_dim]``), the adapter's change to ``W``."""
        return self.scale * (self.lora_b.weight @ self.lora_a.weight)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The weight of a plain linear layer equivalent to this one, ``W + (alpha / rank) * B @ A``.

        Computed in float32 and returned in the adapter's dtype.
        """
        dtype = self.lora_a.weight.dtype
        return (self.base_weight().float() + self.lora_delta().float()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = float8_frozen_linear if self.float8_base else F.linear
        out = linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        # The scale multiplies the rank-r intermediate, not the out_dim-wide output: the same product, for a pass
        # over r columns instead of out_dim in forward and in backward.
        return out + self.lora_b(self.lora_a(self.dropout(x)) * self.scale)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        return _apply_keeping_nf4(self, fn, lambda: super(LoRALinear, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        base = "NF4" if self.quantize_base else "dense"
        return (
            f"in_dim={self.in_dim}, out_dim={self.out_dim}, rank={self.rank}, alpha={self.alpha}, "
            f"bias={self.bias is not None}, weight={base}"
        )


class DoRALinear(LoRALinear):
    """Weight-decomposed low-rank adaptation: ``W' = m * (W + s B A) / ||W + s B A||``, the norm taken over each
    output row (Liu et al., 2024, eq. 5), with the magnitude ``m`` (``[out_dim]``) trained alongside ``A`` and
    ``B``.

    The norm is treated as a constant in backward (Liu et al., 2024, section 4.3), as PEFT does, so our gradients
    and PEFT's agree. ``m`` must equal the base rows' norms at the start: call
    :meth:`initialize_dora_magnitude` once the base weight is loaded (``toolkit.modules.peft.init_adapters`` does
    it for a whole model). Arguments are :class:`LoRALinear`'s.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_bias: bool = False,
        quantize_base: bool = False,
    ) -> None:
        super().__init__(
            in_dim, out_dim, rank=rank, alpha=alpha, dropout=dropout, use_bias=use_bias, quantize_base=quantize_base
        )
        self.magnitude = nn.Parameter(torch.empty(out_dim, dtype=self.lora_a.weight.dtype))
        self.initialize_dora_magnitude()

    def adapter_params(self) -> list[str]:
        return ["lora_a.weight", "lora_b.weight", "magnitude"]

    def _weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        # ||W + s B A|| per output row, without gradient (Liu et al., 2024, section 4.3). One function for the
        # magnitude's initialization and the forward, so that at initialization m / norm is exactly 1.
        with torch.no_grad():
            return torch.linalg.vector_norm(weight + self.lora_delta().to(weight.dtype), dim=1)

    @torch.no_grad()
    def initialize_dora_magnitude(self) -> None:
        """Set ``m`` to the row norms of ``W + s B A`` (of ``W`` while ``B`` is zero), as PEFT does."""
        if self.weight.device.type == "meta":
            return
        self.magnitude.copy_(self._weight_norm(self.base_weight().to(self.magnitude.dtype)))

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``m * (W + s B A) / ||W + s B A||``, computed in float32 and returned in the adapter's dtype."""
        dtype = self.lora_a.weight.dtype
        direction = self.base_weight().float() + self.lora_delta().float()
        norm = torch.linalg.vector_norm(direction, dim=1, keepdim=True)
        return (self.magnitude.float().unsqueeze(1) * direction / norm).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        weight = self.base_weight().to(x.dtype)
        scale = self.magnitude / self._weight_norm(weight)  # [out_dim]
        # y = scale * (W x' + s B A x') + b, written as a correction of the base output (PEFT's arrangement).
        # Without dropout x' = x and W x' is the base output itself; with dropout (training) it is recomputed on
        # the dropped input, as PEFT does, so that training matches PEFT's too.
        x_drop = self.dropout(x)
        if isinstance(self.dropout, nn.Identity) or not self.training:
            base = out if self.bias is None else out - self.bias
        else:
            base = F.linear(x_drop, weight)
        return out + (scale - 1) * base + scale * self.lora_b(self.lora_a(x_drop) * self.scale)
