"""Promise 1 across tensor-parallel layouts: one process, tp=2, tp=4, ddp x tp=2, zero2 x tp=2, zero3 x tp=2 and hsdp x
tp=2 (as one replica sharded over 2 pairs, and as 2 replicas) train the same model from the same global batches and then generate
the same tokens; so does the recipe, and its step checkpoints resume on the same layout (bitwise) and on one process;
the generate and eval recipes on one model split over 2 processes give what they give on one. On 2 processes (one
launch of recipe runs): step checkpoints resumed across tp=2, dp=2 (zero3) and one process; the LoRA recipe on tp=2
(and, in the 4-process launch, on zero3 x tp=2) trains like one process, and its PEFT adapter and merged model,
written from each rank's shards, load in `peft` and `transformers`; `tune export` of a TP run's step checkpoint gives
its final export.

One torchrun launch of 4 processes (tests/training/_tp_worker.py; conftest.py's ``four_processes``, which
test_memory_tp.py and test_parallel_parity.py read too) trains a tiny Llama 3 (rope scaling), Qwen 2.5 (q/k/v
biases, tied embeddings) and Gemma 2 (soft-caps, sliding window, tied), each full fine-tuned, with LoRA (on Llama's
output projection too) and with DoRA, on every layout (the worker's RUNS: 45 runs, and 6 more with ZeRO-2 and
sequence parallelism), 5 steps each; this process trains the one-process reference of each case with the same code
and compares. fp32 on CPU: the layouts differ only in the order of float sums (split matmuls, reductions over
ranks, micro-batches padded differently), so losses agree to about 1e-7 relative and the weights after 5 AdamW
steps to a few 1e-6; we allow 1e-5 for both.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, as_in_a_subprocess, run_recipe_here, run_recipes, run_tune_here
from tests.training import _tp_worker as worker
from toolkit.parallel import ParallelDims


@pytest.fixture(scope="module")
def layouts(four_processes) -> dict:
    return torch.load(four_processes / "results.pt", weights_only=True)


@pytest.fixture(scope="module")
def references() -> dict:
    # One thread, as each worker has: these tiny matmuls run 30x slower on a pool of threads that another process
    # keeps busy.
    with as_in_a_subprocess():
        one_process = ParallelDims("ddp", dp_replicate=1, dp_shard=1)
        return {case: worker.train(*case, one_process) for case in sorted({(n, m) for n, m, _ in worker.RUNS})}


def _assert_trains_like_one_process(ours: dict, reference: dict, mode: str) -> None:
    torch.testing.assert_close(ours["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["norms"], reference["norms"], rtol=1e-5, atol=0)
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-5, atol=1e-5, msg=key)
    # The run trained: weights that did not move would agree with anything.
    assert reference["moved"] > 1e-3
    # Each rank's embedding gradient is its part of the table (a whole one on every rank would also train alike).
    rows, grad_rows = ours["embedding_rows"]
    assert rows <= worker.VOCAB // 2 and grad_rows in (rows, None if mode != "full" else rows)


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_layout_trains_like_one_process(run, layouts, references):
    name, mode, layout = run
    _assert_trains_like_one_process(layouts[f"{name}/{mode}/{layout}"], references[(name, mode)], mode)


def test_the_hsdp_layouts_shard_or_replicate_over_the_pairs_as_their_shard_size_says(layouts):
    # (dp_replicate, dp_shard, tp) of each: hsdp_shard_size 2 shards over both pairs (a degenerate replicate
    # dimension), 1 replicates over them (a degenerate shard dimension), so that between them both dimensions of
    # HSDP's 2-D mesh carry 2 ranks once. Both at once (2 x 2 x tp 2) would take 8 processes: a launch of 30 to 50 s
    # on this 2-core machine for one tiny case (measured), more than the suite's budget allows.
    assert layouts["llama/full/hsdp_tp2"]["dims"] == (1, 2, 2)
    assert layouts["qwen/full/hsdp_r2_tp2"]["dims"] == (2, 1, 2)


@pytest.mark.parametrize("run", [r for r in worker.RUNS if r[2] in worker.SEQUENCE_PARALLEL], ids="/".join)
def test_sequence_parallelism_splits_the_norms_positions(run, layouts):
    # The equality above would hold as well if the sequence were never split: the first norm of every training
    # forward saw 1/tp of the micro-batch's positions (and a layout without it, all of them).
    name, mode, layout = run
    ours, tp = layouts[f"{name}/{mode}/{layout}"], worker.LAYOUTS[worker.SEQUENCE_PARALLEL[layout]][1]
    assert ours["norm_positions"] == [length // tp for length in ours["positions"]]
    plain = next(r for n, r in layouts.items() if not n.endswith("_sp"))
    assert plain["norm_positions"] == plain["positions"]


@pytest.mark.parametrize("run", [r for r in worker.RUNS if r[1] != "full"], ids=lambda run: "/".join(run))
def test_every_layout_merges_adapters_from_its_own_shards(run, layouts, references):
    # What the LoRA recipe exports as its merged model, computed on each rank's shards of the base and the adapters:
    # no rank holds more of any merged weight than of the base weight (the model is never gathered), and the
    # weights gathered afterwards are one process's (tolerance as for the weights).
    name, mode, layout = run
    ours, reference = layouts[f"{name}/{mode}/{layout}"], references[(name, mode)]
    assert ours["gathered_by_merge"] == []
    assert ours["merged"].keys() == reference["merged"].keys()
    for key, weight in reference["merged"].items():
        torch.testing.assert_close(ours["merged"][key], weight, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_layout_generates_what_one_process_does(run, layouts, references):
    # The trained model of each layout, its KV cache holding each rank's heads: the same tokens, greedy and sampled
    # (the gathered logits are the same on every rank, so every rank draws the same token), and the prompt's logits
    # to float rounding.
    name, mode, layout = run
    _assert_generates_like_one_process(layouts[f"{name}/{mode}/{layout}"], references[(name, mode)])


def _assert_generates_like_one_process(ours: dict, reference: dict) -> None:
    assert ours["greedy"] == reference["greedy"]
    assert ours["sampled"] == reference["sampled"]
    assert len(set(reference["sampled"])) > 1  # draws that always gave one token would agree with anything
    torch.testing.assert_close(ours["logits"], reference["logits"], rtol=1e-5, atol=1e-5)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _assert_same_weights(ours: Path, expected: Path) -> None:
    """The two runs exported the same tensors, bitwise."""
    weights, reference = _weights(ours), _weights(expected)
    assert weights.keys() == reference.keys()
    for key, weight in reference.items():
        assert torch.equal(weights[key], weight), key


def test_the_recipe_on_zero3_over_tensor_parallel_pairs_trains_like_one_process(four_processes, one_process):
    # The demo recipe in this process (one_process) against the worker's 4 processes (2 ZeRO-3 ranks of TP pairs):
    # the same losses, tokens, gradient norms and exported weights. The split matmuls sum in another order: after 5
    # AdamW steps a weight may differ by 1e-5 (measured: one of the 0.9M by 2e-6; Adam's 1/sqrt(v) enlarges
    # rounding-level gradient differences on entries with near-zero gradients, see test_parallel_parity.py).
    ours, reference = _records(four_processes / "recipe"), _records(one_process)
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in reference], rtol=1e-5, atol=0)
    # Each token counted once, not once per rank of its pair, and each gradient at its size (AdamW alone would hide a
    # gradient scaled by 2; the clipped norm does not).
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in reference]
    torch.testing.assert_close([r["grad_norm"] for r in ours], [r["grad_norm"] for r in reference], rtol=1e-5, atol=0)
    weights, expected = _weights(four_processes / "recipe"), _weights(one_process)
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, rtol=1e-4, atol=1e-5, msg=key)


def test_a_resume_on_the_same_layout_is_bitwise_exact(four_processes):
    uninterrupted, resumed = four_processes / "recipe", four_processes / "recipe_resumed"
    assert [r["step"] for r in _records(resumed)] == list(range(worker.RESUMED_AT + 1, 6))
    assert [r["loss"] for r in _records(resumed)] == [r["loss"] for r in _records(uninterrupted)][worker.RESUMED_AT :]
    _assert_same_weights(resumed, uninterrupted)


def test_a_tensor_parallel_checkpoint_resumes_on_one_process(four_processes, tmp_path):
    # DCP reshards the TP (and ZeRO-3) shards of the model and optimizer state to whole tensors; the sample order and
    # the RNG state carry over. Another layout sums in another order: float rounding.
    checkpoint = four_processes / "recipe" / "checkpoints" / f"step_{worker.RESUMED_AT}"
    run_recipe_here("full_finetune", "demo", *worker.RECIPE, f"output_dir={tmp_path}", f"resume_from={checkpoint}")
    expected = [r["loss"] for r in _records(four_processes / "recipe")][worker.RESUMED_AT :]
    torch.testing.assert_close([r["loss"] for r in _records(tmp_path)], expected, rtol=1e-5, atol=0)


# Few enough samples to keep the evaluation short; generation stops at the byte tokenizer's end of sequence.
EVAL = ["dataset.num_samples=32", "eval_tasks.num_samples=12", "micro_batch_size=8"]
# The random model of the seed (checkpointer.checkpoint_dir=null: each process draws the whole tensors and keeps its
# part): the 5-step model's reply is its end-of-sequence token at once, even sampled, which would agree with anything.
# The eval run below loads the trained checkpoint.
PROMPT = ["prompt=reverse: tensor", "checkpointer.checkpoint_dir=null"]


def _split_over_two_runs(four_processes: Path) -> dict[str, RecipeRun]:
    checkpoint = four_processes / "recipe" / "final"
    return {
        "generate": RecipeRun("generate", four_processes / "generate_tp2", "tensor_parallel=2", *PROMPT),
        "eval": RecipeRun("eval", four_processes / "eval_tp2", "tensor_parallel=2",
                          f"checkpointer.checkpoint_dir={checkpoint}", *EVAL),
    }


@pytest.fixture(scope="module")
def split_over_two(two_process_launch) -> dict[str, RecipeRun]:
    """The generate and eval recipes, tensor_parallel=2 on 2 processes (in the module's one 2-process launch,
    :func:`two_process_launch`)."""
    return {name: two_process_launch[name] for name in ("generate", "eval")}


def test_the_generate_recipe_split_over_two_processes_replies_as_one_does(split_over_two):
    one = run_tune_here("run", "generate", "--config", "demo", *PROMPT)
    assert one.returncode == 0, one.stderr
    assert split_over_two["generate"].stdout() == one.stdout
    assert one.stdout.strip()  # a reply, not nothing twice


def test_the_eval_recipe_split_over_two_processes_scores_as_one_does(four_processes, split_over_two, tmp_path):
    run_recipe_here("eval", "demo", f"checkpointer.checkpoint_dir={four_processes / 'recipe' / 'final'}", *EVAL,
                    f"output_dir={tmp_path}")
    one = json.loads((tmp_path / "eval.json").read_text())
    two = json.loads((split_over_two["eval"].output_dir / "eval.json").read_text())
    # Each token counted once (not once per rank of the pair); the split matmuls sum in another order.
    assert two["val_tokens"] == one["val_tokens"]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert (two["correct"], two["total"]) == (one["correct"], one["total"])


# --- Across layouts on 2 processes, and the exports of a tensor-parallel run -------------------------------------------
# Step checkpoints written on one layout and resumed on another: tp=2 (one pair, no data parallelism), dp=2 (zero3, no
# TP) and one process, each way. DCP reshards the model and optimizer state; the sampler's position and the RNG state
# carry over, so the resumed run reads the same rows in the same micro-batches (the layouts cut the global batch into
# the same rows). Every run saves at steps 2, 4 and 5 (the last), as conftest.py's one_process does (the reference of
# the 4-process recipe run and of the 2-process runs; its step 2 is resumed on tp=2).
SAVES = worker.SAVES


def _checkpoint(out: Path) -> Path:
    return out / "checkpoints" / f"step_{worker.RESUMED_AT}"


# The LoRA recipe, its base the model the 4-process recipe run trained (a trained base: the adapters' effect is not a
# random base's), as the worker runs it on zero3 x tp2; saving the merged model too.
def _lora(four_processes: Path) -> list[str]:
    return [*worker.RECIPE, *worker.LORA, f"checkpointer.checkpoint_dir={four_processes / 'recipe' / 'final'}"]


@pytest.fixture(scope="module")
def two_process_launch(four_processes, one_process, tmp_path_factory) -> dict[str, RecipeRun]:
    """Every 2-process run of this module, in one launch: the generate and eval recipes split over 2 processes, then
    uninterrupted tp=2 and zero3 runs, each resumed from the other's step 2 checkpoint, tp=2 resumed from the
    one-process run's, and LoRA on tp=2. By name."""
    root = tmp_path_factory.mktemp("two_processes")
    tp2, zero3 = ["tensor_parallel=2"], ["data_parallel=zero3"]
    runs = {
        **_split_over_two_runs(four_processes),
        "tp2": RecipeRun("full_finetune", root / "tp2", *worker.RECIPE, *tp2, *SAVES),
        "zero3": RecipeRun("full_finetune", root / "zero3", *worker.RECIPE, *zero3, *SAVES),
        "tp2_from_zero3": RecipeRun("full_finetune", root / "tp2_from_zero3", *worker.RECIPE, *tp2,
                                    f"resume_from={_checkpoint(root / 'zero3')}"),
        "zero3_from_tp2": RecipeRun("full_finetune", root / "zero3_from_tp2", *worker.RECIPE, *zero3,
                                    f"resume_from={_checkpoint(root / 'tp2')}"),
        "tp2_from_one": RecipeRun("full_finetune", root / "tp2_from_one", *worker.RECIPE, *tp2,
                                  f"resume_from={_checkpoint(one_process)}"),
        "lora_tp2": RecipeRun("lora_finetune", root / "lora_tp2", *_lora(four_processes), *tp2, *SAVES),
        # What tensor parallelism combines with, each against the run it must equal (see COMBINED).
        **{name: RecipeRun("full_finetune", root / name, *worker.RECIPE, *tp2, *overrides)
           for name, overrides in COMBINED.items()},
    }
    result = run_recipes(list(runs.values()), nproc=2, timeout_s=500)
    assert result.returncode == 0, result.stderr[-4000:]
    return runs


