"""Mixture-of-experts models through the recipes, on a tiny Qwen3-MoE that `transformers` writes (with a BPE
tokenizer the test trains), through the `any_model` configs.

- The same global batch trains the same on 1 process and on 2 under ddp and zero3: per-step losses (the
  load-balancing loss included), that loss's share, the per-expert token counts and the gradient norm. fp32 on
  CPU: the layouts differ only in the order of float sums, so 1e-5 relative (the counts are integers: exact).
- A run killed by SIGKILL and resumed ends bitwise where the uninterrupted run does.
- A checkpoint whose expert count or top-k is not the config's model's is refused in one line, exit 2.
- The export loads in `transformers` with our model's logits (1e-4: fp32, other kernels).
- Expert parallelism (2 ranks sharing out the experts, ZeRO-3 on the rest) too, and its export and step checkpoint
  are the one-process run's (the checkpoint resumed on one process; and the one-process run's resumed on 2 ranks
  sharing out the experts).
- LoRA with adapters on every expert, under expert parallelism: each expert's adapters train, the merged model is
  written in the per-expert Hugging Face layout and loads in `transformers`, and the PEFT adapter (written from each
  rank's experts) on the base in `peft` gives the merged model's logits.
- LoRA with the routers trained whole too (`train_router`): 2 processes under zero3, ddp and zero3 x expert_parallel
  2 train like one, the routers
  change (and stay frozen without it), the step checkpoint holds and resumes them, and the merged export, `tune
  merge` of the PEFT adapter (routers as `modules_to_save`) and `peft` on transformers all have them.
- QLoRA with the experts in NF4: 2 processes under ddp, zero3 and zero3 x expert_parallel 2 train like one, a step
  checkpoint resumes on another layout, every expert's adapter trains, and the PEFT adapter on the NF4 base (as
  torchao rounds it) in `peft` gives the merged model's logits; DPO on it starts at its reference.
"""

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here
from tests.tiny_tokenizer import chatml_byte_level_bpe

transformers = pytest.importorskip("transformers")
tune = partial(run_tune_here, "run")

