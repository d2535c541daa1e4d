"""``tune plot``: plot one or more runs' ``metrics.jsonl`` against the step, runs overlaid, as a PNG."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError
from toolkit.paths import install_command

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Panels drawn when --metrics is not given; those that no run has are left out (the preference recipe's rewards).
DEFAULT_METRICS = ("loss", "lr", "tokens_per_second", "peak_memory_gib", "reward_accuracy", "reward_margin")

# A panel's field, or the fields standing in for it where a run's records lack it. metrics.jsonl has the peak
# memory of each rank only as min/max over ranks, every log_every_n_steps steps: the max is the one that matters.
_FALLBACKS = {"peak_memory_gib": ("peak_memory_gib", "rank_peak_memory_gib_max")}

_TITLES = {
    "loss": "loss",
    "val_loss": "validation loss",
    "lr": "learning rate",
    "tokens_per_second": "tokens/s",
    "peak_memory_gib": "peak memory (GiB, max over ranks)",
    "reward_accuracy": "reward accuracy (chosen over rejected)",
    "reward_margin": "reward margin (chosen - rejected)",
}


def metrics_file(run: Path) -> Path:
    """The ``metrics.jsonl`` of the run folder ``run``, or ``run`` itself where it names the file.

    Raises:
        UserError: when the folder or its metrics.jsonl is missing.
    """
    if run.is_file():
        return run
    if not run.is_dir():
        raise UserError(f"no such run folder: '{run}'")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"'{run}' has no metrics.jsonl: is it a run's output_dir?")
    return path


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (``run`` is its folder or the file), skipping a last line cut
    short by a crash or still being written.

    Raises:
        UserError: when the file is missing or unreadable, has no record, or a line (named) is not a record.
    """
    path = metrics_file(run)
    records = []
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as e:  # ValueError: also bytes that are not UTF-8
                    # Only the last line lacks its newline: the run writes one record at a time, newline last.
                    if not line.endswith(b"\n"):
                        break
                    raise UserError(f"'{path}', line {number}: not valid JSON ({e})") from None
                if not isinstance(record, dict) or not _is_number(record.get("step")):
                    raise UserError(
                        f"'{path}', line {number}: not a metrics record (a JSON object with a 'step' number): "
                        f"{line.decode('utf-8', errors='replace').strip():.80}"
                    )
                records.append(record)
    except OSError as e:
        raise UserError(f"cannot read '{path}': {e.strerror or e}") from None
    if not records:
        raise UserError(f"'{path}' has no records yet")
    return records


