"""Generate a reply from a checkpoint, on one device.

    tune run generate --config demo prompt="reverse: hello"
    tune run generate --config demo checkpoint_dir=outputs/my_run/final temperature=0.8 top_p=0.9

The prompt is sent as one user message in the tokenizer's chat format; the reply is printed.
"""

import torch
from omegaconf import DictConfig

from toolkit.config import instantiate, recipe_main
from toolkit.generation import generate
from toolkit.training import init_distributed, materialize, precision_policy, set_seed


@recipe_main
def main(cfg: DictConfig) -> None:
    env = init_distributed(device=cfg.device)
    set_seed(cfg.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    materialize(model, device=env.device, dtype=precision_policy(cfg.dtype, device=env.device).param_dtype)
    instantiate(cfg.checkpointer).load(model)
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
