"""Every command the project shows a user runs as written, on the demo.

The commands are read from where a user reads them: the ```bash blocks of the README and docs/, the `examples:`
of every `tune` command's --help, the launch commands in the recipes' docstrings and the demo configs' header
comments. `test_the_commands_run` executes them in that order in one working folder laid out like a clone
(recipes/, recipe_configs/, ... linked in), as a new user would: the README's demo first, then generate, export,
plot, merge, resume and the rest, each reading what the commands before it wrote. Launches of several processes
and lines with other shell syntax run through bash; a `tune` command of one process runs through what the `tune`
script calls (`toolkit.cli.main.main`) in the test's own process, which saves an interpreter start each. The few
that cannot run here are in SKIPPED with the reason; `test_skipped_tune_commands_still_name_what_exists` still
checks those without running them.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

import toolkit.cli._run as run_module
from toolkit.cli._catalog import config_for_recipe, split_launch_suffix
from toolkit.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/guide.md", "docs/checkpoints.md", "docs/multi_node.md", "docs/performance.md"]
# Every subcommand shows examples in its --help.
SUBCOMMANDS = ["ls", "run", "plan", "cp", "cat", "validate", "export", "merge", "plot", "download", "doctor"]
# What a clone holds that the commands name by path (recipes/full_finetune.py, scripts/slurm/...).
CLONE = ["recipes", "recipe_configs", "scripts", "benchmarks"]

# What cannot run here, and why. Each pattern must still match a command (test_the_skip_list_is_current).
SKIPPED = {
    r"^pip install ": "installs packages; the environment running the tests has them (CI installs them fresh)",
    r"^python -m pytest": "the test suite itself",
    r"^tune download ": "downloads from the Hugging Face hub",
    r"^tune run .*--config (llama3_1_8b|llama3_2_1b|any_model|qwen3_|transformers_backend)":
        "a real model: a GPU and weights from the hub",
    r"rdzv_endpoint host:|node0\.example": "several machines",
    r"lm_eval\.tasks=": "lm-evaluation-harness tasks download their data sets from the hub",
    r"^sbatch ": "a Slurm cluster",
    r"^kubectl ": "a Kubernetes cluster",
    r"^(python|bash) benchmarks/": "a benchmark: minutes each, against peers installed apart (benchmarks/README.md)",
}

# The demo trains 1000 steps (the LoRA demo 300) on 32,000 samples and evaluates on 200; the test appends these
# overrides to each command that trains or evaluates, for keys the command does not set itself, so that all of
# them run in a few minutes. They change no name a later command reads: runs keep their output_dir, and the docs
# name a step checkpoint only of runs whose max_steps and save_every_n_steps they set.
SHORT_TRAINING = {
    "max_steps": 4,
    "dataset.num_samples": 1280,  # one epoch: 40 steps of 32
    "eval_tasks.num_samples": 8,
    "validation_dataset.num_samples": 16,
    "sft_warmup_steps": 4,  # the RL demo's supervised warm-up (before its steps) of a model starting from random
}
SHORT_EVAL = {"dataset.num_samples": 16, "eval_tasks.num_samples": 8}
TRAINING_RECIPES = {"full_finetune", "lora_finetune", "preference_finetune", "distill", "rl_finetune"}
TIMEOUT_S = 300


@dataclass
class Command:
    source: str
    text: str  # as written, without its comment
    together: int = 1  # launched this many times at once ("terminal 1 and terminal 2: the same command")

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)


def _uncomment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _commands_of(source: str, lines: list[str]) -> list[Command]:
    found: list[Command] = []
    together = 1
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        if "terminal 1 and terminal 2" in line:
            together = 2
        text = _uncomment(line).strip()
        if not text:
            continue
        for part in text.split(" && "):
            found.append(Command(source, part.strip(), together))
        together = 1
    return found


def _help_text(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def _examples(text: str) -> list[str]:
    """The lines of an ``examples:`` section (up to the first blank line)."""
    section = text.split("\nexamples:\n", 1)[1] if "\nexamples:\n" in text else ""
    return [line for line in section.split("\n\n", 1)[0].splitlines() if line.strip()]


def commands() -> list[Command]:
    """Every command shown to a user, in the order the test runs them."""
    found: list[Command] = []
    for name in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (REPO / name).read_text(), flags=re.S):
            found += _commands_of(name, block.splitlines())
    for sub in SUBCOMMANDS:
        found += _commands_of(f"tune {sub} --help", _examples(_help_text(sub)))
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        doc = ast.get_docstring(ast.parse(recipe.read_text())) or ""
        lines = [line for line in doc.splitlines() if re.match(r"    (tune|python) ", line)]
        found += _commands_of(f"recipes/{recipe.name}", lines)
    for config in sorted((REPO / "recipe_configs").glob("*/demo*.yaml")):
        header = re.match(r"(#.*\n)*", config.read_text()).group(0)
        lines = [line[1:] for line in header.splitlines() if re.match(r"#\s+(tune|python) ", line)]
        found += _commands_of(str(config.relative_to(REPO)), lines)
    return found


COMMANDS = commands()


def skip_reason(command: Command) -> str | None:
    return next((reason for pattern, reason in SKIPPED.items() if re.search(pattern, command.text)), None)


# --- the commands, checked cheaply ----------------------------------------------------------------------------


def test_the_commands_are_found():
    sources = {c.source for c in COMMANDS}
    assert set(DOCS) <= sources
    assert {f"tune {sub} --help" for sub in SUBCOMMANDS} <= sources, "a --help without examples"
    assert {f"recipes/{r.name}" for r in (REPO / "recipes").glob("*.py")} <= sources
    assert len(COMMANDS) > 80


def test_the_skip_list_is_current():
    for pattern in SKIPPED:
        assert any(re.search(pattern, c.text) for c in COMMANDS), f"{pattern!r} skips nothing: remove it"
    run_here = [c for c in COMMANDS if not skip_reason(c)]
    assert len(run_here) > 2 * (len(COMMANDS) - len(run_here)), "most commands run"


def test_what_the_docs_mark_gpu_is_skipped():
    for name in ("docs/guide.md", "docs/multi_node.md"):
        for block in re.findall(r"```bash\n(.*?)```", (REPO / name).read_text(), flags=re.S):
            lines = block.replace("\\\n", " ").splitlines()
            for command in _commands_of(name, [line for line in lines if re.search(r"#\s*GPU\b", line)]):
                assert skip_reason(command), f"{name}: '{command.text}' needs a GPU but would run"


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if skip_reason(c) and c.words[0] == "tune"], ids=lambda c: c.text[:70]
)
def test_skipped_tune_commands_still_name_what_exists(command, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    check_without_running(command.words[1:], monkeypatch=monkeypatch, capsys=capsys)


def check_without_running(args: list[str], *, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Check the arguments of a `tune` command that cannot run here (also those of scripts/k8s's manifest): its
    recipe, config, torchrun flags and overrides, by `tune run` with the launch replaced by a no-op; the other
    subcommands' arguments are parsed."""
    if args[0] == "run":
        launched = []
        monkeypatch.setattr(run_module, "_run_single_device", lambda path, argv: launched.append(argv) or 0)
        monkeypatch.setattr(run_module, "_run_distributed", lambda launch, path, argv, **_: launched.append(argv) or 0)
        assert main(args) == 0, capsys.readouterr().err
        assert launched, "the recipe would have been launched"
    else:
        assert build_parser().parse_args(args).command == args[0]


