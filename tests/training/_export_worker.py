"""Worker for test_export.py, run under torchrun: export a seeded tiny Llama sharded (FSDP2) or replicated (DDP)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.models.llama3 import llama3
from toolkit.parallel import apply_data_parallel, parallel_dims
from toolkit.training import HFCheckpointer

DIMS = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3(**DIMS)


if __name__ == "__main__":
    strategy, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    model = tiny_model()
    dims = parallel_dims(strategy=strategy, world_size=dist.get_world_size(), local_world_size=dist.get_world_size(),
                         shard_size=None, cpu_offload=False, device_type="cpu")
    model = apply_data_parallel(model, dims=dims, device=torch.device("cpu"), mp_policy=None)
    # Small files: each rank writes several of them.
    HFCheckpointer(None, model_family="llama3").export(model, out, max_shard_bytes=20_000)
    del model  # its DDP reducer holds the group: freed after destroy_process_group, at exit, it can hang there
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown, as the recipes' torchrun workers do: torch 2.13's gloo destructors can abort there.
    sys.stdout.flush()
    os._exit(0)
