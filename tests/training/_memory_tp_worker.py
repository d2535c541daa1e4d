"""Worker for test_memory_tp.py, run under torchrun on 2 processes (gloo, CPU): what a real tensor-parallel model
holds on each rank, for the memory plan to be compared with.

For every case of :data:`CASES` (tiny Llama, Qwen 2.5 with biases and tied embeddings, Gemma 2 with soft-caps,
LoRA with an adapted output, DoRA), the model is split over both ranks by ``apply_tp`` (fp32), takes one
forward and backward with the fused vocabulary-parallel loss and one AdamW step, and each rank records the bytes
of its local shards: parameters and buffers, gradients, optimizer state (the scalar ``step`` counters aside),
and the tensors autograd saves inside the decoder layers (the part of the activations that tensor parallelism
splits; storages counted once, parameters' own storages not at all). Rank zero gathers every rank's numbers and
saves them to ``sys.argv[1]`` (``torch.save``).

Then, in the same launch, the full fine-tune recipe runs one step of the demo into ``sys.argv[2]`` with
``tensor_parallel: auto`` and ``data_parallel: auto`` on a device of :data:`RECIPE_MEMORY_GB`, where only the
split fits (its line, on stdout, says what it picked).
"""

import runpy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.training._tp_worker import build as build_case
from toolkit.cli._catalog import recipe_schema
from toolkit.config import apply_overrides, load_config, validate
from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3
from toolkit.models.qwen2_5 import qwen2_5
from toolkit.modules.peft import init_adapters
from toolkit.parallel import apply_tp
from toolkit.paths import configs_dir, recipes_dir
from toolkit.training import init_weights
from toolkit.training.init import materialize

BATCH, SEQ, VOCAB = 2, 16, 96
SIZES = dict(vocab_size=VOCAB, num_heads=8, num_kv_heads=4, intermediate_dim=128, max_seq_len=32)
MODELS = {
    "llama": lambda linear: llama3(**SIZES, num_layers=2, embed_dim=64, linear=linear),
    "qwen": lambda linear: qwen2_5(**SIZES, num_layers=1, embed_dim=64, tie_word_embeddings=True, linear=linear),
    "gemma": lambda linear: gemma2(
        **SIZES, num_layers=2, embed_dim=48, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        attn_logit_softcap=5.0, final_logit_softcap=3.0, linear=linear,
    ),
}
# (model, mode): every split apply_tp makes (column, row, vocabulary, tied, biases, LoRA's A and B, DoRA's
# magnitude, a LoRA output projection).
CASES = [("llama", "full"), ("qwen", "full"), ("gemma", "full"), ("llama", "lora"), ("gemma", "dora")]


def build(name: str, mode: str) -> torch.nn.Module:
    """The case's model on the meta device, only its adapters trainable when it has any (as the LoRA recipe)."""
    return build_case(name, mode, models=MODELS)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def measure(name: str, mode: str, tp_mesh) -> dict[str, int]:
    model = build(name, mode)
    apply_tp(model, tp_mesh=tp_mesh)
    materialize(model, device=torch.device("cpu"))
    init_weights(model)
    init_adapters(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)

    # Saved tensors inside the layers only: a layer's pre-hook opens the window, its hook closes it.
    state = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in state:
                saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    generator = torch.Generator().manual_seed(0)  # the same tokens on both ranks (a TP group reads one batch)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens)
    loss.backward()
    grads = _nbytes(p.grad for p in trainable)
    optimizer.step()
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and _local(t).dim() > 0]
    return dict(
        params=_nbytes(model.parameters()) + _nbytes(model.buffers()),
        grads=grads,
        optimizer_state=_nbytes(states),
        layer_activations=sum(saved.values()),
    )


# The demo (micro batches of 16 of a batch of 32) on 2 processes, fp32: without TP the smallest layout needs
# 56.9 MiB per process, ddp x tp2 37.5 MiB (tune plan full_finetune --config demo --nproc_per_node 2); 90% of
# 50 MiB lies between.
RECIPE_MEMORY_GB = 0.0488


def run_recipe(output_dir: str) -> None:
    """The full fine-tune recipe's ``train`` (its ``main`` would leave the process group), checked as `tune run`
    checks it."""
    cfg = load_config(configs_dir() / "full_finetune" / "demo.yaml")
    apply_overrides(cfg, [
        "tensor_parallel=auto", "data_parallel=auto", f"device_memory_gb={RECIPE_MEMORY_GB}", "max_steps=1",
        "~eval_tasks", "~validation_dataset", "progress_bar=false", "dataset.num_samples=256",
        f"output_dir={output_dir}",
    ])
    validate(cfg, schema=recipe_schema(recipes_dir() / "full_finetune.py"), world_size=dist.get_world_size())
    recipe = runpy.run_path(str(recipes_dir() / "full_finetune.py"))
    with recipe["sdpa_preference"](cfg.get("sdpa_backend")):
        recipe["train"](cfg)


def main() -> None:
    dist.init_process_group("gloo")
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))["tp"]
    results = {}
    for name, mode in CASES:
        mine = measure(name, mode, tp_mesh)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[f"{name} {mode}"] = every
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
    run_recipe(sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