@pytest.fixture(scope="module")
def two_processes(two_process_launch) -> dict[str, Path]:
    """The output folders of :func:`two_process_launch`'s training runs, by name."""
    return {name: run.output_dir for name, run in two_process_launch.items() if name not in ("generate", "eval")}


# TP with the switches it combines with: activation checkpointing (against the tp2 run), the step inside
# backward (against the ordinary step without clipping or accumulation, as it needs), fp16 loss scaling with FSDP2's
# sharded scaler on a plain TP model, and bf16 autocast (both against the fp32 tp2 run), and torchao's 8-bit AdamW
# on each rank's shards (against one process's 8-bit AdamW).
ONE_MICRO_STEP = ["micro_batch_size=8", "clip_grad_norm=null"]
COMBINED = {
    "tp2_ac": ["activation_checkpointing=true"],
    "tp2_ordinary": ONE_MICRO_STEP,
    "tp2_in_backward": [*ONE_MICRO_STEP, "optimizer_in_backward=true"],
    "tp2_fp16": ["dtype=fp16-mixed"],
    "tp2_bf16": ["dtype=bf16-mixed"],
    "tp2_adamw8bit": ["optimizer._component_=torchao.optim.AdamW8bit"],
}

# (resumed run, the uninterrupted run whose checkpoint it resumed)
CROSS_LAYOUT = [("tp2_from_zero3", "zero3"), ("zero3_from_tp2", "tp2"), ("tp2_from_one", "one")]


