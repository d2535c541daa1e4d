"""Building objects from ``_component_`` nodes."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import types
import typing
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from toolkit.config._errors import ConfigError, did_you_mean, first_line
from toolkit.config._schema import Spec
from toolkit.config._tree import UNKNOWN_SOURCE, child_path, config_source, node_path
from toolkit.errors import ArgumentError, UserError

COMPONENT_KEY = "_component_"

_DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


class TargetNotFound(Exception):
    """Internal: ``locate`` could not find a target; the message is the problem, without a key path."""


def _public_names(obj: Any) -> list[str]:
    names = [name for name in dir(obj) if not name.startswith("_")]
    # Submodules not imported yet are not attributes, but are what a typo in a dotted path usually misses.
    if inspect.ismodule(obj) and hasattr(obj, "__path__"):
        names += [info.name for info in pkgutil.iter_modules(obj.__path__) if not info.name.startswith("_")]
    return names


def locate(dotted: Any) -> Any:
    """Import the object a dotted path names, ``package.module.attr`` (any depth of modules and attributes).

    Raises:
        TargetNotFound: With a one-line reason and a did-you-mean among the public names where one helps.
    """
    if not isinstance(dotted, str) or not _DOTTED_RE.match(dotted):
        raise TargetNotFound(f"_component_ must be a dotted path like 'package.module.name', got {dotted!r}")
    parts = dotted.split(".")
    module = None
    imported = 0
    # Try the longest importable module prefix; the rest are attributes.
    for imported in range(len(parts), 0, -1):
        name = ".".join(parts[:imported])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            # The module exists but one of its own imports does not.
            raise TargetNotFound(f"cannot import '{dotted}': {first_line(e)}") from None
        except ImportError as e:
            raise TargetNotFound(f"cannot import '{dotted}': {first_line(e)}") from None
        break
    if module is None:
        raise TargetNotFound(f"cannot import '{dotted}': no module named '{parts[0]}'")
    obj: Any = module
    for depth in range(imported, len(parts)):
        try:
            obj = getattr(obj, parts[depth])
        except AttributeError:
            owner = ".".join(parts[:depth])
            hint = did_you_mean(parts[depth], _public_names(obj))
            raise TargetNotFound(f"cannot import '{dotted}': '{owner}' has no '{parts[depth]}'{hint}") from None
    return obj


def signature(target: Callable[..., Any]) -> inspect.Signature | None:
    """The call signature of ``target``, or None for callables that have none (some builtins)."""
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def keyword_names(sig: inspect.Signature) -> tuple[set[str], bool]:
    """Parameter names a config may set by keyword, and whether the callable takes ``**kwargs``."""
    names = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, takes_kwargs


def annotations(target: Callable[..., Any]) -> dict[str, Any]:
    """The evaluated parameter annotations of ``target``; ``{}`` when they cannot be evaluated."""
    try:
        sig = inspect.signature(target, eval_str=True)
    except Exception:  # a forward reference to a name only imported for type checkers, or no signature at all
        return {}
    return {name: p.annotation for name, p in sig.parameters.items() if p.annotation is not p.empty}


def _fits(annotation: Any, value: Any) -> bool | None:
    """Whether a scalar config value fits an annotation; None where the annotation says nothing checkable."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        specs = [m for m in metadata if isinstance(m, Spec)]
        if specs:
            return all(spec.problem(value) is None for spec in specs)
        return _fits(base, value)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(arg, value) for arg in typing.get_args(annotation)]
        return True if True in verdicts else (False if all(v is False for v in verdicts) else None)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and annotation is not typing.Any and value is not None:
        if isinstance(value, annotation):
            return True
        if isinstance(value, str) and issubclass(annotation, (os.PathLike, PurePath)):
            return True  # a path written as a string
        if annotation.__module__.startswith("torch") and annotation.__name__ == "Tensor":
            return False  # `lr: float | Tensor` given 'abc'
    return None


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        specs = [m for m in metadata if isinstance(m, Spec)]
        return " and ".join(spec.full_description() for spec in specs) if specs else _describe(base)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def value_problem(annotation: Any, value: Any, *, default: Any = inspect.Parameter.empty) -> str | None:
    """Why a scalar config value cannot be passed to a parameter of this annotation, or None if it can (or if
    the annotation or the value is beyond a simple check: containers, classes, ``Any``).

    ``null`` always fits a parameter whose default is ``None``.
    """
    if not isinstance(value, (str, int, float, type(None))) or (value is None and default is None):
        return None  # a section, a list, or an object a nested component built
    if _fits(annotation, value) is not False:
        return None
    shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
    return f"expects {_describe(annotation)}, got {shown}"


