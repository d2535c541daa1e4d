"""tune download: arguments reach snapshot_download, and failures are one line with the command to retry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError

from toolkit.cli.main import main


def test_unreachable_hub_is_one_line_with_the_retry_command(tmp_path):
    # A closed local port stands in for the hub: nothing leaves the machine.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf_home")}
    out = tmp_path / "model"
    result = subprocess.run(
        [
            sys.executable, "-m", "toolkit.cli.main", "download", "org/model", "--output-dir", str(out),
            "--exclude", "*.pth",
        ],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("tune: error:")]
    assert len(errors) == 1, result.stderr
    assert "could not download org/model" in errors[0]
    assert errors[0].endswith(f"retry: tune download org/model --output-dir {out} --exclude '*.pth'")


def test_arguments_reach_snapshot_download(monkeypatch, capsys, tmp_path):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(kwargs["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    code = main([
        "download", "Qwen/Qwen2.5-0.5B", "--output-dir", str(tmp_path), "--hf-token", "secret",
        "--include", "*.json", "*.safetensors", "--exclude", "original/*",
    ])
    assert code == 0
    repo_id, kwargs = calls[0]
    assert repo_id == "Qwen/Qwen2.5-0.5B" and str(kwargs["local_dir"]) == str(tmp_path) and kwargs["token"] == "secret"
    assert kwargs["allow_patterns"] == ["*.json", "*.safetensors"] and kwargs["ignore_patterns"] == ["original/*"]
    assert f"downloaded Qwen/Qwen2.5-0.5B to {tmp_path}" in capsys.readouterr().out


def test_gated_repo_explains_access_and_hides_the_token(monkeypatch, capsys):
    def gated(repo_id, **kwargs):
        raise GatedRepoError("gated", response=mock.Mock(headers={}, status_code=403))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    assert main(["download", "meta-llama/Llama-3.2-1B", "--hf-token", "secret"]) == 2
    err = capsys.readouterr().err
    assert "accept its license on https://huggingface.co/meta-llama/Llama-3.2-1B" in err
    assert f"--output-dir {Path.home()}/models/Llama-3.2-1B" in err and "secret" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["download"], ["download", "a/b", "--include"]])
def test_usage_errors_are_one_line(capsys, argv):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("tune: error:")
