"""Reading a completion's final math answer and deciding whether it equals a reference, without running any text.

:func:`final_answer` finds the answer a model wrote (its last ``\\boxed{...}``, else the last "answer is X" or
"#### X", else its last number); :func:`equivalent` compares two answers: as written (after a normalization that drops
dollar signs, ``\\left``, ``\\text{}``, a trailing period...), as exact rational numbers (``1,000``, ``0.5``, ``1/2``,
``\\frac{1}{2}``, ``1.5e3``, ``50%``), element by element for tuples, and as expressions through sympy where it is
installed (``2\\sqrt{2}`` and ``\\sqrt{8}``, ``(x+1)^2`` and ``x^2+2x+1``).

Nothing here calls ``eval``, ``exec`` or sympy's string parsers (``sympify`` and ``parse_expr`` evaluate Python): the
expressions are read by the small recursive-descent parser below, which builds sympy objects from an allowed set of
tokens (numbers, single letters, Greek letters, ``+ - * / ^``, brackets, ``\\frac``, ``\\sqrt``, ``\\pi``), and refuses
anything else or anything large (an answer longer than :data:`MAX_SYMBOLIC_CHARS`, an exponent above
:data:`MAX_EXPONENT`), so a completion cannot make the comparison run for long either.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

# Longer answers are compared as numbers or strings only: simplifying is where sympy's time goes.
MAX_SYMBOLIC_CHARS = 120
# The largest exponent a parsed power may have (a literal like 9^9^9 would take sympy forever to expand).
MAX_EXPONENT = 64
# Digits of a number literal beyond which it is not read as a number (Fraction of 1e999999999 is a huge integer).
_MAX_NUMBER_CHARS = 400
_MAX_DECIMAL_EXPONENT = 400
# Digits a power of a number may have.
_MAX_POWER_DIGITS = 2000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s$\\{}]+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)
_HASHES = re.compile(r"####")
# "The answer is 42 apples": the number, without the words after it.
_LEADING_NUMBER = re.compile(r"^\$?(-?(?:(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?|\.\d+))\s+[A-Za-z]")
# A number as written in prose: a sign, thousands separators, decimals, an exponent, an optional "/ denominator".
_NUMBER_IN_TEXT = re.compile(
    r"-?(?:(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
)
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_FRACTION = re.compile(r"^([-+]?)\(?([-+]?(?:\d+\.?\d*|\.\d+))\)?/\(?([-+]?(?:\d+\.?\d*|\.\d+))\)?$")
_LATEX_FRACTION = re.compile(r"^([-+]?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))$")
# "1\\frac{1}{2}": one and a half, as MATH writes mixed numbers.
_MIXED_NUMBER = re.compile(r"^([-+]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_SCIENTIFIC = re.compile(r"^([-+]?(?:\d+\.?\d*|\.\d+))(?:\\times|\\cdot|\*|x)10\^\{?([-+]?\d+)\}?$")
_LHS = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?=(?!=)")
_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "^\\circ", "^{\\circ}", "\\circ")
_BRACKETS = {"(": ")", "[": "]", "\\{": "\\}"}


def _balanced(text: str, start: int) -> str | None:
    """The text between the ``{`` just before ``start`` and its matching ``}``, or None if it is never closed."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{" and text[i - 1] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _cut_sentence(text: str) -> str:
    """The answer a phrase like "answer is" introduces: up to the line's end or a sentence's end (". ")."""
    return re.split(r"\n|\.\s", text, maxsplit=1)[0].strip()


def final_answer(completion: str) -> str | None:
    """The final answer written in ``completion``, or None when it has none.

    The last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` is whole); else whichever comes last of
    "answer is X" / "answer: X" and GSM8K's "#### X" (up to the end of the line or sentence); else the last number.
    """
    boxed = [(m.start(), _balanced(completion, m.end())) for m in _BOXED.finditer(completion)]
    boxed += [(m.start(), m.group(1)) for m in _BOXED_BARE.finditer(completion)]
    boxed = [(at, text) for at, text in boxed if text is not None]
    if boxed:
        return max(boxed)[1].strip()
    # The text after the last phrase (a "Final answer: the answer is 42" holds two; the later one is meant).
    phrases = [(m.start(), _cut_sentence(completion[m.end() :])) for p in (_ANSWER_IS, _HASHES) for m in
               p.finditer(completion)]
    phrases = [(at, text) for at, text in phrases if text]
    if phrases:
        text = max(phrases)[1]
        leading = _LEADING_NUMBER.match(text)
        return leading.group(1) if leading else text
    numbers = _NUMBER_IN_TEXT.findall(completion)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """The answer a dataset's reference states: its boxed or "#### X" answer where it is a worked solution
    (MATH's ``solution``, GSM8K's ``answer``), else the whole reference."""
    if _BOXED.search(reference) or _BOXED_BARE.search(reference) or _HASHES.search(reference):
        answer = final_answer(reference)
        if answer is not None:
            return answer
    return reference.strip()


