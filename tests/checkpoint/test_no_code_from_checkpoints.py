"""No checkpoint file runs code (design promise 6): for every loader, a crafted file whose unpickling would create a
marker file stops the load with one line naming the file, and the marker never appears.

The crafted files are real attacks: the first test shows torch's own readers running them.
"""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from tests.launch import run_tune_here
from toolkit.cli.main import main as tune
from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules.peft import init_adapters, is_adapter_key
from toolkit.training import HFCheckpointer, StepCheckpointer, TrainingState, materialize
from toolkit.checkpoint.meta import MetaCheckpointer
from toolkit.checkpoint.peft import load_peft_adapter, save_peft_adapter
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.checkpoint.step_files import tensor_state

SIZE = dict(vocab_size=64, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, intermediate_dim=32, max_seq_len=32)
LORA = dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=2, lora_alpha=4.0)


class RunsCode:
    """Unpickled, it creates the file ``marker``: a stand-in for whatever a crafted checkpoint file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def training_state() -> TrainingState:
    torch.manual_seed(0)
    model = llama3(**SIZE)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()  # so that the checkpoint holds optimizer state too
    return TrainingState(
        model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        GlobalBatchSampler(8, global_batch_size=4),
    )


CONFIG = OmegaConf.create({
    "seed": 0,
    "model": {"_component_": "toolkit.models.llama3.llama3", **SIZE},
    "checkpointer": {
        "_component_": "toolkit.checkpoint.HFCheckpointer", "checkpoint_dir": None, "model_family": "llama3",
    },
})


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A complete step checkpoint of a tiny Llama and its AdamW state, written by StepCheckpointer."""
    return StepCheckpointer(tmp_path_factory.mktemp("run"), every_n_steps=1).save(1, training_state(), config=CONFIG)


@pytest.fixture
def step(written, tmp_path) -> Path:
    """A copy of the step checkpoint to craft."""
    return Path(shutil.copytree(written, tmp_path / "checkpoints" / "step_1"))


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "code_ran"
    yield path
    assert not path.exists(), "a crafted checkpoint file ran code"


def craft_metadata(step: Path, marker: Path) -> Path:
    """The checkpoint's own metadata, with a payload where DCP keeps any object (its planner's data)."""
    metadata = read_dcp_metadata(step)
    metadata.planner_data = {"model.tok_embeddings.weight": RunsCode(marker)}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    return step / ".metadata"


def craft_value(step: Path, marker: Path) -> str:
    """The checkpoint written again with the payload as a non-tensor value (an optimizer's learning rate)."""
    state = training_state()
    tensors = tensor_state(state, trainable_only=False)
    key = next(k for k in tensors["optimizer"] if k.endswith(".lr"))
    tensors["optimizer"][key] = RunsCode(marker)
    dcp.save(tensors, checkpoint_id=str(step))
    return f"optimizer.{key}"


def one_line(text: str) -> str:
    assert text.strip().count("\n") == 0, text
    return text


def test_the_crafted_files_run_code_through_torchs_own_readers(step, tmp_path):
    ran = tmp_path / "ran"
    craft_metadata(step, ran)
    dcp.FileSystemReader(str(step)).read_metadata()
    assert ran.exists()
    ran.unlink()
    craft_value(step, ran)
    state = training_state()
    dcp.load(tensor_state(state, trainable_only=False), checkpoint_id=str(step))
    assert ran.exists()
    ran.unlink()
    torch.save({"x": RunsCode(ran)}, tmp_path / "file.pt")
    torch.load(tmp_path / "file.pt", weights_only=False)
    assert ran.exists()


# --- step checkpoints: resume ----------------------------------------------------------------------------------------


def test_resume_refuses_crafted_metadata(step, marker):
    file = craft_metadata(step, marker)
    with pytest.raises(UserError) as refused:
        StepCheckpointer(step.parent.parent, every_n_steps=1).load(step, training_state(), config=CONFIG)
    assert one_line(str(refused.value)).startswith(f"{file}: not loaded: it names builtins.exec")


