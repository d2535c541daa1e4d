"""ToolkitLM, lm-eval's model interface over our decoder: log-likelihoods against a float64 computation and against
transformers on the same weights, rolling windows against lm-eval's definition, and generation with stop strings."""

import copy
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from toolkit.errors import UserError  # noqa: E402
from toolkit.evaluation.lm_eval_model import ToolkitLM  # noqa: E402
from toolkit.generation import generate  # noqa: E402
from toolkit.tokenizers import byte_tokenizer  # noqa: E402
from toolkit.training import HFCheckpointer  # noqa: E402

TOKENIZER = byte_tokenizer()
BOS = TOKENIZER.bos_id
GREEDY_PROMPT = "Q: 2+2="

# (context, continuation): a plain one, a context ending in a space (scored with the continuation, lm-eval's
# convention), an empty context (scored after bos), and a sequence longer than the model's 64 positions (the context
# loses its start).
PAIRS = [
    ("Question: what is two plus two? Answer:", " four"),
    ("The capital of France is ", "Paris"),
    ("", "an empty context"),
    ("x" * 80 + " so the context is cut from the left:", " yes"),
]


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("test_task", 0, 1))


def reference_score(logits_of: Callable[[list[int]], torch.Tensor], context: str, continuation: str) -> tuple[float, bool]:
    """``(log p(continuation | context), greedy)`` from one unpadded forward; the byte tokenizer's ids written out
    (bos, then UTF-8 bytes), whitespace ending the context scored with the continuation, the sequence cut to the
    model's 64 positions plus the last target."""
    stripped = context.rstrip()
    scored = list((context[len(stripped):] + continuation).encode())
    sequence = ([BOS, *stripped.encode()] + scored)[-65:]
    with torch.no_grad():
        logprobs = logits_of(sequence[:-1]).double().log_softmax(-1)[-len(scored):]  # [c, vocab]
    targets = torch.tensor(scored)
    return float(logprobs.gather(-1, targets[:, None]).sum()), bool((logprobs.argmax(-1) == targets).all())


def greedy_continuation(model: torch.nn.Module, num_tokens: int) -> str:
    """The model's own greedy continuation of GREEDY_PROMPT, as text (its tokens are bytes, checked)."""
    tokens = generate(model, TOKENIZER.encode(GREEDY_PROMPT, add_eos=False), max_new_tokens=num_tokens)
    assert len(tokens) == num_tokens and all(t < 256 for t in tokens), "a plain-text continuation to test with"
    return bytes(tokens).decode()


def test_loglikelihood_matches_a_float64_computation(demo_model):
    pairs = [*PAIRS, (GREEDY_PROMPT, greedy_continuation(demo_model, 6))]
    # Batches of 2 sequences of different lengths: the shorter one is padded.
    got = ToolkitLM(demo_model, TOKENIZER, batch_size=2).loglikelihood([request("loglikelihood", *p) for p in pairs])
    model64 = copy.deepcopy(demo_model).double()
    expected = [reference_score(lambda ids: model64(torch.tensor([ids]))[0], *pair) for pair in pairs]
    # float32 (batched, padded) against float64 on sums of up to 20 log-probabilities of magnitude ~6: 3e-6 apart
    # when measured; a wrong token or position would be off by ~1 or more.
    assert [score for score, _ in got] == pytest.approx([score for score, _ in expected], abs=1e-4, rel=0)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected] == [False] * len(PAIRS) + [True]


def test_loglikelihood_matches_transformers_on_the_same_weights(demo_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    checkpoint = HFCheckpointer(None, model_family="llama3").save(demo_model, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    got = ToolkitLM(demo_model, TOKENIZER, batch_size=3).loglikelihood([request("loglikelihood", *p) for p in PAIRS])
    expected = [reference_score(lambda ids: theirs(torch.tensor([ids])).logits[0], *pair) for pair in PAIRS]
    # float32 in both, the same math in another order: 3e-6 apart when measured (tests/models: logits within 1e-4).
    assert [score for score, _ in got] == pytest.approx([score for score, _ in expected], abs=1e-4, rel=0)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]


def test_a_continuation_longer_than_the_model_is_an_error(demo_model):
    lm = ToolkitLM(demo_model, TOKENIZER)
    with pytest.raises(UserError, match=r"test_task, document 0: a continuation of 70 tokens .* max_seq_len \(64\)"):
        lm.loglikelihood([request("loglikelihood", "context", "y" * 70)])


def test_rolling_windows_follow_lm_evals_definition(random_demo_model):
    # lm-eval's LM.loglikelihood_rolling docstring: tokens 0..9, a context of 4. Every token is predicted once; a
    # window after the first starts with the token before those it predicts; the last takes a full context.
    lm = ToolkitLM(random_demo_model(max_seq_len=4), TOKENIZER)
    assert lm.rolling_windows(list(range(10))) == [([BOS], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]), ([5, 6, 7], [8, 9])]
    assert lm.rolling_windows([0, 1, 2, 3]) == [([BOS], [0, 1, 2, 3])]
    assert lm.rolling_windows([]) == []


