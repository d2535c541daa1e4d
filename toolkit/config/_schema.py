"""Declared schemas: the config keys a recipe reads, their types, ranges and choices, and how they depend on
each other, checked whole before anything runs.

A recipe declares its schema once, near the top of its file::

    SCHEMA = Schema({"epochs": Int(ge=1), "max_steps": Int(ge=1, null=True), ...}, rules=[...])

    @recipe_main(schema=SCHEMA)
    def main(cfg): ...

``tune validate``, ``tune plan`` and ``tune run`` (before launching a process) check a config against it, and so
does the recipe itself, so a value nobody thought to check by hand never reaches a constructor or the loop. Each
problem is one line naming the file and key. Keys with dots (``optimizer.lr``) constrain an argument of a
component when the config gives it; the component's own signature types are checked by :func:`validate`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config._errors import ConfigError, closest, did_you_mean
from toolkit.config._tree import UNKNOWN_SOURCE, config_source

_MISSING = object()


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (DictConfig, dict)):
        return "a section"
    if isinstance(value, (ListConfig, list, tuple)):
        items = list(value)
        return repr(items) if len(repr(items)) <= 60 else f"a list of {len(items)} items"
    return repr(value)


@dataclass(frozen=True)
class Spec:
    """What one config value may be. Subclasses say which values; ``null`` allows ``None`` besides.

    Attributes:
        null: ``None`` is allowed.
        required: a config without the key is refused (the recipe reads it as ``cfg.<key>``).
    """

    null: bool = False
    required: bool = True

    def describe(self) -> str:
        """What the value must be, as the end of ``expects ...``."""
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        """Whether a non-null value fits."""
        raise NotImplementedError

    def problem(self, value: Any) -> str | None:
        """Why ``value`` does not fit, or None."""
        if value is None:
            return None if self.null else f"expects {self.full_description()}, got null"
        if self.accepts(value):
            return None
        return f"expects {self.full_description()}, got {_shown(value)}"

    def full_description(self) -> str:
        return self.describe() + (" or null" if self.null else "")


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = []
    if gt is not None:
        parts.append(f"> {gt}")
    if ge is not None:
        parts.append(f">= {ge}")
    if lt is not None:
        parts.append(f"< {lt}")
    if le is not None:
        parts.append(f"<= {le}")
    return " and ".join(parts)


def _in_bounds(x: float, ge: float | None, gt: float | None, le: float | None, lt: float | None) -> bool:
    return not (
        (ge is not None and x < ge) or (gt is not None and x <= gt) or (le is not None and x > le)
        or (lt is not None and x >= lt)
    )


@dataclass(frozen=True)
class Bool(Spec):
    """``true`` or ``false``; never a string (``overwrite=flase`` is a typo, not a truthy value)."""

    def describe(self) -> str:
        return "true or false"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class _Number(Spec):
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    _what = "a number"

    def describe(self) -> str:
        bounds = _bounds(self.ge, self.gt, self.le, self.lt)
        return self._what + (f" {bounds}" if bounds else "")

    def accepts(self, value: Any) -> bool:
        return (
            self._kind_fits(value) and (isinstance(value, int) or math.isfinite(value))
            and _in_bounds(value, self.ge, self.gt, self.le, self.lt)
        )

    def _kind_fits(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Int(_Number):
    """An integer (not a boolean) within the bounds given."""

    _what = "an integer"

    def _kind_fits(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Float(_Number):
    """A finite number (an integer is fine) within the bounds given."""


@dataclass(frozen=True)
class Str(Spec):
    """A string; with ``choices``, one of them; never empty unless ``empty``."""

    choices: tuple[str, ...] = ()
    empty: bool = False

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return "a string" if self.empty else "a non-empty string"

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, str):
            return False
        if self.choices:
            return value in self.choices
        return self.empty or bool(value.strip())

    def problem(self, value: Any) -> str | None:
        found = super().problem(value)
        if found is not None and self.choices and isinstance(value, str):
            found += did_you_mean(value, self.choices)
        return found


def Choice(*choices: str, null: bool = False, required: bool = True) -> Str:  # noqa: N802 (reads as a type)
    """One of the strings ``choices``."""
    return Str(choices=tuple(choices), null=null, required=required)


@dataclass(frozen=True)
class Component(Spec):
    """A section with ``_component_: dotted.path`` (its arguments are checked against the callable's signature)."""

    def describe(self) -> str:
        return "a section with _component_"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (DictConfig, dict)) and "_component_" in value


@dataclass(frozen=True)
class Section(Spec):
    """A mapping of keys to values (checked further by whoever reads it)."""

    def describe(self) -> str:
        return "a section (key: value mapping)"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (DictConfig, dict))