# --- the commands, run ------------------------------------------------------------------------------------------


def _recipe(words: list[str], cwd: Path) -> tuple[str | None, str | None]:
    """The recipe a command runs (a copied recipe file counts as the one it was copied from) and its config
    argument, or ``(None, None)``."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # OMP_NUM_THREADS=1 tune ...
    if words[:2] == ["tune", "run"]:
        flags_with_values = {"--nproc_per_node", "--nnodes", "--max_restarts", "--rdzv_backend", "--rdzv_endpoint",
                             "--rdzv_id", "--node_rank", "--master_addr", "--master_port"}
        i = 2
        while words[i].startswith("-"):
            i += 2 if words[i] in flags_with_values else 1
        token = words[i]
    elif len(words) > 1 and words[0] == "python" and words[1].startswith("recipes/"):
        token = words[1]
    else:
        return None, None
    config = words[words.index("--config") + 1]
    if token.endswith(".py"):
        text = (cwd / token).read_text()
        token = next((r.stem for r in (REPO / "recipes").glob("*.py") if r.read_text() == text), token)
    return split_launch_suffix(token)[0], config


def _sets(words: list[str], key: str) -> bool:
    """Whether the command sets or deletes ``key``, a key above it or one below it."""
    for word in words:
        name = word.lstrip("~").split("=", 1)[0]
        if name == key or key.startswith(f"{name}.") or name.startswith(f"{key}."):
            return True
    return False


def _config(recipe: str, config: str, cwd: Path) -> DictConfig:
    return OmegaConf.load(cwd / config if (cwd / config).is_file() else config_for_recipe(config, recipe))


def _shortening(words: list[str], cfg: DictConfig, recipe: str) -> dict[str, object]:
    """The shortening overrides a command that trains or evaluates gets: those of keys the config has (under a
    section that is not null; a key set to null counts, as the KTO demo's ``max_steps: null`` does) and the command
    leaves alone."""
    short = SHORT_EVAL if recipe == "eval" else SHORT_TRAINING  # a resume: the max_steps of the run it continues
    return {k: v for k, v in short.items() if not _sets(words, k) and _has(cfg, k)}


def _has(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(section, DictConfig) and leaf in section


def _output_dir(words: list[str], cfg: DictConfig) -> str:
    given = [w.split("=", 1)[1] for w in words if w.startswith("output_dir=")]
    return given[-1] if given else str(cfg.output_dir)


def _clone(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    for name in CLONE:
        (work / name).symlink_to(REPO / name)
    bin_dir = tmp / "bin"  # `tune` and `python` are this checkout's, on this interpreter
    bin_dir.mkdir()
    for name, run in (("tune", f'exec "{sys.executable}" -m toolkit.cli.main "$@"'),
                      ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{run}\n")
        (bin_dir / name).chmod(0o755)
    return work


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children."""
    usages = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usages)


