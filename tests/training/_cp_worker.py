"""Worker for test_context_parallel_training.py, run under torchrun on 4 processes (gloo, CPU) into the folder
``sys.argv[1]``: tiny models trained with each sequence split over context-parallel ranks, on every layout of the
4 ranks that has them, one after the other, in one launch; then the recipe.

The layouts (name: data_parallel, tensor_parallel, context_parallel, micro-batches per rank and step):

- ``cp2``: DDP over 4 ranks, two CP pairs (2 ranks read distinct rows, each pair splits them);
- ``cp4``: one CP group of all 4 ranks;
- ``zero3_cp2``: ZeRO-3 over the 4 ranks, two CP pairs;
- ``ddp_tp2_cp2`` and ``zero3_tp2_cp2``: a CP pair of tensor-parallel pairs (one reader of rows);
- ``zero3_cp2_ac``: ``zero3_cp2`` with activation checkpointing;
- ``zero2_cp2`` and ``hsdp_cp2``: ZeRO-2, and HSDP with shard groups of one rank, of CP pairs.

Full fine-tuning, LoRA, DoRA and QLoRA; each run trains 5 AdamW steps (gradient norm clipped) of a global batch of 4 rows, unpacked (lengths 5 to 20, a
prompt ignored) or packed (2 to 4 documents of uneven lengths per row, crossing the CP chunks' boundaries), for both
methods (``ring``, ``alltoall``); rank zero saves the losses, gradient norms and final weights (gathered whole) per
run to ``results.pt``, and the test trains the one-process references (no split) with the same code and compares.

Then the full fine-tune recipe on the demo (tests/training/_tp_worker.py's ``RECIPE``, saving at steps 2, 4 and 5)
with ``context_parallel=2`` (ring) into ``recipe/``, and resumed from its step 2 with ``context_parallel=4``
(alltoall) into ``recipe_resumed/``, and from its step 4 without the split into ``recipe_cp1/``, each scoring the
held-out set after step 5: the test compares them with each other and with the one-process run of the same config;
with ``data_parallel=zero1`` and ``context_parallel=2`` into ``recipe_zero1/``; and compiled with each method into
``recipe_compiled_<method>/``.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.training._tp_worker import ADAPTERS, MODELS, RECIPE, SAVES, VOCAB, build, fill, full, run_recipe
from toolkit.parallel import parallel_dims, unwrap
from toolkit.parallel.context_parallel import CP_METHODS
from toolkit.training import forward_backward, optimizer_step, parallelize

STEPS, BATCH = 5, 4
LAYOUTS = {
    "cp2": ("ddp", 1, 2, 2), "cp4": ("ddp", 1, 4, 2), "zero3_cp2": ("zero3", 1, 2, 1),
    "ddp_tp2_cp2": ("ddp", 2, 2, 2), "zero3_tp2_cp2": ("zero3", 2, 2, 1),
    # zero3_cp2 with activation checkpointing: each layer's forward (and its exchanges) again in backward.
    "zero3_cp2_ac": ("zero3", 1, 2, 1),
    # ZeRO-2, and HSDP with shard groups of one rank (HSDP_SHARD_SIZE: all 4 replicas, the CP pairs' ranks being
    # data-parallel ranks too), of CP pairs.
    "zero2_cp2": ("zero2", 1, 2, 2), "hsdp_cp2": ("hsdp", 1, 2, 1),
}
HSDP_SHARD_SIZE = {"hsdp_cp2": 1}
# (model, mode, data) on layouts, each for both methods.
RUNS = [
    *[("llama", "full", "unpacked", layout) for layout in LAYOUTS],
    ("llama", "full", "packed", "cp2"), ("llama", "full", "packed", "zero3_tp2_cp2"),
    ("llama", "lora", "packed", "zero3_cp2"), ("llama", "lora", "unpacked", "zero3_tp2_cp2"),
    ("llama", "dora", "packed", "cp2"), ("llama", "full", "packed", "zero3_cp2_ac"),
    # QLoRA: NF4 bases (whole on every rank: FSDP2 does not shard them), adapters under ZeRO-3.
    ("llama", "qlora", "packed", "zero3_cp2"),
    ("llama", "full", "packed", "zero2_cp2"), ("llama", "lora", "unpacked", "hsdp_cp2"),
    # Gemma 2: a sliding window (layer 0), attention and final soft-caps.
    ("gemma", "full", "packed", "cp2"),
]
# The held-out loss after the last step (16 rows over 2 reading ranks: the CP groups score the same slice).
VALIDATION = ["eval_every_n_steps=5", "validation_dataset.num_samples=16"]
# Rows are padded to a multiple of 8 = 2 x the largest CP degree, as the recipes pad them (2 x context_parallel).
PAD_TO = 8
assert set(ADAPTERS) >= {"full", "lora"} and set(MODELS) >= {"llama", "gemma"}


def global_batch(step: int, data: str) -> list[dict[str, torch.Tensor]]:
    """The step's 4 rows; packed ones carry ``input_pos`` restarting at every document."""
    generator = torch.Generator().manual_seed(100 + step)
    rows = []
    for i in range(BATCH):
        if data == "unpacked":
            length = int(torch.randint(5, 21, (1,), generator=generator))
            tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
            labels = tokens[1:].clone()
            labels[: 2 + i % 2] = -100
            rows.append({"tokens": tokens[:-1], "labels": labels})
            continue
        docs = [int(n) for n in torch.randint(2, 11, (int(torch.randint(2, 5, (1,), generator=generator)),),
                                              generator=generator)]
        tokens, labels, positions = [], [], []
        for n in docs:
            doc = torch.randint(0, VOCAB, (n + 1,), generator=generator)
            tokens.append(doc[:-1])
            labels.append(doc[1:])
            positions.append(torch.arange(n))
        rows.append({"tokens": torch.cat(tokens), "labels": torch.cat(labels), "input_pos": torch.cat(positions)})
    return rows


