"""QLoRA on mixture-of-experts models: the experts stored in NF4, one quantization per expert (`NF4Stack`).

The reference for every value is torchao's own NF4 (`to_nf4` of one expert's matrix, dequantized by torchao): our
stacked dequantization must give those values bit for bit, so a QLoRA model of Mixtral or Qwen3-MoE computes exactly
what the plain model computes with every quantized matrix replaced by torchao's round trip of it (logits and adapter
gradients equal to float rounding of the same operations: bitwise here). Memory: between the forward and the backward
only the 4-bit codes and the scales are kept, never a full-precision stack.
"""

import pytest
import torch
from torch import nn

from tests.models.test_moe_families import FAMILIES, tiny
from toolkit.errors import UserError
from toolkit.models.mixtral import lora_mixtral, qlora_mixtral_8x7b, qlora_mixtral_8x22b
from toolkit.models.qwen3_moe import lora_qwen3_moe, qlora_qwen3_moe_30b_a3b, qlora_qwen3_moe_235b_a22b
from toolkit.modules.moe import grouped_mm
from toolkit.modules.peft import (
    LoRAGroupedExperts,
    NF4Stack,
    dequantize,
    get_adapter_params,
    get_merged_state_dict,
    has_nf4,
    init_adapters,
    is_adapter_key,
    is_nf4,
    merge_lora_weights,
    nf4_stacks,
    set_trainable_params,
    to_nf4,
)
from toolkit.modules.peft.nf4_experts import NF4_LEVELS
from toolkit.training import HFCheckpointer
from toolkit.training.init import init_weights, materialize

LORA = dict(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_experts=True, lora_rank=4, lora_alpha=8)


