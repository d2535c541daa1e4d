"""One config for any checkpoint: `any_model` builds the architecture, weight names and tokenizer from a Hugging
Face folder (here a tiny Qwen2 that `transformers` writes, with a BPE tokenizer the test trains)."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.launch import run_tune
from tests.tiny_tokenizer import chatml_byte_level_bpe

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FAST = [
    "max_steps=3", "dataset.num_samples=64", "batch_size=8", "micro_batch_size=4", "data_parallel=ddp",
    "progress_bar=false", "~eval_tasks", "save_every_n_steps=null", "dtype=fp32", "max_seq_len=64",
]


tune = partial(run_tune, timeout_s=300, check=True)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = chatml_byte_level_bpe(["reverse: abcd dcba", "upper: word WORD", "sort: dcba abcd"] * 50, vocab_size=400)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_full_finetune_of_any_checkpoint(qwen_folder, tmp_path):
    tune("run", "full_finetune_single_device", "--config", "any_model", f"output_dir={tmp_path}",
         f"checkpointer.checkpoint_dir={qwen_folder}", *FAST)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 2
    assert (tmp_path / "final" / "tokenizer.json").is_file(), "the tokenizer files travel with the export"
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # loads back


@pytest.mark.parametrize("config", ["any_model_lora", "any_model_qlora"])
def test_lora_and_qlora_of_any_checkpoint(config, qwen_folder, tmp_path):
    tune("run", "lora_finetune_single_device", "--config", config, f"output_dir={tmp_path}",
         f"checkpointer.checkpoint_dir={qwen_folder}", "save_merged=false", *FAST)
    adapter = json.loads((tmp_path / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(qwen_folder) and "q_proj" in adapter["target_modules"]


def test_any_model_trains_an_architecture_without_a_family_through_the_backend(tmp_path):
    from tests.tiny_hf_models import save_tiny

    folder = save_tiny("olmo2", tmp_path / "olmo2")
    base = [f"output_dir={tmp_path / 'out'}", f"checkpointer.checkpoint_dir={folder}", *FAST, "max_seq_len=128"]
    # The model comes from transformers; the tokenizer is not guessed for a model_type we do not know.
    refused = run_tune("run", "full_finetune_single_device", "--config", "any_model", *base, timeout_s=300)
    assert refused.returncode == 2 and "no tokenizer for model_type 'olmo2'" in refused.stderr
    result = tune("run", "full_finetune_single_device", "--config", "any_model", *base,
                  "tokenizer._component_=toolkit.tokenizers.qwen2_5_tokenizer",
                  f"tokenizer.path={folder}/tokenizer.json")
    assert "model_type 'olmo2': no native family; built by the transformers backend" in result.stderr
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")  # loads back
