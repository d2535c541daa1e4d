"""The default install is enough: the demo's path and every `tune` command, with only the core dependencies importable.

`pip install torch==2.13.0 -e .` brings pyproject's ``[project.dependencies]`` and what they require, nothing more;
the test environment has the extras too, which is how two undeclared imports (tokenizers, and numpy for gloo's
object collectives) once hid from CI while the README's first command failed. Here the `tune` commands run in an
interpreter, and the processes it launches, that start with a ``sitecustomize`` refusing every top-level module
which only a distribution outside that closure provides, exactly as if the distribution were not installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.launch import REPO
from toolkit.paths import install_command

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# Installed before anything else imports, in every interpreter that has this folder on its PYTHONPATH (torchrun's
# workers inherit it). Every finder is wrapped to find nothing for a refused name, so an import fails with the error
# of a missing package and importlib.util.find_spec answers None (torch probes optional packages that way).
_HOOK = '''\
import sys

_REFUSED = frozenset({refused!r})


class _CoreInstallOnly:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _REFUSED or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self._finder, attribute)


sys.meta_path[:] = [_CoreInstallOnly(finder) for finder in sys.meta_path]
'''


def core_closure() -> set[str]:
    """The project and every distribution its ``[project.dependencies]`` require, transitively (canonical names;
    requirements behind an extra or a marker this interpreter does not meet are left out, as pip leaves them)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    closure = {canonicalize_name(project["name"])}
    pending = [Requirement(line) for line in project["dependencies"]]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in closure or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        closure.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing of it to refuse, and a missing core dependency fails below anyway
        pending.extend(Requirement(line) for line in requires)
    return closure


def refused_modules(closure: set[str]) -> set[str]:
    """Top-level modules installed here that no distribution of ``closure`` (nor the standard library) provides."""
    return {
        module
        for module, providers in importlib.metadata.packages_distributions().items()
        if module not in sys.stdlib_module_names and not closure & {canonicalize_name(p) for p in providers}
    }


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment variables under which `tune` sees only the core install (this checkout's toolkit first)."""
    hook_dir = tmp_path_factory.mktemp("core_only")
    (hook_dir / "sitecustomize.py").write_text(_HOOK.format(refused=sorted(refused_modules(core_closure()))))
    return {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO)]), "HF_HUB_OFFLINE": "1"}


def test_the_core_closure_is_what_pyproject_declares() -> None:
    closure = core_closure()
    assert {"torch", "tokenizers", "numpy", "omegaconf", "pyyaml", "tunekit"} <= closure
    refused = refused_modules(closure)
    assert "pytest" in refused and "matplotlib" not in closure  # the test extras stay out
    assert not refused & {"torch", "toolkit", "yaml", "numpy", "tokenizers"}


# Runs `tune ARGV...` for each (ARGV, ok) in argv[1] (JSON) in this one interpreter (each `tune` process would import
# torch again, ~3 s here), each with the environment it started with, as a process of its own would; stops at the
# first whose exit code is not what `ok` says. First, that the hook works: pytest is installed but no core dependency.
_DRIVER = """\
import importlib.util, json, os, shlex, sys
assert importlib.util.find_spec("pytest") is None, "the core-install hook did not load"
from toolkit.cli.main import main
environment = dict(os.environ)
for argv, ok in json.loads(sys.argv[1]):
    code = main(argv)
    os.environ.clear()
    os.environ.update(environment)
    if (code == 0) != ok:
        sys.exit(f"unexpected exit {code}: tune {shlex.join(argv)}")
"""


