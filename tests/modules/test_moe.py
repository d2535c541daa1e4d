"""The mixture-of-experts block against ``transformers``' Qwen3-MoE pieces (its router, its loop over the experts,
its load-balancing loss), the grouped matmul against its per-expert fallback, the per-row load statistics
against splitting the batch, and the experts' adapters against one LoRA layer per expert. fp32 throughout: the same products summed in other orders, so 1e-6."""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from toolkit.modules import moe
from toolkit.modules.moe import (
    GroupedExperts,
    MoEFeedForward,
    TopKRouter,
    active_parameter_count,
    grouped_mm,
    permute_rows,
    routing_statistics,
)
from toolkit.modules.peft import (
    LoRAGroupedExperts,
    LoRALinear,
    disable_adapters,
    get_merged_state_dict,
    merge_lora_weights,
)

E, K, DIM, HIDDEN = 8, 2, 32, 16


def _pair(norm_topk_prob: bool) -> tuple[MoEFeedForward, Qwen3MoeTopKRouter, Qwen3MoeExperts]:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=HIDDEN, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
    )
    config._experts_implementation = "eager"
    router, experts = Qwen3MoeTopKRouter(config), Qwen3MoeExperts(config)
    for param in [*router.parameters(), *experts.parameters()]:
        torch.nn.init.normal_(param, std=0.3)
    ours = MoEFeedForward(
        gate=TopKRouter(DIM, E, K, norm_topk_prob=norm_topk_prob),
        experts=GroupedExperts(num_experts=E, dim=DIM, hidden_dim=HIDDEN),
    )
    with torch.no_grad():
        ours.gate.weight.copy_(router.weight)
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(experts.down_proj)
    return ours, router, experts


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_block_computes_what_transformers_loop_over_experts_does(norm_topk_prob):
    ours, router, experts = _pair(norm_topk_prob)
    x = torch.randn(3, 7, DIM, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    _, weights, chosen = router(x_ref.view(-1, DIM))
    expected = experts(x_ref.view(-1, DIM), chosen, weights)
    out = ours(x)
    torch.testing.assert_close(out.view(-1, DIM), expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.view(-1, DIM))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    ref_gate, ref_up = experts.gate_up_proj.grad.chunk(2, dim=1)
    torch.testing.assert_close(ours.experts.gate_proj.grad, ref_gate, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.experts.up_proj.grad, ref_up, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.experts.down_proj.grad, experts.down_proj.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.gate.weight.grad, router.weight.grad, rtol=1e-5, atol=1e-6)


def test_the_per_expert_fallback_gives_the_grouped_kernels_values(monkeypatch):
    torch.manual_seed(1)
    counts = torch.tensor([5, 0, 3, 9, 0, 1, 2, 4])  # empty groups included
    x, weight = torch.randn(int(counts.sum()), DIM), torch.randn(E, HIDDEN, DIM)
    grouped = grouped_mm(x, weight, counts)
    monkeypatch.setattr(moe, "_has_grouped_mm", lambda device_type, dtype: False)
    fallback = grouped_mm(x, weight, counts)
    expected = torch.cat([part @ weight[e].T for e, part in enumerate(x.split(counts.tolist()))])
    torch.testing.assert_close(fallback, expected, rtol=0, atol=0)
    torch.testing.assert_close(grouped, expected, rtol=1e-6, atol=1e-6)


def test_experts_that_get_no_token_leave_the_others_right():
    # Every token to the same experts: the other groups are empty, and the kernel must cope with them.
    ours, router, experts = _pair(True)
    with torch.no_grad():
        ours.gate.weight.zero_()
        ours.gate.weight[3] = 1.0
        ours.gate.weight[5] = 0.5
        router.weight.copy_(ours.gate.weight)
    x = torch.rand(2, 5, DIM) + 0.1  # positive, so experts 3 and 5 score highest for every token
    _, weights, chosen = router(x.view(-1, DIM))
    assert set(chosen.flatten().tolist()) == {3, 5}
    torch.testing.assert_close(ours(x).view(-1, DIM), experts(x.view(-1, DIM), chosen, weights), rtol=1e-6, atol=1e-6)


def test_the_block_is_bitwise_reproducible():
    ours, _, _ = _pair(True)
    x = torch.randn(4, 11, DIM)
    assert torch.equal(ours(x), ours(x))


def test_the_load_statistics_of_each_row_are_transformers_loss_of_that_row_alone():
    ours, _, _ = _pair(True)
    x = torch.randn(3, 6, DIM)
    lengths = torch.tensor([6, 2, 4])
    routings = []
    for _ in range(3):  # three layers, the same block (each forward is one layer's routing)
        ours(x)
        routings.append(ours.routing)
        x = x.roll(1, dims=-1)
    stats = routing_statistics(routings, num_experts=E, lengths=lengths)
    for row, n in enumerate(lengths.tolist()):
        logits = tuple(torch.log(r.probs[row, :n]) for r in routings)  # softmax(log p) = p
        expected = load_balancing_loss_func(logits, E, K)
        torch.testing.assert_close(stats.aux_loss[row], expected, rtol=1e-6, atol=0)
    # Padding counts nowhere: each layer's counts are the top-k choices of the real tokens alone.
    assert stats.tokens_per_expert.shape == (3, E)
    assert stats.tokens_per_expert.sum(dim=-1).tolist() == [K * int(lengths.sum())] * 3


def test_the_load_statistics_of_a_batch_split_in_two_are_the_whole_batchs():
    ours, _, _ = _pair(True)
    x = torch.randn(4, 5, DIM)
    lengths = torch.tensor([5, 3, 1, 4])
    ours(x)
    whole = routing_statistics([ours.routing], num_experts=E, lengths=lengths)
    parts = []
    for rows in (slice(0, 1), slice(1, 4)):
        ours(x[rows, : int(lengths[rows].max())])  # each part padded to its own longest row
        parts.append(routing_statistics([ours.routing], num_experts=E, lengths=lengths[rows]))
    torch.testing.assert_close(torch.cat([p.aux_loss for p in parts]), whole.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(p.tokens_per_expert for p in parts), whole.tokens_per_expert, rtol=0, atol=0)


def test_bad_router_and_expert_settings_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(DIM, 4, 5, norm_topk_prob=True)
    with pytest.raises(ValueError, match="scores 4 experts but there are 8"):
        MoEFeedForward(gate=TopKRouter(DIM, 4, 2, norm_topk_prob=True), experts=GroupedExperts(num_experts=8, dim=DIM, hidden_dim=HIDDEN))


# --- LoRA on the experts ----------------------------------------------------------------------------------------


def _adapted(dropout: float = 0.0) -> tuple[MoEFeedForward, MoEFeedForward]:
    """A block with adapted experts (B random, so the adapters matter) and the plain block it came from."""
    plain, _, _ = _pair(True)
    experts = LoRAGroupedExperts(num_experts=E, dim=DIM, hidden_dim=HIDDEN, rank=3, alpha=6.0, dropout=dropout)
    experts.load_state_dict(plain.experts.state_dict(), strict=False)
    torch.manual_seed(2)
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.nn.init.normal_(experts.adapter(name).lora_b.weight, std=0.3)
    return MoEFeedForward(gate=plain.gate, experts=experts), plain


def test_expert_adapters_compute_what_one_lora_layer_per_expert_does():
    adapted, plain = _adapted()
    x = torch.randn(2, 9, DIM)
    _, weights, chosen = adapted.gate(x.view(-1, DIM))
    expected = torch.zeros(x.numel() // DIM, DIM)
    for e in range(E):
        # Expert e as three LoRALinear layers with its slices of the stacked base and adapters.
        layers = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            base = getattr(adapted.experts, name)[e]
            layer = LoRALinear(base.shape[1], base.shape[0], rank=3, alpha=6.0)
            with torch.no_grad():
                layer.weight.copy_(base)
                layer.lora_a.weight.copy_(adapted.experts.adapter(name).lora_a.weight[e])
                layer.lora_b.weight.copy_(adapted.experts.adapter(name).lora_b.weight[e])
            layers[name] = layer
        for t, k in zip(*torch.where(chosen == e)):
            h = torch.nn.functional.silu(layers["gate_proj"](x.view(-1, DIM)[t])) * layers["up_proj"](x.view(-1, DIM)[t])
            expected[t] += weights[t, k] * layers["down_proj"](h).detach()
    torch.testing.assert_close(adapted(x).view(-1, DIM).detach(), expected, rtol=1e-5, atol=1e-6)


def test_expert_adapters_start_as_the_base_train_alone_and_merge_into_plain_experts():
    adapted, plain = _adapted()
    x = torch.randn(2, 6, DIM)
    adapted.experts.reset_lora_parameters()  # B = 0: the adapted block is its base
    assert torch.equal(adapted(x), plain(x))
    torch.nn.init.normal_(adapted.experts.adapter("up_proj").lora_b.weight, std=0.3)
    adapted(x).sum().backward()
    trained = {n for n, p in adapted.experts.named_parameters() if p.grad is not None}
    assert trained == set(adapted.experts.adapter_params())  # the base experts are frozen
    with disable_adapters(adapted):
        torch.testing.assert_close(adapted(x), plain(x), rtol=0, atol=0)
    merged = merge_lora_weights(MoEFeedForward(gate=adapted.gate, experts=adapted.experts))
    assert type(merged.experts) is GroupedExperts
    torch.testing.assert_close(merged(x), adapted(x), rtol=1e-5, atol=1e-6)
    assert get_merged_state_dict(adapted).keys() == plain.state_dict().keys()


def test_a_token_goes_through_top_k_of_the_experts_parameters():
    block, _, _ = _pair(True)
    assert active_parameter_count(block) == E * DIM + K * 3 * HIDDEN * DIM  # the router, and k experts' SwiGLU
    adapted, _ = _adapted()
    adapters = 3 * (3 * DIM + 3 * HIDDEN)  # per expert: A and B of rank 3 on each projection
    assert active_parameter_count(adapted) == E * DIM + K * (3 * HIDDEN * DIM + adapters)


def test_permuting_rows_has_indexings_values_and_gradients():
    x = torch.randn(12, DIM, requires_grad=True)
    order = torch.randperm(12)
    grad = torch.randn(12, DIM)
    permute_rows(x, order).backward(grad)
    ours, x.grad = x.grad, None
    x[order].backward(grad)
    assert torch.equal(ours, x.grad)
