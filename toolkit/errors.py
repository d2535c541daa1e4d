"""Errors that are the user's to fix.

A :class:`UserError` is printed as one line (no traceback) by the ``tune`` CLI and by recipes, followed by a
non-zero exit. Raise it for bad input: config typos, missing files, malformed rows, sizes that do not divide.
Programming errors stay ordinary exceptions so that their traceback reaches the developer.
"""

import json
import sys
from pathlib import Path
from typing import Any

# What starts every line of a user error, from `tune` and from a recipe run directly or under torchrun alike, so a
# user (or a script reading stderr) looks for one prefix.
ERROR_PREFIX = "tune: error: "


class UserError(Exception):
    """A problem with the user's input, reported as a single actionable line."""


class ArgumentError(UserError):
    """A problem with one argument of an object a config node builds (a checkpointer's ``checkpoint_dir``).

    The object knows its argument, not the key the user wrote it under: ``toolkit.config.instantiate`` puts the
    node's key path in front (``teacher_checkpointer.checkpoint_dir: ...``), so the line names the key to fix
    whichever node it was.
    """

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(f"{argument}: {problem}")
        self.argument, self.problem = argument, problem


class NothingToDo(Exception):
    """The command has nothing to do (a run resumed after its last step): its one-line message is printed and it
    exits with 0, having changed nothing."""


def print_error(message: str) -> None:
    """Print ``message`` to stderr, each of its lines behind :data:`ERROR_PREFIX` (the one place that writes it)."""
    for line in message.splitlines() or [""]:
        print(f"{ERROR_PREFIX}{line}", file=sys.stderr)


def read_json(path: Path) -> Any:
    """The contents of the JSON file ``path``, which the user supplied (a config, an adapter's settings...).

    Raises:
        UserError: the file is not valid JSON; the message names it and where the parse failed.
    """
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
