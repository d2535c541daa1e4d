"""Worker for test_float8.py, run under torchrun: a tiny Llama with float8 linear layers, sharded by FSDP2 (ZeRO-3)
and trained a few steps, once gathering the weights in float32 and casting them after, once casting each shard and
gathering the float8 bytes (``fsdp_float8_all_gather``). Rank zero writes both runs' losses as JSON.

Also the one-process helpers test_float8.py trains with."""

import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from toolkit.data import GlobalBatchSampler, demo_dataset, padded_collate
from toolkit.models._decoder import plain_linear
from toolkit.models._lora import lora_builder
from toolkit.models.llama3 import llama3
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.tokenizers import byte_tokenizer
from toolkit.parallel import parallel_dims
from toolkit.training import apply_float8, forward_backward, init_weights, optimizer_step, parallelize, set_seed

CPU = torch.device("cpu")
BATCH_SIZE = 8
MAX_SEQ_LEN = 32


def tiny_llama3(*, linear=plain_linear):
    """A Llama 3 of 2 layers and width 32 (every projection's dimensions multiples of 16, as float8 needs): on the
    CPU, torch runs float8 matmuls with a reference kernel near 10M multiply-adds per second, so the demo Llama
    (~1.8G multiply-adds a step) would take a minute a step; this one takes about a second."""
    return llama3(vocab_size=384, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64,
                  max_seq_len=MAX_SEQ_LEN, rope_base=10_000.0, linear=linear)


lora_tiny_llama3 = lora_builder(tiny_llama3)


def batches(steps: int, *, rank: int = 0, world_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's share of the first ``steps`` global batches of the demo tasks."""
    tokenizer = byte_tokenizer(max_seq_len=MAX_SEQ_LEN)
    dataset = demo_dataset(tokenizer, num_samples=BATCH_SIZE * steps, seed=0)
    sampler = GlobalBatchSampler(len(dataset), global_batch_size=BATCH_SIZE, rank=rank, world_size=world_size, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE // world_size, sampler=sampler,
                        collate_fn=partial(padded_collate, pad_id=tokenizer.pad_id))
    return list(itertools.islice(loader, steps))


def demo_model(
    *, float8: bool, dtype: torch.dtype, strategy: str = "ddp", world_size: int = 1, float8_all_gather: bool = True,
    lora: bool = False,
) -> torch.nn.Module:
    """The seeded tiny Llama (``lora``: with rank-8 adapters on every projection, only they trained), optionally
    with float8 linear layers, in ``dtype``, parallelized as a recipe does; sharded float8 weights are all-gathered
    in float8 unless ``float8_all_gather`` is False."""
    dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size, device_type="cpu")
    set_seed(0)
    with torch.device("meta"):
        if lora:
            model = lora_tiny_llama3(lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                     apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16)
            set_trainable_params(model, get_adapter_params(model))
        else:
            model = tiny_llama3()
    if float8:
        apply_float8(model, fsdp_float8_all_gather=float8_all_gather and dims.is_sharded)
    return parallelize(model, dims=dims, device=CPU, dtype=dtype, fill=init_weights)


def train(model: torch.nn.Module, steps: list[dict[str, torch.Tensor]], *, world_size: int = 1) -> list[float]:
    """AdamW on the given micro-batches, one per step; returns the global losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for batch in steps:
        losses.append(forward_backward(model, [batch], device=CPU, data_parallel_size=world_size).loss)
        optimizer_step(model, optimizer, max_grad_norm=None)
    return losses


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    steps = batches(3, rank=rank, world_size=world_size)
    result = {}
    for name, float8_all_gather in (("float32_all_gather", False), ("float8_all_gather", True)):
        model = demo_model(float8=True, dtype=torch.float32, strategy="zero3", world_size=world_size,
                           float8_all_gather=float8_all_gather)
        result[name] = train(model, steps, world_size=world_size)
        result[f"{name}_weight"] = type(model.layers[0].mlp.up_proj.weight.to_local()).__name__
        del model
    # LoRA with its bases in float8 under ZeRO-3: FSDP2 frees each layer's gathered base after forward and gathers
    # it again for backward, where the float8 matmul casts the weight it saved (the gathered one) once more.
    model = demo_model(float8=True, dtype=torch.float32, strategy="zero3", world_size=world_size, lora=True)
    result["lora_float8_zero3"] = train(model, steps, world_size=world_size)
    del model
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, as the recipes' torchrun workers do (gloo destructors can abort there)
