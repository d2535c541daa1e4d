"""toolkit.recipe_setup: the layout planned from one statement of each degree, the loaders, the loop's bookkeeping
and the header line. (The recipes that use it run end to end in tests/recipes.)"""

import contextlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import DataLoader

from toolkit.checkpoint import StepCheckpointer, TrainingState
from toolkit.config import apply_overrides, load_config
from toolkit.data import GlobalBatchSampler, demo_data_warning
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_demo, lora_llama3_demo
from toolkit.parallel import DistributedEnv, parallel_dims
from toolkit.paths import configs_dir
from toolkit.planning import ParallelPlan, StepKernels
from toolkit.recipe_setup import (
    Data,
    Layout,
    Run,
    TrainingLoop,
    build_data,
    describe_backend,
    describe_method,
    describe_optimizer,
    claim_output,
    plan_layout,
    print_header,
    print_summary,
    row_padding,
)
from toolkit.training import MetricsLogger, StepResult, precision_policy

CPU = torch.device("cpu")


def _run(world_size: int) -> Run:
    env = DistributedEnv(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size, device=CPU,
                         backend="gloo" if world_size > 1 else None)
    return Run(env, precision_policy("fp32", device=CPU), Path("unused"), resume=None, base_checkpoint=None)


def _config(**overrides) -> OmegaConf:
    return OmegaConf.create({
        "data_parallel": "ddp", "cpu_offload": False, "batch_size": 32, "micro_batch_size": 4, "max_seq_len": 64,
        "dtype": "fp32", "activation_checkpointing": False, "hsdp_shard_size": None, "clip_grad_norm": 1.0,
        "optimizer": {"_component_": "torch.optim.AdamW"}, "seed": 0, "epochs": 1, "max_steps": None,
        **overrides,
    })


