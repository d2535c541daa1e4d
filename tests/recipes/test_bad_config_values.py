"""A battery of the values users get wrong, on every shipped recipe: each is refused by `tune validate`, `tune plan`
and `tune run` (before any process starts or any file is touched) in one line naming the config file and the key,
with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.paths import configs_dir

TRAINING = ["full_finetune", "lora_finetune", "preference_finetune", "distill"]

# (override, the key the message must name). Each is a mistake a user makes at the command line or in a YAML file.
TRAINING_CASES = [
    ("epochs=0", "epochs"),
    ("epochs=-2", "epochs"),
    ("epochs=1.5", "epochs"),
    ("max_steps=-1", "max_steps"),
    ("max_steps=0", "max_steps"),
    ("max_steps=abc", "max_steps"),
    ("batch_size=0", "batch_size"),
    ("batch_size=33", "batch_size"),
    ("batch_size=abc", "batch_size"),
    ("micro_batch_size=0", "micro_batch_size"),
    ("micro_batch_size=Auto", "micro_batch_size"),
    ("max_seq_len=0", "max_seq_len"),
    ("max_seq_len=abc", "max_seq_len"),
    ("seed=-1", "seed"),
    ("seed=abc", "seed"),
    ("overwrite=flase", "overwrite"),
    ("overwrite=yes please", "overwrite"),
    ("overwrite=1", "overwrite"),
    ("progress_bar=maybe", "progress_bar"),
    ("shuffle=random", "shuffle"),
    ("async_save=2", "async_save"),
    ("cpu_offload=enabled", "cpu_offload"),
    ("compile=fast", "compile"),
    ("fused_loss=null", "fused_loss"),
    ("dtype=bf17", "dtype"),
    ("dtype=float32", "dtype"),
    ("device=gpu", "device"),
    ("data_parallel=fsdp", "data_parallel"),
    ("data_parallel=zero4", "data_parallel"),
    ("hsdp_shard_size=0", "hsdp_shard_size"),
    ("dist_timeout_s=0", "dist_timeout_s"),
    ("dist_timeout_s=-5", "dist_timeout_s"),
    ("log_every_n_steps=0", "log_every_n_steps"),
    ("save_every_n_steps=0", "save_every_n_steps"),
    ("save_every_n_steps=-10", "save_every_n_steps"),
    ("keep_last_n=0", "keep_last_n"),
    ("eval_every_n_steps=0", "eval_every_n_steps"),
    ("eval_max_new_tokens=-1", "eval_max_new_tokens"),
    ("clip_grad_norm=-1", "clip_grad_norm"),
    ("clip_grad_norm=abc", "clip_grad_norm"),
    ("clip_grad_norm=0", "clip_grad_norm"),
    ("activation_checkpointing=0", "activation_checkpointing"),
    ("activation_checkpointing=always", "activation_checkpointing"),
    ("loss_chunks=0", "loss_chunks"),
    ("flex_attention=sometimes", "flex_attention"),
    ("sdpa_backend=flashy", "sdpa_backend"),
    ("device_memory_gb=-4", "device_memory_gb"),
    ("resume_from=", "resume_from"),
    ("output_dir=", "output_dir"),
    ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=abc", "optimizer.lr"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("optimizer.betas=0.9", "optimizer.betas"),
    ("optimizer.eps=-1e-8", "optimizer.eps"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
    ("optimizer.amsgrad=3", "optimizer.amsgrad"),
    ("optimizer.lrr=0.1", "optimizer.lrr"),
    # A value only the optimizer's own constructor knows is wrong (checked without building a parameter group).
    ("optimizer={_component_: torch.optim.SGD, lr: 0.1, nesterov: true}", "optimizer"),
    ("optimizer={_component_: torch.optim.SGD, lr: 0.1, momentum: -2}", "optimizer.momentum"),  # (a schema key: Muon's)
    ("lr_scheduler.warmup_steps=-3", "lr_scheduler.warmup_steps"),
    ("lr_scheduler.min_lr_ratio=1.5", "lr_scheduler.min_lr_ratio"),
    ("profiler.enable=true", "profiler.enable"),
    ("metric_loggers=tensorboard", "metric_loggers"),
    ("metric_loggers=[tensorbord]", "metric_loggers[0]"),
    ("metric_loggers=[{type: wandb, projct: x}]", "metric_loggers[0]"),
]

LORA_CASES = [
    ("model.lora_rank=0", "model.lora_rank"),
    ("model.lora_rank=-8", "model.lora_rank"),
    ("model.lora_rank=eight", "model.lora_rank"),
    ("model.lora_alpha=0", "model.lora_alpha"),
    ("model.lora_dropout=1.5", "model.lora_dropout"),
    ("model.lora_dropout=-0.1", "model.lora_dropout"),
    ("model.use_dora=sure", "model.use_dora"),
    ("model.train_router=sure", "model.train_router"),
    ("save_merged=nope", "save_merged"),
]

PREFERENCE_CASES = [
    ("beta=0", "beta"),
    ("beta=-0.1", "beta"),
    ("beta=abc", "beta"),
    ("preference_loss=kpo", "preference_loss"),
    ("preference_loss=DPO", "preference_loss"),
    ("label_smoothing=0.5", "label_smoothing"),
    ("label_smoothing=-0.1", "label_smoothing"),
    ("simpo_gamma=-1", "simpo_gamma"),
    ("precompute_reference=maybe", "precompute_reference"),
    # What only some losses read, refused with the others rather than silently unused.
    ("preference_loss=simpo|precompute_reference=true", "precompute_reference"),
    ("preference_loss=orpo|label_smoothing=0.1", "label_smoothing"),
    ("desirable_weight=2.0", "desirable_weight"),  # only kto weighs its answers
    ("preference_loss=ipo|undesirable_weight=0.5", "undesirable_weight"),
    ("preference_loss=kto|desirable_weight=0", "desirable_weight"),
    ("preference_loss=kto|undesirable_weight=-1", "undesirable_weight"),
    ("preference_loss=kto|desirable_weight=lots", "desirable_weight"),
    ("fused_loss=false", "fused_loss"),  # keys the recipe does not read are not silently ignored
]

DISTILL_CASES = [
    ("kd_loss=kl", "kd_loss"),
    ("kd_ratio=1.5", "kd_ratio"),
    ("kd_ratio=-0.1", "kd_ratio"),
    ("temperature=0", "temperature"),
    ("temperature=hot", "temperature"),
    ("kd_loss=jsd|jsd_beta=1.0", "jsd_beta"),
    ("jsd_beta=0.5", "jsd_beta"),  # forward_kl does not read it
    ("sequence_parallel=true", "sequence_parallel"),  # without tensor parallelism
    ("teacher_model=7", "teacher_model"),
]

GENERATE_CASES = [
    ("temperature=-1", "temperature"),
    ("temperature=hot", "temperature"),
    ("max_new_tokens=-5", "max_new_tokens"),
    ("max_new_tokens=0", "max_new_tokens"),
    ("top_k=-1", "top_k"),
    ("top_p=1.5", "top_p"),
    ("top_p=-0.5", "top_p"),
    ("seed=abc", "seed"),
    ("dtype=fp64", "dtype"),
]

RL_CASES = [
    ("num_generations=1", "num_generations"),
    ("num_generations=0", "num_generations"),
    ("temperature=0", "temperature"),  # greedy: every completion of a group the same
    ("temperature=-1", "temperature"),
    ("max_new_tokens=64", "max_new_tokens"),  # no room left for a prompt within max_seq_len
    ("loss=ppo", "loss"),
    ("loss=dapo|kl_coef=0.1", "kl_coef"),  # an objective's key given to another objective
    ("dynamic_sampling=true", "dynamic_sampling"),
    ("overlong_filter=true", "overlong_filter"),
    ("clip_low=1.5", "clip_low"),
    ("top_p=0", "top_p"),
    ("updates_per_rollout=0", "updates_per_rollout"),
    ("rewards=[]", "rewards"),
    ("rewards.0._component_=toolkit.rl.NoSuchReward", "rewards[0]._component_"),
    ("rewards.0.weight=heavy", "rewards[0].weight"),
    ("rewards.0._component_=toolkit.rl.rollout.completion_seed|~rewards.0.field", "rewards[0]._component_"),
    ("rewards.0.field=3", "rewards[0].field"),
    ("sft_warmup_lr=null", "sft_warmup_lr"),
    ("routing_replay=true", "routing_replay"),  # with updates_per_rollout 1 there is no other pass to replay
]

EVAL_CASES = [
    ("micro_batch_size=0", "micro_batch_size"),
    ("micro_batch_size=auto", "micro_batch_size"),
    ("eval_max_new_tokens=0", "eval_max_new_tokens"),
    ("data_parallel=auto", "data_parallel"),
    ("lm_eval.limit=-1", "lm_eval.limit"),
    ("lm_eval.num_fewshot=-2", "lm_eval.num_fewshot"),
    ("lm_eval.batch_size=0", "lm_eval.batch_size"),
]

CASES = (
    [(recipe, override, key) for recipe in TRAINING for override, key in TRAINING_CASES]
    + [("lora_finetune", override, key) for override, key in LORA_CASES]
    + [("preference_finetune", override, key) for override, key in PREFERENCE_CASES]
    + [("distill", override, key) for override, key in DISTILL_CASES]
    + [("rl_finetune", override, key) for override, key in RL_CASES]
    + [("generate", override, key) for override, key in GENERATE_CASES]
    + [("eval", override, key) for override, key in EVAL_CASES]
)


def _one_problem(err: str, key: str, recipe: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    config = configs_dir() / recipe / "demo.yaml"
    # Named: the file, then the key (a mistyped override is named by the override itself).
    assert lines[0].startswith(f"tune: error: {config}: {key}: ") or (
        lines[0].startswith("tune: error: override ") and key in lines[0]
    ), lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(("recipe", "override", "key"), CASES, ids=lambda v: str(v))
def test_tune_validate_refuses_a_bad_value_in_one_line(recipe, override, key, capsys):
    assert main(["validate", f"{recipe}/demo", *override.split("|")]) == 2  # "|" joins several overrides
    _one_problem(capsys.readouterr().err, key, recipe)


RUN_CASES = [
    ("full_finetune_single_device", "max_steps=-1", "max_steps"),
    ("full_finetune_single_device", "epochs=-2", "epochs"),
    ("full_finetune_distributed", "overwrite=flase", "overwrite"),
    ("lora_finetune_distributed", "model.lora_rank=0", "model.lora_rank"),
    ("preference_finetune_distributed", "beta=0", "beta"),
    ("generate", "temperature=-1", "temperature"),
    ("eval_distributed", "micro_batch_size=0", "micro_batch_size"),
    ("rl_finetune_distributed", "num_generations=1", "num_generations"),
]


@pytest.mark.parametrize(("recipe", "override", "key"), RUN_CASES, ids=lambda v: str(v))
def test_tune_run_refuses_before_launching_or_writing(recipe, override, key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the demo configs write under ./outputs
    args = ["--nproc_per_node", "2"] if recipe.endswith("_distributed") else []
    assert main(["run", *args, recipe, "--config", "demo", override]) == 2
    _one_problem(capsys.readouterr().err, key, recipe.removesuffix("_distributed").removesuffix("_single_device"))
    assert list(tmp_path.iterdir()) == []  # nothing written, no process started


@pytest.mark.parametrize("nproc", [3, 5])
def test_a_batch_that_does_not_divide_over_the_processes_is_refused_everywhere(nproc, tmp_path, monkeypatch, capsys):
    # The demo's batch of 32 does not split over 3 or 5 processes. tune validate used to say OK.
    monkeypatch.chdir(tmp_path)
    lower = 32 // nproc * nproc
    expected = f"batch_size: 32 is not divisible by the world size ({nproc}); use batch_size={lower} or {lower + nproc}"
    assert main(["validate", "full_finetune/demo", "--nproc_per_node", str(nproc)]) == 2
    assert expected in capsys.readouterr().err
    assert main(["plan", "full_finetune", "--config", "demo", "--nproc_per_node", str(nproc), "--device-memory-gb", "8"]) == 2
    assert expected in capsys.readouterr().err
    assert main(["run", "--nproc_per_node", str(nproc), "full_finetune_distributed", "--config", "demo"]) == 2
    assert expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", [4, 8])
def test_a_micro_batch_above_a_process_share_is_no_refusal(nproc, capsys):
    # On 4 or 8 processes the demo's micro batch of 16 is above each one's share of 32 sequences: the run cuts it to
    # the share (the same global batch), so what checks the config before a launch must not refuse it.
    assert main(["validate", "full_finetune/demo", "--nproc_per_node", str(nproc)]) == 0
    assert main(["plan", "full_finetune", "--config", "demo", "--nproc_per_node", str(nproc), "--device-memory-gb", "8"]) == 0
    assert f"micro batch {32 // nproc} x 64 tokens" in capsys.readouterr().out
    assert main(["validate", "full_finetune/demo", "batch_size=8"]) == 0  # `tune run --help`'s example


# tensor_parallel: (recipe, overrides, processes, the key the message must name). The demo Llama has 4 heads, 2
# key/value heads, an MLP width and a vocabulary of 384.
TINY_LLAMA = [
    "model._component_=toolkit.models.llama3.llama3", "model.num_layers=1", "model.num_heads=4",
    "model.num_kv_heads=2", "model.embed_dim=64",
]
TINY_MOE = [
    "model._component_=toolkit.models.qwen3_moe.qwen3_moe", "model.vocab_size=384", "model.num_layers=1",
    "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16", "model.embed_dim=64",
    "model.moe_intermediate_dim=32", "model.num_experts=4", "model.num_experts_per_tok=2",
]
TP_CASES = [
    ("full_finetune", ["tensor_parallel=0"], 2, "tensor_parallel"),
    ("full_finetune", ["tensor_parallel=two"], 2, "tensor_parallel"),
    ("full_finetune", ["tensor_parallel=1.5"], 2, "tensor_parallel"),
    ("full_finetune", ["tensor_parallel=2"], 3, "tensor_parallel"),  # does not divide 3 processes
    ("full_finetune", ["tensor_parallel=3"], 3, "tensor_parallel"),  # nor the 4 heads
    ("full_finetune", ["tensor_parallel=4"], 4, "tensor_parallel"),  # nor the 2 key/value heads
    ("full_finetune", ["tensor_parallel=2", *TINY_LLAMA, "model.intermediate_dim=99",
                       "model.vocab_size=384"], 2, "tensor_parallel"),  # nor an MLP of 99
    ("full_finetune", ["tensor_parallel=2", *TINY_LLAMA, "model.intermediate_dim=128",
                       "model.vocab_size=383"], 2, "tensor_parallel"),  # nor a vocabulary of 383
    ("full_finetune", ["tensor_parallel=2", "batch_size=33"], 4, "batch_size"),  # over 2 dp ranks
    ("full_finetune", ["tensor_parallel=2", "data_parallel=hsdp", "hsdp_shard_size=3"], 4,
     "hsdp_shard_size"),
    ("full_finetune", ["tensor_parallel=2", "data_parallel=zero1"], 4, "data_parallel"),
    ("full_finetune", ["tensor_parallel=2", "data_parallel=zero3", "cpu_offload=true"], 4,
     "cpu_offload"),
    ("full_finetune", ["tensor_parallel=2", "float8=true"], 2, "float8"),
    ("full_finetune", ["tensor_parallel=2", "fused_loss=false"], 2, "fused_loss"),
    ("full_finetune", ["tensor_parallel=8"], 4, "tensor_parallel"),  # more than the launch's (one node's) 4
    ("full_finetune", ["tensor_parallel=abc"], 2, "tensor_parallel"),
    ("full_finetune", ["tensor_parallel=Auto"], 2, "tensor_parallel"),
    ("full_finetune", ["tensor_parallel=auto", "float8=true"], 2, "float8"),  # auto may split: refused as TP is
    ("eval", ["tensor_parallel=auto"], 2, "tensor_parallel"),  # evaluation plans no memory: a number
    ("lora_finetune", ["tensor_parallel=2", "model.quantize_base=true"], 2, "tensor_parallel"),
    ("lora_finetune", ["tensor_parallel=2", "model.use_dora=true"], 2, "tensor_parallel"),
    ("full_finetune", ["sequence_parallel=true"], 2, "sequence_parallel"),  # with tensor_parallel 1
    ("full_finetune", ["tensor_parallel=2", "sequence_parallel=maybe"], 2, "sequence_parallel"),
    # Generation splits one model over every process of its launch; evaluation, like training.
    ("generate", ["tensor_parallel=2"], 1, "tensor_parallel"),
    ("generate", [], 2, "tensor_parallel"),
    ("generate", ["tensor_parallel=2"], 4, "tensor_parallel"),
    ("generate", ["tensor_parallel=4"], 4, "tensor_parallel"),  # the 2 key/value heads
    ("generate", ["tensor_parallel=0"], 1, "tensor_parallel"),
    ("eval", ["tensor_parallel=2"], 3, "tensor_parallel"),
    ("eval", ["tensor_parallel=4"], 4, "tensor_parallel"),
    ("eval", ["tensor_parallel=2", "data_parallel=zero1"], 4, "data_parallel"),
    ("distill", ["tensor_parallel=2", "data_parallel=zero1"], 4, "data_parallel"),
    ("distill", ["tensor_parallel=4"], 4, "tensor_parallel"),  # the student's 2 key/value heads
    # expert_parallel: a positive divisor of the data-parallel processes, under zero2/zero3, without TP or offloading,
    # on a model with experts it divides (the demo Llama has none).
    ("full_finetune", ["expert_parallel=0"], 2, "expert_parallel"),
    ("full_finetune", ["expert_parallel=two"], 2, "expert_parallel"),
    ("full_finetune", ["expert_parallel=2", "data_parallel=zero3", "batch_size=30"], 3, "expert_parallel"),
    ("full_finetune", ["expert_parallel=2", "data_parallel=ddp"], 2, "data_parallel"),
    ("lora_finetune", ["expert_parallel=2", "data_parallel=hsdp"], 2, "data_parallel"),
    ("full_finetune", ["expert_parallel=2", "data_parallel=zero3", "tensor_parallel=2"], 4, "tensor_parallel"),
    ("full_finetune", ["expert_parallel=2", "data_parallel=zero3", "cpu_offload=true"], 2, "cpu_offload"),
    ("full_finetune", ["expert_parallel=2", "data_parallel=zero3"], 2, "expert_parallel"),  # no experts
    # context_parallel: a positive divisor of the data-parallel processes; alltoall needs it to divide each TP rank's
    # heads (the demo Llama's 4); what it does not combine with yet is refused by name.
    ("full_finetune", ["context_parallel=0"], 2, "context_parallel"),
    ("full_finetune", ["context_parallel=two"], 2, "context_parallel"),
    ("full_finetune", ["context_parallel=3"], 2, "context_parallel"),  # does not divide 2 processes
    ("full_finetune", ["context_parallel=2", "tensor_parallel=2"], 2, "context_parallel"),  # nor 1 dp rank
    ("lora_finetune", ["context_parallel=2", "context_parallel_method=zigzag"], 2, "context_parallel_method"),
    ("full_finetune", ["context_parallel=8", "context_parallel_method=alltoall", "batch_size=32"], 8,
     "context_parallel"),  # 4 heads
    ("full_finetune", ["context_parallel=4", "tensor_parallel=2", "context_parallel_method=alltoall"], 8,
     "context_parallel"),  # 2 heads per TP rank
    ("full_finetune", ["context_parallel=2", "batch_size=33"], 4, "batch_size"),  # over 2 row-reading ranks
    ("full_finetune", ["context_parallel=2", "tensor_parallel=2", "sequence_parallel=true"], 4,
     "sequence_parallel"),
    ("full_finetune", ["context_parallel=2", "micro_batch_size=auto"], 2, "micro_batch_size"),
    ("lora_finetune", ["context_parallel=2", "tensor_parallel=auto"], 2, "tensor_parallel"),
    ("full_finetune", ["context_parallel=2", "data_parallel=zero3", "expert_parallel=2", *TINY_MOE], 4,
     "expert_parallel"),
    ("full_finetune", ["context_parallel=2", *TINY_MOE], 2, "context_parallel"),  # experts' per-row loss
    ("full_finetune", ["context_parallel=2", "model._component_=toolkit.models.phi3.phi4_mini"], 2,
     "context_parallel"),  # LongRoPE's short or long factors, chosen by each rank's positions
    ("preference_finetune", ["context_parallel=2"], 2, "context_parallel"),  # not read by these recipes (yet)
    ("distill", ["context_parallel=2"], 2, "context_parallel"),
]


@pytest.mark.parametrize(("recipe", "overrides", "nproc", "key"), TP_CASES, ids=lambda v: str(v))
def test_tensor_parallel_refuses_what_does_not_fit_in_one_line(recipe, overrides, nproc, key, capsys):
    assert main(["validate", f"{recipe}/demo", "--nproc_per_node", str(nproc), *overrides]) == 2
    _one_problem(capsys.readouterr().err, key, recipe)


def test_tensor_parallel_fits_and_is_refused_before_launching(tmp_path, monkeypatch, capsys):
    assert main(["validate", "full_finetune/demo", "--nproc_per_node", "4", "tensor_parallel=2"]) == 0
    # auto, with the other autos: planned at run time (the memory plan counts the split now).
    assert main(["validate", "full_finetune/demo", "--nproc_per_node", "4", "tensor_parallel=auto",
                 "data_parallel=auto", "micro_batch_size=auto"]) == 0
    assert main(["validate", "full_finetune/demo", "--nproc_per_node", "2", "tensor_parallel=2",
                 "data_parallel=auto", "micro_batch_size=auto"]) == 0
    monkeypatch.chdir(tmp_path)
    args = ["run", "--nproc_per_node", "4", "lora_finetune_distributed", "--config", "demo", "tensor_parallel=2"]
    assert main([*args, "data_parallel=zero1"]) == 2
    _one_problem(capsys.readouterr().err, "data_parallel", "lora_finetune")
    assert main(["run", "--nproc_per_node", "4", "full_finetune_distributed", "--config", "demo",
                 "tensor_parallel=8"]) == 2
    _one_problem(capsys.readouterr().err, "tensor_parallel", "full_finetune")
    assert list(tmp_path.iterdir()) == []  # nothing written, no process started


def test_several_problems_are_all_reported_at_once(capsys):
    assert main(["validate", "full_finetune/demo", "epochs=0", "overwrite=flase", "optimizer.lr=-1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("tune: error: ") for line in lines), lines


def test_a_typo_in_the_config_file_itself_is_named_once(tmp_path: Path, capsys):
    # One mistake, one line: the typo with the key it stands for, not also that key reported missing (and no rule
    # reading the missing key runs on its absence), in tune validate and in tune run before any process starts.
    demo = (configs_dir() / "full_finetune" / "demo.yaml").read_text()
    for key, typo in [("max_steps", "max_step"), ("batch_size", "batch_sise")]:
        path = tmp_path / f"{typo}.yaml"
        path.write_text(demo.replace(f"\n{key}:", f"\n{typo}:"))
        expected = [f"tune: error: {path}: {typo}: not a key this recipe reads; did you mean '{key}'?"]
        assert main(["validate", "--recipe", "full_finetune", str(path)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == expected
        assert main(["run", "full_finetune_single_device", "--config", str(path), f"output_dir={tmp_path / 'o'}"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == expected
    assert not (tmp_path / "o").exists()


def test_a_finished_run_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys):
    # The recipe's rank 0 refused it too, but only after torchrun had started every process (15 s on 2 cores).
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "full_finetune_demo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = sorted(p.name for p in run.iterdir())
    assert main(["run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "demo"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tune: error: output_dir: ") and "already holds a run (metrics.jsonl)" in line, line
    assert "overwrite=true" in line
    assert sorted(p.name for p in run.iterdir()) == before  # nothing launched, nothing written


def test_tensor_parallel_auto_runs_and_says_what_it_picked(tmp_path):
    # One process: nothing to split, so auto keeps tensor parallelism off and says so, with the numbers, in the one
    # line data_parallel auto prints too. (Which degree auto picks on several processes: tests/training/
    # test_memory_tp.py and tests/cli/test_plan.py, on the same plan_parallelism the recipe calls.)
    from tests.launch import run_tune_here

    result = run_tune_here(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'run'}", "max_steps=1",
        "~eval_tasks", "~validation_dataset", "tensor_parallel=auto", "data_parallel=auto", "device_memory_gb=8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if "tensor_parallel: auto ->" in line]
    assert "data_parallel, tensor_parallel: auto -> ddp, tensor_parallel 1 (ddp needs " in line


def test_tensor_parallel_auto_that_fits_nowhere_is_one_line_and_touches_no_folder(tmp_path):
    from tests.launch import run_tune_here

    result = run_tune_here(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'run'}",
        "~eval_tasks", "tensor_parallel=auto", "device_memory_gb=0.001",
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tune: error: tensor_parallel: auto: no layout of 1 process(es) fits 0.9 MiB usable"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("config", "override"),
    [
        ("full_finetune/qwen3_moe_30b_a3b", "model.router_aux_loss_coef=-0.1"),
        ("lora_finetune/mixtral_8x7b_lora", "model.router_aux_loss_coef=abc"),
    ],
)
def test_a_bad_router_aux_loss_coef_is_refused_in_one_line(config, override, capsys):
    # The mixture-of-experts sizes take the weight of their load-balancing loss; the demos have no such key.
    assert main(["validate", config, override]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"tune: error: {configs_dir() / config}.yaml: model.router_aux_loss_coef: "), line


@pytest.mark.parametrize("overrides", [
    ["context_parallel=2"],
    ["context_parallel=4", "context_parallel_method=alltoall"],
    ["context_parallel=2", "tensor_parallel=2", "data_parallel=zero3", "context_parallel_method=alltoall"],
])
@pytest.mark.parametrize("recipe", ["full_finetune", "lora_finetune"])
def test_context_parallel_layouts_that_fit_pass(recipe, overrides):
    assert main(["validate", f"{recipe}/demo", "--nproc_per_node", "4", *overrides]) == 0
