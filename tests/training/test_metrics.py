"""What rank zero shows while training: a plain loss line every few steps, and a progress bar on a terminal only,
whose clock starts with training."""

import contextlib
import io
import json
import os
import re
import sys

import pytest
import tqdm.std

from tests.launch import run_tune
from toolkit.training.metric_loggers import StdoutLogger
from toolkit.training.metrics import MetricsLogger, Progress, format_duration


def record(step: int, *, step_time_s: float = 0.5, grad_norm: float | None = 0.8125,
           peak_memory_gib: float | None = None) -> dict:
    """A training step's metrics.jsonl record, as step_metrics makes it (with every rank's peak memory gathered on
    the steps that ask for it: the largest ``peak_memory_gib``)."""
    out = {"step": step, "epoch": 0, "loss": 2.0 / step, "lr": 3e-4, "grad_norm": grad_norm, "num_tokens": 512,
           "tokens_per_second": 1024.4, "step_time_s": step_time_s, "data_wait_s": 0.25}
    if peak_memory_gib is not None:
        out.update(rank_peak_memory_gib_min=1.0, rank_peak_memory_gib_max=peak_memory_gib)
    return out


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal (and has no descriptor, like pytest's captured streams)."""

    def isatty(self) -> bool:
        return True


def test_piped_output_gets_a_loss_line_every_n_steps_and_no_bar(tmp_path, capsys):
    # Under pytest, stdout and stderr are not terminals: what a log file or a pipe would get.
    now = [100.0]
    log = MetricsLogger(tmp_path, enabled=True, total_steps=5, progress_bar=True, log_every_n_steps=2,
                        clock=lambda: now[0])
    log.print("0.90M parameters")
    for step in range(1, 6):
        now[0] += 30.0 if step == 1 else 25.0  # the set-up, then the first step's 0.75 s; then 25 s a step
        gathered = {2: 3.14, 4: 3.14, 5: 7.5}.get(step)  # the steps whose line is due gather every rank's peak
        log.log(record(step, grad_norm=None if step == 4 else 0.8125, peak_memory_gib=gathered))
        if step == 4:
            log.log({"step": 4, "val_loss": 1.23456, "val_perplexity": 3.4, "val_tokens": 100})
    log.close()
    out, err = capsys.readouterr()
    # Elapsed from the first step's start (its record's time less its 0.75 s); the time left at the mean step time.
    assert out.splitlines() == [
        "0.90M parameters",
        "step 2/5  loss 1.0000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024  elapsed 0m26s  eta 0m39s  peak 3.1GiB",
        # no grad norm (the step ran inside backward)
        "step 4/5  loss 0.5000  lr 3.00e-04  tok/s 1024  elapsed 1m16s  eta 0m19s  peak 3.1GiB",
        "step 4/5  val_loss 1.2346",  # validation: whenever it runs
        # the last step, though not due
        "step 5/5  loss 0.4000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024  elapsed 1m41s  eta 0m00s  peak 7.5GiB",
    ]
    assert err == ""  # no bar frames, no "\r"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    assert [r.get("elapsed_s") for r in records] == [pytest.approx(v) for v in (0.75, 25.75, 50.75, 75.75)] + [
        None, pytest.approx(100.75)]


def test_a_resumed_run_counts_the_time_left_from_its_own_steps(tmp_path, capsys):
    # Resumed at step 100 of 200: 4 s a step in this attempt; steps before it (and the load) are not timed.
    now = [0.0]
    log = MetricsLogger(tmp_path, enabled=True, total_steps=200, initial_step=100, log_every_n_steps=10,
                        clock=lambda: now[0])
    now[0] = 900.0  # loading and resuming: not training time
    for step in range(101, 111):
        now[0] += 4.0
        log.log(record(step, step_time_s=3.0))  # (+ its data wait of 0.25 s: the first step began 3.25 s ago)
    log.close()
    line = capsys.readouterr().out.strip()
    assert line.endswith("  elapsed 0m39s  eta 5m53s")  # 39.25 s over 10 steps; 90 steps left x 3.925 s


