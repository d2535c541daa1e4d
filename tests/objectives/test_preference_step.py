"""preference_forward_backward: one step of pairs on a tiny LoRA Llama, against the loss computed from the model's
whole logits in float64 (the base as reference, the adapters switched off); the same step whatever the split into
micro-batches (another padding); a precomputed reference equal to the live one."""

import math

import pytest
import torch

from tests.modules.test_linear_cross_entropy import _lora_model
from toolkit.data import preference_collate
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.modules.peft import disable_adapters, set_trainable_params, get_adapter_params
from toolkit.objectives.preference import PreferenceSettings, lora_reference, preference_forward_backward
from toolkit.training.metrics import _loss_line

CPU = torch.device("cpu")
IGNORE = CROSS_ENTROPY_IGNORE_INDEX


def pairs(vocab: int) -> list[dict]:
    """Four pairs of prompts and answers of different lengths (the prompt's labels ignored), shifted labels."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for prompt_len, chosen_len, rejected_len in [(3, 4, 6), (5, 2, 2), (2, 7, 3), (4, 3, 5)]:
        sample = {}
        prompt = torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()
        for name, n in (("chosen", chosen_len), ("rejected", rejected_len)):
            answer = torch.randint(0, vocab, (n,), generator=generator).tolist()
            tokens = prompt + answer
            sample[f"{name}_tokens"] = tokens
            sample[f"{name}_labels"] = [IGNORE] * (prompt_len - 1) + answer + [IGNORE]
        out.append(sample)
    return out


def model_and_batches(split: int):
    model = _lora_model()
    set_trainable_params(model, get_adapter_params(model))
    vocab = model.embed_tokens.weight.shape[0]
    rows = pairs(vocab)
    size = len(rows) // split
    batches = [preference_collate(rows[i : i + size], pad_id=0) for i in range(0, len(rows), size)]
    return model, batches, rows


def reference_rewards(model, rows, beta: float) -> list[tuple[float, float]]:
    """Each pair's rewards ``beta * (pi - ref)`` of its chosen and rejected answers, each log-probability summed over
    an answer from the float64 log-softmax of the model's logits for that row alone (no padding)."""

    def logp(tokens, labels) -> float:
        logits = model(torch.tensor([tokens])).double()[0]
        picked = [logits[t].log_softmax(-1)[label] for t, label in enumerate(labels) if label != IGNORE]
        return float(sum(picked))

    rewards = []
    with torch.no_grad():
        for row in rows:
            policy = [logp(row[f"{n}_tokens"], row[f"{n}_labels"]) for n in ("chosen", "rejected")]
            with disable_adapters(model):
                ref = [logp(row[f"{n}_tokens"], row[f"{n}_labels"]) for n in ("chosen", "rejected")]
            rewards.append((beta * (policy[0] - ref[0]), beta * (policy[1] - ref[1])))
    return rewards


def reference_dpo(model, rows, beta: float) -> float:
    """The mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), in float64."""
    losses = [math.log1p(math.exp(-(chosen - rejected))) for chosen, rejected in reference_rewards(model, rows, beta)]
    return sum(losses) / len(losses)


def step(model, batches, settings, **kwargs):
    return preference_forward_backward(model, batches, settings=settings, device=CPU, data_parallel_size=1, **kwargs)


def test_a_dpo_step_is_the_mean_over_pairs_and_does_not_depend_on_the_micro_batches():
    settings = PreferenceSettings(loss="dpo", beta=0.5)
    results, grads = [], []
    for split in (1, 2, 4):  # one micro-batch of 4 pairs, 2 of 2, 4 of 1: padded to other lengths
        model, batches, rows = model_and_batches(split)
        results.append(step(model, batches, settings, reference=lora_reference(model)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # float32 through the model against float64 from its logits: 1e-6 on a loss of ~0.7.
    assert results[0].loss == pytest.approx(reference_dpo(model, rows, 0.5), abs=1e-6)
    assert results[0].metrics["pairs"] == 4
    for result, grad in zip(results[1:], grads[1:]):
        assert result.loss == pytest.approx(results[0].loss, rel=1e-6)
        assert result.metrics == pytest.approx(results[0].metrics, rel=1e-5, abs=1e-7)
        for key, value in grads[0].items():
            torch.testing.assert_close(grad[key], value, rtol=1e-5, atol=1e-7, msg=key)
    metrics = results[0].metrics
    assert metrics["reward_margin"] == pytest.approx(metrics["rewards_chosen"] - metrics["rewards_rejected"])
    assert 0 <= metrics["reward_accuracy"] <= 1 and metrics["logps_chosen"] < 0


def test_a_precomputed_reference_is_the_live_one():
    settings = PreferenceSettings(loss="dpo", beta=0.5)
    model, batches, _ = model_and_batches(2)
    live = step(model, batches, settings, reference=lora_reference(model))
    for batch in batches:
        with torch.no_grad(), disable_adapters(model):
            batch["ref_logps"] = model(batch["tokens"], labels=batch["labels"], per_sequence=True)
    stored = step(model, batches, settings)
    assert stored.loss == pytest.approx(live.loss, rel=1e-6) and stored.metrics == pytest.approx(live.metrics)


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_the_other_losses_step_alike_on_any_split(loss):
    settings = PreferenceSettings(loss=loss, beta=0.5)
    results = []
    for split in (1, 4):
        model, batches, _ = model_and_batches(split)
        results.append(step(model, batches, settings, reference=lora_reference(model)
                            if settings.needs_reference else None))
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-6) and math.isfinite(results[0].loss)


def test_a_loss_scaler_scales_the_gradients_only():
    # fp16's loss scaling: the backward of the scaled loss, the step's loss and metrics as without it.
    settings = PreferenceSettings(loss="dpo", beta=0.5)
    model, batches, _ = model_and_batches(2)
    plain = step(model, batches, settings, reference=lora_reference(model))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    scaled = step(model, batches, settings, reference=lora_reference(model), grad_scaler=scaler)
    assert scaled.loss == plain.loss and scaled.metrics == plain.metrics
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(param.grad, 64.0 * grads[name], rtol=1e-6, atol=0, msg=name)


def test_the_reward_accuracy_and_margin_the_console_shows_are_the_float64_ones():
    # Adapters moved off zero, so that the policy differs from its reference and the rewards do not all tie.
    settings = PreferenceSettings(loss="dpo", beta=0.5)
    model, batches, rows = model_and_batches(2)
    generator = torch.Generator().manual_seed(3)  # (a seed whose pairs go both ways)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    metrics = step(model, batches, settings, reference=lora_reference(model)).metrics
    rewards = reference_rewards(model, rows, 0.5)
    accuracy = sum(chosen > rejected for chosen, rejected in rewards) / len(rewards)
    margin = sum(chosen - rejected for chosen, rejected in rewards) / len(rewards)
    assert 0 < accuracy < 1 and abs(margin) > 1e-3  # neither all ties nor all one way: a number to compare
    assert metrics["reward_accuracy"] == accuracy
    # float32 log-probabilities through the model against float64 from its logits (sums of a few tokens of ~6).
    assert metrics["reward_margin"] == pytest.approx(margin, abs=1e-5)
    line = _loss_line({"step": 1, "loss": 0.7, **metrics}, total_steps=2)
    assert f"  reward_acc {accuracy:.3f}  margin {margin:.4f}" in line
