"""The memory plan of a preference step: a pair is two rows of one forward, and a full fine-tune with a live
reference holds a frozen copy of the model (toolkit.objectives.preference.preference_kernels), measured against the
copy frozen_reference builds."""

import dataclasses

import pytest
import torch

from toolkit.models.llama3 import llama3_demo
from toolkit.parallel import ParallelDims
from toolkit.training import StepKernels, estimate_memory, init_weights
from toolkit.objectives.preference import frozen_reference, preference_kernels

ARGS = dict(world_size=1, micro_batch_size=4, max_seq_len=64, dtype="bf16-mixed")


def meta_model():
    with torch.device("meta"):
        return llama3_demo(max_seq_len=64)


@pytest.mark.parametrize(("loss", "adapters", "precompute", "copy"), [
    ("dpo", False, False, True), ("ipo", False, False, True), ("dpo", True, False, False),
    ("dpo", False, True, False), ("simpo", False, False, False), ("orpo", False, False, False),
])
def test_only_a_full_fine_tune_with_a_live_reference_holds_a_copy(loss, adapters, precompute, copy):
    kernels = preference_kernels(StepKernels(), loss=loss, adapters=adapters, precompute=precompute)
    assert kernels.sequences_per_sample == 2 and kernels.reference_model is copy


def test_a_pair_counts_as_two_sequences():
    model = meta_model()
    pairs = estimate_memory(model, strategy="ddp", kernels=StepKernels(sequences_per_sample=2), **ARGS)
    rows = estimate_memory(model, strategy="ddp", **{**ARGS, "micro_batch_size": 8})
    assert (pairs.activations, pairs.logits) == (rows.activations, rows.logits)
    assert pairs.params == rows.params and pairs.reference == 0


def test_the_reference_copy_is_what_frozen_reference_allocates():
    # One process: the copy is whole, in the compute dtype (bf16 under bf16-mixed), with the model's buffers.
    estimate = estimate_memory(meta_model(), strategy="ddp", kernels=StepKernels(reference_model=True), **ARGS)
    dims = ParallelDims(strategy="ddp", dp_replicate=1, dp_shard=1)
    reference = frozen_reference(lambda: llama3_demo(max_seq_len=64), dims=dims, mesh=None,
                                 device=torch.device("cpu"), dtype=torch.bfloat16, fill=init_weights)
    allocated = sum(t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()])
    assert estimate.reference == allocated
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in reference.parameters())
    assert not reference.training
    plain = estimate_memory(meta_model(), strategy="ddp", **ARGS)
    assert estimate.total == plain.total + estimate.reference


def test_sharded_the_copy_is_a_share_and_what_it_gathers():
    model = meta_model()
    kernels = StepKernels(reference_model=True)
    args = {**ARGS, "world_size": 4}
    zero3 = estimate_memory(model, strategy="zero3", kernels=kernels, **args)
    zero2 = estimate_memory(model, strategy="zero2", kernels=kernels, **args)
    whole = estimate_memory(model, strategy="ddp", kernels=kernels, **args).reference
    assert zero3.reference == zero2.reference < whole + whole  # zero2's reference reshards after forward too
    layers = sum(p.numel() for p in model.layers[0].parameters()) * 2
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers.")) * 2
    assert zero3.reference >= root + 2 * layers + (whole - root) // 4
    offloaded = estimate_memory(model, strategy="zero3", kernels=kernels, cpu_offload=True, **args)
    assert offloaded.reference == root + 2 * layers + sum(b.numel() * b.element_size() for b in model.buffers())
    assert offloaded.host > estimate_memory(model, strategy="zero3", cpu_offload=True, **args).host


def test_the_plan_table_shows_the_reference_row_only_when_there_is_one():
    model = meta_model()
    with_copy = estimate_memory(model, strategy="ddp", kernels=StepKernels(reference_model=True), **ARGS)
    assert "frozen model" in with_copy.table()
    assert "frozen model" not in dataclasses.replace(with_copy, reference=0).table()


@pytest.mark.parametrize(("strategy", "world_size", "tensor_parallel", "cpu_offload"), [
    ("ddp", 1, 1, False), ("zero3", 4, 1, False), ("zero3", 4, 1, True), ("zero2", 4, 2, False),
])
def test_a_teacher_of_its_own_shape_counts_as_its_frozen_copy(strategy, world_size, tensor_parallel, cpu_offload):
    # Distillation's teacher (StepKernels.frozen_model), laid out like the student: exactly what a frozen copy of
    # the teacher beside itself would add, on the student's estimate, which is otherwise unchanged.
    from toolkit.models.llama3 import llama3

    with torch.device("meta"):
        student = llama3(vocab_size=384, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                         intermediate_dim=192, max_seq_len=64)
    teacher = meta_model()
    args = {**ARGS, "world_size": world_size, "tensor_parallel": tensor_parallel, "cpu_offload": cpu_offload}
    taught = estimate_memory(student, strategy=strategy, kernels=StepKernels(frozen_model=teacher), **args)
    alone = estimate_memory(student, strategy=strategy, **args)
    copy = estimate_memory(teacher, strategy=strategy, kernels=StepKernels(reference_model=True), **args)
    without = estimate_memory(teacher, strategy=strategy, **args)
    assert taught.reference == copy.reference > 0
    assert taught.host - alone.host == copy.host - without.host
    assert (taught.params, taught.activations, taught.total - taught.reference) == (
        alone.params, alone.activations, alone.total)
