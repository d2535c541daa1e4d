"""Every `tune` command in the README and docs/ still names things that exist.

Each command in a ```bash block is checked without training. `tune run` goes through the real CLI with the
launch replaced by a no-op, so its recipe, torchrun flags, config, overrides and config validation are all
checked. `ls`, `cat`, `validate`, `cp` and `plan` run for real (cheap). `download`, `merge`, `export` and `plot`
have their arguments parsed. Running the commands is the recipe tests' job; the guide names those tests.
"""

import re
import shlex
from pathlib import Path

import pytest

import toolkit.cli._run as run_module
from toolkit.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_FOR_REAL = {"ls", "cat", "validate", "cp", "plan"}


def commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words = words[1:]  # OMP_NUM_THREADS=1 tune ...
                if words[:1] == ["tune"] and not any("<" in w or "..." in w for w in words):
                    found.append((f"{doc.name}: {line.strip()[:70]}", words[1:]))
    return found


COMMANDS = commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) > 30


@pytest.mark.parametrize("args", [c[1] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_command_is_valid(args, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # `tune cp` writes into the current folder
    if args[0] == "run":
        launched = []
        monkeypatch.setattr(run_module, "_run_single_device", lambda path, argv: launched.append(argv) or 0)
        monkeypatch.setattr(run_module, "_run_distributed", lambda launch, path, argv: launched.append(argv) or 0)
        assert main(args) == 0, capsys.readouterr().err
        assert launched, "the recipe would have been launched"
    elif args[0] in RUN_FOR_REAL:
        assert main(args) == 0, capsys.readouterr().err
    else:
        namespace = build_parser().parse_args(args)
        assert namespace.command == args[0]
