"""Building a metric logger checks what it can and writes nothing into the output folder: a recipe builds them
before it claims the folder, and each opens its files (or its tracker run) at its first record."""

import os
import sys
import types

import pytest

from tests.launch import free_port
from toolkit.errors import UserError
from toolkit.training.metric_loggers import build_metric_loggers, build_metric_loggers_on_rank_zero

RECORD = {"step": 1, "loss": 2.0}


def test_tensorboard_creates_its_folder_at_the_first_record(tmp_path):
    pytest.importorskip("tensorboard")
    (logger,) = build_metric_loggers(["tensorboard"], output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    logger.log(RECORD, step=1)
    logger.close()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_logger_closed_before_any_record_writes_nothing(tmp_path):
    pytest.importorskip("tensorboard")
    (logger,) = build_metric_loggers(["tensorboard"], output_dir=tmp_path / "run")
    logger.close()
    assert not (tmp_path / "run").exists()


class FakeWandb(types.ModuleType):
    """Just what WandBLogger calls; ``login`` fails as wandb's does with no API key and no terminal."""

    def __init__(self, logged_in: bool) -> None:
        super().__init__("wandb")
        self.logged_in = logged_in
        self.calls: list[str] = []
        self.errors = types.SimpleNamespace(UsageError=type("UsageError", (Exception,), {}))

    def login(self, **kwargs):
        self.calls.append("login")
        if not self.logged_in:
            raise self.errors.UsageError("No API key configured. Use `wandb login` to log in.")
        return True

    def init(self, **kwargs):
        self.calls.append("init")
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: self.calls.append("finish"))


def test_wandb_checks_the_login_when_built_and_starts_its_run_at_the_first_record(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(logged_in=False))
    with pytest.raises(UserError, match="wandb metric logger: No API key configured.* or WANDB_MODE=offline"):
        build_metric_loggers(["wandb"], output_dir=tmp_path)
    wandb = FakeWandb(logged_in=True)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    (logger,) = build_metric_loggers(["wandb"], output_dir=tmp_path)
    assert wandb.calls == ["login"]
    logger.log(RECORD, step=1)
    logger.close()
    assert wandb.calls == ["login", "init", "finish"]


@pytest.mark.parametrize("offline", [{"mode": "offline"}, {}])
def test_wandb_offline_needs_no_login(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = FakeWandb(logged_in=False)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    (logger,) = build_metric_loggers([{"type": "wandb", **offline}], output_dir=tmp_path)
    logger.close()
    assert wandb.calls == []


def test_mlflow_reaches_its_store_when_built_and_creates_its_run_at_the_first_record(tmp_path, monkeypatch):
    tracking = pytest.importorskip("mlflow.tracking")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    spec = {"type": "mlflow", "tracking_uri": uri, "experiment_name": "built"}
    (logger,) = build_metric_loggers([spec], output_dir=tmp_path / "run")
    client = tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("built")
    assert experiment is not None and client.search_runs([experiment.experiment_id]) == []
    logger.log(RECORD, step=1)
    logger.close()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    with pytest.raises(UserError, match="mlflow metric logger: tracking_uri 'bogus://nowhere': "):
        build_metric_loggers([{"type": "mlflow", "tracking_uri": "bogus://nowhere"}], output_dir=tmp_path)


def test_an_unreachable_mlflow_server_is_one_line_after_one_retry_not_minutes(tmp_path, monkeypatch):
    # Nothing listens on the port: MLflow's defaults retry 7 times with exponential backoff (minutes); the build asks
    # twice. MLflow's own settings are left as they were for the rest of the run.
    pytest.importorskip("mlflow.tracking")
    import mlflow.utils.rest_utils as rest_utils

    attempts = []
    real = rest_utils.http_request

    def counted(*args, **kwargs):
        attempts.append(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES"))
        return real(*args, **kwargs)

    monkeypatch.setattr(rest_utils, "http_request", counted)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # the retry itself at once
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as error:
        build_metric_loggers([{"type": "mlflow", "tracking_uri": uri}], output_dir=tmp_path)
    assert str(error.value).startswith(f"mlflow metric logger: tracking_uri '{uri}': ")
    assert "\n" not in str(error.value)
    assert attempts and set(attempts) == {"1"}
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_on_rank_zero_without_a_process_group_builds_here_and_checks_every_entry(tmp_path):
    (logger,) = build_metric_loggers_on_rank_zero(["stdout"], output_dir=tmp_path)
    logger.close()
    with pytest.raises(UserError, match="unknown type 'tensorbord'"):
        build_metric_loggers_on_rank_zero(["stdout", "tensorbord"], output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
