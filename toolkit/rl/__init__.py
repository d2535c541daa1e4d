"""Online reinforcement learning with verifiable rewards: completions sampled in the training processes, the reward
functions a config names and their set, and the RL recipe's keys.

See :mod:`toolkit.rl.rollout` (sampling the same completions on any layout), :mod:`toolkit.rl.rewards` (what a
reward is, the shipped ones, :class:`RewardSet`), :mod:`toolkit.rl.math_answers` (the math verifier's extraction and
comparison, which never evaluates text), :mod:`toolkit.rl.collect` (a step's rollouts as trained) and
:mod:`toolkit.rl.keys` (the recipe's config keys and checks).
"""

from toolkit.rl.keys import RL_SCHEMA, check_prompts, clip_range, rl_kernels, verifier_index
from toolkit.rl.rewards import (
    ExactMatch,
    FormatReward,
    LengthPenalty,
    MathAnswer,
    RewardFunction,
    RewardSet,
)
from toolkit.rl.rollout import Completion, SamplingSettings, completion_seed, sample_completions

__all__ = [
    "RL_SCHEMA", "Completion", "ExactMatch", "FormatReward", "LengthPenalty", "MathAnswer", "RewardFunction",
    "RewardSet", "SamplingSettings", "check_prompts", "clip_range", "completion_seed", "rl_kernels",
    "sample_completions", "verifier_index",
]