def test_resume_refuses_a_crafted_value_in_a_shard(step, marker):
    key = craft_value(step, marker)
    with pytest.raises(UserError) as refused:
        StepCheckpointer(step.parent.parent, every_n_steps=1).load(step, training_state(), config=CONFIG)
    message = one_line(str(refused.value))
    assert message.startswith(f"{step / '__0_0.distcp'}: the value of {key!r} was not loaded"), message
    assert "GLOBAL exec" in message


def test_resume_refuses_a_crafted_rng_state(step, marker):
    rng = step / "rng" / "rank_0.pt"
    torch.save({"python": RunsCode(marker)}, rng)
    with pytest.raises(UserError) as refused:
        StepCheckpointer(step.parent.parent, every_n_steps=1).load(step, training_state(), config=CONFIG)
    message = one_line(str(refused.value))
    assert message.startswith(f"{rng}: not loaded: it holds more than tensors and plain data"), message
    assert "GLOBAL exec" in message


def test_a_legit_checkpoint_still_resumes(step):
    saved, resumed = training_state(), training_state()
    with torch.no_grad():
        for param in resumed.model.parameters():
            param.zero_()
    resumed.optimizer.param_groups[0]["betas"] = (0.5, 0.5)
    assert StepCheckpointer(step.parent.parent, every_n_steps=1).load(step, resumed, config=CONFIG) == 1
    for (name, a), b in zip(saved.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # a non-tensor value, read back


def test_tune_run_resume_from_crafted_metadata_is_one_line_and_exit_2(tmp_path, marker):
    # The checkpoint needs only what is checked before its tensors: the marker, the state, the model config.
    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    state = {"step": 1, "sampler": {}, "lr_scheduler": {}, "world_size": 1, "model_state": "full"}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "config.yaml").write_text("model:\n  _component_: toolkit.models.llama3.llama3_demo\n  max_seq_len: 64\n")
    (step / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    # `tune run` on one device runs the recipe in its own process: here, this one.
    result = run_tune_here(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'out'}",
        f"resume_from={step}", "progress_bar=false", "~eval_tasks",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{step / '.metadata'}: not loaded: it names builtins.exec" in one_line(result.stderr)


# --- tune export ----------------------------------------------------------------------------------------------------


def test_tune_export_refuses_crafted_metadata(step, marker, tmp_path, capsys):
    file = craft_metadata(step, marker)
    assert tune(["export", str(step), "--output", str(tmp_path / "hf")]) == 2
    assert f"{file}: not loaded" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()


def test_tune_export_reads_no_value_it_does_not_need(step, marker, tmp_path):
    craft_value(step, marker)  # the optimizer's: an export reads the model's tensors alone
    assert tune(["export", str(step), "--output", str(tmp_path / "hf")]) == 0


@pytest.mark.parametrize(
    "key, component",
    [
        ("model", "os.system"),
        ("model", "toolkit.models.llama3._convert_weights.torch.save"),  # reached through toolkit, defined elsewhere
        ("checkpointer", "toolkit.checkpoint.output_dir.prepare_output_dir"),  # ours, but not a checkpointer
    ],
)
def test_tune_export_builds_only_tunekits_components(step, tmp_path, capsys, key, component):
    config = step / "config.yaml"
    cfg = OmegaConf.load(config)
    cfg[key] = {"_component_": component}
    OmegaConf.save(cfg, config)
    assert tune(["export", str(step), "--output", str(tmp_path / "hf")]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{config}: {key}._component_={component!r} is not " in err and "cannot run other code" in err


# --- base checkpoints: a step checkpoint, a Hugging Face folder, a Meta folder ---------------------------------------


def meta_model():
    with torch.device("meta"):
        model = llama3(**SIZE)
    materialize(model, device=torch.device("cpu"))
    return model


def test_a_step_checkpoint_as_base_refuses_crafted_metadata(step, marker):
    file = craft_metadata(step, marker)
    with pytest.raises(UserError) as refused:
        HFCheckpointer(str(step), model_family="llama3").load(meta_model())
    assert one_line(str(refused.value)).startswith(f"{file}: not loaded")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return HFCheckpointer(None, model_family="llama3").save(llama3(**SIZE), tmp_path_factory.mktemp("hf") / "base")


def test_a_hugging_face_folder_never_unpickles_its_stray_files(hf_base, tmp_path, marker):
    base = Path(shutil.copytree(hf_base, tmp_path / "base"))
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        torch.save({"x": RunsCode(marker)}, base / name)
    model = meta_model()
    HFCheckpointer(str(base), model_family="llama3").load(model)  # the safetensors alone
    torch.manual_seed(0)
    for (key, expected), loaded in zip(llama3(**SIZE).state_dict().items(), model.state_dict().values()):
        assert torch.equal(loaded, expected), key


def test_a_hugging_face_folder_of_pickled_weights_is_refused(tmp_path, marker):
    (tmp_path / "base").mkdir()
    torch.save({"x": RunsCode(marker)}, tmp_path / "base" / "pytorch_model.bin")
    with pytest.raises(UserError) as refused:
        HFCheckpointer(str(tmp_path / "base"), model_family="llama3").load(meta_model())
    message = one_line(str(refused.value))
    assert "no *.safetensors" in message and "pytorch_model.bin is a pickle, which is not loaded" in message


def test_a_meta_checkpoint_refuses_a_crafted_pth_in_one_line(tmp_path, marker):
    file = tmp_path / "consolidated.00.pth"
    torch.save({"tok_embeddings.weight": torch.zeros(64, 16), "norm.weight": RunsCode(marker)}, file)
    with pytest.raises(UserError) as refused:
        MetaCheckpointer(str(tmp_path), model_family="llama3").load(meta_model())
    message = one_line(str(refused.value))
    assert message.startswith(f"{file}: not loaded: it holds more than tensors and plain data"), message
    assert "GLOBAL exec" in message and "weights_only=False" not in message and "safe_globals" not in message


# --- adapters: tune merge, and the adapter eval and generate load -----------------------------------------------------


@pytest.fixture(scope="module")
def adapter(hf_base, tmp_path_factory) -> Path:
    with torch.device("meta"):
        model = lora_llama3(**SIZE, **LORA)
    materialize(model, device=torch.device("cpu"))
    HFCheckpointer(str(hf_base), model_family="llama3").load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    return save_peft_adapter(model, tmp_path_factory.mktemp("adapter") / "adapter", model_family="llama3")


def pickled_adapter(adapter: Path, tmp_path: Path, marker: Path) -> Path:
    """The adapter as PEFT's older format would hold it: adapter_model.bin, a pickle (here, a crafted one)."""
    folder = tmp_path / "pickled_adapter"
    folder.mkdir()
    shutil.copy(adapter / "adapter_config.json", folder)
    torch.save({"x": RunsCode(marker)}, folder / "adapter_model.bin")
    return folder


def test_tune_merge_never_unpickles(hf_base, adapter, tmp_path, marker, capsys):
    base = Path(shutil.copytree(hf_base, tmp_path / "base"))
    torch.save({"x": RunsCode(marker)}, base / "pytorch_model.bin")
    torch.save({"x": RunsCode(marker)}, Path(shutil.copytree(adapter, tmp_path / "adapter")) / "adapter_model.bin")
    adapter_copy = tmp_path / "adapter"
    assert tune(["merge", "--base", str(base), "--adapter", str(adapter_copy), "--output", str(tmp_path / "m")]) == 0

    folder = pickled_adapter(adapter, tmp_path, marker)
    assert tune(["merge", "--base", str(base), "--adapter", str(folder), "--output", str(tmp_path / "m2")]) == 2
    assert "adapter_model.bin is a pickle, which is not loaded" in one_line(capsys.readouterr().err)
    (base / "model.safetensors").unlink()
    assert tune(["merge", "--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "m3")]) == 2
    assert "pytorch_model.bin is a pickle, which is not loaded" in one_line(capsys.readouterr().err)


def test_loading_an_adapter_never_unpickles(adapter, tmp_path, marker):
    with torch.device("meta"):
        model = lora_llama3(**SIZE, **LORA)
    materialize(model, device=torch.device("cpu"))
    with pytest.raises(UserError) as refused:
        load_peft_adapter(model, pickled_adapter(adapter, tmp_path, marker), model_family="llama3")
    assert "adapter_model.bin is a pickle, which is not loaded" in one_line(str(refused.value))
