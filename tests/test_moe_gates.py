"""Gates: worked numbers, invariants, gradient flow and the balancing variants (Shazeer et al. 2017 on)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moee.moe import (
    BatchwiseBalancedGate,
    ExpertChoiceGate,
    GateOutput,
    HierarchicalGate,
    Hierarchy,
    LossFreeBalancedGate,
    NoisyTopKGate,
    SoftmaxGate,
    cv_squared,
    prob_in_top_k,
    switch_capacity,
    top_k_gating,
)
from moee.moe.gates import batchwise_mask, noisy_top_k

H = torch.tensor([2.3, 0.8, 0.6, -2.0])
CLEAN = torch.tensor([2.0, 1.0, 0.5, -0.5])


def _check_gate_output(out: GateOutput, n: int, e: int) -> None:
    assert out.probs.shape == (n, e) and out.logits.shape == (n, e)
    assert out.weights.shape == out.indices.shape and out.weights.shape[0] == n
    assert out.indices.dtype == torch.long
    assert {"loss", "importance", "load"} <= set(out.aux)
    assert out.aux["loss"].dim() == 0
    assert out.aux["importance"].shape == (e,) and out.aux["load"].shape == (e,)
    # the sparse slots and the dense matrix describe the same gate values
    assert torch.allclose(out.probs.gather(1, out.indices), out.weights)


# ---------------------------------------------------------------- worked numbers


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, [1.0, 0.0, 0.0, 0.0]), (2, [0.818, 0.182, 0.0, 0.0]), (3, [0.711, 0.159, 0.130, 0.0])],
)
def test_seed_gate_values(k, expected):
    probs, weights, indices = top_k_gating(H, k)
    assert torch.allclose(probs, torch.tensor(expected), atol=5e-4)
    assert (probs == 0).sum().item() == 4 - k
    assert indices.tolist() == list(range(k))
    if k == 1:
        assert probs[0].item() == 1.0


def test_zero_noise_gate_and_second_draw():
    probs, _, _ = top_k_gating(CLEAN, 2)
    assert torch.allclose(probs, torch.tensor([0.731, 0.269, 0.0, 0.0]), atol=5e-4)
    # second draw: H_3 = 1.5 and H_1 = 1.4 are the top two, expert 2 is bumped
    probs, _, _ = top_k_gating(torch.tensor([1.4, 0.9, 1.5, -1.0]), 2)
    assert torch.allclose(probs, torch.tensor([0.475, 0.0, 0.525, 0.0]), atol=5e-4)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=6, max_size=6),
        min_size=1,
        max_size=5,
    ),
    k=st.integers(1, 6),
)
def test_exactly_k_nonzero_gates_summing_to_one(rows, k):
    h = torch.tensor(rows, dtype=torch.float32)
    probs, weights, indices = top_k_gating(h, k)
    assert ((probs > 0).sum(-1) == k).all()
    assert ((probs == 0).sum(-1) == 6 - k).all()
    assert torch.allclose(probs.sum(-1), torch.ones(len(rows)), atol=1e-5)
    assert torch.equal(probs.gather(-1, indices), weights)
    if k == 1:
        assert (weights == 1.0).all()


def test_zero_init_noise_std_is_ln2_and_selection_uniform():
    gate = NoisyTopKGate(8, 4, 1)
    assert (gate.w_gate.weight == 0).all() and (gate.w_noise.weight == 0).all()
    x = torch.randn(4000, 8)
    assert torch.allclose(F.softplus(gate.w_noise(x)), torch.full((4000, 4), math.log(2)))
    # the gate's noise is exactly N(0,1) * ln 2 on zero clean logits
    torch.manual_seed(3)
    out = gate.train()(x)
    torch.manual_seed(3)
    h = torch.randn(4000, 4) * math.log(2)
    assert torch.equal(out.indices[:, 0], h.argmax(-1))
    counts = torch.bincount(out.indices[:, 0], minlength=4).float()
    assert (counts - 1000).abs().max() < 120  # ~ 4 sigma of a binomial(4000, 1/4)


def test_noise_only_in_training_mode():
    torch.manual_seed(0)
    gate = NoisyTopKGate(6, 5, 2)
    torch.nn.init.normal_(gate.w_gate.weight)
    x = torch.randn(30, 6)
    gate.eval()
    a, b = gate(x), gate(x)
    assert torch.equal(a.probs, b.probs)
    assert torch.equal(a.probs, top_k_gating(x @ gate.w_gate.weight.t(), 2)[0])
    gate.train()
    assert not torch.equal(gate(x).probs, gate(x).probs)
    gate_clean = NoisyTopKGate(6, 5, 2, noisy=False)
    gate_clean.w_gate.weight.data.copy_(gate.w_gate.weight.data)
    assert gate_clean.w_noise is None
    assert torch.equal(gate_clean.train()(x).probs, a.probs)


def test_noisy_gate_output_load_and_losses():
    torch.manual_seed(1)
    gate = NoisyTopKGate(6, 5, 2, w_importance=0.1, w_load=0.2)
    torch.nn.init.normal_(gate.w_gate.weight)
    torch.nn.init.normal_(gate.w_noise.weight)
    x = torch.randn(40, 6)
    out = gate.train()(x)
    _check_gate_output(out, 40, 5)
    assert ((out.probs > 0).sum(1) == 2).all()
    # smooth load (values checked against a naive reference below): non-integer, within [0, N]
    assert not torch.equal(out.aux["load"], out.aux["load"].round())
    assert ((out.aux["load"] >= 0) & (out.aux["load"] <= 40)).all()
    ev = gate.eval()(x)
    assert torch.equal(ev.aux["load"], torch.bincount(ev.indices.flatten(), minlength=5).float())
    assert ev.aux["load"].sum().item() == 80


def test_noisy_top_k_smooth_load_matches_prob_in_top_k():
    torch.manual_seed(2)
    clean, noise_logits = torch.randn(10, 6), torch.randn(10, 6)
    torch.manual_seed(5)
    probs, _, _, load_terms = noisy_top_k(clean, noise_logits, 2, add_noise=True)
    torch.manual_seed(5)
    std = F.softplus(noise_logits)
    h = clean + torch.randn(10, 6) * std
    assert torch.equal(probs, top_k_gating(h, 2)[0])
    assert torch.allclose(load_terms, prob_in_top_k(clean, h, std, 2))


def test_gate_input_validation():
    gate = NoisyTopKGate(4, 3, 2)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        gate(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        gate(torch.randn(2, 3, 4))
    with pytest.raises(TypeError):
        gate([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ValueError, match="k must be in"):
        NoisyTopKGate(4, 3, 4)
    with pytest.raises(ValueError, match="w_load"):
        NoisyTopKGate(4, 3, 2, w_load=-1.0)


# ---------------------------------------------------------------- gradients


def test_worked_gradient_chain():
    h = H.clone().requires_grad_(True)
    probs, _, _ = top_k_gating(h, 2)
    expert_out = torch.tensor([2.0, 0.0, 0.0, 0.0])
    (0.1 * (probs * expert_out).sum()).backward()
    p1 = probs[0].item()
    assert p1 * (1 - p1) == pytest.approx(0.149, abs=1e-3)
    assert h.grad[0].item() == pytest.approx(0.030, abs=5e-4)
    assert h.grad[2].item() == 0.0 and h.grad[3].item() == 0.0  # masked experts get nothing


def _weight_path_grads(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gate = NoisyTopKGate(6, 4, k).train()
    torch.nn.init.normal_(gate.w_gate.weight)
    torch.nn.init.normal_(gate.w_noise.weight)
    x = torch.randn(16, 6)
    expert_values = torch.randn(16, 4)  # stands in for E_i(x) . dL/dy
    out = gate(x)
    (out.probs * expert_values).sum().backward()
    return gate.w_gate.weight.grad, gate.w_noise.weight.grad


def test_k_greater_than_one_gives_router_gradients():
    g_gate, g_noise = _weight_path_grads(2)
    assert g_gate.abs().sum() > 0 and g_noise.abs().sum() > 0


def test_k_equal_one_gives_no_gradient_on_relative_weighting():
    g_gate, g_noise = _weight_path_grads(1)
    assert torch.equal(g_gate, torch.zeros_like(g_gate))
    assert torch.equal(g_noise, torch.zeros_like(g_noise))


def test_masked_experts_get_no_gradient():
    torch.manual_seed(4)
    h = torch.randn(20, 6, requires_grad=True)
    probs, _, _ = top_k_gating(h, 3)
    (probs * torch.randn(20, 6)).sum().backward()
    selected = probs > 0
    assert (h.grad[~selected] == 0).all()
    assert (h.grad[selected] != 0).float().mean() > 0.9


# ---------------------------------------------------------------- dense softmax gate


def test_softmax_gate_is_dense():
    gate = SoftmaxGate(5, 4, w_importance=0.5)
    torch.nn.init.normal_(gate.w_gate.weight)
    out = gate(torch.randn(7, 5))
    _check_gate_output(out, 7, 4)
    assert out.k == 4 and (out.probs > 0).all()
    assert torch.allclose(out.probs.sum(1), torch.ones(7))
    assert torch.equal(out.indices, torch.arange(4).expand(7, 4))
    assert torch.equal(out.aux["load"], torch.full((4,), 7.0))


def test_softmax_gate_hand_computed_importance_loss():
    # logits [ln 2, 0, 0] and [0, ln 2, 0] -> gates [1/2, 1/4, 1/4] and [1/4, 1/2, 1/4]
    gate = SoftmaxGate(2, 3, w_importance=0.5)
    with torch.no_grad():
        gate.w_gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    out = gate(torch.tensor([[math.log(2), 0.0], [0.0, math.log(2)]]))
    torch.testing.assert_close(out.probs, torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))
    torch.testing.assert_close(out.aux["importance"], torch.tensor([0.75, 0.75, 0.5]))
    # mean 2/3, population variance 1/72 -> CV^2 = 1/32
    assert out.aux["loss"].item() == pytest.approx(0.5 / 32, rel=1e-5)


# ---------------------------------------------------------------- hierarchical gate


def _random_hierarchical(seed: int = 0, **kw) -> HierarchicalGate:
    torch.manual_seed(seed)
    gate = HierarchicalGate(6, Hierarchy(3, 4, 2, 2), **kw)
    for p in gate.parameters():
        torch.nn.init.normal_(p)
    return gate


def test_hierarchical_gate_product_weights():
    gate = _random_hierarchical()
    x = torch.randn(25, 6)
    out = gate.train()(x)
    _check_gate_output(out, 25, 12)
    assert out.k == 4
    assert ((out.probs > 0).sum(1) == 4).all()
    assert torch.allclose(out.weights.sum(1), torch.ones(25), atol=1e-6)
    # every selected expert lies in one of the two selected groups, two per group
    groups = out.indices // 4
    for row in groups:
        assert sorted(torch.bincount(row, minlength=3).tolist()) == [0, 2, 2]
    assert torch.allclose(torch.softmax(out.logits, -1).sum(1), torch.ones(25), atol=1e-5)


def _load_h_reference(gate: HierarchicalGate, x: torch.Tensor) -> torch.Tensor:
    """Load_H by explicit loops over groups (eval mode: counts)."""
    a, b = gate.n_groups, gate.experts_per_group
    primary = top_k_gating(gate.w_gate(x), gate.k_primary)[0]
    load = torch.zeros(a, b)
    for i in range(a):
        members = primary[:, i] > 0
        if members.sum() == 0:
            continue
        sec = top_k_gating(x[members] @ gate.w_gate_secondary[i], gate.k_secondary)[0]
        load_i = (sec > 0).sum(0).float()
        load[i] = members.sum() * load_i / members.sum()
    return load.reshape(-1)


def test_hierarchical_load_and_importance_match_reference():
    gate = _random_hierarchical(1, w_importance=0.3, w_load=0.7).eval()
    x = torch.randn(40, 6)
    out = gate(x)
    load = _load_h_reference(gate, x)
    assert torch.allclose(out.aux["load"], load)
    # eval mode has no noise: the naive training-mode reference with zero noise gives Importance_H
    with torch.no_grad():
        params = (gate.w_gate.weight, torch.zeros(3, 6), gate.w_gate_secondary, torch.zeros(3, 6, 4))
        importance, _ = _naive_hierarchical(gate, x, torch.zeros(40, 3), torch.zeros(40, 3, 4), params)
    torch.testing.assert_close(out.aux["importance"], importance, rtol=1e-5, atol=1e-6)
    expected = 0.3 * _naive_cv2(importance) + 0.7 * _naive_cv2(load)
    assert out.aux["loss"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_hierarchical_empty_group_guard():
    gate = HierarchicalGate(4, Hierarchy(3, 2, 1, 1), w_importance=1.0, w_load=1.0)
    with torch.no_grad():
        gate.w_gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0.5, 0, 0, 0], [-5.0, 0, 0, 0]]))
    x = torch.rand(10, 4) + 0.1  # first feature positive: group 2 is never chosen
    for mode in (gate.eval(), gate.train()):
        out = mode(x)
        assert torch.isfinite(out.aux["load"]).all() and torch.isfinite(out.aux["loss"])
        if not mode.training:
            assert out.aux["group_counts"][2].item() == 0
            assert torch.equal(out.aux["load"][4:], torch.zeros(2))
        out.aux["loss"].backward()
        for p in gate.parameters():
            assert p.grad is None or torch.isfinite(p.grad).all()
        gate.zero_grad()


def test_hierarchical_load_trains_primary_gate():
    gate = _random_hierarchical(2, w_load=1.0).train()
    gate(torch.randn(30, 6)).aux["load_loss"].backward()
    assert gate.w_gate.weight.grad.abs().sum() > 0  # via the Load_primary factor
    assert gate.w_gate_secondary.grad.abs().sum() > 0


# ---------------------------------------------------------------- strictly balanced gate


def test_batchwise_mask_exactly_m_per_expert():
    scores = torch.softmax(torch.randn(24, 6), -1)
    mask = batchwise_mask(scores, 4)
    assert (mask.sum(0) == 4).all() and mask.sum().item() == 24
    for i in range(6):  # the kept rows are that column's top 4
        assert set(mask[:, i].nonzero().flatten().tolist()) == set(scores[:, i].topk(4).indices.tolist())


def test_batchwise_gate_training_balance_and_weights():
    torch.manual_seed(0)
    gate = BatchwiseBalancedGate(8, 6, 2).train()
    x = torch.randn(30, 8)
    out = gate(x)
    m = gate.examples_per_expert(30)
    assert m == 10
    _check_gate_output(out, 30, 6)
    assert torch.equal(out.aux["load"], torch.full((6,), 10.0))
    assert torch.equal(torch.bincount(out.indices[out.mask], minlength=6), torch.full((6,), 10))
    assert (out.weights[~out.mask] == 0).all()
    totals = out.probs.sum(1)
    routed = (out.probs > 0).any(1)
    assert torch.allclose(totals[routed], torch.ones(int(routed.sum())))
    assert (totals[~routed] == 0).all()
    assert torch.isfinite(out.aux["threshold_loss"])


@pytest.mark.slow
def test_batchwise_threshold_loss_gradient_and_training():
    torch.manual_seed(1)
    gate = BatchwiseBalancedGate(8, 4, 1).train()
    torch.nn.init.normal_(gate.w_gate.weight)  # spread the scores so the boundary is learnable
    x = torch.randn(64, 8)
    out = gate(x)
    out.aux["loss"].backward()
    scores = torch.softmax(out.logits.detach(), -1)
    thr = scores > gate.thresholds.detach()
    sel = batchwise_mask(scores, gate.examples_per_expert(64))
    assert torch.allclose(gate.thresholds.grad, -(thr.float() - sel.float()).sum(0))
    assert gate.w_gate.weight.grad is None or (gate.w_gate.weight.grad == 0).all()
    # training T alone makes the inference mask agree with the batchwise one
    before = out.aux["threshold_agreement"].item()
    opt = torch.optim.SGD([gate.thresholds], lr=1e-3)
    for _ in range(200):
        opt.zero_grad()
        gate(x).aux["loss"].backward()
        opt.step()
    after = gate(x).aux["threshold_agreement"].item()
    assert after > before and after >= 0.99
    # the learned thresholds now give (about) m = 16 examples per expert at inference
    load = gate.eval()(x).aux["load"]
    assert ((load - 16).abs() <= 2).all(), load


def test_batchwise_gate_inference_uses_thresholds():
    torch.manual_seed(2)
    gate = BatchwiseBalancedGate(8, 4, 2).eval()
    with torch.no_grad():
        gate.thresholds.copy_(torch.tensor([0.2, 0.3, 0.25, 0.9]))
    x = torch.randn(1, 8)  # a single example works at inference
    out = gate(x)
    scores = torch.softmax(out.logits, -1)
    assert torch.equal(out.probs > 0, scores > gate.thresholds)
    assert out.aux["loss"].item() == 0.0


# ---------------------------------------------------------------- expert choice


def test_expert_choice_each_expert_gets_exactly_c_tokens():
    torch.manual_seed(0)
    gate = ExpertChoiceGate(8, 4, capacity_factor=2.0)
    x = torch.randn(20, 8)
    out = gate(x)
    c = switch_capacity(20, 4, 2.0)
    assert c == 10 and out.aux["capacity"].item() == 10
    _check_gate_output(out, 20, 4)
    assert torch.equal(out.aux["load"], torch.full((4,), 10.0))
    assert torch.equal(torch.bincount(out.indices[out.mask], minlength=4), torch.full((4,), 10))
    scores = torch.softmax(out.logits, -1)
    for e in range(4):
        tokens = out.aux["expert_tokens"][e]
        assert set(tokens.tolist()) == set(scores[:, e].topk(10).indices.tolist())
        assert torch.allclose(out.aux["expert_weights"][e], scores[tokens, e])
    # un-renormalised: a token's gates are its own scores for the experts that chose it
    assert torch.allclose(out.probs[out.probs > 0], scores[out.probs > 0])
    assert out.aux["unrouted_tokens"].item() == int(((out.probs > 0).sum(1) == 0).sum())


# ---------------------------------------------------------------- loss-free balancing


def test_loss_free_bias_moves_toward_balance():
    torch.manual_seed(0)
    gate = LossFreeBalancedGate(8, 8, 2, gamma=1e-2).train()
    with torch.no_grad():
        gate.w_gate.weight.normal_(std=0.3)
        gate.w_gate.weight[0] += 1.0  # a skewed router: expert 0 strongly preferred
    x = torch.randn(256, 8) + 0.5

    def max_over_mean() -> float:
        load = gate(x).aux["load"]
        return (load.max() / load.mean()).item()

    gate.eval()
    before = max_over_mean()
    gate.train()
    for _ in range(400):
        gate(x)
    gate.eval()
    after = max_over_mean()
    assert before > 2.0 and after < 1.5, (before, after)
    assert gate.bias[0] < 0  # the overloaded expert was nudged down
    assert "bias" not in dict(gate.named_parameters())  # a buffer: no optimiser touches it
    assert "bias" in gate.state_dict()  # but it is saved with the model


def test_loss_free_bias_does_not_change_gate_weights():
    torch.manual_seed(1)
    gate = LossFreeBalancedGate(6, 5, 2, score_func="softmax").eval()
    x = torch.randn(12, 6)
    base = gate(x)
    with torch.no_grad():
        gate.bias.fill_(0.37)  # shifts every score equally: same selection
    shifted = gate(x)
    assert torch.equal(shifted.indices, base.indices)
    assert torch.equal(shifted.weights, base.weights)
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0]))  # forces expert 4 in
    forced = gate(x)
    assert (forced.indices == 4).any(1).all()
    scores = torch.softmax(forced.logits, -1)
    sel = scores.gather(1, forced.indices)
    assert torch.allclose(forced.weights, sel / sel.sum(1, keepdim=True))
    # softmax scores renormalised over the selection == softmax over the selected logits
    assert torch.allclose(forced.weights, torch.softmax(forced.logits.gather(1, forced.indices), -1))


def test_loss_free_update_rule_and_manual_mode():
    gate = LossFreeBalancedGate(4, 4, 1, gamma=0.5, auto_update=False).train()
    gate.update_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    assert torch.equal(gate.bias, torch.tensor([-0.5, 0.5, 0.0, 0.5]))
    gate(torch.randn(9, 4))
    assert gate.pending_load.sum().item() == 9
    bias_before = gate.bias.clone()
    gate.update_bias()
    assert not torch.equal(gate.bias, bias_before) and gate.pending_load.sum().item() == 0
    gate.eval()(torch.randn(9, 4))
    assert gate.pending_load.sum().item() == 0  # eval forwards never touch the bias
    with pytest.raises(ValueError, match="score_func"):
        LossFreeBalancedGate(4, 4, 1, score_func="relu")


# ---------------------------------------------------------------- initialisation without noise


def test_noise_free_gate_starts_random_not_collapsed():
    """Zero init relies on the noise to break ties; without noise every token would pick the same
    k experts (topk's tie order) and the router would stay collapsed."""
    torch.manual_seed(0)
    gate = NoisyTopKGate(16, 8, 2, noisy=False).train()
    assert torch.count_nonzero(gate.w_gate.weight) == gate.w_gate.weight.numel()
    assert 0.005 < gate.w_gate.weight.std().item() < 0.05
    x = torch.randn(64, 16)
    chosen = {tuple(sorted(row)) for row in gate(x).indices.tolist()}
    assert len(chosen) > 5
    assert torch.count_nonzero(gate(x).aux["load"]) == 8  # every expert gets some tokens
    # with noise, the zero init of the paper is kept
    assert torch.count_nonzero(NoisyTopKGate(16, 8, 2).w_gate.weight) == 0


def test_noise_free_hierarchical_gate_starts_random_not_collapsed():
    torch.manual_seed(0)
    gate = HierarchicalGate(16, Hierarchy(4, 4, 1, 1), noisy=False)
    assert torch.count_nonzero(gate.w_gate.weight) == gate.w_gate.weight.numel()
    assert torch.count_nonzero(gate.w_gate_secondary) == gate.w_gate_secondary.numel()
    out = gate(torch.randn(64, 16))
    assert torch.unique(out.indices).numel() > 5
    noisy = HierarchicalGate(16, Hierarchy(4, 4, 1, 1))
    assert torch.count_nonzero(noisy.w_gate.weight) == 0 and torch.count_nonzero(noisy.w_gate_secondary) == 0


# ---------------------------------------------------------------- naive references for the balancing terms
#
# Written from the formulas of Shazeer et al. (2017), Section 4 / Appendix A (flat gate) and
# Appendix B (hierarchical gate), with Python loops and no helper from moee.moe, so the gates'
# vectorised versions are checked against an independent implementation (values and gradients).


def _naive_cv2(v: torch.Tensor) -> torch.Tensor:
    """CV^2 = population variance / mean^2."""
    n = v.shape[0]
    mean = sum(v[i] for i in range(n)) / n
    return sum((v[i] - mean) ** 2 for i in range(n)) / n / mean**2


def _phi(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def _naive_noisy_gate(clean, noise_logits, eps, k):
    """Per row: H = clean + eps * softplus(noise), G = softmax over the top-k H, and
    P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / std_i). Returns (G, P), lists of rows."""
    gates, probs_in = [], []
    for r in range(clean.shape[0]):
        std = torch.log1p(torch.exp(noise_logits[r]))
        h = clean[r] + eps[r] * std
        e = h.shape[0]
        order = sorted(range(e), key=lambda i: -h[i].item())
        top = order[:k]
        denom = sum(torch.exp(h[i]) for i in top)
        gates.append(torch.stack([torch.exp(h[i]) / denom if i in top else h[i] * 0 for i in range(e)]))
        row_p = []
        for i in range(e):
            others = sorted((h[j] for j in range(e) if j != i), key=lambda t: -t.item())
            row_p.append(_phi((clean[r, i] - others[k - 1]) / std[i]))
        probs_in.append(torch.stack(row_p))
    return torch.stack(gates), torch.stack(probs_in)


def _random_noisy_gate(seed: int, **kw) -> NoisyTopKGate:
    torch.manual_seed(seed)
    gate = NoisyTopKGate(6, 5, 2, **kw)
    torch.nn.init.normal_(gate.w_gate.weight)
    torch.nn.init.normal_(gate.w_noise.weight)
    return gate


def test_noisy_gate_balance_terms_match_naive_reference_values_and_gradients():
    gate = _random_noisy_gate(1, w_importance=0.3, w_load=0.7).train()
    x = torch.randn(12, 6)
    torch.manual_seed(11)
    out = gate(x)
    torch.manual_seed(11)
    eps = torch.randn(12, 5)  # the gate's one noise draw, same shape and generator

    w_g = gate.w_gate.weight.detach().clone().requires_grad_(True)
    w_n = gate.w_noise.weight.detach().clone().requires_grad_(True)
    g, p = _naive_noisy_gate(x @ w_g.t(), x @ w_n.t(), eps, 2)
    importance, load = g.sum(0), p.sum(0)
    torch.testing.assert_close(out.probs, g.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux["importance"], importance.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux["load"], load.detach(), rtol=1e-5, atol=1e-6)
    imp_loss, ld_loss = 0.3 * _naive_cv2(importance), 0.7 * _naive_cv2(load)
    assert out.aux["importance_loss"].item() == pytest.approx(imp_loss.item(), rel=1e-5)
    assert out.aux["load_loss"].item() == pytest.approx(ld_loss.item(), rel=1e-5)
    assert out.aux["loss"].item() == pytest.approx((imp_loss + ld_loss).item(), rel=1e-5)

    # each balance term carries its own gradient to both W_g and W_noise
    for name in ("importance_loss", "load_loss", "loss"):
        got = torch.autograd.grad(out.aux[name], [gate.w_gate.weight, gate.w_noise.weight], retain_graph=True)
        want_loss = {"importance_loss": imp_loss, "load_loss": ld_loss, "loss": imp_loss + ld_loss}[name]
        want = torch.autograd.grad(want_loss, [w_g, w_n], retain_graph=True)
        for a, b in zip(got, want):
            assert b.abs().sum() > 0, name
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_balance_losses_train_a_skewed_router_towards_balance():
    torch.manual_seed(0)
    gate = NoisyTopKGate(8, 8, 2, w_importance=1.0, w_load=1.0)
    with torch.no_grad():
        gate.w_gate.weight.normal_(std=0.3)
        gate.w_gate.weight[0] += 1.0  # expert 0 strongly preferred
    x = torch.randn(256, 8) + 0.5

    def cvs() -> tuple[float, float]:
        with torch.no_grad():
            out = gate.eval()(x)
        return cv_squared(out.aux["importance"]).item(), cv_squared(out.aux["load"]).item()

    imp_before, load_before = cvs()
    opt = torch.optim.Adam(gate.parameters(), lr=0.05)
    gate.train()
    for _ in range(30):
        opt.zero_grad()
        gate(x).aux["loss"].backward()  # the balancing losses alone
        opt.step()
    imp_after, load_after = cvs()
    assert imp_before > 1.0 and load_before > 0.5, (imp_before, load_before)
    assert imp_after < imp_before / 4 and load_after < load_before / 4, (imp_after, load_after)


def _naive_hierarchical(gate: HierarchicalGate, x, eps_p, eps_s, params):
    """Importance_H and Load_H of Shazeer et al. (2017), Appendix B, in training mode:
    Importance_H(X)_{i,j} = sum_x G_primary(x)_i G_i(x)_j and
    Load_H(X)_{i,j} = Load_primary(X)_i * Load_i(X^(i))_j / |X^(i)|, X^(i) = {x : G_primary(x)_i > 0},
    every Load the smooth estimator sum_x P(x, .) of its own noisy gate."""
    w_p, w_np, w_s, w_ns = params
    a = gate.n_groups
    g_p, p_p = _naive_noisy_gate(x @ w_p.t(), x @ w_np.t(), eps_p, gate.k_primary)
    load_primary = p_p.sum(0)
    importance, load = [], []
    for i in range(a):
        g_i, p_i = _naive_noisy_gate(x @ w_s[i], x @ w_ns[i], eps_s[:, i], gate.k_secondary)
        importance.append((g_p[:, i : i + 1] * g_i).sum(0))
        members = [r for r in range(x.shape[0]) if g_p[r, i].item() > 0]
        assert members, "reference needs every group used"
        load_i = sum(p_i[r] for r in members)
        load.append(load_primary[i] * load_i / len(members))
    return torch.cat(importance), torch.cat(load)


def test_hierarchical_training_load_matches_naive_reference_values_and_gradients():
    gate = _random_hierarchical(3, w_importance=0.4, w_load=0.6).train()
    x = torch.randn(30, 6)
    torch.manual_seed(7)
    out = gate(x)
    torch.manual_seed(7)
    eps_p, eps_s = torch.randn(30, 3), torch.randn(30, 3, 4)  # primary draw, then secondary

    params = [
        p.detach().clone().requires_grad_(True)
        for p in (gate.w_gate.weight, gate.w_noise.weight, gate.w_gate_secondary, gate.w_noise_secondary)
    ]
    importance, load = _naive_hierarchical(gate, x, eps_p, eps_s, params)
    torch.testing.assert_close(out.aux["importance"], importance.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux["load"], load.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(load.detach(), load.detach().round())  # smooth, not the eval counts
    want = 0.4 * _naive_cv2(importance) + 0.6 * _naive_cv2(load)
    assert out.aux["loss"].item() == pytest.approx(want.item(), rel=1e-5)
    own = [gate.w_gate.weight, gate.w_noise.weight, gate.w_gate_secondary, gate.w_noise_secondary]
    got = torch.autograd.grad(out.aux["loss"], own)
    for g_got, g_want in zip(got, torch.autograd.grad(want, params)):
        assert g_want.abs().sum() > 0
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- argument checks, defaults, contracts

_BAD_ARGS = [
    (lambda: NoisyTopKGate(4.0, 3, 2), TypeError, r"^d_model must be an int, got float$"),
    (lambda: NoisyTopKGate(4, True, 1), TypeError, r"^n_experts must be an int, got bool$"),
    (lambda: NoisyTopKGate(0, 3, 1), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: NoisyTopKGate(4, 0, 1), ValueError, r"^n_experts must be >= 1, got 0$"),
    (
        lambda: NoisyTopKGate(4, 3, 2, w_importance=-0.5),
        ValueError,
        r"^w_importance must be a non-negative number, got -0.5$",
    ),
    (
        lambda: NoisyTopKGate(4, 3, 2, w_load=float("nan")),
        ValueError,
        r"^w_load must be a non-negative number, got nan$",
    ),
    (lambda: SoftmaxGate(0, 3), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: SoftmaxGate(4, 0), ValueError, r"^n_experts must be >= 1, got 0$"),
    (
        lambda: SoftmaxGate(4, 3, w_importance=-1.0),
        ValueError,
        r"^w_importance must be a non-negative number",
    ),
    (lambda: HierarchicalGate(0, Hierarchy(2, 2, 1, 1)), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: HierarchicalGate(4, Hierarchy(0, 2, 1, 1)), ValueError, r"^n_groups must be >= 1, got 0$"),
    (
        lambda: HierarchicalGate(4, Hierarchy(2, 0, 1, 1)),
        ValueError,
        r"^experts_per_group must be >= 1, got 0$",
    ),
    (lambda: HierarchicalGate(4, Hierarchy(2, 2, 3, 1)), ValueError, r"^k_primary must be in \[1, 2\]"),
    (lambda: HierarchicalGate(4, Hierarchy(2, 2, 1, 3)), ValueError, r"^k_secondary must be in \[1, 2\]"),
    (
        lambda: HierarchicalGate(4, Hierarchy(2, 2, 1, 1), w_importance=-1.0),
        ValueError,
        r"^w_importance must be a non-negative",
    ),
    (
        lambda: HierarchicalGate(4, Hierarchy(2, 2, 1, 1), w_load=-1.0),
        ValueError,
        r"^w_load must be a non-negative",
    ),
    (lambda: BatchwiseBalancedGate(0, 3, 1), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: BatchwiseBalancedGate(4, 0, 1), ValueError, r"^n_experts must be >= 1, got 0$"),
    (
        lambda: BatchwiseBalancedGate(4, 3, 1, w_threshold=-1.0),
        ValueError,
        r"^w_threshold must be a non-negative",
    ),
    (lambda: BatchwiseBalancedGate(4, 3, 1, init_std=0.0), ValueError, r"^init_std must be > 0, got 0.0$"),
    (lambda: ExpertChoiceGate(0, 3), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: ExpertChoiceGate(4, 0), ValueError, r"^n_experts must be >= 1, got 0$"),
    (
        lambda: ExpertChoiceGate(4, 3, capacity_factor=0.0),
        ValueError,
        r"^capacity_factor must be > 0, got 0.0$",
    ),
    (lambda: LossFreeBalancedGate(0, 3, 1), ValueError, r"^d_model must be >= 1, got 0$"),
    (lambda: LossFreeBalancedGate(4, 0, 1), ValueError, r"^n_experts must be >= 1, got 0$"),
    (lambda: LossFreeBalancedGate(4, 3, 1, gamma=-1.0), ValueError, r"^gamma must be >= 0, got -1.0$"),
    (lambda: batchwise_mask(torch.ones(4), 1), ValueError, r"^scores must be \[N, E\], got shape \(4,\)$"),
    (lambda: batchwise_mask(torch.ones(3, 2), 4), ValueError, r"^m must be in \[1, 3\]"),
    (
        lambda: noisy_top_k(torch.zeros(2, 3), None, 1, True),
        ValueError,
        r"^noise_logits are required when add_noise is True$",
    ),
    (
        lambda: NoisyTopKGate(4, 3, 2)([[0.0] * 4]),
        TypeError,
        r"^gate input must be a torch.Tensor, got list$",
    ),
    (
        lambda: BatchwiseBalancedGate(4, 3, 1)(torch.zeros(0, 4)),
        ValueError,
        r"^BatchwiseBalancedGate needs a non-empty batch$",
    ),
    (
        lambda: ExpertChoiceGate(4, 3)(torch.zeros(0, 4)),
        ValueError,
        r"^ExpertChoiceGate needs a non-empty batch$",
    ),
]


@pytest.mark.parametrize(("build", "error", "message"), _BAD_ARGS)
def test_bad_arguments_raise_a_clear_error(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_smallest_valid_arguments_and_boundary_values():
    x = torch.randn(1, 1)
    for gate in (
        NoisyTopKGate(1, 1, 1),
        SoftmaxGate(1, 1),
        HierarchicalGate(1, Hierarchy(1, 1, 1, 1)),
        BatchwiseBalancedGate(1, 1, 1),
        ExpertChoiceGate(1, 1, capacity_factor=0.5),  # a factor below 1 is valid
        LossFreeBalancedGate(1, 1, 1, gamma=0.0),  # gamma 0 (a frozen bias) is valid
    ):
        out = gate(x)
        assert out.indices.tolist() == [[0]] and out.n_experts == 1 and out.k == 1


def test_defaults_have_no_balancing_loss_and_small_random_inits():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    noisy = _random_noisy_gate(0).train()
    assert noisy(torch.randn(8, 6)).aux["loss"].item() == 0.0
    soft = SoftmaxGate(64, 8)
    torch.nn.init.normal_(soft.w_gate.weight)
    assert soft(x).aux["loss"].item() == 0.0
    assert _random_hierarchical(0).train()(torch.randn(8, 6)).aux["loss"].item() == 0.0
    for gate in (
        BatchwiseBalancedGate(64, 64, 2),
        ExpertChoiceGate(64, 64),
        LossFreeBalancedGate(64, 64, 2),
        NoisyTopKGate(64, 64, 2, noisy=False),
    ):
        assert gate.w_gate.weight.std().item() == pytest.approx(0.02, rel=0.05)
    clean = HierarchicalGate(64, Hierarchy(8, 64, 1, 1), noisy=False)
    assert clean.w_noise is None and clean.w_noise_secondary is None
    assert clean.w_gate_secondary.std().item() == pytest.approx(0.02, rel=0.05)
    assert clean.n_experts == 8 * 64 and clean.k == 1


def test_pack_selection_width_is_the_widest_row():
    from moee.moe.gates import _pack_selection

    selected = torch.tensor([[True, False, False], [False, False, True]])
    gates = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    weights, indices, mask = _pack_selection(selected, gates)
    assert indices.tolist() == [[0], [2]] and mask.tolist() == [[True], [True]]
    torch.testing.assert_close(weights, torch.tensor([[0.7], [0.6]]))
    weights, indices, mask = _pack_selection(torch.zeros(2, 3, dtype=torch.bool), gates)
    assert weights.shape == (2, 1) and not mask.any() and (weights == 0).all()
    weights, indices, mask = _pack_selection(torch.zeros(0, 3, dtype=torch.bool), torch.zeros(0, 3))
    assert weights.shape == indices.shape == mask.shape == (0, 1)


def test_loads_are_float_counts_of_real_selections():
    # a softmax gate whose second expert underflows to an exact 0 is not selected there
    soft = SoftmaxGate(1, 2)
    with torch.no_grad():
        soft.w_gate.weight.copy_(torch.tensor([[0.0], [-1.0]]))
    out = soft(torch.full((3, 1), 200.0))
    assert out.aux["load"].tolist() == [3.0, 0.0] and out.aux["load"].dtype == torch.float32
    x = torch.randn(12, 6)
    assert _random_noisy_gate(2).eval()(x).aux["load"].dtype == torch.float32
    assert BatchwiseBalancedGate(6, 4, 2).eval()(x).aux["load"].dtype == torch.float32
    assert ExpertChoiceGate(6, 4)(x).aux["load"].dtype == torch.float32


def test_batchwise_threshold_is_strict_and_examples_per_expert_floor():
    gate = BatchwiseBalancedGate(4, 8, 1)
    assert torch.equal(gate.thresholds.detach(), torch.full((8,), 1 / 8))
    assert gate.examples_per_expert(4) == 1  # 4 // 8 = 0 -> at least 1
    assert gate.examples_per_expert(40) == 5
    gate.eval()
    x = torch.randn(1, 4)
    scores = torch.softmax(gate.w_gate(x), -1).detach()
    with torch.no_grad():
        gate.thresholds.copy_(scores[0])  # every score equals its threshold: none is above it
    out = gate(x)
    assert not out.mask.any() and (out.probs == 0).all()


def test_expert_choice_capacity_defaults_and_unrouted_tokens():
    gate = ExpertChoiceGate(4, 4)
    assert gate.capacity(8) == 2 and gate.capacity(3) == 1  # factor 1, minimum 1
    assert ExpertChoiceGate(4, 4, capacity_factor=0.1, minimum_capacity=3).capacity(8) == 3
    torch.manual_seed(1)
    gate = ExpertChoiceGate(4, 2, capacity_factor=0.25)  # capacity int(8 * 0.25 / 2) = 1
    out = gate(torch.randn(8, 4))
    routed = set(out.aux["expert_tokens"].flatten().tolist())
    assert out.aux["capacity"].item() == 1 and len(routed) <= 2
    assert out.aux["unrouted_tokens"].item() == 8 - len(routed)
    assert ExpertChoiceGate(4, 2)(torch.randn(1, 4)).indices.shape == (1, 2)  # a single token works


def test_hierarchical_single_member_group_and_logits():
    gate = HierarchicalGate(4, Hierarchy(3, 2, 1, 1)).eval()
    with torch.no_grad():
        gate.w_gate.weight.copy_(torch.eye(3, 4))  # group i <- feature i
        gate.w_gate_secondary.normal_()
    x = torch.eye(4)[[0, 0, 0, 0, 0, 1, 1, 1, 1, 2]] + 0.01 * torch.randn(10, 4)
    out = gate(x)
    assert out.aux["group_counts"].tolist() == [5.0, 4.0, 1.0]
    assert out.aux["group_counts"].dtype == torch.float32
    # eval: Load_H(i, j) = |X^(i)| * count_ij / |X^(i)| = count_ij, whatever the group size
    counts = torch.bincount(out.indices.flatten(), minlength=6).float()
    torch.testing.assert_close(out.aux["load"], counts)
    assert out.aux["load"][4:].sum().item() == 1.0
    torch.testing.assert_close(out.aux["primary_logits"], x @ gate.w_gate.weight.t())
    sec = torch.stack([x @ gate.w_gate_secondary[i] for i in range(3)], 1)
    torch.testing.assert_close(out.aux["secondary_logits"], sec)
    # softmax over all experts of the logits = product of the two levels' dense softmaxes
    product = torch.softmax(out.aux["primary_logits"], -1).unsqueeze(-1) * torch.softmax(sec, -1)
    torch.testing.assert_close(torch.softmax(out.logits, -1), product.reshape(10, 6))


def test_hierarchical_smooth_load_with_few_groups():
    """k_secondary >= n_groups: the secondary level still uses the smooth estimator."""
    torch.manual_seed(0)
    gate = HierarchicalGate(6, Hierarchy(2, 4, 1, 2), w_load=1.0)
    for p in gate.parameters():
        torch.nn.init.normal_(p)
    gate.train()
    x = torch.randn(30, 6)
    torch.manual_seed(9)
    out = gate(x)
    torch.manual_seed(9)
    eps_p, eps_s = torch.randn(30, 2), torch.randn(30, 2, 4)
    params = (gate.w_gate.weight, gate.w_noise.weight, gate.w_gate_secondary, gate.w_noise_secondary)
    with torch.no_grad():
        _, load = _naive_hierarchical(gate, x, eps_p, eps_s, params)
    torch.testing.assert_close(out.aux["load"], load, rtol=1e-5, atol=1e-6)


def test_loss_free_gate_outputs_defaults_and_state():
    torch.manual_seed(3)
    gate = LossFreeBalancedGate(6, 4, 1)
    assert gate.score_func == "sigmoid" and gate.auto_update
    assert "pending_load" not in gate.state_dict()  # per-step scratch, not model state
    x = torch.randn(10, 6)
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))  # forces expert 0 only
    out = gate.train()(x)
    assert out.aux["load"].tolist() == [10.0, 0.0, 0.0, 0.0]  # unused experts still have a slot
    assert out.aux["bias"].tolist() == [5.0, 0.0, 0.0, 0.0]  # the bias this forward used
    # default gamma 1e-3: overloaded expert down, the others up
    torch.testing.assert_close(gate.bias, torch.tensor([5.0 - 1e-3, 1e-3, 1e-3, 1e-3]))
    assert out.aux["loss"].item() == 0.0
    assert out.probs.shape == (10, 4) and torch.equal(out.probs[:, 0], torch.ones(10))
    torch.testing.assert_close(out.aux["importance"], torch.tensor([10.0, 0.0, 0.0, 0.0]))
