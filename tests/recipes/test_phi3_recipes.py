"""Phi-4 and Phi-4-mini (the Phi-3 architecture) through the recipes' `any_model` configs, on tiny
`Phi3ForCausalLM`s that `transformers` writes, with Phi-4-style BPE tokenizers the test trains: a full fine-tune and
LoRA runs train (finite, falling loss) and export what `transformers` and `peft` load; a checkpoint with a feature
the builder does not compute stops in one line before anything is written."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run_tune, run_tune_here
from tests.recipes._tiny_checkpoint import FAST, STEPS, check_trained, losses, refusal
from tests.tiny_tokenizer import PHI4_MINI_SPECIALS, PHI4_SPECIALS, chatml_byte_level_bpe

transformers = pytest.importorskip("transformers")
tune = partial(run_tune_here, "run")


def tiny_phi3_folder(folder: Path, special_tokens: tuple[str, ...], **fields) -> Path:
    """A tiny ``Phi3ForCausalLM`` that transformers writes to ``folder``, with a BPE tokenizer trained around
    ``special_tokens``; ``fields`` change its config."""
    texts = ["reverse: abcd dcba", "upper: word WORD", "sort: dcba abcd"] * 50
    tokenizer = chatml_byte_level_bpe(texts, vocab_size=400, special_tokens=special_tokens)
    tokenizer.save(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= 320  # the embedding has rows to spare (as Phi-4's), and splits in two
    config = transformers.Phi3Config(**{
        "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rope_theta": 250_000.0,
        "bos_token_id": 0, "eos_token_id": 3, "pad_token_id": 0, "tie_word_embeddings": False, **fields,
    })
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def phi_folder(tmp_path_factory) -> Path:
    return tiny_phi3_folder(tmp_path_factory.mktemp("tiny_phi3"), PHI4_SPECIALS)


@pytest.fixture(scope="module")
def mini_folder(tmp_path_factory) -> Path:
    # Phi-4-mini's shape: 6 of each head's 8 features rotated, LongRoPE over 32 tokens of original context (of 128),
    # tied embeddings.
    factors = torch.linspace(1.0, 4.0, 3).tolist()
    return tiny_phi3_folder(
        tmp_path_factory.mktemp("tiny_phi4_mini"), PHI4_MINI_SPECIALS, tie_word_embeddings=True,
        partial_rotary_factor=0.75, original_max_position_embeddings=32,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 1.5], "long_factor": factors},
    )


@pytest.fixture(scope="module")
def one_process(phi_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("phi3_one")
    result = tune("full_finetune_single_device", "--config", "any_model", f"output_dir={out}",
                  f"checkpointer.checkpoint_dir={phi_folder}", "optimizer.lr=1e-3", *FAST,
                  f"save_every_n_steps={STEPS}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_full_finetune_trains_and_exports_the_fused_layout(phi_folder, one_process, tmp_path):
    check_trained(one_process)
    final = one_process / "final"
    # tune export joins the step checkpoint's q/k/v and gate/up (read back from its shards) as the run's export did.
    exported = run_tune_here("export", str(one_process / "checkpoints" / f"step_{STEPS}"), "--output",
                             str(tmp_path / "x"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    ours, theirs = load_file(tmp_path / "x" / "model.safetensors"), load_file(final / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert json.loads((final / "config.json").read_text())["model_type"] == "phi3"
    original, exported = load_file(phi_folder / "model.safetensors"), load_file(final / "model.safetensors")
    assert exported.keys() == original.keys()  # qkv_proj and gate_up_proj, as transformers writes them
    assert not torch.equal(exported["model.layers.0.self_attn.qkv_proj.weight"],
                           original["model.layers.0.self_attn.qkv_proj.weight"])  # trained
    transformers.AutoModelForCausalLM.from_pretrained(final)  # loads back


LORA = [
    "save_merged=true", "optimizer.lr=1e-2", "model.lora_attn_modules=[q_proj,k_proj,v_proj,o_proj]",
    "model.apply_lora_to_mlp=true", *FAST,
]


@pytest.fixture(scope="module")
def lora_one_process(phi_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("phi3_lora_one")
    result = tune("lora_finetune_single_device", "--config", "any_model_lora", f"output_dir={out}",
                  f"checkpointer.checkpoint_dir={phi_folder}", *LORA)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_lora_trains_and_peft_loads_its_adapter_as_the_merged_model(phi_folder, lora_one_process):
    peft = pytest.importorskip("peft")
    tmp_path = lora_one_process
    check_trained(tmp_path)
    adapter = tmp_path / "final" / "adapter"
    assert set(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == {
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj",
    }
    base = transformers.AutoModelForCausalLM.from_pretrained(phi_folder, dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged", dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, merged.eval()(tokens).logits, atol=1e-4, rtol=0)


def test_phi4_mini_lora_trains_and_peft_loads_its_adapter_as_the_merged_model(mini_folder, tmp_path):
    peft = pytest.importorskip("peft")
    result = tune("lora_finetune_single_device", "--config", "any_model_lora", f"output_dir={tmp_path}",
                  f"checkpointer.checkpoint_dir={mini_folder}", *LORA)
    assert result.returncode == 0, result.stderr[-3000:]
    check_trained(tmp_path)
    merged_dir = tmp_path / "final" / "merged"
    assert json.loads((merged_dir / "config.json").read_text())["rope_scaling"]["long_factor"] == torch.linspace(
        1.0, 4.0, 3).tolist()
    base = transformers.AutoModelForCausalLM.from_pretrained(mini_folder, dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "final" / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))  # past the original 32
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, merged(tokens).logits, atol=1e-4, rtol=0)


def test_a_phi3_feature_we_do_not_compute_stops_in_one_line(phi_folder, tmp_path):
    # Phi-3-mini 4k's sliding window (2047 of its 4096 tokens), scaled to the tiny model's context.
    line = refusal(phi_folder, ("tokenizer.json", "model.safetensors"),
                   lambda config: config.update(sliding_window=32), tmp_path)
    assert "sliding_window 32 is not supported for phi3" in line, line


def test_tensor_parallel_splits_the_projections_and_exports_them_joined(phi_folder, one_process, tmp_path):
    # Our q/k/v and gate/up are separate, so tensor parallelism splits them as in every family; the export writes
    # each fused tensor from the processes' shards. fp32 on CPU: the layouts differ only in the order of float sums.
    run_tune("run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "any_model",
             f"output_dir={tmp_path}", f"checkpointer.checkpoint_dir={phi_folder}", "optimizer.lr=1e-3", *FAST,
             "tensor_parallel=2", timeout_s=300, check=True)
    torch.testing.assert_close(losses(tmp_path), losses(one_process), rtol=1e-5, atol=0)
    ours, reference = load_file(tmp_path / "final" / "model.safetensors"), load_file(
        one_process / "final" / "model.safetensors"
    )
    assert ours.keys() == reference.keys()
    for key, weight in reference.items():
        torch.testing.assert_close(ours[key], weight, rtol=1e-5, atol=1e-6, msg=key)


def test_lora_under_zero3_writes_the_one_process_adapter(phi_folder, lora_one_process, tmp_path):
    # Each rank's shards of the adapters gathered and fused as one process fuses them (fp32, float rounding apart).
    run_tune("run", "--nproc_per_node", "2", "lora_finetune_distributed", "--config", "any_model_lora",
             f"output_dir={tmp_path}", f"checkpointer.checkpoint_dir={phi_folder}", *LORA, "data_parallel=zero3",
             timeout_s=300, check=True)
    for name in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):
        ours, reference = load_file(tmp_path / "final" / name), load_file(lora_one_process / "final" / name)
        assert ours.keys() == reference.keys()
        for key, tensor in reference.items():
            torch.testing.assert_close(ours[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
