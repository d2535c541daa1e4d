"""The checks a single-GPU machine without network runs, in about 9 minutes a call: install the wheels brought along,
compare our recipes with torchtune on real Llama shapes, run the GPU tests and the preference, distillation, Muon and
MoE recipes, time attention and MoE layers, and write a results table.

    python benchmarks/gpu/run_checks.py                          # on the GPU machine; wheels in benchmarks/gpu/wheels
    python benchmarks/gpu/run_checks.py --results "$OUT"         # the table and logs where the caller collects them
    python benchmarks/gpu/run_checks.py --dry-run                # on CPU, tiny shapes: checks this script end to end

Before: ``bash benchmarks/gpu/fetch_wheels.sh`` where PyPI is reachable (README.md here lists the wheels).

1. ``pip install --no-index --no-deps --target`` the wheels into two folders under ``/dev/shm/tunekit-bench``:
   ``peers`` (torchtune and what it needs) and ``ours`` (our wheel, plus omegaconf and torchao when this interpreter
   lacks them). Each tool's runs get only its own folder on ``PYTHONPATH``, so torchtune sees torchao 0.10 while
   ours keeps the machine's torchao where there is one.
2. ``benchmarks/compare.py --device cuda`` for Llama 3.2 1B and 3B full fine-tuning and Llama 3.1 8B LoRA and QLoRA,
   random weights, 2 x 4096 tokens without activation checkpointing (issue 8's setup), everything under
   ``/dev/shm`` (removed after each shape; each method's results are kept as soon as it ends).
3. Budget permitting, ``pytest -m gpu`` on the files that hold gpu-marked tests (exit code 5, none selected, is
   reported, not a failure), after the comparisons so that a short budget goes to the targets; ``-p
   report_each_test`` (this folder's plugin) prints each test's outcome and a failure's traceback as it ends.
4. The recipe runs on one GPU, each a short ``tune run`` of our wheel's recipe from its shipped config with
   overrides (``RecipeSetup``): ``preference_finetune_single_device`` (LoRA DPO on Llama 3.2 1B, the reference its
   base with the adapters off), ``distill_single_device`` (that 1B as the teacher of a student of half its width
   and depth, from random initialization), ``full_finetune_single_device`` (that 1B with ``toolkit.optim.Muon``)
   and ``lora_finetune_single_device`` (a Qwen3-MoE from ``qwen3_moe_30b_a3b_lora`` at 8 layers of 64 experts,
   adapters on the experts, routers trained, random base), 8 steps of 2 x 2048 tokens, bf16, random weights from
   one checkpoint written as compare.py writes its own. Each run's ``metrics.jsonl`` gives its row: steps/s,
   tokens/s, peak memory, the first and last loss; a run that fails, stops short or logs a loss that is not
   finite is FAILED.
   Then ``benchmarks/attention.py``: packed rows on SDPA with a dense mask against FlexAttention block masks, in
   Llama 3.1 8B's attention layer. Where the machine has several GPUs, ``benchmarks/tensor_parallel.py --device
   cuda``: bytes and step time of data- and tensor-parallel layouts of Llama 3.2 1B over all of them, and
   ``benchmarks/context_parallel.py --device cuda``: peak memory and tokens/s of one 32k-token row of Llama 3.2 1B
   on one GPU and split over 2 by each method (both skipped on one GPU).
   Then ``benchmarks/moe.py --device cuda``: our grouped experts against ``transformers``' experts implementations
   and an equal-active dense model, on a Qwen3-MoE of 8 layers of 64 experts (bf16).
5. ``results.md`` (and ``results.json``) in ``--results``: one row per tool, the ratio lines, then each benchmark's
   section (attention, tensor-parallel, MoE, recipes).

``--dry-run`` does the same on CPU with the tiny shapes, a few steps and short sequences, into ``/tmp``.
``--only SHAPE ...`` runs those shapes' comparisons alone (a second call, when the first ran out of time),
``--skip-comparisons`` everything but the comparisons, ``--only-recipes`` the recipe runs alone (after pytest unless
``--skip-pytest``), and
``--ours-variant NAME:KEY=VALUE[,...]`` (passed to compare.py) also runs ours with those overrides, as ``ours[NAME]``,
next to ours and torchtune: ``cudnn:sdpa_backend=cudnn`` measures cuDNN's attention end to end.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import compare  # noqa: E402  (its shapes, random checkpoints, tokenizer and data, for the recipe runs too)

HERE = Path(__file__).resolve().parent
COMPARE = REPO / "benchmarks" / "compare.py"
ATTENTION = REPO / "benchmarks" / "attention.py"
TENSOR_PARALLEL = REPO / "benchmarks" / "tensor_parallel.py"
CONTEXT_PARALLEL = REPO / "benchmarks" / "context_parallel.py"
MOE = REPO / "benchmarks" / "moe.py"
OURS_WHEEL = "tunekit"
# pytest -m gpu on one H200: the first 5 tests took 85 s, collection included (FlexAttention compiles in several).
PYTEST_LIMIT = 240
# benchmarks/moe.py on one H200: each variant a process of its own (~20 s of imports there); 120 s ran out.
MOE_LIMIT = 200
# Wheels of packages ours needs too: added to ours' folder when this interpreter cannot import them.
SHARED = {"omegaconf": "omegaconf", "torchao": "torchao"}

# (shape, methods, extra compare.py arguments, time limit s). Measured on one H200 with 10 steps each: 1B 112 s, 3B
# 124 s, 8B LoRA and QLoRA (one 16 GB checkpoint for both) 193 s; --budget cuts what does not fit. Both tools
# compile (compare.py's default on CUDA: each at its best); the targets are against torchtune, so the transformers
# loop is left to a run by hand (compare.py --device cuda --peers transformers).
# The setup of issue 8's measured table: 2 x 4096 tokens, no activation checkpointing (each tool's best on an H200,
# where torchtune's 8B LoRA took 54.6 GiB without it).
_GPU_STEPS = ["--steps", "10", "--warmup", "3", "--peers", "torchtune", "--batch-size", "2", "--seq-len", "4096",
              "--activation-checkpointing", "off"]
GPU_RUNS = [
    ("llama3_2_1b", ["full"], _GPU_STEPS, 150),
    ("llama3_2_3b", ["full"], _GPU_STEPS, 180),
    ("llama3_1_8b", ["lora", "qlora"], _GPU_STEPS, 330),
]
# The tiny shapes have the 1B/3B layout (tied embeddings) and the 8B one; the first runs one tool after another and
# compiled as on a GPU (with MFU against a stated rate), the second interleaved as on CPU.
_FEW_STEPS = ["--steps", "6", "--warmup", "2", "--batch-size", "2", "--seq-len", "64"]
DRY_RUNS = [
    ("tiny", ["full"], [*_FEW_STEPS, "--interleave", "off", "--compile", "on", "--peak-tflops", "0.1"], 300),
    ("tiny_untied", ["lora", "qlora"], _FEW_STEPS, 400),
]


@dataclass(frozen=True)
class RecipeSetup:
    """The recipe runs: ``base`` (a compare.py shape, from one random checkpoint) is the DPO policy, whose reference
    is itself with the adapters off, the teacher distilled into ``student`` (random initialization) and the model
    fine-tuned whole with Muon; ``moe`` are the ``lora_qwen3_moe`` arguments of the Qwen3-MoE given LoRA on its
    attention and experts with its routers trained (a random base, vocabulary the tokenizer's); ``batch_size``
    pairs or rows of ``seq_len`` tokens a step, ``limit`` seconds a run."""

    base: str
    student: compare.Shape
    moe: dict
    steps: int
    batch_size: int
    seq_len: int
    dtype: str
    limit: int


# Estimated for one H200: the 1B checkpoint ~15 s, each run ~40 s (start, load, 8 eager steps); the student is Llama
# 3.2 1B's layout at half the width and depth (0.26B parameters, 0.13B of them the embedding); the MoE is
# benchmarks/moe.py's GPU shape, Qwen3-30B-A3B's layers at 8 deep and 64 experts (2.3B parameters).
_MOE = dict(num_heads=16, num_kv_heads=4, head_dim=128, norm_topk_prob=True)
GPU_RECIPES = RecipeSetup("llama3_2_1b", compare.Shape(128_256, 8, 16, 8, 1024, 4096, rope_scaling=32,
                                                       tie_word_embeddings=True),
                          dict(_MOE, vocab_size=128_256, num_layers=8, embed_dim=2048, moe_intermediate_dim=768,
                               num_experts=64, num_experts_per_tok=8),
                          steps=8, batch_size=2, seq_len=2048, dtype="bf16", limit=90)
DRY_RECIPES = RecipeSetup("tiny", compare.Shape(8192, 2, 4, 2, 128, 384, rope_scaling=32, tie_word_embeddings=True),
                          dict(_MOE, vocab_size=8192, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2,
                               embed_dim=128, moe_intermediate_dim=64, num_experts=8, num_experts_per_tok=2),
                          steps=3, batch_size=2, seq_len=64, dtype="fp32", limit=60)


def log(message: str) -> None:
    print(f"[run_checks {time.strftime('%H:%M:%S')}] {message}", flush=True)


def install_wheels(wheels: Path, site: Path) -> tuple[Path, Path]:
    """Install the wheels into ``site/peers`` and ``site/ours``; return both folders."""
    files = sorted(wheels.glob("*.whl"))
    ours = [f for f in files if f.name.startswith(OURS_WHEEL + "-")]
    peers = [f for f in files if f not in ours]
    if not ours or not peers:
        sys.exit(f"{wheels}: expected our {OURS_WHEEL} wheel and the peers' wheels; run benchmarks/gpu/fetch_wheels.sh")
    shared = [f for f in peers for dist, module in SHARED.items()
              if f.name.startswith(dist + "-") and importlib.util.find_spec(module) is None]
    for name, group in (("peers", peers), ("ours", ours + shared)):
        target = site / name
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--root-user-action=ignore",
                        "--no-index", "--no-deps", "--target", str(target), *map(str, group)], check=True)
        log(f"installed into {target}: {', '.join(f.name for f in group)}")
    return site / "peers", site / "ours"


def preflight(peers: Path, ours: Path) -> dict[str, str]:
    """Versions as each tool's runs will see them (a missing import stops here, not in the middle)."""
    checks = {
        "torchtune": (peers, "import torch, torchtune, torchao; print(torch.__version__, torchtune.__version__, "
                             "torchao.__version__)"),
        "ours": (ours, "import torch, toolkit, torchao; "
                       "print(torch.__version__, toolkit.__file__, torchao.__version__)"),
        "transformers": (None, "import transformers, peft; print(transformers.__version__, peft.__version__)"),
        "bitsandbytes": (None, "import bitsandbytes; print(bitsandbytes.__version__)"),
    }
    found = {}
    for name, (path, code) in checks.items():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path) if path else None,
                                                                         os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
        found[name] = run.stdout.strip() if run.returncode == 0 else "missing: " + run.stderr.strip().splitlines()[-1]
        log(f"{name}: {found[name]}")
    if found["torchtune"].startswith("missing") or found["ours"].startswith("missing"):
        sys.exit("a tool cannot be imported (above); bring its wheel")
    return found


