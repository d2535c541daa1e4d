"""`tune plot`: runs' metrics.jsonl as a PNG, and a text summary without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.cli.plot import plot_runs, read_metrics
from tests.cli.conftest import one_line

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, *, steps: int, start_loss: float, validate_every: int = 0) -> Path:
    """A run folder with metrics.jsonl as a recipe writes it: per-rank stats every 2 steps, validation records
    (``val_loss`` lines) every ``validate_every`` steps, and a last line cut short by a crash."""
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "epoch": 0, "loss": start_loss / step, "lr": 1e-3, "grad_norm": 1.0,
                  "num_tokens": 512, "tokens_per_second": 1000.0 + step, "step_time_s": 0.5}
        if step % 2 == 0:
            record.update(rank_peak_memory_gib_min=1.0, rank_peak_memory_gib_max=1.5 + step, slowest_rank=0)
        lines.append(json.dumps(record))
        if validate_every and step % validate_every == 0:
            lines.append(json.dumps({"step": step, "val_loss": start_loss / step + 0.1}))
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": ')
    return folder


def loss_axes(figure):
    (ax,) = [ax for ax in figure.axes if ax.get_title() == "loss"]
    return ax


def test_two_runs_overlaid_in_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run_a = write_run(tmp_path / "run_a", steps=6, start_loss=3.0)
    run_b = write_run(tmp_path / "run_b", steps=4, start_loss=2.0)
    output = tmp_path / "plots" / "cmp.png"
    assert main(["plot", str(run_a), str(run_b), "--output", str(output)]) == 0
    assert output.read_bytes().startswith(PNG_SIGNATURE)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "run_a: 6 steps (1-6); loss first 3.0000 last 0.5000 min 0.5000 (step 6); mean tokens/s 1004",
        "run_b: 4 steps (1-4); loss first 2.0000 last 0.5000 min 0.5000 (step 4); mean tokens/s 1002",
        f"wrote {output}",
    ]

    figure = plot_runs({"run_a": read_metrics(run_a), "run_b": read_metrics(run_b)},
                       ["loss", "lr", "tokens_per_second", "peak_memory_gib"])
    ax = loss_axes(figure)
    assert [line.get_label() for line in ax.get_lines()] == ["run_a", "run_b"]
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert [ax.get_legend_handles_labels()[1] for ax in figure.axes[:1]] == [["run_a", "run_b"]]
    # Peak memory: metrics.jsonl has the max over ranks on the steps that gathered rank stats.
    (memory,) = [ax for ax in figure.axes if ax.get_title().startswith("peak memory")]
    assert list(memory.get_lines()[0].get_xdata()) == [2, 4, 6]


def test_validation_loss_is_dashed_in_the_loss_panel(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=6, start_loss=3.0, validate_every=3)
    records = read_metrics(run)
    figure = plot_runs({"run": records}, ["loss", "lr"])
    train, val = loss_axes(figure).get_lines()
    assert (train.get_label(), val.get_label(), val.get_linestyle()) == ("run", "run (validation)", "--")
    assert list(val.get_xdata()) == [3, 6] and list(train.get_xdata()) == [1, 2, 3, 4, 5, 6]


def test_metrics_chooses_the_panels(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    assert main(["plot", str(run), "--metrics", "grad_norm", "step_time_s", "-o", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_SIGNATURE)


def test_an_unknown_metric_is_a_one_line_error_listing_the_fields(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    assert main(["plot", str(run), "--metrics", "loss", "val_los"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "no run has val_los to plot" in line and "grad_norm, loss, lr" in line


def test_without_matplotlib_it_prints_a_summary_and_how_to_get_the_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails as if it were not installed
    run_a = write_run(tmp_path / "run_a", steps=6, start_loss=3.0, validate_every=3)
    run_b = write_run(tmp_path / "run_b", steps=4, start_loss=2.0)
    output = tmp_path / "cmp.png"
    assert main(["plot", str(run_a), str(run_b), "--output", str(output)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run_a: 6 steps (1-6); loss first 3.0000 last 0.5000 min 0.5000 (step 6); mean tokens/s 1004; "
        "val_loss last 0.6000 (step 6)",
        "run_b: 4 steps (1-4); loss first 2.0000 last 0.5000 min 0.5000 (step 4); mean tokens/s 1002",
        'for the PNG, install matplotlib: pip install "tunekit[plot]"',
    ]
    assert not output.exists()


def test_runs_with_the_same_folder_name_are_told_apart_by_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "a" / "out", steps=2, start_loss=1.0)
    write_run(tmp_path / "b" / "out", steps=2, start_loss=1.0)
    assert main(["plot", "a/out", "b/out"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()[:2]] == ["a/out", "b/out"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "nope", "no such run folder: '{run}'"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "'{run}' has no metrics.jsonl"),
    ],
)
def test_a_missing_run_is_a_one_line_error(tmp_path, capsys, make, message):
    run = make(tmp_path)
    assert main(["plot", str(run)]) == 2
    assert message.format(run=run) in one_line(capsys.readouterr().err)


def test_a_run_without_records_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert "has no records yet" in one_line(capsys.readouterr().err)


def test_an_output_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    (tmp_path / "taken").write_text("a file, not a folder\n")
    output = tmp_path / "taken" / "m.png"
    assert main(["plot", str(run), "-o", str(output)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"tune: error: cannot write '{output}': ")


def test_an_output_without_a_suffix_is_a_png_at_that_very_path(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    output = tmp_path / "runs"
    assert main(["plot", str(run), "-o", str(output)]) == 0
    # matplotlib alone would write runs.png while we said "wrote .../runs".
    assert output.read_bytes().startswith(PNG_SIGNATURE) and not output.with_suffix(".png").exists()
    assert f"wrote {output}" in capsys.readouterr().out


def test_an_output_format_matplotlib_cannot_write_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    assert main(["plot", str(run), "-o", str(tmp_path / "runs.xyz")]) == 2
    error = one_line(capsys.readouterr().err)
    assert error.startswith(f"tune: error: cannot write '{tmp_path / 'runs.xyz'}': no image format 'xyz'")
    assert "png" in error
    assert not (tmp_path / "runs.xyz").exists()