@dataclass(frozen=True)
class ListOf(Spec):
    """A list, each item fitting ``item`` (any item when None), of exactly ``length`` items when given."""

    item: Spec | None = None
    length: int | None = None

    def describe(self) -> str:
        count = f"{self.length} " if self.length is not None else ""
        what = f" of {self.item.full_description()}" if self.item is not None else ""
        return f"a list of {count}items{what}" if count else f"a list{what}"

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, (ListConfig, list, tuple)):
            return False
        if self.length is not None and len(value) != self.length:
            return False
        return self.item is None or all(self.item.problem(v) is None for v in value)


@dataclass(frozen=True)
class AnyOf(Spec):
    """Any value one of ``specs`` accepts (``Int(ge=1) | auto``)."""

    specs: tuple[Spec, ...] = ()

    def describe(self) -> str:
        return " or ".join(spec.describe() for spec in self.specs)

    def accepts(self, value: Any) -> bool:
        return any(spec.accepts(value) for spec in self.specs)


def one_of(*specs: Spec, null: bool = False, required: bool = True) -> AnyOf:
    """A value that fits any of ``specs``: ``one_of(Int(ge=1), Choice("auto"))``."""
    return AnyOf(specs=tuple(specs), null=null, required=required)


@dataclass(frozen=True)
class Anything(Spec):
    """Any value; the key is declared so that it is known, and checked by whoever reads it."""

    null: bool = True

    def describe(self) -> str:
        return "any value"

    def accepts(self, value: Any) -> bool:
        return True


@dataclass(frozen=True)
class Context:
    """What a rule may look at: the config's values and what is known of the launch.

    Attributes:
        values: the value of every declared key that is present and passed its own check (dotted keys too).
        world_size: the number of processes the launch starts (all nodes), or None when not known
            (``tune validate`` without ``--nproc_per_node``).
    """

    values: Mapping[str, Any]
    world_size: int | None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


# A rule looks at several keys together and returns ``(key, problem)`` pairs.
Rule = Callable[[Context], Iterable[tuple[str, str]]]