def series(records: Sequence[Mapping[str, Any]], metric: str) -> tuple[list[float], list[float]]:
    """Steps and values of ``metric`` (or of its stand-in, see ``_FALLBACKS``) over the records that have it."""
    for key in _FALLBACKS.get(metric, (metric,)):
        points = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
        if points:
            return [s for s, _ in points], [v for _, v in points]
    return [], []


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Legend labels: folder names, or the paths as given where two runs share a folder name (a run given by its
    metrics.jsonl is named by the folder holding it)."""
    run_dirs = [d.parent if d.name == "metrics.jsonl" and d.is_file() else d for d in run_dirs]
    names = [d.name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], metrics: Sequence[str]) -> Figure:
    """A figure with one panel per metric (against the step), each run a line labelled with its name.

    Each panel also draws its held-out counterpart (``val_loss`` on the ``loss`` panel, ``val_reward_accuracy``
    on ``reward_accuracy``...), dashed with markers, where a run has validation records.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 1 if len(metrics) == 1 else 2
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(6.5 * ncols, 3.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot, no display: the Agg canvas renders the PNG
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, metric in zip(axes, metrics):
        for color, (label, records) in zip(colors, runs.items()):
            steps, values = series(records, metric)
            if steps:
                ax.plot(steps, values, color=color, label=label, marker="." if len(steps) == 1 else None)
            steps, values = series(records, f"val_{metric}")
            if steps:
                ax.plot(steps, values, color=color, linestyle="--", marker="o", label=f"{label} (validation)")
        ax.set_title(_TITLES.get(metric, metric))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")  # one legend: a run has the same color in every panel
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    return fig


def summary(label: str, records: Sequence[Mapping[str, Any]]) -> str:
    """One line about a run: steps, first/last/min loss, steps whose loss was not finite, mean tokens/s and the
    last validation loss."""
    steps, losses = series(records, "loss")
    parts = [f"{label}: {len(steps)} step{'' if len(steps) == 1 else 's'}"]
    if steps:
        low = min(range(len(losses)), key=losses.__getitem__)
        parts[0] += f" ({steps[0]}-{steps[-1]})"
        parts.append(f"loss first {losses[0]:.4f} last {losses[-1]:.4f} min {losses[low]:.4f} (step {steps[low]})")
    # A diverged run logs NaN (json writes it as NaN): left out of the lines drawn, so said here.
    diverged = _not_finite_steps(records, "loss")
    if diverged:
        parts.append(f"loss NaN or infinite at {len(diverged)} step{'' if len(diverged) == 1 else 's'} "
                     f"(first: step {diverged[0]})")
    _, throughput = series(records, "tokens_per_second")
    if throughput:
        parts.append(f"mean tokens/s {sum(throughput) / len(throughput):.0f}")
    val_steps, val_losses = series(records, "val_loss")
    if val_steps:
        parts.append(f"val_loss last {val_losses[-1]:.4f} (step {val_steps[-1]})")
    for name in ("reward_accuracy", "val_reward_accuracy"):  # preference runs
        steps_, values = series(records, name)
        if steps_:
            parts.append(f"{name} last {values[-1]:.1%} (step {steps_[-1]})")
    return "; ".join(parts)


def _not_finite_steps(records: Sequence[Mapping[str, Any]], metric: str) -> list[float]:
    return [r["step"] for r in records if isinstance(r.get(metric), float) and not math.isfinite(r[metric])]


def _panels(runs: Mapping[str, Sequence[Mapping[str, Any]]], requested: Sequence[str] | None) -> list[str]:
    """The metrics to draw: those asked for (each must exist in some run), or the defaults that exist."""
    present = [m for m in (requested or DEFAULT_METRICS) if any(series(r, m)[0] for r in runs.values())]
    # Asked-for metrics must exist; of the defaults, loss (a field of every record, by contract) must.
    missing = [m for m in requested or ("loss",) if m not in present]
    for metric in missing:
        if any(metric in r for records in runs.values() for r in records):
            raise UserError(
                f"no run has a finite {metric} to plot: every {metric} recorded is NaN, infinite or not a number"
            )
    if missing:
        fields = sorted({k for records in runs.values() for r in records for k, v in r.items() if _is_number(v)})
        raise UserError(f"no run has {', '.join(missing)} to plot; the fields are: {', '.join(fields)}")
    return present


def plot(args: argparse.Namespace) -> int:
    """Run ``tune plot``: print a summary line per run, then write the PNG (or say how to get one)."""
    run_dirs = [Path(d) for d in args.run_dirs]
    runs = dict(zip(run_labels(run_dirs), (read_metrics(d) for d in run_dirs)))
    metrics = _panels(runs, args.metrics)
    for label, records in runs.items():
        print(summary(label, records))
    try:
        importlib.import_module("matplotlib")  # here, not at the top: the other commands do not need it
    except ImportError:
        print(f"for the PNG, install matplotlib: {install_command('plot')}")
        return 0
    output = _output_path(args.output, run_dirs)
    # The suffix names the format (runs.svg, runs.pdf); a name without one is a PNG at exactly that path, where
    # matplotlib alone would add ".png" to it.
    image_format = output.suffix[1:].lower() or "png"
    formats = importlib.import_module("matplotlib.backend_bases").FigureCanvasBase.get_supported_filetypes()
    if image_format not in formats:
        choices = ", ".join(sorted(formats))
        raise UserError(f"cannot write '{output}': no image format '{image_format}'; choose from {choices}")
    figure = plot_runs(runs, metrics)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output, dpi=120, format=image_format)
    except OSError as e:
        raise UserError(f"cannot write '{output}': {e.strerror or e}") from None
    print(f"wrote {output}")
    return 0


def _output_path(output: str | None, run_dirs: Sequence[Path]) -> Path:
    """Where the image goes: ``output`` as given; by default beside the (first) run's metrics.jsonl, named
    ``metrics.png`` for one run and ``compare.png`` for several; an existing folder (or a path ending in a
    separator) gets that name inside it."""
    name = "metrics.png" if len(run_dirs) == 1 else "compare.png"
    if output is None:
        return metrics_file(run_dirs[0]).parent / name
    if output.endswith(("/", os.sep)) or Path(output).is_dir():
        return Path(output) / name
    return Path(output)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune plot`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "plot",
        help="plot runs' metrics.jsonl (loss, learning rate, tokens/s, memory) as a PNG",
        description=(
            "Draw loss (and validation loss where recorded), learning rate, tokens/s and peak memory against the\n"
            "step for one or more runs, overlaid. Without matplotlib (the `plot` extra) it prints the per-run\n"
            "summary only."
        ),
        epilog="examples:\n  tune plot outputs/full_finetune_demo outputs/lora_finetune_demo --output runs.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="OUTPUT_DIR", help="a run's output_dir (has metrics.jsonl), or the file itself"
    )
    parser.add_argument(
        "--output", "-o", metavar="FILE",
        help="image to write: a PNG, unless its suffix names another format, e.g. .svg or .pdf; a folder gets "
        "the default name in it (default: metrics.png beside the run's metrics.jsonl; compare.png beside the first "
        "run's when there are several)",
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        metavar="FIELD",
        help=f"metrics.jsonl fields to plot, one panel each (default: {' '.join(DEFAULT_METRICS)})",
    )
    parser.set_defaults(handler=plot)