def _run(name: str, two_processes: dict[str, Path], one_process: Path) -> Path:
    return one_process if name == "one" else two_processes[name]


@pytest.mark.parametrize("resumed,source", CROSS_LAYOUT, ids=lambda x: x)
def test_a_checkpoint_resumes_on_another_layout(resumed, source, two_processes, one_process):
    # The resumed run goes on from step 3 with the same rows (each step's token count) and, the layouts summing in
    # another order only, the uninterrupted run's losses and final weights to float rounding (fp32: 1e-5 relative;
    # 1e-6 absolute for the weights near zero, whose relative error rounding inflates).
    ours, theirs = _records(two_processes[resumed]), _records(_run(source, two_processes, one_process))
    assert [r["step"] for r in ours] == list(range(worker.RESUMED_AT + 1, 6))
    later = theirs[worker.RESUMED_AT :]
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in later]
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in later], rtol=1e-5, atol=0)
    weights, expected = _weights(two_processes[resumed]), _weights(_run(source, two_processes, one_process))
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, rtol=1e-5, atol=1e-6, msg=key)


def test_a_tp2_checkpoint_resumes_on_one_process(two_processes, tmp_path):
    run_recipe_here("full_finetune", "demo", *worker.RECIPE, f"output_dir={tmp_path}",
                    f"resume_from={_checkpoint(two_processes['tp2'])}")
    ours, theirs = _records(tmp_path), _records(two_processes["tp2"])[worker.RESUMED_AT :]
    assert [r["step"] for r in ours] == list(range(worker.RESUMED_AT + 1, 6))
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in theirs]
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=1e-5, atol=0)
    weights, expected = _weights(tmp_path), _weights(two_processes["tp2"])
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, rtol=1e-5, atol=1e-6, msg=key)  # (as above)