def _where(source: str, path: str) -> str:
    return path if source == UNKNOWN_SOURCE else f"{source}: {path}"


def _build(value: Any, path: str, source: str) -> Any:
    """Turn a config value into plain Python, instantiating any ``_component_`` node inside it."""
    if isinstance(value, (DictConfig, dict)):
        if COMPONENT_KEY in value:
            return _instantiate_node(value, path, source, (), {})
        return {key: _build(_get(value, key, path, source), child_path(path, key), source) for key in value}
    if isinstance(value, (ListConfig, list)):
        return [_build(_get(value, i, path, source), child_path(path, i), source) for i in range(len(value))]
    return value


def _get(container: Any, key: Any, path: str, source: str) -> Any:
    try:
        return container[key]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{_where(source, child_path(path, key))}: {first_line(e)}") from None


def _instantiate_node(
    node: DictConfig | dict[str, Any], path: str, source: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    where = _where(source, path or "<node>")
    if COMPONENT_KEY not in node:
        raise ConfigError(f"{where}: no '{COMPONENT_KEY}' to instantiate")
    dotted = _get(node, COMPONENT_KEY, path, source)
    try:
        target = locate(dotted)
    except TargetNotFound as e:
        raise ConfigError(f"{where}: {e}") from None
    if not callable(target):
        raise ConfigError(f"{where}: '{dotted}' is not callable")
    config_kwargs: dict[str, Any] = {
        str(key): _build(_get(node, key, path, source), child_path(path, key), source)
        for key in node
        if key != COMPONENT_KEY
    }
    call_kwargs = {**config_kwargs, **kwargs}
    sig = signature(target)
    if sig is not None:
        hints = annotations(target)
        for key, value in config_kwargs.items():
            param = sig.parameters.get(key)
            if key in kwargs or key not in hints or param is None:
                continue
            problem = value_problem(hints[key], value, default=param.default)
            if problem is not None:
                raise ConfigError(f"{_where(source, child_path(path, key))}: {problem} (an argument of {dotted})")
        # Bind before calling, so that only a mismatch between the config and the signature becomes a
        # ConfigError; a TypeError raised inside the callable is a bug and keeps its traceback.
        try:
            sig.bind(*args, **call_kwargs)
        except TypeError as e:
            names, takes_kwargs = keyword_names(sig)
            for key in config_kwargs:
                if key not in kwargs and key not in names and not takes_kwargs:
                    raise ConfigError(
                        f"{_where(source, child_path(path, key))}: not an argument of {dotted}"
                        f"{did_you_mean(str(key), names)}"
                    ) from None
            try:
                sig.bind_partial(*args, **kwargs)
            except TypeError:
                raise  # the recipe's own arguments do not fit: a bug, keep the traceback
            raise ConfigError(f"{where}: cannot call {dotted}: {e}") from None
    try:
        return target(*args, **call_kwargs)
    except ArgumentError as e:  # the object names its argument; the line names the key it came from
        if not path:
            raise
        raise UserError(f"{child_path(path, e.argument)}: {e.problem}") from None


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a ``_component_`` node describes.

    The node's other keys become keyword arguments; nested nodes with ``_component_`` (also inside dicts
    and lists) are instantiated first, other dicts and lists are passed as plain ``dict``/``list``.

    Args:
        node: A config node with ``_component_: dotted.path.to.callable``, or None.
        *args: Positional arguments for the callable (things only the recipe has, e.g. ``model.parameters()``).
        **kwargs: Keyword arguments, overriding the node's values.

    Returns:
        The callable's result, or None when ``node`` is None.

    Raises:
        ConfigError: The target does not import, or the node's keys do not fit its signature; the message
            names the config file and key path (e.g. ``model.lora_rank``).
    """
    if node is None:
        return None
    if not isinstance(node, (DictConfig, dict)):
        raise ConfigError(f"cannot instantiate a {type(node).__name__}: expected a node with '{COMPONENT_KEY}'")
    return _instantiate_node(node, node_path(node), config_source(node), args, kwargs)