def normalize(answer: str) -> str:
    """``answer`` without what does not change its value: math delimiters, spacing commands, ``\\text{}`` wrappers,
    ``\\dfrac``, degree signs, a leading ``x =``, a trailing period, and all whitespace."""
    text = answer.strip().rstrip(".").rstrip()  # "\\(x\\)." ends a sentence
    for opening, closing in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(opening) and text.endswith(closing) and len(text) >= len(opening) + len(closing):
            text = text[len(opening) : len(text) - len(closing)].strip()
            break
    boxed = _BOXED.match(text)
    if boxed and (inner := _balanced(text, boxed.end())) is not None and len(inner) == len(text) - boxed.end() - 1:
        text = inner
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    for dropped in _DROPPED:
        text = text.replace(dropped, "")
    text = _TEXT_COMMANDS.sub(r"\1", text)
    text = "".join(text.split()).replace("\u2212", "-")  # the typographic minus sign
    text = text.replace("{,}", ",").replace("\\$", "$").replace("\\%", "%")
    text = _LHS.sub("", text)
    while text and text[-1] in ".$%":
        text = text[:-1]
    return text.lstrip("$")


def as_number(answer: str) -> Fraction | None:
    """A normalized answer's exact value when it is a number: an integer, a decimal, ``1,000``, ``a/b``,
    ``\\frac{a}{b}``, scientific (``1.5e3``, ``1.5\\times10^{3}``); else None."""
    text = answer
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    try:
        if _PLAIN_NUMBER.match(text):
            return _fraction(text)
        if match := _SCIENTIFIC.match(text):
            exponent = int(match.group(2))
            if abs(exponent) > _MAX_DECIMAL_EXPONENT:
                return None
            return _fraction(match.group(1)) * Fraction(10) ** exponent
        if match := _FRACTION.match(text):
            sign, numerator, denominator = match.groups()
            value = _fraction(numerator) / _fraction(denominator)
        elif match := _MIXED_NUMBER.match(text):
            sign, whole, numerator, denominator = match.groups()
            value = int(whole) + Fraction(int(numerator), int(denominator))
        elif match := _LATEX_FRACTION.match(text):
            sign = match.group(1)
            numerator, denominator = (as_number(match.group(i) or match.group(i + 1)) for i in (2, 4))
            if numerator is None or denominator is None:
                return None
            value = numerator / denominator
        else:
            return None
    except ZeroDivisionError:
        return None
    return -value if sign == "-" else value


def _fraction(text: str) -> Fraction:
    exponent = re.search(r"[eE]([-+]?\d+)$", text)
    if exponent and abs(int(exponent.group(1))) > _MAX_DECIMAL_EXPONENT:
        raise ZeroDivisionError  # read as "not a number" by the caller; such literals are no answer anyway
    return Fraction(text)


def _split_tuple(text: str) -> tuple[str, list[str]] | None:
    """``("(", ["1", "2"])`` for ``(1,2)``; None for anything but a bracketed, comma-separated list."""
    for opening, closing in _BRACKETS.items():
        if text.startswith(opening) and text.endswith(closing) and len(text) > len(opening) + len(closing):
            inner, depth, parts, start = text[len(opening) : -len(closing)], 0, [], 0
            for i, char in enumerate(inner):
                depth += char in "([{"
                depth -= char in ")]}"
                if depth < 0:
                    return None  # "(1)+(2)": the outer brackets are not one pair
                if char == "," and depth == 0:
                    parts.append(inner[start:i])
                    start = i + 1
            if depth:
                return None
            return opening, parts + [inner[start:]]
    return None


def equivalent(answer: str, reference: str, *, rel_tol: float = 0.0) -> bool:
    """Whether ``answer`` states the same value as ``reference`` (both as written, e.g. ``\\frac{1}{2}`` and ``0.5``).

    Args:
        answer: a model's answer (see :func:`final_answer`).
        reference: the reference answer.
        rel_tol: numbers within this relative distance are equal (0: exactly equal, as rationals).
    """
    left, right = normalize(answer), normalize(reference)
    if left == right:
        return bool(left)
    left_number, right_number = as_number(left), as_number(right)
    if left_number is not None and right_number is not None:
        if left_number == right_number:
            return True
        return rel_tol > 0 and math.isclose(left_number, right_number, rel_tol=rel_tol)
    left_tuple, right_tuple = _split_tuple(left), _split_tuple(right)
    if left_tuple is not None and right_tuple is not None and (len(left_tuple[1]) > 1 or len(right_tuple[1]) > 1):
        return left_tuple[0] == right_tuple[0] and len(left_tuple[1]) == len(right_tuple[1]) and all(
            equivalent(a, b, rel_tol=rel_tol) for a, b in zip(left_tuple[1], right_tuple[1])
        )
    return _symbolically_equal(left, right)


