"""Online reinforcement learning with verifiable rewards: the reward functions a config names and their set.

See :mod:`toolkit.rl.rewards` (what a reward is, the shipped ones, :class:`RewardSet`) and
:mod:`toolkit.rl.math_answers` (the math verifier's extraction and comparison, which never evaluates text).
"""

from toolkit.rl.rewards import (
    ExactMatch,
    FormatReward,
    LengthPenalty,
    MathAnswer,
    RewardFunction,
    RewardSet,
)

__all__ = ["ExactMatch", "FormatReward", "LengthPenalty", "MathAnswer", "RewardFunction", "RewardSet"]
