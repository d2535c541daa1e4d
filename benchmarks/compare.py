"""Our recipes against their peers on the same job: tokens per second and peak memory, as ratios.

    python benchmarks/compare.py --device cpu                                  # tiny Llama, full and LoRA, ~4.5 min
    python benchmarks/compare.py --device cuda --model llama3_2_1b             # full fine-tune, bf16
    python benchmarks/compare.py --device cuda --model llama3_1_8b --methods lora qlora
    python benchmarks/compare.py --device cpu --ladder                         # ours only, technique by technique

For each method (``full``: every weight trains; ``lora``; ``qlora``: LoRA on an NF4 base) three programs train the
same model on the same data, each in its own process:

* **ours**: ``tune run full_finetune_single_device --config demo`` (or ``lora_finetune_single_device``) with
  command-line overrides for the shape, data, batch and optimizer;
* **torchtune** 0.6.1: its own ``full_finetune_single_device`` / ``lora_finetune_single_device`` recipes, run with
  ``python -m torchtune._cli.tune run RECIPE --config <a YAML written here>``, in a virtual environment of its own
  (``~/.cache/tunekit-bench/torchtune-venv``, created on first use with torch at our version, torchtune 0.6.1,
  torchao 0.10.0 and torchdata 0.11.0), or with ``--torchtune-python``/``--torchtune-pythonpath`` on a machine
  that brings them along (``benchmarks/gpu/``);
* **transformers**: a plain training loop written here (``LlamaForCausalLM`` + ``peft`` for LoRA, bitsandbytes
  NF4 for QLoRA when it is installed), in this interpreter.

What is the same for all three:

* **Model**: one shape table (``SHAPES``) feeds each tool's component builder (ours ``toolkit.models.llama3.llama3``
  / ``lora_llama3``, torchtune ``llama3_2``/``llama3_1`` and their ``lora_`` versions, transformers ``config.json``),
  and all three start from the same random weights: a Hugging Face safetensors checkpoint written once by our
  ``HFCheckpointer.save``. LoRA: rank 8, alpha 16, no dropout, on q/k/v/o and the three MLP projections.
* **Data and tokens**: one JSONL file whose rows are all the same text, longer than the sequence; every tool reads
  it as text completion (ours ``text_completion_dataset``, torchtune ``text_completion_dataset``, transformers
  here), truncated to ``--seq-len`` tokens, so every sample is exactly ``seq_len`` tokens, nothing is padded or
  packed, and a step trains ``batch_size x (seq_len - 1)`` tokens (the last position has no target). Ours and
  torchtune use their own Llama 3 tiktoken tokenizers over one tokenizer file written here (the 256 byte tokens,
  special tokens at 256..511), and the transformers loop encodes the same way (``<|begin_of_text|>`` then the
  bytes), so all three see the same token ids. Same rows in every batch: the first step's loss must agree across
  the tools (the table shows it), which checks that weights, tokens and loss normalization are the same.
  ``--packed`` instead writes documents of random lengths (16 to ``seq_len / 2`` tokens) that ours and torchtune
  pack into rows of ``seq_len`` the same way (in order, no document split across rows, each row padded to
  ``seq_len``), attending within documents; tokens/s then counts every position of a step, padding included. The
  transformers loop has no packing and is skipped. The first-step losses of the two differ slightly there (each
  tool's labels at document boundaries), so they check less.
* **Step**: batch ``--batch-size`` in one micro-batch (no accumulation), AdamW (``fused=True``, lr 1e-4, betas
  (0.9, 0.95), no weight decay), gradient norm clipped at 1.0, cosine schedule without warmup, fp32 on CPU and
  bf16 parameters on CUDA (no autocast), activation checkpointing off on CPU and as ``--activation-checkpointing``
  says on CUDA (on for the 8B shapes), ``torch.compile`` in ours and torchtune as ``--compile`` says (on CUDA: each
  tool's best setting, as torchtune's own GPU numbers are taken; off on CPU; the transformers loop runs eagerly,
  as the Hugging Face numbers in issue 8 were). Ours and torchtune compute the output projection and
  the loss in ``--loss-chunks`` (8) chunks of the sequence, so the float32 logits never exist whole (ours
  ``loss_chunks``, 8 in its real-model configs, with the projection fused with the loss so that no chunk's
  logits are kept either, its default ``fused_loss: true``; torchtune ``CEWithChunkedOutputLoss``, 8 in its
  configs, keeping every chunk's logits for backward); the transformers loop computes them whole, its default.
  ``--loss-chunks 0``: whole logits in transformers and torchtune, one fused chunk in ours.

How it measures, the same way for all three: a ``sitecustomize`` module (written into the work folder and put on
``PYTHONPATH``) registers a global ``torch.optim`` step post-hook in each training process. After every optimizer
step it records the time (after ``torch.cuda.synchronize()`` on CUDA), the process's CPU time, its resident-memory
high-water mark (``VmHWM``) and, on CUDA, ``torch.cuda.max_memory_allocated``. A step's time runs from the end of
the previous optimizer step to the end of this one: one whole loop iteration (data, forward, backward, clipping,
step, the tool's own logging). **tokens/s** = trained tokens per step / the median step time after ``--warmup``
steps. **memory** = the highest peak from the start to the last optimizer step: host RSS on CPU, allocated GPU
memory on CUDA, so loading counts and the final save does not. The table also shows the median CPU seconds per
step; **training GiB**: the peak after the first forward pass minus the memory held when it began (gradients,
optimizer state, activations: what training adds to the loaded model; the probe resets the peak counters there);
on CPU the peak above what the process held once Python and torch were loaded (the rest is each tool's imports,
data and model); the process's RSS high-water to its exit (``wait4``, the final save included); and, without
interleaving, each tool's own throughput log (ours ``metrics.jsonl`` ``tokens_per_second``, timed over forward,
backward and step; torchtune's ``tokens_per_second_per_gpu``, over the loop iteration). For ours, the table also
splits the step (``split ms``): forward and backward and the data wait from our recipe's own timers in
``metrics.jsonl``, and the rest of the probe's step time (clipping, optimizer, schedule, logging). The table is
followed by the same ratios computed from CPU time per step and from training GiB. On CUDA the table adds **MFU**:
issue 8's model FLOPs per token (``matmul_flops_per_token``: 6N for full fine-tuning, 4N + 6N_lora for LoRA and
QLoRA) times the ``batch x seq`` positions of a step, per second of step time, over the bf16 matmul rate measured
at the start (``--peak-tflops`` states one instead).

On CPU the machine is shared (2 cores here, other jobs come and go), so two things keep the comparison about the
tools rather than about the load at the minute each ran:

* **Interleaved steps** (``--interleave``, on by default on CPU): the three processes start together, and the probe
  stops its process (SIGSTOP) after every optimizer step; compare.py then lets them go one step each in turn, so
  only one trains at any time and each tool's step k runs within seconds of the others'. The time a process spends
  stopped is not counted (its step starts when it is let go). A tool's own timer would count it, so its own
  throughput log is shown only without interleaving.
* **One thread per process** (``--threads``, default 1 on CPU): with torch's default of 2 OpenMP threads on 2 cores
  that other jobs also use, a thread waiting at a barrier for its descheduled partner spins; steps measured that
  way took 6-9x the CPU time of one-thread steps and varied by 5x from one step to the next, which swamped every
  difference between tools. ``--threads 0`` gives torch its own choice.

**The ladder** (``--ladder``) runs no peer: it runs our recipe once per rung of ``LADDER``, each rung adding one
technique to those above it (chunked loss, the projection fused with it, activation checkpointing, offloading on
CUDA, compile, 8-bit AdamW, the optimizer step in backward), measured the same way, and prints each rung's tokens/s
and memory against the baseline's: what each switch costs or saves on this job.

On CUDA the runs go one after another (memory: a full 3B fine-tune does not fit three times) on torch's defaults.
The last lines are one per comparison::

    ratio <recipe> vs <peer>: <ours / theirs tokens/s> (memory <ours / theirs>)

``--ours-variant NAME:KEY=VALUE[,...]`` also runs ours with those overrides in the same invocation (tool
``ours[NAME]``: the same checkpoint, data and peers, so a switch such as ``sdpa_backend=cudnn`` is measured
without a second setup); its lines follow, ``ratio <recipe>[NAME] vs ours`` and against every peer.

Numbers depend on the machine and its load; not a test (benchmarks/README.md keeps a table).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TORCHTUNE_VENV = Path.home() / ".cache" / "tunekit-bench" / "torchtune-venv"
# The peer versions this benchmark is written against (torchtune 0.6.1 runs with torch 2.13 and torchao 0.10).
TORCHTUNE_PACKAGES = ("torchtune==0.6.1", "torchao==0.10.0", "torchdata==0.11.0")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
TORCHTUNE_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")  # torchtune's name for o_proj
HF_LORA_MODULES = (*LORA_MODULES, "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16
LR, BETAS = 1e-4, (0.9, 0.95)
NUM_BYTES = 256  # the tokenizer written here: ids 0..255 are bytes, special tokens follow
PEERS = ("torchtune", "transformers")
RECIPES = {"full": "full_finetune", "lora": "lora_finetune", "qlora": "lora_finetune"}


@dataclass(frozen=True)
class Shape:
    """A Llama 3.x architecture; ``rope_scaling`` is Llama 3.1's factor (8 for 3.1, 32 for 3.2)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    rope_scaling: int
    tie_word_embeddings: bool
    rope_base: int = 500_000


