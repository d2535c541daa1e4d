"""The global gradient norm on one process, against float64 arithmetic and ``torch.nn.utils.clip_grad_norm_``.
(Across ranks and layouts it is compared in test_tensor_parallel.py and the recipes' layout tests.)"""

import pytest
import torch
from torch import nn

from toolkit.parallel import clip_grad_norm
from toolkit.parallel.grad_norm import global_norm


def _model_with_grads(seed: int = 0) -> nn.Module:
    """Parameters of mixed dtypes and sizes (one of them empty, one without a gradient), gradients set."""
    torch.manual_seed(seed)
    model = nn.ModuleDict({
        "a": nn.Linear(37, 64), "b": nn.Linear(64, 8, bias=False).to(torch.bfloat16),
        "c": nn.Embedding(0, 4), "frozen": nn.Linear(3, 3),
    })
    for name, p in model.named_parameters():
        p.grad = None if name.startswith("frozen") else torch.randn_like(p) * 3
    return model


def _reference(model: nn.Module) -> float:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def test_the_norm_is_float64s_to_float32_rounding():
    model = _model_with_grads()
    # float32 sums of squares over ~3000 elements: a relative error of a few float32 epsilons.
    assert global_norm([p.grad for p in model.parameters() if p.grad is not None]) == pytest.approx(
        _reference(model), rel=1e-6)
    assert global_norm([]) == 0.0


@pytest.mark.parametrize("max_norm", [None, 1e9, 5.0])
def test_clipping_scales_every_gradient_by_one_coefficient(max_norm):
    # Against float64, not torch.nn.utils.clip_grad_norm_: with bf16 gradients among float32 ones, torch takes the
    # bf16 group's norm in bf16 (160.128 here, against 160.094 exactly; ours 160.094).
    ours, original = _model_with_grads(), _model_with_grads()
    expected = _reference(original)
    assert clip_grad_norm(ours, max_norm) == pytest.approx(expected, rel=1e-6)
    coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (expected + 1e-6))
    for (name, p), q in zip(ours.named_parameters(), original.parameters()):
        if p.grad is None:
            continue
        want = (q.grad.double() * coefficient).to(q.grad.dtype)
        if coefficient == 1.0:  # nothing to clip: the gradients are left alone, bit for bit
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        else:  # the coefficient is a float32 number; bf16 gradients round the product to bf16
            torch.testing.assert_close(p.grad, want, rtol=1e-6 if p.dtype == torch.float32 else 8e-3, atol=0,
                                       msg=name)
    if max_norm is not None and max_norm < expected:
        assert _reference(ours) == pytest.approx(max_norm, rel=1e-3)


def test_the_norms_are_one_operation_not_one_per_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    grads = [torch.randn(8, 8) for _ in range(50)]
    with Count() as count:
        global_norm(grads)
    # one multi-tensor kernel on CUDA for the 50 norms, then a few ops on the 50 results: not 50 norms, squares, adds
    assert count.ops.count("_foreach_norm") == 1 and "linalg_vector_norm" not in count.ops, count.ops
    assert len(count.ops) < 10, count.ops
