"""A fake recipes/configs tree, and a helper that runs `tune` on it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from toolkit.cli.main import main

REPO = Path(__file__).resolve().parents[2]

# Writes `RANK MESSAGE` to out_dir/rank_<RANK>.txt, or fails the way the config asks, on the ranks it names.
TOY_RECIPE = '''\
"""Toy recipe for CLI tests."""
import os

from toolkit.config import recipe_main
from toolkit.errors import UserError


@recipe_main
def main(cfg):
    rank = os.environ.get("RANK", "none")
    if str(cfg.fail_on) in ("all", rank):
        if cfg.failure == "user":
            raise UserError(f"bad value on rank {rank}")
        raise RuntimeError(f"bug on rank {rank}")
    with open(os.path.join(cfg.out_dir, f"rank_{rank}.txt"), "w") as f:
        f.write(f"{rank} {cfg.message}")


if __name__ == "__main__":
    main()
'''

TOY_CONFIG = """\
# tune run toy_single_device --config small
out_dir: {out_dir}
message: hello
fail_on: nobody
failure: user
optimizer:
  _component_: tests.config._targets.fake_optimizer
  lr: 0.1
"""


class Tree:
    """Paths of the fake tree."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recipes = root / "recipes"
        self.configs = root / "recipe_configs"
        self.out = root / "out"
        self.work = root / "work"

    def rank_files(self) -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted(self.out.glob("rank_*.txt"))}


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    t = Tree(tmp_path)
    for folder in (t.recipes, t.configs / "toy", t.configs / "other", t.out, t.work):
        folder.mkdir(parents=True)
    (t.recipes / "toy.py").write_text(TOY_RECIPE)
    (t.recipes / "other.py").write_text('"""Another recipe."""\n')
    (t.recipes / "_shared.py").write_text("# not a recipe: private helpers start with _\n")
    (t.configs / "toy" / "small.yaml").write_text(TOY_CONFIG.format(out_dir=t.out))
    (t.configs / "toy" / "demo.yaml").write_text(TOY_CONFIG.format(out_dir=t.out))
    (t.configs / "other" / "demo.yaml").write_text("lr: 1\n")
    return t


_DROPPED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE", "TUNE_VERBOSE")


def tune_env(tree: Tree) -> dict[str, str]:
    """The environment for a `tune` subprocess pointed at the fake tree."""
    # Nothing from an enclosing launcher or a developer's shell may change what `tune` does here.
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and not k.startswith("PET_")}
    env.update(TUNE_RECIPES_DIR=str(tree.recipes), TUNE_CONFIGS_DIR=str(tree.configs), PYTHONPATH=str(REPO))
    return env


TUNE_COMMAND = [sys.executable, "-m", "toolkit.cli.main"]


@pytest.fixture
def tune_process(tree: Tree) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python -m toolkit.cli.main ARGS` in tree.work, pointed at the fake tree: for launches."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*TUNE_COMMAND, *args], cwd=tree.work, capture_output=True, text=True, env=tune_env(tree), timeout=120
        )

    return run


@pytest.fixture
def tune(
    tree: Tree, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`tune ARGS` in this process (same code path as the command, without a second torch import per call):
    for everything that launches no recipe."""
    for name in _DROPPED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TUNE_RECIPES_DIR", str(tree.recipes))
    monkeypatch.setenv("TUNE_CONFIGS_DIR", str(tree.configs))
    monkeypatch.chdir(tree.work)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tune", *args], code, out, err)

    return run


def one_line(text: str) -> str:
    """The text, asserting it is exactly one line."""
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]
