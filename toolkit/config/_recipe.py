"""The entry-point decorator recipes put on ``main(cfg)``."""

from __future__ import annotations

import errno
import functools
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf import DictConfig

from toolkit.config._parse import parse_recipe_args
from toolkit.config._schema import Schema
from toolkit.errors import NothingToDo, UserError, print_error
from toolkit.quiet import quiet_third_party_noise

T = TypeVar("T")

# `tune run ..._distributed` sets this for its workers: it then prints the one error line itself, from the
# error file of the rank that failed, so an error hit by rank 1 alone is still shown, and shown once.
LAUNCHER_REPORTS_ERRORS_ENV = "TUNE_LAUNCHER_REPORTS_ERRORS"
# Key in torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE) that marks a user error and holds its text.
USER_ERROR_KEY = "tunekit_user_error"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _record_for_launcher(message: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The layout torchrun's ProcessFailure reads, plus our key, so both `tune run` and plain torchrun show it.
    data = {
        "message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}},
        USER_ERROR_KEY: message,
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the message is still printed by rank 0 when no launcher reads the file


def report_user_error(error: UserError) -> None:
    """Print ``tune: error: <message>`` to stderr on rank 0 (every line prefixed), and leave it for the launcher."""
    message = str(error)
    _record_for_launcher(message)
    if _rank() != 0 or os.environ.get(LAUNCHER_REPORTS_ERRORS_ENV) == "1":
        return
    sys.stdout.flush()
    print_error(message)
    sys.stderr.flush()


# Errors of the storage a run writes to, reported as one line rather than a traceback.
_STORAGE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def _world_size() -> int:
    # The processes torchrun started (the schema's rules divide them among the mesh dimensions).
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def recipe_main(fn: Callable[[DictConfig], T] | None = None, *, schema: Schema | None = None) -> Any:
    """Decorate a recipe's ``main(cfg)`` so that ``main()`` runs it from the command line.

    ``@recipe_main(schema=SCHEMA)`` checks the config against the recipe's declared schema first (``tune run``
    has checked it before launching; the recipe checks again, for ``python recipe.py`` and ``torchrun``), so a bad
    value stops before anything is built or written. ``@recipe_main`` alone checks nothing beyond the overrides.

    Called without arguments, the wrapper builds the config with
    ``parse_recipe_args(sys.argv[1:])`` and calls ``fn(cfg)``. A :class:`~toolkit.errors.UserError` (such as
    a :class:`ConfigError`) is printed as one ``tune: error: ...`` line by rank 0 (``RANK``, default 0) and exits
    with code 2; a :class:`~toolkit.errors.NothingToDo` is printed by rank 0 and exits with 0; Ctrl-C exits with
    130 quietly; any other exception keeps its traceback. Called with a
    config, the wrapper checks it against the schema (its top-level keys are not checked: a config built in code
    may carry more) and calls ``fn(cfg)`` (for tests and notebooks).
    """
    if fn is None:
        return functools.partial(recipe_main, schema=schema)

    @functools.wraps(fn)
    def wrapper(cfg: DictConfig | None = None) -> Any:
        if cfg is not None:
            if schema is not None:
                schema.check(cfg, world_size=_world_size(), unknown_keys=False)
            return fn(cfg)
        quiet_third_party_noise()
        try:
            # torchrun's `record` writes any other exception's traceback to the rank's error file, so the
            # launcher names the rank that failed and its exception. Imported inside the try: a Ctrl-C that lands
            # during this (slow) import must exit quietly too.
            from torch.distributed.elastic.multiprocessing.errors import record

            cfg = parse_recipe_args(
                sys.argv[1:], recipe_file=inspect.getsourcefile(fn), schema=schema,
                world_size=_world_size(),
            )
            try:
                result = record(fn)(cfg)
            except NothingToDo as e:
                if _rank() == 0:
                    print(e, flush=True)
                result = None
            if "TORCHELASTIC_RUN_ID" in os.environ:
                # A torchrun worker that finished: leave without running interpreter teardown, where torch 2.13's
                # gloo process-group destructor can deadlock or abort ("terminate called without an active
                # exception") after all work is done. The recipe has closed its files; flush what is buffered.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            return result
        except UserError as e:
            report_user_error(e)
            sys.exit(2)
        except OSError as e:
            if e.errno not in _STORAGE_ERRORS:
                raise
            # A full disk or a folder that cannot be written is the machine's state, not a bug: one line naming the
            # file (the recipe's checkpoints already say this themselves, and keep the previous one usable).
            where = f"{e.filename}: " if e.filename else ""
            report_user_error(UserError(f"{where}cannot write ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})"))
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception:
            if "TORCHELASTIC_RUN_ID" not in os.environ:
                raise
            # A torchrun worker that crashed: `record` has written the error file; print the traceback and leave
            # at once. Teardown can take seconds (or hang in gloo's destructor), and meanwhile the other ranks
            # see the closed connections and fail too: exiting first keeps this rank the first failure the
            # launcher sees, so it names the cause rather than a rank that only lost its peer.
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    wrapper.schema = schema  # type: ignore[attr-defined]  (what `tune run` checks before launching)
    return wrapper
