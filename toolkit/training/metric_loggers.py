"""Metric loggers: where a run's per-step metrics go besides ``metrics.jsonl`` (the console, TensorBoard, Weights &
Biases, MLflow), behind one small interface.

A config lists them by name, with options where the defaults do not do::

    metric_loggers:
      - {type: stdout, every_n_steps: 10}
      - tensorboard                               # events in <output_dir>/tensorboard
      - {type: wandb, project: my-project, mode: offline}
      - {type: mlflow, tracking_uri: "sqlite:///mlflow.db", experiment_name: my-experiment}

and :func:`build_metric_loggers_on_rank_zero` builds them on rank zero only. TensorBoard, W&B and MLflow are optional extras: their
packages are imported when such a logger is built, and a missing one is a :class:`~toolkit.errors.UserError` naming
the extra to install.

Building a logger checks everything it can (package, options, the W&B login, the MLflow tracking store) and writes
nothing into the output folder: each opens its files or its tracker run at its first record. A recipe builds them
before it claims the output folder, so that a bad entry stops the run with an old run there as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import numbers
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from toolkit.config import did_you_mean
from toolkit.errors import UserError
from toolkit.parallel.distributed import on_rank_zero
from toolkit.paths import install_command


@runtime_checkable
class MetricLogger(Protocol):
    """Receives each optimizer step's metrics (on rank zero only) and the run's config."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (a ``metrics.jsonl`` record; fields that are not numbers may be skipped)."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's resolved config (a plain nested dict)."""

    def close(self) -> None:
        """Flush and release everything; called once at the end of the run."""


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The fields of a record that a tracker can plot: real numbers, as floats, without ``step`` (the x axis)."""
    return {key: float(value) for key, value in metrics.items() if key != "step" and isinstance(value, numbers.Real)}


def _import_extra(module: str, extra: str) -> ModuleType:
    """Import an optional backend's package, or say which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"the {extra} metric logger needs the `{extra}` package ({e}); install it with "
            f"{install_command(extra)}"
        ) from e


def _format_value(value: float) -> str:
    if value.is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


class StdoutLogger:
    """One compact line per ``every_n_steps`` training steps on stdout, e.g. ``step 20  loss 1.234  lr 0.0003  ...``,
    and one per other record, such as ``step 25  val_loss 1.3``.

    Args:
        every_n_steps: print steps that are a multiple of this.
        keys: the fields to show, in this order, where a record has them (a record with none is not printed).
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 10,
        keys: Sequence[str] = (
            "epoch", "loss", "lr", "grad_norm", "tokens_per_second", "rank_peak_memory_gib_max", "val_loss",
        ),
    ) -> None:
        if every_n_steps < 1:
            raise UserError(f"stdout metric logger: every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.keys = tuple(keys)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if step % self.every_n_steps and "loss" in metrics:  # training steps every N; other records (validation) all
            return
        values = numeric_metrics(metrics)
        fields = [f"{key} {_format_value(values[key])}" for key in self.keys if key in values]
        if not fields:
            return
        # tqdm.write clears and redraws any progress bar around the line instead of breaking it.
        tqdm.write("  ".join([f"step {step}", *fields]), file=sys.stdout)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Nothing: the recipe saves the config as ``config.yaml`` in the output folder."""

    def close(self) -> None:
        sys.stdout.flush()