def _one_process(command: Command) -> bool:
    """Whether ``command`` is ``tune`` in one process: no torchrun launch, no other shell syntax."""
    words = command.words
    if words[0] != "tune" or re.search(r"[|&;<>$`]", command.text):
        return False
    return words[1] != "run" or not (words[2].startswith("-") or words[2].endswith("_distributed"))


def _run_here(args: list[str], cwd: Path, capfd: pytest.CaptureFixture) -> tuple[int, str]:
    """``tune args`` through what the ``tune`` script calls, in this process (no interpreter start)."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    finally:
        os.chdir(before)
    out, err = capfd.readouterr()
    return code, out + err


def _run_in_bash(command: Command, text: str, cwd: Path, env: dict[str, str]) -> list[tuple[int, str]]:
    launched = [subprocess.Popen(["bash", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for _ in range(command.together)]
    results = []
    for process in launched:
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        results.append((process.returncode, output))
    return results


def _scratch(work: Path, tmp: Path, output_dir: str) -> Path:
    """A copy of ``work`` without ``output_dir``: the folder a user who tries this command first has."""
    scratch = tmp / f"scratch_{len(list(tmp.glob('scratch_*')))}"
    skip = (work / output_dir).resolve()
    shutil.copytree(work, scratch, symlinks=True,
                    ignore=lambda folder, names: [n for n in names if (Path(folder) / n).resolve() == skip])
    return scratch


@pytest.mark.slow  # 55 commands, 13 launching several processes: ~300 s of CPU, 3.5-4.5 minutes on 2 cores
def test_the_commands_run(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    work = _clone(tmp_path)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done: set[tuple[str, ...]] = set()
    written: set[str] = set()  # the output_dirs of runs so far
    failures, timings = [], []
    for command in COMMANDS:
        words = command.words
        if skip_reason(command) or tuple(words) in done:
            continue
        done.add(tuple(words))
        text, cwd = command.text, work
        recipe, config = _recipe(words, work)
        if recipe in TRAINING_RECIPES | {"eval"}:
            cfg = _config(recipe, config, work)
            text += "".join(f" {k}={v}" for k, v in _shortening(words, cfg, recipe).items())
        if recipe in TRAINING_RECIPES:
            output_dir = _output_dir(words, cfg)
            resumes = any(w.startswith("resume_from=") for w in words)
            if output_dir in written and not resumes:
                # The README's lines run top to bottom as written: each run has its own output_dir. The guides
                # offer several ways to train the demo into one output_dir, and a second run there is refused
                # (overwrite=true replaces it); each of those runs as a user trying it first would, on a copy of
                # the folder without that run, and later commands read the first one.
                if command.source == "README.md":
                    failures.append(f"README.md: {text}\n  writes {output_dir}, which a line above it wrote")
                    continue
                cwd = _scratch(work, tmp_path, output_dir)
            written.add(output_dir)
        start, cpu = time.monotonic(), _cpu_s()
        if _one_process(command):
            results = [_run_here(shlex.split(text)[1:], cwd, capfd)]
        else:
            results = _run_in_bash(command, text, cwd, env)
        for code, output in results:
            if code != 0:
                tail = "\n    ".join(output.replace("\r", "\n").strip().splitlines()[-6:])
                failures.append(f"{command.source}: {text}\n  exit {code} in {cwd.name}:\n    {tail}")
        if cwd != work:
            shutil.rmtree(cwd)
        timings.append((_cpu_s() - cpu, time.monotonic() - start, text))
        with capfd.disabled():
            print(f"{timings[-1][0]:5.1f}s CPU {timings[-1][1]:5.1f}s {text[:150]}", flush=True)
    total_cpu, total_wall = sum(t[0] for t in timings), sum(t[1] for t in timings)
    with capfd.disabled():
        print(f"{len(timings)} commands: {total_cpu:.0f}s CPU, {total_wall:.0f}s", flush=True)
    assert not failures, "\n\n".join(failures)