def test_tp2_and_zero3_train_like_one_process(two_processes, one_process):
    # The uninterrupted runs the resumed ones are compared with agree with each other too (tolerances as above).
    reference = _records(one_process)
    for name in ("tp2", "zero3"):
        ours = _records(two_processes[name])
        assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in reference]
        torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in reference], rtol=1e-5, atol=0)


def test_tp2_with_activation_checkpointing_is_the_tp2_run(two_processes):
    # The recomputed layers compute what the first forward did: the run without checkpointing, bitwise (and so one
    # process's, to float rounding: test_tp2_and_zero3_train_like_one_process).
    ours, plain = two_processes["tp2_ac"], two_processes["tp2"]
    assert [r["loss"] for r in _records(ours)] == [r["loss"] for r in _records(plain)]
    _assert_same_weights(ours, plain)


def test_tp2_steps_inside_backward_as_the_ordinary_step_does(two_processes):
    # One AdamW per parameter shard, stepped from its gradient hook: the same arithmetic as the ordinary step.
    ours, ordinary = two_processes["tp2_in_backward"], two_processes["tp2_ordinary"]
    assert [r["loss"] for r in _records(ours)] == [r["loss"] for r in _records(ordinary)]
    _assert_same_weights(ours, ordinary)


@pytest.mark.parametrize(("name", "rtol"), [("tp2_fp16", 2e-4), ("tp2_bf16", 1e-3)])
def test_tp2_in_mixed_precision_trains_like_fp32(two_processes, name, rtol):
    # fp16 (its loss scaler sharded, as FSDP2's is, over a TP model without FSDP) and bf16 round each matmul's
    # inputs: losses near fp32's by their precision, not equal to them (measured: fp16 within 8.4e-6 relative, bf16
    # within 7.6e-5 over the 5 steps; the bounds leave an order of magnitude).
    ours, fp32 = [r["loss"] for r in _records(two_processes[name])], [r["loss"] for r in _records(two_processes["tp2"])]
    assert ours != fp32
    assert ours == pytest.approx(fp32, rel=rtol)


