"""The config error type and the did-you-mean hint shared by config and CLI messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from toolkit.errors import UserError


class ConfigError(UserError):
    """A config file, override or ``_component_`` node the user has to fix."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Suggest the closest candidate to a mistyped word.

    Args:
        word: What the user wrote.
        candidates: The names that would have been valid.

    Returns:
        ``"; did you mean 'x'?"`` for a close match, else ``""``, so it can be appended to any message.
    """
    match = closest(word, candidates)
    return f"; did you mean '{match}'?" if match else ""


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate a mistyped ``word`` most likely stands for, or None when none is close."""
    matches = difflib.get_close_matches(word, [str(c) for c in candidates], n=1, cutoff=0.6)
    return matches[0] if matches else None


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (OmegaConf and YAML append context on later lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
