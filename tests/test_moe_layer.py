"""MoE layer: sort-based dispatch vs a naive per-token loop, zero gradients for unused experts, stats."""

from __future__ import annotations

import pytest
import torch

import moee.moe.layer as layer_mod
from moee.moe.gates import NoisyTopKGate
from moee.moe.layer import Experts, MoEERouter, MoELayer, dispatch_combine, routing_stats


def _naive(x, weights, indices, experts: Experts, slot_mask=None):
    """Reference: loop over tokens and slots, one expert call per (token, slot)."""
    rows = []
    for n in range(x.shape[0]):
        y = torch.zeros_like(x[n])
        for j in range(indices.shape[1]):
            if slot_mask is not None and not bool(slot_mask[n, j]):
                continue
            e = int(indices[n, j])
            y = y + weights[n, j] * experts.expert_forward(e, x[n : n + 1])[0]
        rows.append(y)
    return torch.stack(rows)


def _routing(n, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    top = logits.topk(k, dim=-1)
    weights = top.values.softmax(-1).requires_grad_(True)
    return weights, top.indices


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("grouped", [True, False])
def test_dispatch_matches_naive_loop_outputs_and_grads(activation, grouped, monkeypatch):
    monkeypatch.setattr(layer_mod, "USE_GROUPED_MM", grouped)
    torch.manual_seed(0)
    n, d, h, e, k = 23, 8, 12, 5, 2
    experts = Experts(e, d, h, activation)
    x = torch.randn(n, d, requires_grad=True)
    weights, indices = _routing(n, e, k)

    y = dispatch_combine(x, weights, indices, experts)
    grads = torch.autograd.grad(y.pow(2).sum(), [x, weights, experts.w_in, experts.w_out])
    y_ref = _naive(x, weights, indices, experts)
    grads_ref = torch.autograd.grad(y_ref.pow(2).sum(), [x, weights, experts.w_in, experts.w_out])

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False])
def test_unselected_experts_get_exactly_zero_gradient(grouped, monkeypatch):
    monkeypatch.setattr(layer_mod, "USE_GROUPED_MM", grouped)
    torch.manual_seed(1)
    n, d, h, e, k = 16, 8, 4, 6, 2
    experts = Experts(e, d, h, "gelu")
    x = torch.randn(n, d)
    weights = torch.full((n, k), 0.5, requires_grad=True)
    indices = torch.randint(0, 3, (n, k))  # experts 3, 4, 5 are never chosen
    indices[0] = torch.tensor([0, 1])
    indices[1] = torch.tensor([2, 0])
    dispatch_combine(x, weights, indices, experts).sum().backward()
    assert torch.count_nonzero(experts.w_in.grad[3:]) == 0
    assert torch.count_nonzero(experts.w_out.grad[3:]) == 0
    assert torch.count_nonzero(experts.w_in.grad[:3]) > 0


def test_slot_mask_skips_padded_slots():
    torch.manual_seed(2)
    n, d, h, e = 10, 6, 4, 4
    experts = Experts(e, d, h, "relu")
    x = torch.randn(n, d)
    weights, indices = _routing(n, e, 3, seed=3)
    mask = torch.rand(n, 3, generator=torch.Generator().manual_seed(4)) > 0.4
    y = dispatch_combine(x, weights, indices, experts, slot_mask=mask)
    torch.testing.assert_close(y, _naive(x, weights, indices, experts, mask), rtol=1e-5, atol=1e-6)


def test_dispatch_rejects_bad_shapes_and_indices():
    experts = Experts(3, 4, 2, "relu")
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="out-of-range"):
        dispatch_combine(x, torch.ones(5, 1), torch.full((5, 1), 3), experts)
    with pytest.raises(ValueError, match="expected x"):
        dispatch_combine(x, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.long), experts)
    with pytest.raises(ValueError, match="activation"):
        Experts(2, 4, 4, "tanh")


