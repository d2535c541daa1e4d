"""A step's rollouts, as the RL recipe trains on them: sampled, scored, grouped into advantages, laid out in
micro-batches; and the held-out score of greedy answers.

Groups never straddle ranks: a prompt's ``G`` completions are sampled, scored and normalized where the prompt is, so
nothing but counts crosses ranks. What does cross them is summed in float64 over the data-parallel group, so every
figure is the global batch's whatever its split.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from toolkit.objectives.rl import RLSettings, RolloutBatch, group_advantages, rollout_batch
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.rl.rewards import RewardSet
from toolkit.rl.rollout import Completion, SamplingSettings, completion_seed, sample_completions
from toolkit.training.metrics import Progress
from toolkit.training.watchdog import progress


@dataclass
class Group:
    """One prompt's completions, scored."""

    row: dict
    completions: list[Completion]
    rewards: list[float]
    per_function: list[list[float]]  # [G][functions]

    @property
    def informative(self) -> bool:
        """Whether its rewards differ (a group of equal rewards has no advantage to learn from)."""
        return max(self.rewards) - min(self.rewards) > 0


def sample_groups(
    model: nn.Module,
    rows: list[dict],
    *,
    rewards: RewardSet,
    tokenizer,
    settings: SamplingSettings,
    num_generations: int,
    seed: int,
    step: int,
    cache_len: int,
) -> tuple[list[Group], int]:
    """``num_generations`` completions of each prompt of ``rows`` (one batch), scored; and the tokens generated.

    The ``j``-th completion of the prompt at dataset index ``i`` draws from :func:`completion_seed` ``(seed, step, i,
    j)``. Rewards see the completion's text without its stop token, the row's fields, and ``completion_tokens``
    (its length in tokens, for length penalties)."""
    prompts = [row["prompt_tokens"] for row in rows for _ in range(num_generations)]
    seeds = [completion_seed(seed, step, row["index"], j) for row in rows for j in range(num_generations)]
    completions = sample_completions(model, prompts, seeds, settings=settings, cache_len=cache_len,
                                     pad_id=tokenizer.pad_id)
    groups = []
    for k, row in enumerate(rows):
        group = completions[k * num_generations : (k + 1) * num_generations]
        totals, parts = [], []
        for completion in group:
            text_tokens = completion.tokens[:-1] if completion.stopped else completion.tokens
            total, per_function = rewards.score(
                row["prompt"], tokenizer.decode(text_tokens),
                {**row["fields"], "completion_tokens": len(completion.tokens)}, row=row["where"])
            totals.append(total)
            parts.append(per_function)
        groups.append(Group(row=row, completions=group, rewards=totals, per_function=parts))
    return groups, sum(len(c.tokens) for c in completions)


def training_batches(
    groups: list[Group],
    *,
    rl: RLSettings,
    micro_batch_size: int,
    num_batches: int,
    pad_id: int,
    overlong_filter: bool = False,
) -> list[RolloutBatch]:
    """This rank's groups as ``num_batches`` micro-batches of ``micro_batch_size`` groups' sequences (every rank the
    same number, so that sharded layouts run the same collectives: a micro-batch with no group is one row with
    nothing to train). With ``overlong_filter`` (DAPO), a truncated completion trains nothing."""
    batches = []
    for b in range(num_batches):
        part = groups[b * micro_batch_size : (b + 1) * micro_batch_size]
        if not part:
            batches.append(rollout_batch([[pad_id]], [[]], [0.0], pad_id=pad_id))
            continue
        rewards = torch.tensor([g.rewards for g in part], dtype=torch.float64)
        advantages = group_advantages(rewards, scale=rl.scale_advantages).flatten().tolist()
        prompts, completions = [], []
        for g in part:
            for c in g.completions:
                prompts.append(g.row["prompt_tokens"])
                completions.append([] if overlong_filter and c.truncated else c.tokens)
        batches.append(rollout_batch(prompts, completions, advantages, pad_id=pad_id))
    return batches


def global_counts(batches: list[RolloutBatch], *, group: dist.ProcessGroup | None, device: torch.device
                  ) -> tuple[int, int]:
    """The completions and completion tokens trained on in the global batch (a collective)."""
    local = torch.tensor([sum(int(b.mask.any(-1).sum()) for b in batches), sum(int(b.mask.sum()) for b in batches)],
                         dtype=torch.float64, device=device)
    sequences, tokens = all_reduce_sum(local, group=group).tolist()
    return int(sequences), int(tokens)


