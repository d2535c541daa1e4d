"""The transformers backend (toolkit.models.transformers_backend) against `transformers` and `peft` themselves, on
tiny random checkpoints of seven architectures without a native family: logits, the engine's losses (fused and
chunked), packed rows, the Hugging Face export and PEFT adapters; and the refusals."""

import json
from pathlib import Path

import pytest
import torch

from tests.tiny_hf_models import ARCHITECTURES, ATTENTION_NAMES, save_tiny
from toolkit.data.packing import packed_attention_mask
from toolkit.errors import UserError
from toolkit.models import build_from_hf, lora_build_from_hf, read_hf_config
from toolkit.models.transformers_backend import TransformersDecoder, from_folder
from toolkit.modules.peft import init_adapters
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer
from toolkit.training.init import materialize
from toolkit.checkpoint.peft import save_peft_adapter

transformers = pytest.importorskip("transformers")

ARCHS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {model_type: save_tiny(model_type, root / model_type) for model_type in ARCHS}


def _hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ARCHS)
def test_logits_losses_and_packed_rows_match_transformers(model_type, folders):
    folder = folders[model_type]
    assert read_hf_config(folder)[1] == "transformers_backend"
    ours, hf = from_pretrained(folder).eval(), _hf(folder)
    assert isinstance(ours, TransformersDecoder)
    assert set(ours.state_dict()) <= set(hf.state_dict()), "the checkpoint's own names"
    torch.manual_seed(0)
    tokens = torch.randint(1, 400, (2, 16))
    labels = torch.randint(1, 400, (2, 16))
    labels[0, :3] = -100
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)
        reference = torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="sum")
        for fused in (True, False):
            loss = ours(tokens, labels=labels, fused_loss=fused, num_output_chunks=3)
            torch.testing.assert_close(loss, reference, atol=1e-4, rtol=1e-6)
        # Two documents packed in each row: the second attends only to itself, from position 0.
        input_pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
        packed = ours(tokens, mask=packed_attention_mask(input_pos), input_pos=input_pos)
        torch.testing.assert_close(packed[:, 6:], hf(tokens[:, 6:]).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ARCHS)
def test_hf_export_loads_in_transformers(model_type, folders, tmp_path):
    ours = from_pretrained(folders[model_type]).eval()
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(0.01 * torch.randn_like(param))  # trained: not the source's weights
    out = HFCheckpointer(str(folders[model_type]), model_family="transformers_backend").save(ours, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    tokens = torch.randint(1, 400, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(_hf(out)(tokens).logits, ours(tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_by_target_names_loads_in_peft(model_type, use_dora, folders, tmp_path):
    peft = pytest.importorskip("peft")
    folder = folders[model_type]
    targets = ATTENTION_NAMES.get(model_type, ["q_proj", "v_proj"])
    with torch.device("meta"):
        ours = lora_build_from_hf(path=folder, lora_attn_modules=[], lora_target_modules=targets, lora_rank=4,
                                  lora_alpha=8, use_dora=use_dora)
    materialize(ours, device=torch.device("cpu"))
    HFCheckpointer(str(folder), model_family="transformers_backend").load(ours, ignore_missing=lambda k: "lora_" in k
                                                                          or k.endswith("magnitude"))
    init_adapters(ours)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_b" in name or name.endswith("magnitude"):
                param.add_(0.1 * torch.randn_like(param))  # trained adapters, not the identity
    ours.eval()
    adapter = save_peft_adapter(ours, tmp_path / "adapter", model_family="transformers_backend",
                                base_model_name_or_path=str(folder))
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
    loaded = peft.PeftModel.from_pretrained(_hf(folder), str(adapter)).eval()
    tokens = torch.randint(1, 400, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, ours(tokens), atol=1e-4, rtol=0)


def test_llama_backend_equals_native_family(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama", num_key_value_heads=2, tie_word_embeddings=False)
    native = from_pretrained(folder).eval()
    with torch.device("meta"):
        backend = from_folder(path=folder)
    materialize(backend, device=torch.device("cpu"))
    HFCheckpointer(str(folder), model_family="transformers_backend").load(backend)
    assert not isinstance(native, TransformersDecoder)
    tokens, labels = torch.randint(1, 400, (2, 16)), torch.randint(1, 400, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(backend.eval()(tokens, labels=labels), native(tokens, labels=labels),
                                   atol=1e-5, rtol=1e-6)


def test_tied_embeddings_stay_one_parameter(folders):
    ours = from_pretrained(folders["cohere"])
    assert ours.output_projection() is None and "lm_head.weight" not in ours.state_dict()
    assert ours.fused_loss_weight() is ours.token_embedding().weight
    with pytest.raises(UserError, match="the transformers backend does not generate"):
        ours.setup_caches(batch_size=1)


def _folder_with(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_refusals(folders, tmp_path):
    with pytest.raises(UserError, match=r"lora_target_modules: \['qkv'\] match no linear layer.*query_key_value"):
        with torch.device("meta"):
            lora_build_from_hf(path=folders["persimmon"], lora_attn_modules=[], lora_target_modules=["qkv"])
    with pytest.raises(UserError, match="'not_a_model' is not supported: no native family"):
        read_hf_config(_folder_with(tmp_path / "unknown", {"model_type": "not_a_model"}))
    remote = _folder_with(tmp_path / "remote", {
        "model_type": "my_model", "auto_map": {"AutoModelForCausalLM": "modeling_my.MyForCausalLM"},
    })
    with pytest.raises(UserError, match="auto_map.*set model.trust_remote_code=true only if you trust"):
        build_from_hf(path=remote)
    # Remote code allowed but its files are absent: transformers cannot build it offline; one line.
    with pytest.raises(UserError, match="transformers cannot build this model offline"):
        build_from_hf(path=remote, trust_remote_code=True)
    neox = save_tiny("gpt_neox", tmp_path / "neox")
    with pytest.raises(UserError, match="stores weights under other names"):
        with torch.device("meta"):
            build_from_hf(path=neox)
