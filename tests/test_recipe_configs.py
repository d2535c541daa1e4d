"""Every shipped config validates, its model builds (on the meta device, so 70B costs nothing), and it fits the
hardware its header names by the planner's estimate."""

import json
import re
from pathlib import Path

import pytest
import torch

from toolkit.cli._catalog import recipe_schema
from toolkit.cli.plan import configured_memory
from toolkit.config import instantiate, load_config, recipe_keys, validate
from toolkit.paths import configs_dir, recipes_dir

CONFIGS = sorted(configs_dir().glob("*/*.yaml"))
TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 256,
}


def test_every_config_folder_belongs_to_a_recipe():
    recipes = {p.stem for p in recipes_dir().glob("*.py")}
    assert CONFIGS, "no configs found"
    for folder in {c.parent for c in CONFIGS}:
        assert folder.name in recipes, f"{folder} has no recipes/{folder.name}.py"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_config_validates_and_model_builds(path: Path, tmp_path: Path):
    cfg = load_config(path)
    # Against the recipe's declared schema, for the number of processes its header launches with (or any).
    validate(cfg, schema=recipe_schema(recipes_dir() / f"{path.parent.name}.py"))
    if "build_from_hf" in cfg.get("model", {}).get("_component_", ""):
        # A config for any checkpoint: its architecture comes from the folder's config.json.
        folder = tmp_path / "hf_model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
        cfg.checkpointer.checkpoint_dir = str(folder)
    if "model" in cfg:
        with torch.device("meta"):
            model = instantiate(cfg.model)
        assert sum(p.numel() for p in model.parameters()) > 0
        if "build_from_hf" not in cfg.model._component_:  # (a claim about any checkpoint is about none in particular)
            _check_hardware_claims(path, cfg, model)


# What a header promises: "Sized for 8 80 GB GPUs", "one 24 GB GPU is enough", "2 nodes of 8 80 GB GPUs".
HARDWARE_CLAIM = re.compile(r"(?:\b(\d+|one) nodes? of )?\b(\d+|one) (\d+) GB GPUs?\b")


def hardware_claims(header: str) -> list[tuple[int, int, int]]:
    """``(nodes, processes per node, GB per GPU)`` for each claim in a config's header comment."""
    text = " ".join(line.lstrip("#").strip() for line in header.splitlines())
    number = {"one": 1}
    return [(number.get(nodes, 0) or int(nodes or 1), number.get(gpus, 0) or int(gpus), int(gb))
            for nodes, gpus, gb in HARDWARE_CLAIM.findall(text)]


def test_hardware_claims_are_read_as_written():
    assert hardware_claims("# Sized for 8 80 GB GPUs in bf16") == [(1, 8, 80)]
    assert hardware_claims("# one 24 GB GPU is enough, and more GPUs\n# on 2 nodes of 8 80 GB\n# GPUs (16)") == [
        (1, 1, 24), (2, 8, 80)]
    assert hardware_claims("# Memory: one node of 8 141 GB GPUs (H200)") == [(1, 8, 141)]
    assert hardware_claims("# fewer or smaller GPUs: lower micro_batch_size; ~36 GiB per GPU") == []


def _check_hardware_claims(path: Path, cfg, model) -> None:
    """The config, as shipped, fits the hardware its header names, by the planner's estimate (`tune plan`): a claim
    and the planner cannot drift apart."""
    header = re.match(r"(#.*\n)*", path.read_text()).group(0)
    for nodes, gpus, gb in hardware_claims(header):
        estimate, usable = configured_memory(cfg, model, nproc=gpus, nnodes=nodes, device_memory_gb=gb)
        assert estimate.total <= usable, (
            f"{path.parent.name}/{path.stem}: the header names {nodes} node(s) x {gpus} {gb} GB GPU(s), where "
            f"{estimate.label} needs {estimate.total / 2**30:.1f} GiB of {usable / 2**30:.1f} usable per GPU; "
            f"see `tune plan {path.parent.name} --config {path.stem} --nproc_per_node {gpus} --nnodes {nodes} "
            f"--device-memory-gb {gb}`"
        )


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.py")))
def test_every_key_a_recipe_reads_is_declared_in_its_schema(recipe: str):
    # The schema and the code cannot drift apart: a key read but not declared would go unchecked, a key declared
    # but not read would be accepted and ignored.
    path = recipes_dir() / f"{recipe}.py"
    schema, reads = recipe_schema(path), recipe_keys(path)
    assert schema is not None and reads is not None, f"{recipe} declares no schema"
    top_level = {key for key in schema.keys if "." not in key}
    assert top_level == reads.reads, f"declared, not read: {top_level - reads.reads}; read, not declared: " \
        f"{reads.reads - top_level}"
    required = {key for key in top_level if schema.keys[key].required}
    assert required == reads.required, (
        f"required by the schema but read with cfg.get: {required - reads.required}; "
        f"read as cfg.<key> but optional in the schema: {reads.required - required}"
    )