def _symbolically_equal(left: str, right: str) -> bool:
    """Whether sympy finds ``left - right`` to be zero; False when sympy is missing or either side is not an
    expression the parser below reads."""
    if max(len(left), len(right)) > MAX_SYMBOLIC_CHARS:
        return False
    try:
        import sympy
    except ImportError:
        return False
    try:
        difference = _Parser(left, sympy).parse() - _Parser(right, sympy).parse()
        return difference == 0 or sympy.expand(difference) == 0 or sympy.simplify(difference) == 0
    except _Unreadable:
        return False


class _Unreadable(Exception):
    """Internal: the text is not an expression the parser reads."""


_TOKEN = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[A-Za-z]+|[A-Za-z]|[-+*/^(){}\[\]])")
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "sigma", "phi", "omega", "tau", "rho",
}


class _Parser:
    """A recursive-descent reader of a small LaTeX-and-ASCII math grammar into sympy objects (no ``eval``)::

        expr   := term (('+' | '-') term)*
        term   := factor (('*' | '/' | '\\cdot' | '\\times' | nothing) factor)*
        factor := ('-' | '+') factor | power
        power  := atom ('^' factor)?
        atom   := number | letter | \\pi | \\infty | greek | '(' expr ')' | '{' expr '}' | \\frac g g
                  | \\sqrt ('[' expr ']')? g | 'sqrt' '(' expr ')'
    """

    def __init__(self, text: str, sympy: Any) -> None:
        self.sympy = sympy
        self.tokens: list[str] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                raise _Unreadable
            self.tokens.append(match.group(1))
            position = match.end()
        # "sqrt(...)" in ASCII: one token, not the letters s, q, r, t.
        joined = "".join(self.tokens)
        if "sqrt" in joined and "\\sqrt" not in joined:
            self.tokens = _TOKEN.findall(text.replace("sqrt", "\\sqrt"))
        self.at = 0

    def parse(self) -> Any:
        if not self.tokens:
            raise _Unreadable
        value = self.expr()
        if self.at != len(self.tokens):
            raise _Unreadable
        return value

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise _Unreadable
        self.at += 1
        return token

    def expr(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Any:
        value = self.factor()
        while True:
            token = self.peek()
            if token in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.factor()
            elif token == "/":
                self.take()
                divisor = self.factor()
                if divisor == 0:
                    raise _Unreadable
                value = value / divisor
            elif token is not None and (token[0].isalnum() or token in ("(", "\\frac", "\\sqrt", "\\pi", "\\infty")
                                        or token[1:] in _GREEK):
                if token == "\\frac" and self.tokens[self.at - 1][0].isdigit():
                    raise _Unreadable  # 2\frac{1}{3}: a mixed number (as_number reads it), not a product
                value = value * self.factor()  # implicit: 2x, 2\pi, x(x+1)
            else:
                return value

    def factor(self) -> Any:
        if self.peek() in ("-", "+"):
            return -self.factor() if self.take() == "-" else self.factor()
        return self.power()

    def power(self) -> Any:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.factor()
        if exponent.has(self.sympy.Pow) and not exponent.is_Rational or (
            exponent.is_number and (not exponent.is_real or abs(exponent) > MAX_EXPONENT)
        ):
            raise _Unreadable
        # ((10^64)^64)^64...: each power within the limit, the number they make beyond any.
        if base.is_Rational and exponent.is_number:
            digits = len(str(abs(base.p))) + len(str(base.q))
            if digits * abs(exponent) > _MAX_POWER_DIGITS:
                raise _Unreadable
        return base**exponent

    def group(self) -> Any:
        """A braced argument, or a single digit or letter (``\\frac12``)."""
        if self.peek() == "{":
            return self.atom()
        token = self.take()
        if len(token) == 1 and token.isalnum():
            return self.sympy.Integer(token) if token.isdigit() else self.sympy.Symbol(token)
        raise _Unreadable

    def atom(self) -> Any:
        sympy = self.sympy
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            if len(token) > _MAX_NUMBER_CHARS:
                raise _Unreadable
            return sympy.Rational(token)
        if token in ("(", "{", "["):
            value = self.expr()
            self.take({"(": ")", "{": "}", "[": "]"}[token])
            return value
        if token == "\\frac":
            numerator, denominator = self.group(), self.group()
            if denominator == 0:
                raise _Unreadable
            return numerator / denominator
        if token == "\\sqrt":
            index = None
            if self.peek() == "[":
                self.take()
                index = self.expr()
                self.take("]")
            radicand = self.atom() if self.peek() == "(" else self.group()
            return sympy.sqrt(radicand) if index is None else sympy.root(radicand, index)
        if token == "\\pi":
            return sympy.pi
        if token == "\\infty":
            return sympy.oo
        if token[1:] in _GREEK:
            return sympy.Symbol(token[1:])
        if len(token) == 1 and token.isalpha():
            return sympy.Symbol(token)
        raise _Unreadable