def _files(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_tp2_with_8bit_adamw_trains_like_one_process_with_it(two_processes, tmp_path):
    # torchao quantizes each moment in blocks of 256 values of the tensor it is given: here each rank's shard, so a
    # row-wise split weight's blocks hold other values than the whole tensor's, and its state rounds differently.
    # Over 5 steps that moves the losses by about 1e-6 relative (measured: 1.6e-6); the weights of a few entries
    # further (measured: one entry of the embedding ends 0.06 apart, the row-wise split weights up to 1e-3), so the
    # losses are what is compared, at 1e-5 as between the fp32 layouts.
    one = tmp_path / "one"
    run_recipe_here("full_finetune", "demo", *worker.RECIPE, *COMBINED["tp2_adamw8bit"], f"output_dir={one}")
    ours = [r["loss"] for r in _records(two_processes["tp2_adamw8bit"])]
    expected = [r["loss"] for r in _records(one)]
    assert len(ours) == len(expected) == 5
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=0)
    plain = [r["loss"] for r in _records(two_processes["tp2"])]
    assert ours[-1] != plain[-1]  # 8-bit state indeed: AdamW's full-precision run lands elsewhere


def test_tune_export_of_a_tp2_step_checkpoint_gives_the_final_export(two_processes, tmp_path):
    # The last step's checkpoint holds the weights the run exported at its end: the same bytes, written from the
    # TP shards by one process.
    run = two_processes["tp2"]
    result = run_tune_here("export", str(run / "checkpoints" / "step_5"), "--output", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    ours, final = _files(tmp_path / "hf"), _files(run / "final")
    assert ours.keys() == final.keys()
    for key, weight in final.items():
        assert torch.equal(ours[key], weight), key


def test_tune_export_of_a_lora_tp2_step_checkpoint_gives_the_final_adapter_and_merged_model(two_processes, tmp_path):
    # The adapter: the same bytes. The merged model: merged offline from the base's files here, from each rank's
    # shards in the run, both in float32 (the sums in another order: 1e-6).
    run = two_processes["lora_tp2"]
    result = run_tune_here("export", str(run / "checkpoints" / "step_5"), "--output", str(tmp_path), "--merged",
                           "--overwrite")
    assert result.returncode == 0, result.stderr
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    final = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == final.keys()
    for key, weight in final.items():
        assert torch.equal(adapter[key], weight), key
    merged, final_merged = _files(tmp_path / "merged"), _files(run / "final" / "merged")
    assert merged.keys() == final_merged.keys()
    for key, weight in final_merged.items():
        torch.testing.assert_close(merged[key], weight, rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def lora_one_process(four_processes, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_one_process")
    run_recipe_here("lora_finetune", "demo", *_lora(four_processes), f"output_dir={out}")
    return out


def _lora_run(name: str, four_processes: Path, two_processes: dict[str, Path]) -> Path:
    return four_processes / "recipe_lora" if name == "zero3_tp2" else two_processes[name]


LORA_RUNS = ["lora_tp2", "zero3_tp2"]  # 2 processes, and the worker's 4


@pytest.mark.parametrize("name", LORA_RUNS)
def test_the_lora_recipe_on_tensor_parallel_layouts_trains_and_exports_like_one_process(
    name, four_processes, two_processes, lora_one_process
):
    # The same rows, losses and gradient norms; the adapters and the merged model as one process writes them (the
    # split matmuls sum in another order: 1e-4 relative after 5 AdamW steps, as for the full fine-tune's weights).
    run = _lora_run(name, four_processes, two_processes)
    ours, reference = _records(run), _records(lora_one_process)
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in reference]
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in reference], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in ours], [r["grad_norm"] for r in reference], rtol=1e-5, atol=0)
    for folder in ("adapter", "merged"):
        weights, expected = _files(run / "final" / folder), _files(lora_one_process / "final" / folder)
        assert weights.keys() == expected.keys()
        for key, weight in expected.items():
            torch.testing.assert_close(weights[key], weight, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.interop
@pytest.mark.parametrize("name", LORA_RUNS)
def test_the_exports_of_a_tensor_parallel_lora_run_load_in_transformers_and_peft(name, four_processes, two_processes):
    # The run's own model, rebuilt from its files by our loaders (the base and the PEFT adapter), against
    # transformers on the merged export and peft on the base with the adapter: fp32, the same math in another
    # order, 1e-4 on logits of about 1 (as in test_peft_export.py).
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from toolkit.models import build_from_hf
    from toolkit.pretrained import from_pretrained
    from toolkit.training import HFCheckpointer, materialize
    from toolkit.checkpoint.peft import adapter_linear, fill_adapter_model

    base, final = four_processes / "recipe" / "final", _lora_run(name, four_processes, two_processes) / "final"
    with torch.device("meta"):
        model = build_from_hf(path=base, linear=adapter_linear(final / "adapter", model_family="llama3"))
    materialize(model, device=torch.device("cpu"))
    fill_adapter_model(model, HFCheckpointer(str(base), model_family="llama3"), adapter_dir=final / "adapter")
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(tokens)
        assert (ours - from_pretrained(base)(tokens)).abs().max() > 1e-2  # the adapters changed the model
        torch.testing.assert_close(from_pretrained(final / "merged")(tokens), ours, atol=1e-4, rtol=0)
        hf = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(hf(tokens).logits, ours, atol=1e-4, rtol=0)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(hf_base, final / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, ours, atol=1e-4, rtol=0)


def test_a_lora_tp2_checkpoint_resumes_on_one_process(four_processes, two_processes, tmp_path):
    # Only the adapters and their optimizer state are in it (the base is the base checkpoint's).
    run_recipe_here("lora_finetune", "demo", *_lora(four_processes), f"output_dir={tmp_path}",
                    f"resume_from={_checkpoint(two_processes['lora_tp2'])}")
    ours, theirs = _records(tmp_path), _records(two_processes["lora_tp2"])[worker.RESUMED_AT :]
    assert [r["step"] for r in ours] == list(range(worker.RESUMED_AT + 1, 6))
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in theirs]
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=1e-5, atol=0)


