"""The transformers backend: a causal language model that ``transformers`` builds (``AutoModelForCausalLM``), for
architectures that have no native family here, trained by the same engine as the native ones.

:class:`TransformersDecoder` holds the Hugging Face model's own modules under their own names, so its state-dict
keys are the checkpoint's (the weight-name conversion of this "family" is the identity), and implements the model
contract (:class:`~toolkit.modules.contract.DecoderModel`) over them: the decoder layers (``model.layers.<i>``:
FSDP2 units, activation checkpointing, compile), the token embedding, the final norm and the output projection,
whose weight the fused projection-and-loss takes with the final hidden states, as for a native decoder. Packed
rows reach the model as a 4D boolean mask and their positions as ``position_ids``.

What it does not do: tensor parallelism (the layers are another library's code, whose projections our
tensor-parallel plan does not know; refused with one line), KV-cache generation, and FlexAttention (dense SDPA
masks everywhere). What a native family adds over it is measured by ``benchmarks/transformers_backend.py``.
"""

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.modules.masks import document_attention_mask
from toolkit.errors import UserError, read_json
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.modules import DocumentMasks, TransformerDecoder
from toolkit.modules.loss import logit_loss_and_grad

log = logging.getLogger(__name__)

# How a config's output-scaling field turns the projection into the logits, as a factor on the final hidden states
# (a bias-free projection is linear: scaling its input scales the logits). Cohere multiplies, Granite divides.
_LOGIT_SCALES = {"logit_scale": lambda value: value, "logits_scaling": lambda value: 1.0 / value}

# What a config.json that runs remote code means, said where it is refused.
REMOTE_CODE = (
    "the model's code is Python files in the checkpoint folder (config.json's auto_map), which building it runs "
    "with your permissions"
)


def transformers_model_class(config: dict) -> str | None:
    """The ``transformers`` class name that builds ``config`` (a ``config.json``) as a causal LM offline, or None."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))


def remote_code_class(config: dict) -> str | None:
    """The ``auto_map`` entry of a ``config.json`` that builds its causal LM from the folder's own code, or None."""
    auto_map = config.get("auto_map")
    return auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None


