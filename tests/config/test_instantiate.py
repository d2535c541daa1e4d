from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.config._targets import Box
from toolkit.config import ConfigError, instantiate, load_config

T = "tests.config._targets"


def test_none_is_none() -> None:
    assert instantiate(None) is None


def test_keys_become_keyword_arguments() -> None:
    cfg = OmegaConf.create({"p": {"_component_": f"{T}.point", "x": 3}})
    assert instantiate(cfg.p) == {"x": 3, "y": 0}


def test_plain_dict_node() -> None:
    assert instantiate({"_component_": f"{T}.point", "x": 1, "y": 2}) == {"x": 1, "y": 2}


def test_kwargs_override_config_and_args_are_positional() -> None:
    cfg = OmegaConf.create({"_component_": f"{T}.pair", "second": "from config"})
    assert instantiate(cfg, "runtime") == ("runtime", "from config")
    assert instantiate(cfg, "runtime", second="kwarg") == ("runtime", "kwarg")


def test_nested_components_in_dicts_and_lists() -> None:
    cfg = OmegaConf.create(
        {
            "box": {
                "_component_": f"{T}.Box",
                "item": {"_component_": f"{T}.point", "x": 1},
                "tags": ["a", "b"],
            },
            "many": {
                "_component_": f"{T}.collect",
                "boxes": [{"_component_": f"{T}.Box", "size": 2}, {"_component_": f"{T}.Box", "size": 3}],
                "options": {"inner": {"_component_": f"{T}.point", "x": 9}, "plain": [1, {"k": "v"}]},
            },
        }
    )
    box = instantiate(cfg.box)
    assert isinstance(box, Box) and box.item == {"x": 1, "y": 0}
    assert box.tags == ["a", "b"] and type(box.tags) is list  # plain lists, not ListConfig
    named = instantiate(cfg.many)["named"]
    assert [b.size for b in named["boxes"]] == [2, 3]
    assert named["options"]["inner"] == {"x": 9, "y": 0}
    assert type(named["options"]) is dict and named["options"]["plain"] == [1, {"k": "v"}]
    assert type(named["options"]["plain"][1]) is dict


def test_interpolation_is_resolved() -> None:
    cfg = OmegaConf.create({"size": 4, "box": {"_component_": f"{T}.Box", "size": "${size}"}})
    assert instantiate(cfg.box).size == 4


def test_bad_module_attribute_suggests(write_yaml) -> None:
    path = write_yaml(f"model:\n  _component_: {T}.pointt\n")
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.model)
    assert str(info.value) == (
        f"{path}: model: cannot import '{T}.pointt': '{T}' has no 'pointt'; did you mean 'point'?"
    )


def test_bad_submodule_suggests() -> None:
    cfg = OmegaConf.create({"loss": {"_component_": "tests.confg._targets.point"}})
    with pytest.raises(ConfigError, match="loss: cannot import .*'tests' has no 'confg'; did you mean 'config'"):
        instantiate(cfg.loss)


def test_unknown_top_level_module() -> None:
    cfg = OmegaConf.create({"m": {"_component_": "no_such_package_xyz.thing"}})
    with pytest.raises(ConfigError, match="m: cannot import 'no_such_package_xyz.thing'"):
        instantiate(cfg.m)


def test_not_a_dotted_path() -> None:
    with pytest.raises(ConfigError, match="must be a dotted path"):
        instantiate(OmegaConf.create({"m": {"_component_": "point"}}).m)


def test_bad_keyword_names_key_path(write_yaml) -> None:
    path = write_yaml(f"outer:\n  inner:\n    _component_: {T}.point\n    x: 1\n    yy: 2\n")
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.outer.inner)
    assert str(info.value) == f"{path}: outer.inner.yy: not an argument of {T}.point; did you mean 'y'?"


def test_bad_keyword_in_nested_list_component() -> None:
    cfg = OmegaConf.create({"c": {"_component_": f"{T}.collect", "boxes": [{"_component_": f"{T}.Box", "sise": 1}]}})
    with pytest.raises(ConfigError, match=r"c\.boxes\[0\]\.sise: not an argument of .*did you mean 'size'"):
        instantiate(cfg.c)


def test_missing_required_argument() -> None:
    cfg = OmegaConf.create({"p": {"_component_": f"{T}.point", "y": 1}})
    with pytest.raises(ConfigError, match=r"^p: cannot call .*point: missing a required argument: 'x'"):
        instantiate(cfg.p)


def test_type_error_inside_the_callable_is_not_a_config_error() -> None:
    with pytest.raises(TypeError, match="a bug inside"):
        instantiate(OmegaConf.create({"_component_": f"{T}.raises_inside", "x": 1}))


def test_recipe_passing_a_wrong_keyword_is_a_bug_not_a_config_error() -> None:
    with pytest.raises(TypeError) as info:
        instantiate(OmegaConf.create({"_component_": f"{T}.point", "x": 1}), wrong=1)
    assert not isinstance(info.value, ConfigError)


def test_node_without_component() -> None:
    with pytest.raises(ConfigError, match="no '_component_'"):
        instantiate(OmegaConf.create({"m": {"x": 1}}).m)


def test_an_objects_own_argument_error_names_the_key_of_the_node_it_was_built_from(tmp_path) -> None:
    # The same checkpointer class under two keys: each refusal names its own key path, nested ones too.
    from toolkit.errors import UserError

    missing = tmp_path / "gone"
    node = {"_component_": "toolkit.checkpoint.HFCheckpointer", "checkpoint_dir": str(missing),
            "model_family": "llama3"}
    cfg = OmegaConf.create({"checkpointer": node, "distill": {"teacher_checkpointer": node}})
    for key in ("checkpointer", "distill.teacher_checkpointer"):
        built = OmegaConf.select(cfg, key)
        with pytest.raises(UserError) as info:
            instantiate(built)
        assert str(info.value) == f"{key}.checkpoint_dir: {missing} is not a folder"
    # Built in code, with no key to name: the argument alone.
    from toolkit.checkpoint import HFCheckpointer

    with pytest.raises(UserError, match=rf"^checkpoint_dir: {missing} is not a folder$"):
        HFCheckpointer(str(missing), model_family="llama3")