SHAPES = {
    # CPU: Llama 3.2's layout (tied embeddings, rope scaling 32; 5.1M parameters) and 3.1's (untied, 8; 7.2M).
    "tiny": Shape(8192, 4, 8, 2, 256, 768, rope_scaling=32, tie_word_embeddings=True),
    "tiny_untied": Shape(8192, 4, 8, 2, 256, 768, rope_scaling=8, tie_word_embeddings=False),
    "llama3_2_1b": Shape(128_256, 16, 32, 8, 2048, 8192, rope_scaling=32, tie_word_embeddings=True),
    "llama3_2_3b": Shape(128_256, 28, 24, 8, 3072, 8192, rope_scaling=32, tie_word_embeddings=True),
    "llama3_1_8b": Shape(128_256, 32, 32, 8, 4096, 14_336, rope_scaling=8, tie_word_embeddings=False),
}


def matmul_flops_per_token(shape: Shape, method: str) -> float:
    """Issue 8's count of model FLOPs per token position: 6 per trainable matmul weight (forward, input gradient,
    weight gradient) and 4 per frozen one (no weight gradient), so ``6N`` for full fine-tuning and
    ``4N + 6N_lora`` for LoRA and QLoRA; attention scores are not counted. ``N`` is every weight that multiplies
    activations: the layers' projections and the output projection (a tied embedding, counted once); an untied
    input embedding is a lookup. Checked against the issue's table: 3.21e9 weights for the 3B shape, 1.24e9 for 1B,
    7.50e9 for 8B (8.03e9 parameters less its 0.53e9 embedding)."""
    d, hd = shape.embed_dim, shape.embed_dim // shape.num_heads
    kv = shape.num_kv_heads * hd
    per_layer = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                 "gate_proj": (d, shape.intermediate_dim), "up_proj": (d, shape.intermediate_dim),
                 "down_proj": (shape.intermediate_dim, d)}
    weights = shape.num_layers * sum(i * o for i, o in per_layer.values()) + shape.vocab_size * d
    if method == "full":
        return 6.0 * weights
    adapters = shape.num_layers * sum(LORA_RANK * (i + o) for name, (i, o) in per_layer.items()
                                      if name in HF_LORA_MODULES)
    return 4.0 * weights + 6.0 * adapters


