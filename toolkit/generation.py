"""Text generation with a KV cache: greedy, temperature, top-k and top-p sampling."""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.errors import UserError
from toolkit.modules import LongRopeRotaryEmbeddings, TransformerDecoder
from toolkit.parallel import unwrap
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.training.metrics import Progress
from toolkit.training.watchdog import progress


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token from ``logits`` (``[vocab]``): argmax when ``temperature`` is 0, else sample from the
    tempered distribution restricted to the ``top_k`` most likely tokens and/or the smallest set whose
    probability reaches ``top_p`` (Holtzman et al., 2019). As in ``transformers``, ``top_k=0`` filters nothing
    and the most likely token always survives ``top_p`` (``top_p=0`` is greedy).

    Raises:
        UserError: a negative ``top_k``, or a ``top_p`` outside ``[0, 1]``.
    """
    if top_k is not None and top_k < 0:
        raise UserError(f"top_k: expected a count of tokens (0 or none: no top-k filter), got {top_k}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise UserError(f"top_p: expected a probability between 0 and 1, got {top_p}")
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is below top_p, and the most likely one whatever top_p.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: TransformerDecoder,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_tokens: list[int] | tuple[int, ...] = (),
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_when: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (fewer if the model's ``max_seq_len`` is reached),
    stopping before any of ``stop_tokens``, or after the token for which ``stop_when(generated)`` is true (a
    stop string that only shows once the tokens are decoded, for example).

    The prompt is processed in one forward pass, then one token per step against the KV cache. A model with
    LongRoPE (:class:`~toolkit.modules.LongRopeRotaryEmbeddings`) whose sequence grows past its original context
    processes the whole sequence again once, at the first position past it, so that every cached key is rotated
    with the long factors, as ``transformers`` does.

    Returns:
        The generated token ids (without the prompt and without the stop token).
    """
    device = model.token_embedding().weight.device
    if not prompt:
        raise UserError("prompt: empty; generation continues a prompt of at least one token (e.g. the BOS token)")
    if len(prompt) >= model.max_seq_len:
        raise UserError(f"prompt: {len(prompt)} tokens leave no room within the model's max_seq_len ({model.max_seq_len})")
    # Generation stops at the model's context length rather than failing.
    total_len = min(len(prompt) + max_new_tokens, model.max_seq_len)
    was_training = model.training
    model.eval()
    model.setup_caches(batch_size=1, max_seq_len=total_len)
    rope = next(iter(model.decoder_layers().values())).self_attn.pos_embeddings
    switch = rope.scaling.original_max_position_embeddings if isinstance(rope, LongRopeRotaryEmbeddings) else None
    generated: list[int] = []
    try:
        tokens = torch.tensor([prompt], device=device)
        logits = model(tokens, input_pos=torch.arange(len(prompt), device=device))[0, -1]
        for pos in range(len(prompt), total_len):
            token = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if token in stop_tokens:
                break
            generated.append(token)
            if pos + 1 == total_len or (stop_when is not None and stop_when(generated)):
                break
            if pos == switch:  # the keys cached so far were rotated with the short factors
                tokens = torch.tensor([prompt + generated], device=device)
                logits = model(tokens, input_pos=torch.arange(pos + 1, device=device))[0, -1]
            else:
                tokens = torch.tensor([[token]], device=device)
                logits = model(tokens, input_pos=torch.tensor([pos], device=device))[0, -1]
    finally:
        model.clear_caches()
        model.train(was_training)
    return generated


def exact_match_accuracy(
    model: nn.Module,
    tokenizer,
    samples: list[dict],
    *,
    max_new_tokens: int = 32,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[int, int]:
    """Greedy-decode each sample's ``prompt`` and compare with its ``answer``, split over ranks.

    Args:
        model: a plain (unwrapped) decoder, or one sharded in place by FSDP2.
        tokenizer: gives ``prompt_tokens(messages)``, ``stop_tokens`` and ``decode``.
        samples: dicts with ``prompt`` and ``answer``.
        max_new_tokens: generation budget per sample.
        rank, world_size: each rank evaluates every ``world_size``-th sample; counts are summed over ranks.

    Returns:
        ``(correct, total)`` over all samples.
    """
    # A sharded model all-gathers each layer's weights in every forward, a collective: all ranks must run the
    # same forwards, so each evaluates every sample (the same weights and prompts give the same generations)
    # instead of splitting the samples and stopping after different numbers of tokens.
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    correct = 0
    # Rank zero shows the progress of all ranks, which split the samples evenly and so keep about its pace (the global
    # rank: under tensor parallelism several processes have data-parallel rank 0).
    rank_zero = not dist.is_initialized() or dist.get_rank() == 0
    with contextlib.closing(Progress(len(samples), label="eval", unit="answers", enabled=rank_zero)) as shown:
        for sample in samples if sharded else samples[rank::world_size]:
            progress("evaluation")
            prompt = tokenizer.prompt_tokens([{"role": "user", "content": sample["prompt"]}])
            out = generate(model, prompt, max_new_tokens=max_new_tokens, stop_tokens=tokenizer.stop_tokens)
            correct += int(tokenizer.decode(out).strip() == sample["answer"].strip())
            shown.update(1 if sharded else world_size)
    if not sharded:
        device = model.token_embedding().weight.device
        correct = int(all_reduce_sum(torch.tensor([correct], dtype=torch.int64, device=device)).item())
    return correct, len(samples)


def report_exact_match(
    model: nn.Module,
    tokenizer,
    samples: list[dict],
    *,
    max_new_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    when: str,
    log: Callable[[str], None] = print,
) -> float:
    """:func:`exact_match_accuracy` of a (possibly DDP-wrapped) training model, reported as the training recipes
    report it: ``held-out accuracy <when> training: 41.0% (82/200)`` (a collective: every rank calls it)."""
    correct, total = exact_match_accuracy(unwrap(model), tokenizer, samples, max_new_tokens=max_new_tokens, rank=rank,
                                          world_size=world_size)
    log(f"held-out accuracy {when} training: {correct / total:.1%} ({correct}/{total})")
    return correct / total