@dataclass(frozen=True)
class Schema:
    """The keys a recipe reads and the rules between them.

    Args:
        keys: ``{key: Spec}``; a dotted key (``optimizer.lr``) constrains a value inside a section when present.
        rules: checks across keys (batch divisibility); each runs only when the keys it reads passed their own
            checks, so one mistake is reported once.
        moved: ``{old top-level key: the key the recipe reads instead}``: a config or override that still sets the
            old key is told the new one (unless a ``${...}`` uses it, as any other top-level value).
    """

    keys: Mapping[str, Spec]
    rules: Sequence[Rule] = field(default_factory=tuple)
    moved: Mapping[str, str] = field(default_factory=dict)

    def extend(self, keys: Mapping[str, Spec] | None = None, rules: Sequence[Rule] = ()) -> Schema:
        """This schema with more (or replaced) keys and more rules."""
        return Schema({**self.keys, **(keys or {})}, (*self.rules, *rules), self.moved)

    def without(self, *names: str) -> Schema:
        """This schema without the keys ``names`` (for a recipe that does not read them)."""
        return Schema({k: v for k, v in self.keys.items() if k not in names}, self.rules, self.moved)

    def problems(
        self,
        cfg: DictConfig,
        *,
        world_size: int | None = None,
        unknown_keys: bool = True,
        known_problems: Iterable[str] = (),
    ) -> list[tuple[str, str]]:
        """Every ``(key path, problem)`` of ``cfg``.

        Args:
            cfg: The config, overrides applied (interpolation resolved or not).
            world_size: Processes of the launch, when known, for the rules that need it.
            unknown_keys: Also report top-level keys that are not declared and that no ``${...}`` refers to.
            known_problems: Key paths already found wrong elsewhere (a component's arguments): the keys are not
                reported again, and the rules that read them do not run.
        """
        problems, values = self.key_problems(cfg, unknown_keys=unknown_keys, known_problems=known_problems)
        bad = [*known_problems, *(path for path, _ in problems)]
        return problems + self.rule_problems(values, world_size=world_size, known_problems=bad)

    def key_problems(
        self, cfg: DictConfig, *, unknown_keys: bool = True, known_problems: Iterable[str] = ()
    ) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        """The problems of each declared key on its own, and the values that passed (for :meth:`rule_problems`)."""
        problems: list[tuple[str, str]] = []
        values: dict[str, Any] = {}
        known = set(known_problems)
        declared = {key.split(".", 1)[0] for key in self.keys}
        referenced = interpolated_names(cfg) if unknown_keys else set()
        unknown = [str(key) for key in cfg.keys() if unknown_keys and str(key) not in declared | referenced]
        # A misspelled key is one mistake, the typo: a required key it stands for is not reported missing as well.
        misspelled = {closest(name, declared) for name in unknown if name not in self.moved}
        # Values written as `${other}` last: one that only repeats a value already found wrong is the same mistake,
        # reported once, where the user wrote it.
        interpolated = {key for key in self.keys if _interpolation(cfg, key) is not None}
        for key in sorted(self.keys, key=lambda k: k in interpolated):
            spec = self.keys[key]
            if key in known:
                continue
            if key in interpolated and referenced_names(_interpolation(cfg, key) or "") & {p for p, _ in problems}:
                continue
            value = _lookup(cfg, key)
            if value is _MISSING:
                if spec.required and "." not in key and key not in misspelled:
                    problems.append((key, f"missing: the recipe reads it ({spec.full_description()})"))
                continue
            if value is _UNRESOLVED:
                continue  # reported by the interpolation check
            problem = spec.problem(value)
            if problem is not None:
                problems.append((key, problem))
            else:
                values[key] = value
        for name in unknown:
            if name in self.moved:
                problems.append((name, moved_problem(name, self.moved)))
            else:
                problems.append((name, f"not a key this recipe reads{did_you_mean(name, sorted(declared))}"))
        return problems, values

    def rule_problems(
        self, values: Mapping[str, Any], *, world_size: int | None = None, known_problems: Iterable[str] = ()
    ) -> list[tuple[str, str]]:
        """The problems the rules find, skipping each rule that reads a key in ``known_problems`` (or under it)."""
        # A required key without a value that passed is wrong or missing (or misspelled): already reported.
        bad = {*known_problems, *(key for key, spec in self.keys.items()
                                  if spec.required and "." not in key and key not in values)}
        context = Context(values=values, world_size=world_size)
        problems: list[tuple[str, str]] = []
        for check in self.rules:
            reads = getattr(check, "reads", ())
            if any(path == key or path.startswith(f"{key}.") for path in bad for key in reads):
                continue
            problems.extend(check(context))
        return problems

    def check(
        self,
        cfg: DictConfig,
        *,
        source: str | None = None,
        world_size: int | None = None,
        unknown_keys: bool = True,
    ) -> None:
        """Raise one :class:`ConfigError` listing every problem, a line each: ``<file>: <key>: <problem>``."""
        problems = self.problems(cfg, world_size=world_size, unknown_keys=unknown_keys)
        if problems:
            source = source or config_source(cfg)
            prefix = "" if source == UNKNOWN_SOURCE else f"{source}: "
            raise ConfigError("\n".join(f"{prefix}{path}: {problem}" for path, problem in problems))


def moved_problem(key: str, moved: Mapping[str, str]) -> str:
    """What is said of a top-level ``key`` a recipe now reads as ``moved[key]`` (:attr:`Schema.moved`)."""
    return f"moved: this recipe reads it as {moved[key]} now; set {moved[key]} instead"


def rule(*reads: str) -> Callable[[Rule], Rule]:
    """Mark a rule with the keys it reads, so it is skipped when one of them already has a problem."""

    def mark(fn: Rule) -> Rule:
        fn.reads = reads  # type: ignore[attr-defined]
        return fn

    return mark


_UNRESOLVED = object()


def _lookup(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted key, ``_MISSING`` when absent, ``_UNRESOLVED`` when its ``${...}`` fails."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, (DictConfig, dict)) or part not in node:
            return _MISSING
        try:
            node = node[part]
        except OmegaConfBaseException:
            return _UNRESOLVED
    return node


def _interpolation(cfg: DictConfig, key: str) -> str | None:
    """The ``${...}`` text written at a dotted key, or None when the value there is not an interpolation."""
    parent_path, _, last = key.rpartition(".")
    parent = _lookup(cfg, parent_path) if parent_path else cfg
    if not isinstance(parent, DictConfig) or last not in parent or not OmegaConf.is_interpolation(parent, last):
        return None
    return str(parent._get_node(last)._value())


_INTERPOLATION_RE = re.compile(r"\$\{\s*([^}]*)\}")


def interpolated_names(cfg: DictConfig) -> set[str]:
    """The top-level keys some ``${...}`` in ``cfg`` refers to (``${max_seq_len}``, ``${model.dim}``)."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
    except OmegaConfBaseException:
        return set()
    names: set[str] = set()
    stack: list[Any] = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            names |= referenced_names(item)
    return names


def referenced_names(text: str) -> set[str]:
    """The top-level keys the ``${...}`` in one string refer to."""
    return {ref.strip().lstrip(".").split(".", 1)[0].split("[", 1)[0] for ref in _INTERPOLATION_RE.findall(text)}
