"""What a real tensor-parallel model holds on each rank, for test_memory_tp.py's comparison with the memory plan;
measured inside the 4-process launch of :mod:`tests.training._tp_worker` (its processes' start is most of what a
launch of its own would cost).

For every case of :data:`CASES` (tiny Llama, Qwen 2.5 with biases and tied embeddings, Gemma 2 with soft-caps,
LoRA with an adapted output, DoRA), the model is split over a pair of ranks by ``apply_tp`` (fp32), takes one
forward and backward with the fused vocabulary-parallel loss and one AdamW step, and each rank records the bytes
of its local shards: parameters and buffers, gradients, optimizer state (the scalar ``step`` counters aside),
and the tensors autograd saves inside the decoder layers (the part of the activations that tensor parallelism
splits; storages counted once, parameters' own storages not at all).

Then, in the same launch, the full fine-tune recipe runs one step of the demo with :data:`AUTO_RECIPE`:
``tensor_parallel: auto`` and ``data_parallel: auto`` on a device of :data:`RECIPE_MEMORY_GB`, where only the
split fits (its line, on stdout, says what it picked).
"""

import torch
from torch.distributed.tensor import DTensor

from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3
from toolkit.models.qwen2_5 import qwen2_5
from toolkit.modules.peft import init_adapters
from toolkit.parallel import apply_tp
from toolkit.training import init_weights
from toolkit.training.init import materialize

BATCH, SEQ, VOCAB = 2, 16, 96
SIZES = dict(vocab_size=VOCAB, num_heads=8, num_kv_heads=4, intermediate_dim=128, max_seq_len=32)
# The cases' models, for tests.training._tp_worker.build(name, mode, models=MODELS).
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes of the tensors' local shards on this rank (of DTensors, their local tensors)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def measure(model: torch.nn.Module, tp_mesh) -> dict[str, int]:
    """Split the meta-device ``model`` over ``tp_mesh``, train it one step, and return this rank's bytes."""
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
    grads = local_bytes(p.grad for p in trainable)
    optimizer.step()
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and _local(t).dim() > 0]
    return dict(
        params=local_bytes(model.parameters()) + local_bytes(model.buffers()),
        grads=grads,
        optimizer_state=local_bytes(states),
        layer_activations=sum(saved.values()),
    )


# The demo (micro batches of 8 of a batch of 32) on 4 processes, fp32: without TP the smallest layout needs
# 30.0 MiB per process (zero3), ddp x tp2 24.3 MiB (tune plan full_finetune --config demo --nproc_per_node 4
# --device-memory-gb 0.0293 micro_batch_size=8); 90% of 30 MiB, 27.0 MiB, lies between.
RECIPE_MEMORY_GB = 0.0293
AUTO_RECIPE = [
    "tensor_parallel=auto", "data_parallel=auto", f"device_memory_gb={RECIPE_MEMORY_GB}", "micro_batch_size=8",
    "max_steps=1",
    "~eval_tasks", "~validation_dataset", "progress_bar=false", "dataset.num_samples=256",
]
