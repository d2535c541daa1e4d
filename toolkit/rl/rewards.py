"""Reward functions for online RL, and the weighted set of them a config names.

A reward scores one completion: ``fn(prompt: str, completion: str, **fields) -> float``, where ``fields`` are the
prompt's dataset row's other columns (an ``answer``, say) and, from the RL recipe, ``completion_tokens`` (the
completion's length in tokens). A config lists them under ``rewards:``, each a ``_component_`` node with an optional
``weight`` (default 1.0) and the function's own options::

    rewards:
      - _component_: toolkit.rl.MathAnswer
      - _component_: toolkit.rl.FormatReward
        pattern: '(?s)<think>.*</think>.*'
        weight: 0.2

The shipped rewards are classes (the node's keys are their constructor's options); a plain function is taken as it
is, with any other keys of its node bound to it. :class:`RewardSet` builds the list, checks each function's signature
before anything runs, and checks every score: a reward that raises or returns something other than a finite number
stops the run with one line naming the reward and the row.

No reward here executes generated code: completions are read as text (regular expressions, and the math verifier's
own parser in :mod:`toolkit.rl.math_answers`, which calls neither ``eval`` nor sympy's string parsers).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from toolkit.config import config_source, instantiate
from toolkit.config._instantiate import COMPONENT_KEY, TargetNotFound, locate, signature
from toolkit.errors import ArgumentError, UserError
from toolkit.rl.math_answers import equivalent, final_answer, reference_answer

RewardFunction = Callable[..., Any]
# The arguments every reward takes first, by position; the row's fields follow by keyword.
_POSITIONAL = ("prompt", "completion")
WEIGHT_KEY = "weight"


def _reference(fields: Mapping[str, Any], field: str) -> str:
    """The row's reference answer ``fields[field]`` as text (a number in a JSON row is read as written)."""
    if field not in fields:
        raise UserError(f"the row has no field {field!r} (its fields: {', '.join(map(str, fields)) or 'none'})")
    value = fields[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = "null" if value is None else type(value).__name__
        raise UserError(f"field {field!r} must be a string or a number, got {kind} {value!r:.40}")
    return value if isinstance(value, str) else str(value)


def _check_field_name(field: str) -> None:
    if not isinstance(field, str) or not field:
        raise ArgumentError("field", f"must name a column of the prompts, got {field!r}")


class ExactMatch:
    """1.0 when the completion is the row's ``field`` exactly, else 0.0.

    Args:
        field: the column holding the expected answer.
        strip: compare without leading and trailing whitespace (on both sides).
        case_sensitive: False compares case-folded text (``"Yes"`` matches ``"yes"``).
    """

    verifier = True  # judges right or wrong: the run's accuracy is the share of completions it scores 1

    def __init__(self, field: str = "answer", strip: bool = True, case_sensitive: bool = True) -> None:
        _check_field_name(field)
        self.field, self.strip, self.case_sensitive = field, strip, case_sensitive

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        expected = _reference(fields, self.field)
        if self.strip:
            completion, expected = completion.strip(), expected.strip()
        if not self.case_sensitive:
            completion, expected = completion.casefold(), expected.casefold()
        return float(completion == expected)


class MathAnswer:
    """1.0 when the completion's final answer equals the row's reference answer, else 0.0.

    The final answer is the completion's last ``\\boxed{...}``, else what follows its last "answer is" or "#### ",
    else its last number (see :func:`~toolkit.rl.math_answers.final_answer`); a reference that is a worked solution
    (with its own box or "#### ") is read the same way. Two answers are equal as written (after normalization), as
    exact numbers (``0.5``, ``1/2``, ``\\frac{1}{2}``; ``1,000``; ``50%``; ``1.5e3``), element by element (tuples),
    or as expressions when sympy is installed (``2\\sqrt{2}`` = ``\\sqrt{8}``). No text is evaluated as code.

    Args:
        field: the column holding the reference answer.
        rel_tol: numbers within this relative distance count as equal; 0 (the default) asks for exact equality.
    """

    verifier = True  # judges right or wrong: the run's accuracy is the share of completions it scores 1

    def __init__(self, field: str = "answer", rel_tol: float = 0.0) -> None:
        _check_field_name(field)
        if isinstance(rel_tol, bool) or not isinstance(rel_tol, (int, float)) or not 0 <= rel_tol < 1:
            raise ArgumentError("rel_tol", f"must be a number in [0, 1), got {rel_tol!r}")
        self.field, self.rel_tol = field, float(rel_tol)

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        reference = reference_answer(_reference(fields, self.field))
        answer = final_answer(completion)
        return float(answer is not None and equivalent(answer, reference, rel_tol=self.rel_tol))


class FormatReward:
    """``weight_on_match`` when the completion matches a regular expression, else 0.0.

    Args:
        pattern: a Python regular expression (inline flags such as ``(?s)``, which lets ``.`` match newlines, work).
        mode: ``fullmatch`` (the whole completion must match) or ``search`` (anywhere in it).
        weight_on_match: the score of a match.
    """

    def __init__(
        self, pattern: str, mode: Literal["fullmatch", "search"] = "fullmatch", weight_on_match: float = 1.0
    ) -> None:
        if not isinstance(pattern, str):
            raise ArgumentError("pattern", f"must be a regular expression (a string), got {pattern!r}")
        try:
            self.regex = re.compile(pattern)
        except re.error as e:
            raise ArgumentError("pattern", f"{pattern!r} is not a valid regular expression: {e}") from None
        if mode not in ("fullmatch", "search"):
            raise ArgumentError("mode", f"must be 'fullmatch' or 'search', got {mode!r}")
        if not _is_finite_number(weight_on_match):
            raise ArgumentError("weight_on_match", f"must be a finite number, got {weight_on_match!r}")
        self.pattern, self.mode, self.weight_on_match = pattern, mode, float(weight_on_match)

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        match = self.regex.fullmatch(completion) if self.mode == "fullmatch" else self.regex.search(completion)
        return self.weight_on_match if match else 0.0


class LengthPenalty:
    """DAPO's overlong reward shaping (Yu et al. 2025, eq. 13): 0 up to ``max_length - cache_length``, then falling
    linearly to -1 at ``max_length``, and -1 beyond::

        R(y) = 0                                      if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max
             = -1                                     if |y| > L_max

    Args:
        max_length: L_max.
        cache_length: L_cache, the width of the ramp (at most ``max_length``).
        unit: ``tokens`` measures |y| by the row's ``completion_tokens`` field, which the RL recipe passes; ``chars``
            by the completion's characters.
    """

    def __init__(self, max_length: int, cache_length: int, unit: Literal["tokens", "chars"] = "tokens") -> None:
        if not _is_int(max_length) or max_length < 1:
            raise ArgumentError("max_length", f"must be a positive integer, got {max_length!r}")
        if not _is_int(cache_length) or not 1 <= cache_length <= max_length:
            raise ArgumentError(
                "cache_length", f"must be an integer from 1 to max_length ({max_length}), got {cache_length!r}"
            )
        if unit not in ("tokens", "chars"):
            raise ArgumentError("unit", f"must be 'tokens' or 'chars', got {unit!r}")
        self.max_length, self.cache_length, self.unit = max_length, cache_length, unit

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        if self.unit == "chars":
            length = len(completion)
        else:
            length = fields.get("completion_tokens")
            if not _is_int(length) or length < 0:
                given = "is missing" if "completion_tokens" not in fields else f"is {length!r}"
                raise UserError(
                    f"needs the completion's token count, an integer field 'completion_tokens', which {given} (the "
                    "RL recipe passes it; set unit: chars to measure characters)"
                )
        soft = self.max_length - self.cache_length
        if length <= soft:
            return 0.0
        if length <= self.max_length:
            return (soft - length) / self.cache_length
        return -1.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _short_name(function: RewardFunction) -> str:
    """``math_answer`` for a :class:`MathAnswer`, a function's own name, a partial's function's name."""
    while isinstance(function, functools.partial):
        function = function.func
    if inspect.isfunction(function) or inspect.ismethod(function) or inspect.isbuiltin(function):
        return function.__name__
    name = type(function).__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _unique(names: list[str]) -> list[str]:
    """The names, the second and later of each repeated one suffixed ``_2``, ``_3``..."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


def _signature_problem(function: RewardFunction) -> tuple[str | None, frozenset[str] | None]:
    """Why ``function`` cannot be called as ``function(prompt, completion, **fields)`` (None if it can), and the
    field names it takes by keyword (None: any, it has ``**kwargs``)."""
    if not callable(function):
        return f"is not callable (a {type(function).__name__})", None
    sig = signature(function)
    if sig is None:
        return None, None  # a builtin without a signature: trusted, and checked by the call itself
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in params)
    named = [p.name for p in positional[:2]]
    if not takes_args and named != list(_POSITIONAL):
        return f"takes {sig}; a reward takes (prompt, completion, **fields)", None
    rest = [p for p in params if p not in positional[:2] and p.kind is not p.VAR_POSITIONAL]
    if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in rest):
        return f"takes {sig}: a third positional-only argument, which no row can give by name", None
    if any(p.kind is p.VAR_KEYWORD for p in rest):
        return None, None
    return None, frozenset(p.name for p in rest if p.kind is not p.POSITIONAL_ONLY)


def _as_score(value: Any) -> float | str:
    """``value`` as a float, or why it is not a finite real number (bool, numpy scalars, 0-d tensors are)."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # a numpy scalar or 0-d array, a 0-d torch tensor
    if not isinstance(value, numbers.Real):
        return f"returned {value!r:.60}, not a number"
    if not math.isfinite(value):
        return f"returned {value!r}, not a finite number"
    return float(value)


class RewardSet:
    """Reward functions with their weights: :meth:`score` gives a completion's weighted total and each one's score.

    Args:
        functions: callables ``fn(prompt, completion, **fields)``.
        weights: one per function (default 1.0 each), finite numbers; 0 keeps a reward for its metric only.
        key: the config key the list came from, for messages (``rewards[1]``).

    Raises:
        UserError: a function whose signature does not fit, or a weight that is not a finite number.
    """

    def __init__(
        self, functions: Sequence[RewardFunction], weights: Sequence[float] | None = None, *, key: str = "rewards"
    ) -> None:
        functions = list(functions)
        if not functions:
            raise UserError(f"{key}: no reward function; list at least one (e.g. - _component_: toolkit.rl.ExactMatch)")
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise UserError(f"{key}: {len(functions)} reward functions but {len(weights)} weights")
        self.key = key
        self.functions = functions
        self._accepts = []
        for i, (function, weight) in enumerate(zip(functions, weights)):
            problem, accepts = _signature_problem(function)
            if problem is not None:
                raise UserError(f"{key}[{i}]: {_short_name(function)} {problem}")
            if not _is_finite_number(weight):
                raise UserError(f"{key}[{i}].{WEIGHT_KEY}: must be a finite number, got {weight!r}")
            self._accepts.append(accepts)
        self.weights = [float(w) for w in weights]
        self.names = _unique([_short_name(f) for f in functions])

    def __len__(self) -> int:
        return len(self.functions)

    @classmethod
    def from_config(cls, nodes: Any, *, key: str = "rewards") -> RewardSet:
        """Build the set from a config's list of ``_component_`` nodes, each with an optional ``weight``.

        A class is instantiated with the node's other keys (:func:`toolkit.config.instantiate`); a function is taken
        as it is, or with the node's other keys bound to it (``functools.partial``).

        Raises:
            UserError: one line naming the config file and key (``rewards[1]._component_: ...``): a list that is
                empty or not a list, an item without ``_component_``, a target that does not import or whose
                signature does not fit, an option it does not take, a bad weight.
        """
        source = config_source(nodes)
        where = "" if source == "<config>" else f"{source}: "
        if not isinstance(nodes, (ListConfig, list, tuple)):
            raise UserError(f"{where}{key}: must be a list of reward nodes (- _component_: ...), got {nodes!r:.60}")
        functions, weights = [], []
        for i, node in enumerate(nodes):
            path = f"{key}[{i}]"
            if not isinstance(node, (DictConfig, Mapping)) or COMPONENT_KEY not in node:
                raise UserError(f"{where}{path}: must be a node with a {COMPONENT_KEY} (a reward class or function)")
            options = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
            weight = options.pop(WEIGHT_KEY, 1.0)
            if not _is_finite_number(weight):
                raise UserError(f"{where}{path}.{WEIGHT_KEY}: must be a finite number, got {weight!r}")
            dotted = options[COMPONENT_KEY]
            try:
                target = locate(dotted)
            except TargetNotFound as e:
                raise UserError(f"{where}{path}.{COMPONENT_KEY}: {e}") from None
            function = _build(target, options, dotted, f"{where}{path}")
            problem, _ = _signature_problem(function)
            if problem is not None:
                shown = f"an instance of {dotted}" if inspect.isclass(target) else dotted
                raise UserError(f"{where}{path}.{COMPONENT_KEY}: {shown} {problem}")
            functions.append(function)
            weights.append(weight)
        return cls(functions, weights, key=key)

    def score(self, prompt: str, completion: str, fields: Mapping[str, Any], *, row: str) -> tuple[float, list[float]]:
        """Each function's score of ``completion`` and their weighted sum: ``(total, [score per function])``.

        Args:
            prompt: the prompt's text.
            completion: the completion's text.
            fields: the row's other columns (and ``completion_tokens`` from the recipe).
            row: where the prompt came from, for messages (``prompts.jsonl row 17``).

        Raises:
            UserError: one line naming the reward and the row, when a function raises, returns something other
                than a finite real number, or needs a field the row lacks.
        """
        shadowed = [name for name in _POSITIONAL if name in fields]
        if shadowed:
            raise UserError(
                f"{row}: has a field named {shadowed[0]!r}, which is the reward functions' own argument; rename the "
                "column"
            )
        scores = []
        for i, (function, accepts, name) in enumerate(zip(self.functions, self._accepts, self.names)):
            label = f"reward {name} ({self.key}[{i}]) on {row}"
            given = dict(fields) if accepts is None else {k: v for k, v in fields.items() if k in accepts}
            try:
                value = function(prompt, completion, **given)
            except UserError as e:
                raise UserError(f"{label}: {e}") from None
            except Exception as e:  # noqa: BLE001 (user code: whatever it raises stops the run in one line)
                if isinstance(e, TypeError) and accepts is not None and (missing := _missing(function, given)):
                    raise UserError(
                        f"{label}: needs field {missing!r}, which the row lacks (its fields: "
                        f"{', '.join(map(str, fields)) or 'none'})"
                    ) from None
                message = str(e).strip().splitlines()
                detail = f": {message[0]}" if message else ""
                raise UserError(f"{label}: raised {type(e).__name__}{detail}") from None
            result = _as_score(value)
            if isinstance(result, str):
                raise UserError(f"{label}: {result}")
            scores.append(result)
        return sum(w * s for w, s in zip(self.weights, scores)), scores


def _missing(function: RewardFunction, given: dict[str, Any]) -> str | None:
    """The first required keyword argument of ``function`` that ``given`` lacks."""
    sig = signature(function)
    if sig is None:
        return None
    try:
        sig.bind("", "", **given)
    except TypeError:
        for p in list(sig.parameters.values())[2:]:
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given:
                return p.name
    return None


def _build(target: Any, options: dict[str, Any], dotted: str, where: str) -> RewardFunction:
    """The reward a resolved node makes: a class instantiated with its options, a function with them bound."""
    if inspect.isclass(target):
        try:
            return instantiate(options)
        except UserError as e:
            # A plain dict's errors name its keys alone ("pattern: ...", or "<node>: ..."): put the node's path first.
            message = str(e)
            relative = f": {message.removeprefix('<node>: ')}" if message.startswith("<node>: ") else f".{message}"
            raise UserError(f"{where}{relative}") from None
    kwargs = {k: v for k, v in options.items() if k != COMPONENT_KEY}
    if not kwargs:
        return target
    sig = signature(target)
    if sig is not None:
        names = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        for name in kwargs:
            if name in _POSITIONAL or (name not in names and not takes_kwargs):
                raise UserError(f"{where}.{name}: not an option of {dotted} (it takes {sig})")
    return functools.partial(target, **kwargs)

