"""toolkit.generation.generate: where generation stops."""

import torch

from toolkit.generation import generate
from toolkit.models.llama3 import llama3_demo


def test_stop_when_ends_generation_after_the_token_it_accepts():
    torch.manual_seed(0)
    model = llama3_demo(max_seq_len=32).eval()
    prompt = [1, 2, 3]
    free = generate(model, prompt, max_new_tokens=10)
    seen = []

    def third_token(generated: list[int]) -> bool:
        seen.append(list(generated))
        return len(generated) == 3

    assert generate(model, prompt, max_new_tokens=10, stop_when=third_token) == free[:3]
    assert seen == [free[:1], free[:2], free[:3]], "asked after every token, and not after it said stop"