def round_trip(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 round trip of a matrix, or of each matrix of a stack."""
    if weight.dim() == 3:
        return torch.stack([dequantize(to_nf4(matrix)) for matrix in weight])
    return dequantize(to_nf4(weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_dequantizes_to_torchaos_values_bit_for_bit(dtype):
    torch.manual_seed(0)
    weights = torch.randn(5, 48, 64, dtype=dtype) * torch.linspace(0.1, 3, 5, dtype=dtype).view(5, 1, 1)
    stack = NF4Stack(5, 48, 64, dtype=dtype)
    stack.quantize_all_(weights)
    assert torch.equal(stack.dequantize(), round_trip(weights))
    assert stack.dequantize().dtype == dtype
    # 4 bits a value, plus an int8 scale per 64 values and a little per expert.
    stored = sum(p.numel() * p.element_size() for p in stack.parameters())
    assert stored < weights.numel() * (0.5 + 1 / 64) + 5 * 64


def test_the_levels_are_torchaos():
    assert torch.equal(torch.tensor(NF4_LEVELS), to_nf4(torch.randn(64, 64)).nf4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_matmul_and_its_input_gradient_are_those_of_the_dequantized_stack(dtype):
    torch.manual_seed(0)
    stack = NF4Stack(4, 32, 64, dtype=dtype)
    stack.quantize_all_(torch.randn(4, 32, 64))
    counts = torch.tensor([3, 0, 6, 2])  # an expert without tokens too
    x = torch.randn(11, 64, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(11, 32, dtype=dtype)
    stack(x, counts).backward(grad)
    expected = grouped_mm(x_ref, stack.dequantize(), counts)
    expected.backward(grad)
    assert torch.equal(stack(x, counts), expected)
    assert torch.equal(x.grad, x_ref.grad)
    assert all(p.grad is None and not p.requires_grad for p in stack.parameters())


def test_only_codes_and_scales_are_kept_for_the_backward():
    stack = NF4Stack(8, 64, 128)
    stack.quantize_all_(torch.randn(8, 64, 128))
    x = torch.randn(16, 128, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        stack(x, torch.tensor([2] * 8)).sum().backward()
    full_precision = 8 * 64 * 128 * 4
    assert sum(t.numel() * t.element_size() for t in saved) < full_precision / 4


def qlora_model(family: str, *, quantize_base: bool = True, **lora) -> nn.Module:
    """The tiny model of ``family`` (tests/models/test_moe_families) with LoRA, built on the meta device."""
    build = lora_mixtral if family == "mixtral" else lora_qwen3_moe
    sizes = dict(vocab_size=96, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, num_experts=4,
                 num_experts_per_tok=2, max_seq_len=64)
    if family == "mixtral":
        sizes.update(num_layers=2, intermediate_dim=24)
    else:
        sizes.update(num_layers=3, intermediate_dim=48, moe_intermediate_dim=16, mlp_only_layers=[1])
    with torch.device("meta"):
        return build(**sizes, **{**LORA, **lora}, quantize_base=quantize_base)


def loaded_qlora(family: str, folder) -> nn.Module:
    model = qlora_model(family)
    materialize(model, device=torch.device("cpu"), dtype=torch.float32)
    HFCheckpointer(str(folder), model_family=family).load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    return model


def quantized_reference(family: str, base: nn.Module) -> nn.Module:
    """The LoRA model (adapters at their start) whose base is ``base`` with every matrix QLoRA stores in NF4 (the
    decoder layers' projections and every expert, not the embedding, norms, routers or output) replaced by torchao's
    round trip of it."""
    reference = qlora_model(family, quantize_base=False)
    materialize(reference, device=torch.device("cpu"), dtype=torch.float32)
    state = reference.state_dict()
    with torch.no_grad():
        for key, value in base.state_dict().items():
            quantized = key.startswith("layers.") and value.dim() >= 2 and not key.endswith("mlp.gate.weight")
            state[key].copy_(round_trip(value) if quantized else value)
    init_adapters(reference)
    return reference


@pytest.fixture(params=FAMILIES)
def family_checkpoint(request, tmp_path):
    family = request.param
    base = tiny(family)
    return family, base, HFCheckpointer(model_family=family).save(base, tmp_path / "ckpt")


def test_the_qlora_model_stores_every_expert_in_nf4_and_computes_the_round_tripped_model(family_checkpoint):
    family, base, folder = family_checkpoint
    model = loaded_qlora(family, folder)
    stacks = nf4_stacks(model)
    moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(stacks) == sorted(f"layers.{i}.mlp.experts.{p}" for i in moe_layers
                                    for p in ("gate_proj", "up_proj", "down_proj"))
    assert has_nf4(model) and not has_nf4(tiny(family))
    reference = quantized_reference(family, base)
    # Same adapters (A drawn at init), so the same model: forward and every adapter's gradient, bitwise.
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if is_adapter_key(k)}, strict=False)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        set_trainable_params(m, get_adapter_params(m))
        for p in get_adapter_params(m).values():  # B = 0 at the start: give the experts' a value, so A gets a gradient
            if p.dim() == 3:
                with torch.no_grad():
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
    ours, theirs = model(tokens), reference(tokens)
    assert torch.equal(ours, theirs)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    ours_grads, their_grads = get_adapter_params(model), get_adapter_params(reference)
    assert ours_grads.keys() == their_grads.keys()
    experts = [name for name in ours_grads if ".experts." in name]
    assert experts
    for name, param in ours_grads.items():
        assert param.grad is not None and torch.equal(param.grad, their_grads[name].grad), name
        if ".experts." in name:  # every expert's adapters get a gradient
            assert (param.grad.flatten(1).abs().sum(dim=1) > 0).all(), name


def test_the_merged_weights_are_the_round_tripped_base_plus_the_adapters(family_checkpoint):
    family, base, folder = family_checkpoint
    model = loaded_qlora(family, folder)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_key(name):
                param.normal_(0.0, 0.05)
    merged = get_merged_state_dict(model)
    assert merged.keys() == base.state_dict().keys()  # the plain model's keys: no codes or scales
    experts: LoRAGroupedExperts = model.layers[0].mlp.experts
    adapter = experts.adapter("up_proj")
    expected = round_trip(base.layers[0].mlp.experts.up_proj) + experts.scale * torch.bmm(
        adapter.lora_b.weight, adapter.lora_a.weight)
    torch.testing.assert_close(merged["layers.0.mlp.experts.up_proj"], expected, rtol=1e-6, atol=1e-6)
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        expected_logits = model(tokens)
        plain = merge_lora_weights(model)
        assert not nf4_stacks(plain) and not has_nf4(plain)
        torch.testing.assert_close(plain(tokens), expected_logits, rtol=1e-5, atol=1e-5)


def test_unadapted_experts_are_stored_in_nf4_too_and_merge_to_their_round_trip(family_checkpoint):
    family, base, folder = family_checkpoint
    model = qlora_model(family, apply_lora_to_experts=False)
    materialize(model, device=torch.device("cpu"), dtype=torch.float32)
    HFCheckpointer(str(folder), model_family=family).load(model, ignore_missing=is_adapter_key)
    assert len(nf4_stacks(model)) == 3 * sum(hasattr(layer.mlp, "experts") for layer in model.layers)
    merged = get_merged_state_dict(model)
    assert torch.equal(merged["layers.0.mlp.experts.down_proj"], round_trip(base.layers[0].mlp.experts.down_proj))


def test_init_weights_draws_what_a_plain_stack_would_and_quantizes_it():
    model = qlora_model("mixtral", apply_lora_to_experts=False, lora_attn_modules=["q_proj"])
    materialize(model, device=torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(0)
    init_weights(model)
    stack = model.layers[0].mlp.experts.gate_proj
    values = stack.dequantize()
    assert values.abs().max() > 0 and 0.01 < values.std() < 0.03  # normal(0, 0.02), 4-bit


@pytest.mark.parametrize("builder", [qlora_qwen3_moe_30b_a3b, qlora_qwen3_moe_235b_a22b, qlora_mixtral_8x7b,
                                     qlora_mixtral_8x22b])
def test_public_sizes_keep_under_5_percent_of_their_base_in_full_precision(builder):
    with torch.device("meta"):
        model = builder(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_experts=True)
    stacks = nf4_stacks(model)
    in_stacks = sum(s.shape.numel() for s in stacks.values())
    assert sum(s.codes.numel() for s in stacks.values()) * 2 == in_stacks  # two 4-bit values a byte
    outside = {name: p for name, p in model.named_parameters()
               if not is_adapter_key(name) and not any(name.startswith(f"{s}.") for s in stacks)}
    full_precision = sum(p.numel() for p in outside.values() if not is_nf4(p))  # embedding, norms, routers, output
    base = in_stacks + sum(p.numel() for p in outside.values())
    assert full_precision / base < 0.05


def test_experts_whose_matrices_nf4_cannot_block_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"^quantize_base: an expert's 9 x 32 matrices are not a multiple of NF4's "
                                        r"64-value blocks; use LoRA$"):
        with torch.device("meta"):
            lora_mixtral(vocab_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32,
                         intermediate_dim=9, num_experts=4, num_experts_per_tok=2, max_seq_len=16, **LORA,
                         quantize_base=True)



def test_the_memory_plan_counts_the_whole_nf4_model_each_rank_loads():
    from toolkit.planning.memory import estimate_memory

    def plan(model: nn.Module, strategy: str):
        return estimate_memory(model, strategy=strategy, world_size=8, micro_batch_size=1, max_seq_len=32,
                               dtype="bf16")

    qlora, lora = qlora_model("qwen3_moe"), qlora_model("qwen3_moe", quantize_base=False)

    def stored(p: torch.Tensor) -> int:  # torchao's NF4 (the attention): its codes and scales; bf16; codes as they are
        if is_nf4(p):
            return sum(getattr(p, name).nbytes for name in p.__tensor_flatten__()[0])
        return p.numel() * (2 if p.dtype.is_floating_point else p.element_size())

    whole = sum(stored(p) for p in qlora.parameters()) + sum(b.nbytes for b in qlora.buffers())
    zero3 = plan(qlora, "zero3")
    # Every rank quantizes the whole model before zero3 splits it: the load is the peak of this tiny model.
    assert zero3.loading == whole and zero3.total == max(zero3.loading, zero3.params + zero3.grads
                                                        + zero3.optimizer_state + zero3.activations
                                                        + zero3.temporary)
    assert zero3.params < zero3.loading  # split 8 ways while training
    assert "loading (whole)" in zero3.table()
    assert plan(lora, "zero3").loading == 0 and "loading" not in plan(lora, "zero3").table()
    # Under cpu_offload the whole NF4 model loads in host memory (parallelize), FSDP2 moving one layer at a time to
    # the device: nothing whole on the device, at least the whole model in the host.
    offloaded = estimate_memory(qlora, strategy="zero3", cpu_offload=True, world_size=8, micro_batch_size=1,
                                max_seq_len=32, dtype="bf16")
    assert offloaded.loading == 0 and offloaded.host >= whole and "loading" not in offloaded.table()


def test_a_step_checkpoint_loads_into_nf4_experts_as_the_hugging_face_files_do(family_checkpoint, tmp_path):
    import torch.distributed.checkpoint as dcp

    family, base, folder = family_checkpoint
    step = tmp_path / "checkpoints" / "step_1"  # a full fine-tune's step checkpoint of the same weights
    dcp.save({f"model.{k}": v for k, v in base.state_dict().items()}, checkpoint_id=str(step))
    (step / "COMPLETE").write_text("{}")
    from_step = qlora_model(family)
    materialize(from_step, device=torch.device("cpu"), dtype=torch.float32)
    HFCheckpointer(str(step), model_family=family).load(from_step, ignore_missing=is_adapter_key)
    from_files = loaded_qlora(family, folder)
    ours = from_step.state_dict()
    for key, value in from_files.state_dict().items():
        if not is_adapter_key(key):  # (torchao's NF4 weights compared by their values)
            assert torch.equal(dequantize(ours[key]), dequantize(value)), key
