"""Walking OmegaConf trees with the dotted key paths that error messages show."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from toolkit.config._errors import first_line

# The root node remembers the file it was loaded from, so later errors can name it. DictConfig routes
# attribute assignment to config keys, hence the write through __dict__.
_SOURCE_ATTR = "_tunekit_source"
UNKNOWN_SOURCE = "<config>"


def child_path(path: str, key: Any) -> str:
    """The key path of ``key`` under ``path``: ``model.lora_rank`` or ``model.layers[0]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def node_path(node: Any) -> str:
    """The key path of an OmegaConf node inside its root config (``""`` for the root or a plain object)."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return ""
    parts: list[Any] = []
    # Walk up by hand: OmegaConf's own full-key helper misformats nodes inside lists.
    while node._get_parent() is not None:
        parts.append(node._key())
        node = node._get_parent()
    path = ""
    for key in reversed(parts):
        path = child_path(path, key)
    return path


def container_keys(node: DictConfig | ListConfig) -> Iterator[Any]:
    """Keys of a DictConfig or indices of a ListConfig."""
    return iter(node.keys()) if isinstance(node, DictConfig) else iter(range(len(node)))


def set_source(cfg: DictConfig, source: str) -> None:
    """Remember where ``cfg`` came from."""
    cfg.__dict__[_SOURCE_ATTR] = source


def config_source(cfg: Any) -> str:
    """The file a config (or any node inside it) was loaded from.

    Args:
        cfg: A config returned by :func:`load_config` or :func:`parse_recipe_args`, or any node inside it.

    Returns:
        The path as given when loading, or ``"<config>"`` when it was not loaded from a file.
    """
    if not isinstance(cfg, (DictConfig, ListConfig)):
        return UNKNOWN_SOURCE
    return cfg._get_root().__dict__.get(_SOURCE_ATTR, UNKNOWN_SOURCE)


def interpolation_problems(node: DictConfig | ListConfig, path: str = "") -> list[tuple[str, str]]:
    """``(key path, problem)`` for every value that is ``???`` or whose ``${...}`` does not resolve."""
    problems: list[tuple[str, str]] = []
    for key in container_keys(node):
        sub = child_path(path, key)
        try:
            value = node[key]
        except MissingMandatoryValue:
            problems.append((sub, f"no value given (it is '???'); set it with {sub}=..."))
            continue
        except OmegaConfBaseException as e:
            problems.append((sub, f"cannot resolve interpolation: {first_line(e)}"))
            continue
        # An interpolation to a section is checked where that section lives, not once per reference.
        if isinstance(value, (DictConfig, ListConfig)) and not OmegaConf.is_interpolation(node, key):
            problems.extend(interpolation_problems(value, sub))
    return problems
