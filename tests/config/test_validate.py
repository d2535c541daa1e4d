from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from toolkit.config import ConfigError, instantiate, load_config, validate

T = "tests.config._targets"

GOOD = f"""\
output_dir: /tmp/run
model:
  _component_: {T}.Box
  size: 2
  item:
    _component_: {T}.point
    x: 1
dataset:
  _component_: {T}.with_tokenizer
  max_seq_len: 16
optimizer:
  _component_: torch.optim.AdamW
  lr: 1.0e-4
lr_scheduler:
  _component_: {T}.schedule
  warmup_steps: 2
extras:
  - _component_: {T}.collect
    anything: goes
"""


def test_clean_config_passes(write_yaml) -> None:
    # `tokenizer`, `params`, `optimizer` and `total_steps` are passed by the recipe.
    validate(load_config(write_yaml(GOOD)))


def test_typo_names_file_key_and_suggestion(write_yaml) -> None:
    path = write_yaml(GOOD.replace("size: 2", "sise: 2"))
    with pytest.raises(ConfigError) as info:
        validate(load_config(path))
    assert str(info.value) == f"{path}: model.sise: not an argument of {T}.Box; did you mean 'size'?"


def test_nested_component_is_checked(write_yaml) -> None:
    path = write_yaml(GOOD.replace("    x: 1", "    x: 1\n    w: 2"))
    with pytest.raises(ConfigError, match=rf"^{path}: model\.item\.w: not an argument of {T}\.point"):
        validate(load_config(path))


def test_component_in_a_list_is_checked() -> None:
    cfg = OmegaConf.create({"layers": [{"_component_": f"{T}.point", "x": 1}, {"_component_": f"{T}.pointy"}]})
    with pytest.raises(ConfigError, match=r"^<config>: layers\[1\]: cannot import .*did you mean 'point'"):
        validate(cfg)


def test_missing_required_argument(write_yaml) -> None:
    path = write_yaml(GOOD.replace("    x: 1\n", "    y: 1\n"))
    with pytest.raises(ConfigError) as info:
        validate(load_config(path))
    assert str(info.value) == f"{path}: model.item: missing required argument 'x' of {T}.point"


def test_missing_keyword_only_argument() -> None:
    with pytest.raises(ConfigError, match="missing required argument 'width'"):
        validate(OmegaConf.create({"s": {"_component_": f"{T}.spacer"}}))


def test_runtime_args_can_be_changed() -> None:
    cfg = OmegaConf.create({"d": {"_component_": f"{T}.with_tokenizer"}})
    validate(cfg)
    with pytest.raises(ConfigError, match="missing required argument 'tokenizer'"):
        validate(cfg, runtime_args=())


def test_all_problems_are_reported_one_per_line(write_yaml) -> None:
    bad = (
        GOOD.replace("size: 2", "sise: 2")
        .replace("torch.optim.AdamW", "torch.optim.AdamWW")
        .replace("output_dir: /tmp/run", "output_dir: ${nowhere}")
    )
    path = write_yaml(bad)
    with pytest.raises(ConfigError) as info:
        validate(load_config(path), source="my.yaml")
    lines = str(info.value).splitlines()
    assert lines == [
        "my.yaml: output_dir: cannot resolve interpolation: Interpolation key 'nowhere' not found",
        f"my.yaml: model.sise: not an argument of {T}.Box; did you mean 'size'?",
        "my.yaml: optimizer: cannot import 'torch.optim.AdamWW': 'torch.optim' has no 'AdamWW'; did you mean 'AdamW'?",
    ]


def test_missing_value_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: output_dir: no value given"):
        validate(OmegaConf.create({"output_dir": "???"}))


def test_missing_component_target() -> None:
    with pytest.raises(ConfigError, match="m: _component_ must be a dotted path"):
        validate(OmegaConf.create({"m": {"_component_": None}}))


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("count", "abc", "expects int, got 'abc' (str)"),
        ("count", 2.5, "expects int, got 2.5 (float)"),
        ("count", True, "expects int, got True (bool)"),
        ("rate", "fast", "expects float, got 'fast' (str)"),
        ("flag", "yes", "expects bool, got 'yes' (str)"),
        ("name", None, "expects str, got null"),
        ("limit", "ten", "expects int or null, got 'ten' (str)"),
        ("mode", "medium", "expects one of 'fast', 'slow', got 'medium' (str)"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_before_the_run(key: str, value: object, problem: str) -> None:
    # Without the check, `max_seq_len=abc` reached torch.empty inside the model builder as a TypeError traceback.
    cfg = OmegaConf.create({"model": {"_component_": f"{T}.typed", key: value}})
    expected = f"<config>: model.{key}: {problem} (an argument of {T}.typed)"
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == expected
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.model)  # a recipe run without `tune` stops as clearly
    assert str(info.value) == expected.removeprefix("<config>: ")


@pytest.mark.parametrize(
    ("key", "value"),
    [("count", 3), ("rate", 2), ("rate", 1e-4), ("flag", True), ("limit", None), ("limit", 4), ("mode", "slow"),
     ("anything", "x"), ("name", "${other}")],
)
def test_values_that_fit_pass(key: str, value: object) -> None:
    cfg = OmegaConf.create({"other": "b", "model": {"_component_": f"{T}.typed", key: value}})
    validate(cfg)
    instantiate(cfg.model)


def test_max_seq_len_that_is_not_a_number_is_caught_in_a_shipped_config() -> None:
    from toolkit.paths import configs_dir

    path = configs_dir() / "full_finetune" / "demo.yaml"
    cfg = load_config(path)
    cfg.max_seq_len = "abc"
    with pytest.raises(ConfigError, match=r"model\.max_seq_len: expects int, got 'abc' \(str\)"):
        validate(cfg)
