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