def measure_matmul_rate(env: dict[str, str]) -> float:
    """The GPU's dense bf16 matmul rate in FLOP/s, as our recipes measure it for their MFU
    (``toolkit.training.profiling.measure_peak_flops``), in a process of its own with our ``env``."""
    code = ("import torch; from toolkit.training.profiling import measure_peak_flops; "
            "print(measure_peak_flops(torch.device('cuda')))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(run.stdout.split()[-1])


@dataclass(frozen=True)
class Job:
    """One comparison: everything the three tools must agree on."""

    method: str  # full | lora | qlora
    shape_name: str
    device: str
    dtype: str  # fp32 | bf16 (our names; torchtune's are the same)
    batch_size: int
    seq_len: int
    steps: int
    activation_checkpointing: bool
    loss_chunks: int  # 0: whole logits
    checkpoint_dir: str
    data: str
    tokenizer: str
    ours_overrides: tuple[str, ...] = ()  # more config overrides for our recipe (--ours-set, the ladder's rungs)
    compile: bool = False  # torch.compile in ours and torchtune (the transformers loop runs eagerly)
    packed: bool = False  # documents of many lengths packed into rows of seq_len (ours and torchtune only)

    @property
    def shape(self) -> Shape:
        return SHAPES[self.shape_name]

    @property
    def tokens_per_step(self) -> int:
        if self.packed:  # packs are padded to seq_len in both tools: positions, padding included
            return self.batch_size * self.seq_len
        return self.batch_size * (self.seq_len - 1)  # the last position of a sample has no target


# --- The probe: the same measurement inside every training process -------------------------------------------------

SITECUSTOMIZE = """\
# Written by benchmarks/compare.py. In a process started with BENCH_PROBE_OUT set, compare.py's install_probe()
# records a line after every optimizer step.
import os

if os.environ.get("BENCH_PROBE_OUT"):
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location("_bench_compare", os.environ["BENCH_PROBE_SRC"])
    _module = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
    _spec.loader.exec_module(_module)
    _module.install_probe(
        os.environ["BENCH_PROBE_OUT"], cuda=os.environ.get("BENCH_PROBE_CUDA") == "1",
        pause=os.environ.get("BENCH_PROBE_PAUSE") == "1",
    )
"""


def _proc_status_kib(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmHWM``: resident high-water mark), KiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def install_probe(path: str, *, cuda: bool, pause: bool) -> None:
    """After every optimizer step of this process, append ``{"t", "cpu", "hwm_kib"[, "cuda_peak"], "resumed"}`` to
    ``path.<pid>``. With ``pause`` the process then stops itself (SIGSTOP) until compare.py lets it go on, and
    ``resumed`` is when it did: the next step's time is counted from there.

    Before the first forward pass of any module (the model is loaded, training starts) it records the memory held
    and the peak so far (``{"first_forward": ...}``), then resets the peak (``/proc/self/clear_refs``, CUDA's peak
    counter), so that later peaks are training's alone.
    """
    import signal

    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out = open(f"{path}.{os.getpid()}", "a", encoding="utf-8")  # a child process would write its own file
    # The resident memory once Python and torch are loaded: the same start for every tool.
    header = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rss_kib": _proc_status_kib("VmRSS")}
    out.write(json.dumps(header) + "\n")
    out.flush()

    def before_first_forward(module: Any, args: Any) -> None:
        first_forward.remove()
        record = {"first_forward": True, "rss_kib": _proc_status_kib("VmRSS"), "hwm_kib": _proc_status_kib("VmHWM")}
        if cuda:
            record["cuda_alloc"], record["cuda_peak"] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
        out.write(json.dumps(record) + "\n")
        out.flush()

    first_forward = register_module_forward_pre_hook(before_first_forward)

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a step run by a backward hook (our optimizer_in_backward): one parameter's, not the step's end
        record: dict[str, Any] = {}
        if cuda:
            torch.cuda.synchronize()  # the step's kernels are done: intervals are device time, not launch time
            record["cuda_peak"] = torch.cuda.max_memory_allocated()
        record["t"], record["cpu"] = time.perf_counter(), time.process_time()
        record["hwm_kib"] = _proc_status_kib("VmHWM")
        if pause:
            os.kill(os.getpid(), signal.SIGSTOP)
        record["resumed"] = time.perf_counter()
        out.write(json.dumps(record) + "\n")
        out.flush()

    register_optimizer_step_post_hook(after_step)


def probe_env(out: Path, *, cuda: bool, pause: bool) -> dict[str, str]:
    """The environment that turns the probe on in a training process whose outputs go to ``out``."""
    return {"BENCH_PROBE_OUT": str(out.parent / f"{out.name}.probe"), "BENCH_PROBE_CUDA": str(int(cuda)),
            "BENCH_PROBE_PAUSE": str(int(pause))}


def read_probe(prefix: Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The header, the first-forward record and the step records of the process that stepped an optimizer."""
    for path in sorted(prefix.parent.glob(prefix.name + ".*")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps = [line for line in lines[1:] if "t" in line]
        if steps:
            first = next((line for line in lines if line.get("first_forward")), {})
            return lines[0], first, steps
    return {}, {}, []


def clear_previous(out: Path) -> None:
    """Remove what an earlier run left at ``out``: its outputs, probe files and log."""
    for old in [out, *out.parent.glob(f"{out.name}.*")]:
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)


def run_announced(label: str, procs: dict[str, list[Any]], *, interleave: bool) -> dict[str, tuple[int, Any, float]]:
    """:func:`run_together`, saying what runs and, once all have ended, how long it took."""
    print(f"  {label} {'interleaved' if interleave else 'one after another'} ...", end=" ", flush=True)
    started = time.perf_counter()
    ended = run_together(procs, interleave=interleave)
    print(f"{time.perf_counter() - started:.0f} s", flush=True)
    return ended


def run_together(procs: dict[str, list[Any]], *, interleave: bool) -> dict[str, tuple[int, Any, float]]:
    """Run training processes to the end: ``{name: [cmd, env, cwd, log_path]}`` -> ``{name: (exit code, rusage,
    wall s)}``.

    With ``interleave`` they start together, and each stops itself after every optimizer step (the probe's
    ``pause``); once all have done their first step they take turns, one step each, so that only one trains at a
    time and a change in the machine's load between minutes falls on every tool alike. Without it they run one
    after another.
    """
    done: dict[str, tuple[int, Any, float]] = {}

    def start(name: str) -> tuple[subprocess.Popen, float]:
        cmd, env, cwd, log = procs[name]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        return proc, time.perf_counter()

    def wait(name: str, proc: subprocess.Popen, started: float) -> bool:
        """Wait until the process stops (True) or ends (False, recorded)."""
        _, status, usage = os.wait4(proc.pid, os.WUNTRACED)  # usage at exit: its own peak RSS (ru_maxrss)
        if os.WIFSTOPPED(status):
            return True
        proc.returncode = os.waitstatus_to_exitcode(status)
        done[name] = (proc.returncode, usage, time.perf_counter() - started)
        return False

    if not interleave:
        for name in procs:
            proc, started = start(name)
            while wait(name, proc, started):
                os.kill(proc.pid, signal.SIGCONT)  # (a stop the probe did not ask for)
        return done
    running = {name: start(name) for name in procs}
    stopped = [name for name, (proc, started) in running.items() if wait(name, proc, started)]
    while stopped:
        for name in list(stopped):
            proc, started = running[name]
            os.kill(proc.pid, signal.SIGCONT)
            if not wait(name, proc, started):
                stopped.remove(name)
    return done


# --- Shared inputs: tokenizer, data, random checkpoint ---------------------------------------------------------------

# Llama 3's special tokens (names as in both tools' Llama 3 tokenizers), here at 256 + index. torchtune's tokenizer
# also requires <|step_id|>, <|image|> and <|video|>: they take reserved slots no text encodes to.
_SPECIALS = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 5: "<|step_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>", 12: "<|video|>", 255: "<|image|>"}


def write_tokenizer(folder: Path) -> tuple[Path, Path]:
    """A tiktoken rank file of the 256 single bytes (token id = byte value, no merges), and torchtune's special
    tokens file (``tokenizer.json``'s ``added_tokens``) with the ids our ``llama3_tokenizer`` gives them."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = folder / "tokenizer.model"
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(NUM_BYTES)))
    reserved = iter(range(NUM_BYTES))
    added = [
        {"id": NUM_BYTES + i, "content": _SPECIALS.get(i) or f"<|reserved_special_token_{next(reserved)}|>"}
        for i in range(256)
    ]
    specials = folder / "special_tokens.json"
    specials.write_text(json.dumps({"added_tokens": added}))
    return ranks, specials


# The benchmark's text: ASCII words (one byte, one token).
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box jackdaws nightly".split()


def write_documents(path: Path, *, tokens: int, seq_len: int, seed: int = 0) -> None:
    """Rows of ASCII text of random lengths (uniform from 16 to ``seq_len / 2`` bytes, one byte a token), about
    ``tokens`` in all, for packing."""
    rng = random.Random(seed)
    rows, total = [], 0
    while total < tokens:
        n = rng.randint(16, max(16, seq_len // 2))
        text = " ".join(rng.choice(WORDS) for _ in range(n))[:n]
        rows.append(json.dumps({"text": text}) + "\n")
        total += n + 2  # with BOS and EOS
    path.write_text("".join(rows))


def write_data(path: Path, *, rows: int, seq_len: int) -> None:
    """``rows`` identical rows of ASCII text longer than ``seq_len`` tokens (one byte is one token here)."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(seq_len))[: seq_len + 64]
    assert len(text) > seq_len
    path.write_text((json.dumps({"text": text}) + "\n") * rows)


def encode_row(text: str, seq_len: int) -> list[int]:
    """What both Llama 3 tokenizers give for a row with the tokenizer above: BOS, the bytes, cut to ``seq_len``."""
    return ([NUM_BYTES] + list(text.encode("utf-8")))[:seq_len]


def checkpoint_command(shape_name: str, folder: Path, *, dtype: str, seq_len: int) -> list[str]:
    """The command that writes a random ``shape_name`` checkpoint into ``folder`` (:func:`make_checkpoint`, in a
    process of its own: run it with our recipes' ``PYTHONPATH``)."""
    spec = json.dumps({"shape": shape_name, "dir": str(folder), "dtype": dtype, "seq_len": seq_len})
    return [sys.executable, str(Path(__file__).resolve()), "--_make-checkpoint", spec]


def make_checkpoint(spec: dict[str, Any]) -> None:
    """(In a subprocess.) Random weights in Hugging Face layout, written by our ``HFCheckpointer``."""
    import torch

    from toolkit.models.llama3 import llama3
    from toolkit.modules import Llama3RopeScaling
    from toolkit.training import HFCheckpointer, init_weights

    shape = SHAPES[spec["shape"]]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama3(**_our_dims(shape, spec["seq_len"]), rope_scaling=Llama3RopeScaling(factor=shape.rope_scaling))
    model.to(torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32)
    model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")  # initializing 8B on a GPU takes seconds
    init_weights(model)
    HFCheckpointer(model_family="llama3").save(model, spec["dir"])


def _our_dims(shape: Shape, seq_len: int) -> dict[str, Any]:
    return dict(
        vocab_size=shape.vocab_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, embed_dim=shape.embed_dim, intermediate_dim=shape.intermediate_dim,
        max_seq_len=seq_len, rope_base=float(shape.rope_base), tie_word_embeddings=shape.tie_word_embeddings,
    )


def model_overrides(shape: Shape, seq_len: int, *, builder: str = "llama3", key: str = "model") -> list[str]:
    """Config overrides that make a recipe's ``key`` section (``model``, or a distillation's ``teacher_model``) our
    ``toolkit.models.llama3.<builder>`` (``llama3`` or ``lora_llama3``) of ``shape``."""
    return [
        f"{key}._component_=toolkit.models.llama3.{builder}",
        *(f"{key}.{k}={v}" for k, v in _our_dims(shape, seq_len).items()),
        f"{key}.rope_scaling._component_=toolkit.modules.Llama3RopeScaling",
        f"{key}.rope_scaling.factor={float(shape.rope_scaling)}",
    ]


# --- The three commands ----------------------------------------------------------------------------------------------


def ours_command(job: Job, out: Path) -> list[str]:
    """``tune run <recipe>_single_device --config demo`` with overrides for the job."""
    shape, lora = job.shape, job.method != "full"
    o = [
        f"output_dir={out}", "overwrite=true", f"device={job.device}", f"dtype={job.dtype}", "seed=0",
        "progress_bar=false", "metric_loggers=[]", f"max_seq_len={job.seq_len}",
        "tokenizer._component_=toolkit.tokenizers.llama3_tokenizer", f"tokenizer.path={job.tokenizer}",
        *model_overrides(shape, job.seq_len, builder="lora_llama3" if lora else "llama3"),
        f"checkpointer.checkpoint_dir={job.checkpoint_dir}",
        "dataset._component_=toolkit.data.text_completion_dataset", f"dataset.source={job.data}",
        "~dataset.num_samples", "~dataset.seed", "dataset.cache_dir=null", "~eval_tasks",
        *(["dataset.packed=true", "dataset.packing_strategy=in_order", f"dataset.max_seq_len={job.seq_len}"]
          if job.packed else []),
        f"batch_size={job.batch_size}", f"micro_batch_size={job.batch_size}", "data_parallel=ddp",
        "epochs=1", f"max_steps={job.steps}",
        f"optimizer.lr={LR}", f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]", "optimizer.weight_decay=0.0",
        "optimizer.fused=true", "lr_scheduler.warmup_steps=0", "lr_scheduler.min_lr_ratio=0.0",
        "clip_grad_norm=1.0", f"activation_checkpointing={str(job.activation_checkpointing).lower()}",
        f"loss_chunks={job.loss_chunks or 'null'}", f"compile={str(job.compile).lower()}",
        "log_every_n_steps=1", "save_every_n_steps=null",
    ]
    if lora:
        o += [
            f"model.lora_attn_modules=[{','.join(LORA_MODULES)}]", "model.apply_lora_to_mlp=true",
            "model.apply_lora_to_output=false", f"model.lora_rank={LORA_RANK}", f"model.lora_alpha={LORA_ALPHA}",
            "model.lora_dropout=0.0", "model.use_dora=false",
            f"model.quantize_base={str(job.method == 'qlora').lower()}", "save_merged=false",
        ]
    o += job.ours_overrides  # later overrides win
    return [sys.executable, "-m", "toolkit.cli", "run", f"{RECIPES[job.method]}_single_device", "--config", "demo", *o]


def torchtune_config(job: Job, out: Path, special_tokens: str) -> dict[str, Any]:
    """A torchtune 0.6.1 recipe config for the job (its keys as in its own single-device configs)."""
    shape, lora = job.shape, job.method != "full"
    family = "llama3_2" if shape.tie_word_embeddings else "llama3_1"
    model: dict[str, Any] = {
        "_component_": f"torchtune.models.{family}.{'lora_' if lora else ''}{family}",
        "vocab_size": shape.vocab_size, "num_layers": shape.num_layers, "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads, "embed_dim": shape.embed_dim, "max_seq_len": job.seq_len,
        "intermediate_dim": shape.intermediate_dim, "rope_base": shape.rope_base, "scale_factor": shape.rope_scaling,
    }
    if lora:
        model.update(
            lora_attn_modules=list(TORCHTUNE_LORA_MODULES), apply_lora_to_mlp=True, apply_lora_to_output=False,
            lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, quantize_base=job.method == "qlora",
        )
    config = {
        "output_dir": str(out),
        "model": model,
        # Its text-completion dataset cuts a sample to max_seq_len - 1 tokens: one more gives seq_len.
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer", "path": job.tokenizer,
                      "special_tokens_path": special_tokens, "max_seq_len": job.seq_len + (0 if job.packed else 1)},
        # Packed: its PackedDataset fills packs of the tokenizer's max_seq_len in order, padding the last part.
        "dataset": {"_component_": "torchtune.datasets.text_completion_dataset", "source": "json",
                    "data_files": job.data, "split": "train", "column": "text", "packed": job.packed,
                    **({"split_across_pack": False} if job.packed else {})},
        "seed": 0,
        "shuffle": False,
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": job.checkpoint_dir,
            "checkpoint_files": sorted(p.name for p in Path(job.checkpoint_dir).glob("*.safetensors")),
            "recipe_checkpoint": None, "output_dir": str(out),
            "model_type": "LLAMA3_2" if shape.tie_word_embeddings else "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "batch_size": job.batch_size,
        "epochs": 1,
        "max_steps_per_epoch": job.steps,
        "gradient_accumulation_steps": 1,
        "optimizer_in_bwd": False,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": LR, "betas": list(BETAS), "weight_decay": 0.0,
                      "fused": True},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 0},
        "loss": ({"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": job.loss_chunks}
                 if job.loss_chunks else {"_component_": "torch.nn.CrossEntropyLoss"}),
        "clip_grad_norm": 1.0,
        "compile": job.compile,
        "device": job.device,
        "dtype": job.dtype,
        "enable_activation_checkpointing": job.activation_checkpointing,
        "enable_activation_offloading": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")},
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,  # it would reset CUDA's peak counter, which the probe reads
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }
    if lora:
        config["save_adapter_weights_only"] = True  # as ours with save_merged=false: no merged model at the end
    return config


