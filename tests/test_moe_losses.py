"""Balancing losses and top-k helpers against hand-worked numbers (Shazeer et al. 2017; Switch)."""

from __future__ import annotations

import math

import pytest
import torch

from moee.moe import (
    cv_squared,
    importance_loss,
    keep_top_k,
    kth_excluding,
    load_loss,
    prob_in_top_k,
    router_z_loss,
    switch_aux_loss,
)

H = torch.tensor([2.3, 0.8, 0.6, -2.0])
CLEAN = torch.tensor([2.0, 1.0, 0.5, -0.5])


def test_cv_squared_seed_numbers_population_std():
    assert cv_squared(torch.tensor([10.0, 10.0, 10.0])).item() == 0.0
    value = cv_squared(torch.tensor([25.0, 10.0, 1.0])).item()
    assert value == pytest.approx(98.0 / 144.0, rel=1e-6)
    assert round(value, 4) == 0.6806
    assert value != pytest.approx(1.0208, abs=1e-3)  # the sample-std (ddof=1) value


def test_cv_squared_edge_cases():
    assert cv_squared(torch.zeros(5)).item() == 0.0
    assert cv_squared(torch.tensor([3.0])).item() == 0.0
    with pytest.raises(ValueError, match="1-D"):
        cv_squared(torch.ones(2, 2))


def test_cv_squared_is_scale_invariant_and_differentiable():
    v = torch.tensor([1.0, 2.0, 6.0], requires_grad=True)
    a = cv_squared(v)
    assert cv_squared(v.detach() * 7).item() == pytest.approx(a.item(), rel=1e-6)
    a.backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_keep_top_k_uses_literal_minus_inf():
    out = keep_top_k(H, 2)
    assert torch.equal(out[:2], H[:2])
    assert math.isinf(out[2].item()) and out[2].item() < 0
    assert math.isinf(out[3].item()) and out[3].item() < 0
    assert torch.equal(keep_top_k(H, 4), H)


def test_keep_top_k_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        keep_top_k(H, 0)
    with pytest.raises(ValueError, match="k must be in"):
        keep_top_k(H, 5)
    with pytest.raises(TypeError, match="int"):
        keep_top_k(H, 2.0)
    with pytest.raises(TypeError, match="floating-point"):
        keep_top_k(torch.tensor([3, 1, 2]), 1)


def test_kth_excluding_worked_example():
    assert torch.allclose(kth_excluding(H, 2), torch.tensor([0.6, 0.6, 0.8, 0.8]))


def test_kth_excluding_matches_brute_force():
    torch.manual_seed(0)
    h = torch.randn(50, 7)
    for k in range(1, 7):
        expected = torch.empty_like(h)
        for row in range(h.shape[0]):
            for i in range(h.shape[1]):
                others = torch.cat([h[row, :i], h[row, i + 1 :]])
                expected[row, i] = others.sort(descending=True).values[k - 1]
        assert torch.equal(kth_excluding(h, k), expected), k
    assert torch.isneginf(kth_excluding(h, 7)).all()


def test_prob_in_top_k_worked_example():
    p = prob_in_top_k(CLEAN, H, torch.ones(4), 2)
    assert torch.allclose(p, torch.tensor([0.9192, 0.6554, 0.3821, 0.0968]), atol=5e-5)
    assert p.sum().item() == pytest.approx(2.054, abs=1e-3)
    # the Phi arguments are (clean - threshold) / std = [1.4, 0.4, -0.3, -1.3]
    assert torch.allclose(torch.special.ndtri(p), torch.tensor([1.4, 0.4, -0.3, -1.3]), atol=1e-4)


def test_prob_in_top_k_scales_with_noise_std_and_is_differentiable():
    clean = CLEAN.clone().requires_grad_(True)
    std = torch.full((4,), 2.0, requires_grad=True)
    p = prob_in_top_k(clean, H, std, 2)
    expected = torch.special.ndtr(torch.tensor([1.4, 0.4, -0.3, -1.3]) / 2.0)
    assert torch.allclose(p, expected, atol=1e-6)
    p.sum().backward()
    assert (clean.grad > 0).all() and std.grad.abs().sum() > 0


