"""Worker for test_tensor_parallel.py, run under torchrun on 4 processes (gloo, CPU) into the folder
``sys.argv[1]``: every case (a tiny model and a fine-tuning mode) trained on every tensor-parallel layout of the 4
ranks, one after the other, in one launch.

The layouts, all from one 4-rank mesh:

- ``tp2``: two independent tensor-parallel pairs, each training on the whole batch (no data parallelism);
- ``tp4``: the 4 ranks split each layer;
- ``ddp_tp2``, ``zero2_tp2``, ``zero3_tp2``, ``hsdp_tp2``: 2 data-parallel ranks (DDP semantics, ZeRO-2, ZeRO-3,
  HSDP on a 2-D FSDP mesh) of tensor-parallel pairs;
- ``hsdp_r2_tp2``: HSDP with shard groups of one rank (``hsdp_shard_size: 1``), so that its replicate dimension is
  the real one: 2 replicas of a tensor-parallel pair (``hsdp_tp2`` shards over the 2 instead, a replica of one).

After training, each run generates from a fixed prompt with the trained model (greedy, and sampled with top-k and
top-p from a seeded generator: the logits are gathered whole, so every rank draws the same token), and scores the
prompt's logits.

Every run trains 5 steps of a global batch of 4 rows of different lengths (prompt positions and padding ignored),
with AdamW and the gradient norm clipped; the layouts differ in how a rank's share is cut into micro-batches too.
Rank zero saves, per case and layout, the losses, the gradient norms, the final weights (gathered whole) and the
generations to ``results.pt`` (``torch.save``); the test computes the one-process references itself
(:func:`train`, and the recipe) and compares.

Then, on 4 processes, the same launch serves the tests that need 4 processes (starting them is most of a launch's
cost; tests/training/conftest.py shares it):

- the memory plan's measures of a real TP model on each pair of ranks (:mod:`tests.training._tp_memory`), into
  ``memory.pt``;
- the full fine-tune recipe on the demo, zero3 x tensor_parallel 2 with sequence parallelism, into ``recipe/``,
  saving step checkpoints, and again into ``recipe_resumed/``, resumed from its step 2; then the LoRA recipe on that
  layout into ``recipe_lora/``, on the model the first run trained;
- the recipe with ``tensor_parallel: auto`` where only the split fits, into ``auto/`` (its stdout in
  ``auto.stdout``), and on HSDP's 2 x 2 mesh without TP (test_parallel_parity.py) into ``hsdp/``.
"""

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.training import _tp_memory as memory
from toolkit.cli._catalog import recipe_schema
from toolkit.config import apply_overrides, load_config, validate
from toolkit.generation import generate
from toolkit.models._decoder import plain_linear
from toolkit.models._lora import lora_linear
from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3
from toolkit.models.qwen2_5 import qwen2_5
from toolkit.modules import Llama3RopeScaling
from toolkit.modules.peft import adapter_modules, get_adapter_params, get_merged_state_dict, init_adapters, set_trainable_params
from toolkit.modules.peft.nf4 import dequantize
from toolkit.parallel import ParallelDims, parallel_dims
from toolkit.paths import configs_dir, recipes_dir
from toolkit.training import forward_backward, init_weights, optimizer_step, parallelize

