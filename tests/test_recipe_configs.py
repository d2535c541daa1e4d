"""Every shipped config validates, and its model builds (on the meta device, so 70B costs nothing)."""

import json
from pathlib import Path

import pytest
import torch

from toolkit.cli._catalog import recipe_schema
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
