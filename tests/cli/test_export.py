"""`tune export`: argument checks, a checkpoint written here converted, and one-line errors for damaged ones
(the conversion of real runs: tests/recipes/test_resume.py)."""

import pytest

from toolkit.cli.export import parse_size
from toolkit.cli.main import main
from toolkit.errors import UserError


@pytest.mark.parametrize(
    "text, expected",
    [("5GB", 5 * 2**30), ("500MB", 500 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", int(1.5 * 2**30)), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense():
    with pytest.raises(UserError, match="--max_shard_size"):
        parse_size("five gigs")


def test_an_incomplete_checkpoint_is_a_one_line_error(tmp_path, capsys):
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a complete step checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_refuses_to_replace_an_existing_output(tmp_path, capsys):
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "COMPLETE").write_text("{}")
    (tmp_path / "out").mkdir()
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 1
    assert "--overwrite" in capsys.readouterr().err


def write_step_checkpoint(tmp_path):
    """A complete step checkpoint of a tiny Llama, written by StepCheckpointer in this process, and its weights."""
    import torch
    from omegaconf import OmegaConf

    from toolkit.config import instantiate
    from toolkit.data import GlobalBatchSampler
    from toolkit.training import StepCheckpointer, TrainingState

    cfg = OmegaConf.create({
        "seed": 0,
        "model": {"_component_": "toolkit.models.llama3.llama3", "vocab_size": 64, "num_layers": 1, "num_heads": 2,
                  "num_kv_heads": 1, "embed_dim": 16, "intermediate_dim": 32, "max_seq_len": 32},
        "checkpointer": {"_component_": "toolkit.training.HFCheckpointer", "checkpoint_dir": None,
                         "model_family": "llama3"},
    })
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                          GlobalBatchSampler(8, global_batch_size=4))
    step = StepCheckpointer(tmp_path / "run", every_n_steps=1).save(1, state, config=cfg)
    return step, model.state_dict()


def test_a_step_checkpoint_exports(tmp_path):
    from safetensors.torch import load_file

    step, weights = write_step_checkpoint(tmp_path)
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    hf_key = {"output.weight": "lm_head.weight"}
    assert exported.keys() == {hf_key.get(k, f"model.{k}") for k in weights}
    assert all(exported[hf_key.get(k, f"model.{k}")].equal(v) for k, v in weights.items())


def damage_truncate(step):
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    return f"{shard.name}: truncated"


def damage_zero(step):  # same size, unreadable: torch.distributed.checkpoint raises a CheckpointException
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))
    return "cannot read the checkpoint"


def damage_metadata(step):
    (step / ".metadata").write_bytes(b"garbage")
    return ".metadata: unreadable"


def damage_config(step):
    (step / "config.yaml").unlink()
    return "config.yaml: missing"


@pytest.mark.parametrize("damage", [damage_truncate, damage_zero, damage_metadata, damage_config])
def test_a_damaged_checkpoint_is_a_one_line_error_and_writes_nothing(damage, tmp_path, capsys):
    step, _ = write_step_checkpoint(tmp_path)
    message = damage(step)
    capsys.readouterr()
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "no output, not even a partial one"


@pytest.mark.parametrize("output", [".", "..", "../.."])
def test_refuses_to_overwrite_the_checkpoint_itself(output, tmp_path, capsys):
    step, _ = write_step_checkpoint(tmp_path)
    files = sorted(p.name for p in step.iterdir())
    assert main(["export", str(step), "--output", str(step / output), "--overwrite"]) == 1
    assert "--output" in capsys.readouterr().err
    assert sorted(p.name for p in step.iterdir()) == files
