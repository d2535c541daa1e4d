"""`tune export`: argument checks, a checkpoint written here converted, and one-line errors for damaged ones
(the conversion of real runs: tests/recipes/test_resume.py)."""

import json
import shutil

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
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a complete step checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_a_step_folder_that_is_gone_is_named_missing_with_the_ones_there(tmp_path, capsys):
    # keep_last_n deleted step_200: say that it does not exist and which checkpoints do, not "interrupted".
    for step in ("step_800", "step_1000"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
        (tmp_path / "checkpoints" / step / "COMPLETE").write_text("{}")
    (tmp_path / "checkpoints" / "step_1200").mkdir()  # being written: not offered
    assert main(["export", str(tmp_path / "checkpoints" / "step_200"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"tune: error: {tmp_path}/checkpoints/step_200: no such folder; the complete step checkpoints of "
                   f"{tmp_path} are step_800, step_1000\n")
    assert main(["export", str(tmp_path / "elsewhere" / "step_2"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"tune: error: {tmp_path}/elsewhere/step_2: no such folder\n"
    assert not (tmp_path / "out").exists()


def test_a_run_folder_exports_its_newest_complete_checkpoint(tmp_path, capsys):
    step, weights = write_step_checkpoint(tmp_path)
    run = step.parent.parent
    (run / "checkpoints" / "step_9").mkdir()  # newer, but incomplete
    assert main(["export", str(run), "--output", str(tmp_path / "hf")]) == 0
    assert f"exporting {step}, the newest complete step checkpoint of {run}" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert main(["export", str(empty), "--output", str(tmp_path / "hf2")]) == 2
    assert "the run has no complete step checkpoint" in capsys.readouterr().err


def test_refuses_to_replace_an_existing_output(tmp_path, capsys):
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "COMPLETE").write_text("{}")
    (tmp_path / "out").mkdir()
    assert main(["export", str(step), "--output", str(tmp_path / "out")]) == 2
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
        "checkpointer": {"_component_": "toolkit.checkpoint.HFCheckpointer", "checkpoint_dir": None,
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
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "no output, not even a partial one"


@pytest.mark.parametrize("output", [".", "..", "../.."])
def test_refuses_to_overwrite_the_checkpoint_itself(output, tmp_path, capsys):
    step, _ = write_step_checkpoint(tmp_path)
    files = sorted(p.name for p in step.iterdir())
    assert main(["export", str(step), "--output", str(step / output), "--overwrite"]) == 2
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
        "checkpointer": {"_component_": "toolkit.checkpoint.HFCheckpointer", "checkpoint_dir": str(tmp_path / "base"),
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
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{step / 'config.yaml'}: the run's base checkpoint {tmp_path / 'base'}" in err
    assert "is gone" in err and "--base" in err and "set checkpoint_dir" not in err
    assert main(["export", str(step), "--output", str(tmp_path / "hf"), "--base", str(tmp_path / "moved")]) == 0
    assert assert_same_logits(tmp_path / "hf", model).config.max_position_embeddings == 128
    # Another model's folder: its config.json would describe other tensors.
    config = json.loads((tmp_path / "moved" / "config.json").read_text())
    (tmp_path / "moved" / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    capsys.readouterr()
    assert main(["export", str(step), "--output", str(tmp_path / "hf2"), "--base", str(tmp_path / "moved")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'model.layers.0.mlp.gate_proj.weight' has shape (32, 16)" in err, err
    assert not (tmp_path / "hf2").exists()


def test_an_export_inside_the_checkpoint_or_its_runs_checkpoints_is_refused(tmp_path, capsys):
    # keep_last_n prunes a run's step checkpoints and overwrite=true clears them: an export among them would go too.
    step, _ = write_step_checkpoint(tmp_path)
    checkpoints = step.parent
    for output, refusal in [
        (step / "hf", f"is inside the checkpoint {step}"),
        (checkpoints / "hf", f"is inside the run's step checkpoints {checkpoints}"),
        (checkpoints / "step_9" / "hf", f"is inside the run's step checkpoints {checkpoints}"),
        (checkpoints.parent, f"holds the checkpoint {step}"),
    ]:
        for args in ([str(step)], [str(checkpoints.parent)]):  # the step folder, or the run standing for it
            assert main(["export", *args, "--output", str(output), "--overwrite"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"tune: error: --output: {output} {refusal}") and err.count("\n") == 1, err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"] and not (step / "hf").exists()


def test_the_python_api_checks_what_the_command_checks(tmp_path):
    from toolkit.checkpoint.export import export_step_checkpoint

    step, _ = write_step_checkpoint(tmp_path)
    with pytest.raises(UserError, match="--output: .* holds the checkpoint"):
        export_step_checkpoint(step, step.parent, overwrite=True)
    message = damage_truncate(step)
    with pytest.raises(UserError, match=message):
        export_step_checkpoint(step, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- a step checkpoint keeps its base's config.json and tokenizer files: it exports alone ---------------------------


def write_base(folder):
    """A tiny Llama base as transformers saves it (bos 5, eos 6, pad 7, 128 positions), with a tokenizer.json."""
    import tokenizers
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=5, eos_token_id=6, pad_token_id=7,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w5", "eos_token": "w6", "pad_token": "w7"}))


def export_notices(caplog):
    """What the toolkit logged: pytest 9's caplog also holds the records of torch's own (non-propagating) loggers."""
    return [r.getMessage() for r in caplog.records if r.name.partition(".")[0] == "toolkit"]


def write_run_on_a_base(tmp_path, *, model_family="llama3"):
    """A step checkpoint of a full fine-tune of ``write_base`` (trained at 32 tokens), which keeps its base's files as
    the recipes' StepCheckpointer does, and the trained model."""
    import torch
    from omegaconf import OmegaConf

    from toolkit.config import instantiate
    from toolkit.data import GlobalBatchSampler
    from toolkit.training import StepCheckpointer, TrainingState

    write_base(tmp_path / "base")
    model_cfg = {"_component_": "toolkit.models.llama3.llama3", "vocab_size": 64, "num_layers": 1, "num_heads": 2,
                 "num_kv_heads": 1, "embed_dim": 16, "intermediate_dim": 32, "max_seq_len": 32}
    if model_family == "auto":
        model_cfg = {"_component_": "toolkit.models.build_from_hf", "path": "${checkpointer.checkpoint_dir}",
                     "max_seq_len": 32}
    cfg = OmegaConf.create({
        "seed": 0,
        "model": model_cfg,
        "checkpointer": {"_component_": "toolkit.checkpoint.HFCheckpointer", "checkpoint_dir": str(tmp_path / "base"),
                         "model_family": model_family},
    })
    model = instantiate(cfg.model)
    checkpointer = instantiate(cfg.checkpointer)
    checkpointer.load(model)
    torch.nn.init.normal_(model.layers[0].mlp.up_proj.weight)  # as if trained: not the base's weights
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                          GlobalBatchSampler(8, global_batch_size=4))
    step = StepCheckpointer(tmp_path / "run", every_n_steps=1, base_checkpoint=checkpointer.checkpoint_dir).save(
        1, state, config=cfg
    )
    return step, model.eval()


@pytest.mark.interop
@pytest.mark.parametrize("model_family", ["llama3", "auto"])
def test_a_checkpoint_whose_base_is_gone_exports_with_the_base_files_it_keeps(model_family, tmp_path, caplog):
    # It used to write config.json from the model alone (transformers' token ids 1/2/None, 32 positions) and no
    # tokenizer; with model_family auto it stopped, the architecture being read from the base's config.json.
    transformers = pytest.importorskip("transformers")
    step, model = write_run_on_a_base(tmp_path, model_family=model_family)
    base_files = {p.name: p.read_bytes() for p in (tmp_path / "base").iterdir() if p.suffix != ".safetensors"}
    (tmp_path / "base").rename(tmp_path / "wiped")
    shutil.rmtree(tmp_path / "wiped")
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 0
    assert not export_notices(caplog), "nothing is missing: no notice"
    loaded = assert_same_logits(tmp_path / "hf", model)
    config = loaded.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id, config.max_position_embeddings) == (5, 6, 7, 128)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == base_files[name], name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer("w9 w3")["input_ids"][-2:]) == (5, 6, [9, 3])


@pytest.mark.interop
def test_the_base_files_the_run_had_win_over_a_changed_base(tmp_path):
    pytest.importorskip("transformers")
    step, _ = write_run_on_a_base(tmp_path)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps(config | {"bos_token_id": 9}))
    (tmp_path / "base" / "tokenizer.json").write_text("{}")
    (tmp_path / "base" / "merges.txt").write_text("a b\n")  # the copy lacks it: the base's is taken
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 5
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (step / "base_files" / "tokenizer.json").read_bytes()
    assert (tmp_path / "hf" / "merges.txt").read_text() == "a b\n"


@pytest.mark.interop
def test_an_old_checkpoint_whose_base_is_gone_exports_with_a_one_line_notice(tmp_path, caplog):
    pytest.importorskip("transformers")
    step, model = write_run_on_a_base(tmp_path)
    shutil.rmtree(step / "base_files")  # as checkpoints were written before they kept them
    shutil.rmtree(tmp_path / "base")
    assert main(["export", str(step), "--output", str(tmp_path / "hf")]) == 0
    (notice,) = export_notices(caplog)
    assert "\n" not in notice and f"base checkpoint {tmp_path / 'base'} is gone" in notice, notice
    assert "token ids" in notice and "tokenizer files are not known" in notice and "--base" in notice
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert assert_same_logits(tmp_path / "hf", model).config.max_position_embeddings == 32


@pytest.mark.interop
def test_a_run_from_a_step_checkpoint_exports_its_base_files(tmp_path):
    # checkpointer.checkpoint_dir=<run>/checkpoints/step_N starts a new run from its weights: its final export takes
    # the config.json facts and the tokenizer from the checkpoint's copy of its base's files.
    pytest.importorskip("transformers")
    from toolkit.training import HFCheckpointer

    step, model = write_run_on_a_base(tmp_path)
    shutil.rmtree(tmp_path / "base")
    final = HFCheckpointer(str(step), model_family="llama3").save(model, tmp_path / "final")
    assert assert_same_logits(final, model).config.bos_token_id == 5
    assert (final / "tokenizer.json").read_bytes() == (step / "base_files" / "tokenizer.json").read_bytes()