def torchtune_command(job: Job, out: Path, special_tokens: str, python: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(json.dumps(torchtune_config(job, out, special_tokens), indent=1))  # JSON is YAML
    recipe = f"{RECIPES[job.method]}_single_device"
    return [python, "-m", "torchtune._cli.tune", "run", recipe, "--config", str(config)]


def transformers_command(job: Job, out: Path) -> list[str]:
    spec = json.dumps({**asdict(job), "out": str(out)})
    return [sys.executable, str(Path(__file__).resolve()), "--_transformers-worker", spec]


def transformers_worker(spec: dict[str, Any]) -> None:
    """(In a subprocess.) A plain transformers (+ peft) training loop: the peer a user would write by hand."""
    import torch
    from transformers import LlamaForCausalLM

    job = Job(**{k: v for k, v in spec.items() if k != "out"})
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(job.device)
    dtype = torch.bfloat16 if job.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    if job.method == "qlora":
        from transformers import BitsAndBytesConfig  # NF4 base weights need bitsandbytes (checked before)

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = LlamaForCausalLM.from_pretrained(
            job.checkpoint_dir, dtype=dtype, quantization_config=quant, device_map={"": torch.cuda.current_device()}
        )
    else:
        model = LlamaForCausalLM.from_pretrained(job.checkpoint_dir, dtype=dtype).to(device)
    if job.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if job.method != "full":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(HF_LORA_MODULES),
                          bias="none", task_type="CAUSAL_LM")
        # Adapters in the model's dtype, as in ours and torchtune (peft would make them fp32 by default).
        model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(1.0, step / job.steps)))
    )
    rows = [json.loads(line)["text"] for line in Path(job.data).read_text().splitlines()]
    model.train()
    with open(out / "losses.jsonl", "w", encoding="utf-8") as log:
        for step in range(job.steps):
            batch = rows[step * job.batch_size : (step + 1) * job.batch_size]
            ids = torch.tensor([encode_row(text, job.seq_len) for text in batch], device=device)
            loss = model(input_ids=ids, labels=ids).loss  # shifts the labels itself: seq_len - 1 targets per row
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(json.dumps({"step": step + 1, "loss": loss.item()}) + "\n")


