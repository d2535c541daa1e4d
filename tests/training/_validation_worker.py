"""Worker for test_validation.py, run under torchrun: the validation loss of a seeded tiny Llama, replicated (DDP)
or sharded (FSDP2), each rank reading its slice of a small set. ``python _validation_worker.py OUT STRATEGY...``
computes it under each strategy in turn, each on a fresh model in the same process group; rank zero writes every
rank's result, by strategy, as JSON to OUT."""

import gc
import json
import os
import random
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.checkpoint._export_worker import DIMS, tiny_model
from toolkit.data import padded_collate, shifted_labels
from toolkit.parallel import apply_data_parallel, parallel_dims
from toolkit.training.validation import ValidationSampler, validation_loss

# 9 samples: on 2 ranks of micro-batches of 2, rank 0 gets 4 samples (2 batches) and rank 1 gets 5 (3 batches),
# so a sharded model must keep the ranks' forwards in step.
NUM_SAMPLES = 9
BATCH_SIZE = 2


def samples() -> list[dict]:
    """Sequences of 3 to 20 tokens whose first few (a "prompt") are not trained on; one has no target at all."""
    rng = random.Random(0)
    out = []
    for i in range(NUM_SAMPLES):
        tokens = [rng.randrange(DIMS["vocab_size"]) for _ in range(rng.randint(3, 20))]
        prompt = len(tokens) if i == 4 else rng.randint(1, 3)
        out.append({"tokens": tokens, "labels": shifted_labels(tokens, [j >= prompt for j in range(len(tokens))])})
    return out


def loader(rank: int, world_size: int) -> DataLoader:
    data = samples()
    return DataLoader(
        data, batch_size=BATCH_SIZE, sampler=ValidationSampler(len(data), rank=rank, world_size=world_size),
        collate_fn=partial(padded_collate, pad_id=0),
    )


def validate_under(strategy: str, rank: int, world_size: int) -> list[dict]:
    """Every rank's result under ``strategy``."""
    model = tiny_model()
    dims = parallel_dims(strategy=strategy, world_size=world_size, local_world_size=world_size, device_type="cpu")
    model = apply_data_parallel(model, dims=dims, device=torch.device("cpu"))
    model.train()
    result = validation_loss(model, loader(rank, world_size), device=torch.device("cpu"))
    result["restored_train_mode"] = model.training and all(m.training for m in model.modules())
    result["batches_on_this_rank"] = len(loader(rank, world_size))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    # FSDP2's device mesh keeps the process group alive past destroy_process_group; freed only at interpreter exit,
    # a gloo thread may then still be releasing the last collective's tensors and abort the process ("terminate
    # called without an active exception"; ~1 run in 4 here). Freeing the model first joins those threads in time.
    del model
    gc.collect()
    dist.barrier()
    return gathered


if __name__ == "__main__":
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {strategy: validate_under(strategy, rank, world_size) for strategy in strategies}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # And skip interpreter teardown altogether, as the recipes' torchrun workers do (toolkit.config.recipe_main):
    # torch 2.13's gloo destructors can still abort there after all work is done.
    sys.stdout.flush()
    os._exit(0)