STEPS = 5
FAST = [
    f"max_steps={STEPS}", "dataset.num_samples=64", "batch_size=8", "micro_batch_size=2", "progress_bar=false",
    "~eval_tasks", "dtype=fp32", "max_seq_len=64", "shuffle=true", "data_parallel=ddp",
]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tokenizer = chatml_byte_level_bpe(["reverse: abcd dcba", "upper: word WORD", "sort: dcba abcd"] * 50, vocab_size=400)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        router_aux_loss_coef=0.05, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a router that prefers some experts, so the load-balancing loss has something to balance
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _overrides(folder: Path, *extra: str) -> list[str]:
    return [f"checkpointer.checkpoint_dir={folder}", *FAST, *extra]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def _one_process_run(out: Path, recipe: str, config: str, folder: Path, *extra: str) -> Path:
    result = tune(f"{recipe}_single_device", "--config", config, f"output_dir={out}", *_overrides(folder, *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process(moe_folder, tmp_path_factory) -> Path:
    return _one_process_run(tmp_path_factory.mktemp("moe_one"), "full_finetune", "any_model", moe_folder,
                            "save_every_n_steps=2", "keep_last_n=null")


# LoRA on the experts with the routers trained whole; a large rate, so that the routers visibly move in 5 steps.
ROUTER = ["model.apply_lora_to_experts=true", "model.train_router=true", "optimizer.lr=1e-2", "save_merged=true"]


@pytest.fixture(scope="module")
def router_one_process(moe_folder, tmp_path_factory) -> Path:
    return _one_process_run(tmp_path_factory.mktemp("moe_router_one"), "lora_finetune", "any_model_lora", moe_folder,
                            *ROUTER, "save_every_n_steps=2", "keep_last_n=null")


# QLoRA: the experts (and every attention projection) stored in NF4, adapters on the experts and the attention.
QLORA = ["model.quantize_base=true", "model.apply_lora_to_experts=true", "optimizer.lr=1e-2", "save_merged=true"]


@pytest.fixture(scope="module")
def qlora_one_process(moe_folder, tmp_path_factory) -> Path:
    return _one_process_run(tmp_path_factory.mktemp("moe_qlora_one"), "lora_finetune", "any_model_lora", moe_folder,
                            *QLORA, "save_every_n_steps=2", "keep_last_n=null")


DPO = ["save_every_n_steps=null", "optimizer.lr=1e-3"]
KTO = [*DPO, "preference_loss=kto", "dataset._component_=toolkit.data.demo_unpaired_dataset"]


@pytest.fixture(scope="module")
def dpo_one_process(moe_folder, tmp_path_factory) -> Path:
    return _one_process_run(tmp_path_factory.mktemp("moe_dpo_one"), "preference_finetune", "any_model_dpo",
                            moe_folder, *DPO)


@pytest.fixture(scope="module")
def kto_one_process(moe_folder, tmp_path_factory) -> Path:
    return _one_process_run(tmp_path_factory.mktemp("moe_kto_one"), "preference_finetune", "any_model_dpo",
                            moe_folder, *KTO)


# The 2-process runs, in one launch: (recipe, config, overrides). ep2: the experts shared out over the 2 ranks
# (expert_parallel), ZeRO-3 on the rest; its step checkpoints resume on one process.
TWO_PROCESS_RUNS = {
    "ddp": ("full_finetune", "any_model", ["data_parallel=ddp", "save_every_n_steps=null"]),
    "zero3": ("full_finetune", "any_model", ["data_parallel=zero3", "save_every_n_steps=null"]),
    "ep2": ("full_finetune", "any_model", ["data_parallel=zero3", "expert_parallel=2", "save_every_n_steps=2",
                                           "keep_last_n=null"]),
    "lora": ("lora_finetune", "any_model_lora", ["data_parallel=zero3", "expert_parallel=2", "save_every_n_steps=null",
                                                 "model.apply_lora_to_experts=true", "optimizer.lr=1e-2",
                                                 "save_merged=true"]),
    "lora_router": ("lora_finetune", "any_model_lora", ["data_parallel=zero3", "save_every_n_steps=null", *ROUTER]),
    # The same with the experts (and their adapters) shared out over the 2 ranks, and under DDP.
    "lora_router_ep2": ("lora_finetune", "any_model_lora", ["data_parallel=zero3", "expert_parallel=2",
                                                            "save_every_n_steps=null", *ROUTER]),
    "lora_router_ddp": ("lora_finetune", "any_model_lora", ["data_parallel=ddp", "save_every_n_steps=null", *ROUTER]),
    # DPO on the mixture of experts (a frozen copy as the reference), its load-balancing loss included.
    **{f"dpo_{name}": ("preference_finetune", "any_model_dpo", [*DPO, *extra]) for name, extra in {
        "ddp": ["data_parallel=ddp"], "zero3": ["data_parallel=zero3"],
        "ep2": ["data_parallel=zero3", "expert_parallel=2"]}.items()},
    "kto_ep2": ("preference_finetune", "any_model_dpo", [*KTO, "data_parallel=zero3", "expert_parallel=2"]),
    # QLoRA with NF4 experts: FSDP2 shards the experts' codes and scales along the experts (zero3), or DDP, or the
    # experts are shared out over the 2 ranks (expert parallelism).
    **{f"qlora_{name}": ("lora_finetune", "any_model_lora", [*QLORA, *extra, "save_every_n_steps=null"])
       for name, extra in {"ddp": ["data_parallel=ddp"], "zero3": ["data_parallel=zero3"],
                           "ep2": ["data_parallel=zero3", "expert_parallel=2"]}.items()},
}


@pytest.fixture(scope="module")
def two_processes(moe_folder, one_process, qlora_one_process, tmp_path_factory) -> dict[str, Path]:
    """TWO_PROCESS_RUNS, and ep2_from_one: the one-process run's step 2 checkpoint resumed with the experts shared
    out over 2 ranks; qlora_zero3_from_one: the one-process QLoRA run's resumed on 2 under zero3."""
    root = tmp_path_factory.mktemp("moe_two")
    runs = {
        name: RecipeRun(recipe, root / name, *_overrides(moe_folder, *overrides), config=config)
        for name, (recipe, config, overrides) in TWO_PROCESS_RUNS.items()
    }
    runs["ep2_from_one"] = RecipeRun("full_finetune", root / "ep2_from_one", *_overrides(
        moe_folder, "data_parallel=zero3", "expert_parallel=2", "save_every_n_steps=null",
        f"resume_from={one_process / 'checkpoints' / 'step_2'}"), config="any_model")
    runs["qlora_zero3_from_one"] = RecipeRun("lora_finetune", root / "qlora_zero3_from_one", *_overrides(
        moe_folder, *QLORA, "data_parallel=zero3", "save_every_n_steps=null",
        f"resume_from={qlora_one_process / 'checkpoints' / 'step_2'}"), config="any_model_lora")
    result = run_recipes(list(runs.values()), nproc=2, timeout_s=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: run.output_dir for name, run in runs.items()}


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "ep2"])
def test_two_processes_train_like_one(strategy, one_process, two_processes):
    ours, reference = _records(two_processes[strategy]), _records(one_process)
    assert len(ours) == len(reference) == STEPS
    for key in ("loss", "router_aux_loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in reference], rtol=1e-5, atol=0, msg=key)
    for key in ("expert_load_min", "expert_load_max", "expert_load_busiest_share"):
        assert [r[key] for r in ours] == [r[key] for r in reference], key
    assert all(r["router_aux_loss"] > 0 for r in reference)  # the load-balancing loss is in the training loss
    assert all(1 / 8 <= r["expert_load_busiest_share"] <= 1 for r in reference)


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "ep2"])
def test_dpo_on_experts_adds_their_load_balancing_loss_and_trains_alike_on_two_processes(
    strategy, dpo_one_process, two_processes
):
    reference = _records(dpo_one_process)
    assert len(reference) == STEPS
    # At the first step the policy is its reference: every pair's DPO loss is exactly log 2, so the rest of the loss
    # is the routers' (a mean over the batch's sequences, which router_aux_loss reports).
    assert reference[0]["loss"] - math.log(2) == pytest.approx(reference[0]["router_aux_loss"], rel=1e-5)
    assert all(r["router_aux_loss"] > 0 and 1 / 8 <= r["expert_load_busiest_share"] <= 1 for r in reference)
    ours = _records(two_processes[f"dpo_{strategy}"])
    for key in ("loss", "router_aux_loss", "reward_accuracy", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in reference], rtol=1e-5, atol=1e-7, msg=key)
    for key in ("expert_load_min", "expert_load_max"):
        assert [r[key] for r in ours] == [r[key] for r in reference], key


