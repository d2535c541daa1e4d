"""Errors that are the user's to fix.

A :class:`UserError` is printed as one line (no traceback) by the ``tune`` CLI and by recipes, followed by a
non-zero exit. Raise it for bad input: config typos, missing files, malformed rows, sizes that do not divide.
Programming errors stay ordinary exceptions so that their traceback reaches the developer.
"""


class UserError(Exception):
    """A problem with the user's input, reported as a single actionable line."""
