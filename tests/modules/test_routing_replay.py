"""Routing replay: a record of each mixture-of-experts layer's chosen experts, replayed in later forwards of the same
tokens (online RL's updates route as its old log-probabilities' forward did). On the tiny Qwen3-MoE (a dense layer
among its MoE layers) and Mixtral: replay on the same weights changes nothing; after the routers move, the fresh
choice differs and the replay does not; the router still gets its gradient; the replayed block against a float64
hand computation; activation checkpointing's recomputation replays the same entry; the errors name the layer."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.models.test_moe_families import FAMILIES, tiny
from toolkit.modules.moe import (
    GroupedExperts,
    MoEFeedForward,
    RoutingRecord,
    TopKRouter,
    record_routing,
    replay_routing,
    routing_agreement,
)
from toolkit.training.activations import apply_activation_checkpointing

VOCAB, BATCH, SEQ = 96, 2, 12


def tokens(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def moe_paths(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def perturb_routers(model: torch.nn.Module, *, seed: int = 3, scale: float = 0.5) -> None:
    """Move every router as an RL update would, far enough that some tokens' top-k changes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
            block.gate.weight.add_(scale * torch.randn(block.gate.weight.shape, generator=generator))


def recorded(model: torch.nn.Module, x: torch.Tensor, *, mode=torch.no_grad) -> tuple[torch.Tensor, RoutingRecord]:
    """A forward without grad (as old log-probabilities are computed) and the routing it recorded."""
    with mode(), record_routing(model) as record:
        return model(x), record


def moved_after_recording(
    family: str, *, mode=torch.no_grad
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, RoutingRecord]:
    """A tiny model, a batch, its output and routing recorded (under ``mode``), and then the routers moved."""
    model = tiny(family)
    x = tokens()
    before, record = recorded(model, x, mode=mode)
    perturb_routers(model)
    return model, x, before, record


def used_experts(model: torch.nn.Module) -> RoutingRecord:
    """The experts each MoE layer used in the last forward (``Routing.experts``), as a record."""
    return RoutingRecord({name: [m.routing.experts.reshape(-1, m.top_k)] for name, m in model.named_modules()
                          if isinstance(m, MoEFeedForward)})


