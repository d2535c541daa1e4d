"""Model families: each sub-package composes ``toolkit.modules`` into architectures and public sizes.

A family package exposes ``hf_key_to_tune``, ``tune_key_to_hf`` and ``hf_config`` (checkpoint conversion; a family
whose tensors Hugging Face stores in parts, as the experts of Mixtral and Qwen3-MoE, also ``hf_key_to_parts`` and
``tune_key_to_hf_slices``: see ``toolkit.models._expert_keys``; a family that builds part of a larger checkpoint,
as Gemma 3's language model, also ``skipped_hf_key``, naming the tensors it leaves) and, when it builds Hugging Face
checkpoints, ``HF_MODEL_TYPES`` (the ``model_type`` values of ``config.json`` it handles) with
``from_hf_config(config, *, max_seq_len)``. :func:`read_hf_config` finds families by scanning this package, so a
new family needs no registration. A ``model_type`` no family handles is built by ``transformers`` itself
(:mod:`toolkit.models.transformers_backend`), whose weight names are the checkpoint's. Nothing here imports the
training or checkpoint code: loading a model's weights is :func:`toolkit.pretrained.from_pretrained`, which sits
above both.
"""

import importlib
import logging
import pkgutil
from pathlib import Path
from types import ModuleType

from torch import nn

from toolkit.errors import UserError, read_json
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models._lora import lora_builder, qlora
from toolkit.models.transformers_backend import from_folder, remote_code_class, transformers_model_class

BACKEND = "transformers_backend"
log = logging.getLogger(__name__)


def hf_model_types() -> dict[str, str]:
    """Which family builds each Hugging Face ``model_type``: ``{"llama": "llama3", "qwen2": "qwen2_5", ...}``."""
    owners: dict[str, str] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        family: ModuleType = importlib.import_module(f"{__name__}.{info.name}")
        for model_type in getattr(family, "HF_MODEL_TYPES", ()):
            if model_type in owners:
                raise RuntimeError(f"model_type {model_type!r} is claimed by both {owners[model_type]} and {info.name}")
            owners[model_type] = info.name
    return owners


def read_hf_config(path: str | Path) -> tuple[dict, str]:
    """``config.json`` of a Hugging Face model folder, and the family that builds it (``llama3``, ``qwen2_5``...):
    the native family of its ``model_type`` where there is one, else ``transformers_backend`` (the model that
    ``transformers`` builds, its own class or the folder's code).

    Raises:
        UserError: no or unreadable ``config.json``, or a ``model_type`` that neither a family nor ``transformers``
            (offline, or by the folder's ``auto_map``) builds; names the file.
    """
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        raise UserError(f"{config_file}: not found; a Hugging Face model folder (with config.json) is needed")
    config = read_json(config_file)
    model_type = config.get("model_type")
    owners = hf_model_types()
    if model_type in owners:
        return config, owners[model_type]
    if transformers_model_class(config) is None and remote_code_class(config) is None:
        raise UserError(
            f"{config_file}: model_type {model_type!r} is not supported: no native family (those: "
            f"{', '.join(sorted(owners))}) and no causal LM that the installed transformers builds offline"
        )
    return config, BACKEND


def build_from_hf(
    *,
    path: str | Path,
    max_seq_len: int | None = None,
    linear: LinearFactory = plain_linear,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The architecture a Hugging Face folder's ``config.json`` describes (family and dimensions), weights unset.

    Usable in configs, so one config fine-tunes any supported checkpoint (``model: {_component_:
    toolkit.models.build_from_hf, path: ${checkpointer.checkpoint_dir}}``); the recipe builds it on the meta
    device and its checkpointer loads the weights. :func:`lora_build_from_hf` is its LoRA version. The native family
    of the ``model_type`` builds it where there is one; otherwise ``transformers`` does
    (:mod:`toolkit.models.transformers_backend`). A line on the log says which (a warning for the backend, at INFO
    level for a native family).

    Args:
        path: the model folder.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA version passes adapter layers).
        trust_remote_code: let the transformers backend build a model whose code is in the folder (``auto_map``
            in ``config.json``), which runs that code; refused otherwise.

    Raises:
        UserError: see :func:`read_hf_config`, or a field the family needs is missing, or a remote-code model
            without ``trust_remote_code``.
    """
    config, family_name = read_hf_config(path)
    config_file = Path(path).expanduser() / "config.json"
    if family_name == BACKEND:
        log.warning("model_type %r: no native family; built by the transformers backend", config.get("model_type"))
        return from_folder(path=path, max_seq_len=max_seq_len, linear=linear, trust_remote_code=trust_remote_code)
    # The usual case is said at INFO, so that exports, merges and validation stay quiet; the backend, at WARNING.
    log.info("model_type %r: built by the native family %s", config.get("model_type"), family_name)
    family = importlib.import_module(f"{__name__}.{family_name}")
    try:
        return family.from_hf_config(config, max_seq_len=max_seq_len, linear=linear)
    except KeyError as e:
        raise UserError(f"{config_file}: missing field {e.args[0]!r} for model_type {config['model_type']!r}") from None
    except UserError as e:
        raise UserError(f"{config_file}: {e}") from None


lora_build_from_hf = lora_builder(build_from_hf)
lora_build_from_hf.__module__ = __name__
qlora_build_from_hf = qlora(lora_build_from_hf)


__all__ = [
    "build_from_hf", "hf_model_types", "lora_build_from_hf", "qlora_build_from_hf", "read_hf_config",
]
