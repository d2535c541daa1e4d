"""``tune plot``: plot one or more runs' ``metrics.jsonl`` against the step, runs overlaid, as a PNG."""

from __future__ import annotations

import argparse
import importlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Panels drawn when --metrics is not given; those that no run has are left out.
DEFAULT_METRICS = ("loss", "lr", "tokens_per_second", "peak_memory_gib")

# A panel's field, or the fields standing in for it where a run's records lack it. metrics.jsonl has the peak
# memory of each rank only as min/max over ranks, every log_every_n_steps steps: the max is the one that matters.
_FALLBACKS = {"peak_memory_gib": ("peak_memory_gib", "rank_peak_memory_gib_max")}

_TITLES = {
    "loss": "loss",
    "val_loss": "validation loss",
    "lr": "learning rate",
    "tokens_per_second": "tokens/s",
    "peak_memory_gib": "peak memory (GiB, max over ranks)",
}

_INSTALL_HINT = 'for the PNG, install matplotlib: pip install "tunekit[plot]"'


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl``, skipping a last line cut short by a crash.

    Raises:
        UserError: when the folder or its metrics.jsonl is missing, or the file has no record.
    """
    if not run_dir.is_dir():
        raise UserError(f"no such run folder: '{run_dir}'")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl: is it a run's output_dir?")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
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
    """Legend labels: folder names, or the paths as given where two runs share a folder name."""
    names = [d.name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], metrics: Sequence[str]) -> Figure:
    """A figure with one panel per metric (against the step), each run a line labelled with its name.

    The ``loss`` panel also draws ``val_loss``, dashed with markers, where a run has validation records.
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
            if metric == "loss":
                steps, values = series(records, "val_loss")
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
    """One line about a run: steps, first/last/min loss, mean tokens/s and the last validation loss."""
    steps, losses = series(records, "loss")
    parts = [f"{label}: {len(steps)} steps"]
    if steps:
        low = min(range(len(losses)), key=losses.__getitem__)
        parts[0] += f" ({steps[0]}-{steps[-1]})"
        parts.append(f"loss first {losses[0]:.4f} last {losses[-1]:.4f} min {losses[low]:.4f} (step {steps[low]})")
    _, throughput = series(records, "tokens_per_second")
    if throughput:
        parts.append(f"mean tokens/s {sum(throughput) / len(throughput):.0f}")
    val_steps, val_losses = series(records, "val_loss")
    if val_steps:
        parts.append(f"val_loss last {val_losses[-1]:.4f} (step {val_steps[-1]})")
    return "; ".join(parts)


def _panels(runs: Mapping[str, Sequence[Mapping[str, Any]]], requested: Sequence[str] | None) -> list[str]:
    """The metrics to draw: those asked for (each must exist in some run), or the defaults that exist."""
    present = [m for m in (requested or DEFAULT_METRICS) if any(series(r, m)[0] for r in runs.values())]
    # Asked-for metrics must exist; of the defaults, loss (a field of every record, by contract) must.
    missing = [m for m in requested or ("loss",) if m not in present]
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
        print(_INSTALL_HINT)
        return 0
    output = Path(args.output)
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


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune plot`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "plot",
        help="plot runs' metrics.jsonl (loss, learning rate, tokens/s, memory) as a PNG",
        description=(
            "Draw loss (and validation loss where recorded), learning rate, tokens/s and peak memory against the "
            "step for one or more runs, overlaid, e.g. tune plot outputs/run_a outputs/run_b --output cmp.png. "
            "Without matplotlib (the `plot` extra) it prints the per-run summary only."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", metavar="OUTPUT_DIR", help="a run's output_dir (has metrics.jsonl)")
    parser.add_argument(
        "--output", "-o", default="metrics.png", metavar="FILE",
        help="image to write: a PNG, unless its suffix names another format, e.g. .svg or .pdf (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        metavar="FIELD",
        help=f"metrics.jsonl fields to plot, one panel each (default: {' '.join(DEFAULT_METRICS)})",
    )
    parser.set_defaults(handler=plot)