@pytest.mark.parametrize("recipe,source,wrote", [
    ("full_finetune", "lora_tp2", "lora_finetune recipe (lora), but this run is the full_finetune recipe (full)"),
    ("lora_finetune", "tp2", "full_finetune recipe (full), but this run is the lora_finetune recipe (lora)"),
])
def test_a_tensor_parallel_checkpoint_of_the_other_recipe_is_refused_in_one_line(
    recipe, source, wrote, four_processes, two_processes, tmp_path
):
    # A LoRA checkpoint holds adapters only, a full fine-tune's the whole model: the recipe and method it records say
    # which, before anything is read from it.
    result = run_tune_here(
        "run", f"{recipe}_single_device", "--config", "demo", *worker.RECIPE,
        f"output_dir={tmp_path}", f"resume_from={_checkpoint(two_processes[source])}",
    )
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("tune: error: ") and f"trainer_state.json: written by the {wrote}" in line
    assert not (tmp_path / "metrics.jsonl").exists()


# --- torch.compile over tensor-parallel layers ---------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_tensor_parallel_recipes_train_like_their_eager_runs(four_processes, one_process, two_processes,
                                                                      tmp_path):
    # compile: true on tp=2 with sequence parallelism (inductor, CPU): the layers compiled for static shapes, every
    # batch padded to one of 8 lengths (static_lengths: multiples of 2 up to the demo's max_seq_len), so the loss is
    # the same and only its float sums run in another order (1e-5, as for the other layouts); the LoRA recipe too.
    compiled = ["tensor_parallel=2", "sequence_parallel=true", "compile=true"]
    runs = [RecipeRun("full_finetune", tmp_path / "full", *worker.RECIPE, *compiled),
            RecipeRun("lora_finetune", tmp_path / "lora", *_lora(four_processes), *compiled)]
    result = run_recipes(runs, nproc=2, timeout_s=500)
    assert result.returncode == 0, result.stderr[-4000:]
    for run, eager in zip(runs, (one_process, two_processes["lora_tp2"])):
        ours, theirs = _records(run.output_dir), _records(eager)
        assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in theirs]
        torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=1e-5, atol=0)
