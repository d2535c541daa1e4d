"""Where the recipes and their configs live, in a source checkout and in an installed wheel, and how to install an
extra into the copy that runs."""

import importlib.metadata
import json
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

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


def install_command(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra`` (pyproject's ``[project.optional-dependencies]``)
    to this installation, as it was installed: ``pip install "tunekit[plot]"`` for a wheel from an index, but
    ``pip install -e ".[plot]"`` for an editable install of a clone (run in the clone; elsewhere its path), whose
    package an index install would replace. pip records a local install's folder in ``direct_url.json`` (PEP 610).
    """
    try:
        recorded = importlib.metadata.distribution("tunekit").read_text("direct_url.json")
        origin = json.loads(recorded) if recorded else {}
    except (importlib.metadata.PackageNotFoundError, ValueError):
        origin = {}
    if "vcs_info" in origin:  # from a repository's URL: the same source, not the index's release
        return f'pip install "tunekit[{extra}] @ {origin["url"]}"'
    url = urlparse(str(origin.get("url", "")))
    if url.scheme != "file" or "dir_info" not in origin:
        return f'pip install "tunekit[{extra}]"'
    folder = Path(unquote(url.path))
    where = "." if Path.cwd().resolve() == folder.resolve() else str(folder)
    editable = "-e " if origin["dir_info"].get("editable") else ""
    return f'pip install {editable}"{where}[{extra}]"'
