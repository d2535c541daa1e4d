"""`tune plot`: runs' metrics.jsonl as a PNG, and a text summary without matplotlib."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.cli.plot import plot_runs, read_metrics
from toolkit.paths import install_command
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
        f"for the PNG, install matplotlib: {install_command('plot')}",
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


# --- where the image goes, and metrics.jsonl files a run did not write cleanly ------------------------------------


def test_the_image_goes_beside_the_metrics_it_plots(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run_a = write_run(tmp_path / "run_a", steps=3, start_loss=3.0)
    run_b = write_run(tmp_path / "run_b", steps=3, start_loss=2.0)
    assert main(["plot", str(run_a)]) == 0
    assert (run_a / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {run_a / 'metrics.png'}"
    # Several runs: a comparison beside the first, which keeps its own plot.
    assert main(["plot", str(run_a), str(run_b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {run_a / 'compare.png'}"
    assert (run_a / "metrics.png").exists() and not list(elsewhere.iterdir())


def test_a_run_given_by_its_metrics_file_and_an_output_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    (tmp_path / "plots").mkdir()
    assert main(["plot", str(run / "metrics.jsonl"), "-o", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run: 3 steps") and out[-1] == f"wrote {tmp_path / 'plots' / 'metrics.png'}"
    assert (tmp_path / "plots" / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_run_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", steps=3, start_loss=3.0)
    run.chmod(0o555)
    try:
        assert main(["plot", str(run)]) == 2
    finally:
        run.chmod(0o755)
    assert one_line(capsys.readouterr().err) == f"tune: error: cannot write '{run / 'metrics.png'}': Permission denied"


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": ', '{"step": 3, "loss": 1.0}'],
         "line 2: not valid JSON (Expecting value"),
        (['{"step": 1, "loss": 2.0}', '[1, 2]', '{"step": 3, "loss": 1.0}'],
         "line 2: not a metrics record (a JSON object with a 'step' number): [1, 2]"),
        (['{"step": 1, "loss": 2.0}', '{"loss": 1.5}', '{"step": 3, "loss": 1.0}'],
         "line 2: not a metrics record (a JSON object with a 'step' number): {\"loss\": 1.5}"),
        (['{"step": 1, "loss": 2.0}', '{"step": "2", "loss": 1.5}', '{"step": 3, "loss": 1.0}'],
         "line 2: not a metrics record"),
    ],
    ids=["broken line", "a list", "no step", "step a string"],
)
def test_a_bad_line_is_named_by_its_number(tmp_path, capsys, lines, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["plot", str(run)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"tune: error: '{run / 'metrics.jsonl'}', {message}")


def test_a_line_that_is_not_utf8_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "note": "caf\xe9"}\n')
    assert main(["plot", str(run)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"tune: error: '{run / 'metrics.jsonl'}', line 2: not valid")


def test_only_blank_lines_is_no_records(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n  \n")
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert one_line(capsys.readouterr().err) == f"tune: error: '{tmp_path / 'run' / 'metrics.jsonl'}' has no records yet"


def test_nan_losses_are_reported_and_left_out_of_the_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = tmp_path / "run"
    run.mkdir()
    # As a diverged run writes them: json.dumps(float("nan")) is NaN.
    records = [{"step": s, "loss": loss} for s, loss in enumerate([3.0, 2.0, float("nan"), float("inf"), 1.0], 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "run: 3 steps (1-5); loss first 3.0000 last 1.0000 min 1.0000 (step 5); loss NaN or infinite at 2 steps "
        "(first: step 3)"
    )
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": NaN}\n')
    assert main(["plot", str(run)]) == 2
    assert one_line(capsys.readouterr().err) == (
        "tune: error: no run has a finite loss to plot: every loss recorded is NaN, infinite or not a number"
    )


def test_a_run_of_one_step_is_plotted(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "lr": 0.001}\n')
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run: 1 step (1-1); loss first 2.5000 last 2.5000 min 2.5000 (step 1)"
    assert (run / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)
