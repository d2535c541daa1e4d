"""MetaCheckpointer: single-file and model-parallel Meta checkpoints load bitwise, and bad input fails in one line."""

import json

import pytest
import torch

from toolkit.config import instantiate
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3, lora_llama3, tune_to_meta
from toolkit.modules.peft import is_adapter_key
from toolkit.training import HFCheckpointer
from toolkit.checkpoint.meta import MetaCheckpointer

SIZE = dict(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=32, max_seq_len=32)
# How Meta's reference model.py lays each weight across model-parallel ranks (fairscale layers):
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "output")  # split along dim 0
ROW_PARALLEL = ("wo", "w2")  # split along dim 1


def tiny(**overrides):
    torch.manual_seed(overrides.pop("seed", 0))
    return llama3(**{**SIZE, **overrides})


def write_meta(model, folder, *, num_files=1, embedding_dim=0, n_kv_heads=2):
    """Write ``model`` as Meta would: ``consolidated.NN.pth`` per model-parallel rank plus ``params.json``.

    ``embedding_dim``: 0 for Llama 3's VocabParallelEmbedding, 1 for Llama 2's ParallelEmbedding.
    """
    meta = tune_to_meta(model.state_dict(), num_heads=4, num_kv_heads=2)
    meta["rope.freqs"] = torch.ones(2)  # Llama 2 files carry it; the loader skips it
    for rank in range(num_files):
        shard = {}
        for key, value in meta.items():
            module = key.split(".")[-2]
            dim = 0 if module in COLUMN_PARALLEL else 1 if module in ROW_PARALLEL else None
            if module == "tok_embeddings":
                dim = embedding_dim
            # clone: torch.save writes a view's whole storage
            shard[key] = value if dim is None else value.chunk(num_files, dim=dim)[rank].clone()
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")
    params = {"dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": n_kv_heads, "vocab_size": 64, "norm_eps": 1e-5}
    (folder / "params.json").write_text(json.dumps(params))
    return folder


def assert_same_weights(loaded, source):
    expected = source.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("num_files,embedding_dim", [(1, 0), (2, 0), (2, 1), (4, 1)])
def test_round_trip_is_bitwise(tmp_path, num_files, embedding_dim):
    model = tiny()
    write_meta(model, tmp_path, num_files=num_files, embedding_dim=embedding_dim)
    loaded = tiny(seed=1)
    MetaCheckpointer(str(tmp_path), model_family="llama3").load(loaded)
    assert_same_weights(loaded, model)


def test_model_parallel_logits_match_and_export_is_hugging_face(tmp_path):
    model = tiny().eval()
    (tmp_path / "meta").mkdir()
    write_meta(model, tmp_path / "meta", num_files=2)
    # The YAML form a config uses, through the config system.
    checkpointer = instantiate({
        "_component_": "toolkit.checkpoint.meta.MetaCheckpointer",
        "checkpoint_dir": str(tmp_path / "meta"),
        "model_family": "llama3",
    })
    loaded = tiny(seed=1).eval()
    checkpointer.load(loaded)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    out = checkpointer.save(loaded, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    again = tiny(seed=2)
    HFCheckpointer(str(out), model_family="llama3").load(again)
    assert_same_weights(again, model)


def test_llama2_family_and_tied_model(tmp_path):
    model = tiny()
    write_meta(model, tmp_path, num_files=2, embedding_dim=1)
    # A tied model skips the checkpoint's output.weight (its embedding is the output projection).
    loaded = tiny(tie_word_embeddings=True, seed=1)
    assert "output.weight" not in loaded.state_dict()
    MetaCheckpointer(str(tmp_path), model_family="llama2").load(loaded)
    assert_same_weights(loaded, model)


def test_adapters_may_be_missing_only_when_ignored(tmp_path):
    write_meta(tiny(), tmp_path)
    lora = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], lora_rank=2, lora_alpha=4, **SIZE)
    with pytest.raises(UserError, match=r"lacks 8 weight\(s\) .*lora"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(lora)
    MetaCheckpointer(str(tmp_path), model_family="llama3").load(lora, ignore_missing=is_adapter_key)
    expected = tiny().state_dict()["layers.1.self_attn.q_proj.weight"]
    assert torch.equal(lora.state_dict()["layers.1.self_attn.q_proj.weight"], expected)


def edit_file(path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


@pytest.mark.parametrize("num_files", [1, 2])
def test_truncated_file_names_the_file(tmp_path, num_files):
    write_meta(tiny(), tmp_path, num_files=num_files)
    path = tmp_path / f"consolidated.{num_files - 1:02d}.pth"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match=rf"{path.name}: cannot read the checkpoint .* truncated or corrupt"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())


@pytest.mark.parametrize("num_files,detail", [(1, r"\(48, 16\)$"), (2, r"\(24, 16\) \(its 1/2 of \(48, 16\) along dim 0\)")])
def test_shape_mismatch_names_file_and_key(tmp_path, num_files, detail):
    write_meta(tiny(), tmp_path, num_files=num_files)
    with pytest.raises(UserError, match=rf"consolidated.00.pth: 'layers.0.feed_forward.w1.weight' has shape .* expects {detail}"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny(intermediate_dim=48))


def test_unknown_and_missing_keys(tmp_path):
    write_meta(tiny(), tmp_path)
    path = tmp_path / "consolidated.00.pth"
    edit_file(path, lambda state: state.update({"layers.0.attention.wz.weight": torch.zeros(2)}))
    with pytest.raises(UserError, match=r"consolidated.00.pth: key 'layers.0.attention.wz.weight' has no counterpart"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())
    edit_file(path, lambda state: [state.pop("layers.0.attention.wz.weight"), state.pop("norm.weight")])
    with pytest.raises(UserError, match=r"lacks 1 weight\(s\) the model needs, e.g. 'norm.weight'"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())
    MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny(), ignore_missing=lambda key: key == "norm.weight")