def micro_batches(rows: list[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` in ``count`` micro-batches padded to a multiple of :data:`PAD_TO` (padding ignored; in packed rows
    a document of its own, as ``padded_collate`` makes it)."""
    size = len(rows) // count
    batches = []
    for group in (rows[i: i + size] for i in range(0, len(rows), size)):
        length = -(-max(len(row["tokens"]) for row in group) // PAD_TO) * PAD_TO
        tokens = torch.zeros(len(group), length, dtype=torch.long)
        labels = torch.full((len(group), length), -100)
        input_pos = torch.arange(length).repeat(len(group), 1)
        for j, row in enumerate(group):
            n = len(row["tokens"])
            tokens[j, :n], labels[j, :n] = row["tokens"], row["labels"]
            if "input_pos" in row:
                input_pos[j, :n] = row["input_pos"]
                input_pos[j, n:] = torch.arange(length - n)
        batch = {"tokens": tokens, "labels": labels}
        if "input_pos" in group[0]:
            batch["input_pos"] = input_pos
        batches.append(batch)
    return batches


def train(name: str, mode: str, data: str, dims, mesh=None, context_parallel=None, *, micro_steps: int = 2,
          activation_checkpointing: bool = False) -> dict:
    """Train the case on ``dims`` (this rank's part), split over ``context_parallel`` if given; the losses,
    gradient norms and whole weights."""
    model = parallelize(build(name, mode), dims=dims, device=torch.device("cpu"), dtype=torch.float32, fill=fill,
                        mesh=mesh, activation_checkpointing=activation_checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    initial = {k: full(v) for k, v in unwrap(model).state_dict().items()}
    group = dims.dp_group(mesh)
    # The positions the first norm sees in the first step's forwards: a split row holds 1/cp of them.
    seen: list[int] = []
    watch = unwrap(model).layers[0].input_layernorm.register_forward_hook(
        lambda module, inputs, output: seen.append(inputs[0].shape[1])
    )
    losses, norms = [], []
    for step in range(STEPS):
        share = BATCH // dims.batch_ranks
        mine = global_batch(step, data)[dims.batch_rank * share: (dims.batch_rank + 1) * share]
        batches = micro_batches(mine, min(micro_steps, share))
        result = forward_backward(
            model, batches, device=torch.device("cpu"),
            data_parallel_size=dims.dp_size, data_parallel_group=group, context_parallel=context_parallel,
        )
        if step == 0:
            watch.remove()
            positions = {"rows": [b["tokens"].shape[1] for b in batches], "seen": seen}
        norms.append(optimizer_step(model, optimizer, max_grad_norm=1.0))
        losses.append(result.loss)
    weights = {k: full(v) for k, v in unwrap(model).state_dict().items()}
    moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    return {"losses": losses, "norms": norms, "weights": weights, "moved": moved, "positions": positions}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, mode, data, layout in RUNS:
        strategy, tp, cp, micro_steps = LAYOUTS[layout]
        dims = parallel_dims(strategy=strategy, world_size=world, local_world_size=world, device_type="cpu",
                             tensor_parallel=tp, rank=rank, context_parallel=cp,
                             shard_size=HSDP_SHARD_SIZE.get(layout))
        mesh = dims.build_mesh("cpu")
        for method in CP_METHODS:
            result = train(name, mode, data, dims, mesh, dims.context_parallel("cpu", method), micro_steps=micro_steps,
                           activation_checkpointing=layout.endswith("_ac"))
            if rank == 0:
                results[f"{name}/{mode}/{data}/{layout}/{method}"] = result
    if rank == 0:
        torch.save(results, out / "results.pt")
    recipe = out / "recipe"
    run_recipe(*RECIPE, *SAVES, *VALIDATION, "context_parallel=2", f"output_dir={recipe}")
    run_recipe(*RECIPE, *VALIDATION, "context_parallel=4", "context_parallel_method=alltoall",
               f"resume_from={recipe}/checkpoints/step_2", f"output_dir={out / 'recipe_resumed'}")
    # The last step again without the split, for the held-out loss of the same weights scored whole.
    run_recipe(*RECIPE, *VALIDATION, f"resume_from={recipe}/checkpoints/step_4", f"output_dir={out / 'recipe_cp1'}")
    # ZeRO-1 (the optimizer's state sharded over the 2 reading ranks by ZeroRedundancyOptimizer) of CP pairs: a
    # recipe strategy with no counterpart in train() above.
    run_recipe(*RECIPE, "data_parallel=zero1", "context_parallel=2", f"output_dir={out / 'recipe_zero1'}")
    # Compiled: each layer's graph broken at the attention's exchanges, which run eagerly (both methods; the second
    # reuses the first's compiled graphs around them).
    for method in CP_METHODS:
        run_recipe(*RECIPE, "context_parallel=2", f"context_parallel_method={method}", "compile=true",
                   f"output_dir={out / f'recipe_compiled_{method}'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
