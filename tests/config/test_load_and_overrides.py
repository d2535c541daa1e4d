from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from toolkit.config import (
    ConfigError,
    apply_overrides,
    config_source,
    did_you_mean,
    load_config,
    parse_recipe_args,
    recipe_keys,
)
from toolkit.errors import UserError

BASE = """\
output_dir: /tmp/run
lr: 0.001
model:
  _component_: tests.config._targets.point
  x: 1
  y: 2
dims: [1, 2, 3]
"""


def test_config_error_is_a_user_error() -> None:
    assert issubclass(ConfigError, UserError)


def test_did_you_mean() -> None:
    assert did_you_mean("num_layerz", ["num_layers", "embed_dim"]) == "; did you mean 'num_layers'?"
    assert did_you_mean("zzz", ["num_layers"]) == ""


def test_load_remembers_source(write_yaml) -> None:
    path = write_yaml(BASE)
    cfg = load_config(path)
    assert cfg.model.x == 1 and cfg.dims == [1, 2, 3]
    assert config_source(cfg) == str(path)
    assert config_source(cfg.model) == str(path)  # nodes lead back to their file


def test_load_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_load_invalid_yaml_names_file_and_line(write_yaml) -> None:
    path = write_yaml("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not valid YAML: line ") and "\n" not in message


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n"])
def test_load_rejects_non_mapping(write_yaml, text: str) -> None:
    path = write_yaml(text)
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(path)


def test_load_rejects_duplicate_keys(write_yaml) -> None:
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(write_yaml("a: 1\na: 2\n"))


def test_overrides_set_nested_and_new_keys(write_yaml) -> None:
    cfg = load_config(write_yaml(BASE))
    apply_overrides(cfg, ["model.x=5", "model.extra.deep=hi", "new_key=3", "dims.1=20"])
    assert cfg.model.x == 5
    assert cfg.model.extra.deep == "hi"
    assert cfg.new_key == 3
    assert cfg.dims == [1, 20, 3]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("v=1e-4", 1e-4),
        ("v=3", 3),
        ("v=2.5", 2.5),
        ("v=true", True),
        ("v=null", None),
        ("v=[1,2]", [1, 2]),
        ("v={a: 1, b: [x]}", {"a": 1, "b": ["x"]}),
        ("v=hello world", "hello world"),
        ('v="a=b"', "a=b"),  # quoted, as when the shell passes the quotes through
        ("v=a=b", "a=b"),  # everything after the first '=' is the value
        ("v='007'", "007"),
        ("v=", ""),
        ("v=.inf", float("inf")),
        # Text that is not a flow list/dict or quoted stays exactly as typed, even where YAML would read
        # a mapping, a comment, a date or a syntax error.
        ("v=reverse: hello", "reverse: hello"),
        ("v=what is #1", "what is #1"),
        ("v=2024-01-31", "2024-01-31"),
        ("v=a: b: c", "a: b: c"),
        ("v=- item", "- item"),
        ('v="quoted: yes"', "quoted: yes"),
    ],
)
def test_override_values_are_yaml(override: str, expected: object) -> None:
    cfg = OmegaConf.create({})
    apply_overrides(cfg, [override])
    value = cfg.v
    assert (OmegaConf.to_container(value) if OmegaConf.is_config(value) else value) == expected


def test_override_replaces_a_section() -> None:
    cfg = OmegaConf.create({"model": {"x": 1, "y": 2}})
    apply_overrides(cfg, ["model={x: 3}"])
    assert OmegaConf.to_container(cfg.model) == {"x": 3}


def test_override_can_interpolate() -> None:
    cfg = OmegaConf.create({"output_dir": "/tmp/run"})
    apply_overrides(cfg, ["log_dir=${output_dir}/logs"])
    assert cfg.log_dir == "/tmp/run/logs"


def test_delete_key(write_yaml) -> None:
    cfg = load_config(write_yaml(BASE))
    apply_overrides(cfg, ["~model.y", "~lr"])
    assert "y" not in cfg.model and "lr" not in cfg


def test_delete_missing_key_suggests(write_yaml) -> None:
    path = write_yaml(BASE)
    cfg = load_config(path)
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["~model.yy"])
    assert str(info.value) == (f"override '~model.yy': no key 'model.yy' in {path} to delete; did you mean 'model.y'?")
    with pytest.raises(ConfigError, match="override '~modle.x': no key 'modle' .*did you mean 'model.x'"):
        apply_overrides(cfg, ["~modle.x"])


@pytest.mark.parametrize("override", ["lr", "=3", "a..b=1", "+new=1", "~", "~a=1", "a b=1"])
def test_malformed_override_names_it(override: str) -> None:
    with pytest.raises(ConfigError, match="malformed") as info:
        apply_overrides(OmegaConf.create({"a": {"b": 1}, "lr": 1}), [override])
    assert f"'{override}'" in str(info.value)


def test_override_into_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="'lr' is a value, not a section"):
        apply_overrides(OmegaConf.create({"lr": 0.1}), ["lr.x=1"])


def test_override_bad_yaml_value() -> None:
    with pytest.raises(ConfigError, match=r"override 'x=\[1,2': the value is not valid YAML"):
        apply_overrides(OmegaConf.create({}), ["x=[1,2"])


def test_override_list_index_out_of_range() -> None:
    with pytest.raises(ConfigError, match="index 5 is past the end"):
        apply_overrides(OmegaConf.create({"dims": [1, 2]}), ["dims.5=1"])


