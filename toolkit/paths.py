"""Where the recipes and their configs live, in a source checkout and in an installed wheel."""

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _locate(repo_name: str, packaged_name: str) -> Path:
    # A source checkout (or editable install) keeps them at the repository root, next to toolkit/; a wheel
    # carries them inside the package (see [tool.hatch.build.targets.wheel.force-include] in pyproject.toml).
    in_repo = _PACKAGE_DIR.parent / repo_name
    if in_repo.is_dir():
        return in_repo
    return _PACKAGE_DIR / packaged_name


def recipes_dir() -> Path:
    """The folder holding one ``<recipe>.py`` file per recipe (``$TUNE_RECIPES_DIR`` if set)."""
    # The environment variables let tests (and people with their own recipe collections) point `tune` at
    # another tree without copying files into the package.
    override = os.environ.get("TUNE_RECIPES_DIR")
    return Path(override) if override else _locate("recipes", "_recipes")


def configs_dir() -> Path:
    """The folder holding ``<recipe>/<config>.yaml`` (``$TUNE_CONFIGS_DIR`` if set)."""
    override = os.environ.get("TUNE_CONFIGS_DIR")
    return Path(override) if override else _locate("recipe_configs", "_recipe_configs")
