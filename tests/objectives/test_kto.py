"""KTO against its published formula (Ethayarajh et al., 2024, Eq. 8), written out again here in float64 with
Python's math: the per-answer loss and its gradients (central finite differences of that formula); one step on a
tiny LoRA Llama against the loss computed from the model's whole logits in float64, with the reference point taken
over the whole global batch, and the same step whatever the split into micro-batches; a precomputed reference equal
to the live one. Tolerances: float32's on per-answer values; 1e-6 on a step's loss (float32 through the model)."""

import math
from functools import partial

import pytest
import torch

from tests.modules.test_linear_cross_entropy import _lora_model
from toolkit.data import kto_collate
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.modules.peft import disable_adapters, get_adapter_params, set_trainable_params
from toolkit.objectives.kto import check_kto_balance, kto_forward_backward, kto_losses
from toolkit.objectives.preference import PreferenceSettings, lora_reference
from toolkit.training.metrics import _loss_line

CPU = torch.device("cpu")
IGNORE = CROSS_ENTROPY_IGNORE_INDEX
BETA = 0.3


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def formula(pi: float, ref: float, desirable: bool, *, z0: float, beta: float, lambda_d: float, lambda_u: float):
    """KTO's loss of one answer: lambda_y - v(x, y), v = lambda_D sigma(beta (r - z0)) for a desirable answer and
    lambda_U sigma(beta (z0 - r)) for an undesirable one, r = log pi / pi_ref."""
    r = pi - ref
    if desirable:
        return lambda_d - lambda_d * _sigmoid(beta * (r - z0))
    return lambda_u - lambda_u * _sigmoid(beta * (z0 - r))


@pytest.mark.parametrize("z0,weights", [(0.0, (1.0, 1.0)), (0.7, (1.0, 1.0)), (0.4, (1.33, 0.8))])
def test_the_loss_and_its_gradients_are_the_published_formula(z0, weights):
    generator = torch.Generator().manual_seed(0)
    policy = (-torch.rand(6, generator=generator) * 20).requires_grad_()
    values = policy.detach().clone()
    reference = -torch.rand(6, generator=generator) * 20
    desirable = torch.tensor([True, False, True, True, False, False])
    loss, rewards = kto_losses(policy, reference, desirable, kl=z0, beta=BETA, desirable_weight=weights[0],
                               undesirable_weight=weights[1])
    loss.sum().backward()
    torch.testing.assert_close(rewards, BETA * (policy - reference).detach())

    def theirs(i: int, d: float = 0.0) -> float:
        return formula(float(values[i]) + d, float(reference[i]), bool(desirable[i]), z0=z0, beta=BETA,
                       lambda_d=weights[0], lambda_u=weights[1])

    for i in range(6):
        assert float(loss[i].detach()) == pytest.approx(theirs(i), rel=1e-5, abs=1e-6)
        step = 1e-4
        grad = (theirs(i, step) - theirs(i, -step)) / (2 * step)
        assert float(policy.grad[i]) == pytest.approx(grad, rel=1e-4, abs=1e-7)
        # A desirable answer's loss falls as it gains on the reference; an undesirable one's rises.
        assert (float(policy.grad[i]) < 0) == bool(desirable[i])


@pytest.mark.parametrize("kwargs,message", [
    ({"beta": 0.0}, "beta and the weights must be positive"),
    ({"desirable_weight": -1.0}, "beta and the weights must be positive"),
    ({"kl": -0.1}, "clamped at 0"),
])
def test_bad_settings_are_refused(kwargs, message):
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=message):
        kto_losses(x, x, torch.tensor([True, False]), **{"kl": 0.0, "beta": BETA, **kwargs})


def test_the_balance_advice_is_the_papers_range():
    assert check_kto_balance(50, 50, desirable_weight=1.0, undesirable_weight=1.0) is None  # 1
    assert check_kto_balance(4, 3, desirable_weight=1.0, undesirable_weight=1.0) is None  # 4/3
    advice = check_kto_balance(10, 90, desirable_weight=1.0, undesirable_weight=1.0)
    assert advice.startswith("kto: desirable_weight x 10 desirable / (undesirable_weight x 90 undesirable) = 0.11")
    assert advice.endswith("(desirable_weight 9 to 12)")
    assert "no undesirable answers" in check_kto_balance(5, 0, desirable_weight=1.0, undesirable_weight=1.0)


