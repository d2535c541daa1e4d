"""The checks several families run: against `transformers` (see ``hf_interop``), and a KV cache against the full
forward (``check_kv_cache``)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from toolkit.generation import generate
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer


def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    # transformers initializes norms to one (Gemma: zero) and biases to zero; random values make a swapped or
    # dropped norm or bias visible in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))


def _check(hf_model: torch.nn.Module, family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    _perturb_norms_and_biases(hf_model)
    hf_model.eval()
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)

    ours = from_pretrained(hf_dir).eval()
    vocab_size = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab_size, (2, 24))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    # fp32 with the same math in a different order: 1e-4 absolute on logits of magnitude ~1.
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)

    prompt = tokens[:1, :10]
    with torch.no_grad():
        # min_new_tokens keeps transformers from stopping at its eos; ours gets no stop tokens.
        hf_out = hf_model.generate(prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    ours_out = generate(ours, prompt[0].tolist(), max_new_tokens=20, stop_tokens=[])
    assert ours_out == hf_out[0, 10:].tolist()

    out_dir = HFCheckpointer(None, model_family=family).save(ours, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-4, rtol=0)


@pytest.fixture
def hf_interop(tmp_path: Path) -> Callable[[torch.nn.Module, str], None]:
    """``hf_interop(hf_model, family)``: save a random `transformers` model, load it with
    ``toolkit.pretrained.from_pretrained``, and check logits, 20 greedy tokens, and the round trip back through
    ``HFCheckpointer.save`` into `transformers`."""
    return lambda hf_model, family: _check(hf_model, family, tmp_path)


def _check_kv_cache(model: torch.nn.Module, vocab_size: int) -> None:
    torch.manual_seed(0)
    model.eval()
    tokens = torch.randint(0, vocab_size, (1, 12))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=1, max_seq_len=16)
        prefill = model(tokens[:, :5], input_pos=torch.arange(5))
        steps = [model(tokens[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(5, 12)]
        model.clear_caches()
    torch.testing.assert_close(prefill, full[:, :5], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 5:], atol=1e-5, rtol=0)


@pytest.fixture
def check_kv_cache() -> Callable[[torch.nn.Module, int], None]:
    """``check_kv_cache(model, vocab_size)``: a 5-token prefill and 7 single-token steps through the KV cache give
    the full forward's logits of 12 random tokens."""
    return _check_kv_cache
