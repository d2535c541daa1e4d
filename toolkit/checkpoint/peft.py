"""Adapters in the Hugging Face PEFT format, and merging an adapter into a base checkpoint offline.

A PEFT LoRA adapter is a folder with ``adapter_config.json`` and ``adapter_model.safetensors``, whose keys are
the Hugging Face module names under ``base_model.model.``: ``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight`` (``[r, in]``), ``...lora_B.weight`` (``[out, r]``) and, for DoRA, ``...lora_magnitude_vector``
(``[out]``). Modules trained whole (routers, ``train_router``) are PEFT's ``modules_to_save``: their weights under
their own names (``base_model.model.model.layers.0.mlp.gate.weight``).
``peft.PeftModel.from_pretrained(transformers_model, folder)`` loads what we write, and we load what PEFT writes for
the same targets. :func:`adapter_linear` builds the model an adapter folder fits from any plain builder, with the
settings its ``adapter_config.json`` records.
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.checkpoint.output_dir import check_output_apart
from toolkit.errors import UserError, read_json
from toolkit.models import hf_model_types, read_hf_config
from toolkit.models._decoder import LinearFactory
from toolkit.models._lora import ATTN_MODULES, MLP_MODULES, lora_linear
from toolkit.modules._dtensor import copy_full_
from toolkit.modules.peft import DoRALinear, LoRAGroupedExperts, adapter_modules, init_adapters, is_adapter_key
from toolkit.modules.peft import get_merged_state_dict, has_nf4, trained_routers
from toolkit.parallel import unwrap
from toolkit.checkpoint.hf import _weight_files, gather_full_state_dict, load_model_family
from toolkit.checkpoint.safetensors_files import SAFETENSORS_INDEX
from toolkit.parallel.distributed import barrier
from toolkit.checkpoint.step_files import TOKENIZER_FILES
from toolkit.training.init import init_weights
from toolkit.checkpoint.peft_fused import fused_members, peft_rank, refuse_fused
from toolkit.checkpoint.peft_fused import peft_tensors as peft_fused_tensors
from toolkit.checkpoint.peft_experts import (
    ROUTER_MODULES,
    TARGET_PARAMETERS,
    fused_delta,
    fused_target,
    hf_moe_name,
    is_fused,
    no_peft_form,
    part_of_fused,
    peft_patterns,
    peft_tensors,
    whole,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
# Our adapter parameter names -> PEFT's, per adapted module.
_TO_PEFT = {"lora_a.weight": "lora_A.weight", "lora_b.weight": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
_FROM_PEFT = {v: k for k, v in _TO_PEFT.items()}
# Where the projections lora_linear can adapt sit in our decoders (layer 0 stands for every layer), with the names
# lora_linear knows them by.
_ADAPTABLE = {
    **{f"layers.0.self_attn.{name}": name for name in ATTN_MODULES},
    **{f"layers.0.mlp.{name}": name for name in MLP_MODULES},
    "output": "output",
}


def _hf_module_name(family: Any, module_name: str) -> str:
    # The family converts parameter keys; a module's name is its weight key without ".weight".
    return family.tune_key_to_hf(f"{module_name}.weight").removesuffix(".weight")


def _uniform(values: dict[str, Any], what: str) -> Any:
    distinct = set(values.values())
    if len(distinct) != 1:
        raise ValueError(f"the PEFT format needs one {what} for every adapter; this model has {sorted(distinct)}")
    return distinct.pop()


def _write_atomically(output_dir: Path, write: Any) -> Path:
    # Write into a sibling temporary folder renamed into place when complete: a crash never leaves a
    # half-written adapter or checkpoint behind under the final name.
    output_dir = Path(output_dir)
    tmp_dir = output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        write(tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if output_dir.exists():
        shutil.rmtree(output_dir)
    tmp_dir.rename(output_dir)
    return output_dir


def save_peft_adapter(
    model: nn.Module,
    output_dir: str | Path,
    *,
    model_family: str,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write the adapters of ``model`` (a plain, unsharded model) as a PEFT LoRA/DoRA adapter folder.

    ``r``, ``lora_alpha``, ``lora_dropout``, ``use_dora`` and ``target_modules`` are read from the model's
    adapter layers, so the config always describes the weights. The folder appears only when complete (an
    existing one is replaced).

    Args:
        model: a model built by a LoRA builder (e.g. ``lora_llama3_2_1b``).
        output_dir: the adapter folder to write.
        model_family: the ``toolkit.models`` family, which names modules the Hugging Face way.
        base_model_name_or_path: recorded in ``adapter_config.json`` (a hub id or the base checkpoint's folder).

    Returns:
        ``output_dir``.

    Raises:
        ValueError: the model has no adapters, or adapters of different ranks, alphas, dropouts or kinds.
    """
    return _save_adapter(model, output_dir, model_family=model_family, base_model_name_or_path=base_model_name_or_path,
                         write=True)


