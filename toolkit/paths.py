"""Where the recipes and their configs live, in a source checkout and in an installed wheel."""

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
    """The folder holding one ``<recipe>.py`` file per recipe."""
    return _locate("recipes", "_recipes")


def configs_dir() -> Path:
    """The folder holding ``<recipe>/<config>.yaml``."""
    return _locate("recipe_configs", "_recipe_configs")
