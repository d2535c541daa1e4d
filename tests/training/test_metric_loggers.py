"""Metric loggers (stdout, TensorBoard, W&B, MLflow) and their wiring into MetricsLogger.

Each optional backend is read back with its own package's reader; the backends whose package is not installed are
skipped (tensorboard is in the dev extra; wandb and mlflow are not: install them to run those tests).
"""

from __future__ import annotations

import json
import re
import time
import struct
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from toolkit.errors import UserError
from toolkit.paths import install_command
from toolkit.training.metric_loggers import (
    MetricLogger,
    StdoutLogger,
    build_metric_loggers,
    numeric_metrics,
    parse_metric_logger_spec,
)
from toolkit.training.metrics import MetricsLogger

CONFIG = {"seed": 0, "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.001}, "output_dir": "out"}


def record(step: int, loss: float) -> dict:
    """A metrics.jsonl record, with a field that is not a number."""
    return {"step": step, "epoch": 0, "loss": loss, "lr": 0.1 * step, "num_tokens": 100, "tokens_per_second": 1e4,
            "strategy": "ddp"}


def log_steps(logger: MetricLogger, losses: dict[int, float]) -> None:
    for step, loss in losses.items():
        logger.log(record(step, loss), step=step)


class Recorder:
    """A MetricLogger that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log(self, metrics, step):
        self.calls.append(("log", step, dict(metrics)))

    def log_config(self, config):
        self.calls.append(("log_config", config))

    def close(self):
        self.calls.append(("close",))


def test_only_numbers_other_than_the_step_go_to_trackers():
    assert numeric_metrics(record(3, 2.5)) == {
        "epoch": 0.0, "loss": 2.5, "lr": pytest.approx(0.3), "num_tokens": 100.0, "tokens_per_second": 1e4
    }


def test_specs_are_names_or_mappings_from_a_config():
    specs = OmegaConf.create({"metric_loggers": ["stdout", {"type": "tensorboard", "log_dir": "${output_dir}/tb"}],
                              "output_dir": "out"}).metric_loggers
    assert [parse_metric_logger_spec(s) for s in specs] == [("stdout", {}), ("tensorboard", {"log_dir": "out/tb"})]
    assert isinstance(Recorder(), MetricLogger)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tensorbord", "unknown type 'tensorbord'; did you mean 'tensorboard'?; choose from stdout, tensorboard"),
        ({"type": "wandb", "projetc": "x"}, "'projetc' is not an option of the wandb logger; did you mean 'project'?"),
        ({"project": "x"}, "a mapping with a `type` key"),
    ],
)
def test_a_bad_spec_is_a_user_error(spec, message):
    with pytest.raises(UserError, match=message.replace("?", r"\?").replace("(", r"\(")):
        parse_metric_logger_spec(spec)


def test_a_bad_wandb_mode_is_a_user_error_even_without_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match="mode must be one of online, offline, disabled, shared, got 'ofline'"):
        build_metric_loggers([{"type": "wandb", "mode": "ofline"}], output_dir=tmp_path)


def test_stdout_prints_one_line_every_n_steps_and_every_validation(capsys):
    (logger,) = build_metric_loggers([{"type": "stdout", "every_n_steps": 2}], output_dir="unused")
    log_steps(logger, {1: 3.0, 2: 2.5, 3: 2.0})
    logger.log({"step": 3, "val_loss": 2.25, "val_tokens": 80}, step=3)
    logger.log({"step": 3, "note": "nothing it shows"}, step=3)
    log_steps(logger, {4: 1.23456})
    logger.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 2  epoch 0  loss 2.5  lr 0.2  tokens_per_second 10000",
        "step 3  val_loss 2.25",
        "step 4  epoch 0  loss 1.235  lr 0.4  tokens_per_second 10000",
    ]


def test_stdout_rejects_a_zero_interval():
    with pytest.raises(UserError, match="every_n_steps"):
        StdoutLogger(every_n_steps=0)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under log_dir, read by TensorBoard's own reader."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = event_accumulator.EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    (logger,) = build_metric_loggers(["tensorboard"], output_dir=tmp_path)
    log_steps(logger, {1: 3.0, 2: 2.5})
    logger.log_config(CONFIG)
    logger.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert sorted(scalars) == ["epoch", "loss", "lr", "num_tokens", "tokens_per_second"]  # no "strategy", no "step"
    assert scalars["loss"] == [(1, 3.0), (2, 2.5)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (text,) = accumulator.Tensors("config/text_summary")
    assert '"lr": 0.001' in text.tensor_proto.string_val[0].decode()


def test_tensorboard_on_resume_hides_the_steps_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    (first,) = build_metric_loggers(["tensorboard"], output_dir=tmp_path)
    log_steps(first, {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5})  # died after step 4; the last checkpoint is step 2
    first.close()
    (resumed,) = build_metric_loggers(["tensorboard"], output_dir=tmp_path, initial_step=2)
    log_steps(resumed, {3: 2.25, 4: 1.75, 5: 1.25})
    resumed.close()
    loss = tensorboard_scalars(tmp_path / "tensorboard")["loss"]
    assert loss == [(1, 3.0), (2, 2.5), (3, 2.25), (4, 1.75), (5, 1.25)]  # steps 3 and 4 once, from the resumed run


def wandb_records(run_file: Path) -> list:
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header, then records in the
    LevelDB log format (32 KiB blocks; each chunk has a 4-byte checksum, 2-byte length and 1-byte type)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, pos, block = [], b"", 7, 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(chunks))
            chunks = b""
    return records


def test_wandb_offline_run_is_written_under_the_output_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no `mode` in the spec: the environment decides
    output_dir = tmp_path / "my_run"
    (logger,) = build_metric_loggers([{"type": "wandb", "project": "toolkit-test"}], output_dir=output_dir)
    logger.log_config(CONFIG)
    log_steps(logger, {1: 3.0, 2: 2.5})
    logger.close()

    # W&B's service process writes the file, and may still be writing it a moment after finish() returns (measured:
    # the file there without its run record, now and then): read it until its last record, the exit, is in.
    records = []
    for _ in range(200):
        run_files = list(output_dir.glob("wandb/offline-run-*/run-*.wandb"))
        try:
            records = wandb_records(run_files[0]) if len(run_files) == 1 else []
        except Exception:  # noqa: BLE001 (a record half written: read again)
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    assert len(run_files) == 1, run_files
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("toolkit-test", "my_run")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"]) for h in history] == [(1, 3.0), (2, 2.5)]
    assert all("strategy" not in h for h in history)
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["optimizer"] == CONFIG["optimizer"]


def test_mlflow_local_file_store_reads_back(tmp_path, monkeypatch):
    tracking = pytest.importorskip("mlflow.tracking")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database unless told otherwise
    uri = (tmp_path / "mlruns").as_uri()
    spec = {"type": "mlflow", "tracking_uri": uri, "experiment_name": "toolkit-test"}
    (logger,) = build_metric_loggers([spec], output_dir=tmp_path / "my_run")
    logger.log_config(CONFIG)
    log_steps(logger, {1: 3.0, 2: 2.5})
    logger.close()

    client = tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.info.run_name == "my_run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "toolkit-test"
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "loss")] == [(1, 3.0), (2, 2.5)]
    assert "strategy" not in run.data.metrics and "step" not in run.data.metrics
    assert run.data.params["optimizer.lr"] == "0.001" and run.data.params["seed"] == "0"


@pytest.mark.parametrize(
    "kind, modules",
    [("tensorboard", ["torch.utils.tensorboard"]), ("wandb", ["wandb"]), ("mlflow", ["mlflow", "mlflow.tracking"])],
)
def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch, kind, modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import` of it now fails as if it were not installed
    already_built = Recorder()
    with pytest.raises(UserError, match=rf"{kind} metric logger needs .*{re.escape(install_command(kind))}$"):
        build_metric_loggers([already_built, kind], output_dir=tmp_path)
    assert already_built.calls == [("close",)]  # what was built before the failure is released


def test_metrics_logger_feeds_its_loggers_on_rank_zero(tmp_path):
    recorder = Recorder()
    log = MetricsLogger(tmp_path, enabled=True, total_steps=2, progress_bar=True, loggers=[recorder])
    log.log_config(OmegaConf.create(CONFIG))
    log.log(record(1, 3.0))
    log.log({"step": 1, "val_loss": 2.5})  # a validation record: no training fields
    log.close()
    # A training record as metrics.jsonl has it, with the seconds since training started (none: it times no step).
    written = {**record(1, 3.0), "elapsed_s": 0.0}
    assert recorder.calls == [
        ("log_config", CONFIG), ("log", 1, written), ("log", 1, {"step": 1, "val_loss": 2.5}), ("close",)
    ]
    assert type(recorder.calls[0][1]) is dict  # a DictConfig reaches the loggers as plain values
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [written, {"step": 1, "val_loss": 2.5}]


def test_other_ranks_build_no_logger_but_check_the_specs(tmp_path):
    recorder = Recorder()
    log = MetricsLogger(tmp_path, enabled=False, total_steps=2, progress_bar=False, loggers=[recorder, "stdout"])
    log.log_config(CONFIG)
    log.log(record(1, 3.0))
    log.close()
    assert recorder.calls == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="unknown type 'tensorbord'"):
        MetricsLogger(tmp_path, enabled=False, total_steps=2, loggers=["tensorbord"])


def test_metrics_logger_builds_specs_and_still_truncates_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record(s, 1.0)) + "\n" for s in (1, 2, 3)))
    log = MetricsLogger(tmp_path, enabled=True, total_steps=3, initial_step=1, progress_bar=False,
                        loggers=OmegaConf.create(["tensorboard"]))
    log.log(record(2, 0.5))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [1.0, 0.5]
    assert tensorboard_scalars(tmp_path / "tensorboard")["loss"] == [(2, 0.5)]


def test_a_missing_package_stops_before_metrics_jsonl_changes(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    text = "".join(json.dumps(record(s, 1.0)) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(UserError, match=re.escape(install_command("wandb"))):
        MetricsLogger(tmp_path, enabled=True, total_steps=3, initial_step=1, progress_bar=False, loggers=["wandb"])
    assert (tmp_path / "metrics.jsonl").read_text() == text