class TransformersDecoder(TransformerDecoder):
    """A ``transformers`` causal LM as the engine's decoder: the losses, fused output projection and chunked logits
    of :class:`~toolkit.modules.TransformerDecoder` on the Hugging Face model's final hidden states.

    Its modules are the Hugging Face model's (base model under its ``base_model_prefix``, output projection under
    its own name unless tied to the embedding), so names and state-dict keys are the checkpoint's.

    Args:
        causal_lm: a ``PreTrainedModel`` for causal LM (``AutoModelForCausalLM.from_config``), on any device.
        max_seq_len: the longest sequence trained (the model's own position embeddings are its own business).

    Raises:
        UserError: a model whose layers are not a ``ModuleList`` named ``layers``, whose final norm cannot be told,
            whose output projection is not a plain linear layer, or whose derived buffers cannot be rebuilt.
    """

    def __init__(self, causal_lm: nn.Module, *, max_seq_len: int) -> None:
        # Not TransformerDecoder.__init__, which registers our module names: these modules keep Hugging Face's.
        nn.Module.__init__(self)
        config = causal_lm.config
        name = f"{type(causal_lm).__name__} ({config.model_type})"
        base = causal_lm.base_model
        if not isinstance(getattr(base, "layers", None), nn.ModuleList):
            raise UserError(f"{name}: the transformers backend needs the decoder layers as a ModuleList `layers`")
        norms = [child for child_name, child in base.named_children() if "norm" in child_name]
        if len(norms) != 1:
            raise UserError(f"{name}: cannot tell the final norm among {[n for n, _ in base.named_children()]}")
        head = causal_lm.get_output_embeddings()
        if type(head) is not nn.Linear:
            raise UserError(f"{name}: the output projection is a {type(head).__name__}, not a linear layer")
        for module_name, module in base.named_modules():
            if module._non_persistent_buffers_set and not hasattr(module, "config"):
                raise UserError(f"{name}: cannot rebuild the buffers of {module_name} after materializing")
        self.hf_config = config
        self._base_name = causal_lm.base_model_prefix
        self._norm = norms  # a list: not registered twice (it is the base model's)
        self.add_module(self._base_name, base)
        tied = head.weight is base.get_input_embeddings().weight
        self._head_name = None if tied else next(n for n, m in causal_lm.named_children() if m is head)
        if self._head_name is not None:
            self.add_module(self._head_name, head)
        scales = [(key, config.to_dict().get(key)) for key in _LOGIT_SCALES]
        self.logit_scale = next((_LOGIT_SCALES[key](value) for key, value in scales if value is not None), 1.0)
        if self.logit_scale != 1.0 and head.bias is not None:
            raise UserError(f"{name}: a scaled output projection with a bias is not supported")
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        self.max_seq_len = max_seq_len
        self.router_aux_loss_coef = 0.0
        self._moe_blocks: list[nn.Module] = []
        self._routing_totals = None
        self._router_loss = None
        self.output_loss_kernel = logit_loss_and_grad

    @property
    def base(self) -> nn.Module:
        """The Hugging Face base model (embedding, layers, final norm)."""
        return getattr(self, self._base_name)

    def decoder_layers(self) -> dict[str, nn.Module]:
        """The base model's decoder layers, in order, by module path (``model.layers.<i>``: transformers' own
        ``ModuleList``, which its forward slices, so it stays one)."""
        return {f"{self._base_name}.layers.{name}": layer for name, layer in self.base.layers.named_children()}

    def token_embedding(self) -> nn.Embedding:
        """The base model's input embedding."""
        return self.base.get_input_embeddings()

    def final_norm(self) -> nn.Module:
        """The base model's final norm."""
        return self._norm[0]

    def output_projection(self) -> nn.Module | None:
        """The output projection, or None when it is the embedding (tied)."""
        return None if self._head_name is None else getattr(self, self._head_name)

    def final_hidden(
        self, tokens: torch.Tensor, *, mask: torch.Tensor | None = None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The base model's last hidden states ``[b, s, d]``, times the config's logit scale (so that the plain
        projection of them, fused or not, gives the model's logits).

        ``mask``: None (causal), a boolean ``[b, s, s]`` (packed documents; True where attention is allowed), or
        :class:`~toolkit.modules.DocumentMasks` (made dense). ``input_pos``: ``[b, s]`` positions.
        """
        if isinstance(mask, DocumentMasks):
            mask = None if mask.document_ids is None else document_attention_mask(mask.document_ids)
        if mask is not None:
            mask = mask.unsqueeze(1)  # [b, 1, s, s]: transformers passes a 4D mask to attention as it is
        out = self.base(input_ids=tokens, attention_mask=mask, position_ids=input_pos, use_cache=False)
        h = out.last_hidden_state
        return h if self.logit_scale == 1.0 else h * self.logit_scale

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection of :meth:`final_hidden`'s states, soft-capped where the config says so."""
        logits = super().compute_logits(h)
        if self.final_logit_softcap is None:
            return logits
        return torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap

    def setup_caches(self, **kwargs: Any) -> None:
        """Refused: generation (``generate``, ``eval_tasks``) needs our attention layers' KV caches."""
        raise UserError(
            "the transformers backend does not generate (no KV caches): set eval_tasks to null, and generate with "
            "transformers from the exported final/ folder"
        )

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the buffers that checkpoints do not hold (rotary frequency tables), in float32, after the model
        was materialized from the meta device: by building each such module again from its config."""
        for module in self.base.modules():
            if not module._non_persistent_buffers_set:
                continue
            fresh = type(module)(module.config)
            for key in module._non_persistent_buffers_set:
                module._buffers[key] = fresh._buffers[key].to(module._buffers[key].device)


def _replace_linears(model: TransformersDecoder, linear: LinearFactory) -> None:
    """Put ``linear(attribute name, in, out, bias=...)`` in place of every linear layer of the decoder layers, and
    ``linear("output", ...)`` in place of an untied output projection; plain layers it returns are left as they
    were (they are the same)."""
    head = model.output_projection()
    in_layers = {id(m) for layer in model.decoder_layers().values() for m in layer.modules() if type(m) is nn.Linear}
    for path, module in list(model.named_modules()):
        if id(module) not in in_layers and (head is None or module is not head):
            continue
        parent_path, _, attr = path.rpartition(".")
        made = linear("output" if module is head else attr, module.in_features, module.out_features,
                      bias=module.bias is not None)
        if type(made) is not nn.Linear:
            setattr(model.get_submodule(parent_path), attr, made)


def from_folder(
    *,
    path: str | Path,
    max_seq_len: int | None = None,
    linear: LinearFactory = plain_linear,
    trust_remote_code: bool = False,
) -> TransformersDecoder:
    """The model a Hugging Face folder describes, built by ``transformers`` (on the current default device: the meta
    device in recipes), as a :class:`TransformersDecoder`: what :func:`toolkit.models.build_from_hf` builds for a
    ``model_type`` without a native family, and usable as a config's ``model`` to force the backend on any (pair it
    with ``checkpointer.model_family: transformers_backend``).

    Args:
        path: the model folder (its ``config.json``, and the code files of a remote-code model).
        max_seq_len: the longest sequence trained; defaults to ``max_position_embeddings`` (or 2048).
        linear: makes the projections (a LoRA factory: adapters where its target names say).
        trust_remote_code: build a model whose code is in the folder (``auto_map``).

    Raises:
        UserError: a remote-code model without ``trust_remote_code``; a folder transformers cannot build offline;
            see :class:`TransformersDecoder`.
    """
    import transformers

    config_file = Path(path).expanduser() / "config.json"
    config = read_json(config_file)
    remote = transformers_model_class(config) is None
    if remote and remote_code_class(config) is None:
        raise UserError(
            f"{config_file}: model_type {config.get('model_type')!r}: transformers {transformers.__version__} has no "
            "causal LM for it and the config names no code of its own (auto_map)"
        )
    if remote and not trust_remote_code:
        raise UserError(
            f"{config_file}: {REMOTE_CODE}; set model.trust_remote_code=true only if you trust that folder"
        )
    try:
        hf_config = transformers.AutoConfig.from_pretrained(
            str(Path(path).expanduser()), trust_remote_code=remote, local_files_only=True
        )
        causal_lm = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", trust_remote_code=remote
        )
    except (ValueError, OSError, ImportError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{config_file}: transformers cannot build this model offline: {first_line}") from None
    from transformers.conversion_mapping import extract_weight_conversions_for_model

    if extract_weight_conversions_for_model(causal_lm):  # e.g. gpt_neox's embed_out.weight, its lm_head's
        raise UserError(
            f"{config_file}: {type(causal_lm).__name__} stores weights under other names than its modules' "
            "(transformers renames them on load and save), which the transformers backend does not follow"
        )
    if max_seq_len is None:
        max_seq_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    try:
        model = TransformersDecoder(causal_lm, max_seq_len=max_seq_len)
    except UserError as e:
        raise UserError(f"{config_file}: {e}") from None
    _replace_linears(model, linear)
    return model


def hf_key_to_tune(key: str) -> str:
    """The identity: the backend's parameters are named as in the checkpoint."""
    return key


def tune_key_to_hf(key: str) -> str:
    """The identity: the backend's parameters are named as in the checkpoint."""
    return key


def hf_config(model: TransformersDecoder) -> dict[str, Any]:
    """The model's own ``config.json`` (``transformers``' ``to_dict``), less its dtype, which the export sets."""
    config = model.hf_config.to_dict()
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    return config


__all__ = [
    "REMOTE_CODE", "TransformersDecoder", "from_folder", "hf_config", "hf_key_to_tune", "remote_code_class",
    "transformers_model_class", "tune_key_to_hf",
]
