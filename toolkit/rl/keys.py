"""The RL recipe's config keys (on top of the shared training vocabulary), the rules between them, and the checks of
its prompts before anything is written."""

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from toolkit.config._schema import Bool, Choice, Component, Context, Float, Int, ListOf, rule
from toolkit.errors import UserError
from toolkit.objectives.rl import RL_LOSSES
from toolkit.planning import StepKernels
from toolkit.rl.rewards import RewardSet
from toolkit.training.recipe_keys import TRAINING_SCHEMA

# Objective-specific keys, refused with another objective rather than silently unused.
_ONLY = {
    "kl_coef": ("grpo",),  # DAPO, Dr. GRPO and GSPO drop the KL term (their papers)
    "dynamic_sampling": ("dapo",),
    "max_refills": ("dapo",),
    "overlong_filter": ("dapo",),
}
# Each objective's clip range when the config gives none: GRPO's and Dr. GRPO's 0.2, DAPO's clip-higher (0.2, 0.28),
# GSPO's sequence-level range (3e-4, 4e-4).
CLIP_DEFAULTS = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


@rule("loss", *_ONLY)
def objective_keys_fit_the_loss(ctx: Context) -> Iterator[tuple[str, str]]:
    loss = ctx.get("loss")
    for key, losses in _ONLY.items():
        value = ctx.get(key)
        if value not in (None, False, 0, 0.0) and loss not in losses:
            yield key, f"only {' and '.join(losses)} reads it, and loss is {loss}; remove it"


@rule("temperature", "num_generations")
def sampling_varies(ctx: Context) -> Iterator[tuple[str, str]]:
    temperature, g = ctx.get("temperature"), ctx.get("num_generations")
    if isinstance(temperature, (int, float)) and temperature <= 0 and isinstance(g, int) and g > 1:
        yield "temperature", (f"{temperature} samples greedily: all {g} completions of a prompt would be the same and "
                              "teach nothing; use a temperature above 0 (1.0 samples the policy as it is)")


@rule("max_new_tokens", "max_seq_len")
def completions_fit(ctx: Context) -> Iterator[tuple[str, str]]:
    new, total = ctx.get("max_new_tokens"), ctx.get("max_seq_len")
    if isinstance(new, int) and isinstance(total, int) and new >= total:
        yield "max_new_tokens", f"{new} leaves no room for a prompt within max_seq_len ({total})"


@rule("sft_warmup_steps", "sft_warmup_dataset", "sft_warmup_lr", "sft_warmup_batch_size")
def warmup_is_whole(ctx: Context) -> Iterator[tuple[str, str]]:
    if ctx.get("sft_warmup_steps"):
        for key in ("sft_warmup_dataset", "sft_warmup_lr", "sft_warmup_batch_size"):
            if ctx.get(key) is None:
                yield key, "sft_warmup_steps needs it"


@rule("rewards")
def rewards_build(ctx: Context) -> Iterator[tuple[str, str]]:
    """Every reward imports, takes its options and scores ``(prompt, completion, **fields)`` (built here, before
    any process starts, as the recipe builds them)."""
    nodes = ctx.get("rewards")
    if not isinstance(nodes, Sequence) or isinstance(nodes, str) or not all(isinstance(n, Mapping) for n in nodes):
        return
    plain = [{str(k): v for k, v in node.items()} for node in nodes]  # (messages then name no file: the check does)
    try:
        RewardSet.from_config(plain, key="rewards")
    except UserError as e:
        key, _, problem = str(e).partition(": ")
        yield key, problem


@rule("routing_replay", "updates_per_rollout")
def replay_needs_updates(ctx: Context) -> Iterator[tuple[str, str]]:
    if ctx.get("routing_replay") and ctx.get("updates_per_rollout") == 1:
        yield "routing_replay", ("replays the experts of the old log-probabilities' pass, which only runs with "
                                 "updates_per_rollout above 1 (with 1, the update's own forward is that pass)")


