"""HFCheckpointer: round trip, sharding with an index, and one-line errors naming the file and key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.errors import UserError
from toolkit.models.llama3 import llama3
from toolkit.training import HFCheckpointer


def tiny(tie: bool = False):
    return llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=32,
                  max_seq_len=32, tie_word_embeddings=tie)


def test_round_trip_sharded_with_index(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    out = HFCheckpointer(model_family="llama3").save(model, tmp_path / "ckpt", max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = tiny()
    HFCheckpointer(str(out), model_family="llama3").load(loaded)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_tied_model_accepts_a_checkpoint_with_lm_head(tmp_path):
    model = tiny(tie=True)
    out = HFCheckpointer(model_family="llama3").save(model, tmp_path / "ckpt")
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(out / "model.safetensors"))
    HFCheckpointer(str(out), model_family="llama3").load(tiny(tie=True))


def test_truncated_file_names_the_file(tmp_path):
    out = HFCheckpointer(model_family="llama3").save(tiny(), tmp_path / "ckpt")
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="model.safetensors: cannot read safetensors"):
        HFCheckpointer(str(out), model_family="llama3").load(tiny())


def test_shape_mismatch_names_the_key(tmp_path):
    out = HFCheckpointer(model_family="llama3").save(tiny(), tmp_path / "ckpt")
    other = llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=48,
                   max_seq_len=32)
    with pytest.raises(UserError, match=r"model.safetensors: 'model.layers.0.mlp.\w+_proj.weight' has shape .* but the model expects"):
        HFCheckpointer(str(out), model_family="llama3").load(other)


def test_missing_weights_and_unknown_family(tmp_path):
    out = HFCheckpointer(model_family="llama3").save(tiny(), tmp_path / "ckpt")
    deeper = llama3(vocab_size=64, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=32,
                    max_seq_len=32)
    with pytest.raises(UserError, match="lacks .* weight"):
        HFCheckpointer(str(out), model_family="llama3").load(deeper)
    with pytest.raises(UserError, match="unknown family 'llama9'"):
        HFCheckpointer(str(out), model_family="llama9")


def step_folder(tmp_path, model):
    """A folder laid out like a complete step checkpoint's model part (``model.<key>`` in DCP files)."""
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "checkpoints" / "step_1"
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(step))
    (step / "COMPLETE").write_text("{}")
    return step


def test_a_step_checkpoint_loads_and_a_damaged_one_is_named(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    step = step_folder(tmp_path, model)
    loaded = tiny()
    HFCheckpointer(str(step), model_family="llama3").load(loaded)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    # Same size, unreadable content: DCP raises a CheckpointException, which is not an Exception.
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(UserError, match="cannot read the checkpoint"):
        HFCheckpointer(str(step), model_family="llama3").load(tiny())
    shard.write_bytes(b"\0" * 100)
    with pytest.raises(UserError, match=f"{shard.name}: truncated"):
        HFCheckpointer(str(step), model_family="llama3").load(tiny())
    (step / "COMPLETE").unlink()  # a write that was interrupted
    with pytest.raises(UserError, match="not a complete step checkpoint"):
        HFCheckpointer(str(step), model_family="llama3").load(tiny())


# --- The exported config.json keeps what the source's says -------------------------------------------------------

SOURCE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=5, eos_token_id=6, pad_token_id=7)
LLAMA3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32, "rope_theta": 500000.0}