# --- Running and reading -----------------------------------------------------------------------------------------


@dataclass
class Result:
    tool: str
    tokens_per_s: float | None = None
    step_ms: float | None = None
    cpu_s: float | None = None
    memory_gib: float | None = None
    above_torch_gib: float | None = None
    training_gib: float | None = None
    process_rss_gib: float | None = None
    own_tokens_per_s: float | None = None
    split: str = ""  # ours: forward+backward / data wait / the rest of the step (optimizer, logging), ms
    first_loss: float | None = None
    last_loss: float | None = None
    wall_s: float | None = None
    mfu: float | None = None  # GPU: model FLOPs per second (matmul_flops_per_token) over the measured matmul rate
    note: str = ""


def read_result(tool: str, *, job: Job, out: Path, exit_code: int, usage: Any, wall_s: float,
                warmup: int, interleaved: bool) -> Result:
    """Step times and memory from the probe, losses and throughput from the tool's own log."""
    result = Result(tool, wall_s=wall_s, process_rss_gib=usage.ru_maxrss / 2**20)
    log = out.parent / f"{out.name}.log"
    if exit_code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        print(f"  {tool} failed (exit {exit_code}); last lines of {log}:\n{tail}", file=sys.stderr)
        result.note = f"failed (exit {exit_code}), see {log.name}"
        return result
    header, first, steps = read_probe(out.parent / f"{out.name}.probe")
    if len(steps) != job.steps:
        result.note = f"probe saw {len(steps)} optimizer steps, expected {job.steps}; "
    # Step k's time runs from the end of step k - 1 (or its resumption) to the end of step k; steps 1..warmup out.
    measured = list(zip(steps, steps[1:]))[max(warmup - 1, 0):]
    if measured:
        result.step_ms = statistics.median(b["t"] - a["resumed"] for a, b in measured) * 1e3
        result.tokens_per_s = job.tokens_per_step / result.step_ms * 1e3
        result.cpu_s = statistics.median(b["cpu"] - a["cpu"] for a, b in measured)
    if steps and first:
        # The peak of the whole run to the last step: loading's (before the reset) or training's, whichever is higher.
        key, unit = ("cuda_peak", 1) if job.device == "cuda" else ("hwm_kib", 1024)
        result.memory_gib = max(first[key], steps[-1][key]) * unit / 2**30
        held = first["cuda_alloc"] if job.device == "cuda" else first["rss_kib"] * 1024
        result.training_gib = (steps[-1][key] * unit - held) / 2**30
        # wait4's ru_maxrss is the high-water since the probe's reset, to the exit (the final save included).
        result.process_rss_gib = max(usage.ru_maxrss, first["hwm_kib"]) / 2**20
    losses, own = own_log(tool, out)
    if losses:
        result.first_loss, result.last_loss = losses[0], losses[-1]
    if own[warmup:] and not interleaved:  # (a tool's own timer would count the turns it waited)
        result.own_tokens_per_s = statistics.median(own[warmup:])
    if tool == "ours" and result.step_ms is not None:
        result.split = step_split(out, warmup=warmup, step_ms=result.step_ms)
    if header:
        if steps and first and job.device == "cpu":
            result.above_torch_gib = (max(first["hwm_kib"], steps[-1]["hwm_kib"]) - header["rss_kib"]) / 2**20
        result.note += f"torch {header['torch']}, {header['threads']} threads"
    return result


