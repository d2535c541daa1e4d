"""Gemma 3 through the recipes' `any_model` configs, on a tiny multimodal `Gemma3ForConditionalGeneration` that
`transformers` writes (vision tower included), with a Gemma-style sentencepiece tokenizer the test trains: a full
fine-tune and a LoRA run train the language model (finite, falling loss), say in one line that the vision tensors
are skipped, and export text-only folders that `transformers` and `peft` load; `tune merge` merges the adapter into
the multimodal base; tensor parallelism over two processes trains as one process does; a checkpoint with a feature
the builder does not compute stops in one line before anything is written."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run_tune, run_tune_here
from tests.recipes._tiny_checkpoint import FAST, check_trained, losses, refusal
from tests.tiny_tokenizer import gemma_sentencepiece
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer

transformers = pytest.importorskip("transformers")
tune = partial(run_tune_here, "run")

TEXT = dict(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, query_pre_attn_scalar=8, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], rope_scaling={"rope_type": "linear", "factor": 8.0},
)
VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_gemma3")
    gemma_sentencepiece(["reverse: abcd dcba", "upper: word WORD", "sort: dcba abcd"] * 50,
                        folder / "tokenizer.model", vocab_size=300)
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _check_skipped_vision(stderr: str, folder: Path) -> None:
    vision = [key for key in load_file(folder / "model.safetensors") if "vision_tower" in key or "projector" in key]
    assert f"skipped {len(vision)} tensors the gemma3 model does not use" in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(gemma3_folder, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gemma3_one")
    result = tune("full_finetune_single_device", "--config", "any_model", f"output_dir={out}",
                  f"checkpointer.checkpoint_dir={gemma3_folder}", "optimizer.lr=1e-3", *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stderr


def test_full_finetune_trains_the_language_model_and_exports_it_text_only(gemma3_folder, one_process):
    out, stderr = one_process
    check_trained(out)
    _check_skipped_vision(stderr, gemma3_folder)
    final = out / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "gemma3_text"
    assert (final / "tokenizer.model").is_file()
    exported = load_file(final / "model.safetensors")
    assert not any("vision" in key for key in exported)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert not torch.equal(reloaded.model.layers[0].self_attn.q_norm.weight, torch.zeros(8))  # trained


def test_tensor_parallel_trains_like_one_process(gemma3_folder, one_process, tmp_path):
    # The q/k norms and both rotary embeddings act per head, so each rank computes its heads as one process does.
    run_tune("run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "any_model",
             f"output_dir={tmp_path}", f"checkpointer.checkpoint_dir={gemma3_folder}", "optimizer.lr=1e-3", *FAST,
             "tensor_parallel=2", timeout_s=300, check=True)
    torch.testing.assert_close(losses(tmp_path), losses(one_process[0]), rtol=1e-5, atol=0)
    ours, reference = (load_file(out / "final" / "model.safetensors") for out in (tmp_path, one_process[0]))
    assert ours.keys() == reference.keys()
    for key, weight in reference.items():
        torch.testing.assert_close(ours[key], weight, rtol=1e-5, atol=1e-6, msg=key)


def test_lora_trains_and_peft_loads_its_adapter_onto_the_text_model(gemma3_folder, tmp_path):
    peft = pytest.importorskip("peft")
    result = tune("lora_finetune_single_device", "--config", "any_model_lora", f"output_dir={tmp_path / 'run'}",
                  f"checkpointer.checkpoint_dir={gemma3_folder}", "save_merged=true", "optimizer.lr=1e-2",
                  "model.lora_attn_modules=[q_proj,k_proj,v_proj,o_proj]", "model.apply_lora_to_mlp=true", *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    check_trained(tmp_path / "run")
    _check_skipped_vision(result.stderr, gemma3_folder)
    # The adapter names the text-only layout: it applies to the base's language model exported as Gemma3ForCausalLM.
    text_base = HFCheckpointer(str(gemma3_folder), model_family="auto").save(
        from_pretrained(gemma3_folder), tmp_path / "text_base"
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(text_base, dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final" / "merged",
                                                              dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged(tokens).logits
        assert (expected - base(tokens).logits).abs().max() > 1e-2  # the adapters matter
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "final" / "adapter").eval()
        torch.testing.assert_close(theirs(tokens).logits, expected, atol=1e-4, rtol=0)
    # tune merge into the multimodal base itself: its language model becomes the merged one, the vision tower stays.
    merged_here = tmp_path / "multimodal_merged"
    result = run_tune_here("merge", "--base", str(gemma3_folder), "--adapter",
                           str(tmp_path / "run" / "final" / "adapter"), "--output", str(merged_here))
    assert result.returncode == 0, result.stderr[-3000:]
    multimodal = transformers.Gemma3ForConditionalGeneration.from_pretrained(merged_here, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(multimodal(input_ids=tokens).logits, expected, atol=1e-4, rtol=0)
    assert load_file(merged_here / "model.safetensors").keys() == load_file(gemma3_folder / "model.safetensors").keys()


def test_a_gemma3_feature_we_do_not_compute_stops_in_one_line(gemma3_folder, tmp_path):
    # EmbeddingGemma's bidirectional attention, in a multimodal checkpoint's text_config.
    line = refusal(gemma3_folder, ("tokenizer.model", "model.safetensors"),
                   lambda config: config["text_config"].update(use_bidirectional_attention=True), tmp_path)
    assert "use_bidirectional_attention True is not supported" in line, line
