"""The shipped reward functions, the math verifier, and the reward set a config builds (its one-line refusals)."""

import functools
import re
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from toolkit.errors import UserError
from toolkit.rl import (
    ExactMatch,
    FormatReward,
    LengthPenalty,
    MathAnswer,
    RewardSet,
    math_answers,
)
from toolkit.rl.math_answers import equivalent, final_answer

# (completion, reference, expected score)
MATH_CASES = [
    ("So the result is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces kept whole
    ("\\boxed{{1}+{2}}", "3", 1.0),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),  # the last box counts
    ("first \\boxed{3}, then corrected: \\boxed{4}", "3", 0.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{-7}", "7", 0.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("The answer is 1,000,000", "1000000", 1.0),
    ("#### 72", "72", 1.0),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0),  # GSM8K reference
    ("The answer is $18.", "18", 1.0),
    ("The answer is 50%", "50", 1.0),
    ("The answer is \\$5", "5", 1.0),
    ("Final Answer: The final answer is 12 apples. I hope it is correct.", "12", 1.0),
    ("answer: $\\frac{2}{3}$", "2/3", 1.0),
    ("It costs 3 then 5 then 8 dollars", "8", 1.0),  # no marker: the last number
    ("\\boxed{1.5\\times 10^{3}}", "1500", 1.0),
    ("\\boxed{2.5e-3}", "0.0025", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{(1, 2)}", "(2,1)", 0.0),
    ("\\boxed{(1, 2)}", "[1,2]", 0.0),
    ("\\boxed{\\text{east}}", "east", 1.0),
    ("The answer is \\(\\frac{3}{5}\\).", "0.6", 1.0),
    ("\\boxed{1\\frac{1}{2}}", "3/2", 1.0),  # a mixed number
    ("\\boxed{1\\frac{1}{2}}", "1/2", 0.0),
    ("\\boxed{-2\\frac{1}{4}}", "-9/4", 1.0),
    ("The answer is \u22125", "-5", 1.0),  # the typographic minus
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{0.33}", "1/3", 0.0),
    ("\\boxed{41}", "42", 0.0),
    ("I do not know.", "42", 0.0),  # no answer at all
    ("", "42", 0.0),
    ("\\boxed{}", "", 0.0),  # two empty answers are not a match
    ("\\boxed{\\frac{1}{0}}", "1", 0.0),
    ("\\boxed{1/0}", "0", 0.0),
]
SYMBOLIC_CASES = [
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("\\boxed{2x}", "x*2", 1.0),
    ("\\boxed{\\sqrt[3]{27}}", "3", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt2}{2}", 1.0),
    ("\\boxed{x^{1/2}}", "\\sqrt{x}", 1.0),
    ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3,\\pi/2)", 1.0),
    ("\\boxed{x^2}", "x^3", 0.0),
    ("\\boxed{((((10^64)^64)^64)^64)^64}", "1", 0.0),  # refused before it is computed
    ("\\boxed{9^{99999}}", "1", 0.0),
]


@pytest.mark.parametrize("completion,reference,expected", MATH_CASES)
def test_math_answer(completion: str, reference: str, expected: float) -> None:
    assert MathAnswer()("p", completion, answer=reference) == expected


@pytest.mark.parametrize("completion,reference,expected", SYMBOLIC_CASES)
def test_math_answer_symbolic(completion: str, reference: str, expected: float) -> None:
    pytest.importorskip("sympy")
    assert MathAnswer()("p", completion, answer=reference) == expected


def test_math_answer_without_sympy_compares_numbers_and_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sympy", None)  # import sympy raises ImportError
    assert equivalent("\\frac{1}{2}", "0.5") and equivalent("x^2 + 1", "x^2+1")
    assert not equivalent("2\\sqrt{2}", "\\sqrt{8}")


