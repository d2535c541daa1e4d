"""Exporting to Hugging Face from every rank: the files equal the model's weights and load in `transformers`."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.launch import run_workers
from toolkit.training import HFCheckpointer

sys.path.insert(0, str(Path(__file__).parent))
from _export_worker import moe_dir, tiny_model, tiny_moe_model  # noqa: E402


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def expected_hf_state() -> dict[str, torch.Tensor]:
    return {("lm_head.weight" if k == "output.weight" else "model." + k): v for k, v in tiny_model().state_dict().items()}


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_two_process_export_equals_the_model_and_loads_in_transformers(strategy, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    worker = Path(__file__).parent / "_export_worker.py"
    result = run_workers(worker, strategy, str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2, "small shards: several files, written by both ranks"
    assert not any(p.name.startswith(".") for p in out.iterdir()), "no intermediate shards left behind"
    expected = expected_hf_state()
    written = read_all(out)
    assert written.keys() == expected.keys() == index["weight_map"].keys()
    for key in expected:
        assert torch.equal(written[key], expected[key]), key
    # The experts, sharded unevenly over the ranks, are written one tensor per expert as one process saves them
    # (and the worker loaded them back into its shards).
    saved = read_all(HFCheckpointer(None, model_family="qwen3_moe").save(tiny_moe_model(), tmp_path / "moe_saved"))
    written = read_all(moe_dir(out))
    assert len(list(moe_dir(out).glob("*.safetensors"))) > 2
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in written
    assert written.keys() == saved.keys()
    for key in saved:
        assert torch.equal(written[key], saved[key]), key

    tokens = torch.randint(0, 96, (2, 16))
    for folder, reference in ((out, tiny_model()), (moe_dir(out), tiny_moe_model())):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            # fp32, the same math in another order: 1e-4 absolute on logits of magnitude ~1.
            torch.testing.assert_close(loaded(tokens).logits, reference.eval()(tokens), atol=1e-4, rtol=0)



def test_single_process_export_streams_the_same_files_as_save(tmp_path):
    from toolkit.models.llama3 import hf_config

    model = tiny_model()
    # A source checkpoint with what the model cannot tell: its token ids and a longer context than the training's.
    (tmp_path / "source").mkdir()
    source = hf_config(model) | {"max_position_embeddings": 4096, "bos_token_id": 5, "eos_token_id": 6}
    (tmp_path / "source" / "config.json").write_text(json.dumps(source))
    checkpointer = HFCheckpointer(str(tmp_path / "source"), model_family="llama3")
    exported = checkpointer.export(model, tmp_path / "export", max_shard_bytes=20_000)
    saved = checkpointer.save(model, tmp_path / "save", max_shard_bytes=20_000)
    for name in sorted(p.name for p in saved.iterdir()):
        assert (exported / name).read_bytes() == (saved / name).read_bytes(), name
    config = json.loads((exported / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (4096, 5, 6)
