"""Every shipped config validates, and its model builds (on the meta device, so 70B costs nothing)."""

import json
from pathlib import Path

import pytest
import torch

from toolkit.config import instantiate, load_config, validate
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
    validate(cfg)
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
