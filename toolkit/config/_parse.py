"""Loading YAML configs, applying command-line overrides and resolving interpolation."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config._errors import ConfigError, did_you_mean, first_line
from toolkit.config._recipe_keys import RecipeKeys, recipe_keys
from toolkit.config._schema import Schema, moved_problem
from toolkit.config._validate import validate
from toolkit.config._tree import (
    UNKNOWN_SOURCE,
    child_path,
    config_source,
    container_keys,
    interpolation_problems,
    set_source,
)

USAGE = "--config PATH [key=value ...] [~key ...]"

# A dotted key: first segment a name, later ones names or list indices (`layers.0.dim`).
_KEY_RE = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+)*$")


class _ValueLoader(yaml.SafeLoader):
    """Parses override values as YAML, the way OmegaConf parses the config file itself."""


# YAML 1.1 only reads floats with a dot, so `lr=1e-4` would stay a string; OmegaConf's loader accepts them
# in files, so overrides must too.
_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:\d[\d_]*)?\.\d[\d_]*(?:[eE][-+]?\d+)?
            |[-+]?\d[\d_]*\.(?:[eE][-+]?\d+)?
            |[-+]?\d[\d_]*[eE][-+]?\d+
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_problem(error: yaml.YAMLError) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    return " ".join(str(error).split())


def load_config(path: str | Path) -> DictConfig:
    """Load a YAML config file.

    Args:
        path: The ``.yaml`` file.

    Returns:
        The config, remembering ``path`` for later error messages (see :func:`config_source`).

    Raises:
        ConfigError: The file is missing, unreadable, not YAML, or not a mapping at the top level.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    if not path.is_file():
        raise ConfigError(f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {first_line(e)}") from None
    try:
        # Look at the structure first: OmegaConf turns a bare scalar document into a one-key mapping.
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise ConfigError(f"{path}: a config must be a mapping of keys to values, found {kind}")
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {first_line(e)}") from None
    assert isinstance(cfg, DictConfig)  # guaranteed by the mapping check above
    set_source(cfg, str(path))
    return cfg


def _parse_value(text: str, override: str) -> Any:
    if text == "":
        # `key=` means an empty string; `key=null` is how to write None.
        return ""
    # Lists, dicts and quoted strings are YAML; anything else is a YAML scalar (number, bool, null) or the
    # text exactly as typed: plain YAML would turn `prompt=reverse: hello` into a mapping and cut
    # `prompt=what is #1` at the comment.
    written_as_yaml = text.lstrip()[:1] in ("[", "{", "'", '"')
    try:
        value = yaml.load(text, Loader=_ValueLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        if not written_as_yaml:
            return text
        raise ConfigError(
            f"override '{override}': the value is not valid YAML ({_yaml_problem(e)}); "
            "quote it to pass a string, e.g. key='\"...\"'"
        ) from None
    if written_as_yaml or value is None or isinstance(value, (bool, int, float)):
        return value
    return text


def _all_key_paths(node: DictConfig | ListConfig, path: str = "") -> list[str]:
    paths = []
    for key in container_keys(node):
        sub = child_path(path, key)
        paths.append(sub.replace("[", ".").replace("]", ""))  # the dotted form overrides use
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_missing() and not child._is_none():
            paths.extend(_all_key_paths(child, sub))
    return paths


def _walk_to_parent(cfg: DictConfig, key: str, override: str, *, create: bool) -> tuple[Any, str]:
    """The container holding the last segment of ``key``, creating missing sections if ``create``."""
    segments = key.split(".")
    node: Any = cfg
    for depth, segment in enumerate(segments[:-1]):
        done = ".".join(segments[: depth + 1])
        child = _get_child(node, segment, override)
        if child is None:
            if not create:
                raise ConfigError(
                    f"override '{override}': no key '{done}' in the config{did_you_mean(key, _all_key_paths(cfg))}"
                )
            node[segment] = {}
            child = node._get_node(segment)
        if not isinstance(child, (DictConfig, ListConfig)) or child._is_none() or child._is_interpolation():
            # Replacing a value by a section silently is how typos go unnoticed; make the user say it.
            raise ConfigError(f"override '{override}': '{done}' is a value, not a section")
        node = child
    return node, segments[-1]


def _get_child(node: DictConfig | ListConfig, segment: str, override: str) -> Any:
    if isinstance(node, ListConfig):
        index = _list_index(node, segment, override)
        return node._get_node(index)
    return node._get_node(segment)  # None when absent; `in` would also say False for '???' values


def _list_index(node: ListConfig, segment: str, override: str) -> int:
    if not segment.isdigit():
        raise ConfigError(f"override '{override}': '{segment}' is not an index into a list")
    index = int(segment)
    if index >= len(node):
        raise ConfigError(f"override '{override}': index {index} is past the end of a list of {len(node)}")
    return index


def _check_top_level(
    cfg: DictConfig, key: str, override: str, known: RecipeKeys, *, deleting: bool, moved: Mapping[str, str]
) -> None:
    """Refuse an override of a top-level key that would have no effect (a typo, or a key the recipe reads elsewhere
    now: ``moved``) or break the recipe later."""
    top = key.split(".", 1)[0]
    if deleting:
        if top == key and top in known.required and cfg._get_node(top) is not None:
            raise ConfigError(
                f"override '{override}': recipe {known.recipe} reads '{top}'; set it to null instead of deleting it"
            )
        return
    if cfg._get_node(top) is not None or top in known.reads:
        return
    if top in moved:
        raise ConfigError(f"override '{override}': {top}: {moved_problem(top, moved)}")
    hint = did_you_mean(top, sorted(set(map(str, cfg.keys())) | known.reads))
    raise ConfigError(
        f"override '{override}': no key '{top}' in the config, and recipe {known.recipe} does not read one{hint}"
    )


def _check_not_replacing_a_component(parent: Any, last: str, key: str, value: Any, override: str) -> None:
    # `optimizer=adam` would turn a component into a string the recipe then fails to instantiate, far from here.
    if isinstance(parent, ListConfig) or value is None or isinstance(value, (dict, list)):
        return
    existing = parent._get_node(last)
    if isinstance(existing, DictConfig) and not existing._is_none() and existing._get_node("_component_") is not None:
        raise ConfigError(
            f"override '{override}': '{key}' is a component (_component_: {existing._get_node('_component_')}); "
            f"set {key}._component_=... to change it, its keys as {key}.<name>=..., or {key}=null to drop it"
        )


def apply_overrides(
    cfg: DictConfig,
    overrides: Sequence[str],
    *,
    source: str | None = None,
    recipe: RecipeKeys | None = None,
    moved: Mapping[str, str] | None = None,
) -> DictConfig:
    """Apply command-line overrides to a config, in order.

    ``a.b.c=value`` sets a key (creating missing sections). Everything after the first ``=`` is the value:
    a number, ``true``/``false``, ``null``, a flow list or dict (``[1, 2]``, ``{a: 1}``) or a quoted string as
    in YAML, otherwise the text as typed (``prompt=reverse: hello`` is a string). ``~a.b`` deletes a key.

    Args:
        cfg: The config to change in place.
        overrides: The ``key=value`` / ``~key`` strings.
        source: The config file, named in errors; defaults to the file ``cfg`` was loaded from.
        recipe: What the recipe reads (see :func:`recipe_keys`); if given, an override may create a top-level
            key only if the recipe reads it, and may not delete one the recipe cannot do without.
        moved: the recipe schema's moved keys (:class:`Schema`): a new top-level key among them is told where the
            recipe reads it now.

    Returns:
        ``cfg``, for chaining.

    Raises:
        ConfigError: A malformed override, a value that is not YAML, a deletion of a key that does not exist, or
            (with ``recipe``) a new top-level key the recipe never reads or the deletion of one it needs.
    """
    source = source or config_source(cfg)
    for override in overrides:
        if override.startswith("~"):
            key = override[1:]
            if not _KEY_RE.match(key):
                raise ConfigError(f"override '{override}' is malformed: expected ~key.path to delete a key")
            if recipe is not None:
                _check_top_level(cfg, key, override, recipe, deleting=True, moved=moved or {})
            parent, last = _walk_to_parent(cfg, key, override, create=False)
            if isinstance(parent, ListConfig):
                del parent[_list_index(parent, last, override)]
            elif parent._get_node(last) is not None:
                del parent[last]
            else:
                hint = did_you_mean(key, _all_key_paths(cfg))
                where = "" if source == UNKNOWN_SOURCE else f" in {source}"
                raise ConfigError(f"override '{override}': no key '{key}'{where} to delete{hint}")
            continue
        key, sep, text = override.partition("=")
        if not sep or not _KEY_RE.match(key):
            hint = "; keys are created without a '+'" if override.startswith("+") else ""
            raise ConfigError(f"override '{override}' is malformed: expected key.path=value or ~key.path{hint}")
        if recipe is not None:
            _check_top_level(cfg, key, override, recipe, deleting=False, moved=moved or {})
        value = _parse_value(text, override)
        parent, last = _walk_to_parent(cfg, key, override, create=True)
        _check_not_replacing_a_component(parent, last, key, value, override)
        try:
            if isinstance(parent, ListConfig):
                parent[_list_index(parent, last, override)] = value
            else:
                parent[last] = value
        except OmegaConfBaseException as e:
            raise ConfigError(f"override '{override}': {first_line(e)}") from None
    return cfg


def resolve(cfg: DictConfig, *, source: str | None = None) -> DictConfig:
    """Replace every ``${...}`` in ``cfg`` by its value, in place.

    Raises:
        ConfigError: One line per unresolvable interpolation or ``???`` value, naming the file and key.
    """
    source = source or config_source(cfg)
    problems = interpolation_problems(cfg)
    if problems:
        raise ConfigError("\n".join(f"{source}: {path}: {problem}" for path, problem in problems))
    OmegaConf.resolve(cfg)
    return cfg


def split_config_arg(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Split ``--config PATH`` (or ``--config=PATH``) from the overrides in a recipe's arguments.

    Raises:
        ConfigError: No ``--config``, two of them, or an option other than ``--config``.
    """
    config: str | None = None
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        value: str | None = None
        if arg == "--config":
            if i + 1 >= len(args):
                raise ConfigError(f"--config needs a value; usage: {USAGE}")
            value = args[i + 1]
            i += 1
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option '{arg}'; usage: {USAGE}")
        else:
            overrides.append(arg)
        if value is not None:
            if config is not None:
                raise ConfigError(f"--config given twice ('{config}' and '{value}')")
            if not value:
                raise ConfigError(f"--config needs a value; usage: {USAGE}")
            config = value
        i += 1
    if config is None:
        raise ConfigError(f"missing --config; usage: {USAGE}")
    return config, overrides


def parse_recipe_args(
    argv: Sequence[str] | None = None,
    *,
    recipe_file: str | Path | None = None,
    schema: Schema | None = None,
    world_size: int | None = None,
) -> DictConfig:
    """Build a recipe's config from its command line.

    Args:
        argv: ``["--config", PATH, "key=value", "~key", ...]``; defaults to ``sys.argv[1:]``.
        recipe_file: the recipe's source file; if given, overrides are checked against the top-level keys it
            reads (see :func:`apply_overrides`).
        schema: the recipe's declared schema; if given, the config is checked against it (every problem, one line
            each) before interpolation is resolved, so keys that only feed a ``${...}`` are known as such.
        world_size: the processes of the launch, for the schema's rules (batch divisibility).

    Returns:
        The loaded config with overrides applied and interpolation resolved. :func:`config_source` gives
        its file.

    Raises:
        ConfigError: Bad arguments, file, override or interpolation.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(f"usage: {Path(sys.argv[0]).name} {USAGE}")
        raise SystemExit(0)
    config, overrides = split_config_arg(args)
    cfg = load_config(config)
    recipe = recipe_keys(recipe_file) if recipe_file is not None else None
    apply_overrides(cfg, overrides, source=config, recipe=recipe, moved=schema.moved if schema is not None else None)
    if schema is not None:
        validate(cfg, source=config, schema=schema, world_size=world_size)
    return resolve(cfg, source=config)