def answers(vocab: int) -> list[dict]:
    """Six prompts with answers of different lengths, three desirable; each prompt's KL sequence takes the next
    sample's answer (as toolkit.data.UnpairedDataset pairs them). Shifted labels, the prompts' ignored."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(3, 4), (5, 2), (2, 7), (4, 3), (3, 3), (6, 2)]
    prompts = [torch.randint(0, vocab, (p,), generator=generator).tolist() for p, _ in shapes]
    replies = [torch.randint(0, vocab, (n,), generator=generator).tolist() for _, n in shapes]

    def sequence(prompt: list[int], reply: list[int]) -> tuple[list[int], list[int]]:
        return prompt + reply, [IGNORE] * (len(prompt) - 1) + reply + [IGNORE]

    out = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        tokens, labels = sequence(prompt, reply)
        kl_tokens, kl_labels = sequence(prompt, replies[(i + 1) % len(replies)])
        out.append({"completion_tokens": tokens, "completion_labels": labels, "kl_tokens": kl_tokens,
                    "kl_labels": kl_labels, "desirable": i % 2 == 0})
    return out


def model_and_batches(split: int):
    model = _lora_model()
    set_trainable_params(model, get_adapter_params(model))
    rows = answers(model.embed_tokens.weight.shape[0])
    # A few steps up the KL sequences' likelihood: the policy is no longer its reference, and z0 is above 0.
    whole = kto_collate(rows, pad_id=0)
    optimizer = torch.optim.SGD(list(get_adapter_params(model).values()), lr=0.05)
    for _ in range(3):
        kl_rows = slice(len(rows), None)
        (-model(whole["tokens"][kl_rows], labels=whole["labels"][kl_rows], per_sequence=True).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    size = len(rows) // split
    return model, [kto_collate(rows[i : i + size], pad_id=0) for i in range(0, len(rows), size)], rows


def log_ratio(model, row, name: str) -> float:
    """log pi - log ref of a row's ``name`` sequence (``completion`` or ``kl``), each summed over its trained tokens
    from the float64 log-softmax of the model's logits for that row alone (no padding); the reference is the model
    with its adapters off."""

    def logp(tokens, labels) -> float:
        logits = model(torch.tensor([tokens])).double()[0]
        return float(sum(logits[t].log_softmax(-1)[label] for t, label in enumerate(labels) if label != IGNORE))

    with torch.no_grad():
        policy = logp(row[f"{name}_tokens"], row[f"{name}_labels"])
        with disable_adapters(model):
            return policy - logp(row[f"{name}_tokens"], row[f"{name}_labels"])


def reference_kto(model, rows, settings) -> tuple[float, float]:
    """The step's loss and z0 in float64 (:func:`log_ratio`): z0 the clamped mean log-ratio over every KL sequence
    of the batch, the loss the mean of the formula above."""
    ratio = partial(log_ratio, model)
    with torch.no_grad():
        z0 = max(0.0, sum(ratio(row, "kl") for row in rows) / len(rows))
        losses = [formula(ratio(row, "completion"), 0.0, row["desirable"], z0=z0, beta=settings.beta,
                          lambda_d=settings.desirable_weight, lambda_u=settings.undesirable_weight) for row in rows]
    return sum(losses) / len(losses), z0


def step(model, batches, settings, **kwargs):
    return kto_forward_backward(model, batches, settings=settings, device=CPU, data_parallel_size=1, **kwargs)


def test_a_kto_step_takes_its_reference_point_over_the_global_batch_whatever_the_split():
    settings = PreferenceSettings(loss="kto", beta=0.5, desirable_weight=1.2, undesirable_weight=0.9)
    results, grads = [], []
    for split in (1, 2, 6):  # one micro-batch of 6 answers, 2 of 3, 6 of 1: the same z0 and loss
        model, batches, rows = model_and_batches(split)
        results.append(step(model, batches, settings, reference=lora_reference(model)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    loss, z0 = reference_kto(model, rows, settings)
    assert z0 > 0  # (the clamp is not what makes it agree)
    assert results[0].loss == pytest.approx(loss, abs=1e-6)
    assert results[0].metrics["kl"] == pytest.approx(z0, rel=1e-5)
    assert results[0].metrics["desirable"] == results[0].metrics["undesirable"] == 3
    for result, grad in zip(results[1:], grads[1:]):
        assert result.loss == pytest.approx(results[0].loss, rel=1e-6)
        assert result.metrics == pytest.approx(results[0].metrics, rel=1e-5, abs=1e-7)
        for key, value in grads[0].items():
            torch.testing.assert_close(grad[key], value, rtol=1e-5, atol=1e-7, msg=key)
    metrics = results[0].metrics
    assert metrics["reward_margin"] == pytest.approx(metrics["rewards_desirable"] - metrics["rewards_undesirable"])


def test_the_reward_means_the_console_shows_are_the_float64_ones():
    settings = PreferenceSettings(loss="kto", beta=0.5)
    model, batches, rows = model_and_batches(2)
    metrics = step(model, batches, settings, reference=lora_reference(model)).metrics
    rewards = {kind: [0.5 * log_ratio(model, row, "completion") for row in rows if row["desirable"] == kind]
               for kind in (True, False)}
    desirable, undesirable = (sum(rewards[kind]) / len(rewards[kind]) for kind in (True, False))
    assert abs(desirable - undesirable) > 1e-3  # (a margin to compare)
    # float32 log-probabilities through the model against float64 from its logits.
    assert metrics["rewards_desirable"] == pytest.approx(desirable, abs=1e-5)
    assert metrics["rewards_undesirable"] == pytest.approx(undesirable, abs=1e-5)
    line = _loss_line({"step": 1, "loss": 0.7, **metrics}, total_steps=2)
    assert (f"  margin {metrics['reward_margin']:.4f}  r_desirable {metrics['rewards_desirable']:.4f}  "
            f"r_undesirable {metrics['rewards_undesirable']:.4f}") in line


def test_a_precomputed_reference_is_the_live_one():
    settings = PreferenceSettings(loss="kto", beta=0.5)
    model, batches, _ = model_and_batches(2)
    live = step(model, batches, settings, reference=lora_reference(model))
    for batch in batches:
        with torch.no_grad(), disable_adapters(model):
            batch["ref_logps"] = model(batch["tokens"], labels=batch["labels"], per_sequence=True)
    stored = step(model, batches, settings)
    assert stored.loss == pytest.approx(live.loss, rel=1e-6) and stored.metrics == pytest.approx(live.metrics)