class TensorBoardLogger:
    """Scalars in TensorBoard event files (``tensorboard --logdir <log_dir>``); the config as a text summary.

    Args:
        log_dir: folder for the event files (default from the config: ``<output_dir>/tensorboard``).
        purge_step: when resuming, hide events at this step and later left by the attempt that died after its
            last checkpoint, as ``metrics.jsonl`` drops them (``MetricsLogger`` passes ``initial_step + 1``).
    """

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None) -> None:
        self._summary_writer = _import_extra("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.log_dir = Path(log_dir)
        self.purge_step = purge_step
        self._writer = None

    @property
    def writer(self):
        """The event file writer, created (with its folder) at the first record."""
        if self._writer is None:
            self._writer = self._summary_writer(log_dir=str(self.log_dir), purge_step=self.purge_step)
        return self._writer

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in numeric_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        # Indented by four spaces: TensorBoard renders text summaries as Markdown, and this keeps it a code block.
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


_WANDB_MODES = ("online", "offline", "disabled", "shared")


class WandBLogger:
    """A Weights & Biases run. ``mode: offline`` (or ``WANDB_MODE=offline``) writes it locally for ``wandb sync``.

    Args mirror ``wandb.init``'s: ``project``, ``entity``, ``name`` (default: the output folder's name), ``group``,
    ``tags``, ``notes``, ``mode`` (``online``/``offline``/``disabled``; default: ``WANDB_MODE`` or online),
    ``dir`` (default: the output folder; W&B writes ``<dir>/wandb/``), and ``id`` with ``resume`` (e.g.
    ``allow``) to continue the same W&B run after a resume.
    """

    def __init__(
        self,
        *,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        notes: str | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
        id: str | None = None,
        resume: str | None = None,
    ) -> None:
        if mode not in (None, *_WANDB_MODES):
            raise UserError(f"wandb metric logger: mode must be one of {', '.join(_WANDB_MODES)}, got '{mode}'")
        self._wandb = _import_extra("wandb", "wandb")
        self._settings = dict(
            project=project, entity=entity, name=name, group=group, tags=list(tags) if tags else None,
            notes=notes, mode=mode, dir=None if dir is None else str(dir), id=id, resume=resume,
        )
        self._run = None
        # The login wandb.init would ask for, asked now (from a terminal it prompts, elsewhere it fails), so that a
        # missing API key stops the run before it claims its output folder.
        if (mode or os.environ.get("WANDB_MODE") or "online") in ("online", "shared"):
            self._user_errors(lambda: self._wandb.login(verify=False))

    def _user_errors(self, call):
        try:
            return call()
        except self._wandb.errors.UsageError as e:  # not logged in, bad mode, ...
            raise UserError(f"wandb metric logger: {e} (or log offline: mode: offline, or WANDB_MODE=offline)") from e

    @property
    def run(self):
        """The W&B run, started (writing under ``dir``) at the first record."""
        if self._run is None:
            self._run = self._user_errors(lambda: self._wandb.init(**self._settings))
        return self._run

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(numeric_metrics(metrics), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


# MLflow accepts at most this many params in one log_batch call.
_MLFLOW_BATCH = 100


class MLflowLogger:
    """An MLflow run, through ``MlflowClient`` (no process-global active run).

    Args:
        tracking_uri: where runs are stored, e.g. ``sqlite:///mlflow.db``, ``http://host:5000``, or a local
            ``file:`` store (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for those); default:
            ``MLFLOW_TRACKING_URI`` or MLflow's own default.
        experiment_name: created if missing; default: MLflow's ``Default`` experiment.
        run_name: default: the output folder's name.
        tags: run tags.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        tracking = _import_extra("mlflow.tracking", "mlflow")
        self._entities = importlib.import_module("mlflow.entities")
        mlflow_error = importlib.import_module("mlflow.exceptions").MlflowException
        # The tracking store is reached now (a wrong URI stops the run before it claims its output folder); the run
        # itself is created at the first record.
        name = experiment_name or "Default"
        try:
            self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
            with _mlflow_asked_once():
                experiment = self.client.get_experiment_by_name(name)
                self._experiment_id = (
                    experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
                )
        except mlflow_error as e:
            where = f"tracking_uri {tracking_uri!r}: " if tracking_uri else ""
            raise UserError(f"mlflow metric logger: {where}{_first_line(e)}") from e
        self._run_name = run_name
        self._tags = dict(tags or {})
        self._run_id: str | None = None

    @property
    def run_id(self) -> str:
        """The MLflow run's id; the run is created at the first record."""
        if self._run_id is None:
            run = self.client.create_run(self._experiment_id, run_name=self._run_name, tags=self._tags)
            self._run_id = run.info.run_id
        return self._run_id

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        timestamp_ms = int(time.time() * 1000)
        values = numeric_metrics(metrics)
        batch = [self._entities.Metric(key, value, timestamp_ms, step) for key, value in values.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [self._entities.Param(key, str(value)) for key, value in _flatten(config).items()]
        for start in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + _MLFLOW_BATCH])

    def close(self) -> None:
        if self._run_id is not None:
            self.client.set_terminated(self._run_id)


# A tracking server is asked these few times, this many seconds each, when the logger is built: MLflow's own defaults
# (7 retries with exponential backoff, 120 s timeouts) keep a run with a mistyped or unreachable http URI waiting
# for minutes before it says so. Later requests, mid-run, keep MLflow's patient defaults (or the user's settings).
_MLFLOW_FIRST_CONTACT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


@contextlib.contextmanager
def _mlflow_asked_once() -> Iterator[None]:
    """MLflow's HTTP retries and timeout cut to :data:`_MLFLOW_FIRST_CONTACT` inside the block, where the user has
    not set them (MLflow reads them at every request)."""
    added = [name for name in _MLFLOW_FIRST_CONTACT if name not in os.environ]
    os.environ.update({name: _MLFLOW_FIRST_CONTACT[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 1e-3}}`` -> ``{"optimizer.lr": 1e-3}`` (MLflow params are flat strings)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


_BACKENDS: dict[str, type] = {
    "stdout": StdoutLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandBLogger,
    "mlflow": MLflowLogger,
}

MetricLoggerSpec = str | Mapping[str, Any]


def _run_defaults(kind: str, output_dir: Path, initial_step: int) -> dict[str, Any]:
    """Options each backend takes from the run unless the config sets them."""
    if kind == "tensorboard":
        return {"log_dir": output_dir / "tensorboard", "purge_step": initial_step + 1 if initial_step else None}
    if kind == "wandb":
        return {"dir": output_dir, "name": output_dir.name}
    if kind == "mlflow":
        return {"run_name": output_dir.name}
    return {}


def parse_metric_logger_spec(spec: MetricLoggerSpec) -> tuple[str, dict[str, Any]]:
    """Check one ``metric_loggers`` entry without importing any backend.

    Returns:
        The backend name and its options.

    Raises:
        UserError: for an unknown type or an option the backend does not take.
    """
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if isinstance(spec, str):
        kind, options = spec, {}
    elif isinstance(spec, Mapping) and "type" in spec:
        options = {str(key): value for key, value in spec.items() if key != "type"}
        kind = str(spec["type"])
    else:
        raise UserError(f"metric_loggers: expected a logger name or a mapping with a `type` key, got {spec!r}")
    if kind not in _BACKENDS:
        raise UserError(
            f"metric_loggers: unknown type '{kind}'{did_you_mean(kind, _BACKENDS)}; choose from {', '.join(_BACKENDS)}"
        )
    accepted = list(inspect.signature(_BACKENDS[kind]).parameters)
    for key in options:
        if key not in accepted:
            raise UserError(
                f"metric_loggers: '{key}' is not an option of the {kind} logger{did_you_mean(key, accepted)}; "
                f"options: {', '.join(accepted)}"
            )
    return kind, options


def build_metric_loggers(
    specs: Sequence[MetricLoggerSpec | MetricLogger], *, output_dir: str | Path, initial_step: int = 0
) -> list[MetricLogger]:
    """Build the loggers a config's ``metric_loggers`` list names, in this process; nothing is written until their
    first record.

    Args:
        specs: entries like ``"tensorboard"`` or ``{"type": "wandb", "project": "x", "mode": "offline"}``;
            a logger already built is kept as it is.
        output_dir: the run's output folder, for the backends' default locations and names.
        initial_step: steps already done when resuming (TensorBoard hides the later events of the last attempt).

    Raises:
        UserError: for a bad entry or a backend whose package is missing; loggers built before it are closed.
    """
    loggers: list[MetricLogger] = []
    try:
        for spec in specs:
            if isinstance(spec, (str, Mapping)):
                kind, options = parse_metric_logger_spec(spec)
                defaults = _run_defaults(kind, Path(output_dir), initial_step)
                loggers.append(_BACKENDS[kind](**{**defaults, **options}))
            else:
                loggers.append(spec)
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers


def build_metric_loggers_on_rank_zero(
    specs: Sequence[MetricLoggerSpec], *, output_dir: str | Path, initial_step: int = 0
) -> list[MetricLogger]:
    """A run's loggers (see :func:`build_metric_loggers`), built on rank zero; the other ranks check the entries
    and get none. A collective under a process group: a failure on rank zero (a package missing, W&B not logged
    in) is raised on every rank, so none is left waiting for it.

    Raises:
        UserError: as :func:`build_metric_loggers`.
    """
    for spec in specs:
        parse_metric_logger_spec(spec)
    loggers: list[MetricLogger] = []
    on_rank_zero(lambda: loggers.extend(build_metric_loggers(specs, output_dir=output_dir, initial_step=initial_step)))
    return loggers
