"""Activation checkpointing of every k-th layer and activation offloading: the same losses and gradients as
without them, the right layers wrapped, the tensors really moved, and in-place modification still caught.

Offloading is tested on the CPU with the offloader's CPU target (a synchronous copy into separate host tensors:
the same bookkeeping as on CUDA without the streams); the peak-memory test needs a GPU."""

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from tests.launch import run_workers
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_1_8b, llama3_demo, lora_llama3_demo, qlora_llama3_demo
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.training.activations import (
    ActivationOffloader,
    apply_activation_checkpointing,
    apply_activation_offloading,
    checkpoint_interval,
)
from toolkit.training.compile import _missing_compiler, compile_model
from toolkit.modules.loss import chunked_cross_entropy_sum, cross_entropy_sum
from toolkit.planning.memory import activation_bytes, offloaded_activation_bytes

CPU = torch.device("cpu")
BATCH, SEQ, VOCAB = 2, 64, 384


def full_model() -> nn.Module:
    torch.manual_seed(0)
    return llama3_demo(max_seq_len=SEQ)


def lora_model(builder=lora_llama3_demo) -> nn.Module:
    torch.manual_seed(0)
    model = builder(
        max_seq_len=SEQ, lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True,
        lora_rank=4, lora_alpha=8, lora_dropout=0.1,  # dropout: its masks are saved too, and must replay
    )
    set_trainable_params(model, get_adapter_params(model))
    for name, param in model.named_parameters():  # B = 0 would make every base gradient path zero
        if "lora_b" in name:
            nn.init.normal_(param, std=0.02)
    return model


MODELS = {"full": full_model, "lora": lora_model, "qlora": lambda: lora_model(qlora_llama3_demo)}


def step(model: nn.Module, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward on a fixed batch: the loss and the trainable parameters' gradients."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    torch.manual_seed(2)  # the dropout masks
    logits = model(tokens, **kwargs)
    if isinstance(logits, list):  # chunked output
        loss = chunked_cross_entropy_sum(logits, tokens)
    else:
        loss = cross_entropy_sum(logits, tokens)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def assert_same_step(actual: tuple, expected: tuple) -> None:
    # Offloading copies values bit for bit and checkpointing recomputes the same kernels on the same inputs: fp32
    # results are identical, not merely close.
    assert torch.equal(actual[0], expected[0])
    assert len(actual[1]) == len(expected[1])
    for grad, reference in zip(actual[1], expected[1], strict=True):
        assert torch.equal(grad, reference)


# --- activation_checkpointing: false | true | k ------------------------------------------------------------------


@pytest.mark.parametrize("value, interval", [(False, 0), (True, 1), (1, 1), (2, 2), (7, 7)])
def test_checkpoint_interval_accepts_booleans_and_positive_integers(value, interval):
    assert checkpoint_interval(value) == interval


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", "true", None])
def test_checkpoint_interval_rejects_anything_else_naming_the_key(value):
    with pytest.raises(UserError, match=r"^activation_checkpointing: must be true .* got ") as error:
        checkpoint_interval(value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("k, wrapped", [(1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3]), (4, [0]), (9, [0])])
def test_every_k_th_layer_is_checkpointed(k, wrapped):
    model = full_model()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, every_k_layers=k)
    assert [i for i, layer in enumerate(model.layers) if "forward" in vars(layer)] == wrapped
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("k", [1, 2])
def test_checkpointing_every_k_layers_changes_no_loss_or_gradient(k):
    model = full_model()
    apply_activation_checkpointing(model, every_k_layers=k)
    assert_same_step(step(model), step(full_model()))


def test_checkpointing_every_k_layers_keeps_memory_between_none_and_every_layer():
    # The estimate for a real shape (meta device: nothing allocated).
    with torch.device("meta"):
        model = llama3_1_8b()
    kwargs = dict(micro_batch_size=1, seq_len=4096, dtype="bf16-mixed")
    estimates = [activation_bytes(model, activation_checkpointing=k, **kwargs) for k in (False, 4, 2, True)]
    assert estimates == sorted(estimates, reverse=True) and len(set(estimates)) == 4


# --- Offloading: the same step, the tensors moved --------------------------------------------------------------


def offloaded(model: nn.Module, *, checkpointing: int = 0) -> ActivationOffloader:
    """The recipe order: checkpointing, then offloading around it. Every size is offloaded (tiny model)."""
    if checkpointing:
        apply_activation_checkpointing(model, every_k_layers=checkpointing)
    offloader = ActivationOffloader(device=CPU, min_bytes=0)
    offloader.apply(model)
    return offloader


