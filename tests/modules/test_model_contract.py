"""The model contract (toolkit.modules.contract): both decoders implement it, layers keep their names when a model
holds only some of them (a pipeline stage), the state-dict keys are the ones the list layout gave, the callers
work on a model whose parts sit elsewhere, and no module outside toolkit/models and toolkit/modules reads a
model's parts by attribute name."""

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from toolkit.models.llama3 import llama3
from toolkit.modules import DecoderLayers, DecoderModel, TransformerDecoder
from toolkit.parallel.tensor_parallel import split_modules
from toolkit.planning.activation_memory import activation_bytes
from toolkit.training.activations import apply_activation_checkpointing
from toolkit.training.compile import compile_model
from toolkit.training.profiling import flops_per_token

DIMS = dict(vocab_size=64, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=32)
CPU = torch.device("cpu")


def tiny(*, tied: bool = False) -> TransformerDecoder:
    torch.manual_seed(0)
    return llama3(**DIMS, tie_word_embeddings=tied)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


# --- Both decoders implement the contract ---------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_the_native_decoder_implements_the_contract(tied):
    model = tiny(tied=tied)
    assert isinstance(model, DecoderModel)
    layers = model.decoder_layers()
    assert list(layers) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(model.get_submodule(path) is layer for path, layer in layers.items())
    assert model.token_embedding() is model.embed_tokens and model.final_norm() is model.norm
    assert model.output_projection() is (None if tied else model.output)


def test_a_module_without_the_methods_is_not_a_decoder_model():
    assert not isinstance(nn.Linear(2, 2), DecoderModel)
    assert not isinstance(nn.ModuleDict({"layers": nn.ModuleList()}), DecoderModel)  # attributes are not the contract


@pytest.mark.parametrize("model_type, tied", [("olmo2", False), ("cohere", True)])
def test_the_transformers_backend_implements_the_contract(model_type, tied, tmp_path):
    pytest.importorskip("transformers")
    from tests.tiny_hf_models import save_tiny
    from toolkit.models.transformers_backend import from_folder

    model = from_folder(path=save_tiny(model_type, tmp_path))
    assert isinstance(model, DecoderModel)
    base = model.base
    layers = model.decoder_layers()
    assert list(layers) == ["model.layers.0", "model.layers.1"]  # transformers' names: the checkpoint's keys
    assert list(layers.values()) == list(base.layers)
    assert all(model.get_submodule(path) is layer for path, layer in layers.items())
    assert model.token_embedding() is base.get_input_embeddings()
    assert model.final_norm() is base.norm
    assert model.output_projection() is (None if tied else model.lm_head)
    # The losses reach the output weight through the contract too: the embedding's when tied.
    assert model.fused_loss_weight() is (model.token_embedding() if tied else model.lm_head).weight


# --- Layers keep their names when a model holds only some of them -------------------------------------------------


def test_a_stage_keeps_the_names_and_state_dict_keys_of_the_layers_it_holds():
    full = tiny()
    stage = copy.deepcopy(full)
    for key in ("0", "1"):  # a second pipeline stage: layers 2 and 3
        del stage.layers[key]
    assert list(stage.decoder_layers()) == ["layers.2", "layers.3"]
    assert len(stage.layers) == 2 and 2 in stage.layers and "0" not in stage.layers and 0 not in stage.layers
    held = [k for k in full.state_dict() if not k.startswith(("layers.0.", "layers.1."))]
    assert list(stage.state_dict()) == held
    # The whole model's checkpoint, less the other stage's layers, loads strictly: the same names.
    stage.load_state_dict({k: v for k, v in full.state_dict().items() if k in held})
    assert stage.layers[2] is stage.layers["2"] is stage.get_submodule("layers.2")
    with pytest.raises(KeyError, match=r"no decoder layer 0 here; this model holds layers 2, 3"):
        stage.layers[0]  # the name of a layer this stage does not hold, not its first layer