def test_durations_are_compact():
    assert [format_duration(s) for s in (0, 21.4, 62, 599.6, 3600, 7530, -1, float("inf"))] == [
        "0m00s", "0m21s", "1m02s", "10m00s", "1h00m", "2h05m", "0m00s", "0m00s"]


def test_a_long_pass_in_a_pipe_prints_a_line_every_tenth_and_a_short_one_nothing(capsys):
    now = [0.0]
    with contextlib.closing(Progress(200, label="eval", unit="answers", clock=lambda: now[0])) as shown:
        for _ in range(100):  # 2 answers (of two ranks) every second
            now[0] += 1.0
            shown.update(2)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"eval {n}/200 answers, {format_duration(n / 2)}" for n in range(20, 200, 20)]
    with contextlib.closing(Progress(200, label="eval", unit="answers", clock=lambda: now[0])) as shown:
        for _ in range(200):  # 2 seconds in all: no line
            now[0] += 0.01
            shown.update()
    assert capsys.readouterr() == ("", "")


def test_a_slow_pass_prints_every_minute_and_a_fast_one_at_most_every_ten_seconds(capsys):
    now = [0.0]
    with contextlib.closing(Progress(1000, label="validation", unit="batches", clock=lambda: now[0])) as shown:
        for _ in range(250):  # a batch every second: a tenth every 100 s, a minute between them
            now[0] += 1.0
            shown.update()
    assert capsys.readouterr().out.splitlines() == [
        "validation 60/1000 batches, 1m00s", "validation 100/1000 batches, 1m40s",
        "validation 160/1000 batches, 2m40s", "validation 200/1000 batches, 3m20s"]
    with contextlib.closing(Progress(10, label="eval", unit="answers", clock=lambda: now[0])) as shown:
        for _ in range(10):  # each answer a tenth, 4 s apart: a line at most every 10 s
            now[0] += 4.0
            shown.update()
    assert capsys.readouterr().out.splitlines() == ["eval 3/10 answers, 0m12s", "eval 6/10 answers, 0m24s",
                                                    "eval 9/10 answers, 0m36s"]