def test_routing_stats_known_values():
    # 4 tokens, k=2, 4 experts: loads [3, 3, 1, 1] -> mean 2, max/mean 1.5, CV = 1/2
    indices = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 3]])
    probs = torch.zeros(4, 4).scatter(1, indices, 0.5)
    stats = routing_stats(probs, indices, 4)
    assert stats["load"].tolist() == [3.0, 3.0, 1.0, 1.0]
    assert stats["max_over_mean_load"].item() == pytest.approx(1.5)
    assert stats["cv_load"].item() == pytest.approx(0.5)
    assert stats["importance"].tolist() == [1.5, 1.5, 0.5, 0.5]
    assert stats["dropped_tokens"].item() == 0
    # padding rows are excluded from the statistics
    masked = routing_stats(probs, indices, 4, token_mask=torch.tensor([1, 1, 1, 0]))
    assert masked["load"].tolist() == [3.0, 2.0, 1.0, 0.0]
    assert masked["tokens"].item() == 3


def test_moe_layer_end_to_end_with_noisy_gate():
    torch.manual_seed(5)
    layer = MoELayer(
        8, 6, n_experts=6, k=2, n_shared_experts=1, gate=NoisyTopKGate(8, 6, 2, w_importance=0.1, w_load=0.1)
    )
    assert isinstance(layer.gate, MoEERouter)
    # zero-initialised noisy gate (Shazeer et al. 2017, Appendix A)
    assert all(torch.count_nonzero(p) == 0 for p in layer.gate.parameters())
    x = torch.randn(3, 5, 8)
    layer.train()
    y, aux = layer(x)
    assert y.shape == x.shape
    for key in (
        "loss",
        "importance",
        "load",
        "cv_importance",
        "cv_load",
        "max_over_mean_load",
        "dropped_tokens",
    ):
        assert key in aux
    assert aux["load"].sum().item() == 3 * 5 * 2
    (y.sum() + aux["loss"]).backward()
    assert layer.gate.gate.w_gate.weight.grad is not None
    # eval mode: no noise, and the layer equals gate + naive reference + shared expert
    layer.eval()
    flat = x.reshape(-1, 8)
    logits, weights, indices, out = layer.gate(flat)
    assert torch.equal(logits, out.logits) and logits.shape == (15, 6)
    y_eval, _ = layer(x)
    w_in, w_out = layer.shared_experts.ffn.w_in[0], layer.shared_experts.ffn.w_out[0]
    shared = (torch.nn.functional.silu(flat @ w_in[:, :6]) * (flat @ w_in[:, 6:])) @ w_out  # SwiGLU
    ref = _naive(flat, weights, indices, layer.experts) + shared
    torch.testing.assert_close(y_eval.reshape(-1, 8), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_shared_experts_equal_the_sum_of_separate_ffns(activation):
    """n shared experts stored as one FFN of width n*h compute the sum of n independent FFNs."""
    torch.manual_seed(6)
    n, d, h = 3, 8, 4
    shared = layer_mod.SharedExperts(n, d, h, activation)
    x = torch.randn(5, d)
    w_in, w_out = shared.ffn.w_in[0], shared.ffn.w_out[0]
    total = torch.zeros(5, d)
    for j in range(n):
        rows = slice(j * h, (j + 1) * h)
        if activation == "swiglu":  # gate half, then up half, each n*h wide
            up = slice(n * h + j * h, n * h + (j + 1) * h)
            hidden = torch.nn.functional.silu(x @ w_in[:, rows]) * (x @ w_in[:, up])
        else:
            hidden = torch.relu(x @ w_in[:, rows])
        total = total + hidden @ w_out[rows]
    torch.testing.assert_close(shared(x), total, rtol=1e-5, atol=1e-6)


def test_moe_layer_validates_k():
    with pytest.raises(ValueError, match="k must be"):
        MoELayer(8, 4, n_experts=4, k=5)


def test_dropped_tokens_counts_switch_capacity_overflow(monkeypatch):
    """32 tokens, 4 experts, capacity factor 0.5 -> capacity int(32 * 0.5 / 4) = 4 slots per expert.
    Choices 20/6/4/2 keep 4 + 4 + 4 + 2 = 14 tokens and drop 18."""
    from moee.moe.switch import SwitchRouter

    router = SwitchRouter(4, 4, capacity_factor=0.5)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4) * 5.0)
    choice = torch.tensor([0] * 20 + [1] * 6 + [2] * 4 + [3] * 2)
    x = torch.nn.functional.one_hot(choice[torch.randperm(32)], 4).float()
    layer = MoELayer(4, 8, n_experts=4, k=1, gate=router)
    work = []
    run_experts = layer.experts.grouped_forward
    monkeypatch.setattr(
        layer.experts,
        "grouped_forward",
        lambda xs, counts: work.append(list(counts)) or run_experts(xs, counts),
    )
    y, aux = layer(x)
    assert work == [[4, 4, 4, 2]]  # dropped tokens are skipped, not computed with weight 0
    assert aux["dropped_tokens"].item() == 18
    assert aux["load"].tolist() == [4.0, 4.0, 4.0, 2.0]  # the experts' real work after capacity
    assert aux["load_estimate"].tolist() == [20.0, 6.0, 4.0, 2.0]  # the choices, before capacity
    assert aux["tokens"].item() == 32
    # padding is not counted: mask out 5 of the overflowing expert-0 tokens
    routing = router(x)
    overflow = (~routing.mask[:, 0]).nonzero().flatten()[:5]
    token_mask = torch.ones(32, dtype=torch.bool)
    token_mask[overflow] = False
    _, aux_masked = layer(x, token_mask=token_mask)
    assert aux_masked["dropped_tokens"].item() == 13 and aux_masked["tokens"].item() == 27


