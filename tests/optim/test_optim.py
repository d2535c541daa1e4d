"""The optimizer step inside backward, on one process: the same training as the ordinary step, without ever holding
every gradient; and the combinations it refuses. torchao's 8-bit AdamW against fp32 AdamW. Multi-process runs and
resuming: tests/recipes/test_optimizer_techniques.py."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_demo
from toolkit.parallel import parallel_dims
from toolkit.training import (
    OptimizerInBackward,
    check_optimizer_in_backward,
    cosine_with_warmup,
    init_weights,
    materialize,
    optimizer_step,
    set_seed,
)


def demo_model() -> torch.nn.Module:
    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=16)
    materialize(model, device=torch.device("cpu"))
    init_weights(model)
    return model


def train(model: torch.nn.Module, optimizer, steps: int = 4, on_grad=None) -> list[float]:
    """A few steps on fixed random batches with the recipes' schedule; returns the losses and the learning rates."""
    scheduler = cosine_with_warmup(optimizer, warmup_steps=2, total_steps=steps)
    generator = torch.Generator().manual_seed(1)
    record = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 16), generator=generator)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer_step(model, optimizer, max_grad_norm=None)
        record += [loss.item(), scheduler.get_last_lr()[0]]
        scheduler.step()
    return record


def test_matches_the_ordinary_step_bitwise():
    # The same AdamW arithmetic per parameter, only earlier: the same losses, learning rates and weights, exactly.
    reference, model = demo_model(), demo_model()
    adamw = partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    expected = train(reference, adamw(reference.parameters()))
    assert train(model, OptimizerInBackward(model.parameters(), adamw)) == expected
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_at_most_one_gradient_exists_at_a_time():
    model = demo_model()
    params = list(model.parameters())
    alive = []
    for param in params:  # registered first, so they run before the optimizer's hook, with the gradient present
        param.register_post_accumulate_grad_hook(lambda _: alive.append(sum(p.grad is not None for p in params)))
    train(model, OptimizerInBackward(params, partial(torch.optim.AdamW, lr=1e-2)), steps=2)
    assert len(alive) == 2 * len(params) and max(alive) == 1
    assert all(p.grad is None for p in params)


def test_its_own_state_dict_points_to_the_per_parameter_optimizers():
    optimizer = OptimizerInBackward(demo_model().parameters(), partial(torch.optim.AdamW, lr=1e-2))
    with pytest.raises(TypeError, match=r"optimizer\.optimizers"):
        optimizer.state_dict()


def refusal(*, strategy="zero3", world_size=2, micro_batch_size=4, accumulation_steps=1, max_grad_norm=None,
            grad_scaling=False) -> str | None:
    dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size, device_type="cpu")
    try:
        check_optimizer_in_backward(
            dims=dims, micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm, grad_scaling=grad_scaling,
        )
    except UserError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "hsdp"])
def test_fsdp2_strategies_are_supported(strategy):
    assert refusal(strategy=strategy) is None


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_replicated_strategies_are_refused_on_several_processes_only(strategy):
    assert "use data_parallel=zero2, zero3 or hsdp" in refusal(strategy=strategy)
    assert refusal(strategy=strategy, world_size=1) is None  # one process: the model is not wrapped at all


def test_accumulation_clipping_and_loss_scaling_are_refused():
    assert "set micro_batch_size=8" in refusal(micro_batch_size=2, accumulation_steps=4)
    assert "set clip_grad_norm=null" in refusal(max_grad_norm=1.0)
    assert "use dtype=bf16-mixed" in refusal(grad_scaling=True)


def test_adamw8bit_trains_like_fp32_adamw_in_a_quarter_of_the_state():
    from torchao.optim import AdamW8bit

    # A student MLP regressing onto a teacher's outputs; both weight matrices are quantized (torchao quantizes
    # tensors of 4096 elements or more). Two shapes only: torchao compiles its step once per shape.
    torch.manual_seed(0)

    def mlp() -> torch.nn.Module:
        return nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 64, bias=False))

    teacher, student = mlp(), mlp()
    x = torch.randn(512, 64)
    y = teacher(x).detach()
    runs = {}
    for name, optimizer_class in (("fp32", torch.optim.AdamW), ("8bit", AdamW8bit)):
        model = mlp()
        model.load_state_dict(student.state_dict())
        optimizer = optimizer_class(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
        losses = []
        for _ in range(20):
            loss = (model(x) - y).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        update = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), student.parameters())]).detach()
        runs[name] = losses, update, optimizer
    (fp32_losses, fp32_update, _), (losses, update, adamw8bit) = runs["fp32"], runs["8bit"]
    assert losses[-1] < losses[0] / 10
    # Both moments are stored in 8 bits per element (a dynamic-tree code) with a float32 scale per block of 256, and
    # torchao applies each step from the moments before re-quantizing them, so quantization only perturbs what
    # carries over to the next step: the updates drift apart by a few percent (2.4% after 20 steps here) while the
    # loss, which averages over every weight, stays within 4e-4 relative. Tolerances: 4-5x those.
    torch.testing.assert_close(losses, fp32_losses, rtol=2e-3, atol=0)
    assert (update - fp32_update).norm() / fp32_update.norm() < 0.1
    # 2 bytes of state per parameter (and 8 bytes of scales per 256), against fp32 AdamW's 8.
    state = [adamw8bit.state[p] for p in adamw8bit.param_groups[0]["params"]]
    state_bytes = sum(s[k].codes.nbytes + s[k].scale.nbytes for s in state for k in ("exp_avg", "exp_avg_sq"))
    assert state_bytes / update.numel() == 2 + 2 * 4 / 256
