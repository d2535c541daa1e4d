"""Rank-zero metrics: one JSON object per optimizer step in ``metrics.jsonl``, a loss line every few steps and a
progress bar on the terminal, and optional metric loggers (stdout, TensorBoard, W&B, MLflow: see
:mod:`toolkit.training.metric_loggers`)."""

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from toolkit.training.metric_loggers import (
    MetricLogger,
    MetricLoggerSpec,
    StdoutLogger,
    build_metric_loggers,
    parse_metric_logger_spec,
)
from toolkit.training.step import StepResult


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl``, prints a loss line every ``log_every_n_steps`` steps, drives a tqdm
    bar and feeds the metric loggers; does nothing on ranks other than zero.

    ``metrics.jsonl`` fields ``step``, ``loss``, ``lr``, ``num_tokens`` and ``tokens_per_second`` are a contract
    that plotting and comparison tools rely on: add fields freely, never rename these. The file is always written,
    whatever the loggers.

    The loss lines (``step 20/200  loss 1.2345  lr 3.00e-04  grad_norm 0.81  tok/s 5120  elapsed 1m02s  eta 9m18s
    peak 3.1GiB``, and ``step 100/200  val_loss 1.3021`` for a validation record) go to stdout, plain, so a log file
    or a pipe (a Slurm or nohup job, which never sees the bar) reads as well as the terminal; a ``stdout`` metric
    logger, if configured, prints them instead. Their clock is the bar's: elapsed from the start of this attempt's
    first step, the time left its remaining steps at their mean time so far (a resumed run counts only its own
    steps); each training record gets that ``elapsed_s``. The bar goes to stderr, and only
    when stderr is a terminal with room for it: elsewhere its redrawn frames would pile up as ``\r``-joined text.
    It appears with the first training step, its clock started when that step did, so its rate and time left
    measure training alone (not the model load or an evaluation before it).

    Args:
        output_dir: the run's output folder.
        enabled: True on rank zero.
        total_steps: optimizer steps in the run (the bar's length).
        initial_step: steps already done (when resuming): lines of later steps, logged by the attempt that died
            after the checkpoint, are dropped so that every step appears once.
        progress_bar: show the bar on a terminal (off in tests or when stderr is not wanted).
        log_every_n_steps: print the loss line of every step that is a multiple of this, and of the last step.
        loggers: more destinations for every record: a config's ``metric_loggers`` entries (``"tensorboard"``,
            ``{"type": "wandb", "mode": "offline"}``, ...), built on rank zero only, or loggers already built.
            Entries are checked on every rank, so a typo stops all ranks with the same message.
        clock: seconds, monotonic, for the lines' elapsed time and time left (a test's fake clock).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        initial_step: int = 0,
        progress_bar: bool = True,
        log_every_n_steps: int = 1,
        loggers: Sequence[MetricLogger | MetricLoggerSpec] | None = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every_n_steps = log_every_n_steps
        self._file = None
        self._bar: tqdm | None = None
        self._show_bar = False
        self._print_lines = False
        self._loggers: list[MetricLogger] = []
        self._clock = clock
        self._train_start: float | None = None  # when this attempt's first step started
        self._first_step = 0
        loggers = list(loggers or ())
        for spec in loggers:
            if isinstance(spec, (str, Mapping)):
                parse_metric_logger_spec(spec)
        if not enabled:
            return
        # Before metrics.jsonl is touched: a missing package stops the run with the output folder as it was.
        self._loggers = build_metric_loggers(loggers, output_dir=output_dir, initial_step=initial_step)
        path = Path(output_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _truncate_after_step(path, initial_step)
        self._file = path.open("a", encoding="utf-8")
        self._show_bar = progress_bar and _is_wide_terminal(sys.stderr)
        self._print_lines = not any(isinstance(logger, StdoutLogger) for logger in self._loggers)

    def log(self, metrics: dict[str, Any]) -> None:
        """Append a record to ``metrics.jsonl`` and pass it to the loggers; a training step's record (one with
        ``loss``) also advances the bar, and prints its line on the steps due. Other records, such as
        ``{"step": 100, "val_loss": ...}`` from a validation pass, need only ``step``; their line is always
        printed."""
        if not self.enabled:
            return
        training = "loss" in metrics
        if training:
            metrics = {**metrics, "elapsed_s": self._elapsed(metrics)}
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        step = int(metrics["step"])
        for logger in self._loggers:
            logger.log(metrics, step=step)
        if training and self._show_bar:
            self._advance_bar(metrics)
        if self._print_lines and (not training or step % self.log_every_n_steps == 0 or step == self.total_steps):
            line = _loss_line(metrics, total_steps=self.total_steps)
            if line is not None:
                self.print(line + (self._timing(metrics) if training else ""))

    def _elapsed(self, metrics: Mapping[str, Any]) -> float:
        """Seconds since this attempt's first step started: the first record moves the clock back by that step's
        own time (its data wait and its step), as the bar does, so the model load before it is not counted."""
        now = self._clock()
        if self._train_start is None:
            self._train_start = now - metrics.get("step_time_s", 0.0) - (metrics.get("data_wait_s") or 0.0)
            self._first_step = int(metrics["step"])
        return now - self._train_start

    def _timing(self, metrics: Mapping[str, Any]) -> str:
        """``  elapsed 1m02s  eta 9m18s  peak 3.1GiB`` for a training record: the time left is the remaining steps
        at this attempt's mean step time; the peak memory the largest over ranks, which the records of the steps
        whose line is printed gather (the recipes gather every ``log_every_n_steps`` steps and at the last)."""
        step, elapsed = int(metrics["step"]), metrics["elapsed_s"]
        mean = elapsed / (step - self._first_step + 1)
        parts = [f"elapsed {format_duration(elapsed)}", f"eta {format_duration(mean * (self.total_steps - step))}"]
        peak = metrics.get("rank_peak_memory_gib_max")
        if peak is not None:
            parts.append(f"peak {peak:.1f}GiB")
        return "".join(f"  {part}" for part in parts)

    def _advance_bar(self, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=self.total_steps, initial=int(metrics["step"]) - 1, desc="train", dynamic_ncols=True,
                file=sys.stderr,
            )
            # Created as the first step ends: moving its clock back to when that step started times the first step
            # too, so the first rate is one step over its own duration.
            first_step_s = metrics.get("step_time_s", 0.0) + (metrics.get("data_wait_s") or 0.0)
            self._bar.start_t -= first_step_s
            self._bar.last_print_t = self._bar.start_t
        self._bar.update(1)
        postfix = {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics['lr']:.2e}",
                   "tok_s": f"{metrics['tokens_per_second']:.0f}"}
        if "mfu" in metrics:
            postfix["mfu"] = f"{metrics['mfu']:.1%}"
        self._bar.set_postfix(postfix, refresh=False)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Give the loggers the run's config (a ``DictConfig`` is resolved to plain values first)."""
        if not self.enabled or not self._loggers:
            return
        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
        for logger in self._loggers:
            logger.log_config(config)

    def print(self, message: str) -> None:
        """Print a line on rank zero (stdout, flushed: a log file shows it at once) without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)  # clears the bar, prints the line, redraws the bar below it
            sys.stdout.flush()
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Close the bar, ``metrics.jsonl`` and the loggers (W&B and MLflow mark their runs finished)."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        loggers, self._loggers = self._loggers, []
        for logger in loggers:
            logger.close()


# The fields of a loss line, in order, with their labels and formats.
_LINE_FIELDS = (
    ("loss", "loss", ".4f"),
    ("lr", "lr", ".2e"),
    ("grad_norm", "grad_norm", ".4g"),
    ("tokens_per_second", "tok/s", ".0f"),
    ("reward_accuracy", "reward_acc", ".3f"),  # preference objectives: pairs whose chosen answer out-rewards
    ("reward_margin", "margin", ".4f"),  # the rejected one, and the mean of their difference (KTO: of the means)
    ("rewards_desirable", "r_desirable", ".4f"),  # KTO: the mean reward of each kind of answer
    ("rewards_undesirable", "r_undesirable", ".4f"),
    ("reward_mean", "reward", ".3f"),  # online RL: the completions' mean reward, the verifier's share of right ones,
    ("accuracy", "acc", ".3f"),  # their mean length and the rollouts' generation speed
    ("completion_len_mean", "len", ".1f"),
    ("generation_tokens_per_second", "gen tok/s", ".0f"),
    ("val_loss", "val_loss", ".4f"),
    ("val_reward_mean", "val_reward", ".3f"),
    ("val_accuracy", "val_acc", ".3f"),
)


def _loss_line(metrics: Mapping[str, Any], *, total_steps: int) -> str | None:
    """``step 20/200  loss 1.2345  lr 3.00e-04 ...`` for a record, or None if it has none of the line's fields."""
    fields = [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in _LINE_FIELDS if metrics.get(key) is not None]
    if not fields:
        return None
    return "  ".join([f"step {int(metrics['step'])}/{total_steps}", *fields])