@pytest.fixture
def four_ranks():
    """A process group of 4 ranks in this one process (torch's fake backend: collectives do nothing), in which the
    mesh of a 4-process job can be built."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield _run(4)
    finally:
        dist.destroy_process_group()


def test_one_statement_of_a_degree_lays_out_both_the_plan_and_the_mesh(four_ranks):
    with torch.device("meta"):
        model = llama3_demo()

    def layout(**overrides) -> Layout:
        return plan_layout(_config(**overrides), run=four_ranks, model=model, kernels=StepKernels())

    # tensor_parallel, given once in the config: the plan splits the batch over 4 / 2 data-parallel ranks, and the
    # mesh the run builds has that shape, with no second statement of the degree.
    split = layout(tensor_parallel=2)
    assert split.dims == split.plan.dims and (split.dims.tp, split.dims.dp_size) == (2, 2)
    assert split.plan.accumulation_steps == 32 // (2 * 4)
    assert split.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert (split.mesh["tp"].size(), split.mesh["dp_replicate"].size()) == (2, 2)
    assert split.dp_group is not None  # the peers at this rank's TP position, not every rank

    whole = layout(tensor_parallel=1)
    assert (whole.dims.tp, whole.dims.dp_size, whole.plan.accumulation_steps) == (1, 4, 32 // (4 * 4))
    assert (whole.mesh["tp"].size(), whole.mesh["dp_replicate"].size()) == (1, 4)
    assert whole.dp_group is None and whole.context_parallel is None

    # context_parallel, a recipe's own degree: its groups share rows, so the batch splits over 2 reading ranks.
    shared = plan_layout(_config(), run=four_ranks, model=model, kernels=StepKernels(), context_parallel=2)
    assert (shared.dims.cp, shared.dims.batch_ranks, shared.plan.accumulation_steps) == (2, 2, 32 // (2 * 4))
    assert shared.context_parallel.size == 2

    # A degree the job cannot take is refused by the plan, naming the key, before any mesh is built.
    with pytest.raises(UserError, match="^tensor_parallel: 3 does not divide the 4 processes"):
        layout(tensor_parallel=3)


def _one_process_layout(micro_batch_size: int, tp: int = 1) -> Layout:
    dims = parallel_dims(strategy="ddp", world_size=tp, local_world_size=tp, device_type="cpu", tensor_parallel=tp)
    plan = ParallelPlan(dims, micro_batch_size=micro_batch_size, accumulation_steps=1)
    return Layout(plan, mesh=None, dp_group=None, context_parallel=None, autocast=contextlib.nullcontext())


def numbers(tokenizer: str, count: int = 5) -> list[int]:
    """A dataset the config names (``_component_: tests.test_recipe_setup.numbers``), built with the tokenizer."""
    assert tokenizer == "the tokenizer"
    return list(range(100, 100 + count))


def refused(tokenizer: str) -> list:
    raise AssertionError("the recipe gave its own held-out set; the config's is not built")


def test_build_data_takes_the_held_out_set_from_the_config_or_the_recipe():
    layout = _one_process_layout(micro_batch_size=2)
    cfg = _config(batch_size=4, epochs=3, validation_dataset={"_component_": "tests.test_recipe_setup.numbers"})
    data = build_data(cfg, layout=layout, dataset=list(range(10)), collate=torch.tensor, tokenizer="the tokenizer")
    assert data.total_steps == 3 * (10 // 4)  # whole global batches only; epochs of them
    assert [batch.tolist() for batch in data.val_loader] == [[100, 101], [102, 103], [104]]
    assert len(list(data.loader)) == 10 // 4 * 2  # micro-batches of the plan's size
    assert build_data(_config(batch_size=4, epochs=3, max_steps=4), layout=layout, dataset=list(range(10)),
                      collate=torch.tensor).total_steps == 4
    assert build_data(_config(batch_size=4), layout=layout, dataset=list(range(10)), collate=torch.tensor,
                      ).val_loader is None

    recipes_own = _config(batch_size=4, validation_dataset={"_component_": "tests.test_recipe_setup.refused"})
    data = build_data(recipes_own, layout=layout, dataset=list(range(8)), collate=torch.tensor,
                      validation_dataset=[10, 11, 12], val_collate=lambda rows: rows)
    assert list(data.val_loader) == [[10, 11], [12]]


def test_rows_are_padded_to_the_parts_the_layout_cuts_them_into():
    cfg = _config(sequence_parallel=True, compile=True, max_seq_len=64)
    padding = row_padding(cfg, layout=_one_process_layout(1, tp=2), part_multiple=16)
    assert padding["pad_to_multiple_of"] == 32 and all(n % 32 == 0 for n in padding["lengths"])
    assert row_padding(_config(), layout=_one_process_layout(1)) == {"pad_to_multiple_of": 1, "lengths": None}


class _Printed:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, line: str) -> None:
        self.lines.append(line)


def test_the_header_says_the_recipe_s_words_then_the_run_s_shape(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    dims = parallel_dims(strategy="ddp", world_size=1, local_world_size=1, device_type="cpu")
    plan = ParallelPlan(dims, micro_batch_size=16, accumulation_steps=2, reasons=("micro_batch_size: auto -> 16",))
    layout = Layout(plan, mesh=None, dp_group=None, context_parallel=None, autocast=contextlib.nullcontext())
    data = Data(sampler=None, loader=None, val_loader=None, total_steps=30)
    log = _Printed()
    print_header(log, "dpo (beta 0.1)", run=_run(1), layout=layout, data=data, batch_size=32, batch_unit="pairs",
                 notes=["float8 matmuls in 4 layers"])
    assert log.lines == [
        "dpo (beta 0.1)",  # (a recipe that passes no loop: its own words only)
        # One process: no data-parallel strategy named, it has nothing to spread over.
        "1 process on cpu (2 threads), fp32; global batch 32 pairs = 1 x 16 x 2 accumulation steps; 30 steps",
        "micro_batch_size: auto -> 16",
        "float8 matmuls in 4 layers",
    ]


def test_the_header_names_the_method_optimizer_and_model_code_and_the_strategy_of_several(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    dims = parallel_dims(strategy="zero3", world_size=2, local_world_size=2, device_type="cpu")
    layout = Layout(ParallelPlan(dims, micro_batch_size=8, accumulation_steps=1), mesh=None, dp_group=None,
                    context_parallel=None, autocast=contextlib.nullcontext())
    loop = _loop(tmp_path, total_steps=3, config={"model": {"_component_": "toolkit.models.llama3.llama3_demo"},
                                                   "optimizer": {"_component_": "torch.optim.AdamW"}})
    log = _Printed()
    print_header(log, "0.89M parameters", run=_run(2), layout=layout, loop=loop, batch_size=16,
                 data=Data(sampler=None, loader=None, val_loader=None, total_steps=3))
    assert log.lines == ["0.89M parameters; full fine-tuning, fused AdamW, llama3",
                         ("2 processes on cpu (1 thread each), zero3, fp32; global batch 16 = 2 x 8 x 1 "
                          "accumulation step; 3 steps")]


@pytest.mark.parametrize("overrides, method", [
    ({}, "LoRA"), ({"use_dora": True}, "DoRA"), ({"quantize_base": True}, "QLoRA"),
    ({"use_dora": True, "quantize_base": True}, "QDoRA"),
])
def test_the_method_is_read_from_the_model_on_the_meta_device(overrides, method):
    with torch.device("meta"):
        model = lora_llama3_demo(lora_attn_modules=["q_proj", "v_proj"], **overrides)
        plain = llama3_demo()
    assert describe_method(model) == method and describe_method(plain) == "full fine-tuning"


def test_the_optimizer_and_model_code_in_a_few_words():
    def optimizer(component: str, **options) -> str:
        return describe_optimizer(OmegaConf.create({"_component_": component, **options}))

    assert optimizer("torch.optim.AdamW") == "fused AdamW"  # torch's Adam(W) is fused by default
    assert optimizer("torch.optim.AdamW", fused=False) == "AdamW"
    assert optimizer("torchao.optim.AdamW8bit") == "8-bit AdamW"
    assert optimizer("toolkit.optim.Muon") == "Muon"
    assert describe_optimizer(OmegaConf.create({"_component_": "torch.optim.SGD"}), in_backward=True) == (
        "SGD stepped in backward")

    class Backend(nn.Module):  # what the transformers backend keeps of the Hugging Face config
        hf_config = OmegaConf.create({"model_type": "olmo2"})

    assert describe_backend(Backend(), OmegaConf.create({"_component_": "toolkit.models.build_from_hf"})) == (
        "transformers (olmo2)")
    assert describe_backend(nn.Linear(1, 1), OmegaConf.create({"_component_": "toolkit.models.qwen3.qwen3_8b"})) == (
        "qwen3")


def _summary(tmp_path: Path, capsys, *, model: str, final_parts: tuple[str, ...], base: str | None) -> list[str]:
    """The summary of a 2-step run on ``model`` whose ``final/`` holds ``final_parts`` (nothing: a Hugging Face
    model), validated at steps 1 and 2 and its eval tasks scored before and after."""
    out = tmp_path / "run"
    losses = iter([2.5, 1.25])
    loop = _loop(out, total_steps=2, config={"model": {"_component_": model}},
                 validate=lambda: {"val_loss": next(losses)})
    loop._accuracy.update(before=0.125, after=0.5)
    for step in (1, 2):
        loop.step = step
        loop.validation()
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    for part in final_parts or ("",):
        (out / "final" / part).mkdir(parents=True, exist_ok=True)
    capsys.readouterr()
    run = Run(_run(1).env, precision_policy("fp32", device=CPU), out, resume=None, base_checkpoint=base)
    print_summary(loop, run=run, final=out / "final")
    return capsys.readouterr().out.splitlines()


def test_the_summary_says_how_it_went_where_the_outputs_are_and_what_to_run_next(tmp_path, capsys):
    out = tmp_path / "run"
    lines = _summary(tmp_path, capsys, model="toolkit.models.llama3.llama3_demo", final_parts=(), base=None)
    assert re.fullmatch(r"done: 2 steps in 0m0\ds; best val_loss 1\.2500 at step 2; held-out accuracy 12\.5% -> 50\.0%",
                        lines[0]), lines
    assert lines[1:] == [
        (f"outputs in {out}: final/ (the model, Hugging Face files), checkpoints/ (step checkpoints), "
         "metrics.jsonl, config.yaml"),
        f"next: tune run generate --config demo checkpointer.checkpoint_dir={out / 'final'}",
        f"      tune export {out} --output {out}_hf   # the newest step checkpoint as Hugging Face files",
    ]


def test_the_summary_of_an_adapter_generates_on_its_base_and_merges_it(tmp_path, capsys):
    out = tmp_path / "run"
    lines = _summary(tmp_path, capsys, model="toolkit.models.llama3.lora_llama3_demo", final_parts=("adapter",),
                     base="models/base")
    adapter = out / "final" / "adapter"
    assert lines[1].startswith(f"outputs in {out}: final/adapter/ (PEFT adapter), checkpoints/ (step checkpoints)")
    assert lines[2:4] == [
        f"next: tune run generate --config demo checkpointer.checkpoint_dir=models/base adapter_dir={adapter}",
        f"      tune merge --base models/base --adapter {adapter} --output {out}_merged",
    ]


def test_the_summary_of_a_model_generate_does_not_ship_a_config_for_says_to_make_one(tmp_path, capsys):
    out = tmp_path / "run"
    lines = _summary(tmp_path, capsys, model="toolkit.models.qwen3.qwen3_8b", final_parts=("adapter", "merged"),
                     base="models/base")
    assert lines[1].startswith(f"outputs in {out}: final/adapter/ (PEFT adapter), final/merged/ (merged model), ")
    assert lines[2:4] == [  # the merged model: nothing left to merge
        "next: tune cp generate/demo my_generate.yaml   # then set its model and tokenizer to this run's",
        f"      tune run generate --config my_generate.yaml checkpointer.checkpoint_dir={out / 'final' / 'merged'}",
    ]


def _loop(
    tmp_path: Path, *, total_steps: int, step: int = 0, validate=None, config: dict | None = None
) -> TrainingLoop:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = [torch.randn(2) for _ in range(8)]
    sampler = GlobalBatchSampler(len(dataset), global_batch_size=4, rank=0, world_size=1, seed=0)
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), sampler)
    return TrainingLoop(
        state=state, loader=DataLoader(dataset, batch_size=2, sampler=sampler), accumulation_steps=2,
        checkpoints=StepCheckpointer(tmp_path, every_n_steps=None),
        log=MetricsLogger(tmp_path, enabled=True, total_steps=total_steps, initial_step=step, progress_bar=False),
        step=step, total_steps=total_steps, max_grad_norm=None, output_dir=tmp_path, device=CPU, rank=0,
        gather_every_n_steps=1, config=OmegaConf.create(config or {}), strategy="ddp", resumed=step > 0,
        validate=validate,
        validate_every_n_steps=2,
    )


def _train(loop: TrainingLoop) -> list[int]:
    """The recipes' loop, with a least-squares loss: the steps it ran."""
    ran = []
    for epoch, micro_batches in loop.global_batches():
        assert len(micro_batches) == 2 and loop.state.model.training
        loss = sum(loop.state.model(batch).pow(2).mean() for batch in micro_batches) / 2
        loss.backward()
        loop.optimizer_step(StepResult(loss=float(loss.detach()), num_tokens=4, num_positions=4), epoch=epoch)
        loop.end_step()
        ran.append(loop.step)
    loop.finish()
    return ran


