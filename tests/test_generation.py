"""toolkit.generation: where generation stops, and the sampling settings; `tune run generate` with an adapter."""

from pathlib import Path

import pytest
import torch

import toolkit.generation
from tests.launch import run_recipe_here
from toolkit.errors import UserError
from toolkit.generation import generate, sample_next_token
from toolkit.models.llama3 import llama3_demo, lora_llama3_demo
from toolkit.modules.peft import get_adapter_params, get_merged_state_dict, init_adapters, is_adapter_key
from toolkit.training import HFCheckpointer
from toolkit.checkpoint.peft import save_peft_adapter


def test_stop_when_ends_generation_after_the_token_it_accepts():
    torch.manual_seed(0)
    model = llama3_demo(max_seq_len=32).eval()
    prompt = [1, 2, 3]
    free = generate(model, prompt, max_new_tokens=10)
    seen = []

    def third_token(generated: list[int]) -> bool:
        seen.append(list(generated))
        return len(generated) == 3

    assert generate(model, prompt, max_new_tokens=10, stop_when=third_token) == free[:3]
    assert seen == [free[:1], free[:2], free[:3]], "asked after every token, and not after it said stop"


def test_top_k_zero_means_no_top_k_filter_as_in_transformers():
    # transformers' generate treats top_k=0 as "no top-k filtering"; `tune run generate top_k=0` must not crash.
    logits = torch.randn(20, generator=torch.Generator().manual_seed(0))

    def draws(**kwargs) -> list[int]:
        return [
            sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(s), **kwargs)
            for s in range(20)
        ]

    assert draws(top_k=0) == draws()


def test_top_p_zero_keeps_the_most_likely_token():
    # transformers keeps at least one token whatever top_p (min_tokens_to_keep=1): top_p=0 is greedy, not an
    # empty distribution.
    logits = torch.randn(20, generator=torch.Generator().manual_seed(0))
    draws = {
        sample_next_token(logits, temperature=1.0, top_p=0.0, generator=torch.Generator().manual_seed(s))
        for s in range(20)
    }
    assert draws == {int(logits.argmax())}


@pytest.mark.parametrize(
    "kwargs,name", [({"top_k": -1}, "top_k"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p")]
)
def test_invalid_sampling_settings_name_the_setting(kwargs, name):
    with pytest.raises(UserError, match=name):
        sample_next_token(torch.randn(20), temperature=1.0, **kwargs)


def test_empty_prompt_is_refused_clearly():
    model = llama3_demo(max_seq_len=32).eval()
    with pytest.raises(UserError, match="prompt"):
        generate(model, [], max_new_tokens=3)


def test_kv_cache_decoding_under_autocast_matches_the_full_forward():
    # lm-eval generation runs under the recipe's autocast (bf16-mixed: float32 weights, bfloat16 activations). The
    # KV cache took the weights' float32 and the first bfloat16 key written into it raised "Index put requires the
    # source and destination dtypes match"; it now takes autocast's dtype.
    torch.manual_seed(0)
    model = llama3_demo(max_seq_len=32).eval()
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert len(generate(model, tokens[0, :4].tolist(), max_new_tokens=8)) == 8
        full = model(tokens)
        model.setup_caches(batch_size=1, max_seq_len=12)
        prefill = model(tokens[:, :4], input_pos=torch.arange(4))
        steps = [model(tokens[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(4, 12)]
        model.clear_caches()
    # The same bfloat16 math with and without a cache (other kernels may round differently): a couple of bfloat16
    # steps (2**-7 at magnitude 2) on logits of magnitude ~2.
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1).float(), full.float(), atol=2e-2, rtol=0)


@pytest.fixture(scope="module")
def demo_base(tmp_path_factory) -> Path:
    """A random demo Llama (the generate demo config's architecture) in Hugging Face layout."""
    torch.manual_seed(0)
    return HFCheckpointer(None, model_family="llama3").save(
        llama3_demo(max_seq_len=64), tmp_path_factory.mktemp("base") / "base"
    )


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_generate_with_an_adapter_on_the_plain_config_replies_as_the_merged_model(
    demo_base, use_dora, tmp_path, capsys, monkeypatch
):
    # A LoRA/DoRA demo model with known adapters, exported as the lora_finetune recipe exports its result: the PEFT
    # adapter, and the base with the adapters merged in (final/adapter, final/merged).
    model = lora_llama3_demo(
        max_seq_len=64, lora_attn_modules=["q_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True,
        apply_lora_to_output=True, lora_rank=4, lora_alpha=8, use_dora=use_dora,
    )
    HFCheckpointer(str(demo_base), model_family="llama3").load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.add_(0.5 * torch.randn(param.shape, generator=gen))
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family="llama3")
    merged = HFCheckpointer(None, model_family="llama3").save(
        model, tmp_path / "merged", state_dict=get_merged_state_dict(model)
    )

    replies = []

    def recording_generate(*args, **kwargs) -> list[int]:
        replies.append(generate(*args, **kwargs))
        return replies[-1]

    # The recipe's reply as tokens (a random base answers bytes that print alike, as replacement characters).
    monkeypatch.setattr(toolkit.generation, "generate", recording_generate)

    def reply(*overrides: str) -> tuple[list[int], str]:
        run_recipe_here("generate", "demo", "prompt=reverse: hello", "max_new_tokens=16", *overrides)
        return replies[-1], capsys.readouterr().out

    # The demo config's plain `model` (llama3_demo): the LoRA model is built from adapter_config.json.
    adapted = reply(f"checkpointer.checkpoint_dir={demo_base}", f"adapter_dir={adapter}")
    # Greedy decoding of W x + s B A x and of the merged (W + s B A) x: logits ~1e-7 apart (float32 rounding), so
    # the same argmax at every step.
    assert adapted == reply(f"checkpointer.checkpoint_dir={merged}")
    assert len(adapted[0]) == 16 and adapted[1].strip()
    assert adapted[0] != reply(f"checkpointer.checkpoint_dir={demo_base}")[0], "the adapter changes the reply"


def test_generation_past_longropes_original_context_rotates_every_key_with_the_long_factors(monkeypatch):
    # transformers encodes the whole sequence again once the first position past the original context comes; the
    # cached keys rotated with the short factors would otherwise stay. Each step's logits equal the full forward's.
    from toolkit.models.phi3 import phi3
    from toolkit.modules import LongRopeScaling

    torch.manual_seed(0)
    scaling = LongRopeScaling(short_factor=(1.0, 1.2, 1.5), long_factor=(2.0, 5.0, 9.0),
                              original_max_position_embeddings=8, factor=4.0)
    model = phi3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32,
                 intermediate_dim=64, max_seq_len=32, partial_rotary_factor=0.75, rope_scaling=scaling).eval()
    seen = []

    def greedy(logits, **_):
        seen.append(logits)
        return int(logits.argmax())

    monkeypatch.setattr(toolkit.generation, "sample_next_token", greedy)
    prompt = [1, 2, 3, 4, 5]
    generated = generate(model, prompt, max_new_tokens=10)
    assert len(generated) == 10 and len(prompt) + len(generated) > 8 + 1
    with torch.no_grad():
        for step, logits in enumerate(seen):
            full = model(torch.tensor([prompt + generated[:step]]))[0, -1]
            torch.testing.assert_close(logits, full, atol=1e-5, rtol=0, msg=f"step {step}")