def test_loglikelihood_rolling_sums_its_windows(demo_model):
    short, long = "a text that fits in one window", "a longer text " * 11  # 30 and 154 bytes: 1 and 3 windows
    lm = ToolkitLM(demo_model, TOKENIZER, batch_size=2)
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", short), request("loglikelihood_rolling", long)])
    model64 = copy.deepcopy(demo_model).double()

    def score64(context: list[int], continuation: list[int]) -> float:
        with torch.no_grad():
            logprobs = model64(torch.tensor([context + continuation[:-1]]))[0].log_softmax(-1)[-len(continuation):]
        return float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum())

    # One window: the text's log-likelihood after bos, as a plain continuation of an empty context.
    assert got[0] == pytest.approx(reference_score(lambda ids: model64(torch.tensor([ids]))[0], "", short)[0], abs=1e-4)
    windows = lm.rolling_windows(list(long.encode()))
    assert [len(continuation) for _, continuation in windows] == [64, 64, 26]
    assert got[1] == pytest.approx(sum(score64(*window) for window in windows), abs=1e-4)  # as above


def test_generate_until_stops_at_a_stop_string_or_the_token_budget(demo_model):
    free = greedy_continuation(demo_model, 12)
    stop = next(c for c in free if c != free[0])  # a stop string the greedy text reaches after some tokens
    lm = ToolkitLM(demo_model, TOKENIZER)
    got = lm.generate_until([
        request("generate_until", GREEDY_PROMPT, {"until": [stop], "max_gen_toks": 12}),
        request("generate_until", GREEDY_PROMPT, {"until": stop, "max_gen_toks": 12, "do_sample": False}),
        request("generate_until", GREEDY_PROMPT, {"until": ["never generated"], "max_gen_toks": 5}),
    ])
    assert got == [free[: free.index(stop)]] * 2 + [free[:5]]


def test_sampling_follows_the_seed(demo_model):
    sample = [request("generate_until", GREEDY_PROMPT, {"do_sample": True, "temperature": 1.0, "max_gen_toks": 8})]
    first, again, other = (ToolkitLM(demo_model, TOKENIZER, seed=s).generate_until(sample)[0] for s in (0, 0, 1))
    assert first == again != other


def test_unsupported_generation_settings_are_named(demo_model):
    with pytest.raises(UserError, match=r"test_task: generation_kwargs \['num_beams'\] are not supported"):
        ToolkitLM(demo_model, TOKENIZER).generate_until([request("generate_until", "x", {"num_beams": 4})])



def test_processes_score_and_generate_disjoint_shares(demo_model, monkeypatch):
    scoring = [request("loglikelihood", *pair) for pair in PAIRS * 2]
    generating = [request("generate_until", prompt, {"max_gen_toks": 3}) for prompt in ("a", "b", "c")]
    alone = ToolkitLM(demo_model, TOKENIZER, batch_size=2)
    scores, texts = alone.loglikelihood(scoring), alone.generate_until(generating)
    # Two ranks of a model with whole copies, one after the other here: what each would all-gather is kept instead
    # (the gathering itself runs in tests/evaluation/test_lm_eval_recipe.py, on 2 processes).
    shares: list[dict] = []
    monkeypatch.setattr(ToolkitLM, "_all_gather", lambda self, mine, count: shares.append(mine) or [None] * count)
    for rank in (0, 1):
        lm = ToolkitLM(demo_model, TOKENIZER, batch_size=2, rank=rank, world_size=2)
        lm.loglikelihood(scoring)
        lm.generate_until(generating)
    scored_0, generated_0, scored_1, generated_1 = shares
    for first, second, total in [(scored_0, scored_1, len(scoring)), (generated_0, generated_1, len(generating))]:
        assert sorted([*first, *second]) == list(range(total)), "every request once"
        assert len(first) - len(second) in (0, 1), "balanced"
    merged = {**scored_0, **scored_1}
    # Other batches, other padding: float32 rounding apart (as against float64 above).
    assert [merged[i][0] for i in range(len(scoring))] == pytest.approx([s for s, _ in scores], abs=1e-4)
    assert [merged[i][1] for i in range(len(scoring))] == [greedy for _, greedy in scores]
    assert [{**generated_0, **generated_1}[i] for i in range(len(generating))] == texts


def test_a_sampled_answer_is_the_same_on_any_number_of_processes(demo_model, monkeypatch):
    # lm-eval's `repeats` (self-consistency tasks) sends copies of one request side by side: on 2 processes each
    # copy of a pair went to another process, and both processes drew from generators seeded alike, so the pair's
    # two samples were one and the same, and the answers differed from one process's.
    settings = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 6}
    sampled = [request("generate_until", prompt, settings) for prompt in ("a", "a", "a", "a", "b")]
    alone = ToolkitLM(demo_model, TOKENIZER, seed=3).generate_until(sampled)
    assert len(set(alone[:4])) == 4, "4 samples of one prompt, 4 draws"
    # A request's sample does not depend on the requests before it either (a lone copy gets the first's).
    assert ToolkitLM(demo_model, TOKENIZER, seed=3).generate_until(sampled[:1]) == alone[:1]
    shares: list[dict] = []
    monkeypatch.setattr(ToolkitLM, "_all_gather", lambda self, mine, count: shares.append(mine) or [None] * count)
    for rank in (0, 1):
        ToolkitLM(demo_model, TOKENIZER, seed=3, rank=rank, world_size=2).generate_until(sampled)
    merged = {**shares[0], **shares[1]}
    # Exactly equal: the same draws for the same request, on one process or two.
    assert [merged[i] for i in range(len(sampled))] == alone


@pytest.mark.parametrize("batch_size", [0, None, "auto", 2.5, True])
def test_a_batch_size_that_is_not_a_positive_count_is_named(demo_model, batch_size):
    # lm-eval's own backends take "auto"; ours needs a count (lm_eval.batch_size=null or auto in a config).
    with pytest.raises(UserError, match=rf"^lm_eval batch_size must be a positive integer, got {batch_size!r}$"):
        ToolkitLM(demo_model, TOKENIZER, batch_size=batch_size)