def test_a_stage_over_its_layers_continues_the_whole_model_bitwise():
    full = tiny().eval()
    stage = copy.deepcopy(full)
    for key in ("0", "1"):
        del stage.layers[key]
    x = tokens()
    with torch.no_grad():
        expected = full(x)
        h = full.embed_tokens(x)
        for layer in list(full.decoder_layers().values())[:2]:  # what the first stage would send
            h = layer(h)
        for layer in stage.decoder_layers().values():
            h = layer(h)
        assert torch.equal(stage.compute_logits(stage.final_norm()(h)), expected)
        # Its own forward runs too, over the layers it holds (from the embedding: this decoder takes no hidden
        # states as input yet).
        assert stage(x).shape == expected.shape


def test_a_stage_built_from_its_layers_by_index_has_the_whole_models_keys():
    full = tiny()
    held = {str(i): copy.deepcopy(layer) for i, layer in enumerate(full.layers) if i >= 2}
    stage = TransformerDecoder(embed_tokens=nn.Embedding(64, 32), layers=held, norm=nn.RMSNorm(32),
                               output=nn.Linear(32, 64, bias=False), max_seq_len=32)
    assert list(stage.decoder_layers()) == ["layers.2", "layers.3"]
    assert {k for k in stage.state_dict() if k.startswith("layers.")} == {
        k for k in full.state_dict() if k.startswith(("layers.2.", "layers.3."))
    }


@pytest.mark.parametrize("keys", [["1", "0"], ["2", "10", "9"], ["01"], ["-1"], ["a"], ["+1"], [" 1"]])
def test_layer_keys_must_be_ascending_indices(keys):
    with pytest.raises(ValueError, match="indices in the whole model, ascending"):
        DecoderLayers({key: nn.Identity() for key in keys})


def test_layers_iterate_in_order_and_replace_in_place():
    layers = [nn.Linear(2, 2) for _ in range(3)]
    container = DecoderLayers(layers)
    assert list(container) == layers and len(container) == 3
    assert [name for name, _ in container.named_children()] == ["0", "1", "2"]
    replacement = nn.Linear(2, 2)
    container[1] = replacement
    assert list(container) == [layers[0], replacement, layers[2]]  # its place kept
    with pytest.raises(KeyError):
        container["3"] = nn.Linear(2, 2)  # a model is not grown layer by layer
    with pytest.raises(KeyError):
        container[True]  # a bool is not an index


def test_a_layer_replaced_by_checkpoint_wrapper_keeps_its_place_keys_and_numbers():
    plain, wrapped = tiny(), tiny()
    keys = list(plain.state_dict())
    for path, layer in wrapped.decoder_layers().items():
        wrapped.set_submodule(path, checkpoint_wrapper(layer))
    assert list(wrapped.decoder_layers()) == list(plain.decoder_layers())
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in wrapped.decoder_layers().values())
    assert list(wrapped.state_dict()) == keys
    x, labels = tokens(1), tokens(2)
    losses = [model(x, labels=labels) for model in (plain, wrapped)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    grads = [{k: p.grad for k, p in model.state_dict(keep_vars=True).items()} for model in (plain, wrapped)]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in keys)


# --- The state-dict keys are the list layout's ------------------------------------------------------------------------

LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight",  # FeedForward registers them so
    "input_layernorm.weight", "post_attention_layernorm.weight",
]


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_keys_are_exactly_the_previous_layouts(tied):
    model = tiny(tied=tied)
    expected = [
        "embed_tokens.weight",
        *(f"layers.{i}.{key}" for i in range(DIMS["num_layers"]) for key in LAYER_KEYS),
        "norm.weight",
        *([] if tied else ["output.weight"]),
    ]
    assert list(model.state_dict()) == expected

    class ListLayout(nn.Module):  # the decoder as it was laid out before DecoderLayers: a ModuleList
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.layers = model.embed_tokens, nn.ModuleList(model.layers)
            self.norm, self.output = model.norm, model.output

    assert list(ListLayout().state_dict()) == expected


# --- Callers work on a model whose parts are not where TransformerDecoder keeps them -------------------------------