@pytest.mark.parametrize("checkpointing", [0, 1, 2], ids=["no_ac", "ac", "ac_every_2"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_offloading_changes_no_loss_or_gradient(kind, checkpointing):
    reference = MODELS[kind]()
    if checkpointing:
        apply_activation_checkpointing(reference, every_k_layers=checkpointing)
    model = MODELS[kind]()
    offloader = offloaded(model, checkpointing=checkpointing)
    assert_same_step(step(model), step(reference))
    assert offloader.bytes_offloaded > 0 and offloader.bytes_restored > 0


@pytest.mark.parametrize("checkpointing", [False, 1, 2], ids=["no_ac", "ac", "ac_every_2"])
def test_offloaded_bytes_are_what_the_layers_save(checkpointing):
    # Independent reference: the estimator's per-layer formula, checked against the tensors autograd keeps alive in
    # test_memory.py. In fp32 every tensor it counts is computed in the layer and offloaded, and a tensor saved
    # several times (a layer's input for q, k and v, through views of it) is copied once.
    model = full_model()
    offloader = offloaded(model, checkpointing=checkpointing)
    step(model)
    kwargs = dict(micro_batch_size=BATCH, seq_len=SEQ, dtype="fp32")
    assert offloader.bytes_offloaded == offloaded_activation_bytes(
        model, activation_checkpointing=checkpointing, **kwargs
    )
    # Backward used the last layer's tensors still on the device (their copies were not awaited: no next layer
    # started); every other layer's came back from host memory.
    layers = len(model.layers)
    last_checkpointed = checkpointing and (layers - 1) % checkpointing == 0
    last_layer = BATCH * SEQ * model.embed_tokens.embedding_dim * 4 if last_checkpointed else (
        offloaded_activation_bytes(model, **kwargs) // layers
    )
    assert offloader.bytes_restored == offloader.bytes_offloaded - last_layer


def test_offloading_composes_with_the_chunked_loss():
    reference = full_model()
    model = full_model()
    offloaded(model, checkpointing=1)
    assert_same_step(step(model, num_output_chunks=3), step(reference, num_output_chunks=3))


def test_offloading_composes_with_compile_applied_first():
    # The recipe order: compile_model, then parallelize (checkpointing, offloading). A counting backend runs the
    # captured graph eagerly, so the step must equal the plain one exactly; the layers ran compiled (one graph)
    # and the compiled layer's saved tensors went through the hooks.
    torch._dynamo.reset()
    counter = CompileCounter()
    model = full_model()
    compile_model(model, device=CPU, backend=counter)
    offloader = offloaded(model, checkpointing=2)
    try:
        assert_same_step(step(model), step(full_model()))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and counter.op_count > 0
    assert offloader.bytes_offloaded > 0 and offloader.bytes_restored > 0


@pytest.mark.slow  # inductor builds C++ for the layer: tens of seconds on 2 cores
@pytest.mark.skipif(_missing_compiler("cpu") is not None, reason="no C++ compiler for inductor")
def test_offloading_composes_with_inductor():
    torch._dynamo.reset()
    try:
        model = full_model()
        compile_model(model, device=CPU)
        offloader = offloaded(model, checkpointing=2)
        actual = step(model)
        torch._dynamo.reset()
        reference = full_model()
        compile_model(reference, device=CPU)
        apply_activation_checkpointing(reference, every_k_layers=2)
        assert_same_step(actual, step(reference))  # the same generated kernels on the same values
    finally:
        torch._dynamo.reset()
    assert offloader.bytes_restored > 0


def test_a_retained_graph_can_be_run_backward_twice():
    model = full_model()
    offloaded(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy_sum(model(tokens), tokens)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for param, once in zip(model.parameters(), first, strict=True):
        assert torch.equal(param.grad, 2 * once)


def test_no_grad_forward_saves_nothing():
    model = full_model()
    offloader = offloaded(model)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert offloader.bytes_offloaded == 0


# --- Views and in-place modification ----------------------------------------------------------------------------


class Layers(nn.Module):
    """A stack of arbitrary functions as decoder layers (what the offloader wraps, asking the model contract)."""

    def __init__(self, *fns) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Lambda(fn) for fn in fns)

    def decoder_layers(self) -> dict[str, nn.Module]:
        return {f"layers.{name}": layer for name, layer in self.layers.named_children()}

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    model(x).sum().backward()
    return x.grad


def test_views_are_restored_as_the_same_views():
    # Whole views (transposed, flattened) share their tensor's copy and are rebuilt from it with their strides;
    # partial views (a slice at an offset, a strided column) are copied on their own. Two layers: the first one's
    # tensors come back from host memory, the second's are still held when backward starts.
    def views(x):
        y = x.exp()  # saves y
        whole = y.t().sin() + y.reshape(-1).cos().reshape(6, 5).t()  # sin and cos save their (whole view) inputs
        part = y[1:, 2:].sin().sum() + y[:, 3].cos().sum() + y.narrow(0, 2, 3).sin().sum()  # partial views
        return whole.t() + part

    model = Layers(views, views)
    x = torch.randn(6, 5)
    expected = run(model, x)
    offloader = offloaded(model)
    assert torch.equal(run(model, x), expected)
    per_layer = 4 * (6 * 5 + 5 * 3 + 6 + 3 * 5)  # y once, then each partial view
    assert (offloader.bytes_offloaded, offloader.bytes_restored) == (2 * per_layer, per_layer)


def test_a_small_tensor_modified_in_place_still_raises_as_without_hooks():
    # Saved-tensor hooks turn autograd's version check off; the offloader redoes it for what it keeps in place.
    def modify(x):
        y = x.exp()
        out = y.sum()
        y.mul_(2)  # y was saved by exp
        return out

    model = Layers(modify)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, torch.randn(4))
    offloader = ActivationOffloader(device=CPU, min_bytes=1024)  # 16 bytes: kept on the device
    offloader.apply(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, torch.randn(4))
    assert offloader.bytes_offloaded == 0


def test_an_offloaded_tensor_modified_while_held_raises():
    # Modified before the next layer started: its copy could have been reading it (on a GPU), so it is refused.
    def save(x):
        return x.exp()  # saves its output, then the next layer modifies it in place before saving anything

    def modify_then_save(y):
        y = y.mul_(2)
        return y.sin()

    model = Layers(save, modify_then_save)
    offloaded(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, torch.randn(4, 4))


def test_an_offloaded_tensor_modified_after_its_copy_was_done_gives_the_right_gradient():
    # Once the copy is known to be done (here: when the next layer starts), backward uses the copy: the value the
    # tensor had when it was saved, which is the right one. Without the hooks autograd refuses instead.
    outputs = {}

    def first(x):
        outputs["first"] = y = x.exp()  # exp saves its output
        return y

    def third(z, modify: bool):
        out = z.cos()
        if modify:
            outputs["first"].mul_(0)  # after the first layer's copy was let go
        return out

    x = torch.randn(4, 4)
    expected = run(Layers(first, lambda y: (y + 1).sin(), lambda z: third(z, modify=False)), x)
    model = Layers(first, lambda y: (y + 1).sin(), lambda z: third(z, modify=True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, x)
    offloaded(model)
    assert torch.equal(run(model, x), expected)


# --- On the CPU the recipe switch is a notice, not hooks -----------------------------------------------------------


def test_apply_activation_offloading_on_the_cpu_logs_once_and_changes_nothing(caplog):
    model = full_model()
    with caplog.at_level(logging.WARNING, logger="toolkit.training.activations"):
        assert apply_activation_offloading(model, device=CPU) is None
    # That logger's records only: pytest 9's caplog also holds torch's own (non-propagating) loggers' records.
    assert [r.getMessage() for r in caplog.records if r.name == "toolkit.training.activations"] == [
        "activation_offloading: training runs on the CPU, whose memory is already the host's; ignored"
    ]
    assert all("forward" not in vars(layer) for layer in model.layers)


# --- With DDP and FSDP2 ---------------------------------------------------------------------------------------------


def test_offloading_under_ddp_and_fsdp2_changes_no_loss_or_gradient(tmp_path):
    out = tmp_path / "result.json"
    worker = Path(__file__).parent / "_offload_worker.py"
    result = run_workers(worker, str(out), timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert sorted(cases) == ["ddp", "ddp+ac", "zero3", "zero3+ac"]
    for name, ranks in cases.items():
        for rank in ranks:
            assert rank["same_loss"] and rank["same_grads"], (name, rank)
            assert rank["bytes_restored"] > 0, (name, rank)


# --- On a GPU: the memory really goes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloading_lowers_peak_gpu_memory_and_changes_no_gradient():
    from toolkit.models.llama3 import llama3

    device = torch.device("cuda")
    dims = dict(vocab_size=4096, num_layers=8, num_heads=8, num_kv_heads=4, embed_dim=1024, intermediate_dim=2816,
                max_seq_len=1024)
    batch, seq = 4, 1024

    def build() -> nn.Module:
        torch.manual_seed(0)
        return llama3(**dims).to(device)

    tokens = torch.randint(0, dims["vocab_size"], (batch, seq), device=device)

    def measured_step(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        cross_entropy_sum(model(tokens), tokens).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, [p.grad for p in model.parameters()]

    plain_peak, plain_grads = measured_step(build())
    model = build()
    offloader = apply_activation_offloading(model, device=device)
    peak, grads = measured_step(model)
    # The estimator's saving: all layers' activations on the device, against two layers' worth with offloading.
    kwargs = dict(micro_batch_size=batch, seq_len=seq, dtype="fp32")
    predicted = activation_bytes(model, **kwargs) - activation_bytes(model, activation_offloading=True, **kwargs)
    assert offloader.bytes_offloaded > 0 and offloader.bytes_restored > 0
    assert plain_peak - peak >= 0.7 * predicted, (plain_peak, peak, predicted)
    # The same values in fresh (differently aligned) memory can make cuBLAS pick another kernel: fp32 tolerance.
    for grad, reference in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)
