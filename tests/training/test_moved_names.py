"""What moved out of toolkit.training into rooms of its own (issue 41) is still where a recipe, a config or a step
checkpoint written before the move looks for it: the same objects, importable from ``toolkit.training``, lazily,
and the old ``_component_`` paths build, resume and export as the new ones."""

import importlib
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import toolkit.training
from toolkit.checkpoint.export import _BUILT, _is_ours
from toolkit.checkpoint.step_reader import _check_config
from toolkit.errors import UserError
from toolkit.config.moved import MOVED, current_path
from tests.launch import run_tune_here


def test_every_public_name_of_toolkit_training_resolves_to_the_object_its_room_defines():
    assert set(MOVED) <= set(toolkit.training.__all__)
    for name in toolkit.training.__all__:
        found = getattr(toolkit.training, name)
        if name in MOVED:
            room = importlib.import_module(MOVED[name])
            assert found is getattr(room, name), name
            assert MOVED[name] != "toolkit.training", name
    with pytest.raises(AttributeError, match="no attribute 'HFCheckpointr'"):
        toolkit.training.HFCheckpointr  # noqa: B018  (a typo is an AttributeError, not a lookup in another room)


def test_from_toolkit_training_import_still_works_for_a_recipe_written_before_the_move():
    namespace: dict = {}
    exec("from toolkit.training import HFCheckpointer, Muon, StepCheckpointer, plan_parallelism, init_distributed",
         namespace)
    from toolkit.checkpoint import HFCheckpointer, StepCheckpointer
    from toolkit.optim import Muon

    assert (namespace["HFCheckpointer"], namespace["Muon"], namespace["StepCheckpointer"]) == (
        HFCheckpointer, Muon, StepCheckpointer)


def test_importing_the_training_room_imports_no_room_above_it():
    # A fresh interpreter: this one has imported everything already.
    above = ("toolkit.planning", "toolkit.checkpoint", "toolkit.objectives", "toolkit.cli")
    code = (
        "import sys, toolkit.training; "
        f"print(sorted(m for m in sys.modules if m.startswith({above!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_current_path_renames_only_the_names_that_moved():
    assert current_path("toolkit.training.HFCheckpointer") == "toolkit.checkpoint.HFCheckpointer"
    assert current_path("toolkit.training.cosine_with_warmup") == "toolkit.optim.cosine_with_warmup"
    assert current_path("toolkit.training.Muon") == "toolkit.optim.Muon"
    # Names that stayed, other packages, and a moved name under another package are themselves.
    for same in ("toolkit.training.set_seed", "torch.optim.AdamW", "toolkit.models.llama3.HFCheckpointer", "Muon"):
        assert current_path(same) == same


def test_a_config_naming_the_old_paths_validates():
    result = run_tune_here(
        "validate", "full_finetune/demo", "checkpointer._component_=toolkit.training.HFCheckpointer",
        "lr_scheduler._component_=toolkit.training.cosine_with_warmup",
    )
    assert result.returncode == 0, result.stderr


def _saved_config(tmp_path, checkpointer: str):
    OmegaConf.save(
        OmegaConf.create({"model": {"_component_": "toolkit.models.llama3.lora_llama3_tiny"}, "seed": 0,
                          "checkpointer": {"_component_": checkpointer, "checkpoint_dir": "base"}}),
        tmp_path / "config.yaml",
    )


def test_resuming_a_checkpoint_whose_config_names_the_old_checkpointer_path(tmp_path):
    _saved_config(tmp_path, "toolkit.training.HFCheckpointer")
    now = OmegaConf.create({"model": {"_component_": "toolkit.models.llama3.lora_llama3_tiny"}, "seed": 0,
                            "checkpointer": {"_component_": "toolkit.checkpoint.HFCheckpointer",
                                             "checkpoint_dir": "base"}})
    _check_config(tmp_path, now, ("model", "checkpointer", "seed"))  # the same checkpointer: no refusal
    # Another checkpointer is still refused, named with the key.
    now.checkpointer._component_ = "toolkit.checkpoint.MetaCheckpointer"
    with pytest.raises(UserError, match=r"checkpointer\._component_="):
        _check_config(tmp_path, now, ("model", "checkpointer", "seed"))


def test_export_builds_the_old_checkpointer_path_and_still_refuses_other_code():
    package, _, fits = _BUILT["checkpointer"]
    assert _is_ours("toolkit.training.HFCheckpointer", package, fits)
    assert _is_ours("toolkit.checkpoint.HFCheckpointer", package, fits)
    assert not _is_ours("toolkit.training.set_seed", package, fits)  # not a checkpointer
    assert not _is_ours("os.system", package, fits)