def assert_same_choices(actual: RoutingRecord, expected: RoutingRecord) -> None:
    assert actual.paths() == expected.paths()
    for path in expected.paths():
        mine, theirs = actual.forwards(path), expected.forwards(path)
        assert len(mine) == len(theirs), path
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), path


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_on_the_same_weights_changes_nothing(family):
    model = tiny(family)
    x = tokens()
    expected, record = recorded(model, x)
    assert record.paths() == moe_paths(model) and len(record) == 1
    for path in record.paths():
        (chosen,) = record.forwards(path)
        assert chosen.dtype == torch.int64 and chosen.shape == (BATCH * SEQ, 2) and not chosen.requires_grad
    with torch.no_grad(), replay_routing(model, record) as fresh:
        assert torch.equal(model(x), expected)
    assert_same_choices(fresh, record)  # the router would have chosen the same
    assert routing_agreement(record, fresh) == 1.0
    _, again = recorded(model, x)
    assert_same_choices(again, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_after_the_routers_move_replay_keeps_the_recorded_experts(family):
    model, x, before, old = moved_after_recording(family)
    unreplayed, new = recorded(model, x)
    changed = sum(int((a != b).any(dim=-1).sum()) for p in old.paths()
                  for a, b in zip(old.forwards(p), new.forwards(p)))
    assert changed > 0, "the moved routers choose other experts for some tokens"
    with torch.no_grad(), replay_routing(model, old) as fresh:
        replayed = model(x)
    assert_same_choices(used_experts(model), old)  # the experts actually used are the recorded ones
    # The router's own choice is reported beside them: in the first MoE layer, the unreplayed forward's (later
    # layers see the replayed layers' outputs, not the unreplayed ones).
    first = old.paths()[0]
    assert torch.equal(fresh.forwards(first)[0], new.forwards(first)[0])
    assert routing_agreement(old, fresh) < 1.0
    # The weights moved with the routers (the scores at the recorded experts), so the output is neither the old
    # one nor the unreplayed one.
    assert not torch.equal(replayed, before) and not torch.equal(replayed, unreplayed)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_router_gets_its_gradient_under_replay(family, mode):
    model, x, _, record = moved_after_recording(family, mode=mode)
    with replay_routing(model, record):
        model(x).square().mean().backward()
    for path in moe_paths(model):
        grad = model.get_submodule(path).gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, path


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_replayed_block_is_the_experts_mixed_by_the_current_scores_at_the_recorded_experts(norm_topk_prob):
    torch.manual_seed(0)
    num_experts, top_k, dim, hidden = 6, 2, 8, 5
    block = MoEFeedForward(
        gate=TopKRouter(dim, num_experts, top_k, norm_topk_prob=norm_topk_prob),
        experts=GroupedExperts(num_experts=num_experts, dim=dim, hidden_dim=hidden),
    ).double()
    x = torch.randn(3, 4, dim, dtype=torch.float64)
    _, record = recorded(block, x)
    (chosen,) = record.forwards("")
    with torch.no_grad():
        block.gate.weight.add_(torch.randn_like(block.gate.weight))
    with torch.no_grad(), replay_routing(block, record):
        out = block(x)

    flat = x.reshape(-1, dim)
    # The router's scores are a float32 softmax whatever the model's dtype (its documented contract); the kept
    # weights are renormalized in float32 too, and everything after them is float64.
    probs = torch.softmax((flat @ block.gate.weight.T).float(), dim=-1)
    assert (probs.topk(top_k).indices.sort().values != chosen.sort().values).any(), "a replay that changes something"
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        kept = probs[t, chosen[t]]
        if norm_topk_prob:
            kept = kept / kept.sum()
        for weight, e in zip(kept.double(), chosen[t].tolist(), strict=True):
            w = block.experts
            expert = w.down_proj[e] @ (F.silu(w.gate_proj[e] @ flat[t]) * (w.up_proj[e] @ flat[t]))
            expected[t] += weight * expert
    torch.testing.assert_close(out.reshape(-1, dim), expected, rtol=0, atol=1e-12)


def test_nothing_is_added_to_the_model_state():
    model = tiny("qwen3_moe")
    keys = list(model.state_dict())
    with torch.no_grad(), record_routing(model) as record:
        model(tokens())
        assert list(model.state_dict()) == keys
    with torch.no_grad(), replay_routing(model, record):
        assert list(model.state_dict()) == keys
    with pytest.raises(ZeroDivisionError), record_routing(model):
        1 / 0  # noqa: B018 (an error inside the context)
    assert all(m._routing_session is None for m in model.modules() if isinstance(m, MoEFeedForward))
    assert list(model.state_dict()) == keys


def test_forward_index_replays_one_micro_batch_of_a_recorded_pass():
    model = tiny("mixtral")
    batches = [tokens(seed, seq) for seed, seq in ((1, 12), (2, 7), (3, 9))]
    with torch.no_grad(), record_routing(model) as record:
        for x in batches:
            model(x)
    assert len(record) == 3
    perturb_routers(model)
    for m in (2, 0, 1):  # in another order, as a shuffled update pass would
        with torch.no_grad(), replay_routing(model, record, forward_index=m) as fresh:
            model(batches[m])
        assert_same_choices(used_experts(model), record[m : m + 1])
        assert len(fresh) == 1 and routing_agreement(record[m : m + 1], fresh) < 1.0
    with torch.no_grad(), replay_routing(model, record, forward_index=1):  # forwards 1 and 2, then none left
        model(batches[1])
        model(batches[2])
        assert_same_choices(used_experts(model), record[2:3])
        with pytest.raises(ValueError, match=r"^routing replay: layers\.0\.mlp has 3 recorded forwards and this is "
                                             r"forward 4"):
            model(batches[2])


def test_a_forward_of_other_tokens_is_refused_naming_the_layer():
    model = tiny("qwen3_moe")
    _, record = recorded(model, tokens(seq=12))
    with torch.no_grad(), replay_routing(model, record), pytest.raises(
        ValueError, match=r"^routing replay: layers\.0\.mlp recorded experts \[24, 2\] \(\[tokens, top_k\]\) in "
                          r"forward 0 and this forward has 20 tokens and top_k 2; replay the same tokens$"
    ):
        model(tokens(seq=10))


def test_a_record_of_another_model_or_index_is_refused_before_any_forward():
    qwen, mixtral = tiny("qwen3_moe"), tiny("mixtral")
    _, record = recorded(qwen, tokens())
    with pytest.raises(ValueError, match=r"not in the model: layers\.2\.mlp\)$"), replay_routing(mixtral, record):
        pass
    for index in (1, -1):
        outside = rf"forward_index {index} is outside the record's 1 forwards \(0 to 0\)"
        with pytest.raises(ValueError, match=outside), replay_routing(qwen, record, forward_index=index):
            pass
    with pytest.raises(ValueError, match="already recording or replaying"), record_routing(qwen), \
            replay_routing(qwen, record):
        pass
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"), record_routing(torch.nn.Linear(2, 2)):
        pass


def test_routing_agreement_counts_each_tokens_experts_in_any_order():
    a = RoutingRecord({"l": [torch.tensor([[0, 1], [2, 3], [4, 5]])]})
    b = RoutingRecord({"l": [torch.tensor([[1, 0], [2, 5], [6, 7]])]})
    assert routing_agreement(a, a) == 1.0
    assert routing_agreement(a, b) == 3 / 6
    with pytest.raises(ValueError, match=r"^routing_agreement: l forward 0 chose \[3, 2\] and \[2, 2\]"):
        routing_agreement(a, RoutingRecord({"l": [torch.zeros(2, 2, dtype=torch.int64)]}))
    with pytest.raises(ValueError, match=r"^routing_agreement: the records have other layers"):
        routing_agreement(a, RoutingRecord({"m": [torch.zeros(3, 2, dtype=torch.int64)]}))
    with pytest.raises(ValueError, match=r"^routing_agreement: l has 1 forwards in one record and 2"):
        routing_agreement(a, RoutingRecord({"l": [a.forwards("l")[0]] * 2}))


def step_gradients(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("nested", [False, True], ids=["checkpointed", "checkpointed_twice"])
def test_activation_checkpointing_recomputes_with_the_replayed_experts(nested):
    x = tokens()
    eager, checkpointed = tiny("qwen3_moe"), tiny("qwen3_moe")
    for _ in range(1 + nested):  # twice: a checkpoint inside another, each recomputation replaying its own forward
        apply_activation_checkpointing(checkpointed)
    with record_routing(checkpointed) as record:  # one entry per forward, none for the recomputation
        checkpointed(x).square().mean().backward()
    assert len(record) == 1
    for model in (eager, checkpointed):
        perturb_routers(model)
    with replay_routing(eager, record):
        expected = step_gradients(eager, x)
    # The backward (and its recomputation) after the context has closed still uses the recorded experts; had the
    # recomputation chosen afresh, the moved routers' choice would give other gradients, or checkpoint's own check
    # would refuse the other shapes.
    checkpointed.zero_grad()
    with replay_routing(checkpointed, record):
        loss = checkpointed(x).square().mean()
    loss.backward()
    for grad, reference in zip((p.grad for p in checkpointed.parameters()), expected, strict=True):
        assert torch.equal(grad, reference)
    with replay_routing(checkpointed, record):  # and with backward inside the context
        for grad, reference in zip(step_gradients(checkpointed, x), expected, strict=True):
            assert torch.equal(grad, reference)


def test_a_recomputation_without_the_routing_context_is_refused():
    model = tiny("mixtral")
    for layer in model.layers:  # torch's checkpoint without toolkit's context_fn
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    _, record = recorded(model, tokens())
    with replay_routing(model, record), pytest.raises(
        RuntimeError, match=r"routing replay: layers\.\d\.mlp ran a forward during backward"
    ):
        model(tokens()).sum().backward()