def source_folder(transformers, family: str, folder):
    """A tiny random checkpoint as ``transformers`` saves it, without generation_config.json: what transformers
    then reads for generation (bos, eos, pad) comes from config.json alone."""
    config = {
        "llama3": lambda: transformers.LlamaConfig(**SOURCE, rope_parameters=LLAMA3_1_ROPE),
        "qwen2_5": lambda: transformers.Qwen2Config(**SOURCE, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**SOURCE, head_dim=8),
        "mistral": lambda: transformers.MistralConfig(**SOURCE, head_dim=8, sliding_window=None),
        "gemma2": lambda: transformers.Gemma2Config(**SOURCE, head_dim=8, query_pre_attn_scalar=8, sliding_window=8),
    }[family]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def assert_same_logits(folder, model, transformers):
    """``folder`` loads in transformers and gives our model's logits (fp32, the same math in another order: 1e-4
    absolute on logits of magnitude ~1)."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model.eval()(tokens), atol=1e-4, rtol=0)
    return loaded


@pytest.mark.interop
@pytest.mark.parametrize("family", ["llama3", "qwen2_5", "qwen3", "mistral", "gemma2"])
def test_export_keeps_the_source_context_length_and_token_ids(family, tmp_path):
    # Trained at max_seq_len 16 (any_model passes the training length to build_from_hf), the export used to say
    # max_position_embeddings 16, and bos/eos/pad fell back to transformers' defaults.
    transformers = pytest.importorskip("transformers")
    from toolkit.models import build_from_hf
    from toolkit.training.init import materialize

    source = source_folder(transformers, family, tmp_path / "source")
    with torch.device("meta"):
        model = build_from_hf(path=source, max_seq_len=16)
    materialize(model, device=torch.device("cpu"))
    checkpointer = HFCheckpointer(str(source), model_family="auto")
    checkpointer.load(model)
    out = checkpointer.save(model, tmp_path / "out")

    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 128
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (5, 6, 7)
    loaded = assert_same_logits(out, model, transformers)
    assert loaded.config.max_position_embeddings == 128
    generation = loaded.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (5, 6, 7)


@pytest.mark.interop
@pytest.mark.parametrize("ours_scaled", [False, True], ids=["ours_plain", "ours_scaled"])
@pytest.mark.parametrize("spelling", ["v5", "v4"])
def test_what_our_model_contradicts_in_the_source_config_is_ours(spelling, ours_scaled, tmp_path):
    # The source and the model (built by a named builder, not from the folder) disagree on the rotary embedding
    # (plain or Llama 3.1 scaling, base 10000 or 500000) and the dtype (bf16 or fp32): the export says the model's
    # in whichever spelling transformers reads first, and keeps the source's token ids.
    transformers = pytest.importorskip("transformers")
    from toolkit.modules import Llama3RopeScaling

    source = tmp_path / "source"
    source.mkdir()
    rope = {"rope_type": "default"} if ours_scaled else {**LLAMA3_1_ROPE, "original_max_position_embeddings": 8}
    rope["rope_theta"] = 10000.0
    if spelling == "v5":
        stale = {"rope_parameters": rope, "dtype": "bfloat16"}
    else:
        theta = rope.pop("rope_theta")
        stale = {"rope_theta": theta, "rope_scaling": None if ours_scaled else rope, "torch_dtype": "bfloat16"}
    (source / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **SOURCE, "hidden_size": 16,
        "intermediate_size": 32, "auto_map": {"AutoModelForCausalLM": "modeling_custom.Custom"}, **stale,
    }))
    torch.manual_seed(0)
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
    model = llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=32,
                   max_seq_len=32, rope_scaling=scaling if ours_scaled else None)
    out = HFCheckpointer(str(source), model_family="llama3").save(model, tmp_path / "out")

    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config, "our weights are the standard architecture, not the source's custom code"
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (5, 6, 128)
    loaded = assert_same_logits(out, model, transformers)
    assert loaded.config.rope_parameters["rope_theta"] == 500000.0
    assert loaded.config.rope_parameters["rope_type"] == ("llama3" if ours_scaled else "default")
    assert transformers.AutoConfig.from_pretrained(out).dtype == torch.float32


@pytest.mark.interop
def test_tokenizer_files_and_chat_template_travel_with_the_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    source = source_folder(transformers, "llama3", tmp_path / "source")
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t6", bos_token="t5"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(source)
    assert (source / "chat_template.jinja").is_file(), "transformers keeps the chat template in its own file"
    out = HFCheckpointer(str(source), model_family="llama3").save(tiny(), tmp_path / "out")
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template


def test_the_config_dtype_is_the_written_weights(tmp_path):
    # A step checkpoint of a bf16 run converts with a model on the meta device (float32 by default): the config
    # must say what the files hold.
    step = step_folder(tmp_path, tiny().to(torch.bfloat16))
    with torch.device("meta"):
        model = tiny()
    out = HFCheckpointer(model_family="llama3").save_from_dcp(model, step, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
