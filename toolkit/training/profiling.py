"""Where the time and memory go: a torch.profiler trace of a window of steps, and model FLOPs utilization."""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.config import did_you_mean
from toolkit.errors import UserError
from toolkit.modules.contract import DecoderModel
from toolkit.modules.moe import active_shares


class StepProfiler:
    """Profiles optimizer steps ``wait_steps + 1 .. wait_steps + warmup_steps + active_steps`` on the chosen ranks.

    After the window it writes ``<output_dir>/profile/rank_<r>/trace.json`` (open it in Perfetto or
    ``chrome://tracing``; CPU and CUDA kernels, memory events), ``summary.txt`` (the operators by CPU time) and, on
    CUDA, ``summary_device.txt`` (by GPU time) and ``memory_snapshot.pickle`` (drag it onto
    https://pytorch.org/memory_viz): every allocation of the window with its stack. Ranks not chosen, or
    ``enabled: false``, cost nothing. Call :meth:`step` after every optimizer step and :meth:`close` at the end.

    Args:
        output_dir: the run's output folder.
        rank: this process's rank.
        enabled: profile at all.
        wait_steps: steps to skip first (compilation, allocator warmup).
        warmup_steps: steps profiled but discarded (the profiler's own start-up cost).
        active_steps: steps recorded.
        ranks: which ranks profile.
        record_shapes, with_stack: more detail in the trace (larger, slower).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        rank: int,
        enabled: bool = False,
        wait_steps: int = 5,
        warmup_steps: int = 1,
        active_steps: int = 3,
        ranks: Sequence[int] = (0,),
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        if min(wait_steps, warmup_steps) < 0 or active_steps < 1:
            raise UserError("profiler: wait_steps and warmup_steps must be >= 0 and active_steps >= 1")
        self.folder = Path(output_dir) / "profile" / f"rank_{rank}"
        self._profiler = None
        self._memory = False
        self._device = False
        if not enabled or rank not in set(ranks):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        self._device = torch.cuda.is_available()
        if self._device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps, repeat=1),
            on_trace_ready=self._write,
            profile_memory=True,
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        self._profiler.start()
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._memory = True

    @property
    def enabled(self) -> bool:
        return self._profiler is not None

    def _write(self, profiler: torch.profiler.profile) -> None:
        profiler.export_chrome_trace(str(self.folder / "trace.json"))
        averages = profiler.key_averages()
        (self.folder / "summary.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        if self._device:  # where the GPU's time goes: kernels first, not the CPU calls that launched them
            (self.folder / "summary_device.txt").write_text(
                averages.table(sort_by="self_device_time_total", row_limit=60) + "\n"
            )
        if self._memory:
            torch.cuda.memory._dump_snapshot(str(self.folder / "memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory = False

    def step(self) -> None:
        """Mark the end of an optimizer step."""
        if self._profiler is not None:
            self._profiler.step()

    def close(self) -> None:
        """Stop profiling (writing what a window cut short recorded)."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
        if self._memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory = False



def profiler_settings(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's ``profiler`` section as :class:`StepProfiler`'s keyword arguments, checked: a recipe calls this
    before it writes anything, so a misspelled option stops the run before the output folder is touched rather
    than after the model is built.

    Raises:
        UserError: an option :class:`StepProfiler` does not take (with a did-you-mean) or a section that is not a
            mapping.
    """
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise UserError(f"profiler: expected a section of options (enabled, wait_steps, ...), got {section!r}")
    accepted = [name for name in inspect.signature(StepProfiler).parameters if name not in ("output_dir", "rank")]
    for key in section:
        if key not in accepted:
            raise UserError(
                f"profiler.{key}: not an option of the profiler{did_you_mean(str(key), accepted)}; "
                f"its options are {', '.join(accepted)}"
            )
    return dict(section)

def _matmul_weights(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) weights that multiply each token: every 2-D weight but a (separate) input embedding, and
    of the stacked experts of a mixture-of-experts block (and their adapters) the ``top_k / num_experts`` share a
    token goes through."""
    # Any module is counted; one that implements the model contract has an input embedding, a lookup.
    contract = isinstance(model, DecoderModel)
    embedding = model.token_embedding() if contract else None
    tied = contract and model.output_projection() is None
    active_share = active_shares(model)
    trainable = frozen = 0
    for name, param in model.named_parameters():
        if param.dim() != 2 and id(param) not in active_share:
            continue
        if embedding is not None and param is embedding.weight and not tied:
            continue  # a lookup, not a matmul (a tied embedding is also the output projection: counted)
        numel = round(param.numel() * active_share.get(id(param), 1))
        if param.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return trainable, frozen


def flops_per_token(model: nn.Module, *, seq_len: int) -> float:
    """Training FLOPs per token position of ``model`` (unwrapped; any device, meta included).

    A weight that trains costs 6 FLOPs per token (2 forward, 2 for the input gradient, 2 for its own gradient),
    a frozen one 4 (no weight gradient): LoRA's 4N + 6N_adapters. Attention adds 12 x layers x (heads x head_dim)
    x ``seq_len`` (scores and values, forward and backward; the causal half is not discounted, as in PaLM's
    count). Activation recomputation is not counted: MFU is useful work.
    """
    trainable, frozen = _matmul_weights(model)
    attention = 0
    for layer in model.decoder_layers().values() if isinstance(model, DecoderModel) else []:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:  # (a transformers backend layer keeps its head count in its config)
            num_heads = getattr(attn, "num_heads", None) or attn.config.num_attention_heads
            attention += 12 * num_heads * attn.head_dim * seq_len
    return 6.0 * trainable + 4.0 * frozen + attention


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, *, size: int = 8192) -> float | None:
    """The device's dense matmul rate in FLOP/s, measured (about a second); None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    iterations = 20
    start = time.perf_counter()
    for _ in range(iterations):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * size**3 * iterations / (time.perf_counter() - start)