def test_progress_draws_a_bar_on_a_terminal_and_nothing_on_other_ranks(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with contextlib.closing(Progress(50, label="eval", unit="answers", min_gap_s=0)) as shown:
        for _ in range(50):
            shown.update()
    assert "eval:" in terminal.getvalue() and capsys.readouterr().out == ""  # the bar, no lines
    quiet = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with contextlib.closing(Progress(50, label="eval", unit="answers", enabled=False, min_gap_s=0)) as shown:
        for _ in range(50):
            shown.update()
    assert quiet.getvalue() == "" and capsys.readouterr().out == ""


def test_a_configured_stdout_logger_replaces_the_loss_line(tmp_path, capsys):
    log = MetricsLogger(tmp_path, enabled=True, total_steps=2, loggers=[StdoutLogger(every_n_steps=1)])
    log.log(record(1))
    log.close()
    assert len(capsys.readouterr().out.splitlines()) == 1  # the logger's line alone, not twice


def test_other_ranks_print_nothing(tmp_path, capsys):
    log = MetricsLogger(tmp_path, enabled=False, total_steps=2)
    log.log(record(1))
    log.print("hello")
    log.close()
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_the_bar_starts_its_clock_with_training(tmp_path, monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # the bar's clock
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    log = MetricsLogger(tmp_path, enabled=True, total_steps=100, initial_step=10, log_every_n_steps=10,
                        clock=lambda: now[0])
    now[0] += 3600  # loading the model and an evaluation before training: not training time
    log.log(record(11, step_time_s=1.75))
    bar = log._bar
    # The clock started when step 11 did (its data wait of 0.25 s and its 1.75 s), not an hour earlier.
    assert bar.start_t == 1000.0 + 3600 - 2.0
    assert (bar.n, bar.total) == (11, 100)
    for step in range(12, 21):
        now[0] += 2.0
        log.log(record(step, step_time_s=1.75))
    assert bar.format_dict["elapsed"] == pytest.approx(20.0)  # 10 steps of 2 s
    assert bar.format_dict["rate"] == pytest.approx(0.5)  # so the time left reads 80 steps x 2 s, not hours
    log.close()
    # The bar draws on stderr; the loss lines go to stdout, whole lines without carriage returns.
    assert "\r" in terminal.getvalue() and "train:" in terminal.getvalue()
    # The line's times are the bar's: 20 s elapsed, 80 steps x 2 s left.
    assert capsys.readouterr().out == (
        "step 20/100  loss 0.1000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024  elapsed 0m20s  eta 2m40s\n")


def test_no_bar_on_a_terminal_of_zero_columns(tmp_path, monkeypatch):
    class ZeroColumns(FakeTerminal):
        def fileno(self) -> int:
            return 2

    monkeypatch.setattr(sys, "stderr", ZeroColumns())
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    log = MetricsLogger(tmp_path, enabled=True, total_steps=2)
    log.log(record(1))
    assert log._bar is None
    log.close()
    assert sys.stderr.getvalue() == ""


@pytest.fixture(scope="module")
def piped_demo_run(tmp_path_factory):
    """The demo through `tune run`, its output piped (not a terminal), bar left on as the config has it."""
    out = tmp_path_factory.mktemp("demo")
    result = run_tune(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", "max_steps=4",
        "dataset.num_samples=64", "eval_tasks.num_samples=4", "batch_size=8", "micro_batch_size=4",
        "log_every_n_steps=2", "save_every_n_steps=4", "shuffle=false", "validation_dataset.num_samples=8",
        "eval_every_n_steps=2", check=True,
    )
    return out, result


def test_a_piped_demo_run_prints_loss_lines_and_no_carriage_return(piped_demo_run):
    _, result = piped_demo_run
    assert "\r" not in result.stdout and "\r" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ") and "  loss " in line]
    assert [line.split("  ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    # What a Slurm or nohup log shows of the time (it never sees the bar): elapsed, time left, peak memory.
    pattern = (r"step \d/4  loss [\d.]+  lr \S+  grad_norm \S+  tok/s \d+  elapsed \dm\d\ds  eta \dm\d\ds  "
               r"peak [\d.]+GiB")
    assert all(re.fullmatch(pattern, line) for line in lines), lines


def test_a_piped_demo_run_says_what_it_is_and_ends_with_a_summary(piped_demo_run):
    out, result = piped_demo_run
    stdout = result.stdout.splitlines()
    # The header: the method, optimizer and model code; one process, no data-parallel strategy, its threads.
    assert stdout[0].endswith("M parameters; full fine-tuning, fused AdamW, llama3"), stdout[:2]
    assert re.fullmatch(r"1 process on cpu \(\d+ threads?\), fp32; global batch 8 = 1 x 4 x 2 accumulation steps; "
                        r"4 steps", stdout[1]), stdout[1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = min((r for r in records if "val_loss" in r), key=lambda r: r["val_loss"])
    assert all(r["elapsed_s"] > 0 for r in records if "loss" in r)
    # The summary: wall time, best held-out loss and its step, accuracy before -> after, outputs, next commands.
    summary = stdout[stdout.index(f"saved {out / 'final'}") + 1:]
    assert re.fullmatch(rf"done: 4 steps in \dm\d\ds; best val_loss {best['val_loss']:.4f} at step {best['step']}; "
                        r"held-out accuracy \d+\.\d% -> \d+\.\d%", summary[0]), summary
    assert summary[1:] == [
        (f"outputs in {out}: final/ (the model, Hugging Face files), checkpoints/ (step checkpoints), "
         "metrics.jsonl, config.yaml"),
        f"next: tune run generate --config demo checkpointer.checkpoint_dir={out / 'final'}",
        f"      tune export {out} --output {out}_hf   # the newest step checkpoint as Hugging Face files",
    ]


def test_shuffle_false_reaches_the_sampler(piped_demo_run):
    out, _ = piped_demo_run
    state = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["sampler"]["shuffle"] is False
