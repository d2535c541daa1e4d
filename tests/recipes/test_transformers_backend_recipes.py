"""Training through the transformers backend end to end (recipe_configs/*/transformers_backend*.yaml), on tiny
random checkpoints of seven architectures without a native family: 1 process against 2 (ddp, zero3) with the same
global batch, LoRA adapters that `peft` loads, the export that `transformers` loads, exact resume, the native Llama
family against the backend on the same Llama checkpoint, and the refusals.

The 1-process runs go through `tune run` in the test's own process; every 2-process run shares one launch."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune_here
from tests.tiny_hf_models import ARCHITECTURES, ATTENTION_NAMES, save_tiny
from toolkit.pretrained import from_pretrained

transformers = pytest.importorskip("transformers")

ARCHS = sorted(ARCHITECTURES)
# 3 steps of a global batch of 8: 1 process x 4 micro-steps of 2, or 2 processes x 2.
COMMON = [
    "max_steps=3", "dataset.num_samples=64", "batch_size=8", "micro_batch_size=2", "progress_bar=false",
    "~eval_tasks", "save_every_n_steps=null", "dtype=fp32", "max_seq_len=128",
]
# The 2-process runs, by name: (recipe, architecture, overrides). ddp without, zero3 with activation checkpointing.
TWO_PROCESS_RUNS = {
    **{f"{arch}_{strategy}": ("full_finetune", arch, [f"data_parallel={strategy}",
                                                      f"activation_checkpointing={strategy == 'zero3'}"])
       for arch in ARCHS for strategy in ("ddp", "zero3")},
    **{f"{arch}_lora_{strategy}": ("lora_finetune", arch, [f"data_parallel={strategy}"])
       for arch, strategy in (("persimmon", "zero3"), ("phi", "ddp"))},
}


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def overrides(recipe: str, folder: Path) -> list[str]:
    """The checkpoint and, for LoRA, its attention projections by their names in the architecture."""
    if recipe == "full_finetune":
        return [f"checkpointer.checkpoint_dir={folder}"]
    targets = ",".join(ATTENTION_NAMES.get(folder.name, ["q_proj", "v_proj"]))
    return [f"checkpointer.checkpoint_dir={folder}", f"model.lora_target_modules=[{targets}]"]


def config(recipe: str) -> str:
    return "transformers_backend" if recipe == "full_finetune" else "transformers_backend_lora"


def run(recipe: str, out: Path, folder: Path, *args: str, says: str = "") -> Path:
    """`tune run` on one process, in this process; its log must say ``says``."""
    result = run_tune_here("run", f"{recipe}_single_device", "--config", config(recipe), f"output_dir={out}",
                           *COMMON, *overrides(recipe, folder), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert says in result.stderr
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: save_tiny(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def two_process_runs(folders, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("two_processes")
    runs = {
        name: RecipeRun(recipe, root / name, *COMMON, *overrides(recipe, folders[arch]), *args, config=config(recipe))
        for name, (recipe, arch, args) in TWO_PROCESS_RUNS.items()
    }
    result = run_recipes(list(runs.values()), nproc=2, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: r.output_dir for name, r in runs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_processes_train_as_one(arch, folders, two_process_runs, tmp_path):
    one = run("full_finetune", tmp_path / "one", folders[arch], says=f"{arch!r}: no native family; built by the "
              "transformers backend")
    reference = losses(one)
    assert len(reference) == 3 and all(loss > 0 for loss in reference)
    for strategy in ("ddp", "zero3"):
        out = two_process_runs[f"{arch}_{strategy}"]
        torch.testing.assert_close(losses(out), reference, rtol=0, atol=1e-5)
    # The export is in the model's own layout: transformers loads it, with the logits the backend gives it.
    final = two_process_runs[f"{arch}_zero3"] / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokens = torch.randint(1, 400, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, from_pretrained(final).eval()(tokens), atol=1e-4, rtol=0)
    trained, base = load_file(final / "model.safetensors"), load_file(folders[arch] / "model.safetensors")
    assert trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)


@pytest.mark.parametrize("name", [name for name in TWO_PROCESS_RUNS if "_lora_" in name])
def test_lora_adapter_loads_in_peft(name, folders, two_process_runs, tmp_path):
    peft = pytest.importorskip("peft")
    arch = TWO_PROCESS_RUNS[name][1]
    final = two_process_runs[name] / "final"
    one = run("lora_finetune", tmp_path / "one", folders[arch], *TWO_PROCESS_RUNS[name][2])
    torch.testing.assert_close(losses(two_process_runs[name]), losses(one), rtol=0, atol=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(final / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
    tokens = torch.randint(1, 400, (2, 12))
    with torch.no_grad():
        expected = merged(tokens).logits
        torch.testing.assert_close(adapted(tokens).logits, expected, atol=1e-4, rtol=0)
        assert not torch.allclose(adapted.get_base_model()(tokens).logits, expected), "the adapters trained"


def test_resume_is_exact(folders, tmp_path):
    folder = folders["granite"]
    whole = run("full_finetune", tmp_path / "whole", folder, "max_steps=4")
    run("full_finetune", tmp_path / "cut", folder, "max_steps=2", "save_every_n_steps=2")
    resumed = run("full_finetune", tmp_path / "cut", folder, "max_steps=4", "resume_from=auto")
    assert losses(resumed) == losses(whole)
    ours = load_file(resumed / "final" / "model.safetensors")
    reference = load_file(whole / "final" / "model.safetensors")
    assert all(torch.equal(ours[key], reference[key]) for key in reference)


def test_which_builds_the_model_is_said_quietly_for_a_native_family_and_as_a_warning_for_the_backend(
    folders, tmp_path, caplog
):
    import logging

    from toolkit.models import build_from_hf

    llama = save_tiny("llama", tmp_path / "llama", num_key_value_heads=2)
    with caplog.at_level(logging.INFO, logger="toolkit.models"), torch.device("meta"):
        build_from_hf(path=llama)
        build_from_hf(path=folders["olmo2"])
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "toolkit.models"] == [
        ("INFO", "model_type 'llama': built by the native family llama3"),
        ("WARNING", "model_type 'olmo2': no native family; built by the transformers backend"),
    ]


def test_llama_backend_trains_as_the_native_family(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama", num_key_value_heads=2)
    native = run("full_finetune", tmp_path / "native", folder)
    backend = run("full_finetune", tmp_path / "backend", folder,
                  "model._component_=toolkit.models.transformers_backend.from_folder",
                  "checkpointer.model_family=transformers_backend")
    torch.testing.assert_close(losses(backend), losses(native), rtol=0, atol=1e-5)


@pytest.mark.parametrize("override, message", [
    ("model.lora_target_modules=[query_key_value,nope]",
     "lora_target_modules: ['nope'] match no linear layer of the model"),
    ("model.trust_remote_code=maybe", "trust_remote_code"),
])
def test_bad_input_is_refused_before_anything_is_written(override, message, folders, tmp_path):
    result = run_tune_here("run", "lora_finetune_single_device", "--config", "transformers_backend_lora",
                           f"output_dir={tmp_path / 'out'}", *COMMON,
                           f"checkpointer.checkpoint_dir={folders['persimmon']}", override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and not (tmp_path / "out").exists()


def test_remote_code_is_refused_unless_allowed(folders, tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    config = json.loads((folders["olmo2"] / "config.json").read_text())
    config.update(model_type="my_model", auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text((folders["olmo2"] / "tokenizer.json").read_text())
    result = run_tune_here("run", "full_finetune_single_device", "--config", "transformers_backend",
                           f"output_dir={tmp_path / 'out'}", *COMMON, f"checkpointer.checkpoint_dir={folder}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "set model.trust_remote_code=true only if you trust that folder" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config_name", ["full_finetune/transformers_backend",
                                         "lora_finetune/transformers_backend_lora"])
def test_configs_validate_on_a_backend_checkpoint(config_name, folders):
    result = run_tune_here("validate", config_name, f"checkpointer.checkpoint_dir={folders['olmo2']}",
                           "--nproc_per_node", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    # The plan names the backend, and says the memory model does not count its layers.
    header = result.stdout.splitlines()[:2]
    assert header[0].endswith(", fused AdamW, transformers (olmo2)"), header
    assert header[1].endswith("; memory not estimated (the transformers backend)"), header


@pytest.mark.parametrize("override, message", [
    ("tensor_parallel=2", "its layers are transformers' (the transformers backend)"),
    ("context_parallel=2", "not the transformers backend"),
])
def test_tensor_and_context_parallelism_are_refused(override, message, folders):
    result = run_tune_here("validate", "full_finetune/transformers_backend", "--nproc_per_node", "2",
                           f"checkpointer.checkpoint_dir={folders['olmo2']}", override)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_compile_trains_like_the_plain_step(folders, tmp_path):
    # torch.compile of each transformers layer (inductor, CPU) and of the fused loss's kernel: the same math.
    plain = run("full_finetune", tmp_path / "plain", folders["olmo2"], "max_steps=2")
    compiled = run("full_finetune", tmp_path / "compiled", folders["olmo2"], "max_steps=2", "compile=true")
    torch.testing.assert_close(losses(compiled), losses(plain), rtol=1e-5, atol=0)


def test_auto_sizing_is_refused(folders):
    # The memory plan models the toolkit's layers: auto micro batches and layouts need numbers instead.
    result = run_tune_here("plan", "full_finetune", "--config", "transformers_backend",
                           f"checkpointer.checkpoint_dir={folders['olmo2']}", "micro_batch_size=auto",
                           "device_memory_gb=1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "auto sizes activations by the toolkit's own layers" in result.stderr


def test_held_out_accuracy_is_refused(folders):
    # The demo config scores eval_tasks by generating, which needs our layers' KV caches.
    result = run_tune_here("validate", "full_finetune/demo", "model._component_=toolkit.models.build_from_hf",
                           f"model.path={folders['olmo2']}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "eval_tasks: generates with KV caches, which the transformers backend's layers do not have" in result.stderr
