"""Rollouts: completions sampled from the policy being trained, in the training processes, on its own layout.

There is no second engine and no weight synchronization: the model that trains is the model that samples, whether
it is replicated (DDP), sharded (ZeRO-3, HSDP: every layer gathered once for the whole rollout, see
:func:`gathered_for_generation`) or split by tensor parallelism.

**The same completions on any layout.** Each completion draws its random numbers from its own generator, seeded by
``(seed, step, prompt index, sample index)`` (:func:`completion_seed`), never by rank or by its place in a batch: the
``t``-th token of a completion is chosen by the ``t``-th uniform draw of its generator, by inverting the cumulative
distribution of the filtered next-token probabilities (:func:`sample_tokens`). Which rank samples a completion, and
beside which others, changes its logits only by float rounding (a different batch shape), which moves a token only
when a draw falls within that rounding of a boundary of the cumulative distribution.

**Batched with a KV cache.** The prompts of a batch are right-padded and processed in one forward; then every row
decodes one token per forward at its own position (``input_pos`` ``[b, 1]``: the cache slots and rotary positions
of each row, :class:`~toolkit.modules.KVCache`), until every row has stopped. The cache spans ``max_seq_len``
positions whatever the batch holds, so every row's attention runs over the same keys on every layout.
"""

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from toolkit.errors import UserError
from toolkit.parallel import unwrap


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled.

    Attributes:
        max_new_tokens: the longest completion, in tokens (its stop token included).
        temperature: 0 samples greedily (the most likely token), else the logits are divided by it.
        top_k: only the ``top_k`` most likely tokens are drawn from (None or 0: all).
        top_p: only the smallest set of most likely tokens whose probability reaches ``top_p`` (None or 1: all).
        stop_tokens: a completion ends with the first of these it samples (kept in it: the policy learns to stop).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        tokens: the sampled token ids, the stop token included when one ended it.
        truncated: it reached ``max_new_tokens`` (or the cache's end) without a stop token.
    """

    tokens: list[int]
    truncated: bool

    @property
    def stopped(self) -> bool:
        return not self.truncated


def completion_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one completion's generator: a hash of the run's seed, the step, the prompt's index in the dataset
    and the sample's index in its group, so nothing about the layout enters it."""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def filtered_probs(
    logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The next-token distribution ``[b, vocab]`` (float32) of ``logits`` ``[b, vocab]``: tempered, restricted to the
    ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p`` (the most likely token
    always kept), and renormalized by the sampler (:func:`sample_tokens`), as ``transformers`` filters."""
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if top_k and top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[b, vocab]``, chosen by inverting its cumulative distribution at the row's
    ``uniforms`` ``[b]`` draw in [0, 1): the first token whose cumulative probability exceeds ``u`` times the row's
    total (a token of probability 0 is never chosen)."""
    cumulative = probs.cumsum(-1)
    target = uniforms.to(cumulative)[:, None] * cumulative[:, -1:]
    return (cumulative <= target).sum(-1).clamp(max=probs.shape[-1] - 1)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Within it, a model sharded by FSDP2 keeps every layer gathered between forwards, so that decoding gathers
    the weights once for the whole rollout rather than once per token; they are sharded again on leaving (the
    memory of the whole unsharded model is what generation needs under ZeRO-3 and HSDP, as for a forward of the root
    that does not reshard). A model that is not sharded is left as it is."""
    modules = _fsdp_modules(model)
    if not modules:
        yield
        return
    # Whether each resharded after its forward (ZeRO-3's layers) or not (ZeRO-2's, the root), to be restored.
    resharded = []
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        resharded.append(group is not None and group.post_forward_mesh_info is not None)
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module, was in zip(modules, resharded):
            module.reshard()
            module.set_reshard_after_forward(was, recurse=False)


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    settings: SamplingSettings,
    cache_len: int,
    pad_id: int = 0,
) -> list[Completion]:
    """Sample one completion for each of ``prompts`` (token ids), the ``i``-th drawing from a generator seeded with
    ``seeds[i]`` (:func:`completion_seed`), all in one batch.

    Every rank of a job calls it with the same number of prompts when the model is sharded or split (FSDP2, tensor
    parallelism): each forward is then a collective, so a rank whose rows have all stopped goes on decoding (its
    results unused) until every rank's have (one small all-reduce per token decides).

    Args:
        model: the policy (a :class:`~toolkit.modules.TransformerDecoder`, possibly wrapped or sharded).
        prompts: each row's prompt; with the completion it must fit in ``cache_len`` (checked by the caller).
        seeds: each row's generator seed.
        settings: the sampling settings.
        cache_len: the KV cache's length in positions: the longest prompt plus completion the run allows (a fixed
            length keeps each row's attention the same on every layout).
        pad_id: what fills the prompts' padding (never attended to).
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts and {len(seeds)} seeds")
    decoder = unwrap(model)
    device = decoder.token_embedding().weight.device
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise ValueError("every rollout needs a non-empty prompt")
    if max(lengths) + 1 > cache_len:
        raise UserError(f"a prompt of {max(lengths)} tokens leaves no room for a completion within max_seq_len "
                        f"({cache_len})")
    collective = dist.is_initialized() and dist.get_world_size() > 1 and _is_sharded(decoder)
    b = len(prompts)
    # Each row's draws, one per position it may sample, made up front from its own generator.
    uniforms = torch.stack([
        torch.rand(settings.max_new_tokens, generator=torch.Generator().manual_seed(seed))
        for seed in seeds
    ]).to(device)
    stop = torch.tensor(sorted(set(settings.stop_tokens)), dtype=torch.long, device=device)
    tokens = torch.full((b, max(lengths)), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    length = torch.tensor(lengths, device=device)
    # A row may sample until its completion is max_new_tokens long or the cache is full.
    budget = torch.clamp(cache_len - length, max=settings.max_new_tokens)
    out = torch.zeros((b, settings.max_new_tokens), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stopped = torch.zeros(b, dtype=torch.bool, device=device)
    generated = torch.zeros(b, dtype=torch.long, device=device)
    was_training = decoder.training
    decoder.eval()
    decoder.setup_caches(batch_size=b, max_seq_len=cache_len)
    try:
        # The decoder itself runs (a DDP wrapper's forward would synchronize buffers, a collective per token).
        with gathered_for_generation(decoder):
            # The prompts in one forward (right-padded: a row's real positions attend only to real ones).
            logits = decoder(tokens, input_pos=torch.arange(tokens.shape[1], device=device))
            logits = logits[torch.arange(b, device=device), length - 1]  # [b, vocab]: after each row's prompt
            for t in range(settings.max_new_tokens):
                if settings.temperature > 0:
                    probs = filtered_probs(logits, temperature=settings.temperature, top_k=settings.top_k,
                                           top_p=settings.top_p)
                    token = sample_tokens(probs, uniforms[:, t])
                else:
                    token = logits.argmax(-1)
                live = ~done
                out[:, t] = torch.where(live, token, pad_id)
                generated += live.long()
                hit_stop = live & torch.isin(token, stop)
                stopped |= hit_stop
                done |= hit_stop | (generated >= budget)
                remaining = ~done
                if collective:
                    remaining_anywhere = remaining.any().long().reshape(1)
                    dist.all_reduce(remaining_anywhere, op=dist.ReduceOp.MAX)
                    if not remaining_anywhere.item():
                        break
                elif not remaining.any():
                    break
                # The next forward: each row's newest token at its own position (a stopped row repeats a harmless
                # write into its last slot).
                pos = torch.clamp(length + generated - 1, max=cache_len - 1)[:, None]
                logits = decoder(torch.where(live, token, pad_id)[:, None], input_pos=pos)[:, -1]
    finally:
        decoder.clear_caches()
        decoder.train(was_training)
    counts, out, stopped = generated.tolist(), out.tolist(), stopped.tolist()
    return [Completion(tokens=out[row][: counts[row]], truncated=not stopped[row]) for row in range(b)]
