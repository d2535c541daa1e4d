"""`tune export`: argument checks, a checkpoint written here converted, and one-line errors for damaged ones
(the conversion of real runs: tests/recipes/test_resume.py)."""

import json

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


def write_any_model_step_checkpoint(tmp_path):
    """A step checkpoint of an `any_model` run (the architecture and family read from the base's config.json,
    built for a training length of 16) on a tiny Llama that transformers saved with bos 5, eos 6, 128 positions."""
    import torch
    import transformers
    from omegaconf import OmegaConf

    from toolkit.config import instantiate
    from toolkit.data import GlobalBatchSampler
    from toolkit.training import StepCheckpointer, TrainingState

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=5, eos_token_id=6,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "generation_config.json").unlink(missing_ok=True)
    cfg = OmegaConf.create({  # as recipe_configs/full_finetune/any_model.yaml has it
        "seed": 0,
        "max_seq_len": 16,
        "model": {"_component_": "toolkit.models.build_from_hf", "path": "${checkpointer.checkpoint_dir}",
                  "max_seq_len": "${max_seq_len}"},
        "checkpointer": {"_component_": "toolkit.training.HFCheckpointer", "checkpoint_dir": str(tmp_path / "base"),
                         "model_family": "auto"},
    })
    model = instantiate(cfg.model)
    torch.nn.init.normal_(model.layers[0].mlp.up_proj.weight)  # as if trained: not the base's weights
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                          GlobalBatchSampler(8, global_batch_size=4))
    step = StepCheckpointer(tmp_path / "run", every_n_steps=1).save(1, state, config=cfg)
    return step, model.eval()


def assert_same_logits(folder, model):
    """transformers on ``folder`` gives ``model``'s logits (fp32, the same math in another order: 1e-4 absolute)."""
    import torch
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    return loaded


@pytest.mark.interop
def test_an_any_model_checkpoint_exports_with_the_base_config(tmp_path):
    # It used to say max_position_embeddings 16 (the training length) and drop bos/eos.
    pytest.importorskip("transformers")
    step, model = write_any_model_step_checkpoint(tmp_path)
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 0
    loaded = assert_same_logits(tmp_path / "hf", model)
    assert loaded.config.max_position_embeddings == 128
    assert (loaded.generation_config.bos_token_id, loaded.generation_config.eos_token_id) == (5, 6)


@pytest.mark.interop
def test_an_any_model_checkpoint_whose_base_moved_says_so(tmp_path, capsys):
    pytest.importorskip("transformers")
    step, model = write_any_model_step_checkpoint(tmp_path)
    (tmp_path / "base").rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{step / 'config.yaml'}: the run's base checkpoint {tmp_path / 'base'}" in err
    assert "is gone" in err and "--base" in err and "set checkpoint_dir" not in err
    assert main(["export", str(step), "--output", str(tmp_path / "hf"), "--base", str(tmp_path / "moved")]) == 0
    assert assert_same_logits(tmp_path / "hf", model).config.max_position_embeddings == 128
    # Another model's folder: its config.json would describe other tensors.
    config = json.loads((tmp_path / "moved" / "config.json").read_text())
    (tmp_path / "moved" / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    capsys.readouterr()
    assert main(["export", str(step), "--output", str(tmp_path / "hf2"), "--base", str(tmp_path / "moved")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'model.layers.0.mlp.gate_proj.weight' has shape (32, 16)" in err, err
    assert not (tmp_path / "hf2").exists()


def test_the_python_api_checks_what_the_command_checks(tmp_path):
    from toolkit.training.step_export import export_step_checkpoint

    step, _ = write_step_checkpoint(tmp_path)
    with pytest.raises(UserError, match="--output: .* holds the checkpoint"):
        export_step_checkpoint(step, step.parent, overwrite=True)
    message = damage_truncate(step)
    with pytest.raises(UserError, match=message):
        export_step_checkpoint(step, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
