"""Checkpoint names of stacked parameters: where one Hugging Face tensor is a part of one of ours.

Our experts are stacked (``layers.0.mlp.experts.gate_proj`` ``[num_experts, hidden, dim]``, see
``toolkit.modules.moe.GroupedExperts``); Hugging Face checkpoints store one tensor per expert and projection
(``model.layers.0.mlp.experts.3.gate_proj.weight``), or, as transformers 5 holds them in memory, the gate and up
projections of all experts fused in one (``model.layers.0.mlp.experts.gate_up_proj`` ``[num_experts, 2 * hidden,
dim]``). A family with such parameters exposes, next to ``hf_key_to_tune`` and ``tune_key_to_hf`` (whole tensors):

- ``hf_key_to_parts(hf_key)``: the :class:`Part` list of an HF tensor that fills parts of ours, or ``None`` for a
  whole tensor (then ``hf_key_to_tune`` names it);
- ``tune_key_to_hf_slices(key, size)``: the HF names of the ``size`` slices along the first dimension of our
  ``key``, in order, as exports write them; ``None`` for a tensor written whole.

The checkpointer reads and writes every tensor one at a time through these, so loading stays a stream, a sharded
parameter receives only its rank's experts, and exports keep the per-expert layout ``transformers`` loads.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

from toolkit.models.llama3._convert_weights import hf_key_to_tune as llama_hf_key_to_tune
from toolkit.models.llama3._convert_weights import tune_key_to_hf as llama_tune_key_to_hf

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""Our stacked parameters of ``GroupedExperts``."""


@dataclass(frozen=True)
class Part:
    """Where a Hugging Face tensor's values go in our state dict.

    Attributes:
        key: our tensor.
        index: the slice of ``key`` along its first dimension that the HF tensor is (one expert), or ``None``:
            the HF tensor has ``key``'s shape.
        rows: ``(i, n)``: only the ``i``-th of the ``n`` blocks of the HF tensor's rows (its second-to-last
            dimension, the output features of a fused projection) go to ``key``; ``None``: all of them. The blocks
            are the parts' tensors in order, each as many rows as its ``key`` (equal for the experts' gate and up;
            Phi-3's ``qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj``, of fewer key/value rows under GQA).
    """

    key: str
    index: int | None = None
    rows: tuple[int, int] | None = None


class ExpertKeys:
    """The names of a family's MoE layers: our stacked experts and router against Hugging Face's names.

    Outside the MoE blocks the names are Llama's (a ``model.`` prefix, ``lm_head``). Each expert's projection is a
    slice of our stacked parameter; the fused in-memory layout of transformers 5 (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``, ``mlp.gate.weight``) is read too. Exports write one tensor per expert.

    Args:
        block: the MoE block's name inside an HF layer (``mlp``; Mixtral's checkpoints: ``block_sparse_moe``). Ours is
            ``mlp``.
        projections: HF's per-expert name of each of our projections (Mixtral: ``{"gate_proj": "w1", "up_proj":
            "w3", "down_proj": "w2"}``).
    """

    def __init__(self, *, block: str, projections: Mapping[str, str]) -> None:
        if set(projections) != set(EXPERT_PROJECTIONS):
            raise ValueError(f"projections must name each of {EXPERT_PROJECTIONS}, got {sorted(projections)}")
        self.block = block
        self.projections = dict(projections)
        self._ours = {hf: ours for ours, hf in projections.items()}
        names = "|".join(map(re.escape, projections.values()))
        self._per_expert = re.compile(rf"model\.layers\.(\d+)\.{re.escape(block)}\.experts\.(\d+)\.({names})\.weight")
        self._fused = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
        self._stacked = re.compile(rf"layers\.(\d+)\.mlp\.experts\.({'|'.join(EXPERT_PROJECTIONS)})")
        self._hf_block = re.compile(rf"(model\.layers\.\d+)\.{re.escape(block)}\.")
        self._our_block = re.compile(r"(model\.layers\.\d+)\.mlp\.")

    def hf_key_to_tune(self, key: str) -> str:
        """A whole tensor's name: ``model.layers.0.block_sparse_moe.gate.weight`` -> ``layers.0.mlp.gate.weight``.

        Raises:
            KeyError: not a name of this family.
        """
        return llama_hf_key_to_tune(self._hf_block.sub(r"\1.mlp.", key, count=1))

    def tune_key_to_hf(self, key: str) -> str:
        """The inverse of :meth:`hf_key_to_tune`."""
        return self._our_block.sub(rf"\1.{self.block}.", llama_tune_key_to_hf(key), count=1)

    def hf_key_to_parts(self, key: str) -> list[Part] | None:
        """The parts of our stacked experts an HF expert tensor fills; ``None`` for any other tensor."""
        if match := self._per_expert.fullmatch(key):
            layer, expert, name = match.groups()
            return [Part(f"layers.{layer}.mlp.experts.{self._ours[name]}", index=int(expert))]
        if match := self._fused.fullmatch(key):
            layer, name = match.groups()
            prefix = f"layers.{layer}.mlp.experts."
            if name == "down_proj":
                return [Part(prefix + "down_proj")]
            return [Part(prefix + "gate_proj", rows=(0, 2)), Part(prefix + "up_proj", rows=(1, 2))]
        return None

    def tune_key_to_hf_slices(self, key: str, size: int) -> list[str] | None:
        """The HF names of the ``size`` experts of our stacked ``key``; ``None`` for any other tensor."""
        if match := self._stacked.fullmatch(key):
            layer, ours = match.groups()
            name = self.projections[ours]
            return [f"model.layers.{layer}.{self.block}.experts.{e}.{name}.weight" for e in range(size)]
        return None