def test_routing_stats_dropped_tokens_are_rows_without_a_real_slot():
    indices = torch.tensor([[0, 1], [2, 0], [1, 3], [3, 2]])
    probs = torch.zeros(4, 4).scatter(1, indices, 0.5)
    slot_mask = torch.tensor([[True, True], [False, False], [True, False], [False, False]])
    stats = routing_stats(probs, indices, 4, slot_mask=slot_mask)
    assert stats["dropped_tokens"].item() == 2
    assert stats["load"].tolist() == [1.0, 2.0, 0.0, 0.0]
    stats = routing_stats(probs, indices, 4, token_mask=torch.tensor([1, 1, 1, 0]), slot_mask=slot_mask)
    assert stats["dropped_tokens"].item() == 1


# ---------------------------------------------------------------- contracts the other modules rely on


def test_grouped_mm_is_used_exactly_for_aligned_float32_cpu():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    x = torch.randn(3, 8)
    assert layer_mod._use_grouped_mm(Experts(2, 8, 12, "relu"), x)
    assert not layer_mod._use_grouped_mm(Experts(2, 10, 12, "relu"), torch.randn(3, 10))  # 10 % 4 != 0
    assert not layer_mod._use_grouped_mm(Experts(2, 8, 10, "relu"), x)
    assert not layer_mod._use_grouped_mm(Experts(2, 8, 12, "relu").double(), x.double())
    assert not layer_mod._use_grouped_mm(Experts(2, 8, 12, "relu").double(), x)  # mixed dtypes


def test_balance_stats_hand_values_below_one():
    stats = layer_mod.balance_stats(torch.tensor([0.25, 0.75]), torch.tensor([0.0, 1.0]))
    assert stats["cv_importance"].item() == pytest.approx(0.5)  # std 0.25 / mean 0.5
    assert stats["cv_load"].item() == pytest.approx(1.0)
    assert stats["max_over_mean_load"].item() == pytest.approx(2.0)
    empty = layer_mod.balance_stats(torch.zeros(3), torch.zeros(3))
    assert all(v.item() == 0 for v in empty.values())


