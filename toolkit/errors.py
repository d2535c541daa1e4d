"""Errors that are the user's to fix.

A :class:`UserError` is printed as one line (no traceback) by the ``tune`` CLI and by recipes, followed by a
non-zero exit. Raise it for bad input: config typos, missing files, malformed rows, sizes that do not divide.
Programming errors stay ordinary exceptions so that their traceback reaches the developer.
"""

import json
from pathlib import Path
from typing import Any


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


def read_json(path: Path) -> Any:
    """The contents of the JSON file ``path``, which the user supplied (a config, an adapter's settings...).

    Raises:
        UserError: the file is not valid JSON; the message names it and where the parse failed.
    """
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
