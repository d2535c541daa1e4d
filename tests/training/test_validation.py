"""validation_loss: the token-weighted mean over the whole set, equal on 1 and 2 processes, DDP and FSDP2."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import run_workers
from toolkit.data import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.errors import UserError
from toolkit.training.validation import ValidationSampler, validation_loss

sys.path.insert(0, str(Path(__file__).parent))
from tests.checkpoint._export_worker import tiny_model  # noqa: E402
from _validation_worker import loader, samples  # noqa: E402

CPU = torch.device("cpu")


def float64_reference() -> tuple[float, int]:
    """Loss sum / token count written out from log-softmax in float64, one unpadded sequence at a time."""
    model = tiny_model().double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples():
            labels = torch.tensor(sample["labels"])
            log_probs = model(torch.tensor([sample["tokens"]]))[0].double().log_softmax(-1)  # [s, vocab]
            targets = (labels != CROSS_ENTROPY_IGNORE_INDEX).nonzero().squeeze(1)
            total -= log_probs[targets, labels[targets]].sum().item()
            count += len(targets)
    return total / count, count


@pytest.mark.parametrize("num_samples", [0, 1, 2, 7, 9, 10])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sampler_covers_every_sample_exactly_once(num_samples, world_size):
    shares = [list(ValidationSampler(num_samples, rank=r, world_size=world_size)) for r in range(world_size)]
    assert sorted(i for share in shares for i in share) == list(range(num_samples))
    assert [len(ValidationSampler(num_samples, rank=r, world_size=world_size)) for r in range(world_size)] == [
        len(share) for share in shares
    ]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_matches_a_float64_reference_and_restores_train_mode():
    model = tiny_model().train()
    result = validation_loss(model, loader(0, 1), device=CPU)
    loss, count = float64_reference()
    assert result["val_tokens"] == count
    # The model runs in float32 (logits ~1e-7 relative rounding) against a float64 model: 1e-5 is ample.
    assert result["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert result["val_perplexity"] == pytest.approx(math.exp(result["val_loss"]), rel=1e-12)
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())



def test_validation_leaves_the_training_rng_as_it_was():
    # A DataLoader's iterator draws a seed from the global RNG: validating must not shift the training's later
    # random numbers (dropout masks), so that a run with validation trains as one without, and resumes exactly.
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    iter(loader(0, 1))
    assert not torch.equal(torch.rand(4), expected)  # what the plain iterator does: the test can fail
    model, batches = tiny_model(), loader(0, 1)
    torch.manual_seed(0)
    validation_loss(model, batches, device=CPU)
    assert torch.equal(torch.rand(4), expected)

def test_keeps_eval_mode_and_refuses_a_set_without_targets():
    model = tiny_model().eval()
    validation_loss(model, loader(0, 1), device=CPU)
    assert not model.training
    ignored = torch.full((2, 5), CROSS_ENTROPY_IGNORE_INDEX)
    no_targets = [{"tokens": torch.ones(2, 5, dtype=torch.long), "labels": ignored}]
    with pytest.raises(UserError, match="no target tokens"):
        validation_loss(model, no_targets, device=CPU)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every rank's result on 2 processes, under DDP and under FSDP2, one after the other in one launch."""
    out = tmp_path_factory.mktemp("validation") / "result.json"
    worker = Path(__file__).parent / "_validation_worker.py"
    result = run_workers(worker, str(out), "ddp", "zero3")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_processes_give_the_one_process_loss(strategy, two_process_results):
    ranks = two_process_results[strategy]
    assert [r["batches_on_this_rank"] for r in ranks] == [2, 3], "uneven batch counts exercise the idle forwards"
    assert all(r["restored_train_mode"] for r in ranks)
    single = validation_loss(tiny_model(), loader(0, 1), device=CPU)
    for r in ranks:  # every rank returns the global result
        assert r["val_tokens"] == single["val_tokens"]
        # The same tokens in other batches: the padded lengths differ, so float32 matmuls may round differently
        # (~1e-7 relative per logit) and each batch's float32 loss sum is rounded once more; the float64 totals
        # add nothing. 1e-6 relative leaves room for that and still catches any token counted twice or missed
        # (one token of 73 moves the mean by ~1e-2) or a mean of per-rank means.
        assert r["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