def test_dispatch_edge_cases():
    torch.manual_seed(3)
    experts = Experts(3, 4, 4, "relu")
    x = torch.randn(1, 4)
    one = dispatch_combine(x, torch.tensor([[0.5]]), torch.tensor([[2]]), experts)  # a single slot
    torch.testing.assert_close(one, 0.5 * experts.expert_forward(2, x))
    # weights in another dtype are cast to the activations' dtype
    y = dispatch_combine(x, torch.tensor([[0.5]], dtype=torch.float64), torch.tensor([[2]]), experts)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, one)
    with pytest.raises(ValueError, match="expected x"):
        dispatch_combine(torch.randn(5, 4), torch.ones(5, 2), torch.zeros(5, 1, dtype=torch.long), experts)
    with pytest.raises(ValueError, match="expected x"):
        dispatch_combine(torch.randn(5, 2, 4), torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.long), experts)


def test_experts_forward_applies_the_slot_mask():
    torch.manual_seed(2)
    experts = Experts(4, 6, 4, "relu")
    x = torch.randn(10, 6)
    weights, indices = _routing(10, 4, 2, seed=1)
    mask = torch.rand(10, 2, generator=torch.Generator().manual_seed(5)) > 0.5
    torch.testing.assert_close(
        experts(x, weights, indices, mask), _naive(x, weights, indices, experts, mask), rtol=1e-5, atol=1e-6
    )


def test_grouped_forward_on_no_rows(monkeypatch):
    experts = Experts(3, 4, 4, "relu")
    for grouped in (True, False):
        monkeypatch.setattr(layer_mod, "USE_GROUPED_MM", grouped)
        out = experts.grouped_forward(torch.zeros(0, 4), [0, 0, 0])
        assert out.shape == (0, 4)


def test_experts_validation_defaults_and_init():
    for bad in ((0, 4, 4), (2, 0, 4), (2, 4, 0)):
        with pytest.raises(ValueError, match=r"^n_experts, d_model and d_hidden must be positive, got"):
            Experts(*bad)
    Experts(1, 1, 1)  # the smallest valid shape
    default = Experts(2, 4, 4)
    assert default.activation == "swiglu" and default.w_in.shape == (2, 4, 8)
    torch.manual_seed(0)
    big = Experts(4, 64, 100, "relu")
    assert big.w_in.std().item() == pytest.approx(1 / 8, rel=0.05)
    assert big.w_out.std().item() == pytest.approx(1 / 10, rel=0.05)
    big.reset_parameters(std=0.3)
    assert big.w_in.std().item() == pytest.approx(0.3, rel=0.05)
    assert big.w_out.std().item() == pytest.approx(0.3, rel=0.05)


def test_shared_experts_shape_and_defaults():
    shared = layer_mod.SharedExperts(3, 4, 5)
    assert shared.n_shared == 3 and shared.ffn.activation == "swiglu"
    assert shared.ffn.w_in.shape == (1, 4, 2 * 3 * 5) and shared.ffn.w_out.shape == (1, 3 * 5, 4)


def test_router_wrapper_contract():
    torch.manual_seed(4)
    layer = MoELayer(8, 4, n_experts=6)
    router = layer.gate
    assert router.num_experts == 6 and router.top_k == 2 and layer.k == 2 and layer.d_model == 8
    # the tag the LM's _init_weights uses to recognise router parameters
    assert all(getattr(m, "_moee_router_part", None) is True for m in router.gate.modules())
    logits, weights, indices, _ = router(torch.randn(3, 5, 8))  # any leading shape is flattened
    assert logits.shape == (15, 6) and weights.shape == indices.shape == (15, 2)


