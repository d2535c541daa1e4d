"""Finding recipes and configs by name, from the folders themselves (there is no list to keep in sync)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from toolkit.config import Schema, did_you_mean
from toolkit.config._errors import first_line
from toolkit.errors import UserError
from toolkit.paths import configs_dir, recipes_dir

LAUNCH_SUFFIXES = ("_single_device", "_distributed")


def list_recipes() -> list[str]:
    """Names of the recipes: every ``recipes_dir()/*.py`` not starting with ``_``."""
    folder = recipes_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_") and p.is_file())


def list_configs(recipe: str) -> list[str]:
    """Names of the configs of ``recipe``: ``configs_dir()/<recipe>/*.yaml``."""
    folder = configs_dir() / recipe
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if p.is_file())


def all_configs() -> list[str]:
    """Every config of every recipe, as ``recipe/config``."""
    return [f"{recipe}/{config}" for recipe in list_recipes() for config in list_configs(recipe)]


def split_launch_suffix(token: str) -> tuple[str, str | None]:
    """``full_finetune_distributed`` -> ``("full_finetune", "_distributed")``; no suffix -> ``(token, None)``."""
    for suffix in LAUNCH_SUFFIXES:
        if token.endswith(suffix) and len(token) > len(suffix):
            return token[: -len(suffix)], suffix
    return token, None


def recipe_path(name: str) -> Path:
    """The file of a recipe given by name (a launch suffix is allowed and ignored).

    Raises:
        UserError: No such recipe; the message lists the available ones with a did-you-mean.
    """
    base = split_launch_suffix(name)[0]
    recipes = list_recipes()
    if base in recipes:
        return recipes_dir() / f"{base}.py"
    # A config's name where the recipe goes: say where it goes instead of suggesting a recipe that looks like it.
    owners = [qualified.split("/", 1)[0] for qualified in _configs_named(name.removesuffix(".yaml"))]
    if owners:
        raise UserError(
            f"'{name}' is a config (of {', '.join(owners)}), not a recipe: give it after the recipe, e.g. "
            f"`tune run {owners[0]}_distributed --config {name}`"
        )
    # Every name that runs, launch suffixes included, so a typo in the suffix (full_finetune_distribted) suggests
    # the launch the user meant rather than the bare recipe, which runs on one device.
    hint = did_you_mean(name, runnable_names())
    raise UserError(f"unknown recipe '{name}'{hint} (recipes: {', '.join(recipes) or f'none in {recipes_dir()}'})")


def runnable_names() -> list[str]:
    """What ``tune run`` takes as a recipe name: every recipe bare (one device) and with each launch suffix."""
    return [recipe + suffix for recipe in list_recipes() for suffix in ("", *LAUNCH_SUFFIXES)]


def _qualified_config(name: str) -> Path | None:
    recipe, _, config = name.partition("/")
    config = config.removesuffix(".yaml")
    path = configs_dir() / recipe / f"{config}.yaml"
    return path if recipe and config and path.is_file() else None


def find_config(name: str) -> Path:
    """A config by ``recipe/config`` or by a bare config name that only one recipe has.

    Raises:
        UserError: Unknown or ambiguous name; the message lists candidates.
    """
    if "/" in name:
        path = _qualified_config(name)
        if path is not None:
            return path
        raise UserError(f"unknown config '{name}'{did_you_mean(name, all_configs())}")
    bare = name.removesuffix(".yaml")
    matches = _configs_named(bare)
    if len(matches) == 1:
        return configs_dir() / f"{matches[0]}.yaml"
    if matches:
        raise UserError(f"config name '{name}' is ambiguous: {', '.join(matches)}; write it as recipe/config")
    hint = did_you_mean(bare, all_configs() + _bare_config_names())
    raise UserError(f"unknown config '{name}'{hint} (see `tune ls`)")


def _configs_named(bare: str) -> list[str]:
    return [qualified for qualified in all_configs() if qualified.split("/", 1)[1] == bare]


def _bare_config_names() -> list[str]:
    return sorted({qualified.split("/", 1)[1] for qualified in all_configs()})


def find_recipe_or_config(name: str) -> Path:
    """What ``tune cp``/``tune cat`` take: a recipe by name first, else a config as in :func:`find_config`.

    Raises:
        UserError: Neither matches (with a did-you-mean over both), or the config name is ambiguous.
    """
    if split_launch_suffix(name)[0] in list_recipes():
        return recipe_path(name)
    if "/" in name or _configs_named(name.removesuffix(".yaml")):
        return find_config(name)
    candidates = list_recipes() + all_configs() + _bare_config_names()
    raise UserError(f"no recipe or config named '{name}'{did_you_mean(name, candidates)} (see `tune ls`)")


def config_for_recipe(name: str, recipe: str | None) -> Path:
    """What ``tune run <recipe> --config <name>`` means: a file, then ``<recipe>/<name>``, then ``recipe/config``.

    Args:
        name: The ``--config`` value.
        recipe: The recipe's name, or None for a recipe given as a file.

    Raises:
        UserError: Nothing matches; the message lists the recipe's configs with a did-you-mean.
    """
    as_file = Path(name)
    if as_file.is_file():
        return as_file
    if recipe is not None:
        own = configs_dir() / recipe / f"{name.removesuffix('.yaml')}.yaml"
        if own.is_file():
            return own
    qualified = _qualified_config(name) if "/" in name else None
    if qualified is not None:
        return qualified
    candidates = all_configs() if "/" in name else []
    if recipe is None:
        hint = did_you_mean(name, all_configs())
        raise UserError(f"no such config file or recipe/config '{name}'{hint}")
    configs = list_configs(recipe)
    listing = f"its configs: {', '.join(configs)}" if configs else f"it has none in {configs_dir() / recipe}"
    if name.endswith((".yaml", ".yml")):
        raise UserError(f"no such config file '{name}' (nor a config of recipe '{recipe}': {listing})")
    hint = did_you_mean(name, configs + candidates)
    raise UserError(f"no config '{name}' for recipe '{recipe}'{hint} ({listing})")


def recipe_schema(path: Path) -> Schema | None:
    """The schema a recipe file declares (``@recipe_main(schema=SCHEMA)``), read by importing the file without
    running it, so that ``tune`` checks a config before any process is launched.

    Returns:
        None for a recipe that declares none (a recipe of one's own may not).

    Raises:
        UserError: the file cannot be imported; the message names it and the first line of the reason.
    """
    name = f"_tunekit_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    sys.path.insert(0, str(path.resolve().parent))  # as `python recipe.py` would see its folder
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (a recipe of one's own may fail in any way while importing)
        raise UserError(f"{path}: cannot import the recipe: {type(e).__name__}: {first_line(e)}") from None
    finally:
        sys.path[:] = saved_path
    schema = getattr(getattr(module, "main", None), "schema", None)
    return schema if isinstance(schema, Schema) else None