def format_duration(seconds: float) -> str:
    """``0m21s``, ``9m18s``, ``2h05m``: compact, and never longer than 6 characters below 100 hours."""
    seconds = max(0, round(seconds)) if math.isfinite(seconds) else 0
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Progress of a long pass on rank zero (generating held-out answers, scoring a held-out set): a tqdm bar on
    stderr where that is a terminal, otherwise a plain line on stdout (``eval 40/200 answers, 0m21s``) as the count
    crosses each tenth of the total or ``every_s`` seconds after the last line, whichever comes first, but never
    sooner than ``min_gap_s`` after the start or the last line: a pass of a few seconds prints nothing, and no pass
    floods a log. Close it when the pass ends (``contextlib.closing``); other ranks pass ``enabled=False``.

    Args:
        total: the pass's units (answers, batches).
        label: what the pass is (``eval``).
        unit: what it counts (``answers``).
        enabled: True on rank zero.
        every_s, min_gap_s: the longest and shortest time between plain lines.
        clock: seconds, monotonic (a test's fake clock).
    """

    def __init__(
        self,
        total: int,
        *,
        label: str,
        unit: str,
        enabled: bool = True,
        every_s: float = 60.0,
        min_gap_s: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total, self.label, self.unit = total, label, unit
        self.done = 0
        self.every_s, self.min_gap_s, self._clock = every_s, min_gap_s, clock
        self.enabled = enabled and total > 0
        self._start = self._last = clock()
        self._tenths = 0
        self._bar: tqdm | None = None
        if self.enabled and _is_wide_terminal(sys.stderr):
            self._bar = tqdm(total=total, desc=label, unit=f" {unit}", leave=False, dynamic_ncols=True,
                             file=sys.stderr)

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done (at most the total)."""
        if not self.enabled:
            return
        n = min(n, self.total - self.done)
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self._clock()
        tenths = self.done * 10 // self.total
        due = tenths > self._tenths or now - self._last >= self.every_s
        if due and now - self._last >= self.min_gap_s and self.done < self.total:  # the caller reports the end
            print(f"{self.label} {self.done}/{self.total} {self.unit}, {format_duration(now - self._start)}",
                  flush=True)
            self._last, self._tenths = now, tenths

    def close(self) -> None:
        """Clear the bar (the caller prints the pass's result)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_wide_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal with columns to draw a bar in (a terminal of zero columns, as some
    containers and CI runners report, would show nothing but the redraws)."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):  # a terminal-like stream without a descriptor: trust isatty
        return True


def _truncate_after_step(path: Path, step: int) -> None:
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if _line_step(line) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def _line_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return float("inf")  # a line cut short by the crash


def step_metrics(
    *,
    step: int,
    epoch: int,
    result: StepResult,
    lr: float | torch.Tensor,
    grad_norm: float | None,
    elapsed_s: float,
    device: torch.device,
    gather_rank_stats: bool,
    data_wait_s: float | None = None,
    forward_backward_s: float | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """The ``metrics.jsonl`` record of one optimizer step.

    With ``gather_rank_stats`` (a collective: every rank must ask on the same steps) it adds each rank's step
    time, throughput and peak memory as min/max over ranks and the slowest rank, so a straggler shows. With
    ``flops_per_token`` and the device's ``peak_flops`` (``toolkit.training.profiling``) it adds ``mfu``: this
    rank's positions per second times the model FLOPs per position, over the device's peak.

    The step time splits into ``forward_backward_s`` (forward and backward of every micro-batch, gradient
    reduction included; it ends with the loss on the host, so on a GPU it is device time) and ``optimizer_s`` (the
    rest of ``step_time_s``: clipping, the optimizer and the schedule); ``data_wait_s`` is the time spent waiting
    for the step's micro-batches before it (not part of ``step_time_s``).
    """
    metrics = {
        "step": step,
        "epoch": epoch,
        "loss": result.loss,
        "lr": float(lr),  # torchao's optimizers keep the learning rate in a tensor
        "grad_norm": grad_norm,  # None (null) with the step inside backward: no step holds every gradient
        "num_tokens": result.num_tokens,
        "tokens_per_second": result.num_tokens / elapsed_s,
        "step_time_s": elapsed_s,
        **result.metrics,
    }
    if forward_backward_s is not None:
        metrics["forward_backward_s"] = forward_backward_s
        metrics["optimizer_s"] = elapsed_s - forward_backward_s
    if data_wait_s is not None:
        metrics["data_wait_s"] = data_wait_s
    if flops_per_token and peak_flops:
        metrics["mfu"] = result.num_positions / elapsed_s * flops_per_token / peak_flops
    if gather_rank_stats:
        metrics.update(
            rank_stats(
                {
                    "rank_step_time_s": elapsed_s,
                    "rank_positions_per_second": result.num_positions / elapsed_s,
                    "rank_peak_memory_gib": peak_memory_gib(device),
                    **({"rank_data_wait_s": data_wait_s} if data_wait_s is not None else {}),
                }
            )
        )
    return metrics


def rank_stats(stats: dict[str, float]) -> dict[str, float]:
    """Gather per-rank figures and summarize them as ``<name>_min``, ``<name>_max`` and, for the first figure,
    the index of the rank with the largest value (``slowest_rank`` when it is a step time), so a straggler shows.

    Every rank must call this with the same keys (it is a collective).
    """
    values = torch.tensor(list(stats.values()), dtype=torch.float64)
    if dist.is_initialized():
        # NCCL gathers GPU tensors only: inputs and outputs both live on this rank's GPU there.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
        values = values.to(device)
        gathered = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)
        table = torch.stack(gathered).cpu()  # [world, n_stats]
    else:
        table = values[None]
    out: dict[str, float] = {}
    for j, name in enumerate(stats):
        out[f"{name}_min"] = float(table[:, j].min())
        out[f"{name}_max"] = float(table[:, j].max())
    out["slowest_rank"] = int(table[:, 0].argmax())
    return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident host memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
