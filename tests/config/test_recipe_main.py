from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config import recipe_main

REPO = Path(__file__).resolve().parents[2]

RECIPE = """\
import sys
from toolkit.config import recipe_main
from toolkit.errors import UserError

@recipe_main
def main(cfg):
    if cfg.action == "user_error":
        raise UserError("batch_size 7 is not divisible by 2 processes")
    if cfg.action == "bug":
        raise RuntimeError("a real bug")
    if cfg.action == "interrupt":
        raise KeyboardInterrupt
    if cfg.action == "disk_full":
        import errno
        raise OSError(errno.ENOSPC, "No space left on device", "out/metrics.jsonl")
    if cfg.action == "missing_file":
        open("no/such/file")
    print("ran with", cfg.value)

if __name__ == "__main__":
    main()
"""


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    config = tmp_path / "config.yaml"
    config.write_text("action: none\nvalue: 1\n")
    # Start from a clean slate: the test itself may run under torchrun or `tune run`.
    inherited = ("RANK", "TORCHELASTIC_ERROR_FILE", "TUNE_LAUNCHER_REPORTS_ERRORS")
    full_env = {key: value for key, value in os.environ.items() if key not in inherited}
    full_env.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(
        [sys.executable, str(recipe), "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def test_runs_with_overrides(tmp_path: Path) -> None:
    result = _run(tmp_path, "value=42")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran with 42"


def test_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _run(tmp_path, "action=user_error")
    assert result.returncode == 2
    assert result.stderr == "tune: error: batch_size 7 is not divisible by 2 processes\n"


def test_config_error_is_one_line(tmp_path: Path) -> None:
    result = _run(tmp_path, "~nope")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("tune: error: override '~nope': no key 'nope'")


def test_a_run_without_tune_refuses_a_key_the_recipe_never_reads(tmp_path: Path) -> None:
    # `python recipe.py` (and torchrun) check overrides against the keys the recipe file reads, as `tune run` does.
    result = _run(tmp_path, "valu=42")
    assert result.returncode == 2
    assert result.stderr == (
        "tune: error: override 'valu=42': no key 'valu' in the config, and recipe recipe does not read one; "
        "did you mean 'value'?\n"
    )


def test_only_rank_zero_prints(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    result = _run(tmp_path, "action=user_error", env={"RANK": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.returncode == 2 and result.stderr == ""
    # ...but every rank leaves its message where torchrun (and `tune run`) can read it.
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "batch_size 7 is not divisible by 2 processes"


def test_interrupt_exits_130_quietly(tmp_path: Path) -> None:
    result = _run(tmp_path, "action=interrupt")
    assert result.returncode == 130 and result.stderr == ""


def test_bugs_keep_their_traceback(tmp_path: Path) -> None:
    result = _run(tmp_path, "action=bug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "RuntimeError: a real bug" in result.stderr


def test_called_with_a_config_is_a_plain_call() -> None:
    @recipe_main
    def main(cfg: dict) -> int:
        return cfg["value"] * 2

    assert main({"value": 21}) == 42
    assert main.__name__ == "main"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help(tmp_path: Path, flag: str) -> None:
    result = _run(tmp_path, flag)
    assert result.returncode == 0 and "--config PATH" in result.stdout


def test_a_full_disk_is_one_line_and_other_os_errors_keep_their_traceback(tmp_path: Path) -> None:
    # metrics.jsonl, config.yaml and the adapter files have no handler of their own: a full disk there is not a bug.
    result = _run(tmp_path, "action=disk_full")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tune: error: out/metrics.jsonl: cannot write (ENOSPC: No space left on device)"
    ]
    result = _run(tmp_path, "action=missing_file")
    assert result.returncode == 1 and "Traceback" in result.stderr and "FileNotFoundError" in result.stderr