def step_split(out: Path, *, warmup: int, step_ms: float) -> str:
    """Our step time split as ``forward+backward / data wait / rest`` ms, from ``metrics.jsonl``.

    Forward/backward and the data wait come from the recipe's own timers (medians after the warmup), which the
    probe's pause (inside the optimizer step) does not touch; the rest (clipping, optimizer, schedule, logging) is
    what the probe's step time leaves.
    """
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "forward_backward_s" in r][warmup:]
    if not records:
        return ""
    forward_backward = statistics.median(r["forward_backward_s"] for r in records) * 1e3
    data = statistics.median(r["data_wait_s"] for r in records) * 1e3
    return f"{forward_backward:.1f} / {data:.1f} / {step_ms - forward_backward - data:.1f}"


def own_log(tool: str, out: Path) -> tuple[list[float], list[float]]:
    """Per-step losses and the tool's own tokens/s figures, from what it wrote."""
    if tool == "ours":
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if "loss" in r]
        return [r["loss"] for r in records], [r["tokens_per_second"] for r in records]
    if tool == "torchtune":
        losses, speeds = [], []
        for path in sorted((out / "logs").glob("log_*.txt")):
            for line in path.read_text().splitlines():  # "Step 3 | loss:10.2 lr:0.0001 tokens_per_second_per_gpu:..."
                if not line.startswith("Step "):
                    continue
                fields = dict(item.split(":", 1) for item in line.split("|", 1)[1].split())
                losses.append(float(fields["loss"]))
                speeds.append(float(fields["tokens_per_second_per_gpu"]))
        return losses, speeds
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records], []