def test_kto_on_experts_adds_their_load_balancing_loss_and_trains_alike_on_two_processes(
    kto_one_process, two_processes
):
    reference = _records(kto_one_process)
    assert len(reference) == STEPS
    # At the first step the policy is its reference: every answer's KTO loss is exactly 1/2, the rest the routers'.
    assert reference[0]["loss"] - 0.5 == pytest.approx(reference[0]["router_aux_loss"], rel=1e-5)
    ours = _records(two_processes["kto_ep2"])
    for key in ("loss", "router_aux_loss", "kl", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in reference], rtol=1e-5, atol=1e-7, msg=key)


def test_the_expert_parallel_export_and_checkpoint_are_the_one_process_runs(moe_folder, one_process, two_processes,
                                                                           tmp_path):
    assert "zero3 x expert_parallel 2" in two_processes["ep2"].with_name("ep2.stdout").read_text()
    # The export, written from each rank's experts: the one-process run's weights (another layout sums in another
    # order: float rounding, 1e-5).
    ours = load_file(two_processes["ep2"] / "final" / "model.safetensors")
    expected = load_file(one_process / "final" / "model.safetensors")
    assert ours.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(ours[key], weight, rtol=1e-5, atol=1e-6, msg=key)
    # Its step checkpoint (each expert weight whole in DCP) resumes on one process, without expert parallelism.
    checkpoint = two_processes["ep2"] / "checkpoints" / "step_2"
    resumed = tune("full_finetune_single_device", "--config", "any_model", f"output_dir={tmp_path}",
                   *_overrides(moe_folder, f"resume_from={checkpoint}", "save_every_n_steps=null"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    torch.testing.assert_close([r["loss"] for r in _records(tmp_path)], [r["loss"] for r in _records(one_process)][2:],
                               rtol=1e-5, atol=0)


def test_a_one_process_checkpoint_resumes_with_the_experts_shared_out(one_process, two_processes):
    # The other way round from the test above: DCP splits each whole expert tensor over the 2 ranks' experts.
    resumed = _records(two_processes["ep2_from_one"])
    assert [r["step"] for r in resumed] == [3, 4, 5]
    torch.testing.assert_close([r["loss"] for r in resumed], [r["loss"] for r in _records(one_process)][2:],
                               rtol=1e-5, atol=0)


def test_the_export_loads_in_transformers_with_the_models_logits(one_process):
    from toolkit.pretrained import from_pretrained

    final = one_process / "final"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ours = from_pretrained(final).eval()
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-4)
    keys = load_file(final / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys  # the hub's per-expert layout


@pytest.mark.slow  # a launch of its own for the kill
def test_a_killed_run_resumes_bitwise(moe_folder, one_process, tmp_path):
    command = ["run", "full_finetune_single_device", "--config", "any_model", f"output_dir={tmp_path}",
               *_overrides(moe_folder, "save_every_n_steps=2", "keep_last_n=null")]
    killed = run_tune(*command, env={"TUNE_INJECT_FAULT": "after_step:3"})
    assert killed.returncode != 0 and not (tmp_path / "final").exists()
    resumed = run_tune_here(*command, "resume_from=auto")  # in this process: nothing to kill
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in _records(tmp_path)][-3:] == [r["loss"] for r in _records(one_process)][-3:]
    weights, expected = load_file(tmp_path / "final" / "model.safetensors"), load_file(one_process / "final" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        assert torch.equal(weights[key], weight), key


def test_lora_on_the_experts_trains_every_expert_and_writes_the_adapter_and_merged_model(moe_folder, two_processes):
    out = two_processes["lora"]
    assert "zero3 x expert_parallel 2" in out.with_name("lora.stdout").read_text()
    merged = out / "final" / "merged"
    weights, base = load_file(merged / "model.safetensors"), load_file(moe_folder / "model.safetensors")
    for layer in range(2):
        for expert in range(8):
            key = f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"
            assert not torch.equal(weights[key], base[key]), f"{key}: its adapter did not train"
        key = f"model.layers.{layer}.mlp.gate.weight"
        assert torch.equal(weights[key], base[key]), "the router stays frozen"
    # The PEFT adapter, written from each rank's experts (expert parallelism), is the merged model on the base.
    peft = pytest.importorskip("peft")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(tokens).logits
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(moe_folder)
        adapted = peft.PeftModel.from_pretrained(hf_base, out / "final" / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", ["apply_lora_to_experts", "train_router"])
def test_expert_adapters_on_a_model_without_experts_are_refused_in_one_line(key, tmp_path):
    result = tune("lora_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'out'}",
                  f"model.{key}=true", "max_steps=1")
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tune: error: {key}: ") and line.endswith("has no mixture-of-experts layers; set it false")
    assert not (tmp_path / "out").exists()


def _explicit_model(folder: Path, **changed: object) -> list[str]:
    """Overrides that build the checkpoint's Qwen3-MoE from the family's builder with its sizes spelled out (as a
    config for a named model does, rather than from config.json as ``any_model`` does), ``changed`` replaced."""
    config = json.loads((folder / "config.json").read_text())
    sizes = dict(
        vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], embed_dim=config["hidden_size"], intermediate_dim=config["intermediate_size"],
        moe_intermediate_dim=config["moe_intermediate_size"],
        num_experts=config.get("num_experts", config.get("num_local_experts")),  # (transformers 5 names it so)
        num_experts_per_tok=config["num_experts_per_tok"], router_aux_loss_coef=config["router_aux_loss_coef"],
        norm_topk_prob=config["norm_topk_prob"], norm_eps=config["rms_norm_eps"],
        rope_base=config.get("rope_theta") or config["rope_parameters"]["rope_theta"],
    )
    return ["model._component_=toolkit.models.qwen3_moe.qwen3_moe", "~model.path",
            *(f"model.{key}={value}" for key, value in {**sizes, **changed}.items())]


def test_the_checkpoint_loads_into_the_family_builder_spelled_out(moe_folder, one_process, tmp_path):
    # The control for the refusals below: the same overrides, nothing changed, train as any_model does.
    out = tmp_path / "out"
    result = tune("full_finetune_single_device", "--config", "any_model", f"output_dir={out}",
                  *_overrides(moe_folder, "max_steps=1"), *_explicit_model(moe_folder))
    assert result.returncode == 0, result.stderr[-3000:]
    assert _records(out)[0]["loss"] == pytest.approx(_records(one_process)[0]["loss"], rel=1e-6)


@pytest.mark.parametrize(("changed", "says"), [
    # Fewer experts than the checkpoint has: its experts 4-7 have nowhere to go.
    (dict(num_experts=4), r"tune: error: .*tiny_qwen3_moe\d*: the checkpoint has 8 experts per layer but the model "
                          r"has 4 \(counted from 'model.layers.0.mlp.experts.7.down_proj.weight'\); is it a checkpoint of "
                          r"this model\?"),
    # The same weights, another top-k: only config.json can tell.
    (dict(num_experts_per_tok=3), r"tune: error: .*tiny_qwen3_moe\d*: the checkpoint's config.json routes each "
                                  r"token to num_experts_per_tok=2 experts but the model to 3; is it a checkpoint of this model\?"),
], ids=["num_experts", "num_experts_per_tok"])
def test_a_checkpoint_with_another_expert_count_or_top_k_is_refused_in_one_line(moe_folder, changed, says, tmp_path):
    import re

    out = tmp_path / "out"
    result = tune("full_finetune_single_device", "--config", "any_model", f"output_dir={out}",
                  *_overrides(moe_folder, "max_steps=1"), *_explicit_model(moe_folder, **changed))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert re.fullmatch(says, lines[-1]), lines[-1]
    assert not out.exists()  # refused before the output folder was made


@pytest.mark.parametrize("run", ["lora_router", "lora_router_ep2", "lora_router_ddp"])
def test_lora_with_trained_routers_trains_alike_on_two_processes(run, moe_folder, router_one_process, two_processes):
    ours, reference = _records(two_processes[run]), _records(router_one_process)
    assert len(ours) == len(reference) == STEPS
    # fp32 on CPU, the layouts differing only in the order of float sums: 1e-5 relative.
    for key in ("loss", "router_aux_loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in reference], rtol=1e-5, atol=0, msg=key)
    # The routers train: the export of each run has its own, both moved alike from the base's.
    base = load_file(moe_folder / "model.safetensors")
    for out in (router_one_process, two_processes[run]):
        merged = load_file(out / "final" / "merged" / "model.safetensors")
        for layer in range(2):
            key = f"model.layers.{layer}.mlp.gate.weight"
            assert (merged[key] - base[key]).abs().max() > 1e-3, f"{out.name}: {key} did not train"
    torch.testing.assert_close(
        load_file(two_processes[run] / "final" / "merged" / "model.safetensors"),
        load_file(router_one_process / "final" / "merged" / "model.safetensors"), rtol=1e-5, atol=1e-6,
    )


def test_trained_routers_resume_and_reach_the_adapter_and_tune_merge(moe_folder, router_one_process, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from toolkit.pretrained import from_pretrained

    # The step checkpoint keeps what trains, the routers with the adapters, and resumes them.
    checkpoint = router_one_process / "checkpoints" / "step_2"
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert "model.layers.1.mlp.gate.weight" in saved and "model.layers.1.mlp.experts.up_proj" not in saved
    resumed = tune("lora_finetune_single_device", "--config", "any_model_lora", f"output_dir={tmp_path / 'resumed'}",
                   *_overrides(moe_folder, *ROUTER, f"resume_from={checkpoint}", "save_every_n_steps=null"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in _records(tmp_path / "resumed")] == [r["loss"] for r in _records(router_one_process)][2:]
    # tune export of the last step checkpoint writes the run's own adapter and merged model, routers included.
    exported = run_tune_here("export", str(router_one_process / "checkpoints" / "step_5"), "--output",
                             str(tmp_path / "export"), "--merged")
    assert exported.returncode == 0, exported.stderr[-3000:]
    for name in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):
        ours, final = load_file(tmp_path / "export" / name), load_file(router_one_process / "final" / name)
        assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in final), name
    # The PEFT adapter has them as modules_to_save; tune merge of it onto the base is the run's merged export.
    adapter, merged = router_one_process / "final" / "adapter", router_one_process / "final" / "merged"
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["mlp.gate"]
    result = run_tune_here("merge", "--base", str(moe_folder), "--adapter", str(adapter), "--output",
                           str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr[-3000:]
    ours, expected = load_file(tmp_path / "merged" / "model.safetensors"), load_file(merged / "model.safetensors")
    assert ours.keys() == expected.keys()
    for key, weight in expected.items():  # the routers exactly; merged adapters summed in another order: 1e-6
        torch.testing.assert_close(ours[key], weight, rtol=0, atol=0 if ".gate." in key else 1e-6, msg=key)
    # peft loads the adapter, routers included, onto transformers' base: our merged model's logits.
    peft = pytest.importorskip("peft")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
        torch.testing.assert_close(theirs(tokens).logits, from_pretrained(merged).eval()(tokens), atol=1e-4, rtol=0)


def test_trained_routers_are_refused_by_the_preference_recipe_in_one_line(moe_folder, tmp_path):
    # Its LoRA reference is the policy with its adapters off, which would route with the trained routers.
    result = tune("preference_finetune_single_device", "--config", "any_model_lora_dpo",
                  f"output_dir={tmp_path / 'out'}", *_overrides(moe_folder, "model.train_router=true"))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("tune: error: model.train_router: ")
    assert not (tmp_path / "out").exists()


def test_expert_adapters_trained_with_dropout_are_exported_merged_and_say_why(moe_folder, tmp_path):
    # PEFT's adapters on parameters take no dropout: the run writes the merged model in the adapter's place, and tune
    # export of its step checkpoint wants --merged.
    out = tmp_path / "run"
    result = tune("lora_finetune_single_device", "--config", "any_model_lora", f"output_dir={out}",
                  *_overrides(moe_folder, "model.apply_lora_to_experts=true", "model.lora_dropout=0.1", "max_steps=2",
                              "save_every_n_steps=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lora_dropout=0.1: writing the merged model instead of the adapter" in result.stdout
    assert (out / "final" / "merged" / "model.safetensors").is_file() and not (out / "final" / "adapter").exists()
    checkpoint = out / "checkpoints" / "step_2"
    refused = run_tune_here("export", str(checkpoint), "--output", str(tmp_path / "export"))
    assert refused.returncode == 2 and not (tmp_path / "export").exists()
    line, = refused.stderr.strip().splitlines()
    assert "lora_dropout=0.1" in line and "--merged" in line
    exported = run_tune_here("export", str(checkpoint), "--output", str(tmp_path / "export"), "--merged")
    assert exported.returncode == 0, exported.stderr[-3000:]
    ours, final = load_file(tmp_path / "export" / "merged" / "model.safetensors"), load_file(
        out / "final" / "merged" / "model.safetensors")
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in final)
    assert not (tmp_path / "export" / "adapter").exists()


# --- QLoRA: NF4 experts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "ep2"])
def test_qlora_with_nf4_experts_trains_alike_on_two_processes(strategy, qlora_one_process, two_processes):
    ours, reference = _records(two_processes[f"qlora_{strategy}"]), _records(qlora_one_process)
    if strategy == "ep2":
        assert "zero3 x expert_parallel 2" in two_processes["qlora_ep2"].with_name("qlora_ep2.stdout").read_text()
    assert len(ours) == len(reference) == STEPS
    assert reference[-1]["loss"] < reference[0]["loss"]
    # fp32 on CPU; the same NF4 base on every layout (quantized from the same checkpoint): float sums only, 1e-5.
    for key in ("loss", "router_aux_loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in ours], [r[key] for r in reference], rtol=1e-5, atol=0, msg=key)
    torch.testing.assert_close(
        load_file(two_processes[f"qlora_{strategy}"] / "final" / "merged" / "model.safetensors"),
        load_file(qlora_one_process / "final" / "merged" / "model.safetensors"), rtol=1e-5, atol=1e-6,
    )


def test_a_qlora_step_checkpoint_resumes_on_two_processes(qlora_one_process, two_processes):
    resumed = _records(two_processes["qlora_zero3_from_one"])
    assert [r["step"] for r in resumed] == [3, 4, 5]
    torch.testing.assert_close([r["loss"] for r in resumed], [r["loss"] for r in _records(qlora_one_process)][2:],
                               rtol=1e-5, atol=0)


def _nf4_round_trip_of(folder: Path):
    """transformers' model of ``folder`` with every matrix QLoRA stores in NF4 (the layers' attention projections, and
    each expert's gate, up and down matrices, one at a time) replaced by torchao's round trip of it."""
    from toolkit.modules.peft import dequantize, to_nf4

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." in name and name.endswith("_proj.weight"):
                param.copy_(dequantize(to_nf4(param)))
            elif ".experts." in name:  # [E, 2I, H] (gate and up, each its own matrix) or [E, H, I]
                halves = 2 if name.endswith("gate_up_proj") else 1
                for expert in param:
                    for block in expert.chunk(halves):
                        block.copy_(dequantize(to_nf4(block.clone())))
    return model.eval()


def test_the_qlora_adapter_on_the_nf4_base_is_the_merged_model_and_every_expert_trains(moe_folder,
                                                                                    qlora_one_process):
    peft = pytest.importorskip("peft")
    final = qlora_one_process / "final"
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    expert_b = {k: v for k, v in adapter.items() if ".experts." in k and "lora_B" in k}
    assert expert_b and all(v.abs().sum() > 0 for v in expert_b.values())  # B starts at 0: they trained
    # The merged model is the NF4 base (as torchao rounds it) plus the adapters: peft's adapter on that base.
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
        adapted = peft.PeftModel.from_pretrained(_nf4_round_trip_of(moe_folder), final / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, merged(tokens).logits, atol=1e-4, rtol=0)


def test_dpo_with_nf4_experts_starts_at_its_reference(moe_folder, tmp_path):
    # The QLoRA DPO config on a mixture of experts: the reference is the NF4 policy with its adapters off, so at the
    # first step every pair's loss is log 2 and the rest is the routers' load-balancing loss.
    out = tmp_path / "out"
    result = tune("preference_finetune_single_device", "--config", "any_model_qlora_dpo", f"output_dir={out}",
                  *_overrides(moe_folder, *DPO, "max_steps=2", "model.apply_lora_to_mlp=false",
                              "model.apply_lora_to_experts=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    first = _records(out)[0]
    assert first["loss"] - math.log(2) == pytest.approx(first["router_aux_loss"], rel=1e-5)
