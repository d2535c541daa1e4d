"""Worker for tests/modules/test_distillation.py, under torchrun: the distillation losses with both output weights
split over the vocabulary (unevenly: 41 tokens on 2 ranks) on a tensor-parallel mesh, against the float64 formula
and the unsplit computation; loss and gradients (the hidden states' whole, each weight's rows on its rank)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.modules.test_distillation import float64_reference, inputs  # noqa: E402
from toolkit.modules.distillation import DIVERGENCES, linear_distillation_sum  # noqa: E402


def run(kind: str, temperature: float, softcap: float | None, mesh) -> None:
    sh, sw, th, tw = inputs(vocab=41)
    whole_h, whole_w = sh.clone().requires_grad_(True), sw.clone().requires_grad_(True)
    split_h = sh.clone().requires_grad_(True)
    split_w = distribute_tensor(sw, mesh, [Shard(0)]).requires_grad_(True)
    split_tw = distribute_tensor(tw, mesh, [Shard(0)])
    options = dict(kind=kind, temperature=temperature, beta=0.3, num_chunks=3, student_softcap=softcap,
                   teacher_softcap=softcap)
    ours = linear_distillation_sum(split_h, split_w, th, split_tw, **options)
    ours.backward()
    whole = linear_distillation_sum(whole_h, whole_w, th, tw, **options)
    whole.backward()
    rows = split_w.to_local().shape[0]
    start = 0 if dist.get_rank() == 0 else 41 - rows
    # The split sums in another order than the whole: float32 rounding, relative 1e-6 on the loss.
    torch.testing.assert_close(ours.detach(), whole.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(split_h.grad, whole_h.grad, rtol=1e-5, atol=1e-6)  # gradients of order 0.1-1
    torch.testing.assert_close(split_w.grad.to_local(), whole_w.grad[start : start + rows], rtol=1e-5, atol=1e-6)
    if softcap is None:
        sh64, sw64 = sh.double().requires_grad_(True), sw.double().requires_grad_(True)
        reference = float64_reference(sh64, sw64, th, tw, kind, temperature, 0.3)
        reference.backward()
        assert abs(ours.item() - reference.item()) <= 1e-5 * abs(reference.item()), (ours.item(), reference.item())
        torch.testing.assert_close(split_h.grad.double(), sh64.grad, rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    for kind in DIVERGENCES:
        for temperature, softcap in ((1.0, None), (2.0, None), (1.0, 3.0)):
            run(kind, temperature, softcap, mesh)
    dist.barrier()
    if dist.get_rank() == 0:
        print("distillation under tensor parallelism: all cases equal")
    dist.destroy_process_group()
