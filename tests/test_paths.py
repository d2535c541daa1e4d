"""How to install an extra into the copy that runs: from the index, a clone (editable or not), or a repository URL."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from toolkit.paths import install_command


class _Distribution:
    def __init__(self, direct_url: dict | None) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


@pytest.fixture
def installed(monkeypatch):
    def install(direct_url: dict | None) -> None:
        monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _Distribution(direct_url))

    return install


def test_a_wheel_from_the_index_installs_the_extra_by_name(installed) -> None:
    installed(None)  # pip writes no direct_url.json for a release from an index
    assert install_command("plot") == 'pip install "tunekit[plot]"'


def test_a_clone_installs_the_extra_from_itself_editable_as_it_was(installed, tmp_path, monkeypatch) -> None:
    clone = tmp_path / "my tunekit"
    clone.mkdir()
    installed({"url": clone.as_uri(), "dir_info": {"editable": True}})
    monkeypatch.chdir(clone)
    assert install_command("plot") == 'pip install -e ".[plot]"'
    monkeypatch.chdir(tmp_path)  # elsewhere: the clone's path (its space survives the file URL's quoting)
    assert install_command("eval") == f'pip install -e "{clone}[eval]"'
    installed({"url": clone.as_uri(), "dir_info": {}})  # `pip install ./clone`, not editable
    assert install_command("eval") == f'pip install "{clone}[eval]"'


def test_an_install_from_a_repository_url_installs_the_extra_from_it(installed) -> None:
    url = "git+https://example.com/org/tunekit.git"
    installed({"url": url, "vcs_info": {"vcs": "git", "commit_id": "0" * 40}})
    assert install_command("wandb") == f'pip install "tunekit[wandb] @ {url}"'


def test_running_without_an_installed_distribution_falls_back_to_the_index_name(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert install_command("data") == 'pip install "tunekit[data]"'