def test_the_loop_runs_to_the_last_step_across_epochs_validating_when_due(tmp_path):
    calls = []

    def validate() -> dict:
        calls.append(True)
        return {"val_loss": float(len(calls))}

    loop = _loop(tmp_path, total_steps=5, validate=validate)
    assert _train(loop) == [1, 2, 3, 4, 5]  # 2 steps an epoch: the data starts over, the loop stops at the last
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records if "loss" in r] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]
    assert [(r["step"], r["val_loss"]) for r in records if "val_loss" in r] == [(2, 1.0), (4, 2.0)]
    # After the last step: validated now, once (the loop did not at step 5), and logged under that step.
    assert loop.final_validation() == {"val_loss": 3.0} and loop.final_validation() == {"val_loss": 3.0}
    assert len(calls) == 3


def test_a_resumed_loop_runs_only_the_steps_left(tmp_path):
    loop = _loop(tmp_path, total_steps=4, step=3)
    assert _train(loop) == [4]
    assert _train(_loop(tmp_path, total_steps=4, step=4)) == []  # resumed at the end: nothing to run


def test_a_real_model_on_the_demo_data_is_warned_about_once_the_output_is_claimed(tmp_path, caplog) -> None:
    cfg = load_config(configs_dir() / "full_finetune/demo.yaml")
    apply_overrides(cfg, ["model._component_=toolkit.models.llama3.llama3_2_1b", "progress_bar=false",
                          "tokenizer={_component_: toolkit.tokenizers.from_pretrained, path: /models/llama}"])
    env = DistributedEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend=None)
    run = Run(env, precision_policy("fp32", device=CPU), tmp_path / "out", resume=None, base_checkpoint=None)
    with caplog.at_level(logging.WARNING, logger="toolkit.recipe_setup"):
        claim_output(cfg, run=run, step=0, total_steps=1).close()
    # The last set-up step that can fail on the user's input: a bad input shows its one error line and nothing else.
    assert [r.getMessage() for r in caplog.records] == [demo_data_warning(cfg)]