def test_demo_path_on_core_install(core_env: dict[str, str], tmp_path: Path) -> None:
    """The README's path on the core install: list, read, copy and check configs, plan, train the demo on two
    processes over gloo, export its step checkpoint, a LoRA step on it, merge, generate, evaluate; and one line
    for what needs an extra (lm-eval tasks, a W&B logger, plot's PNG) or the network (download)."""
    out, lora, merged = tmp_path / "demo", tmp_path / "lora", tmp_path / "merged"
    small = ["dataset.num_samples=64", "validation_dataset.num_samples=8", "eval_every_n_steps=2", "progress_bar=false"]
    commands = [
        (["ls"], True),
        (["cat", "full_finetune/demo"], True),
        (["cp", "full_finetune/demo", str(tmp_path / "my.yaml")], True),
        # Configs whose components import each tokenizer engine (byte, tokenizer.json, sentencepiece, tiktoken).
        *((["validate", config], True) for config in (
            "full_finetune/demo", "lora_finetune/demo", "eval/demo", "generate/demo", "qwen3_8b_lora",
            "gemma2_2b_lora", "llama3_2_1b_qlora")),
        (["plan", "full_finetune", "--config", "demo", "--device-memory-gb", "24"], True),
        (["run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "demo", f"output_dir={out}",
          "max_steps=2", "save_every_n_steps=2", "eval_tasks.num_samples=4", *small], True),
        (["export", str(out / "checkpoints" / "step_2"), "--output", str(tmp_path / "hf")], True),
        (["run", "lora_finetune_single_device", "--config", "demo", f"output_dir={lora}", "max_steps=1",
          f"checkpointer.checkpoint_dir={out / 'final'}", "save_merged=false", *small], True),
        (["merge", "--base", str(out / "final"), "--adapter", str(lora / "final" / "adapter"),
          "--output", str(merged)], True),
        (["run", "generate", "--config", "demo", f"checkpointer.checkpoint_dir={merged}", "max_new_tokens=4"], True),
        (["run", "eval_single_device", "--config", "demo", f"checkpointer.checkpoint_dir={merged}",
          f"output_dir={tmp_path / 'eval'}", "dataset.num_samples=8", "eval_tasks.num_samples=4"], True),
        (["run", "eval_single_device", "--config", "demo", f"output_dir={tmp_path / 'lm_eval'}",
          "lm_eval.tasks=[arc_easy]"], False),
        (["run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'wandb'}", "max_steps=1",
          "metric_loggers=[wandb]", *small], False),
        (["plot", str(out), "--output", str(tmp_path / "loss.png")], True),
        (["download", "org/model", "--output-dir", str(tmp_path / "dl")], False),
    ]
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(commands)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **core_env}, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (merged / "config.json").is_file()
    # Without an extra: the line names it (plot still prints its summary); offline, the hub client's one line.
    errors = [line for line in result.stderr.splitlines() if line.startswith("tune: error:")]
    assert len(errors) == 3, result.stderr[-3000:]
    with contextlib.chdir(tmp_path):  # the hint names the clone as seen from where the command ran
        hints = {extra: install_command(extra) for extra in ("eval", "wandb", "plot")}
    assert errors[0].endswith(hints["eval"]) and errors[1].endswith(hints["wandb"])
    assert errors[2].startswith("tune: error: could not download org/model")
    assert hints["plot"] in result.stdout and not (tmp_path / "loss.png").exists()
    assert "Traceback" not in result.stderr


def test_constraints_pin_every_declared_package_within_its_bounds() -> None:
    # .ci/run installs `torch==2.13.0 -e .[...]` with -c constraints.txt: a torch line could only conflict, the
    # project and CUDA-only packages must not be pinned at all, and a declared package missing from the file (or
    # pinned outside a bound raised since) means it was not refreshed with scripts/refresh_constraints.sh.
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    assert not [name for name in pins if name in ("torch", "tunekit") or name.startswith(("nvidia-", "triton"))]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    declared = [*project["dependencies"], *(line for extra in extras for line in extra)]
    for requirement in map(Requirement, declared):
        name = canonicalize_name(requirement.name)
        if name != "torch":
            assert name in pins, f"{name} is not in constraints.txt"
            assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]}: {requirement}"