# 5 steps, each step's batch of other lengths: from the second on, AdamW updates with its state (each rank's shard
# of it), and rounding differences between layouts have steps to grow in.
STEPS, BATCH, VOCAB = 5, 4, 96
# 8 query and 4 key/value heads: grouped-query attention that tensor_parallel=4 still splits.
SIZES = dict(vocab_size=VOCAB, num_heads=8, num_kv_heads=4, intermediate_dim=128, max_seq_len=32)
MODELS = {
    # Llama 3.1's rope scaling, with an original context short enough that the test's positions see it.
    "llama": lambda linear: llama3(
        **SIZES, num_layers=1, embed_dim=64, linear=linear,
        rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=8),
    ),
    # Qwen 2.5: q/k/v biases, tied embeddings.
    "qwen": lambda linear: qwen2_5(**SIZES, num_layers=1, embed_dim=64, tie_word_embeddings=True, linear=linear),
    # Gemma 2: attention and final soft-caps, a sliding window (layer 0; layer 1 is global), scaled and tied
    # embeddings, sandwich norms.
    "gemma": lambda linear: gemma2(
        **SIZES, num_layers=2, embed_dim=48, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, attn_logit_softcap=5.0,
        final_logit_softcap=3.0, linear=linear,
    ),
}
ADAPTERS = {
    "full": None,
    # LoRA on every projection, and on Llama's (untied) output projection: a vocabulary-split B in the fused loss.
    "lora": dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True, lora_rank=4),
    # DoRA on a column-wise (q) and a row-wise (o) projection: its magnitude split with the rows, or its row norm
    # reduced over the split columns.
    "dora": dict(lora_attn_modules=["q_proj", "o_proj"], lora_rank=4, use_dora=True),
}
# QLoRA (LoRA on NF4 bases) where the weights are not split by tensor parallelism, which refuses it: the
# context-parallel layouts (_cp_worker.py).
WHOLE_WEIGHT_ADAPTERS = {
    "qlora": dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True, lora_rank=4,
                  quantize_base=True),
}
# name: (data_parallel, tensor_parallel, hsdp_shard_size, micro-batches per rank and step)
LAYOUTS = {
    "tp2": ("ddp", 2, None, 2), "tp4": ("ddp", 4, None, 1), "ddp_tp2": ("ddp", 2, None, 1),
    "zero2_tp2": ("zero2", 2, None, 1), "zero3_tp2": ("zero3", 2, None, 2), "hsdp_tp2": ("hsdp", 2, 2, 1), "hsdp_r2_tp2": ("hsdp", 2, 1, 2),
}
# Sequence parallelism on a base layout: the residual stream and norms split along the sequence too.
SEQUENCE_PARALLEL = {"tp2_sp": "tp2", "tp4_sp": "tp4", "zero3_tp2_sp": "zero3_tp2"}
# Every model and mode on every layout: the 9 cases on tp2, tp4, ddp x tp2, zero3 x tp2 and one of HSDP's two (in
# turn, so that each HSDP layout trains full, LoRA and DoRA cases of all three models between them; both for every
# case would add 9 runs), 45 runs, then 3 on ZeRO-2 x tp2 (one mode of each model) and 3 with sequence parallelism. The launch trains them in about 140 s here
# (measured; 4 processes on 2 cores wait on each other at every collective). (Llama's full fine-tune on
# zero3 x tp2 also runs through the recipe, in test_parallel_parity.py.)
CASES = [(name, mode) for name in MODELS for mode in ADAPTERS]
RUNS = [
    *((name, mode, layout) for i, (name, mode) in enumerate(CASES)
      for layout in ("tp2", "tp4", "ddp_tp2", "zero3_tp2", ("hsdp_tp2", "hsdp_r2_tp2")[i % 2])),
    ("llama", "lora", "zero2_tp2"), ("qwen", "full", "zero2_tp2"), ("gemma", "dora", "zero2_tp2"),
    ("llama", "full", "tp2_sp"), ("gemma", "full", "zero3_tp2_sp"), ("qwen", "lora", "tp4_sp"),
]


def build(name: str, mode: str, *, models: dict = MODELS) -> torch.nn.Module:
    """The case's model (from ``models``) on the meta device, only its adapters trainable when it has any."""
    adapters = {**ADAPTERS, **WHOLE_WEIGHT_ADAPTERS}[mode]
    linear = plain_linear
    if adapters is not None:
        linear = lora_linear(**adapters, apply_lora_to_output=name == "llama" and mode == "lora")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = models[name](linear)
    if adapters is not None:
        set_trainable_params(model, get_adapter_params(model))
    return model


def fill(model: torch.nn.Module) -> None:
    init_weights(model)  # every layout draws the whole tensors and keeps its part: the same values
    init_adapters(model)


