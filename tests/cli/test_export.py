"""`tune export`: argument checks and errors (the conversion itself: tests/recipes/test_resume.py)."""

import pytest

from toolkit.cli.export import parse_size
from toolkit.cli.main import main
from toolkit.errors import UserError


@pytest.mark.parametrize(
    "text, expected",
    [("5GB", 5 * 2**30), ("500MB", 500 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", int(1.5 * 2**30)), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense():
    with pytest.raises(UserError, match="--max_shard_size"):
        parse_size("five gigs")


def test_an_incomplete_checkpoint_is_a_one_line_error(tmp_path, capsys):
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a complete step checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_refuses_to_replace_an_existing_output(tmp_path, capsys):
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "COMPLETE").write_text("{}")
    (tmp_path / "out").mkdir()
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 1
    assert "--overwrite" in capsys.readouterr().err
