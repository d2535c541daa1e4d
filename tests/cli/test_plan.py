"""tune plan: the per-strategy memory table for a real config, and what auto picks."""

from __future__ import annotations

import subprocess

import pytest
import torch

from toolkit.cli.main import main

EIGHT_B = ("model._component_=toolkit.models.llama3.llama3_1_8b", "micro_batch_size=1", "max_seq_len=2048")
SEVENTY_B = ("model._component_=toolkit.models.llama3.llama3_1_70b", "micro_batch_size=1", "max_seq_len=2048")


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`tune plan ARGS` in this process, on the repository's own recipes and configs."""
    for name in ("TUNE_RECIPES_DIR", "TUNE_CONFIGS_DIR"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = main(["plan", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tune", "plan", *args], code, out, err)

    return run


def _row(out: str, title: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(title))[len(title):].split()


def test_plan_demo_prints_the_table_and_the_choice(plan) -> None:
    result = plan("full_finetune", "--config", "demo", "--device-memory-gb", "24")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "per device" in out and _row(out, "total") and _row(out, "fits") == ["yes"]
    for part in ("params", "grads", "optimizer state", "activations", "logits + loss", "gathered"):
        assert part in out
    assert "24.00 GiB each (--device-memory-gb), 21.60 GiB usable" in out
    assert "auto picks: data_parallel=ddp (ddp needs" in out
    assert "config: data_parallel=ddp needs" in out  # the demo config names ddp
    if not torch.cuda.is_available():
        assert "no GPU here, so one process per node" in out


def test_plan_shows_every_strategy_with_and_without_offload(plan) -> None:
    # Flags and overrides in any order, as for tune run.
    result = plan(
        "full_finetune_distributed", "--config", "demo", "--nnodes", "2", "batch_size=64", "--nproc_per_node", "4",
        "--device-memory-gb", "24", "dtype=bf16-mixed", "micro_batch_size=8",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "per device" in line)
    assert lines[header].split()[3:] == ["ddp", "zero1", "zero2", "hsdp", "zero3", "zero2", "hsdp", "zero3"]
    assert lines[header + 1].split() == ["+offload"] * 3
    assert "world size 8" in result.stdout and "1 accumulation step(s)" in result.stdout
    assert len(_row(result.stdout, "host, per rank")) == 8


def test_plan_8b_on_two_24gb_gpus_offloads(plan) -> None:
    result = plan(
        "full_finetune", "--config", "demo", "--nproc_per_node", "2", "--device-memory-gb", "24", *EIGHT_B,
        "batch_size=2", "dtype=bf16-mixed", "activation_checkpointing=true", "data_parallel=auto",
        "max_seq_len=4096",  # where zero2+offload (every layer's weights gathered through the step) does not fit
    )
    assert result.returncode == 0, result.stderr
    assert "auto picks: data_parallel=zero3 with cpu_offload: true (zero3+offload needs" in result.stdout
    assert _row(result.stdout, "fits") == ["no", "no", "no", "no", "no", "yes"]


def test_plan_70b_that_fits_nowhere_prints_the_table_then_one_error(plan) -> None:
    result = plan("full_finetune", "--config", "demo", "--nproc_per_node", "2", "--device-memory-gb", "24", *SEVENTY_B)
    assert result.returncode == 2
    assert "no" in _row(result.stdout, "fits") and "yes" not in _row(result.stdout, "fits")
    (line,) = result.stderr.splitlines()
    assert line.startswith("tune: error: no data-parallel strategy fits 2 device(s)") and "LoRA/QLoRA" in line


def test_device_memory_from_the_config(plan) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU's own memory is used before the config's")
    result = plan("full_finetune", "--config", "demo", "device_memory_gb=80")
    assert result.returncode == 0, result.stderr
    assert "80.00 GiB each (config device_memory_gb)" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no GPU here to measure: say how much memory one device has with --device-memory-gb G"),
        (("--device-memory-gb", "24", "~micro_batch_size"), "recipe full_finetune reads 'micro_batch_size'"),
        (("--device-memory-gb", "24", "data_parallel=zero4"), "data_parallel: expects one of ddp, zero1, zero2, zero3, hsdp, auto, got 'zero4'"),
        (("--device-memory-gb", "-1"), "--device-memory-gb: must be a positive number of GiB"),
        (("--device-memory-gb", "24", "--bogus"), "unrecognized arguments: --bogus; see `tune plan --help`"),
        (("--device-memory-gb", "24", "--nproc_per_node", "4", "tensor_parallel=8"),
         "tensor_parallel: 8 is more than the 4 processes of the launch"),
        (("--device-memory-gb", "24", "tensor_parallel=abc"),
         "tensor_parallel: expects an integer >= 1 or one of auto, got 'abc'"),
        (("--device-memory-gb", "24", "--nproc_per_node", "2", "tensor_parallel=auto", *SEVENTY_B),
         "tensor_parallel: auto: no layout of 2 process(es) fits 21.60 GiB usable"),
    ],
)
def test_bad_input_is_one_line(plan, args: tuple[str, ...], message: str) -> None:
    if not args and torch.cuda.is_available():
        pytest.skip("the GPU's memory is known here")
    result = plan("full_finetune", "--config", "demo", *args)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("tune: error: ") and message in line


def test_unknown_recipe_and_config(plan) -> None:
    assert "unknown recipe 'full_finetun'" in plan("full_finetun", "--config", "demo").stderr
    assert "no config 'dem' for recipe 'full_finetune'" in plan("full_finetune", "--config", "dem").stderr


def test_help_lists_plan(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "plan" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--device-memory-gb" in out and "tune plan full_finetune --config demo" in out


@pytest.mark.parametrize("output", [(), ("model.apply_lora_to_output=true",)], ids=["plain output", "lora output"])
def test_plan_counts_the_fused_loss_and_names_the_loss_path(plan, output: tuple[str, ...]) -> None:
    # A LoRA output layer is fused as a plain one is (its adapter's rank-sized matmuls are added in each chunk).
    args = ("lora_finetune", "--config", "llama3_1_8b_lora", "--device-memory-gb", "80", "micro_batch_size=2",
            "max_seq_len=4096", "loss_chunks=8", *output)
    fused, logits = plan(*args), plan(*args, "fused_loss=false")
    assert fused.returncode == logits.returncode == 0, fused.stderr + logits.stderr
    assert "loss fused with the projection, in 8 chunks" in fused.stdout
    assert "loss on logits, in 8 chunks" in logits.stdout
    # 2 x 4096 x 128,256 bf16 logits in 8 chunks: one chunk at c + f = 10 bytes a logit, against every chunk's
    # logits kept (2 bytes) plus one chunk's 8: 1.29 GiB and 2.94 GiB (see logits_bytes).
    (fused_gib,), (logits_gib,) = _row(fused.stdout, "logits + loss"), _row(logits.stdout, "logits + loss")
    assert float(fused_gib) < 0.5 * float(logits_gib)


def test_plan_keeps_the_chunked_logits_for_a_dora_output_layer(plan) -> None:
    # DoRA rescales the adapted weight's rows, which the fused loss does not do.
    result = plan("lora_finetune", "--config", "llama3_1_8b_lora", "--device-memory-gb", "80", "loss_chunks=8",
                  "model.apply_lora_to_output=true", "model.use_dora=true")
    assert result.returncode == 0, result.stderr
    assert "loss on logits, in 8 chunks" in result.stdout


def test_plan_lora_trains_only_the_adapters(plan) -> None:
    result = plan(
        "full_finetune", "--config", "demo", "--device-memory-gb", "24",
        "model._component_=toolkit.models.llama3.lora_llama3_demo", "model.lora_attn_modules=[q_proj,v_proj]",
    )
    assert result.returncode == 0, result.stderr
    params, trainable = (float(x) for x in _between(result.stdout, "model: ", "M parameters (", "M trainable"))
    assert 0 < trainable < params / 2


def _between(text: str, start: str, middle: str, end: str) -> tuple[str, str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    first, rest = line.split(middle, 1)
    return first.rsplit(" ", 1)[-1].replace(",", ""), rest.split(end, 1)[0].replace(",", "")


def test_auto_micro_batch_is_planned_like_tune_run_picks_it():
    # 8B on 8 x 80 GB with zero3: the same choice plan_parallelism makes at run time, with its reason printed.
    result = subprocess.run(
        ["tune", "plan", "full_finetune", "--config", "llama3_1_8b", "--nproc_per_node", "8",
         "--device-memory-gb", "80", "micro_batch_size=auto"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "micro_batch_size: auto -> " in result.stdout and "sequences per device" in result.stdout


def test_plan_counts_8bit_adamw_and_the_step_inside_backward(plan) -> None:
    # The demo on 2 processes: 8-bit AdamW's state is a quarter of fp32 AdamW's, the step inside backward holds one
    # gradient at a time, and auto skips ddp, which would fit but cannot step inside backward.
    args = ("full_finetune", "--config", "demo", "--device-memory-gb", "24", "--nproc_per_node", "2")
    adamw = plan(*args).stdout
    lighter = plan(*args, "optimizer._component_=torchao.optim.AdamW8bit", "optimizer_in_backward=true").stdout
    assert "adamw8bit stepped inside backward" in lighter
    assert float(_row(lighter, "optimizer state")[0]) < float(_row(adamw, "optimizer state")[0]) / 3
    assert float(_row(lighter, "grads")[0]) < float(_row(adamw, "grads")[0]) / 5
    assert "auto picks: data_parallel=ddp" in adamw and "auto picks: data_parallel=zero2" in lighter


def test_auto_micro_batch_may_plan_cpu_offload_as_a_gpu_run_would(plan) -> None:
    # 70B full on 8 x 80 GB fits only with cpu_offload (zero3 needs 82 GiB of 72). Plans are for GPUs: with
    # micro_batch_size auto, tune plan must pick what a GPU run picks, not stop as if on a CPU with nothing to offload to.
    args = ("full_finetune", "--config", "llama3_1_70b", "--nproc_per_node", "8", "--device-memory-gb", "80")
    fixed = plan(*args, "micro_batch_size=1", "batch_size=8", "data_parallel=auto")
    auto = plan(*args, "micro_batch_size=auto", "batch_size=8", "data_parallel=auto")
    assert fixed.returncode == 0 and auto.returncode == 0, auto.stderr
    assert "auto picks: data_parallel=zero3 with cpu_offload: true" in fixed.stdout
    assert "micro_batch_size: auto -> 1 sequences per device" in auto.stdout
    assert "auto picks: data_parallel=zero3 with cpu_offload: true" in auto.stdout


def test_auto_micro_batch_fits_the_configured_hsdp_groups(plan) -> None:
    # hsdp_shard_size 2 on 2 x 8 GPUs of 44 GB: the micro batch auto picks must fit the groups of 2 the run shards
    # over, by the very estimate the plan prints for the configured strategy (planned for groups of 8, it took 4
    # sequences, which need 40.2 GiB of 39.6 in groups of 2).
    result = plan(
        "full_finetune", "--config", "llama3_1_8b", "--nnodes", "2", "--nproc_per_node", "8", "--device-memory-gb",
        "44", "micro_batch_size=auto", "batch_size=64", "data_parallel=hsdp", "hsdp_shard_size=2",
    )
    assert result.returncode == 0, result.stderr
    assert "micro_batch_size: auto -> 2 sequences per device" in result.stdout
    assert "config: data_parallel=hsdp needs" in result.stdout and "does NOT fit" not in result.stdout


def _tables(out: str) -> dict[int, list[str]]:
    """The header row of each table, by tensor-parallel degree (1: the first, untitled one)."""
    tables, degree = {}, 1
    for line in out.splitlines():
        if line.startswith("tensor_parallel ") and ": each layer split over" in line:
            degree = int(line.split()[1].rstrip(":"))
        elif "per device" in line and line.split()[1:3] == ["per", "device"]:
            tables[degree] = line.split()[3:]
    return tables


def test_plan_prints_a_table_for_each_tp_degree_that_splits_the_model_within_a_node(plan) -> None:
    # The demo Llama: 4 heads, 2 key/value heads: degrees 1 and 2 on 4 processes (4 does not split 2 KV heads).
    result = plan("full_finetune", "--config", "demo", "--nproc_per_node", "4", "--device-memory-gb", "24")
    assert result.returncode == 0, result.stderr
    tables = _tables(result.stdout)
    assert tables == {1: ["ddp", "zero1", "zero2", "zero3", "zero2", "zero3"], 2: ["ddp", "zero2", "zero3"]}
    assert "tensor_parallel 2: each layer split over 2 processes, data parallelism over 2 rank(s)" in result.stdout
    assert "x tp2" in result.stdout
    # The demo fits without TP: auto keeps it off.
    assert "tensor_parallel auto picks: data_parallel=ddp, tensor_parallel=1 (ddp needs" in result.stdout
    # TP halves what is split: the params of ddp x tp2 are below ddp's.
    params = [float(x) for x in _rows(result.stdout, "params")]
    assert params[6] < params[0]


def _rows(out: str, title: str) -> list[str]:
    return [cell for line in out.splitlines() if line.startswith(title) for cell in line[len(title):].split()]


def test_plan_with_a_given_tp_degree_shows_only_it(plan) -> None:
    result = plan("full_finetune", "--config", "demo", "--nproc_per_node", "4", "--device-memory-gb", "24",
                  "tensor_parallel=2")
    assert result.returncode == 0, result.stderr
    assert _tables(result.stdout) == {2: ["ddp", "zero2", "zero3"]}
    assert "config: data_parallel=ddp x tp2 needs" in result.stdout
    assert "auto picks: data_parallel=ddp x tensor_parallel 2 (ddp x tp2 needs" in result.stdout


def test_plan_tensor_parallel_auto_picks_tp1_when_it_fits_and_tp2_when_only_that_fits(plan) -> None:
    args = ("full_finetune", "--config", "llama3_1_8b", "--nproc_per_node", "2", "batch_size=2",
            "micro_batch_size=1", "max_seq_len=4096", "tensor_parallel=auto", "data_parallel=auto")
    roomy = plan(*args, "--device-memory-gb", "200")
    assert roomy.returncode == 0, roomy.stderr
    assert "tensor_parallel auto picks: data_parallel=ddp, tensor_parallel=1 (ddp needs" in roomy.stdout
    # Where only the split fits: between what ddp x tp2 (one data-parallel rank) and every tp=1 layout without
    # offloading need.
    tables = roomy.stdout
    tp1_totals = [float(x) for x in _rows(tables, "total")[:4]]
    tp2_total = float(_rows(tables, "total")[6])
    assert tp2_total < min(tp1_totals)  # the premise
    memory = (tp2_total + min(tp1_totals)) / 2 / 0.9
    tight = plan(*args, "--device-memory-gb", f"{memory:.2f}")
    assert tight.returncode == 0, tight.stderr
    assert "tensor_parallel auto picks: data_parallel=ddp, tensor_parallel=2 (ddp x tp2 needs" in tight.stdout
    assert "without tensor parallelism the smallest, zero3, would need" in tight.stdout