def test_parse_recipe_args(write_yaml) -> None:
    path = write_yaml(BASE + "log_dir: ${output_dir}/logs\n")
    cfg = parse_recipe_args(["--config", str(path), "output_dir=/data", "model.x=7"])
    assert cfg.log_dir == "/data/logs" and cfg.model.x == 7
    assert config_source(cfg) == str(path)
    # Interpolation is resolved: the config no longer changes when the value it pointed to does.
    cfg.output_dir = "/elsewhere"
    assert cfg.log_dir == "/data/logs"
    assert parse_recipe_args([f"--config={path}"]).lr == 0.001


def test_parse_recipe_args_unresolved_interpolation_names_key(write_yaml) -> None:
    path = write_yaml(BASE + "log_dir: ${output_dirr}/logs\nname: ???\n")
    with pytest.raises(ConfigError) as info:
        parse_recipe_args(["--config", str(path)])
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: log_dir: cannot resolve interpolation")
    assert lines[1].startswith(f"{path}: name: no value given")
    assert len(lines) == 2
    # An override can supply what was missing.
    cfg = parse_recipe_args(["--config", str(path), "output_dirr=/x", "name=run"])
    assert cfg.log_dir == "/x/logs"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "missing --config"),
        (["--config"], "--config needs a value"),
        (["--config", "a.yaml", "--config", "b.yaml"], "--config given twice"),
        (["--config", "a.yaml", "--lr", "1"], "unknown option '--lr'"),
    ],
)
def test_parse_recipe_args_bad_argv(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_recipe_args(argv)


RECIPE_SOURCE = """\
def main(cfg):
    run(cfg.batch_size, cfg.model, cfg["seed"], cfg.get("compile", False))
    if "profiler" in cfg:
        profile(**cfg.profiler)
    print(cfg.get("lr").keys(), cfg.items())
"""


def test_recipe_keys_are_read_from_the_recipe_file(tmp_path) -> None:
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(RECIPE_SOURCE)
    keys = recipe_keys(recipe)
    assert keys is not None and keys.recipe == "my_recipe"
    assert keys.reads == {"batch_size", "model", "seed", "compile", "profiler", "lr"}
    # Read with get or `in` somewhere: a config may go without them.
    assert keys.required == {"batch_size", "model", "seed"}


@pytest.mark.parametrize("line", ["cfg[name]", "cfg.get(name)", "getattr(cfg, name)", "OmegaConf.select(cfg, k)"])
def test_recipe_keys_give_up_on_keys_named_at_run_time(tmp_path, line: str) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text(RECIPE_SOURCE + f"    {line}\n")
    assert recipe_keys(recipe) is None


def test_recipe_keys_follow_the_config_into_the_recipes_set_up(tmp_path) -> None:
    # The recipes hand `cfg` to their shared set-up (toolkit.recipe_setup): what it reads there is the recipe's,
    # followed into the functions it hands `cfg` on to; only the functions called count.
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from toolkit.recipe_setup import setup_run as start\n"
        "def main(cfg):\n"
        "    run = start(cfg)\n"
        "    print(cfg.get('seed'), cfg.logger.keys())\n"
    )
    keys = recipe_keys(recipe)
    assert keys.reads == {"device", "dist_timeout_s", "dtype", "output_dir", "checkpointer", "overwrite",
                          "resume_from", "seed", "logger"}
    assert keys.required == keys.reads - {"seed"}
    # A toolkit function that takes the config under another name: what it reads cannot be said.
    recipe.write_text("from toolkit.config import instantiate\ndef main(cfg):\n    instantiate(cfg)\n")
    assert recipe_keys(recipe) is None


def test_overrides_checked_against_the_recipe_keys(tmp_path) -> None:
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(RECIPE_SOURCE)
    keys = recipe_keys(recipe)
    cfg = OmegaConf.create({"batch_size": 8, "model": {"x": 1}, "seed": 0, "profiler": {"enabled": False}})
    # Keys the config has, and keys the recipe reads, may be set (new ones created); optional ones deleted.
    apply_overrides(cfg, ["batch_size=4", "model.y=2", "compile=true", "~profiler", "lr=0.1"], recipe=keys)
    assert cfg.compile is True and "profiler" not in cfg
    with pytest.raises(ConfigError, match=(
        r"^override 'batch_sze=64': no key 'batch_sze' in the config, and recipe my_recipe does not read one; "
        r"did you mean 'batch_size'\?$"
    )):
        apply_overrides(cfg, ["batch_sze=64"], recipe=keys)
    with pytest.raises(ConfigError, match="^override 'sede.x=1': no key 'sede'"):
        apply_overrides(cfg, ["sede.x=1"], recipe=keys)
    with pytest.raises(ConfigError, match="recipe my_recipe reads 'seed'; set it to null instead of deleting it$"):
        apply_overrides(cfg, ["~seed"], recipe=keys)
    apply_overrides(cfg, ["~model.x"], recipe=keys)  # below the top level, the recipe's components decide
    # Without the recipe (a config on its own), any key may be created.
    apply_overrides(cfg, ["batch_sze=64"])
    assert cfg.batch_sze == 64


def test_a_component_is_not_replaced_by_a_plain_value() -> None:
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.1}, "plain": {"a": 1}})
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["optimizer=adam"])
    assert str(info.value) == (
        "override 'optimizer=adam': 'optimizer' is a component (_component_: torch.optim.AdamW); set "
        "optimizer._component_=... to change it, its keys as optimizer.<name>=..., or optimizer=null to drop it"
    )
    # A whole new node, null, or a section without a component may still replace it.
    apply_overrides(cfg, ["optimizer={_component_: torch.optim.SGD, lr: 1}", "plain=7"])
    assert cfg.optimizer._component_ == "torch.optim.SGD" and cfg.plain == 7
    apply_overrides(cfg, ["optimizer=null"])
    assert cfg.optimizer is None