def test_moe_layer_constructor_options_reach_the_gate_and_experts():
    torch.manual_seed(5)
    default = MoELayer(8, 4, n_experts=4)
    assert default.shared_experts is None and default.gate.gate.noisy
    assert default.experts.activation == "swiglu"
    MoELayer(8, 4, n_experts=4, k=4)  # k == n_experts is allowed
    with pytest.raises(ValueError, match=r"^n_shared_experts must be >= 0, got -1$"):
        MoELayer(8, 4, n_experts=4, n_shared_experts=-1)
    relu = MoELayer(
        8, 4, n_experts=4, n_shared_experts=2, activation="relu", gate=NoisyTopKGate(8, 4, 2, noisy=False)
    )
    assert relu.experts.activation == "relu" and relu.shared_experts.ffn.activation == "relu"
    assert not relu.gate.gate.noisy and relu.gate.gate.w_noise is None
    x = torch.randn(20, 8)
    # the balancing weights reach the loss: hand CV^2 of the layer's own statistics (eval: counts)
    assert default.eval()(x)[1]["loss"].item() == 0.0  # default weights are 0
    for w_imp, w_load in ((0.5, 0.0), (0.0, 0.7)):
        layer = MoELayer(
            8, 4, n_experts=4, gate=NoisyTopKGate(8, 4, 2, noisy=False, w_importance=w_imp, w_load=w_load)
        ).eval()
        _, aux = layer(x)

        def cv2(v):
            return (((v - v.mean()) ** 2).mean() / v.mean() ** 2).item()

        want = w_imp * cv2(aux["importance"]) + w_load * cv2(aux["load"])
        assert want > 0 and aux["loss"].item() == pytest.approx(want, rel=1e-5)


def test_gate_without_a_loss_gives_a_zero_loss():
    from moee.moe.gates import GateOutput

    class FixedGate(torch.nn.Module):
        def forward(self, x):
            indices = torch.zeros(x.shape[0], 1, dtype=torch.long)
            weights = torch.ones(x.shape[0], 1)
            probs = torch.zeros(x.shape[0], 2).scatter(1, indices, weights)
            return GateOutput(weights=weights, indices=indices, probs=probs, logits=probs, aux={})

    layer = MoELayer(4, 4, n_experts=2, k=1, gate=FixedGate())
    y, aux = layer(torch.randn(3, 4))
    assert aux["loss"].shape == () and aux["loss"].item() == 0.0 and "load_estimate" not in aux


def test_a_noisy_gate_reports_the_load_of_its_noise_free_decision_in_training():
    """Training noise spreads the picks of a collapsed gate; the clean_* figures are those of the
    noise-free decision, equal to what the same layer reports in evaluation."""
    torch.manual_seed(0)
    layer = MoELayer(8, 4, n_experts=4, k=1, gate=NoisyTopKGate(8, 4, 1, noisy=True))
    with torch.no_grad():
        layer.gate.gate.w_gate.weight.zero_()
        layer.gate.gate.w_gate.weight[2] = 0.01  # a small push towards expert 2 for every token
        layer.gate.gate.w_noise.weight.fill_(0.0)
    x = torch.randn(64, 8).abs()
    layer.train()
    _, train_aux = layer(x)
    layer.eval()
    _, eval_aux = layer(x)
    assert "clean_load" not in eval_aux
    assert torch.equal(train_aux["clean_load"], eval_aux["load"])
    assert float(train_aux["clean_max_over_mean_load"]) == float(eval_aux["max_over_mean_load"]) == 4.0
    assert float(train_aux["max_over_mean_load"]) < 4.0  # the noisy picks look balanced
    assert layer_mod.noise_free_balance(train_aux)[2] == layer_mod.noise_free_balance(eval_aux)[2]
    mask = torch.zeros(64, dtype=torch.bool)
    mask[:10] = True
    layer.train()
    _, masked = layer(x, token_mask=mask)
    assert float(masked["clean_load"].sum()) == 10
