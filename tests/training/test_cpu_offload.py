"""FSDP2's CPU offload: the model is sharded on the meta device and each rank allocates only its shards, in host
memory (before, it was materialized whole on the GPU and split after, which a model that only fits in shards could
not survive), and it trains exactly as without offload.

This machine has no GPU: the workers run the offload policy on a CPU mesh, where the shards already live in host
memory, so what is checked is the order (shard, then allocate and fill) and the arithmetic; that buffers go to the
GPU while parameters stay in host memory is checked on :func:`materialize` with another buffer device."""

import json
from pathlib import Path

import pytest
import torch

from tests.launch import removing, run_workers
from toolkit.models.llama3 import llama3_demo
from toolkit.training import materialize

WORKER = Path(__file__).parent / "_cpu_offload_worker.py"


def test_offloaded_zero3_fills_only_shards_and_trains_as_without_offload(tmp_path):
    out = tmp_path / "offload.json"
    result = run_workers(WORKER, str(out), nproc=2, clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    plain, offloaded = records["False"], records["True"]
    # fill (the checkpoint load or the initializer) got this rank's half of every parameter, never the whole model
    assert offloaded["sharded_when_filled"] and plain["sharded_when_filled"]
    assert offloaded["filled_elements"] == pytest.approx(offloaded["model_elements"] / 2, rel=0.01)
    # the same arithmetic on the same shards: equal (measured bitwise)
    assert offloaded["losses"] == plain["losses"]
    assert offloaded["weights"] == plain["weights"]


def test_materialize_puts_parameters_and_buffers_where_asked():
    # Under CPU offload parameters are allocated in host memory and buffers (rotary tables) where the layers run;
    # "meta" stands in for the GPU here: what matters is that each goes where it is told.
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=16)
    materialize(model, device=torch.device("cpu"), buffer_device=torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    buffers = list(model.buffers())
    assert buffers and {b.device.type for b in buffers} == {"meta"}
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=16)
    materialize(model, device=torch.device("cpu"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_shards_live_in_host_memory_and_train_as_on_the_gpu(tmp_path):
    # One GPU, FSDP2 over a mesh of its one rank with and without offload: with offload the shards and their
    # gradients are in host memory, and clipping (an all-reduce of the norm over NCCL, which takes GPU tensors only)
    # and gathering the weights must move what they send. The Adam step then runs on the CPU instead of the GPU:
    # other kernels, so equal to float32 rounding over 3 steps, not bitwise.
    out = tmp_path / "offload.json"
    result = run_workers(WORKER, str(out), "cuda", nproc=1, clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    plain, offloaded = records["False"], records["True"]
    assert plain["parameters_on"] == ["cuda"] and offloaded["parameters_on"] == ["cpu"]
    assert offloaded["buffers_on"] == ["cuda"]
    assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert offloaded["norms"] == pytest.approx(plain["norms"], rel=1e-4)
    assert offloaded["weights"] == pytest.approx(plain["weights"], rel=1e-5)
