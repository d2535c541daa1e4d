"""tune plan: the per-strategy memory table for a real config, and what auto picks."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from toolkit.cli.main import main

EIGHT_B = ("model._component_=toolkit.models.llama3.llama3_1_8b", "micro_batch_size=1", "max_seq_len=2048")
SEVENTY_B = ("model._component_=toolkit.models.llama3.llama3_1_70b", "micro_batch_size=1", "max_seq_len=2048")


def _in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str,
                *appended: str):
    """`tune COMMAND ARGS APPENDED` in this process, on the repository's own recipes and configs."""
    for name in ("TUNE_RECIPES_DIR", "TUNE_CONFIGS_DIR"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        code = main([command, *args, *appended])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tune", command, *args], code, out, err)

    return run


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`tune plan ARGS` in this process."""
    return _in_process(monkeypatch, capsys, "plan")


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
    # The last line: what to run, on this one process, with the micro batch auto picks (the whole batch of 32).
    assert out.splitlines()[-1] == "recommended: tune run full_finetune_single_device --config demo micro_batch_size=32"
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
    # The same choice, as a command: the user's overrides but the data_parallel=auto it replaces, then its own.
    recommended = result.stdout.splitlines()[-1]
    assert recommended.startswith("recommended: tune run --nproc_per_node 2 full_finetune_distributed --config demo ")
    assert recommended.endswith(" max_seq_len=4096 data_parallel=zero3 cpu_offload=true"), recommended
    assert "data_parallel=auto" not in recommended


def test_plan_70b_that_fits_nowhere_prints_the_table_then_one_error(plan) -> None:
    result = plan("full_finetune", "--config", "demo", "--nproc_per_node", "2", "--device-memory-gb", "24", *SEVENTY_B)
    assert result.returncode == 2
    assert "no" in _row(result.stdout, "fits") and "yes" not in _row(result.stdout, "fits")
    (line,) = result.stderr.splitlines()
    assert line.startswith("tune: error: no data-parallel strategy fits 2 device(s)") and "LoRA/QLoRA" in line
    # stdout ends with the nearest job that fits, as a command to run.
    recommended = result.stdout.splitlines()[-1]
    assert recommended.startswith("recommended: nothing fits 2 process(es) of 24.00 GiB, even with activation "
                                  "checkpointing and offloading; it fits on "), recommended
    assert "activation_checkpointing=true" in recommended and recommended.endswith("; or LoRA/QLoRA")


def test_the_recommended_command_is_what_auto_picks_and_planning_it_changes_nothing(plan) -> None:
    first = plan("full_finetune", "--config", "llama3_1_8b", "--nproc_per_node", "8", "--device-memory-gb", "80")
    assert first.returncode == 0, first.stderr
    recommended = first.stdout.splitlines()[-1]
    prefix = "recommended: tune run --nproc_per_node 8 full_finetune_distributed --config llama3_1_8b "
    assert recommended.startswith(prefix), recommended
    overrides = recommended[len(prefix):].split()
    assert {o.split("=")[0] for o in overrides} >= {"data_parallel", "micro_batch_size"}, overrides
    # Planned again with those overrides, the config is what auto picks: nothing more to change.
    again = plan("full_finetune", "--config", "llama3_1_8b", "--nproc_per_node", "8", "--device-memory-gb", "80",
                 *overrides)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == recommended
    assert "fits" in next(line for line in again.stdout.splitlines() if line.startswith("config: "))


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
        (("--device-memory-gb", "24", "--nproc_per_node", "1", "data_parallel=zero3", "cpu_offload=true"),
         "cpu_offload: offloads the shards of a model sharded over 2 or more processes, and one process has none"),
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
    assert "expert-parallel degree" in out and "expert_parallel=8" in out


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


# --- Mixture-of-experts models and expert parallelism ----------------------------------------------------------------


_TITLES = ("params", "grads", "optimizer state", "activations", "logits + loss", "gathered", "all-to-all", "total",
           "fits")


def _ep_tables(out: str) -> dict[int, dict[str, list[str]]]:
    """Each table's rows (title -> cells; ``header``: the strategies) by expert-parallel degree (1: the first)."""
    tables, degree = {}, 1
    for line in out.splitlines():
        if line.startswith("expert_parallel ") and ": each process holds" in line:
            degree = int(line.split()[1].rstrip(":"))
        elif line.split()[1:3] == ["per", "device"]:
            tables[degree] = {"header": line.split()[3:]}
        elif degree in tables and line[:16].strip() in _TITLES:
            tables[degree][line[:16].strip()] = line[16:].split()
    return tables


def _column(table: dict[str, list[str]], strategy: str) -> dict[str, str]:
    """One strategy's column without offloading (the first of that name)."""
    i = table["header"].index(strategy)
    return {title: cells[i] for title, cells in table.items() if title != "header"}


def _without_offload(table: dict[str, list[str]], title: str) -> list[str]:
    """A row's cells of the columns without offloading (those before a strategy's name comes again)."""
    header = table["header"]
    firsts = [i for i, strategy in enumerate(header) if strategy not in header[:i]]
    return [table[title][i] for i in firsts]


@pytest.mark.parametrize("nnodes", [1, 2])
def test_plan_shows_the_expert_parallel_layouts_of_qwen3_30b(plan, nnodes: int) -> None:
    """Qwen3-30B-A3B (48 layers of width 2048; 128 experts of width 768, top-8; 32 query and 4 key/value heads of
    128; vocabulary 151,936, untied), bf16, AdamW, 1 x 2048 tokens, every layer checkpointed, on 8 x 80 GB and 2 x 8.

    By hand, in parameters: a layer's experts E = 128 x 3 x 768 x 2048 = 603,979,776, its rest (q and o 4096 x 2048,
    k and v 512 x 2048, the router 128 x 2048, norms) 19,140,864; the root (embedding, output, final norm)
    622,331,904; in all 48 x 623,120,640 + 622,331,904 = 30,532,122,624, of which 3,353,032,704 active per token
    (8/128 of each E). On 8 processes zero3's state is 8 bytes per parameter / 8 = 28.44 GiB, with or without EP
    (each process's 128/ep experts sharded over the 8/ep holding the same ones). Gathered, 2 bytes each: without
    EP, the root and two whole layers, plus the root's and a layer's unsharded gradients, 2 x (2 x 622,331,904 + 3 x
    623,120,640) = 5.80 GiB; at ep 8 a layer's experts are a unit of 16, held whole (no all-gather buffer: the rest's
    is the larger one), so 2 x (2 x 622,331,904 + 3 x 19,140,864 + 2 x E/8) = 2.71 GiB: the experts' part, 3 copies
    of E (4.50 GiB each), is 2 copies of E/8 (0.56 GiB each). The exchange's buffers: 3 x 2048 x 8 x 2048 x 2 bytes =
    0.19 GiB; it keeps 2048 x 8 x (2 x 2048 + 8) bytes more in the recomputed layer: 0.06 GiB.
    """
    result = plan("full_finetune", "--config", "qwen3_moe_30b_a3b", "--nproc_per_node", "8", "--nnodes", str(nnodes),
                  "--device-memory-gb", "80")
    assert result.returncode == 0, result.stderr
    assert "30,532.12M parameters (3,353.03M active per token, 30,532.12M trainable)" in result.stdout
    tables = _ep_tables(result.stdout)
    world = 8 * nnodes
    assert sorted(tables) == [d for d in (1, 2, 4, 8, 16) if d <= world]
    assert all(tables[ep]["header"] == ["zero2", "zero3"] for ep in tables if ep > 1)  # no offloading with EP
    assert "all-to-all" not in tables[1]
    plain = _column(tables[1], "zero3")
    for ep in sorted(tables)[1:]:
        for strategy in ("zero2", "zero3"):
            column = _column(tables[ep], strategy)
            assert [column[t] for t in ("params", "grads", "optimizer state")] == [
                plain[t] for t in ("params", "grads", "optimizer state")]
            assert column["all-to-all"] == "0.19"
            assert float(column["activations"]) == pytest.approx(float(plain["activations"]) + 0.06, abs=0.011)
    if nnodes == 1:  # (the params row holds the rotary tables too, 0.04 GiB)
        state = sum(float(plain[t]) for t in ("params", "grads", "optimizer state"))
        assert state == pytest.approx(28.44 + 0.04, abs=0.011)
        assert (plain["gathered"], _column(tables[8], "zero3")["gathered"]) == ("5.80", "2.71")
        assert (plain["total"], _column(tables[8], "zero3")["total"]) == ("35.48", "32.64")
    # zero2 keeps every layer gathered: without EP that is the whole model's 59 GiB, which does not fit; with the
    # experts shared out it does, at every degree (and needs an all-gather per layer and step fewer than zero3).
    assert _column(tables[1], "zero2")["fits"] == "no"
    assert all(_column(tables[ep], "zero2")["fits"] == "yes" for ep in tables if ep > 1)
    assert "config: data_parallel=zero3 needs" in result.stdout


@pytest.mark.parametrize("nnodes", [1, 2])
def test_plan_shows_qwen3_235b_fits_only_with_offloading_on_8_or_16_gpus(plan, nnodes: int) -> None:
    """Qwen3-235B-A22B (94 layers of width 4096; 128 experts of width 1536, top-8; 64 query and 4 key/value heads of
    128), the same settings. By hand: E = 128 x 3 x 1536 x 4096 = 2,415,919,104 a layer, the rest 71,835,904, the
    root 1,244,663,808; 235,093,634,560 in all, 22,190,763,520 active per token. Its state alone, 8 bytes a
    parameter, is 218.95 GiB per GPU on 8 and 109.47 GiB on 16, whatever the EP degree: beyond the 72 GiB usable, so
    only offloading (without EP, which cannot combine with it) fits. EP still cuts zero3's gathered part: on 8,
    2 x (2 x root + 3 x E + 3 x rest) = 18.54 GiB without it, 2 x (2 x root + 2 x E/8 + 3 x rest) = 6.16 GiB at ep 8
    (experts held whole); on 16 at ep 8 the experts (16, over 2 processes) are the larger all-gather buffer, one
    E/8 more: 6.59 GiB; at ep 16, 8 experts held whole: 5.60 GiB. The all-to-all buffers: 3 x 2048 x 8 x 4096 x 2
    bytes = 0.38 GiB.
    """
    result = plan("full_finetune", "--config", "qwen3_moe_235b_a22b", "--nproc_per_node", "8", "--nnodes",
                  str(nnodes), "--device-memory-gb", "80")
    assert result.returncode == 0, result.stderr
    assert "235,093.63M parameters (22,190.76M active per token" in result.stdout
    tables = _ep_tables(result.stdout)
    zero3 = _column(tables[1], "zero3")
    state = sum(float(zero3[t]) for t in ("params", "grads", "optimizer state"))
    assert state == pytest.approx(218.95 / nnodes + 0.04, abs=0.011)  # (and the rotary tables)
    expected = {1: {1: "18.54", 8: "6.16"}, 2: {1: "18.54", 8: "6.59", 16: "5.60"}}[nnodes]
    assert {ep: _column(tables[ep], "zero3")["gathered"] for ep in expected} == expected
    assert all(_column(tables[ep], "zero3")["all-to-all"] == "0.38" for ep in tables if ep > 1)
    assert all("yes" not in _without_offload(table, "fits") for table in tables.values())
    assert tables[1]["fits"][-1] == "yes"  # zero3 with cpu_offload
    assert "config: data_parallel=zero3 needs" in result.stdout and "does NOT fit" in result.stdout
    assert "with cpu_offload: true" in result.stdout.splitlines()[-2]  # what data_parallel: auto picks
    assert " cpu_offload=true " in result.stdout.splitlines()[-1]  # and so what to run


def test_plan_with_a_given_expert_parallel_degree_shows_only_it(plan) -> None:
    # The 30B on 8 x 80 GB at ep 8 (the numbers of test_plan_shows_the_expert_parallel_layouts_of_qwen3_30b): the
    # config's zero3, and what data_parallel: auto would pick among what combines with EP, zero2 first.
    result = plan("full_finetune", "--config", "qwen3_moe_30b_a3b", "--nproc_per_node", "8", "--device-memory-gb",
                  "80", "expert_parallel=8")
    assert result.returncode == 0, result.stderr
    tables = _ep_tables(result.stdout)
    assert list(tables) == [8] and tables[8]["header"] == ["zero2", "zero3"]
    assert "config: data_parallel=zero3 x ep8 needs 32.64 GiB per device: fits" in result.stdout
    assert "auto picks: data_parallel=zero2 x expert_parallel 8 (zero2 x ep8 needs 40.89 GiB per device" in (
        result.stdout
    )


def test_plan_lora_235b_on_8_gpus_fits_under_zero3_at_every_expert_parallel_degree(plan) -> None:
    # LoRA on attention: 12.71M trainable; the frozen base's bf16 weights sharded over 8 (54.78 GiB) and the
    # gathered units dominate. zero3 fits with 69.14 GiB of 72 without EP; sharing the experts out gathers fewer.
    result = plan("lora_finetune", "--config", "qwen3_moe_235b_a22b_lora", "--nproc_per_node", "8",
                  "--device-memory-gb", "80")
    assert result.returncode == 0, result.stderr
    assert "12.71M trainable" in result.stdout
    tables = _ep_tables(result.stdout)
    totals = {ep: float(_column(table, "zero3")["total"]) for ep, table in tables.items()}
    assert list(totals) == [1, 2, 4, 8] and totals[1] == 69.14
    assert totals[1] > totals[2] > totals[4] > totals[8]
    assert all(_column(table, "zero3")["fits"] == "yes" for table in tables.values())



def test_plan_of_a_preference_run_counts_pairs_and_the_reference_copy(plan) -> None:
    # The DPO demo is a full fine-tune with a live reference: a frozen copy, and each pair two sequences.
    full = plan("preference_finetune", "--config", "demo", "--device-memory-gb", "24")
    assert full.returncode == 0, full.stderr
    assert "micro batch 16 pairs x 64 tokens, a frozen reference model" in full.stdout
    assert float(_row(full.stdout, "frozen model")[0]) > 0
    sft = plan("full_finetune", "--config", "demo", "--device-memory-gb", "24", "micro_batch_size=32",
               "batch_size=64")
    assert _row(full.stdout, "activations") == _row(sft.stdout, "activations")  # 16 pairs = 32 sequences
    # Precomputed, or adapters (their base is the reference): no copy.
    for overrides in (["precompute_reference=true"], [
        "model._component_=toolkit.models.llama3.lora_llama3_demo", "model.lora_attn_modules=[q_proj,v_proj]"
    ]):
        result = plan("preference_finetune", "--config", "demo", "--device-memory-gb", "24", *overrides)
        assert result.returncode == 0, result.stderr
        assert "frozen model" not in result.stdout and "micro batch 16 pairs" in result.stdout


def test_plan_of_an_rl_run_counts_each_prompts_completions_and_the_kl_reference(plan) -> None:
    # The RL demo's micro batch of 8 prompts is 8 x 8 = 64 sequences, the logits unfused (the objective reads
    # log-probabilities); no KL term, so no frozen copy.
    rl = plan("rl_finetune", "--config", "demo", "--device-memory-gb", "24", "batch_size=16", "micro_batch_size=8")
    assert rl.returncode == 0, rl.stderr
    assert float(_row(rl.stdout, "rollout")[0]) > 0  # the rollouts' KV cache, between steps
    assert "micro batch 8 prompt(s) x 8 completions x 64 tokens" in rl.stdout and "loss on logits" in rl.stdout
    assert "flex_attention off" in rl.stdout  # the recipe runs SDPA
    assert "frozen model" not in rl.stdout
    sft = plan("full_finetune", "--config", "demo", "--device-memory-gb", "24", "micro_batch_size=64",
               "batch_size=64", "fused_loss=false", "max_seq_len=64")
    assert _row(rl.stdout, "activations") == _row(sft.stdout, "activations")
    # A KL term: a frozen copy for a full fine-tune, none for LoRA (the base with the adapters off).
    kl = plan("rl_finetune", "--config", "demo", "--device-memory-gb", "24", "kl_coef=0.1", "batch_size=16",
              "micro_batch_size=8")
    assert float(_row(kl.stdout, "frozen model")[0]) > 0
    lora = plan("rl_finetune", "--config", "demo", "--device-memory-gb", "24", "kl_coef=0.1", "batch_size=16",
                "micro_batch_size=8", "model._component_=toolkit.models.llama3.lora_llama3_demo",
                "model.lora_attn_modules=[q_proj,v_proj]")
    assert lora.returncode == 0, lora.stderr
    assert "frozen model" not in lora.stdout


def test_plan_of_a_distillation_run_counts_the_teacher(plan) -> None:
    result = plan("distill", "--config", "demo", "--device-memory-gb", "24")
    assert result.returncode == 0, result.stderr
    assert "a frozen 0.89M-parameter teacher" in result.stdout
    # The teacher (the 0.89M demo Llama) in float32, whole under ddp: its parameters and buffers, as the preference
    # recipe's reference copy of the same model counts them.
    teacher = float(_row(result.stdout, "frozen model")[0])
    copy = plan("preference_finetune", "--config", "demo", "--device-memory-gb", "24")
    assert teacher == float(_row(copy.stdout, "frozen model")[0]) > 0


def test_plan_of_a_long_context_config_counts_each_process_share_of_the_sequence(plan) -> None:
    # 128k tokens split over context_parallel 4: every estimate is for 32768 positions per process, the batch over
    # 8 / 4 = 2 reading processes; and the longest max_seq_len per layout, under the strategy holding least.
    result = plan("lora_finetune", "--config", "llama3_1_8b_lora_128k", "--nproc_per_node", "8",
                  "--device-memory-gb", "80")
    assert result.returncode == 0, result.err
    out = result.stdout
    assert ("context_parallel 4: each sequence split over 4 processes (alltoall), each holding 32768 of its 131072 "
            "positions; the batch over 2 reading process(es)") in out
    assert "longest max_seq_len that fits 72.00 GiB per device (multiples of 1024), by layout:" in out
    longest = {line.split(":")[0].strip(): int(line.split(": ")[1].split()[0]) for line in out.splitlines()
               if line.startswith("  ") and " tokens under " in line}
    # Splitting the sequence over N processes holds 1/N of every row's activations: about N times the length fits.
    one, two, four = longest["data parallel only"], longest["context_parallel 2"], longest["context_parallel 4"]
    assert 1.9 * one <= two <= 2.1 * one and 3.8 * one <= four <= 4.2 * one
    assert one > 0 and "tensor_parallel 2 x context_parallel 2" in longest
    # The config's own layout fits its 131072 tokens at cp 4, as its header says.
    assert four >= 131072 and "config: data_parallel=zero3 needs" in out and ": fits" in out


def test_plan_prints_the_longest_sequences_on_request_only(plan) -> None:
    args = ("full_finetune", "--config", "demo", "--nproc_per_node", "2", "--device-memory-gb", "8")
    assert "longest max_seq_len" not in plan(*args).stdout
    out = plan(*args, "--longest").stdout
    assert "  data parallel only: " in out and "  context_parallel 2: " in out


def test_the_longest_sequence_search_finds_the_last_length_that_fits() -> None:
    from toolkit.cli.plan import longest_fitting_sequence

    linear = lambda n: 1000 + 3 * n  # noqa: E731
    assert longest_fitting_sequence(linear, 1000 + 3 * 10 * 1024) == 10 * 1024
    assert longest_fitting_sequence(linear, 1000 + 3 * 10 * 1024 - 1) == 9 * 1024
    square = lambda n: n * n  # noqa: E731 (a dense mask's term: the line through two lengths overshoots)
    assert longest_fitting_sequence(square, (7 * 1024) ** 2 + 5) == 7 * 1024
    assert longest_fitting_sequence(linear, 10) == 0
    assert longest_fitting_sequence(lambda n: 1, 10, ceiling=1 << 16) == 1 << 16


def test_plan_counts_muon_and_shows_no_tensor_parallel_layout(plan) -> None:
    # Muon keeps one buffer for its matrices (AdamW two for the rest): less optimizer state than AdamW under ddp. It
    # steps whole matrices or FSDP2's row shards, so no tensor-parallel table is offered (the config check refuses
    # one).
    args = ("full_finetune", "--config", "llama3_2_1b", "--device-memory-gb", "80", "--nproc_per_node", "2")
    adamw = plan(*args).stdout
    muon = plan(*args, "optimizer._component_=toolkit.optim.Muon", "~optimizer.betas").stdout
    assert ", muon, " in muon.splitlines()[1]
    assert float(_row(muon, "optimizer state")[0]) < float(_row(adamw, "optimizer state")[0])
    assert "tensor_parallel 2:" in adamw and "tensor_parallel 2:" not in muon


@pytest.fixture
def validate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`tune validate ARGS` in this process, planned for the CPU (on a GPU machine too)."""
    return _in_process(monkeypatch, capsys, "validate", "device=cpu")


def test_validate_prints_the_plan_as_the_run_s_header_would(validate) -> None:
    result = validate("full_finetune/demo", "--nproc_per_node", "2", "max_steps=30")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "0.89M parameters; full fine-tuning, fused AdamW, llama3"  # as the run's header starts
    assert re.fullmatch(r"2 processes on cpu, ddp, fp32; global batch 32 = 2 x 16 x 1 accumulation step; at most 30 "
                        r"steps; about [\d.]+ MiB per device \(estimated\)", lines[1]), lines[1]
    assert lines[2].startswith("OK: ") and len(lines) == 3
    lora = validate("lora_finetune/demo", "--nproc_per_node", "1", "model.use_dora=true", "max_steps=null", "epochs=2")
    assert lora.stdout.splitlines()[:2] == [
        "1.06M parameters, 0.169M trainable; DoRA, fused AdamW, llama3",
        # One process: no strategy named; no threads either (the run chooses them, not this command).
        "1 process on cpu, fp32; global batch 32 = 1 x 16 x 2 accumulation steps; 2 epoch(s) of the data; about "
        + lora.stdout.splitlines()[1].split("; about ")[1],
    ]


def test_validate_names_what_a_preference_batch_counts(validate) -> None:
    for config, unit in (("demo", "32 pairs"), ("demo_kto", "64 answers")):
        result = validate(f"preference_finetune/{config}", "--nproc_per_node", "2")
        assert f"; global batch {unit} = 2 x " in result.stdout.splitlines()[1], result.stdout


def test_validate_resolves_auto_and_says_why(validate) -> None:
    result = validate("full_finetune/demo", "--nproc_per_node", "2", "data_parallel=auto", "micro_batch_size=auto",
                      "device_memory_gb=0.1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("2 processes on cpu, ddp, fp32; global batch 32 = 2 x 16 x 1 accumulation step; ")
    assert lines[2].startswith("data_parallel: auto -> ddp") and lines[3].startswith("micro_batch_size: auto -> 16")


def test_validate_says_which_process_count_it_assumed_and_what_the_plan_lacks(validate, monkeypatch) -> None:
    # No GPU and 3 cores: `tune run ..._distributed` would start 3 CPU processes, over which the batch of 32 does
    # not split. Assumed, the count is a line (the config itself is fine); given, it is the error a run would meet.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("toolkit.cli.plan.usable_cores", lambda: 3)
    result = validate("full_finetune/demo")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [
        ("assumed 3 process(es) per node, as `tune run <recipe>_distributed` starts here (--nproc_per_node N for "
         "another count)"),
        ("plan not resolved for 3 process(es) on cpu: batch_size: 32 is not divisible by the world size (3); use "
         "batch_size=30 or 33"),
    ]
    split = validate("lora_finetune/qwen3_8b_lora_128k")  # each sequence over 4 processes, of the 3 assumed
    assert split.returncode == 0 and split.stdout.splitlines()[1] == (
        "plan not resolved for 3 process(es) on cpu: tensor_parallel x context_parallel (4) does not divide the 3 "
        "processes")
    refused = validate("full_finetune/demo", "--nproc_per_node", "3")
    assert refused.returncode == 2 and refused.stdout == "" and len(refused.stderr.splitlines()) == 1
    # auto sizes need the devices' memory, which this machine may not have: the run is planned where it runs.
    unknown = validate("full_finetune/demo", "--nproc_per_node", "2", "micro_batch_size=auto")
    assert unknown.returncode == 0 and unknown.stdout.splitlines()[0] == (
        "plan not resolved for 2 process(es) on cpu: micro_batch_size: auto needs the memory of each device; on CPU "
        "set device_memory_gb=<GiB> (or give the value: data_parallel ddp, zero1, zero2, zero3 or hsdp; "
        "micro_batch_size and tensor_parallel a number)")


def test_validate_of_a_config_that_trains_nothing_says_ok_only(validate) -> None:
    result = validate("generate/demo")
    assert result.returncode == 0 and result.stdout.startswith("OK: ") and len(result.stdout.splitlines()) == 1
