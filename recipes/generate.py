"""Generate a reply from a checkpoint, on one device.

    tune run generate --config demo prompt="reverse: hello"
    tune run generate --config demo checkpoint_dir=outputs/lora_finetune_demo/final/merged temperature=0.8 top_p=0.9
    tune run generate --config demo checkpoint_dir=null adapter_dir=outputs/lora_finetune_demo/final/adapter

The weights come from ``checkpoint_dir`` (``null``: random from ``seed``, the LoRA demo's base). With ``adapter_dir``,
a PEFT LoRA/DoRA adapter folder is loaded on top: a plain ``model`` is built as its LoRA/DoRA version with the
settings of the adapter's ``adapter_config.json`` (a LoRA builder in ``model`` is used as it is). The prompt is sent
as one user message in the tokenizer's chat format; the reply is printed.
"""

import torch
from omegaconf import DictConfig

from toolkit.config import Float, Int, Schema, Str, instantiate, one_of, recipe_main
from toolkit.generation import generate
from toolkit.modules.peft import adapter_modules
from toolkit.training import init_distributed, materialize, precision_policy, set_seed
from toolkit.training.peft import adapter_linear, fill_adapter_model
from toolkit.training.schema import MODEL_KEYS

# Every config key this recipe reads, checked before anything is loaded (toolkit/training/schema.py has the shared
# ones). top_k 0 and top_p 0 switch the filter off, as in transformers.
SCHEMA = Schema({
    **MODEL_KEYS,
    "adapter_dir": Str(null=True, required=False),
    "prompt": one_of(Str(empty=True), Float()),  # `prompt=42` is read as a number, and sent as its text
    "max_new_tokens": Int(ge=1),
    "temperature": Float(ge=0),
    "top_k": Int(ge=0, null=True),
    "top_p": Float(ge=0, le=1, null=True),
}).without("sdpa_backend")


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    env = init_distributed(device=cfg.device)
    set_seed(cfg.seed)  # the same seed as training gives the same random base (LoRA on a random base)
    checkpointer = instantiate(cfg.checkpointer)
    adapter_dir = cfg.get("adapter_dir")  # absent from configs copied before it existed
    with torch.device("meta"):
        model = instantiate(cfg.model)
        if adapter_dir is not None and not adapter_modules(model):
            # A plain builder: its LoRA/DoRA version, with the settings the adapter's adapter_config.json records.
            linear = adapter_linear(adapter_dir, model_family=checkpointer.family_name)
            model = instantiate(cfg.model, linear=linear)
    materialize(model, device=env.device, dtype=precision_policy(cfg.dtype, device=env.device).param_dtype)
    # The base (or random from the seed), then the adapter's weights on a LoRA model.
    fill_adapter_model(model, checkpointer, adapter_dir=adapter_dir)
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
    print(tokenizer.decode(reply))


if __name__ == "__main__":
    main()