def test_model_parallel_files_must_agree_on_keys(tmp_path):
    write_meta(tiny(), tmp_path, num_files=2)
    edit_file(tmp_path / "consolidated.01.pth", lambda state: state.pop("layers.1.ffn_norm.weight"))
    with pytest.raises(UserError, match=r"consolidated.01.pth: lacks key 'layers.1.ffn_norm.weight'"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())


def test_missing_files(tmp_path):
    with pytest.raises(UserError, match="no consolidated.*.pth files"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())
    write_meta(tiny(), tmp_path, num_files=4)
    (tmp_path / "consolidated.02.pth").unlink()
    with pytest.raises(UserError, match=r"consolidated.02.pth: missing; .* to consolidated.03.pth"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())


def test_head_counts_must_match_and_family_must_convert(tmp_path):
    write_meta(tiny(), tmp_path, n_kv_heads=4)
    with pytest.raises(UserError, match=r"params.json: n_heads=4, n_kv_heads=4, but the model has num_heads=4, num_kv_heads=2"):
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(tiny())
    with pytest.raises(UserError, match=r"'qwen2_5' has no Meta checkpoint conversion"):
        MetaCheckpointer(str(tmp_path), model_family="qwen2_5").load(tiny())


def lora_step_checkpoint(tmp_path):
    """A LoRA run's step checkpoint (adapters only) on a two-file Meta base, and the model it holds."""
    from omegaconf import OmegaConf

    from toolkit.data import GlobalBatchSampler
    from toolkit.training import StepCheckpointer, TrainingState

    (tmp_path / "meta").mkdir()
    write_meta(tiny(), tmp_path / "meta", num_files=2)
    cfg = OmegaConf.create({
        "seed": 0,
        "model": {"_component_": "toolkit.models.llama3.lora_llama3", "lora_attn_modules": ["q_proj", "v_proj"],
                  "lora_rank": 2, "lora_alpha": 4, **SIZE},
        "checkpointer": {"_component_": "toolkit.checkpoint.meta.MetaCheckpointer",
                         "checkpoint_dir": str(tmp_path / "meta"), "model_family": "llama3"},
    })
    model = instantiate(cfg.model)
    instantiate(cfg.checkpointer).load(model, ignore_missing=is_adapter_key)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter_key(name))
            if is_adapter_key(name):
                param.normal_(std=0.1)  # as if trained: B starts at zero, which would hide a missing adapter
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                          GlobalBatchSampler(8, global_batch_size=4))
    step = StepCheckpointer(tmp_path / "run", every_n_steps=1, trainable_only=True).save(1, state, config=cfg)
    return step, model.eval()


def assert_merged_logits(folder, model):
    """``folder`` loads in transformers and gives the LoRA model's logits (fp32, merged weights against the
    adapter path: 1e-4 absolute on logits of magnitude ~1)."""
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=1e-4, rtol=0)


@pytest.mark.interop
def test_a_lora_step_checkpoint_on_a_meta_base_exports_merged(tmp_path):
    # tune export used to read the base with HFCheckpointer whatever the run's checkpointer: "no *.safetensors".
    from toolkit.checkpoint.export import export_step_checkpoint

    step, model = lora_step_checkpoint(tmp_path)
    written = export_step_checkpoint(step, tmp_path / "export", merged=True)
    assert written == [tmp_path / "export" / "adapter", tmp_path / "export" / "merged"]
    assert_merged_logits(written[1], model)


@pytest.mark.interop
def test_a_moved_meta_base_is_named_and_found_with_base(tmp_path, capsys):
    from toolkit.cli.main import main

    step, model = lora_step_checkpoint(tmp_path)
    (tmp_path / "meta").rename(tmp_path / "moved")
    out = tmp_path / "export"
    capsys.readouterr()
    assert main(["export", str(step), "--output", str(out), "--merged"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"base checkpoint {tmp_path / 'meta'} (checkpointer.checkpoint_dir) is gone" in err
    assert "merged" in err and "--base" in err and not out.exists()
    # Without --merged the adapters need no base.
    assert main(["export", str(step), "--output", str(out)]) == 0
    assert main(["export", str(step), "--output", str(out), "--merged", "--overwrite", "--base", str(tmp_path / "moved")]) == 0
    assert_merged_logits(out / "merged", model)