def rollout_metrics(
    groups: list[Group], *, names: list[str], verifier: int | None, generated_tokens: int, generation_s: float,
    group: dist.ProcessGroup | None, device: torch.device,
) -> dict[str, float]:
    """The ``metrics.jsonl`` figures of a step's rollouts, over the global batch: ``reward_mean``, ``reward_std``,
    ``reward_<function>`` (each function's mean), ``accuracy`` (the share of completions the verifier, the first
    exact-match or math reward, scored 1), ``completion_len_mean``, ``completion_len_max``, ``truncated_share``,
    ``equal_reward_groups`` (the share of groups whose rewards are all equal) and ``generation_tokens_per_second``
    (all ranks' tokens over the slowest rank's time)."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [len(c.tokens) for g in groups for c in g.completions]
    per_function = [sum(p[k] for g in groups for p in g.per_function) for k in range(len(names))]
    correct = sum(p[verifier] == 1 for g in groups for p in g.per_function) if verifier is not None else 0
    local = torch.tensor([
        len(rewards), sum(rewards), sum(r * r for r in rewards), sum(lengths),
        sum(not c.stopped for g in groups for c in g.completions), len(groups), sum(not g.informative for g in groups),
        correct, generated_tokens, *per_function,
    ], dtype=torch.float64, device=device)
    summed = all_reduce_sum(local, group=group).tolist()
    longest = torch.tensor([max(lengths, default=0), generation_s], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    n, total, squares, length_sum, truncated, num_groups, equal, correct, tokens = summed[:9]
    mean = total / max(n, 1)
    metrics = {
        "reward_mean": mean,
        "reward_std": math.sqrt(max(squares / max(n, 1) - mean * mean, 0.0)),
        **{f"reward_{name}": value / max(n, 1) for name, value in zip(names, summed[9:])},
        "completion_len_mean": length_sum / max(n, 1),
        "completion_len_max": float(longest[0]),
        "truncated_share": truncated / max(n, 1),
        "equal_reward_groups": equal / max(num_groups, 1),
        "generation_tokens_per_second": tokens / max(float(longest[1]), 1e-9),
    }
    if verifier is not None:
        metrics["accuracy"] = correct / max(n, 1)
    return metrics


@torch.no_grad()
def reward_validation(
    model: nn.Module,
    rows: list[dict],
    *,
    rewards: RewardSet,
    verifier: int | None,
    tokenizer,
    settings: SamplingSettings,
    cache_len: int,
    batch_size: int,
    rank: int,
    num_ranks: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    show_progress: bool,
) -> dict[str, float]:
    """Greedy answers to held-out prompts, scored by the rewards: ``val_reward_mean`` and, with a verifier,
    ``val_accuracy`` (the share it scored 1), over every prompt; each data-parallel rank answers every
    ``num_ranks``-th prompt, in as many batches as every other rank (a sharded model's forwards are collectives)."""
    greedy = SamplingSettings(max_new_tokens=settings.max_new_tokens, temperature=0.0, stop_tokens=settings.stop_tokens)
    mine = rows[rank::num_ranks]
    num_batches = math.ceil(math.ceil(len(rows) / num_ranks) / batch_size)
    totals = torch.zeros(3, dtype=torch.float64)
    with contextlib.closing(Progress(len(rows), label="held-out", unit="answers", enabled=show_progress)) as shown:
        for b in range(num_batches):
            progress("held-out answers")
            part = mine[b * batch_size : (b + 1) * batch_size]
            batch = part or rows[:1]  # (a rank out of prompts still decodes along with the others)
            groups, _ = sample_groups(model, batch, rewards=rewards, tokenizer=tokenizer, settings=greedy,
                                      num_generations=1, seed=0, step=0, cache_len=cache_len)
            for g in groups[: len(part)]:
                totals += torch.tensor([1, g.rewards[0], verifier is not None and g.per_function[0][verifier] == 1],
                                       dtype=torch.float64)
            shown.update(len(part) * num_ranks)
    n, total, correct = all_reduce_sum(totals.to(device), group=group).tolist()
    out = {"val_reward_mean": total / max(n, 1), "val_prompts": int(n)}
    if verifier is not None:
        out["val_accuracy"] = correct / max(n, 1)
    return out



def record_rollouts(path, groups: list[Group], *, step: int, tokenizer, group: dist.ProcessGroup | None,
                    write: bool) -> None:
    """Append the global batch's completions of ``step`` to ``path`` (JSON lines: ``step``, ``prompt_index``,
    ``sample``, ``tokens``, ``completion``, ``reward``), in prompt and sample order, whatever the layout: each
    data-parallel rank's are gathered (a collective) and the process with ``write`` writes them."""
    import json

    mine = [(g.row["index"], j, c.tokens, r) for g in groups for j, (c, r) in enumerate(zip(g.completions, g.rewards))]
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    if not write:
        return
    with open(path, "a") as f:
        for index, sample, tokens, reward in sorted(item for part in everyone for item in part):
            f.write(json.dumps({"step": step, "prompt_index": index, "sample": sample, "tokens": tokens,
                                "completion": tokenizer.decode(tokens), "reward": reward}) + "\n")


def truncate_rollouts(path, *, step: int) -> None:
    """Keep the lines of ``path`` up to ``step`` (a resumed run records the steps after its checkpoint again)."""
    import json
    from pathlib import Path

    path = Path(path)
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))