def test_prob_in_top_k_zero_std_is_a_hard_indicator():
    p = prob_in_top_k(CLEAN, H, torch.zeros(4), 2)
    assert torch.equal(p, torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_prob_in_top_k_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        prob_in_top_k(CLEAN, H[:3], torch.ones(4), 2)


def test_importance_and_load_loss():
    gates = torch.tensor([[0.9, 0.1, 0.0], [0.8, 0.0, 0.2], [0.0, 0.5, 0.5]])
    # Importance = [1.7, 0.6, 0.7]: mean 1, population variance (0.49 + 0.16 + 0.09) / 3
    assert importance_loss(gates).item() == pytest.approx(0.74 / 3, rel=1e-6)
    load = torch.tensor([25.0, 10.0, 1.0])
    assert load_loss(load).item() == pytest.approx(0.6806, abs=1e-4)
    with pytest.raises(ValueError):
        importance_loss(gates[0])


def test_switch_aux_uniform_is_alpha():
    t, e, alpha = 12, 4, 0.01
    probs = torch.full((t, e), 1.0 / e)
    idx = torch.arange(t) % e
    assert switch_aux_loss(probs, idx, alpha).item() == pytest.approx(alpha, rel=1e-6)


def test_switch_aux_collapsed_is_alpha_e_q():
    t, e, alpha, q = 10, 4, 0.01, 0.7
    probs = torch.tensor([[q, 0.1, 0.1, 0.1]]).expand(t, e)
    idx = torch.zeros(t, dtype=torch.long)
    assert switch_aux_loss(probs, idx, alpha).item() == pytest.approx(alpha * e * q, rel=1e-6)


def test_switch_aux_gradient_flows_through_p_not_f():
    t, e, alpha = 6, 3, 0.01
    probs = torch.softmax(torch.randn(t, e), -1).requires_grad_(True)
    idx = torch.tensor([0, 0, 0, 1, 1, 2])
    switch_aux_loss(probs, idx, alpha).backward()
    f = torch.tensor([3.0, 2.0, 1.0]) / t
    # d/dprobs[t, i] of alpha*E*sum_i f_i*mean_t(probs)_i = alpha*E*f_i/T, the same for every row
    assert torch.allclose(probs.grad, (alpha * e * f / t).expand(t, e))


def test_switch_aux_validates_shapes():
    with pytest.raises(ValueError, match="expert_index"):
        switch_aux_loss(torch.ones(4, 2) / 2, torch.zeros(3, dtype=torch.long))


def test_router_z_loss():
    logits = torch.zeros(5, 8, requires_grad=True)
    z = router_z_loss(logits)
    assert z.item() == pytest.approx(math.log(8) ** 2, rel=1e-6)
    z.backward()
    assert torch.allclose(logits.grad, torch.full((5, 8), 2 * math.log(8) / 8 / 5))
    shifted = router_z_loss(torch.full((5, 8), 3.0))
    assert shifted.item() == pytest.approx((3 + math.log(8)) ** 2, rel=1e-6)


def test_cv_squared_small_inputs_dtypes_and_two_entries():
    assert cv_squared(torch.tensor([1.0, 3.0])).item() == pytest.approx(0.25)  # var 1 / mean^2 4
    assert cv_squared(torch.tensor([25, 10, 1])).item() == pytest.approx(98.0 / 144.0, rel=1e-6)  # ints
    double = cv_squared(torch.tensor([25.0, 10.0, 1.0], dtype=torch.float64))
    assert double.dtype == torch.float64 and double.item() == pytest.approx(98.0 / 144.0, rel=1e-12)
    # eps only guards the all-zero vector: tiny loads stay in [0, true value]
    tiny = cv_squared(torch.tensor([1e-6, 3e-6])).item()
    assert 0.0 <= tiny <= 0.25


def test_check_k_rejects_non_int_and_bool():
    with pytest.raises(TypeError, match=r"^k must be an int, got float$"):
        keep_top_k(H, 2.0)
    with pytest.raises(TypeError, match=r"^k must be an int, got bool$"):
        keep_top_k(H, True)


def test_error_messages_name_the_shapes():
    with pytest.raises(ValueError, match=r"^importance_loss expects gates \[N, E\], got shape \(3,\)$"):
        importance_loss(torch.ones(3))
    with pytest.raises(
        ValueError, match=r"^clean_logits, noisy_logits and noise_std must have the same shape"
    ):
        prob_in_top_k(CLEAN, H[:3], torch.ones(4), 2)
    with pytest.raises(ValueError, match=r"^switch_aux_loss expects probs \[T, E\], got shape \(4,\)$"):
        switch_aux_loss(torch.ones(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^expert_index must have shape \[4\], got \(3,\)$"):
        switch_aux_loss(torch.ones(4, 2) / 2, torch.zeros(3, dtype=torch.long))


def test_switch_aux_default_alpha_is_one_percent():
    probs = torch.full((8, 4), 0.25)
    assert switch_aux_loss(probs, torch.arange(8) % 4).item() == pytest.approx(0.01, rel=1e-6)


def test_router_z_loss_shapes():
    assert router_z_loss(torch.zeros(8)).item() == pytest.approx(math.log(8) ** 2, rel=1e-6)  # one row
    assert router_z_loss(torch.zeros(5, 1)).item() == 0.0  # a single expert: logsumexp = 0
    # [2, 3, 4]: reduced over the last (expert) axis only, then averaged over the 6 rows
    logits = torch.zeros(2, 3, 4)
    logits[0, 0] = torch.tensor([math.log(2.0), 0.0, 0.0, 0.0])  # logsumexp = log 5
    want = (5 * math.log(4) ** 2 + math.log(5) ** 2) / 6
    assert router_z_loss(logits).item() == pytest.approx(want, rel=1e-6)
    for bad in (torch.tensor(1.0), torch.zeros(3, 0)):
        with pytest.raises(ValueError, match=r"^router_z_loss expects logits \[\.\.\., E\], got shape"):
            router_z_loss(bad)