def run_logged(cmd: list[str], *, log_path: Path, timeout: int, env: dict[str, str] | None = None,
               cwd: Path = REPO) -> int:
    """Run ``cmd`` in ``cwd`` with its output both on the console and in ``log_path``; the exit code (124 on
    timeout)."""
    log(f"$ {' '.join(cmd)}  (limit {timeout} s, log {log_path.name})")
    with open(log_path, "w") as out:
        # A new session: on the time limit the whole group goes (compare.py's training processes too).
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        code = proc.wait()
        if not timer.is_alive():
            log(f"time limit reached: {' '.join(cmd[:4])} ...")
            return 124
        timer.cancel()
        return code


def gpu_test_files() -> list[str]:
    """The test files that hold ``gpu``-marked tests, so that pytest collects only those: a test module elsewhere that
    imports a package the GPU machine lacks (a tracker, say) cannot stop the GPU tests at collection."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if "@pytest.mark.gpu" in path.read_text() or "pytestmark = pytest.mark.gpu" in path.read_text())


def write_pairs(path: Path, *, rows: int, seq_len: int) -> None:
    """``rows`` identical preference pairs of ASCII text (one byte, one token with compare.py's tokenizer): a prompt
    and two answers (the words in order, chosen, and reversed, rejected) of ``seq_len / 2 - 16`` bytes each, so that
    each conversation, with the chat template's ~25 tokens, fills most of ``seq_len`` and none is cut."""
    n = seq_len // 2 - 16
    words = [compare.WORDS[i % len(compare.WORDS)] for i in range(n)]
    pair = {"prompt": " ".join(words)[:n], "chosen": " ".join(words)[:n], "rejected": " ".join(words[::-1])[:n]}
    path.write_text((json.dumps(pair) + "\n") * rows)


def recipe_commands(setup: RecipeSetup, work: Path, *, device: str) -> dict[str, tuple[Path, list[str]]]:
    """Each run's output folder and ``tune run`` command, by its row's label: the shipped config for its real model
    with overrides for the shape, the random checkpoint, the data written into ``work``, and a short run logging
    every step: DPO with LoRA on ``setup.base`` (the config's adapters), and ``setup.base`` distilled into the
    student."""
    base = compare.SHAPES[setup.base]

    def tune_run(recipe: str, config: str, out: str, data: str, *overrides: str) -> tuple[Path, list[str]]:
        config_text = (REPO / "recipe_configs" / recipe / f"{config}.yaml").read_text()
        common = [
            f"output_dir={work / out}", "overwrite=true", f"device={device}", f"dtype={setup.dtype}",
            "progress_bar=false", "metric_loggers=[]", f"max_seq_len={setup.seq_len}",
            "tokenizer._component_=toolkit.tokenizers.llama3_tokenizer",
            f"tokenizer.path={work / 'tokenizer' / 'tokenizer.model'}",
            *(["~tokenizer.chat_format"] if "chat_format:" in config_text else []),  # the Llama 3 tokenizer's own
            f"dataset.source={work / data}", "~dataset.num_samples", "~dataset.seed", "dataset.cache_dir=null",
            f"batch_size={setup.batch_size}", f"micro_batch_size={setup.batch_size}", f"max_steps={setup.steps}",
            "lr_scheduler.warmup_steps=0", "log_every_n_steps=1", "save_every_n_steps=null",
        ]
        return work / out, [sys.executable, "-m", "toolkit.cli", "run", f"{recipe}_single_device", "--config", config,
                            *common, *overrides]

    student = f"{setup.student.num_layers} layers x {setup.student.embed_dim}"
    moe = f"{setup.moe['num_layers']} layers x {setup.moe['num_experts']} experts (top {setup.moe['num_experts_per_tok']})"
    return {
        f"preference_finetune: LoRA DPO, {setup.base}": tune_run(
            "preference_finetune", "llama3_2_1b_lora_dpo", "dpo", "pairs.jsonl",
            *compare.model_overrides(base, setup.seq_len, builder="lora_llama3"),
            f"checkpointer.checkpoint_dir={work / 'checkpoint'}", "save_merged=false",
            "dataset._component_=toolkit.data.preference_dataset"),
        f"distill: {setup.base} into {student}": tune_run(
            "distill", "llama3_2_1b_from_llama3_1_8b", "distill", "text.jsonl",
            *compare.model_overrides(setup.student, setup.seq_len),
            *compare.model_overrides(base, setup.seq_len, key="teacher_model"),
            "checkpointer.checkpoint_dir=null", f"teacher_checkpointer.checkpoint_dir={work / 'checkpoint'}",
            "data_parallel=ddp", "dataset._component_=toolkit.data.text_completion_dataset"),
        f"full_finetune: Muon, {setup.base}": tune_run(
            "full_finetune", "llama3_2_1b", "muon", "text.jsonl",
            *compare.model_overrides(base, setup.seq_len),
            f"checkpointer.checkpoint_dir={work / 'checkpoint'}",
            "optimizer._component_=toolkit.optim.Muon", "optimizer.lr=0.02", "~optimizer.betas",
            "optimizer.adamw_lr=2e-5", "optimizer.adamw_betas=[0.9,0.95]",
            "dataset._component_=toolkit.data.text_completion_dataset"),
        f"lora_finetune: Qwen3-MoE {moe}, experts and routers": tune_run(
            "lora_finetune", "qwen3_moe_30b_a3b_lora", "moe_lora", "text.jsonl",
            "model._component_=toolkit.models.qwen3_moe.lora_qwen3_moe",
            *(f"model.{key}={value}" for key, value in setup.moe.items()), f"model.max_seq_len={setup.seq_len}",
            "model.apply_lora_to_experts=true", "model.train_router=true", "checkpointer.checkpoint_dir=null",
            "dataset._component_=toolkit.data.text_completion_dataset"),
    }


def read_recipe_metrics(path: Path, *, exit_code: int, steps: int) -> dict:
    """A run's row from its ``metrics.jsonl``: medians over the steps after the first (which warms up), the peak
    memory the recipe logged (GPU allocated on CUDA, RSS on CPU), the first and last loss. Its status is ``ok`` only
    if the run exited 0, logged all ``steps`` steps and every loss of every step (``loss``, ``ce_loss``, ...) is
    finite; otherwise FAILED and why."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    logged = [r for r in records if "step_time_s" in r]  # the steps' records (not validation's)
    timed = logged[1:] or logged
    losses = [value for r in logged for key, value in r.items() if key.endswith("loss")]
    problems = [{124: "time limit"}.get(exit_code, f"exit {exit_code}")] if exit_code else []
    if len(logged) < steps:
        problems.append(f"{len(logged)} of {steps} steps logged")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses):
        problems.append("a loss is not finite")

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    step_s = median("step_time_s")
    peaks = [r["rank_peak_memory_gib_max"] for r in logged if "rank_peak_memory_gib_max" in r]
    return {
        "status": "FAILED (" + "; ".join(problems) + ")" if problems else "ok", "steps": len(logged),
        "steps_per_s": step_s and 1 / step_s, "tokens_per_s": median("tokens_per_second"),
        "positions_per_s": median("rank_positions_per_second_max"), "peak_gib": max(peaks) if peaks else None,
        "first_loss": logged[0]["loss"] if logged else None, "last_loss": logged[-1]["loss"] if logged else None,
    }


def run_recipe_checks(setup: RecipeSetup, *, work: Path, results: Path, ours: Path, device: str,
                      left: Callable[[], int]) -> list[dict]:
    """The preference and distillation rows: one random ``setup.base`` checkpoint (compare.py's) and the data for
    both runs in ``work``, then each run with our wheel's recipes, under its own limit while ``--budget`` allows
    (a run that cannot start says so in its row); ``work`` is removed afterwards."""
    env = {**os.environ, "PYTHONPATH": str(ours), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    commands = recipe_commands(setup, work, device=device)
    shape = f"{setup.batch_size} x {setup.seq_len}"
    rows = [{"run": name, "batch x seq": shape, "dtype": setup.dtype, "status": f"not run: {left()} s of --budget left"}
            for name in commands]
    if left() < 60:
        return rows
    shutil.rmtree(work, ignore_errors=True)
    compare.write_tokenizer(work / "tokenizer")
    write_pairs(work / "pairs.jsonl", rows=setup.steps * setup.batch_size, seq_len=setup.seq_len)
    compare.write_data(work / "text.jsonl", rows=setup.steps * setup.batch_size, seq_len=setup.seq_len)
    code = run_logged(compare.checkpoint_command(setup.base, work / "checkpoint", dtype=setup.dtype,
                                                 seq_len=setup.seq_len),
                      log_path=results / "recipes_checkpoint.log", timeout=min(60, left()), env=env)
    for row, (name, (out, cmd)) in zip(rows, commands.items()):
        if code != 0:
            row["status"] = f"FAILED (random {setup.base} checkpoint: exit {code})"
        elif left() >= 60:
            exit_code = run_logged(cmd, log_path=results / f"{out.name}.log", timeout=min(setup.limit, left()),
                                   env=env, cwd=work)
            row.update(read_recipe_metrics(out / "metrics.jsonl", exit_code=exit_code, steps=setup.steps))
        else:
            row["status"] = f"not run: {left()} s of --budget left"
        log(f"{name}: {row['status']}")
    shutil.rmtree(work, ignore_errors=True)
    return rows


def device_name(dry_run: bool) -> str:
    if dry_run:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import torch

    return f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"


def write_table(
    results: Path, runs: list[dict], versions: dict[str, str], *, device: str, pytest_status: str, attention: list[str],
    tensor_parallel: list[str], moe: list[str], recipes: list[dict], context_parallel: list[str] | None = None,
) -> str:
    """Markdown: the setup, one row per tool and method, the ratio lines, then each benchmark's section."""
    lines = [
        f"# compare.py on {device}",
        "",
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; Python {platform.python_version()}.",
        *(f"- {name}: {version}" for name, version in versions.items()),
        f"- pytest -m gpu: {pytest_status}",
        "",
        "| shape | method | batch x seq | AC | compile | tool | tokens/s | step ms | MFU | peak memory GiB "
        "| training GiB | loss step 1 | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if "results" not in run:
            lines.append(f"| {run['shape']} | {' '.join(run['methods'])} | | | | | | | | | | | {run['status']} |")
            continue
        for method, tools in run["results"].items():
            for r in tools:
                lines.append(
                    f"| {run['shape']} | {method} | {run['batch_size']} x {run['seq_len']} | "
                    f"{'on' if run['activation_checkpointing'] else 'off'} | "
                    f"{'on' if run.get('compile') and r['tool'] != 'transformers' else 'off'} | {r['tool']} | "
                    f"{_num(r['tokens_per_s'], '.0f')} | {_num(r['step_ms'], '.1f')} | "
                    f"{_num(r.get('mfu') and 100 * r['mfu'], '.1f')} | "
                    f"{_num(r['memory_gib'], '.2f')} | {_num(r['training_gib'], '.2f')} | "
                    f"{_num(r['first_loss'], '.4f')} | {r['note']} |"
                )
    peaks = {run["peak_flops"] for run in runs if run.get("peak_flops")}
    lines += ["", "MFU (%): 6N per token for full fine-tuning, 4N + 6N_lora for LoRA/QLoRA (N: the matmul weights), "
              "over the bf16 matmul rate compare.py measured (or was given, --peak-tflops): "
              + (", ".join(f"{p / 1e12:.4g} TFLOP/s" for p in sorted(peaks)) or "-")]
    lines += ["", *(f"    {run['shape']}: {line}" for run in runs for line in run.get("ratio_lines", []))]
    lines += ["", "## Packed rows: attention kernels (benchmarks/attention.py)", "", *attention]
    lines += ["", "## Data- and tensor-parallel layouts (benchmarks/tensor_parallel.py)", "", *tensor_parallel]
    lines += ["", "## Context parallelism: one long row whole and split (benchmarks/context_parallel.py)", "",
              *(context_parallel or ["not run"])]
    lines += ["", "## Mixture of experts (benchmarks/moe.py)", "", *moe]
    lines += ["", "## Preference, distillation, Muon and MoE recipes (one GPU)", "", *recipe_table(recipes)]
    text = "\n".join(lines) + "\n"
    (results / "results.md").write_text(text)
    (results / "results.json").write_text(json.dumps({"versions": versions, "runs": runs, "recipes": recipes},
                                                     indent=1))
    return text


def recipe_table(rows: list[dict]) -> list[str]:
    """The recipe runs' rows (:func:`run_recipe_checks`), and what their columns count."""
    lines = ["| run | batch x seq | dtype | steps | steps/s | tokens/s | positions/s | peak memory GiB | loss first "
             "| loss last | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['batch x seq']} | {r['dtype']} | {r.get('steps', '-')} | "
            f"{_num(r.get('steps_per_s'), '.2f')} | {_num(r.get('tokens_per_s'), '.0f')} | "
            f"{_num(r.get('positions_per_s'), '.0f')} | {_num(r.get('peak_gib'), '.2f')} | "
            f"{_num(r.get('first_loss'), '.4f')} | {_num(r.get('last_loss'), '.4f')} | {r['status']} |")
    return lines + ["", "`tune run` on the shipped configs (llama3_2_1b_lora_dpo, llama3_2_1b_from_llama3_1_8b, "
                    "llama3_2_1b with optimizer toolkit.optim.Muon, qwen3_moe_30b_a3b_lora at a smaller size "
                    "with adapters on the experts and the routers trained), random weights, eager; batch: pairs for "
                    "DPO (reference: the base, adapters off), rows otherwise (the distillation's student from random "
                    "initialization). From each run's metrics.jsonl: medians "
                    "after the first step; tokens/s counts the recipe's trained tokens (DPO: both answers), "
                    "positions/s every input position; peak memory: GPU allocated (RSS on CPU); ok: exit 0, every "
                    "step logged, every loss finite."]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the script here")
    parser.add_argument("--wheels", type=Path, default=REPO / "benchmarks" / "gpu" / "wheels")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "gpu" / "results")
    parser.add_argument("--skip-pytest", action="store_true")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--only", nargs="+", default=None, metavar="SHAPE",
                      help="run only these shapes' comparisons (e.g. llama3_1_8b, when a first call ran out of time)")
    only.add_argument("--skip-comparisons", action="store_true",
                      help="no comparisons: the GPU tests, the recipe runs, then the attention, tensor-parallel, "
                           "context-parallel and MoE benchmarks (a session whose comparisons are already measured)")
    only.add_argument("--only-recipes", action="store_true",
                      help="run only the recipe runs: preference, distillation, Muon, MoE (no comparisons, "
                           "attention, tensor-parallel or MoE benchmarks), when an earlier call's budget cut them")
    parser.add_argument("--ours-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                        help="passed to every compare.py run: ours also runs with these overrides, as ours[NAME] "
                             "(e.g. cudnn:sdpa_backend=cudnn); each run's time limit grows by half per variant")
    parser.add_argument("--budget", type=int, default=540,
                        help="seconds for the whole script; a step that cannot get 60 s more is not started")
    args = parser.parse_args()
    started = time.monotonic()

    def left() -> int:
        return int(args.budget - (time.monotonic() - started))

    def benchmark_skipped() -> str | None:
        """Why a benchmark step (attention, tensor-parallel, MoE) does not start, or None when it does."""
        if args.only_recipes:
            return "not run (--only-recipes)"
        return f"not run: {left()} s of --budget left" if left() < 60 else None

    scratch = Path("/tmp/tunekit-bench-dry" if args.dry_run else "/dev/shm/tunekit-bench")
    args.results.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --dry-run on a CPU machine")

    peers, ours = install_wheels(args.wheels, scratch / "site")
    versions = preflight(peers, ours)

    planned = [] if args.only_recipes or args.skip_comparisons else DRY_RUNS if args.dry_run else GPU_RUNS
    if args.only:
        unknown = set(args.only) - {shape for shape, *_ in planned}
        if unknown:
            parser.error(f"--only: no such shape here: {', '.join(sorted(unknown))}")
        planned = [run for run in planned if run[0] in args.only]
    variants = [arg for text in args.ours_variant for arg in ("--ours-variant", text)]
    runs = []
    for shape, methods, extra, limit in planned:
        limit = int(limit * (1 + 0.5 * len(args.ours_variant)))
        work = scratch / shape
        out_json = args.results / f"{shape}.json"
        out_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(COMPARE), "--device", "cpu" if args.dry_run else "cuda", "--model", shape,
               "--methods", *methods, *extra, *variants, "--work-dir", str(work), "--json-out", str(out_json),
               "--torchtune-python", sys.executable, "--torchtune-pythonpath", str(peers),
               "--ours-pythonpath", str(ours)]
        if left() < 60:
            runs.append({"shape": shape, "methods": methods, "status": f"not run: {left()} s of --budget left"})
            log(f"{shape}: {runs[-1]['status']}")
            continue
        code = run_logged(cmd, log_path=args.results / f"{shape}.log", timeout=min(limit, left()))
        shutil.rmtree(work, ignore_errors=True)  # an 8B checkpoint is 16 GB of /dev/shm
        status = {0: "ok", 124: "time limit"}.get(code, f"compare.py exit {code}")
        run = {"shape": shape, "methods": methods, "status": status}
        if out_json.exists():
            run.update(json.loads(out_json.read_text()))
            log_lines = (args.results / f"{shape}.log").read_text().splitlines()
            run["ratio_lines"] = [line for line in log_lines if line.startswith("ratio ")]
        runs.append(run)
        log(f"{shape}: {run['status']} ({time.monotonic() - started:.0f} s so far)")

    # The GPU tests after the comparisons (the targets come first when the budget is short), with ours' folder on
    # PYTHONPATH for what this interpreter lacks (omegaconf, torchao); the checkout's toolkit comes first (cwd).
    pytest_status = "skipped (--skip-pytest)"
    if not args.skip_pytest:
        pytest_status = f"not run: {left()} s of --budget left"
        if left() >= 60:
            # report_each_test (this folder's plugin): each test's outcome and a failure's traceback as it ends.
            code = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               "-p", "report_each_test", *gpu_test_files()],
                              log_path=args.results / "pytest_gpu.log", timeout=min(PYTEST_LIMIT, left()),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ours), str(HERE)])})
            named = {0: "passed", 5: "no test selected (exit 5)", 124: "time limit"}
            pytest_status = named.get(code, f"FAILED (exit {code})")
        log(f"pytest -m gpu: {pytest_status}")

    # The recipe runs before the benchmarks' tables: they check the newer recipes on a GPU at all.
    recipes = run_recipe_checks(DRY_RECIPES if args.dry_run else GPU_RECIPES, work=scratch / "recipes",
                                results=args.results, ours=ours, device="cpu" if args.dry_run else "cuda", left=left)

    skipped = benchmark_skipped()
    attention = [skipped]
    attention_cmd = [sys.executable, str(ATTENTION), *(["--device", "cpu", "--shape", "tiny"] if args.dry_run else
                                                       ["--device", "cuda", "--shape", "8b"])]
    if not skipped:
        code = run_logged(attention_cmd, log_path=args.results / "attention.log", timeout=min(90, left()),
                          env={**os.environ, "PYTHONPATH": str(ours)})
        attention = [line for line in (args.results / "attention.log").read_text().splitlines()
                     if line.startswith(("attention layer", "|", "note:"))] if code == 0 else [f"FAILED (exit {code})"]

    # Tensor-parallel rows need several GPUs (on CPU, the dry run checks the script on 2 processes).
    gpus = 2 if args.dry_run else _gpu_count()
    tensor_parallel = [f"not run: {gpus} GPU(s); the layouts need 2 or more"]
    if gpus >= 2:
        skipped = benchmark_skipped()
        tensor_parallel = [skipped]
        tp_args = (["--nproc", "2", "--layouts", "ddp", "tp2", "--steps", "2"] if args.dry_run else
                   ["--device", "cuda", "--nproc", str(gpus), "--model", "toolkit.models.llama3.llama3_2_1b",
                    "--seq_len", "2048", "--micro_batch_size", "1", "--layouts", "ddp", "zero3", "tp2", "tp2_sp", "zero3_tp2"])
        if not skipped:
            code = run_logged([sys.executable, str(TENSOR_PARALLEL), *tp_args],
                              log_path=args.results / "tensor_parallel.log", timeout=min(150, left()),
                              env={**os.environ, "PYTHONPATH": str(ours)})
            tensor_parallel = [line for line in (args.results / "tensor_parallel.log").read_text().splitlines()
                               if line.startswith(("|", f"{tp_args[tp_args.index('--nproc') + 1]} processes"))]
            if code != 0:
                tensor_parallel = [f"FAILED (exit {code})"]

    # Context-parallel rows too: one row of 32k tokens on one GPU and split over 2 (ring and alltoall).
    context_parallel = [f"not run: {gpus} GPU(s); the split needs 2 or more"]
    if gpus >= 2:
        skipped = benchmark_skipped()
        context_parallel = [skipped]
        cp_args = (["--nproc", "2", "--seq_len", "512", "--steps", "1", "--layers", "2", "--dim", "64"] if args.dry_run
                   else ["--device", "cuda", "--nproc", "2", "--model", "toolkit.models.llama3.llama3_2_1b",
                         "--seq_len", "32768", "--steps", "2", "--activation_checkpointing"])
        if not skipped:
            code = run_logged([sys.executable, str(CONTEXT_PARALLEL), *cp_args],
                              log_path=args.results / "context_parallel.log", timeout=min(150, left()),
                              env={**os.environ, "PYTHONPATH": str(ours)})
            context_parallel = [line for line in (args.results / "context_parallel.log").read_text().splitlines()
                                if line.startswith(("|", "one row"))]
            if code != 0:
                context_parallel = [f"FAILED (exit {code})"]

    skipped = benchmark_skipped()
    moe = [skipped]
    moe_args = (["--steps", "2", "--warmup", "1", "--seq_len", "128", "--num_layers", "2"] if args.dry_run else
                ["--device", "cuda", "--dtype", "bfloat16", "--embed_dim", "2048", "--num_layers", "8", "--num_heads",
                 "16", "--num_kv_heads", "4", "--head_dim", "128", "--num_experts", "64", "--top_k", "8",
                 "--expert_dim", "768", "--vocab_size", "32768", "--seq_len", "4096", "--micro_batch_size", "2"])
    if not skipped:
        code = run_logged([sys.executable, str(MOE), *moe_args], log_path=args.results / "moe.log",
                          timeout=min(MOE_LIMIT, left()), env={**os.environ, "PYTHONPATH": str(ours)})
        moe = [line for line in (args.results / "moe.log").read_text().splitlines()
               if line.startswith(("variant", "ours", "transformers", "dense", "cpu ", "cuda "))]
        if code != 0:  # the rows of the variants that ended, then why the rest are missing
            moe.append(f"FAILED (exit {code}{', time limit' if code == 124 else ''})")

    table = write_table(args.results, runs, versions, device=device_name(args.dry_run), pytest_status=pytest_status,
                        attention=attention, tensor_parallel=tensor_parallel, moe=moe, recipes=recipes,
                        context_parallel=context_parallel)
    print("\n" + table)
    log(f"done in {time.monotonic() - started:.0f} s; {args.results / 'results.md'}")
    if any(run["status"] != "ok" for run in [*runs, *recipes]):
        sys.exit(1)


if __name__ == "__main__":
    main()
