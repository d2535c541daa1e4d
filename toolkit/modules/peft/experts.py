"""LoRA on the stacked experts of a mixture-of-experts block: one low-rank adapter per expert and projection, run
in the same grouped matmuls as the experts themselves; and the block's router trained whole next to the adapters."""

import torch
from torch import nn

from toolkit.modules._dtensor import init_full_
from toolkit.modules.moe import PROJECTIONS, GroupedExperts, TopKRouter, grouped_mm, local


class StackedMatrix(nn.Module):
    """One matrix per expert, ``weight`` ``[num_experts, out_dim, in_dim]`` (a module of its own so that the
    adapter keys end as a linear layer's adapters do: ``...lora_gate_proj.lora_a.weight``)."""

    def __init__(self, num_experts: int, out_dim: int, in_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, out_dim, in_dim))


class ExpertAdapters(nn.Module):
    """The adapters of one projection of every expert: ``lora_a`` ``[E, rank, in]``, ``lora_b`` ``[E, out, rank]``."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, rank: int) -> None:
        super().__init__()
        self.lora_a = StackedMatrix(num_experts, rank, in_dim)
        self.lora_b = StackedMatrix(num_experts, out_dim, rank)


class TrainedRouter(TopKRouter):
    """A :class:`~toolkit.modules.moe.TopKRouter` that a LoRA model trains whole (its full ``[num_experts, dim]``
    weight, no adapter) beside the adapters: ``lora_linear(train_router=True)`` makes it. A router is a tiny share of
    the weights, and a low-rank adapter of a matrix with only ``num_experts`` rows would save next to nothing. It
    computes what the plain router computes; only :func:`~toolkit.modules.peft.get_adapter_params` tells them apart,
    and PEFT saves it as a ``modules_to_save`` module."""


class LoRAGroupedExperts(GroupedExperts):
    """:class:`~toolkit.modules.moe.GroupedExperts` with frozen stacked weights and a trained LoRA adapter on each
    projection of each expert: expert ``e``'s projection ``W_e x`` becomes ``W_e x + (alpha / rank) B_e A_e
    dropout(x)``, as a :class:`~toolkit.modules.peft.LoRALinear` of that expert would compute.

    The base parameters keep their names, so a base checkpoint loads unchanged; the adapters are
    ``lora_<projection>.lora_a.weight`` and ``.lora_b.weight``. ``B`` starts at zero. Other arguments are
    :class:`~toolkit.modules.moe.GroupedExperts`'.

    Args:
        rank: each adapter's rank.
        alpha: the adapters' outputs are scaled by ``alpha / rank``.
        dropout: dropout on the adapters' input.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        activation: nn.Module | None = None,
    ) -> None:
        super().__init__(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim, activation=activation)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        for name in PROJECTIONS:
            getattr(self, name).requires_grad_(False)
            out_dim, in_dim = getattr(self, name).shape[1:]
            setattr(self, f"lora_{name}", ExpertAdapters(num_experts, in_dim, out_dim, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # toolkit.modules.peft.disable_adapters: the base experts alone
        self.reset_lora_parameters()

    @property
    def dropout_p(self) -> float:
        return self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0

    def adapter(self, name: str) -> ExpertAdapters:
        return getattr(self, f"lora_{name}")

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """Each expert's ``A`` as a linear layer's default (uniform within ``1 / sqrt(in_dim)``, what Kaiming-uniform
        with ``a = sqrt(5)`` gives one expert's ``[rank, in_dim]``), ``B`` zero."""
        for name in PROJECTIONS:
            a, b = self.adapter(name).lora_a.weight, self.adapter(name).lora_b.weight
            bound = 1 / a.shape[-1] ** 0.5
            init_full_(a, lambda w: nn.init.uniform_(w, -bound, bound))
            nn.init.zeros_(b)

    def adapter_params(self) -> list[str]:
        """Names (relative to this module) of the trained parameters."""
        return [f"lora_{name}.lora_{ab}.weight" for name in PROJECTIONS for ab in ("a", "b")]

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = super().project(name, x, counts)
        if self.disabled:
            return out
        adapter = self.adapter(name)
        low = grouped_mm(self.dropout(x), local(adapter.lora_a.weight), counts) * self.scale  # [n, rank]
        return out + grouped_mm(low, local(adapter.lora_b.weight), counts)

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """``W_e + (alpha / rank) B_e A_e`` of every expert, by projection name (``[E, out, in]``), computed in
        float32 and returned in the adapters' dtype."""
        merged = {}
        for name in PROJECTIONS:
            adapter = self.adapter(name)
            dtype = adapter.lora_a.weight.dtype
            delta = torch.bmm(adapter.lora_b.weight.float(), adapter.lora_a.weight.float()) * self.scale
            merged[name] = (self.base_weight(name).float() + delta).to(dtype)
        return merged

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, rank={self.rank}, alpha={self.alpha}"