def test_math_answer_never_evaluates_text(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sympy")
    import builtins

    import sympy

    def refuse(*args, **kwargs):
        raise AssertionError("text was evaluated")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(sympy, "sympify", refuse)
    for text in ("__import__('os').system('true')", "\\boxed{x+1}", "(lambda: 1)()"):
        MathAnswer()("p", text, answer="x+1")
    assert MathAnswer()("p", "\\boxed{1+x}", answer="x+1") == 1.0


def test_math_answer_options_and_reference_types() -> None:
    assert MathAnswer(field="solution")("p", "\\boxed{3}", solution="3", answer="4") == 1.0
    assert MathAnswer()("p", "\\boxed{3}", answer=3) == 1.0  # a JSON number
    assert MathAnswer()("p", "\\boxed{0.5}", answer=0.5) == 1.0
    assert MathAnswer(rel_tol=0.01)("p", "\\boxed{0.333}", answer="1/3") == 1.0
    assert MathAnswer()("p", "\\boxed{0.333}", answer="1/3") == 0.0
    with pytest.raises(UserError, match=r"rel_tol: must be a number in \[0, 1\), got -1"):
        MathAnswer(rel_tol=-1)
    with pytest.raises(UserError, match="the row has no field 'answer' \\(its fields: task\\)"):
        MathAnswer()("p", "1", task="t")
    with pytest.raises(UserError, match="field 'answer' must be a string or a number, got null"):
        MathAnswer()("p", "1", answer=None)


def test_final_answer_extraction() -> None:
    assert final_answer("\\boxed{\\frac{1}{\\sqrt{2}}} and more") == "\\frac{1}{\\sqrt{2}}"
    assert final_answer("\\boxed{unclosed") is None
    assert final_answer("\\boxed{7 unclosed") == "7"  # an unclosed box is no box: the last number
    assert final_answer("a \\boxed{1} then the answer is 2") == "1"  # a box wins over a phrase
    assert final_answer("the answer is 2.\n#### 3") == "3"  # the later phrase
    assert final_answer("values -4 and 1,250.5 seen") == "1,250.5"
    assert final_answer("no digits") is None


def test_exact_match() -> None:
    assert ExactMatch()("p", " pmal\n", answer="pmal") == 1.0
    assert ExactMatch(strip=False)("p", " pmal", answer="pmal") == 0.0
    assert ExactMatch()("p", "PMAL", answer="pmal") == 0.0
    assert ExactMatch(case_sensitive=False)("p", "PMAL", answer="pmal") == 1.0
    assert ExactMatch(field="target")("p", "7", target=7) == 1.0
    assert ExactMatch()("p", "pma", answer="pmal") == 0.0
    with pytest.raises(UserError, match="field: must name a column"):
        ExactMatch(field="")


def test_format_reward() -> None:
    think = FormatReward(pattern=r"(?s)<think>.*</think>\s*\S.*")
    assert think("p", "<think>a\nb</think> 42") == 1.0
    assert think("p", "42 <think>a</think> 4") == 0.0
    assert FormatReward(pattern=r"\d+", mode="search")("p", "it is 42.") == 1.0
    assert FormatReward(pattern=r"\d+")("p", "it is 42.") == 0.0
    assert FormatReward(pattern="x", weight_on_match=0.25)("p", "x") == 0.25
    with pytest.raises(UserError, match=r"^pattern: '\(' is not a valid regular expression"):
        FormatReward(pattern="(")
    with pytest.raises(UserError, match="mode: must be 'fullmatch' or 'search', got 'match'"):
        FormatReward(pattern="x", mode="match")
    with pytest.raises(UserError, match="weight_on_match: must be a finite number"):
        FormatReward(pattern="x", weight_on_match=float("nan"))


@pytest.mark.parametrize("length,expected", [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (101, -1.0),
                                             (10_000, -1.0)])
def test_length_penalty_follows_dapo(length: int, expected: float) -> None:
    # DAPO eq. 13 with L_max = 100, L_cache = 20: zero to 80 tokens, then a ramp to -1 at 100.
    assert LengthPenalty(max_length=100, cache_length=20)("p", "x", completion_tokens=length) == pytest.approx(expected)
    assert LengthPenalty(max_length=100, cache_length=20, unit="chars")("p", "x" * length) == pytest.approx(expected)


def test_length_penalty_refusals() -> None:
    with pytest.raises(UserError, match="max_length: must be a positive integer, got 0"):
        LengthPenalty(max_length=0, cache_length=1)
    with pytest.raises(UserError, match=r"cache_length: must be an integer from 1 to max_length \(10\), got 11"):
        LengthPenalty(max_length=10, cache_length=11)
    with pytest.raises(UserError, match="cache_length: .* got True"):
        LengthPenalty(max_length=10, cache_length=True)
    with pytest.raises(UserError, match="unit: must be 'tokens' or 'chars'"):
        LengthPenalty(max_length=10, cache_length=2, unit="words")
    with pytest.raises(UserError, match="'completion_tokens', which is missing .*set unit: chars"):
        LengthPenalty(max_length=10, cache_length=2)("p", "x")
    with pytest.raises(UserError, match="which is -1"):
        LengthPenalty(max_length=10, cache_length=2)("p", "x", completion_tokens=-1)


def length_reward(prompt, completion, **fields):
    return len(completion)


def needs_answer(prompt, completion, answer, scale=1.0):
    return scale * float(completion == answer)


def wrong_signature(completion, **fields):
    return 1.0


def two_args_only(prompt, completion):
    return 0.5


def returns(value):
    def reward(prompt, completion, **fields):
        return value() if callable(value) else value

    return reward


def _rewards(*nodes: dict):
    """A config's ``rewards`` list, loaded as a recipe's config would be."""
    return OmegaConf.create({"rewards": list(nodes)}).rewards


HERE = __name__


def test_reward_set_builds_classes_and_functions_with_weights_and_names() -> None:
    rewards = RewardSet.from_config(_rewards(
        {"_component_": "toolkit.rl.MathAnswer", "weight": 2},
        {"_component_": f"{HERE}.length_reward", "weight": 0.5},
        {"_component_": f"{HERE}.needs_answer", "scale": 3.0},
        {"_component_": "toolkit.rl.MathAnswer", "field": "other"},
        {"_component_": f"{HERE}.two_args_only", "weight": 0},
    ))
    assert rewards.names == ["math_answer", "length_reward", "needs_answer", "math_answer_2", "two_args_only"]
    assert rewards.weights == [2.0, 0.5, 1.0, 1.0, 0.0]
    assert isinstance(rewards.functions[2], functools.partial) and rewards.functions[1] is length_reward
    total, scores = rewards.score("p", "\\boxed{4}", {"answer": "4", "other": "5", "task": "t"}, row="r")
    assert scores == [1.0, 9.0, 0.0, 0.0, 0.5]
    assert total == 2.0 * 1 + 0.5 * 9
    # A function naming its fields is given those alone; **fields takes all.
    assert rewards.score("p", "4", {"answer": "4", "other": "4"}, row="r")[1][2] == 3.0


@pytest.mark.parametrize("node,message", [
    ({"_component_": "toolkit.rl.MathAnswr"},
     ("rewards[1]._component_: cannot import 'toolkit.rl.MathAnswr': 'toolkit.rl' has no 'MathAnswr'; did you mean "
     "'MathAnswer'?")),
    ({"_component_": "nowhere.reward"}, "rewards[1]._component_: cannot import 'nowhere.reward'"),
    ({"_component_": f"{HERE}.wrong_signature"},
     (f"rewards[1]._component_: {HERE}.wrong_signature takes (completion, **fields); a reward takes (prompt, "
     "completion, **fields)")),
    ({"_component_": f"{HERE}.HERE"}, f"rewards[1]._component_: {HERE}.HERE is not callable (a str)"),
    ({"_component_": "collections.OrderedDict"},
     "rewards[1]._component_: an instance of collections.OrderedDict is not callable (a OrderedDict)"),
    ({"_component_": f"{HERE}.needs_answer", "scael": 2}, f"rewards[1].scael: not an option of {HERE}.needs_answer"),
    ({"_component_": f"{HERE}.length_reward", "completion": "x"}, "rewards[1].completion: not an option"),
    ({"_component_": "toolkit.rl.FormatReward", "pattern": "("}, "rewards[1].pattern: '(' is not a valid regular"),
    ({"_component_": "toolkit.rl.FormatReward", "patern": "x"},
     "rewards[1].patern: not an argument of toolkit.rl.FormatReward; did you mean 'pattern'?"),
    ({"_component_": "toolkit.rl.FormatReward"}, "rewards[1]: cannot call toolkit.rl.FormatReward: missing a required"),
    ({"_component_": "toolkit.rl.ExactMatch", "weight": "high"}, "rewards[1].weight: must be a finite number, got 'high'"),
    ({"_component_": "toolkit.rl.ExactMatch", "weight": float("inf")}, "rewards[1].weight: must be a finite number"),
    ({"weight": 1}, "rewards[1]: must be a node with a _component_"),
])
def test_reward_set_refuses_bad_nodes_in_one_line(node: dict, message: str) -> None:
    with pytest.raises(UserError) as error:
        RewardSet.from_config(_rewards({"_component_": "toolkit.rl.ExactMatch"}, node))
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_reward_set_names_the_config_file(tmp_path) -> None:
    from toolkit.config import load_config

    path = tmp_path / "rl.yaml"
    path.write_text("rewards:\n  - _component_: toolkit.rl.Nope\n")
    with pytest.raises(UserError, match=re.escape(f"{path}: rewards[0]._component_: cannot import")):
        RewardSet.from_config(load_config(str(path)).rewards)


def test_reward_set_refuses_an_empty_or_non_list() -> None:
    with pytest.raises(UserError, match="rewards: no reward function"):
        RewardSet.from_config([])
    with pytest.raises(UserError, match="rewards: must be a list of reward nodes"):
        RewardSet.from_config({"_component_": "toolkit.rl.ExactMatch"})


def _fail():
    return 1 / 0


@pytest.mark.parametrize("value,problem", [
    ("yes", "returned 'yes', not a number"),
    (None, "returned None, not a number"),
    (float("nan"), "returned nan, not a finite number"),
    (float("-inf"), "returned -inf, not a finite number"),
    (np.float32("nan"), "returned nan, not a finite number"),
    (torch.tensor([1.0, 2.0]), "returned tensor([1., 2.]), not a number"),
    (1 + 2j, "returned (1+2j), not a number"),
    (_fail, "raised ZeroDivisionError: division by zero"),
])
def test_reward_set_refuses_a_bad_score_naming_function_and_row(value, problem) -> None:
    rewards = RewardSet([ExactMatch(), returns(value)])
    with pytest.raises(UserError) as error:
        rewards.score("p", "x", {"answer": "x"}, row="prompts.jsonl row 17")
    assert str(error.value) == f"reward reward (rewards[1]) on prompts.jsonl row 17: {problem}"


@pytest.mark.parametrize("value", [True, False, 3, np.float64(0.25), np.int64(2), torch.tensor(0.5), np.array(1.5)])
def test_reward_set_takes_numbers_of_any_kind(value) -> None:
    total, scores = RewardSet([returns(value)], [2.0]).score("p", "x", {}, row="r")
    assert scores == [float(value)] and total == 2 * float(value) and type(scores[0]) is float


def test_reward_set_names_a_missing_field_and_a_shadowing_column() -> None:
    rewards = RewardSet([needs_answer], key="rewards")
    with pytest.raises(UserError, match=re.escape(
        "reward needs_answer (rewards[0]) on demo row 3: needs field 'answer', which the row lacks (its fields: task)"
    )):
        rewards.score("p", "x", {"task": "t"}, row="demo row 3")
    with pytest.raises(UserError, match="data.jsonl row 2: has a field named 'completion'"):
        rewards.score("p", "x", {"completion": "y", "answer": "y"}, row="data.jsonl row 2")
    with pytest.raises(UserError, match=re.escape("reward exact_match (rewards[0]) on r: the row has no field 'answer'")):
        RewardSet([ExactMatch()]).score("p", "x", {}, row="r")


def test_reward_set_checks_signatures_of_python_functions() -> None:
    with pytest.raises(UserError, match=r"rewards\[1\]: wrong_signature takes \(completion, \*\*fields\)"):
        RewardSet([length_reward, wrong_signature])
    with pytest.raises(UserError, match=r"rewards: 1 reward functions but 2 weights"):
        RewardSet([length_reward], [1, 2])
    RewardSet([lambda *args, **fields: 0.0])  # *args takes prompt and completion


def test_symbolic_limits_are_set() -> None:
    assert math_answers.MAX_SYMBOLIC_CHARS > 50 and math_answers.MAX_EXPONENT >= 10
