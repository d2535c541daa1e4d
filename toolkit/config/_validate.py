"""Checking a whole config against the signatures of its components, without building anything."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config._errors import ConfigError, did_you_mean
from toolkit.config._instantiate import (
    COMPONENT_KEY,
    TargetNotFound,
    annotations,
    keyword_names,
    locate,
    signature,
    value_problem,
)
from toolkit.config._schema import Schema, referenced_names
from toolkit.config._tree import child_path, config_source, container_keys, interpolation_problems

# Arguments recipes pass themselves when they instantiate a node (`instantiate(cfg.optimizer, model.parameters())`,
# `instantiate(cfg.lr_scheduler, optimizer, total_steps=...)`), so a config never sets them.
RUNTIME_ARGS: frozenset[str] = frozenset({"tokenizer", "params", "optimizer", "model", "total_steps"})
# Top-level keys whose `_component_` nodes are not called with their keys as arguments, and which the recipe's own
# schema rule checks instead: the RL recipe's `rewards` name functions used as they are (or classes built with
# their options) and carry a `weight` each (toolkit.rl.RewardSet.from_config, the rule toolkit.rl.keys.rewards_build).
READER_CHECKED_KEYS: frozenset[str] = frozenset({"rewards"})


def _repeats(node: DictConfig, key: Any, wrong: Collection[str]) -> bool:
    """Whether ``node[key]`` is an interpolation of a top-level key in ``wrong``."""
    if not wrong or not OmegaConf.is_interpolation(node, str(key)):
        return False
    return bool(referenced_names(str(node._get_node(key)._value())) & set(wrong))


def _component_problems(
    node: DictConfig, path: str, runtime_args: Collection[str], wrong: Collection[str]
) -> list[tuple[str, str]]:
    try:
        dotted = node[COMPONENT_KEY]
        target = locate(dotted)
    except OmegaConfBaseException:
        return []  # reported by the interpolation check
    except TargetNotFound as e:
        return [(path, str(e))]
    if not callable(target):
        return [(path, f"'{dotted}' is not callable")]
    sig = signature(target)
    if sig is None:
        return []
    names, takes_kwargs = keyword_names(sig)
    given = [key for key in node.keys() if key != COMPONENT_KEY]
    problems = [
        (child_path(path, key), f"not an argument of {dotted}{did_you_mean(str(key), names)}")
        for key in given
        if key not in names and not takes_kwargs
    ]
    hints = annotations(target)
    for key in given:
        param = sig.parameters.get(str(key))
        if param is None or param.name not in hints or param.name in runtime_args:
            continue
        if child_path(path, key) in wrong or _repeats(node, key, wrong):
            continue  # reported by the schema already
        try:
            value = node[key]
        except OmegaConfBaseException:
            continue  # reported by the interpolation check
        problem = value_problem(hints[param.name], value, default=param.default)
        if problem is not None:
            problems.append((child_path(path, key), f"{problem} (an argument of {dotted})"))
    for param in sig.parameters.values():
        required = param.default is inspect.Parameter.empty and param.name in names
        if required and param.name not in given and param.name not in runtime_args:
            problems.append((path, f"missing required argument '{param.name}' of {dotted}"))
    return problems


def _visit(
    node: DictConfig | ListConfig, path: str, runtime_args: Collection[str], wrong: Collection[str]
) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    if isinstance(node, DictConfig) and node._get_node(COMPONENT_KEY) is not None:
        problems += _component_problems(node, path, runtime_args, wrong)
    for key in container_keys(node):
        if not path and key in READER_CHECKED_KEYS:
            continue
        child = node._get_node(key)
        # Only real sections: interpolated ones are checked where they live, broken ones by the
        # interpolation check.
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            problems += _visit(child, child_path(path, key), runtime_args, wrong)
    return problems


def validate(
    cfg: DictConfig,
    *,
    source: str | None = None,
    runtime_args: Collection[str] = RUNTIME_ARGS,
    schema: Schema | None = None,
    world_size: int | None = None,
) -> None:
    """Check a config before running anything.

    For every ``_component_`` node (at any depth): the target imports, every key is a parameter of it
    (unless it takes ``**kwargs``), a number, boolean, string or null fits the parameter's annotation where that
    is a plain scalar type (``max_seq_len: int`` given ``abc``), and every required parameter is given, except
    those in ``runtime_args``. Also reports ``${...}`` that do not resolve and ``???`` values left unset.

    Args:
        cfg: The config (overrides already applied).
        source: The config file named in messages; defaults to the file ``cfg`` was loaded from.
        runtime_args: Parameter names recipes pass themselves, never missing from a config.
        schema: The recipe's declared schema: every key it reads has the type, range and choices it declares, the
            rules between keys hold, and the config has no top-level key the recipe does not read (unless a
            ``${...}`` uses it).
        world_size: The processes of the launch, when known, for the schema's rules.

    Raises:
        ConfigError: Listing every problem, one line each: ``<source>: <key path>: <problem>``.
    """
    source = source or config_source(cfg)
    problems = interpolation_problems(cfg)
    values: dict[str, Any] = {}
    if schema is not None:
        key_problems, values = schema.key_problems(cfg, known_problems=[path for path, _ in problems])
        problems += key_problems
    # A component argument that only repeats a top-level value already found wrong (`max_seq_len: ${max_seq_len}`)
    # is the same mistake: it is reported once, where the user wrote it.
    wrong = {path for path, _ in problems}
    problems += _visit(cfg, "", runtime_args, wrong)
    if schema is not None:
        problems += schema.rule_problems(
            values, world_size=world_size, known_problems=[path for path, _ in problems]
        )
    if problems:
        raise ConfigError("\n".join(f"{source}: {path or '<root>'}: {problem}" for path, problem in problems))
