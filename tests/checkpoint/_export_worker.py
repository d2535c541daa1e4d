"""Worker for test_export.py, run under torchrun: export a seeded tiny Llama and a tiny Qwen3-MoE sharded (FSDP2) or
replicated (DDP); the MoE export is then loaded back into a second model laid out the same way."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from toolkit.models.llama3 import llama3
from toolkit.models.qwen3_moe import qwen3_moe
from toolkit.parallel import apply_data_parallel, parallel_dims, unwrap
from toolkit.training import HFCheckpointer

DIMS = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64)
# 3 experts over 2 ranks: FSDP2 shards them unevenly (2 and 1); layer 1 is dense.
MOE_DIMS = dict(
    vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32, moe_intermediate_dim=16,
    intermediate_dim=48, num_experts=3, num_experts_per_tok=2, mlp_only_layers=[1], max_seq_len=64,
)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3(**DIMS)


def tiny_moe_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return qwen3_moe(**MOE_DIMS)


def moe_dir(out: Path) -> Path:
    """Where the worker exports the MoE model, next to ``out``."""
    return out.with_name(out.name + "_moe")


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


if __name__ == "__main__":
    strategy, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    dims = parallel_dims(strategy=strategy, world_size=dist.get_world_size(), local_world_size=dist.get_world_size(),
                         shard_size=None, cpu_offload=False, device_type="cpu")

    def parallel(model: torch.nn.Module) -> torch.nn.Module:
        return apply_data_parallel(model, dims=dims, device=torch.device("cpu"), mp_policy=None)

    model = parallel(tiny_model())
    # Small files: each rank writes several of them.
    HFCheckpointer(None, model_family="llama3").export(model, out, max_shard_bytes=20_000)
    moe = parallel(tiny_moe_model())
    HFCheckpointer(None, model_family="qwen3_moe").export(moe, moe_dir(out), max_shard_bytes=4_000)
    # Loaded back into a model laid out alike (and initialized otherwise), each rank reads its experts into its shard.
    torch.manual_seed(1)
    reloaded = parallel(qwen3_moe(**MOE_DIMS))
    HFCheckpointer(str(moe_dir(out)), model_family="qwen3_moe").load(unwrap(reloaded))
    expected = unwrap(moe).state_dict()
    for key, value in unwrap(reloaded).state_dict().items():
        assert torch.equal(local(value), local(expected[key])), f"rank {dist.get_rank()}: {key} differs"
    del model, moe, reloaded  # a DDP reducer holds the group: freed after destroy_process_group, at exit, it can hang
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown, as the recipes' torchrun workers do: torch 2.13's gloo destructors can abort there.
    sys.stdout.flush()
    os._exit(0)