RL_KEYS = {
    "loss": Choice(*RL_LOSSES),
    "num_generations": Int(ge=2),  # G: completions per prompt (a group)
    "max_new_tokens": Int(ge=1),
    "temperature": Float(ge=0),
    "top_k": Int(ge=0, null=True, required=False),
    "top_p": Float(gt=0, le=1, null=True, required=False),
    "stop_tokens": ListOf(item=Int(ge=0), null=True, required=False),  # default: the tokenizer's
    "rewards": ListOf(item=Component()),
    "clip_low": Float(ge=0, lt=1, null=True, required=False),  # null: the objective's own (CLIP_DEFAULTS)
    "clip_high": Float(ge=0, null=True, required=False),
    "kl_coef": Float(ge=0, null=True, required=False),
    "updates_per_rollout": Int(ge=1),
    "dynamic_sampling": Bool(required=False),
    "max_refills": Int(ge=0, required=False),
    "overlong_filter": Bool(required=False),
    "sft_warmup_steps": Int(ge=0, null=True, required=False),
    "sft_warmup_dataset": Component(null=True, required=False),
    "sft_warmup_lr": Float(gt=0, null=True, required=False),
    "sft_warmup_batch_size": Int(ge=1, null=True, required=False),
    "save_merged": Bool(required=False),
    "save_rollouts": Bool(required=False),  # every completion of every step in output_dir/rollouts.jsonl
    "routing_replay": Bool(required=False),  # MoE: updates reuse the experts chosen for the old log-probabilities
}

RL_SCHEMA = TRAINING_SCHEMA.without(
    "fused_loss", "optimizer_in_backward", "activation_offloading", "float8", "profiler", "context_parallel",
    "context_parallel_method", "expert_parallel", "flex_attention",
).extend(RL_KEYS, rules=[objective_keys_fit_the_loss, sampling_varies, completions_fit, warmup_is_whole, rewards_build,
                                  replay_needs_updates])


def rl_kernels(kernels: StepKernels, *, num_generations: int, reference: bool) -> StepKernels:
    """What the memory plan counts for an RL step: each prompt of a micro-batch is ``num_generations`` sequences,
    trained and, before the step, sampled together with a KV cache, and a full fine-tune with a KL term holds a
    frozen copy of the model."""
    return dataclasses.replace(kernels, sequences_per_sample=num_generations, reference_model=reference,
                               fused_loss=False, rollout_samples=num_generations)


def check_prompts(dataset, *, key: str, max_prompt_tokens: int) -> None:
    """A prompt dataset (rows with ``prompt_tokens``), none longer than the context left for generation, or one line
    naming the key and the row."""
    if len(dataset) == 0 or "prompt_tokens" not in dataset[0]:
        found = "is empty" if len(dataset) == 0 else "yields no prompts"
        raise UserError(f"{key}: the dataset {found}; give a prompt dataset such as toolkit.data.prompt_dataset")
    for i in range(len(dataset)):
        row = dataset[i]
        if len(row["prompt_tokens"]) > max_prompt_tokens:
            raise UserError(f"{key}: {row['where']}: the prompt is {len(row['prompt_tokens'])} tokens, longer than the "
                            f"{max_prompt_tokens} max_seq_len - max_new_tokens leaves for it")


def verifier_index(rewards) -> int | None:
    """The first reward that judges right or wrong (``verifier = True``: exact match, the math verifier), whose share
    of 1s is the run's accuracy; None without one."""
    return next((i for i, fn in enumerate(rewards.functions) if getattr(fn, "verifier", False)), None)


def clip_range(loss: str, clip_low: float | None, clip_high: float | None) -> tuple[float, float]:
    """The ratio's clip range ``(clip_low, clip_high)``: the config's, else the objective's own; a ``clip_low`` given
    alone is symmetric."""
    low, high = CLIP_DEFAULTS[loss]
    low = clip_low if clip_low is not None else low
    return low, clip_high if clip_high is not None else (high if clip_low is None else low)

