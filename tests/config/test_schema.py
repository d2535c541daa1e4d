"""The declared config schema: every value a recipe reads is checked for type, range and choice, and the rules
between keys hold, before anything runs; each problem is one line naming the file and key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from toolkit.config import (
    Bool,
    Choice,
    Component,
    ConfigError,
    Float,
    Int,
    ListOf,
    Schema,
    Str,
    one_of,
    rule,
    validate,
)
from toolkit.config._tree import set_source


def _cfg(data: dict, source: str = "run.yaml"):
    cfg = OmegaConf.create(data)
    set_source(cfg, source)
    return cfg


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (Bool(), [True, False], ["flase", "true", 1, 0, None]),
        (Int(ge=1), [1, 10**12], [0, -1, 1.5, True, "3", None]),
        (Int(ge=0, null=True), [0, None], [-1, "abc"]),
        (Float(gt=0), [1e-4, 3, 2.5], [0, -1.0, float("inf"), float("nan"), "abc", False]),
        (Float(ge=0, lt=1), [0, 0.5], [1, 1.5, -0.1]),
        (Str(), ["a"], ["", "  ", 3, None]),
        (Choice("fp32", "bf16"), ["fp32"], ["fp33", "FP32", 32]),
        (ListOf(item=Float(ge=0, lt=1), length=2), [[0.9, 0.95]], [[0.9], [0.9, 1.5], "0.9", 0.9]),
        (one_of(Int(ge=1), Choice("auto")), [4, "auto"], [0, "Auto", None]),
        (Component(), [{"_component_": "a.b"}], [{"lr": 1}, "a.b", None]),
    ],
)
def test_a_spec_accepts_its_values_and_names_what_it_expects(spec, good, bad):
    for value in good:
        assert spec.problem(value) is None, value
    for value in bad:
        problem = spec.problem(value)
        assert problem is not None and problem.startswith(f"expects {spec.full_description()}, got "), value


def test_a_choice_suggests_the_nearest():
    assert Choice("bf16-mixed", "fp16-mixed").problem("bf16-mix").endswith("did you mean 'bf16-mixed'?")


SCHEMA = Schema(
    {
        "epochs": Int(ge=1),
        "max_steps": Int(ge=1, null=True),
        "overwrite": Bool(),
        "name": Str(required=False),
        "optimizer": Component(),
        "optimizer.lr": Float(gt=0),
    }
)
GOOD = {"epochs": 1, "max_steps": None, "overwrite": False, "optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1}}


def test_every_problem_is_one_line_naming_the_file_and_key():
    cfg = _cfg({**GOOD, "epochs": 0, "overwrite": "flase", "optimizer": {"_component_": "x.y", "lr": -1}})
    with pytest.raises(ConfigError) as info:
        SCHEMA.check(cfg)
    lines = str(info.value).splitlines()
    assert lines == [
        "run.yaml: epochs: expects an integer >= 1, got 0",
        "run.yaml: overwrite: expects true or false, got 'flase'",
        "run.yaml: optimizer.lr: expects a number > 0, got -1",
    ]


def test_missing_required_keys_are_named_and_optional_ones_are_not():
    cfg = _cfg({"epochs": 1, "optimizer": {"_component_": "x.y"}})
    problems = dict(SCHEMA.problems(cfg))
    assert set(problems) == {"max_steps", "overwrite"}
    assert problems["overwrite"].startswith("missing: the recipe reads it")


def test_an_unknown_top_level_key_is_a_typo_unless_an_interpolation_uses_it():
    cfg = _cfg({**GOOD, "epoch": 3, "base": "/models/x", "optimizer": {"_component_": "a.b", "dir": "${base}"}})
    assert SCHEMA.problems(cfg) == [("epoch", "not a key this recipe reads; did you mean 'epochs'?")]
    assert SCHEMA.problems(cfg, unknown_keys=False) == []


def test_a_misspelled_required_key_is_one_line_the_typo_not_also_the_missing_key():
    # `epoch: 3` instead of `epochs: 3`: one mistake, one line (not also "epochs: missing"), and a rule that reads
    # the missing key does not run on its absence.
    cfg = _cfg({key: value for key, value in GOOD.items() if key != "epochs"} | {"epoch": 3, "max_steps": 100})
    schema = SCHEMA.extend(rules=[_steps_within_epochs])
    assert schema.problems(cfg, world_size=2) == [("epoch", "not a key this recipe reads; did you mean 'epochs'?")]
    with pytest.raises(ConfigError) as info:
        validate(cfg, schema=schema, world_size=2)
    assert str(info.value) == "run.yaml: epoch: not a key this recipe reads; did you mean 'epochs'?"


def test_a_moved_key_names_the_key_the_recipe_reads_instead_unless_an_interpolation_uses_it():
    schema = Schema({**SCHEMA.keys, "checkpointer": Component()},
                    moved={"checkpoint_dir": "checkpointer.checkpoint_dir"})
    node = {"_component_": "a.b", "checkpoint_dir": "/models/x"}
    cfg = _cfg({**GOOD, "checkpointer": node, "checkpoint_dir": "/models/y"})
    moved = "moved: this recipe reads it as checkpointer.checkpoint_dir now; set checkpointer.checkpoint_dir instead"
    expected = [("checkpoint_dir", moved)]
    assert schema.problems(cfg) == expected
    assert schema.without("name").extend({"name": Str(required=False)}).problems(cfg) == expected  # kept by both
    # A config written before the move, whose checkpointer reads the old key through `${...}`: still good.
    assert schema.problems(_cfg({**GOOD, "checkpointer": {**node, "checkpoint_dir": "${checkpoint_dir}"},
                                 "checkpoint_dir": "/models/y"})) == []


def test_a_value_from_an_interpolation_is_checked_as_resolved():
    cfg = _cfg({**GOOD, "steps": -5, "max_steps": "${steps}"})
    assert SCHEMA.problems(cfg) == [("max_steps", "expects an integer >= 1 or null, got -5")]


@rule("epochs", "max_steps")
def _steps_within_epochs(ctx):
    if ctx.get("max_steps") is not None and ctx.world_size is not None:
        if ctx.get("max_steps") > 10 * ctx.get("epochs") * ctx.world_size:
            yield "max_steps", "more steps than the epochs have"


def test_a_rule_sees_the_launch_and_is_skipped_when_its_keys_are_wrong():
    schema = SCHEMA.extend(rules=[_steps_within_epochs])
    assert schema.problems(_cfg({**GOOD, "max_steps": 100}), world_size=2) == [
        ("max_steps", "more steps than the epochs have")
    ]
    assert schema.problems(_cfg({**GOOD, "max_steps": 100})) == []  # the launch is unknown: nothing to say
    # epochs is already wrong: the rule would only repeat it.
    assert [k for k, _ in schema.problems(_cfg({**GOOD, "epochs": 0, "max_steps": 100}), world_size=2)] == [
        "epochs"
    ]


def test_validate_reports_component_and_schema_problems_together_once():
    cfg = _cfg({**GOOD, "epochs": -1, "optimizer": {"_component_": "torch.optim.SGD", "lr": "abc"}})
    with pytest.raises(ConfigError) as info:
        validate(cfg, schema=SCHEMA)
    lines = str(info.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "run.yaml: epochs: expects an integer >= 1, got -1"
    assert lines[1] == "run.yaml: optimizer.lr: expects a number > 0, got 'abc'"


def test_a_wrong_value_feeding_an_interpolation_is_reported_once_where_it_was_written():
    cfg = _cfg({**GOOD, "epochs": "${n}", "n": "abc", "optimizer": {"_component_": "torch.optim.SGD", "lr": "${n}"}})
    schema = SCHEMA.extend({"n": Float(gt=0)})
    with pytest.raises(ConfigError) as info:
        validate(cfg, schema=schema)
    assert str(info.value).splitlines() == ["run.yaml: n: expects a number > 0, got 'abc'"]