def export_peft_adapter(
    model: nn.Module,
    output_dir: str | Path,
    *,
    model_family: str,
    base_model_name_or_path: str | None = None,
) -> Path:
    """:func:`save_peft_adapter` for a model whose parameters may be sharded (FSDP2, tensor parallelism): a
    collective, every rank calls it. Each adapter tensor is gathered whole on every rank in turn (a rank-``r``
    matrix or a magnitude vector, never a base weight: the base is not gathered), and rank zero writes the folder.
    """
    rank_zero = not dist.is_initialized() or dist.get_rank() == 0
    return _save_adapter(model, output_dir, model_family=model_family, base_model_name_or_path=base_model_name_or_path,
                         write=rank_zero)


def _save_adapter(
    model: nn.Module, output_dir: str | Path, *, model_family: str, base_model_name_or_path: str | None, write: bool
) -> Path:
    family = load_model_family(model_family)
    modules = adapter_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA/DoRA layers to save")
    problem = no_peft_form(modules)
    if problem:  # written without them, the adapter would silently lose the experts' training
        raise UserError(f"{problem}; export the merged model")
    experts = {name: module for name, module in modules.items() if isinstance(module, LoRAGroupedExperts)}
    tensors = {}
    for name, module in experts.items():  # the experts' adapters on transformers' fused parameters
        for key, tensor in peft_tensors(module).items():
            if write:
                tensors[f"{_PEFT_PREFIX}{hf_moe_name(name)}.{key}"] = tensor.cpu()
    routers = trained_routers(model)
    for name, router in routers.items():  # trained whole: PEFT's modules_to_save, the full weight
        weight = whole(router.weight)
        if write:
            tensors[f"{_PEFT_PREFIX}{hf_moe_name(name)}.weight"] = weight.contiguous().cpu()
    linear = {name: module for name, module in modules.items() if name not in experts}
    use_dora = _uniform({n: isinstance(m, DoRALinear) for n, m in modules.items()}, "adapter kind (LoRA or DoRA)")
    rank, alpha = _uniform({n: m.rank for n, m in modules.items()}, "rank"), _uniform(
        {n: m.alpha for n, m in modules.items()}, "alpha"
    )
    # Our adapters by the Hugging Face module they adapt: several where the family fuses projections (Phi-3).
    groups: dict[str, dict[str, nn.Module]] = {}
    for name, module in linear.items():
        groups.setdefault(_hf_module_name(family, name), {})[name] = module
    width = peft_rank(groups, rank) if groups else rank
    for hf_name, members in groups.items():
        adapted = peft_fused_tensors(unwrap(model), hf_name, fused_members(family, hf_name), members, width)
        if write:
            tensors.update({f"{_PEFT_PREFIX}{hf_name}.{key}": tensor for key, tensor in adapted.items()})
    if width != rank:  # the padded rank of fused modules; lora_alpha / r stays ours
        rank, alpha = width, alpha * width / rank
    rank_pattern, alpha_pattern = peft_patterns(rank, alpha) if experts else ({}, {})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": _uniform({n: m.dropout_p for n, m in modules.items()}, "dropout"),
        # PEFT matches target_modules against the end of each module's name.
        "target_modules": sorted({hf_name.rpartition(".")[2] for hf_name in groups}) or None,
        "use_dora": use_dora,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": ROUTER_MODULES if routers else None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    if experts:
        config["target_parameters"] = TARGET_PARAMETERS

    if not write:  # every rank checked the config above: a bad one fails on all of them
        return Path(output_dir)

    def write_files(tmp_dir: Path) -> None:
        save_file(tensors, str(tmp_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    return _write_atomically(Path(output_dir), write_files)


def _read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter folder, checked for the PEFT options we reproduce.

    Raises:
        UserError: missing or unreadable files, or a PEFT option we do not reproduce; the message names the file.
    """
    adapter_dir = Path(adapter_dir)
    config_file, weights_file = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not weights_file.is_file() and (adapter_dir / "adapter_model.bin").is_file():
        # PEFT's older format is a pickle, never read: unpickling a file can run any code it names.
        raise UserError(
            f"{weights_file}: missing; adapter_model.bin is a pickle, which is not loaded since it could run code: "
            "save the adapter as safetensors (PEFT's save_pretrained with safe_serialization=True, its default)"
        )
    for file in (config_file, weights_file):
        if not file.is_file():
            raise UserError(f"{file}: missing; is {adapter_dir} a PEFT adapter folder?")
    config = read_json(config_file)
    unsupported = {
        "peft_type": (config.get("peft_type"), "LORA"),
        "bias": (config.get("bias", "none"), "none"),
        "use_rslora": (config.get("use_rslora", False), False),
        "fan_in_fan_out": (config.get("fan_in_fan_out", False), False),
    }
    for key, (value, expected) in unsupported.items():
        if value != expected:
            raise UserError(f"{config_file}: {key}={value!r} is not supported (only {expected!r})")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise UserError(f"{config_file}: {key} must be a positive number, got {config.get(key)!r}")
    # Parameters adapted directly: only the fused experts', whose ranks and alphas alone may differ from r's.
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not set(targets) <= set(TARGET_PARAMETERS):
        raise UserError(
            f"{config_file}: target_parameters={targets!r} is not supported (only {TARGET_PARAMETERS}, the experts "
            "of transformers' mixture-of-experts blocks)"
        )
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(name, str) and name for name in saved):
        raise UserError(f"{config_file}: modules_to_save={saved!r} is not supported (only a list of module names)")
    fused = {name.rpartition(".")[2] for name in targets}
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not set(pattern) <= fused or not all(
            isinstance(v, (int, float)) and v > 0 for v in pattern.values()
        ):
            raise UserError(
                f"{config_file}: {key}={pattern!r} is not supported (only positive numbers for the experts' "
                f"{sorted(fused) or 'target_parameters, which are none here'})"
            )
    return config


def _read_adapter(
    adapter_dir: str | Path,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The config, the tensors by Hugging Face module name (``{"model.layers.0.self_attn.q_proj": {"lora_A.weight":
    ...}}``; an experts block's by the fused parameter they adapt, ``model.layers.0.mlp.experts.gate_up_proj``) of
    a PEFT LoRA adapter folder, and the whole weights of its ``modules_to_save`` by Hugging Face name
    (``{"model.layers.0.mlp.gate.weight": ...}``); each module's rank and scale are :func:`_rank_and_scale`'s.

    Raises:
        UserError: missing or unreadable files, or a PEFT option we do not reproduce; the message names the file.
    """
    config = _read_adapter_config(adapter_dir)
    weights_file = Path(adapter_dir) / ADAPTER_WEIGHTS
    try:
        flat = load_file(str(weights_file))
    except SafetensorError as e:
        raise UserError(f"{weights_file}: cannot read safetensors ({e}); the file may be truncated") from None
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    saved: dict[str, torch.Tensor] = {}
    for key, tensor in flat.items():
        if key.endswith(".base_layer.weight"):
            continue  # PEFT also saves the base of adapted lm_head/embeddings; the base checkpoint has it already
        module, param = None, None
        for peft_name in _FROM_PEFT:
            if key.startswith(_PEFT_PREFIX) and key.endswith("." + peft_name):
                module, param = key[len(_PEFT_PREFIX): -len(peft_name) - 1], peft_name
        name = key.removeprefix(_PEFT_PREFIX)
        if module is None and key.startswith(_PEFT_PREFIX) and any(  # PEFT's rule: the module's name ends so
            name.rpartition(".")[0].endswith(target) for target in config.get("modules_to_save") or []
        ):
            saved[name] = tensor
            continue
        if module is None:
            raise UserError(f"{weights_file}: unexpected key {key!r} (not a LoRA/DoRA weight)")
        if config.get("target_parameters"):  # an experts block's adapters, by the fused parameter they adapt
            module = fused_target(module) or module
        by_module.setdefault(module, {})[param] = tensor
    for module, params in by_module.items():
        if not {"lora_A.weight", "lora_B.weight"} <= params.keys():
            raise UserError(f"{weights_file}: {module} lacks lora_A or lora_B")
        if ("lora_magnitude_vector" in params) != bool(config.get("use_dora", False)):
            raise UserError(f"{weights_file}: {module}: a DoRA magnitude is present iff use_dora in {ADAPTER_CONFIG}")
        rank = _rank_and_scale(config, module)[0]
        if is_fused(module) and params["lora_A.weight"].shape[0] % rank:
            raise UserError(
                f"{weights_file}: {module}.lora_A.weight has {params['lora_A.weight'].shape[0]} rows, not a multiple "
                f"of its rank {rank} (one block per expert)"
            )
    return config, by_module, saved


def _rank_and_scale(config: dict[str, Any], module: str) -> tuple[int, float]:
    # The experts' fused parameters may have their own rank and alpha (rank_pattern, alpha_pattern); the rest r's.
    name = module.rpartition(".")[2]
    rank = (config.get("rank_pattern") or {}).get(name, config["r"])
    return rank, (config.get("alpha_pattern") or {}).get(name, config["lora_alpha"]) / rank


def adapter_linear(adapter_dir: str | Path, *, model_family: str) -> LinearFactory:
    """The projection factory (``linear=`` of every builder) of the model a PEFT adapter folder fits.

    Any plain builder of ``model_family`` given it (``llama3_demo(linear=...)``, ``build_from_hf``) builds the
    LoRA/DoRA model the adapter was saved from, so a recipe given a base and an adapter needs no restated LoRA
    model. ``r``, ``lora_alpha``, ``use_dora`` and ``target_modules`` come from ``adapter_config.json``; the Hugging
    Face module names of ``target_modules`` are matched as PEFT matches them (a module's name, or its end after a
    dot) against the family's names for our adaptable projections (``q_proj``... ``o_proj``, ``gate_proj``,
    ``up_proj``, ``down_proj``, and the output projection, ``lm_head``). The model is for inference: no dropout.
    :func:`load_peft_adapter` then checks the weights against the model.

    Args:
        adapter_dir: a PEFT LoRA/DoRA adapter folder (ours or PEFT's).
        model_family: the ``toolkit.models`` family of the base, whose weight-name conversion maps the names.

    Raises:
        UserError: no adapter folder, a PEFT option we do not reproduce, or targets our builders cannot express
            (a module they do not adapt, some of the feed-forward's projections only, some layers only, a regular
            expression); the message names ``adapter_config.json``.
    """
    config = _read_adapter_config(adapter_dir)
    config_file = Path(adapter_dir) / ADAPTER_CONFIG
    _refuse_merge_only(config, config_file)
    for key in ("layers_to_transform", "layers_pattern", "exclude_modules"):
        if config.get(key):
            raise UserError(
                f"{config_file}: {key}={config[key]!r} is not supported: our LoRA builders adapt the same "
                "projections in every layer"
            )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise UserError(
            f"{config_file}: target_modules={targets!r} is a pattern, which is not supported; list the module names"
        )
    if not targets:
        raise UserError(f"{config_file}: target_modules is empty; nothing to adapt")
    family = load_model_family(model_family)
    refuse_fused(family, model_family, [_hf_module_name(family, path) for path in _ADAPTABLE], str(config_file))
    hf_names = {_hf_module_name(family, path): name for path, name in _ADAPTABLE.items()}
    known = [hf_name.rpartition(".")[2] for hf_name in hf_names]
    adapted = set()
    for target in targets:
        found = {name for hf_name, name in hf_names.items() if hf_name == target or hf_name.endswith(f".{target}")}
        if not found:
            raise UserError(
                f"{config_file}: target_modules has {target!r}, which our LoRA builders do not adapt; they adapt "
                f"{', '.join(known)}"
            )
        adapted |= found
    mlp = adapted & set(MLP_MODULES)
    if mlp and mlp != set(MLP_MODULES):
        hf_mlp = {name: hf_name.rpartition(".")[2] for hf_name, name in hf_names.items() if name in MLP_MODULES}
        has = ", ".join(hf_mlp[name] for name in MLP_MODULES if name in mlp)
        lacks = ", ".join(hf_mlp[name] for name in MLP_MODULES if name not in mlp)
        raise UserError(
            f"{config_file}: target_modules has {has} but not {lacks}; our LoRA builders adapt the feed-forward's "
            f"{', '.join(hf_mlp.values())} all three or none"
        )
    return lora_linear(
        lora_attn_modules=[name for name in ATTN_MODULES if name in adapted],
        apply_lora_to_mlp=bool(mlp),
        apply_lora_to_output="output" in adapted,
        lora_rank=config["r"],
        lora_alpha=config["lora_alpha"],
        use_dora=bool(config.get("use_dora", False)),
    )


def _refuse_merge_only(config: dict[str, Any], config_file: Path) -> None:
    # Adapters on the experts and modules trained whole (routers) are written and merged, not loaded into a model.
    for key, what in (("target_parameters", "adapters on the experts"), ("modules_to_save", "modules trained whole")):
        if config.get(key):
            raise UserError(
                f"{config_file}: {key}={config[key]} ({what}) cannot be loaded into a model here; merge the adapter "
                "into its base (tune merge) and use the merged model"
            )


def fill_adapter_model(
    model: nn.Module, checkpointer: Any, *, adapter_dir: str | Path | None = None
) -> None:
    """Put the weights into a materialized LoRA/DoRA/QLoRA model (a ``fill`` for ``parallelize``).

    The base comes from ``checkpointer`` (a base checkpoint holds no adapter keys), or is initialized at random from
    the current seed when it has no ``checkpoint_dir``. The adapters are then initialized so that the model
    computes exactly its base (LoRA ``B`` = 0, DoRA magnitudes = the base rows' norms), and with ``adapter_dir``
    a PEFT adapter's weights replace them. A model without adapters just gets its base.
    """
    if checkpointer.checkpoint_dir is not None:
        checkpointer.load(model, ignore_missing=is_adapter_key)
    else:
        init_weights(model)
    init_adapters(model)
    if adapter_dir is not None:
        load_peft_adapter(model, adapter_dir, model_family=checkpointer.family_name)


@torch.no_grad()
def load_peft_adapter(model: nn.Module, adapter_dir: str | Path, *, model_family: str) -> None:
    """Copy a PEFT adapter folder's weights into the adapter layers of ``model``.

    The model must have been built with the adapter's targets, rank, alpha and kind (LoRA or DoRA). Its parameters
    may be FSDP2-sharded: each rank copies its own part.

    Raises:
        UserError: the folder is not a PEFT LoRA adapter, or its targets, rank, alpha, kind or shapes differ from
            the model's; the message names the file and the module.
    """
    family = load_model_family(model_family)
    config, by_module, _ = _read_adapter(adapter_dir)
    _refuse_merge_only(config, Path(adapter_dir) / ADAPTER_CONFIG)
    weights_file = Path(adapter_dir) / ADAPTER_WEIGHTS
    refuse_fused(family, model_family, list(by_module), str(weights_file))
    modules = {_hf_module_name(family, name): module for name, module in adapter_modules(model).items()}
    if by_module.keys() != modules.keys():
        missing, extra = sorted(modules.keys() - by_module.keys()), sorted(by_module.keys() - modules.keys())
        raise UserError(
            f"{weights_file}: the adapter's modules differ from the model's "
            f"(missing: {missing[:3]}, not in the model: {extra[:3]}); build the model with the adapter's targets"
        )
    for hf_name, module in modules.items():
        if (module.rank, module.alpha) != (config["r"], config["lora_alpha"]):
            raise UserError(
                f"{weights_file}: r={config['r']}, lora_alpha={config['lora_alpha']} but the model's {hf_name} has "
                f"rank {module.rank}, alpha {module.alpha}"
            )
        if isinstance(module, DoRALinear) != bool(config.get("use_dora", False)):
            kind = "DoRA" if isinstance(module, DoRALinear) else "LoRA"
            use_dora = config.get("use_dora", False)
            raise UserError(f"{weights_file}: use_dora={use_dora} but the model's {hf_name} is {kind}")
        for peft_name, tensor in by_module[hf_name].items():
            target = module.get_parameter(_FROM_PEFT[peft_name])
            if tensor.shape != target.shape:
                raise UserError(
                    f"{weights_file}: {hf_name}.{peft_name} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(target.shape)}"
                )
            copy_full_(target, tensor)  # under FSDP2, this rank's rows only


def _merge(weight: torch.Tensor, params: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    # LoRA: W + s B A (Hu et al., 2021); DoRA: m (W + s B A) / ||W + s B A||, rows (Liu et al., 2024). In float32,
    # returned in the base dtype.
    merged = weight.float() + scale * (params["lora_B.weight"].float() @ params["lora_A.weight"].float())
    if "lora_magnitude_vector" in params:
        norm = torch.linalg.vector_norm(merged, dim=1, keepdim=True)
        merged = params["lora_magnitude_vector"].float().unsqueeze(1) * merged / norm
    return merged.to(weight.dtype)


def merge_adapter_into_checkpoint(
    base_dir: str | Path, adapter_dir: str | Path, output_dir: str | Path, *, overwrite: bool = False
) -> Path:
    """Write the Hugging Face checkpoint of ``base_dir`` with the PEFT adapter of ``adapter_dir`` merged in.

    Works on the files alone (no model is built, any family; a family the base's ``config.json`` names also
    matches weights its files name otherwise than the adapter, as Gemma 3's multimodal checkpoints): the base is
    streamed one safetensors file at a time, each adapted weight replaced by its merged value and each weight of a
    module trained whole (``modules_to_save``: trained routers) by the adapter's, and written with the same file
    names and index; ``config.json`` and tokenizer files are copied. The folder appears only when complete.

    Args:
        base_dir: the base model's Hugging Face folder.
        adapter_dir: a PEFT LoRA/DoRA adapter folder (ours or PEFT's).
        output_dir: the merged checkpoint folder to write.
        overwrite: replace ``output_dir`` if it exists.

    Returns:
        ``output_dir``.

    Raises:
        UserError: unreadable inputs, an adapter module without a base weight, a shape mismatch, an ``output_dir``
            that is, holds or lies inside an input folder, or an existing one without ``overwrite``; checked before
            anything is written where possible.
    """
    base_dir, output_dir = Path(base_dir), Path(output_dir)
    if not base_dir.is_dir():
        raise UserError(f"--base: {base_dir} is not a folder")
    check_output_apart(output_dir, option="--output", inputs=[("the base", base_dir), ("the adapter", adapter_dir)])
    if output_dir.exists() and not overwrite:
        raise UserError(f"--output: {output_dir} already exists; choose another folder or pass --overwrite")
    config, by_module, saved = _read_adapter(adapter_dir)
    targets = {f"{module}.weight": params for module, params in by_module.items() if not is_fused(module)}
    scales = {f"{module}.weight": _rank_and_scale(config, module)[1] for module in by_module}
    # Adapters on the experts: every expert's delta of each fused parameter, applied to the checkpoint's per-expert
    # (or fused) tensors, which the base's family names.
    experts = {
        module: fused_delta(params, *_rank_and_scale(config, module))
        for module, params in by_module.items() if is_fused(module)
    }
    # (A family without experts has none of their tensors: each adapted one is then missing.)
    family = load_model_family(read_hf_config(base_dir)[1]) if experts or saved else _known_family(base_dir)
    # A base whose files name the adapted weights otherwise than the adapter does (Gemma 3's multimodal checkpoint
    # holds its language model under language_model.model.*, the adapter names the text-only layout) is matched by
    # the family's names for both.
    by_ours = {} if family is None else {ours: key for key in targets if (ours := _tune_key(family, key)) is not None}

    def target(key: str) -> str | None:
        """The adapted weight (by the adapter's name) that the base's tensor ``key`` is, if any."""
        if key in targets:
            return key
        return by_ours.get(_tune_key(family, key)) if by_ours else None

    # Experts' parts only where the adapter has experts or whole weights (a fused dense projection is no expert).
    hf_key_to_parts = getattr(family if experts or saved else None, "hf_key_to_parts", lambda key: None)
    # The weights trained whole, by our name: the adapter names them as transformers 5 holds them (``mlp.gate``),
    # the checkpoint's files as its family writes them (Mixtral's ``block_sparse_moe.gate``).
    replaced = {}
    for name, tensor in saved.items():
        if (ours := _tune_key(family, name)) is None:
            raise UserError(f"{Path(adapter_dir) / ADAPTER_WEIGHTS}: {name!r} is no weight of a {family.__name__} model")
        replaced[ours] = tensor
    files = _weight_files(base_dir)
    found: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for key in reader.keys():
                    if (adapted := target(key)) is not None:
                        found.add(adapted)
                    if replaced and (ours := _tune_key(family, key)) in replaced:
                        found.add(ours)
                    for part in hf_key_to_parts(key) or ():
                        found.add(part_of_fused(part.key)[0])
        except SafetensorError as e:
            raise UserError(f"{file}: cannot read safetensors ({e}); the file may be truncated or corrupt") from None
    missing = sorted((targets.keys() | experts.keys() | replaced.keys()) - found)
    if missing:
        raise UserError(
            f"{base_dir}: no base weight {missing[0]!r} for the adapter's module (tied embeddings, or another model?)"
        )

    def write(tmp_dir: Path) -> None:
        for file in files:
            out = {}
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                metadata = reader.metadata() or {"format": "pt"}
                for key in reader.keys():
                    tensor = reader.get_tensor(key)
                    if (adapted := target(key)) is not None:
                        params = targets[adapted]
                        shape = (params["lora_B.weight"].shape[0], params["lora_A.weight"].shape[1])
                        if tuple(tensor.shape) != shape:
                            got = tuple(tensor.shape)
                            raise UserError(f"{file}: {key} has shape {got}; the adapter expects {shape}")
                        tensor = _merge(tensor, params, scales[adapted])
                    elif (parts := hf_key_to_parts(key)) and part_of_fused(parts[0].key)[0] in experts:
                        delta = _experts_delta(parts, experts)
                        if delta.shape != tensor.shape:
                            got, shape = tuple(tensor.shape), tuple(delta.shape)
                            raise UserError(f"{file}: {key} has shape {got}; the adapter expects {shape}")
                        tensor = (tensor.float() + delta).to(tensor.dtype)
                    elif replaced and (ours := _tune_key(family, key)) in replaced:
                        if replaced[ours].shape != tensor.shape:
                            got, shape = tuple(tensor.shape), tuple(replaced[ours].shape)
                            raise UserError(f"{file}: {key} has shape {got}; the adapter's is {shape}")
                        tensor = replaced[ours].to(tensor.dtype)
                    out[key] = tensor
            save_file(out, str(tmp_dir / file.name), metadata=metadata)
        for name in (SAFETENSORS_INDEX, "config.json", *TOKENIZER_FILES):
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp_dir / name)

    return _write_atomically(output_dir, write)


def _known_family(base_dir: Path) -> Any:
    """The family of the ``config.json`` in ``base_dir``, or None where there is none we know (a merge by the
    adapter's names alone needs none)."""
    config = base_dir / "config.json"
    if not config.is_file() or read_json(config).get("model_type") not in hf_model_types():
        return None
    return load_model_family(read_hf_config(base_dir)[1])


def _tune_key(family: Any, hf_key: str) -> str | None:
    """Our name of a Hugging Face weight, or None for a name ``family`` does not know."""
    try:
        return family.hf_key_to_tune(hf_key)
    except KeyError:
        return None


def _experts_delta(parts: list, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
    """The adapter's delta for one checkpoint tensor of the experts (one expert's projection, or a fused parameter),
    from the parts of our stacked experts it holds (its family's ``hf_key_to_parts``) and the fused deltas by name."""
    blocks = []
    for part in parts:
        fused, block, count = part_of_fused(part.key)
        delta = deltas[fused]
        rows = delta.shape[1] // count
        delta = delta[:, block * rows : (block + 1) * rows]
        blocks.append(delta if part.index is None else delta[part.index])
    # Parts that share one tensor fill its row blocks (``Part.rows``), in order.
    order = sorted(range(len(parts)), key=lambda i: parts[i].rows[0] if parts[i].rows else 0)
    return torch.cat([blocks[i] for i in order], dim=-2)


def save_adapter_and_merged(
    model: nn.Module,
    checkpointer: Any,
    *,
    output_dir: Path,
    save_merged: bool,
    build: Callable[[], nn.Module],
    is_rank_zero: bool,
    log: Callable[[str], None] = print,
) -> None:
    """A trained LoRA/DoRA/QLoRA run's results: the PEFT adapter in ``output_dir/adapter`` and, with
    ``save_merged``, the base with the adapters merged in, in Hugging Face format, in ``output_dir/merged``. With
    adapters on a mixture-of-experts model's experts that PEFT cannot load (trained with dropout), the merged model
    alone. A collective: every rank calls it.

    Sharded (FSDP2 or tensor-parallel) adapters are gathered one tensor at a time (they are small) and rank zero
    writes them; the merged model is computed from each rank's shards of the base and the adapters and exported as
    the full fine-tune exports, every rank writing its share: the base is never gathered on one rank. QLoRA's NF4
    bases under FSDP2 are the exception: the model is gathered on rank zero, rebuilt there (``build()`` makes it
    on the meta device) and merged.
    """
    plain = unwrap(model)
    base = str(checkpointer.checkpoint_dir) if checkpointer.checkpoint_dir is not None else None
    sharded = any(isinstance(p, DTensor) for p in plain.parameters())
    nf4 = has_nf4(plain)
    no_adapter = no_peft_form(adapter_modules(plain))
    if no_adapter:
        log(f"{no_adapter}: writing the merged model instead of the adapter")
    save_merged = save_merged or bool(no_adapter)
    family = checkpointer.family_name
    if sharded and nf4:
        full_state = gather_full_state_dict(model)
        if not is_rank_zero:
            return
        with torch.device("meta"):
            plain = build()
        plain.load_state_dict(full_state, assign=True)
        adapter_dir = save_peft_adapter(plain, output_dir / "adapter", model_family=family,
                                        base_model_name_or_path=base)
        log(f"saved {adapter_dir}")
        if save_merged:
            merged_dir = checkpointer.save(plain, output_dir / "merged", state_dict=get_merged_state_dict(plain))
            log(f"saved {merged_dir}")
        return
    if not no_adapter:
        adapter_dir = export_peft_adapter(plain, output_dir / "adapter", model_family=family,
                                          base_model_name_or_path=base)
        barrier()  # rank zero's folder is in place before any rank goes on
        log(f"saved {adapter_dir}")
    if save_merged:
        merged_dir = checkpointer.export(model, output_dir / "merged", state_dict=get_merged_state_dict(plain))
        log(f"saved {merged_dir}")
