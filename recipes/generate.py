"""Generate a reply from a checkpoint, on one device, or with one model split over several (tensor parallelism).

    tune run generate --config demo prompt="reverse: hello"
    tune run generate --config demo checkpointer.checkpoint_dir=outputs/lora_finetune_demo/final/merged temperature=0.8
    tune run generate --config demo checkpointer.checkpoint_dir=null \
        adapter_dir=outputs/lora_finetune_demo/final/adapter
    tune run generate_distributed --nproc_per_node 2 --config demo tensor_parallel=2 prompt="reverse: hello"

The weights come from ``checkpointer.checkpoint_dir``, as in every recipe (``null``: random from ``seed``, the LoRA
demo's base). With ``adapter_dir``,
a PEFT LoRA/DoRA adapter folder is loaded on top: a plain ``model`` is built as its LoRA/DoRA version with the
settings of the adapter's ``adapter_config.json`` (a LoRA builder in ``model`` is used as it is). The prompt is sent
as one user message in the tokenizer's chat format; the reply is printed.

With ``tensor_parallel: N`` on N processes, every layer is split over them (``toolkit.parallel.apply_tp``; each
process loads only its part of the weights, and its KV cache holds its share of the heads); the logits of each
step are gathered, so every process picks the same token, and the reply is the one-process reply.
"""

from collections.abc import Iterator
from functools import partial

import torch
from omegaconf import DictConfig

from toolkit.config import Context, Float, Int, Schema, Str, instantiate, one_of, recipe_main, rule
from toolkit.generation import generate
from toolkit.modules.peft import adapter_modules
from toolkit.parallel import parallel_dims
from toolkit.training import destroy_distributed, init_distributed, materialize, parallelize, precision_policy, set_seed
from toolkit.checkpoint.peft import adapter_linear, fill_adapter_model
from toolkit.training.recipe_keys import MODEL_KEYS, parallelism_splits_the_model


@rule("tensor_parallel")
def tensor_parallel_spans_the_processes(ctx: Context) -> Iterator[tuple[str, str]]:
    """One reply, from one model: several processes split it (tensor parallelism) and all take part."""
    tp, world = ctx.get("tensor_parallel", 1), ctx.world_size
    if world is not None and world != tp:
        yield "tensor_parallel", (
            f"{tp}, but the launch starts {world} processes; generation splits one model over every process: "
            f"set tensor_parallel={world}" + (" (or run it on one process)" if world > 1 else "")
        )


# Every config key this recipe reads, checked before anything is loaded (toolkit/training/recipe_keys.py has the shared
# ones). top_k 0 and top_p 0 switch the filter off, as in transformers.
SCHEMA = Schema({
    **MODEL_KEYS,
    "adapter_dir": Str(null=True, required=False),
    "prompt": one_of(Str(empty=True), Float()),  # `prompt=42` is read as a number, and sent as its text
    "max_new_tokens": Int(ge=1),
    "temperature": Float(ge=0),
    "top_k": Int(ge=0, null=True),
    "top_p": Float(ge=0, le=1, null=True),
    "tensor_parallel": Int(ge=1, required=False),
    "dist_timeout_s": Float(gt=0, required=False),
}, rules=(tensor_parallel_spans_the_processes, parallelism_splits_the_model),
    # Read at the top level before every recipe's vocabulary was one: said once, in one line, rather than ignored.
    moved={"checkpoint_dir": "checkpointer.checkpoint_dir"},
).without("sdpa_backend")


def generate_reply(cfg: DictConfig) -> None:
    env = init_distributed(device=cfg.device, timeout_s=cfg.get("dist_timeout_s", 600))
    dims = parallel_dims(
        strategy="ddp", world_size=env.world_size, local_world_size=env.local_world_size,
        tensor_parallel=cfg.get("tensor_parallel", 1), rank=env.rank, device_type=env.device.type,
    )
    set_seed(cfg.seed)  # the same seed as training gives the same random base (LoRA on a random base)
    checkpointer = instantiate(cfg.checkpointer)
    adapter_dir = cfg.get("adapter_dir")  # absent from configs copied before it existed
    with torch.device("meta"):
        model = instantiate(cfg.model)
        if adapter_dir is not None and not adapter_modules(model):
            # A plain builder: its LoRA/DoRA version, with the settings the adapter's adapter_config.json records.
            linear = adapter_linear(adapter_dir, model_family=checkpointer.family_name)
            model = instantiate(cfg.model, linear=linear)
    # The base (or random from the seed), then the adapter's weights on a LoRA model.
    fill = partial(fill_adapter_model, checkpointer=checkpointer, adapter_dir=adapter_dir)
    dtype = precision_policy(cfg.dtype, device=env.device).param_dtype
    if dims.tp > 1:
        # Split on the meta device: each process allocates and loads only its part of every layer.
        model = parallelize(model, dims=dims, device=env.device, dtype=dtype, fill=fill)
    else:
        materialize(model, device=env.device, dtype=dtype)
        fill(model)
    tokenizer = instantiate(cfg.tokenizer)

    prompt = tokenizer.prompt_tokens([{"role": "user", "content": str(cfg.prompt)}])
    generator = torch.Generator(device=env.device).manual_seed(cfg.seed)
    reply = generate(
        model,
        prompt,
        max_new_tokens=cfg.max_new_tokens,
        stop_tokens=tokenizer.stop_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        generator=generator,
    )
    if env.is_rank_zero:
        print(tokenizer.decode(reply))


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    try:
        generate_reply(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
