"""What rank zero shows while training: a plain loss line every few steps, and a progress bar on a terminal only,
whose clock starts with training."""

import io
import json
import os
import sys

import pytest
import tqdm.std

from tests.launch import run_tune
from toolkit.training.metric_loggers import StdoutLogger
from toolkit.training.metrics import MetricsLogger


def record(step: int, *, step_time_s: float = 0.5, grad_norm: float | None = 0.8125) -> dict:
    """A training step's metrics.jsonl record, as step_metrics makes it."""
    return {"step": step, "epoch": 0, "loss": 2.0 / step, "lr": 3e-4, "grad_norm": grad_norm, "num_tokens": 512,
            "tokens_per_second": 1024.4, "step_time_s": step_time_s, "data_wait_s": 0.25}


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal (and has no descriptor, like pytest's captured streams)."""

    def isatty(self) -> bool:
        return True


def test_piped_output_gets_a_loss_line_every_n_steps_and_no_bar(tmp_path, capsys):
    # Under pytest, stdout and stderr are not terminals: what a log file or a pipe would get.
    log = MetricsLogger(tmp_path, enabled=True, total_steps=5, progress_bar=True, log_every_n_steps=2)
    log.print("0.90M parameters")
    for step in range(1, 6):
        log.log(record(step, grad_norm=None if step == 4 else 0.8125))
        if step == 4:
            log.log({"step": 4, "val_loss": 1.23456, "val_perplexity": 3.4, "val_tokens": 100})
    log.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "0.90M parameters",
        "step 2/5  loss 1.0000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024",
        "step 4/5  loss 0.5000  lr 3.00e-04  tok/s 1024",  # no grad norm (the step ran inside backward)
        "step 4/5  val_loss 1.2346",  # validation: whenever it runs
        "step 5/5  loss 0.4000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024",  # the last step, though not due
    ]
    assert err == ""  # no bar frames, no "\r"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


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
    log = MetricsLogger(tmp_path, enabled=True, total_steps=100, initial_step=10, log_every_n_steps=10)
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
    assert capsys.readouterr().out == "step 20/100  loss 0.1000  lr 3.00e-04  grad_norm 0.8125  tok/s 1024\n"


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
        "dataset.num_samples=64", "~eval_tasks", "batch_size=8", "micro_batch_size=4", "log_every_n_steps=2",
        "save_every_n_steps=4", "shuffle=false", check=True,
    )
    return out, result


def test_a_piped_demo_run_prints_loss_lines_and_no_carriage_return(piped_demo_run):
    _, result = piped_demo_run
    assert "\r" not in result.stdout and "\r" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all("  loss " in line and "  lr " in line and "  tok/s " in line for line in lines)


def test_shuffle_false_reaches_the_sampler(piped_demo_run):
    out, _ = piped_demo_run
    state = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["sampler"]["shuffle"] is False