def ensure_torchtune_venv(venv: Path) -> str:
    """torchtune's own virtual environment (no system site-packages), with torch at this interpreter's version."""
    import torch

    python = venv / "bin" / "python"
    want = torch.__version__
    if python.exists():
        found = subprocess.run([str(python), "-c", "import torch, torchtune; print(torch.__version__)"],
                               capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.split()[-1] == want:
            return str(python)
    print(f"setting up {venv}: torch {want}, {' '.join(TORCHTUNE_PACKAGES)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_req = f"torch=={want.split('+')[0]}"
    # Where would pip take torch from? A CUDA build is a multi-GB download: stop rather than fetch one.
    report = subprocess.run([*pip, "--dry-run", "--report", "-", torch_req], capture_output=True, text=True, check=True)
    for item in json.loads(report.stdout)["install"]:
        if item["metadata"]["name"] == "torch":
            url, version = item["download_info"]["url"], item["metadata"]["version"]
            if version != want and not url.startswith("file:"):
                sys.exit(f"pip would install torch {version} from {url}, not the {want} build this interpreter has; "
                         f"install it into {venv} by hand (e.g. --index-url https://download.pytorch.org/whl/cpu)")
    subprocess.run([*pip, torch_req], check=True)
    subprocess.run([*pip, *TORCHTUNE_PACKAGES], check=True)
    return str(python)


def transformers_missing(method: str) -> str | None:
    """Why the transformers peer cannot run this method here, or None."""
    import importlib.util

    needs = ["transformers"] + (["peft"] if method != "full" else []) + (["bitsandbytes"] if method == "qlora" else [])
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    return f"{', '.join(missing)} not installed" if missing else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


# --- The ladder: what each of our techniques buys, one on top of the other ------------------------------------------


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: config overrides added to all the rungs before it."""

    name: str
    overrides: tuple[str, ...]
    cuda_only: bool = False  # offloading to host memory means nothing when training already runs there


LADDER = (
    Rung("baseline: whole logits", ("loss_chunks=null", "fused_loss=false", "activation_checkpointing=false",
                                    "compile=false")),
    Rung("+ chunked loss (8 chunks)", ("loss_chunks=8",)),
    Rung("+ projection fused with the loss", ("fused_loss=true",)),
    Rung("+ activation checkpointing", ("activation_checkpointing=true",)),
    Rung("+ activation offloading", ("activation_offloading=true",), cuda_only=True),
    Rung("+ compile", ("compile=true",)),
    Rung("+ 8-bit AdamW (torchao)", ("optimizer._component_=torchao.optim.AdamW8bit", "~optimizer.fused")),
    # The step inside backward cannot clip the global gradient norm (it needs every gradient at once).
    Rung("+ optimizer step in backward, no clipping", ("optimizer_in_backward=true", "clip_grad_norm=null")),
)


def run_ladder(job: Job, *, work: Path, env: dict[str, str], interleave: bool, warmup: int,
               keep: bool) -> list[Result]:
    """Our recipe on ``job`` once per rung, each with its techniques and all the earlier ones'."""
    rungs = [rung for rung in LADDER if job.device == "cuda" or not rung.cuda_only]
    procs: dict[str, list[Any]] = {}
    jobs: dict[str, Job] = {}
    outs: dict[str, Path] = {}
    overrides: list[str] = []
    for i, rung in enumerate(rungs):
        overrides += rung.overrides
        jobs[rung.name] = replace(job, ours_overrides=(*job.ours_overrides, *overrides))
        out = outs[rung.name] = work / f"{job.method}_rung{i}"
        clear_previous(out)
        rung_env = {**env, **probe_env(out, cuda=job.device == "cuda", pause=interleave)}
        procs[rung.name] = [ours_command(jobs[rung.name], out), rung_env, work, work / f"{out.name}.log"]
    ended = run_announced(f"{job.method} ladder: {len(rungs)} rungs", procs, interleave=interleave)
    results = []
    for rung in rungs:
        out = outs[rung.name]
        exit_code, usage, wall_s = ended[rung.name]
        result = read_result("ours", job=jobs[rung.name], out=out, exit_code=exit_code, usage=usage, wall_s=wall_s,
                             warmup=warmup, interleaved=interleave)
        result.tool = rung.name
        results.append(result)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    return results


def print_ladder(method: str, results: list[Result], *, steps: int, cpu: bool) -> None:
    base = results[0]
    memory = "peak RSS GiB" if cpu else "peak GPU alloc GiB"
    columns = ["rung", "tokens/s", "x baseline", memory, "x baseline", "training GiB", "x baseline", "loss step 1",
               f"loss step {steps}", "split ms: fwd+bwd / data / rest", "note"]
    print(f"\n{RECIPES[method]}{'/qlora' if method == 'qlora' else ''} ladder (each rung adds to the ones above):\n")
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for r in results:
        cells = [r.tool, fmt(r.tokens_per_s, ".0f"), ratio(r.tokens_per_s, base.tokens_per_s),
                 fmt(r.memory_gib, ".3f"), ratio(r.memory_gib, base.memory_gib), fmt(r.training_gib, ".3f"),
                 ratio(r.training_gib, base.training_gib), fmt(r.first_loss, ".5f"), fmt(r.last_loss, ".5f"),
                 r.split or "-", r.note]
        print("| " + " | ".join(cells) + " |")


def parse_variant(parser: argparse.ArgumentParser, text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME:KEY=VALUE[,KEY=VALUE...]`` (``--ours-variant``) as its name and overrides."""
    name, _, overrides = text.partition(":")
    pairs = tuple(o for o in overrides.split(",") if o)
    if not name.isidentifier() or not pairs or not all("=" in o for o in pairs):
        parser.error(f"--ours-variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...], e.g. cudnn:sdpa_backend=cudnn")
    return name, pairs


def tool_folder(method: str, tool: str) -> str:
    """A tool's output folder name (``ours[cudnn]`` becomes ``ours-cudnn``)."""
    return f"{method}_{tool.replace('[', '-').rstrip(']')}"


def comparisons(method: str, runs: list[Result]) -> list[tuple[str, Result, Result]]:
    """(label, ours-like run, other run) for each ratio line: ours against every peer, then each variant against
    ours and every peer."""
    label = RECIPES[method] + ("/qlora" if method == "qlora" else "")
    is_ours = [r.tool == "ours" or r.tool.startswith("ours[") for r in runs]
    ours = [r for r, mine in zip(runs, is_ours) if mine]
    peers = [r for r, mine in zip(runs, is_ours) if not mine]
    pairs = [(label, ours[0], peer) for peer in peers]
    for variant in ours[1:]:
        pairs += [(label + variant.tool[len("ours"):], variant, other) for other in (ours[0], *peers)]
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: tiny (cpu), llama3_2_1b (cuda)")
    parser.add_argument("--methods", nargs="+", choices=("full", "lora", "qlora"), default=None,
                        help="default: full lora (tiny shapes), full (1B, 3B), lora qlora (8B)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--ladder", action="store_true",
                        help="no peers: our recipe once per technique added (LADDER), tokens/s and memory of each")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 4 (cpu, 1B), 2 (3B, 8B)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 256 (cpu), 2048 (cuda)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run; default 30 (cpu), 15 (cuda)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 5)")
    parser.add_argument("--loss-chunks", type=int, default=8,
                        help="ours and torchtune: output and loss in N chunks (0: whole logits)")
    parser.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                        help="auto: on for the 8B shape, off otherwise")
    parser.add_argument("--packed", action="store_true",
                        help="documents of random lengths packed into rows of --seq-len (per-document attention), "
                             "ours and torchtune only; tokens/s then counts every position, padding included")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile in ours and torchtune (auto: on cuda, each tool's best setting; off on "
                             "cpu, where compiling takes longer than the run)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="checkpoints, data and outputs (default: a temporary folder, /dev/shm on cuda)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for every training process; default 1 on cpu (see the docstring), "
                             "torch's own choice on cuda; 0: torch's own choice")
    parser.add_argument("--interleave", choices=("auto", "on", "off"), default="auto",
                        help="take turns step by step (auto: on cpu, where other jobs share the cores)")
    parser.add_argument("--torchtune-python", default=None,
                        help=f"interpreter that runs torchtune (default: {TORCHTUNE_VENV}, created if missing)")
    parser.add_argument("--torchtune-pythonpath", default=None, help="prepended to PYTHONPATH for torchtune runs")
    parser.add_argument("--ours-pythonpath", default=str(REPO), help="prepended to PYTHONPATH for our runs")
    parser.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for our recipe only, after the benchmark's own (repeatable), e.g. "
                             "sdpa_backend=cudnn; the ratio lines then measure ours with it")
    parser.add_argument("--ours-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                        help="also run ours with these overrides, as tool ours[NAME], in the same invocation (same "
                             "checkpoint, data and peers; repeatable), e.g. cudnn:sdpa_backend=cudnn; its ratio "
                             "lines follow ours'")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the matmul rate MFU is taken against (default on cuda: the bf16 rate, measured here "
                             "at the start; on cpu no MFU unless given)")
    parser.add_argument("--_transformers-worker", dest="transformers_worker", help=argparse.SUPPRESS)
    parser.add_argument("--_make-checkpoint", dest="make_checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_worker:
        return transformers_worker(json.loads(args.transformers_worker))
    if args.make_checkpoint:
        return make_checkpoint(json.loads(args.make_checkpoint))

    variants = [parse_variant(parser, text) for text in args.ours_variant]
    cpu = args.device == "cpu"
    shape_name = args.model or ("tiny" if cpu else "llama3_2_1b")
    big = shape_name == "llama3_1_8b"
    methods = args.methods or (["full", "lora"] if shape_name.startswith("tiny") else ["lora", "qlora"] if big
                               else ["full"])
    batch_size = args.batch_size or (4 if cpu or shape_name == "llama3_2_1b" else 2)
    seq_len = args.seq_len or (256 if cpu else 2048)
    steps = args.steps or (30 if cpu else 15)
    warmup = args.warmup if args.warmup is not None else 5
    ac = big if args.activation_checkpointing == "auto" else args.activation_checkpointing == "on"
    compile_ = not cpu if args.compile == "auto" else args.compile == "on"
    dtype = "fp32" if cpu else "bf16"
    interleave = cpu if args.interleave == "auto" else args.interleave == "on"
    if steps <= warmup + 1:
        parser.error("--steps must exceed --warmup + 1")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tunekit-compare-", dir=None if cpu else "/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    torchtune_python = None
    if "torchtune" in args.peers and not args.ladder:
        torchtune_python = args.torchtune_python or ensure_torchtune_venv(TORCHTUNE_VENV)
    probe_dir = work / "probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    base_env = {
        **os.environ, "BENCH_PROBE_SRC": str(Path(__file__).resolve()), "HF_HOME": str(work / "hf_home"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    }
    threads = args.threads if args.threads is not None else (1 if cpu else 0)
    if threads:
        base_env["OMP_NUM_THREADS"] = str(threads)

    def env_with(*paths: str | None) -> dict[str, str]:
        entries = [str(probe_dir), *(p for p in paths if p), os.environ.get("PYTHONPATH")]
        return {**base_env, "PYTHONPATH": os.pathsep.join(p for p in entries if p)}

    peak_flops = (args.peak_tflops * 1e12 if args.peak_tflops
                  else None if cpu else measure_matmul_rate(env_with(args.ours_pythonpath)))

    ranks, specials = write_tokenizer(work / "tokenizer")
    data = work / "data.jsonl"
    if args.packed:  # enough documents for every step's packs, twice over
        write_documents(data, tokens=2 * steps * batch_size * seq_len, seq_len=seq_len)
    else:
        write_data(data, rows=steps * batch_size, seq_len=seq_len)
    checkpoint = work / f"checkpoint_{shape_name}"
    if not checkpoint.exists():
        started = time.perf_counter()
        subprocess.run(checkpoint_command(shape_name, checkpoint, dtype=dtype, seq_len=seq_len),
                       env=env_with(args.ours_pythonpath), check=True)
        print(f"random {shape_name} checkpoint written in {time.perf_counter() - started:.0f} s", flush=True)

    load_before = os.getloadavg()[0]
    print(f"{shape_name}, {dtype} on {args.device}; batch {batch_size} x {seq_len} tokens, {steps} steps "
          f"(median of the last {steps - warmup}); activation checkpointing {'on' if ac else 'off'}; loss chunks "
          f"{args.loss_chunks or 'none'}; {threads or 'default'} thread(s); work folder {work}"
          f"{'; ours with ' + ' '.join(args.ours_set) if args.ours_set else ''}", flush=True)
    results: dict[str, list[Result]] = {}

    def write_json() -> None:
        """The results so far (rewritten after each method, so that a run stopped by a time limit keeps the
        methods it finished)."""
        if args.json_out:
            args.json_out.write_text(json.dumps(
                {"shape": shape_name, "device": args.device, "dtype": dtype, "batch_size": batch_size,
                 "seq_len": seq_len, "steps": steps, "activation_checkpointing": ac, "loss_chunks": args.loss_chunks,
                 "ours_set": args.ours_set, "ours_variants": {name: list(o) for name, o in variants},
                 "compile": compile_, "packed": args.packed, "peak_flops": peak_flops,
                 "results": {m: [asdict(r) for r in runs] for m, runs in results.items()}}, indent=1))

    for method in methods:
        job = Job(method, shape_name, args.device, dtype, batch_size, seq_len, steps, ac, args.loss_chunks,
                  str(checkpoint), str(data), str(ranks), compile=compile_, packed=args.packed,
                  ours_overrides=tuple(args.ours_set))
        if args.ladder:
            results[method] = run_ladder(job, work=work, env=env_with(args.ours_pythonpath), interleave=interleave,
                                         warmup=warmup, keep=args.keep)
            continue
        procs: dict[str, list[Any]] = {}
        skipped: dict[str, Result] = {}
        # Ours, then ours with each variant's overrides added, then the peers.
        ours_jobs = {"ours": job, **{f"ours[{name}]": replace(job, ours_overrides=(*job.ours_overrides, *overrides))
                                     for name, overrides in variants}}
        tools = [*ours_jobs, *args.peers]
        for tool in tools:
            out = work / tool_folder(method, tool)
            clear_previous(out)
            if tool in ours_jobs:
                cmd, env = ours_command(ours_jobs[tool], out), env_with(args.ours_pythonpath)
            elif tool == "torchtune":
                cmd = torchtune_command(job, out, str(specials), torchtune_python)
                env = env_with(args.torchtune_pythonpath)
            else:
                missing = "no packing in the plain loop" if job.packed else transformers_missing(method)
                if missing:
                    skipped[tool] = Result(tool, note=f"skipped: {missing}")
                    continue
                cmd, env = transformers_command(job, out), env_with()
            env.update(probe_env(out, cuda=not cpu, pause=interleave))
            procs[tool] = [cmd, env, work, work / f"{out.name}.log"]
        ended = run_announced(f"{method}: {', '.join(procs)}", procs, interleave=interleave)
        runs = []
        for tool in tools:
            out = work / tool_folder(method, tool)
            if tool in skipped:
                runs.append(skipped[tool])
                continue
            exit_code, usage, wall_s = ended[tool]
            ours = tool in ours_jobs
            result = read_result("ours" if ours else tool, job=ours_jobs.get(tool, job), out=out, exit_code=exit_code,
                                 usage=usage, wall_s=wall_s, warmup=warmup, interleaved=interleave)
            result.tool = tool
            runs.append(result)
            if not args.keep:  # outputs of big shapes fill /dev/shm
                shutil.rmtree(out, ignore_errors=True)
        for r in runs:
            if peak_flops and r.step_ms:
                positions = batch_size * seq_len  # every position runs forward and backward, the last one too
                r.mfu = matmul_flops_per_token(SHAPES[shape_name], method) * positions / (r.step_ms / 1e3) / peak_flops
        results[method] = runs
        if not args.ladder:  # this method's lines now, and on file, before the next method's runs
            for label, ours, peer in comparisons(method, runs):
                print(f"  so far: {label} vs {peer.tool}: {ratio(ours.tokens_per_s, peer.tokens_per_s)} tokens/s "
                      f"(memory {ratio(ours.memory_gib, peer.memory_gib)})", flush=True)
            write_json()

    print(f"\n1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    if args.ladder:
        for method, runs in results.items():
            print_ladder(method, runs, steps=steps, cpu=cpu)
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return
    if peak_flops:
        print(f"MFU: issue 8's model FLOPs per token (6N full, 4N + 6N_lora LoRA/QLoRA; N the matmul weights) x "
              f"{batch_size} x {seq_len} positions per step / step time, over {peak_flops / 1e12:.4g} TFLOP/s "
              f"({'--peak-tflops' if args.peak_tflops else 'bf16 matmul rate measured here'})\n")
    columns = ["method", "tool", "tokens/s", "step ms", "CPU s/step", f"peak {'RSS' if cpu else 'GPU alloc'} GiB",
               "training GiB", "above torch GiB", "own log tokens/s", "process RSS GiB", "loss step 1",
               f"loss step {steps}", "split ms: fwd+bwd / data / rest", "note"] + (["MFU"] if peak_flops else [])
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for method, runs in results.items():
        for r in runs:
            mfu = [fmt(r.mfu and 100 * r.mfu, ".1f") + ("%" if r.mfu else "")] if peak_flops else []
            cells = [method, r.tool, fmt(r.tokens_per_s, ".0f"), fmt(r.step_ms, ".1f"), fmt(r.cpu_s, ".3f"),
                     fmt(r.memory_gib, ".3f"), fmt(r.training_gib, ".3f"), fmt(r.above_torch_gib, ".3f"),
                     fmt(r.own_tokens_per_s, ".0f"), fmt(r.process_rss_gib, ".3f"), fmt(r.first_loss, ".5f"),
                     fmt(r.last_loss, ".5f"), r.split or "-", r.note, *mfu]
            print("| " + " | ".join(cells) + " |")
    print("\nBy CPU time per step (ours / theirs throughput) and by memory grown after the first forward pass:")
    for method, runs in results.items():
        for label, ours, peer in comparisons(method, runs):
            print(f"  {label} vs {peer.tool}: {ratio(peer.cpu_s, ours.cpu_s)} "
                  f"(training memory {ratio(ours.training_gib, peer.training_gib)})")
    write_json()
    if not args.keep and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print()
    for method, runs in results.items():
        for label, ours, peer in comparisons(method, runs):
            print(f"ratio {label} vs {peer.tool}: {ratio(ours.tokens_per_s, peer.tokens_per_s)} "
                  f"(memory {ratio(ours.memory_gib, peer.memory_gib)})")


if __name__ == "__main__":
    main()