def global_batch(step: int) -> list[dict[str, torch.Tensor]]:
    """The step's 4 rows: lengths 5 to 20, the first 2 or 3 positions a prompt (ignored)."""
    generator = torch.Generator().manual_seed(step)
    rows = []
    for i in range(BATCH):
        length = int(torch.randint(5, 21, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: 2 + i % 2] = -100
        rows.append({"tokens": tokens[:-1], "labels": labels})
    return rows


def micro_batches(rows: list[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` in ``count`` micro-batches, each padded to its longest row (padding ignored)."""
    size = len(rows) // count
    batches = []
    for group in (rows[i : i + size] for i in range(0, len(rows), size)):
        # Padded to a multiple of 4, as the recipes pad under sequence parallelism (4 | the TP degrees here).
        length = -(-max(len(row["tokens"]) for row in group) // 4) * 4
        tokens = torch.zeros(len(group), length, dtype=torch.long)
        labels = torch.full((len(group), length), -100)
        for j, row in enumerate(group):
            tokens[j, : len(row["tokens"])] = row["tokens"]
            labels[j, : len(row["labels"])] = row["labels"]
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, as plain values (an NF4 base dequantized)."""
    return dequantize(t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


PROMPT = [5, 17, 42, 3, 88, 9]


@torch.no_grad()
def generations(model: torch.nn.Module) -> dict:
    """What the model generates from :data:`PROMPT` (12 tokens, greedy and sampled), and the prompt's logits."""
    model.eval()
    sampled = generate(
        model, PROMPT, max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9,
        generator=torch.Generator().manual_seed(0),
    )
    return {
        "greedy": generate(model, PROMPT, max_new_tokens=12), "sampled": sampled,
        "logits": model(torch.tensor([PROMPT])).detach(),
    }


def train(
    name: str, mode: str, dims: ParallelDims, mesh=None, *, micro_steps: int = BATCH, sequence_parallel: bool = False
) -> dict:
    """Train the case on the layout ``dims`` (this rank's part of it), this rank's share of each global batch in
    ``micro_steps`` micro-batches; the losses, gradient norms, whole weights and :func:`generations`."""
    model = parallelize(build(name, mode), dims=dims, device=torch.device("cpu"), dtype=torch.float32, fill=fill,
                        sequence_parallel=sequence_parallel,
                        mesh=mesh)
    # AdamW's eps at 1e-6 (not 1e-8): its update divides by sqrt(v), which turns rounding-level gradient differences
    # on entries with near-zero gradients into larger update differences; the layouts agree on the gradients.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    initial = {k: full(v) for k, v in model.state_dict().items()}
    # The positions the first norm normalizes in the first step's forwards: a split sequence holds 1/tp of them.
    norm_positions: list[int] = []
    watch = model.layers[0].input_layernorm.register_forward_hook(
        lambda module, inputs, output: norm_positions.append(inputs[0].shape[1])
    )
    group = dims.dp_group(mesh)
    losses, norms = [], []
    for step in range(STEPS):
        share = BATCH // dims.dp_size
        mine = global_batch(step)[dims.dp_rank * share : (dims.dp_rank + 1) * share]
        batches = micro_batches(mine, micro_steps)
        result = forward_backward(
            model, batches, device=torch.device("cpu"), data_parallel_size=dims.dp_size, data_parallel_group=group,
        )
        if step == 0:
            watch.remove()
            positions = [b["tokens"].shape[1] for b in batches]
            # This rank's part of the embedding's gradient (frozen under LoRA): as many rows as its part of the table.
            weight = model.embed_tokens.weight
            embedding_rows = (local(weight).shape[0], None if weight.grad is None else local(weight.grad).shape[0])
        norms.append(optimizer_step(model, optimizer, max_grad_norm=1.0))
        losses.append(result.loss)
    weights = {k: full(v) for k, v in model.state_dict().items()}
    moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    return {
        "losses": losses, "norms": norms, "weights": weights, "moved": moved, "positions": positions,
        "embedding_rows": embedding_rows, "norm_positions": norm_positions, **merged(model), **generations(model),
    }


def local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def merged(model: torch.nn.Module) -> dict:
    """An adapted model's merged weights (as the LoRA recipe exports them, from each rank's shards), gathered whole
    here for the comparison, and the keys of those a rank held more of than of the base weight itself (none: the
    merge never gathers a base weight)."""
    if not adapter_modules(model):
        return {}
    state, dense = model.state_dict(), get_merged_state_dict(model)
    return {
        "merged": {k: full(v) for k, v in dense.items()},
        "gathered_by_merge": [k for k, v in dense.items() if local_numel(v) > local_numel(state[k])],
    }


# The demo recipe as test_parallel_parity.py runs it (its COMMON: variable-length words, 5 steps of 8 sequences in
# micro-batches of 2), here on zero3 x tensor_parallel 2: each TP pair reads its 4 sequences of a step in 2
# micro-steps.
RECIPE = [
    "dataset.word_len=[2,8]", "max_steps=5", "dataset.num_samples=256", "progress_bar=false", "~eval_tasks",
    "batch_size=8", "micro_batch_size=2",
]
# With sequence parallelism: the recipe pads every batch to a multiple of 2 and splits the norms' positions.
RECIPE_TP = ["tensor_parallel=2", "data_parallel=zero3", "sequence_parallel=true"]
RESUMED_AT = 2
# Step checkpoints at steps 2, 4 and 5 (the last).
SAVES = ["save_every_n_steps=2", "keep_last_n=null"]
# The LoRA recipe's runs (its demo: rank-16 adapters on every projection and the vocabulary-split output projection),
# writing the merged model too.
LORA = ["save_merged=true"]


def run_recipe(*overrides: str, recipe_name: str = "full_finetune", stdout: Path | None = None) -> None:
    """The full fine-tune recipe (or ``recipe_name``) on the demo with ``overrides``, checked as `tune run` checks
    it, in this process group (the recipe's ``main`` would leave the group when done; its ``train`` does not); rank
    zero's stdout into the file ``stdout`` if given."""
    cfg = load_config(configs_dir() / recipe_name / "demo.yaml")
    apply_overrides(cfg, list(overrides))
    validate(cfg, schema=recipe_schema(recipes_dir() / f"{recipe_name}.py"), world_size=dist.get_world_size())
    recipe = runpy.run_path(str(recipes_dir() / f"{recipe_name}.py"))
    output = contextlib.nullcontext(sys.stdout)
    if stdout is not None:
        output = open(stdout if dist.get_rank() == 0 else os.devnull, "w")
    with output as out, contextlib.redirect_stdout(out), recipe["sdpa_preference"](cfg.get("sdpa_backend")):
        recipe["train"](cfg)


def train_layouts(runs: list[tuple[str, str, str]], out: Path) -> None:
    """Train each of ``runs`` on its layout of this launch's ranks; rank zero saves the results to ``out``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, mode, layout in runs:
        strategy, tp, shard, micro_steps = LAYOUTS[SEQUENCE_PARALLEL.get(layout, layout)]
        dims = parallel_dims(strategy=strategy, world_size=world, local_world_size=world, shard_size=shard,
                             device_type="cpu", tensor_parallel=tp, rank=rank)
        mesh = dims.build_mesh("cpu")
        if layout in ("tp2", "tp2_sp"):
            # Each pair is a job of its own: tensor parallelism over the pair, the other mesh dimension unused (its
            # dp_shard groups are single ranks, so nothing is summed across the pairs).
            dims = ParallelDims("ddp", dp_replicate=1, dp_shard=1, tp=2, rank=rank % 2)
        result = train(name, mode, dims, mesh, micro_steps=micro_steps, sequence_parallel=layout in SEQUENCE_PARALLEL)
        if rank == 0:
            results[f"{name}/{mode}/{layout}"] = {**result, "dims": (dims.dp_replicate, dims.dp_shard, dims.tp)}
    if rank == 0:
        torch.save(results, out)


def measure_memory(out: Path) -> None:
    """Each pair of ranks measures what every case of :data:`tests.training._tp_memory.CASES` holds split over
    the pair; rank zero saves every rank's numbers to ``out``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_mesh = ParallelDims("ddp", dp_replicate=world // 2, dp_shard=1, tp=2, rank=rank).build_mesh("cpu")["tp"]
    results = {}
    for name, mode in memory.CASES:
        every = [None] * world
        dist.all_gather_object(every, memory.measure(build(name, mode, models=memory.MODELS), tp_mesh))
        results[f"{name} {mode}"] = every
    if rank == 0:
        torch.save(results, out)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    train_layouts(RUNS, out / "results.pt")
    measure_memory(out / "memory.pt")
    # The recipe itself, with no second launch: its sampler, loss normalization, step checkpoints and export
    # under TP. A run saving every 2 steps, then a run resuming from its step 2 checkpoint on the same layout.
    recipe = out / "recipe"
    run_recipe(*RECIPE, *RECIPE_TP, *SAVES, f"output_dir={recipe}")
    run_recipe(*RECIPE, *RECIPE_TP, f"resume_from={recipe}/checkpoints/step_{RESUMED_AT}",
               f"output_dir={out / 'recipe_resumed'}")
    # The LoRA recipe on the same layout, its base the model just trained: the PEFT adapter and the merged model
    # exported from each rank's shards.
    run_recipe(*RECIPE, *RECIPE_TP, *LORA, f"checkpointer.checkpoint_dir={recipe}/final",
               f"output_dir={out / 'recipe_lora'}", recipe_name="lora_finetune")
    run_recipe(*memory.AUTO_RECIPE, f"output_dir={out / 'auto'}", stdout=out / "auto.stdout")
    run_recipe(*RECIPE, "data_parallel=hsdp", "hsdp_shard_size=2", f"output_dir={out / 'hsdp'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