class FeaturesThenDecoder(nn.Module):
    """A toy model with an encoder in front of the decoder (a projector of features into the decoder's width, as a
    vision-language model has): its decoder's parts are under ``language_model.``, which it says through the
    contract."""

    def __init__(self, decoder: TransformerDecoder, *, feature_dim: int) -> None:
        super().__init__()
        self.projector = nn.Linear(feature_dim, decoder.token_embedding().embedding_dim, bias=False)
        self.language_model = decoder

    def decoder_layers(self) -> dict[str, nn.Module]:
        return {f"language_model.{path}": layer for path, layer in self.language_model.decoder_layers().items()}

    def token_embedding(self) -> nn.Embedding:
        return self.language_model.token_embedding()

    def final_norm(self) -> nn.Module:
        return self.language_model.final_norm()

    def output_projection(self) -> nn.Module | None:
        return self.language_model.output_projection()


def test_callers_find_the_parts_of_a_model_with_an_encoder_in_front():
    decoder = tiny()
    model = FeaturesThenDecoder(decoder, feature_dim=8)
    assert isinstance(model, DecoderModel)
    assert all(model.get_submodule(path) is layer for path, layer in model.decoder_layers().items())
    # The tensor-parallel plan, the activation memory and the FLOP count see the decoder's parts, whatever their path;
    # the projector's matmul is counted, the embedding (a lookup) is not.
    assert [(id(m), plan) for m, plan in split_modules(model)] == [(id(m), plan) for m, plan in split_modules(decoder)]
    kwargs = dict(micro_batch_size=2, seq_len=16, dtype="fp32")
    assert activation_bytes(model, **kwargs) == activation_bytes(decoder, **kwargs)
    assert flops_per_token(model, seq_len=16) - flops_per_token(decoder, seq_len=16) == 6 * 8 * 32
    # Activation checkpointing and compile wrap the decoder's layers in place.
    apply_activation_checkpointing(model, every_k_layers=2)
    assert ["forward" in vars(layer) for layer in decoder.layers] == [True, False, True, False]
    compile_model(model, device=CPU, backend=CompileCounter())
    assert all("forward" in vars(layer) for layer in decoder.layers)


# --- Nothing outside models/ and modules/ reads a model's parts by name ---------------------------------------------

TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"
PARTS = {"layers", "embed_tokens", "norm", "output"}
# Reads of these names that are not a model's parts, by file and expression, each with why.
UNRELATED = {
    ("cli/plot.py", "args.output"),  # argparse's --output
    ("cli/export.py", "args.output"),  # argparse's --output
    ("cli/merge.py", "args.output"),  # argparse's --output
    ("parallel/tensor_parallel.py", "split.output"),  # a _Split plan's output placement
    ("optim/muon.py", "x.norm"),  # a tensor's Frobenius norm, x.norm()
}


def part_reads(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every read of a model part's name in ``source``: an attribute (``model.layers``) or
    a name given to ``getattr``, ``hasattr``, ``setattr`` or ``delattr`` (``getattr(model, "output", None)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in PARTS:
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PARTS):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_part_reads_finds_attributes_and_getattr_names():
    source = "a = model.layers[0]\nb = getattr(m, 'output', None)\nc = m.embed_tokens.weight\nd = m.norm\ne = m.out"
    assert [line for line, _ in part_reads(source)] == [1, 2, 3, 4]


def test_no_caller_outside_models_and_modules_reads_a_models_parts_by_name():
    reads, unrelated_seen = [], set()
    for file in sorted(TOOLKIT.rglob("*.py")):
        relative = file.relative_to(TOOLKIT).as_posix()
        if relative.startswith(("models/", "modules/")):
            continue
        for line, expression in part_reads(file.read_text()):
            if (relative, expression) in UNRELATED:
                unrelated_seen.add((relative, expression))
            else:
                reads.append(f"toolkit/{relative}:{line}: {expression}")
    assert not reads, (
        "ask the model through its contract (toolkit.modules.contract.DecoderModel: decoder_layers(), "
        "token_embedding(), final_norm(), output_projection()) instead of reading these by name; if one is not a "
        f"model's part, add it to UNRELATED with why: {reads}"
    )
    assert unrelated_seen == UNRELATED, f"UNRELATED entries no longer in the code: {UNRELATED - unrelated_seen}"
