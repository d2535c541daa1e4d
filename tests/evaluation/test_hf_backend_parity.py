"""ToolkitLM against lm-evaluation-harness's own Hugging Face backend (``lm_eval.models.huggingface.HFLM``) on the
same tiny Qwen2 checkpoint and BPE tokenizer: the same log-likelihoods (the context/continuation boundary, whitespace
moved to the continuation, left truncation past the model's length), the same rolling windows, the same greedy
generations cut at the same stop strings."""

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from lm_eval.api.instance import Instance  # noqa: E402

from tests.tiny_tokenizer import chatml_byte_level_bpe  # noqa: E402
from toolkit.evaluation.lm_eval_model import ToolkitLM  # noqa: E402
from toolkit.models import build_from_hf  # noqa: E402
from toolkit.tokenizers import from_pretrained  # noqa: E402
from toolkit.training import HFCheckpointer, materialize  # noqa: E402

MAX_LEN = 64  # both backends' max length, well under the checkpoint's 128 positions
TEXT = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Question: what is two plus two? Answer: four.", "  leading spaces and\nnewlines\n\n and tabs\there ",
]


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> tuple[ToolkitLM, object]:
    """(ours, lm-eval's HFLM) over one checkpoint; batch sizes differ (2 and 3), so padding differs too."""
    from lm_eval.models.huggingface import HFLM
    folder: Path = tmp_path_factory.mktemp("tiny_qwen2")
    bpe = chatml_byte_level_bpe(TEXT * 20, vocab_size=500)
    bpe.save(str(folder / "tokenizer.json"))
    config = transformers.Qwen2Config(
        vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0,
    )
    torch.manual_seed(0)
    theirs = transformers.Qwen2ForCausalLM(config).eval()
    theirs.save_pretrained(folder)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its left-truncation warnings
    reference = HFLM(pretrained=theirs, tokenizer=hf_tokenizer, max_length=MAX_LEN, batch_size=3, device="cpu")

    with torch.device("meta"):
        model = build_from_hf(path=folder, max_seq_len=MAX_LEN)
    materialize(model, device=torch.device("cpu"))
    HFCheckpointer(str(folder), model_family="auto").load(model)
    return ToolkitLM(model.eval(), from_pretrained(str(folder)), batch_size=2), reference


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("parity", 0, 1))


def test_loglikelihoods_match_lm_evals_hf_backend(backends):
    ours, reference = backends
    tokenizer = ours.tokenizer
    context = "The capital of France is"
    with torch.no_grad():
        top = int(ours.model(torch.tensor([tokenizer.encode(context, add_eos=False)]))[0, -1].argmax())
    pairs = [
        ("Question: what is two plus two? Answer:", " four"),
        ("The capital of France is ", "Paris"),  # the space is scored with "Paris"
        ("newlines\n\n", "and tabs"),  # so are the newlines
        ("", "an empty context"),  # after the eos (this vocabulary has no bos)
        ("The quick brown fox jumps over the lazy dog. " * 8, "Paris"),  # cut from the left
        ("hello", " lazy dog" * 12),  # a continuation of most of the window
        (context, tokenizer.decode([top])),  # the greedy next token
    ]
    got = ours.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    expected = reference.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    # float32 in both, other batches and another attention kernel: ~2e-5 apart on sums of ~100 log-probabilities
    # (measured); a token off at the boundary or a position off by one moves a score by ~1 or more.
    assert [score for score, _ in got] == pytest.approx([score for score, _ in expected], abs=2e-4, rel=1e-6)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
    assert got[-1][1], "one greedy continuation, so the flag is tested both ways"


def test_rolling_loglikelihoods_match_lm_evals_hf_backend(backends):
    ours, reference = backends
    texts = [TEXT[0] * 5, "short text", TEXT[2] * 5, "x"]  # 3, 1, 2 and 1 windows of 64 tokens
    got = ours.loglikelihood_rolling([request("loglikelihood_rolling", text) for text in texts])
    expected = reference.loglikelihood_rolling([request("loglikelihood_rolling", text) for text in texts])
    assert got == pytest.approx(expected, abs=2e-4, rel=1e-6)  # as above, on sums of up to ~500


def test_greedy_generations_and_stop_strings_match_lm_evals_hf_backend(backends):
    ours, reference = backends
    prompts = ["Question: what is two plus two? Answer:", "The capital of France is", "leading spaces and"]
    free = ours.generate_until([request("generate_until", p, {"until": ["\x00"], "max_gen_toks": 16}) for p in prompts])
    assert free == reference.generate_until(
        [request("generate_until", p, {"until": ["\x00"], "max_gen_toks": 16}) for p in prompts]
    )
    # Stop strings the free texts reach: one character, several, one at the start; a bare string; a budget.
    requests = [
        request("generate_until", prompt, {"until": [stop, "never generated"], "max_gen_toks": 16, "do_sample": False})
        for prompt, text in zip(prompts, free) for stop in (text[4], text[2:5], text[:2])
    ]
    requests += [request("generate_until", prompts[0], {"until": free[0][6], "max_gen_toks": 16})]
    requests += [request("generate_until", prompts[1], {"until": ["never generated"], "max_gen_toks": 3})]
    got = ours.generate_until(requests)
    # Exactly equal: greedy decoding of the same logits (float32) and the same cutting.
    assert got == reference.generate_until(requests)
    assert all(len(text) < len(full) for text, full in zip(got[:-1], [f for f in free for _ in range(3)] + free[:1]))
