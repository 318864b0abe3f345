"""Switch top-1 routing with capacity against its invariants and a per-token loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from moee.moe import SwitchFFN, SwitchRouter, switch_capacity, switch_route
from moee.moe.switch import switch_ffn_reference

# small reference shapes: T = 8 tokens, D = 4, E = 3 experts, H = 8
T, D, E, HID = 8, 4, 3, 8


def test_switch_capacity_convention():
    assert switch_capacity(8, 3, 1.0) == 2  # int(8/3) floors
    assert switch_capacity(8, 3, 1.25) == 3  # int(3.33)
    assert switch_capacity(8, 3, 0.1) == 1  # minimum 1
    assert switch_capacity(8, 3, 0.1, minimum=4) == 4  # upstream default minimum
    assert switch_capacity(4, 1, 2.0) == 4  # clamped to the token count
    assert switch_capacity(0, 3, 1.0, minimum=0) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        switch_capacity(8, 3, 0.0)
    with pytest.raises(ValueError, match="experts"):
        switch_capacity(8, 0, 1.0)
    with pytest.raises(TypeError, match="tokens"):
        switch_capacity(8.0, 3, 1.0)


def test_positions_from_exclusive_cumsum_and_token_order_wins():
    # expert choices: 0 0 1 0 2 0 1 0 -> slots 0 1 0 2 0 3 1 4
    choice = torch.tensor([0, 0, 1, 0, 2, 0, 1, 0])
    logits = torch.nn.functional.one_hot(choice, 3).float() * 2.0
    r = switch_route(logits, capacity_factor=1.0)  # capacity int(8/3) = 2
    assert r.capacity == 2
    assert r.expert_index.tolist() == choice.tolist()
    assert r.positions.tolist() == [0, 1, 0, 2, 0, 3, 1, 4]
    assert r.accepted.tolist() == [True, True, True, False, True, False, True, False]
    # f counts the original choices, overflow included
    assert torch.allclose(r.fractions, torch.tensor([5.0, 2.0, 1.0]) / 8)
    # dispatch: exactly one slot per accepted token, at most one token per slot
    assert r.dispatch.shape == (8, 3, 2)
    assert torch.equal(r.dispatch.sum((1, 2)), r.accepted.long())
    assert (r.dispatch.sum(0) <= 1).all()
    for t in r.accepted.nonzero().flatten().tolist():
        assert r.dispatch[t, r.expert_index[t], r.positions[t]]
    assert torch.allclose(r.combine.sum((1, 2)), r.gate * r.accepted)


def test_argmax_ties_go_to_first_expert_and_gate_not_renormalised():
    r = switch_route(torch.zeros(4, 3), capacity_factor=4.0)
    assert r.expert_index.tolist() == [0, 0, 0, 0]
    assert torch.allclose(r.gate, torch.full((4,), 1 / 3))  # not 1: the selected probability itself


def test_switch_aux_uniform_and_collapsed():
    alpha = 0.01
    # uniform P (equal logits) gives exactly alpha whatever f is
    assert switch_route(torch.zeros(6, 3), 1.0).aux_loss.item() == pytest.approx(alpha, rel=1e-6)
    # collapsed: every token picks expert 0 with probability q -> alpha * E * q
    logits = torch.tensor([[2.0, 0.0, 0.0]]).expand(6, 3)
    r = switch_route(logits, 1.0)
    q = torch.softmax(logits[0], -1)[0].item()
    assert r.aux_loss.item() == pytest.approx(alpha * 3 * q, rel=1e-6)
    assert torch.equal(r.fractions, torch.tensor([1.0, 0.0, 0.0]))


def test_non_finite_router_logits_raise():
    with pytest.raises(ValueError, match="router logits overflowed float32"):
        switch_route(torch.tensor([[0.0, float("nan")]]), 1.0)
    router = SwitchRouter(D, E)
    with torch.no_grad():
        router.weight.fill_(1e30)
    with pytest.raises(ValueError, match="router logits overflowed float32"):
        router(torch.full((2, D), 1e30))


def _ffn(capacity_factor: float, seed: int = 7) -> SwitchFFN:
    torch.manual_seed(seed)
    return SwitchFFN(D, HID, E, capacity_factor=capacity_factor)


def test_overflow_tokens_keep_their_input_exactly():
    ffn = _ffn(0.5)
    x = torch.randn(T, D)
    y, aux = ffn(x)
    overflow = ~aux["accepted"]
    assert overflow.any() and aux["accepted"].any()
    assert torch.equal(y[overflow], x[overflow])
    assert not torch.equal(y[~overflow], x[~overflow])
    assert aux["dropped_tokens"].item() == int(overflow.sum())


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 3.0])
def test_einsum_dispatch_equals_token_loop_outputs_and_gradients(capacity_factor):
    ffn = _ffn(capacity_factor)
    x = torch.randn(T, D, requires_grad=True)
    target = torch.randn(T, D)
    y, aux = ffn(x)
    ((y - target) ** 2).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in (ffn.router.weight, ffn.w1, ffn.w2)]

    x_ref = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in (ffn.router.weight, ffn.w1, ffn.w2)]
    y_ref = switch_ffn_reference(x_ref, *params, capacity_factor=capacity_factor)
    ((y_ref - target) ** 2).sum().backward()
    ref_grads = [x_ref.grad] + [p.grad for p in params]

    assert torch.allclose(y, y_ref, atol=1e-6)  # the "token-loop error" is ~0
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow
def test_router_trains_through_unrenormalised_top1_gate():
    ffn = _ffn(3.0)
    x = torch.randn(T, D)
    y, aux = ffn(x)
    (y**2).sum().backward()  # an illustrative squared-output objective, no aux loss
    assert ffn.router.weight.grad.abs().sum() > 0
    before = ffn.router.weight.detach().clone()
    torch.optim.SGD(ffn.parameters(), lr=0.1).step()
    assert not torch.equal(ffn.router.weight, before)


def test_expert_and_residual_overflow_raise():
    ffn = _ffn(3.0)
    with torch.no_grad():
        ffn.w1.fill_(1e20)
        ffn.w2.fill_(1e20)
    with pytest.raises(ValueError, match=r"^expert outputs overflowed float32$"):
        ffn(torch.ones(T, D))

    ffn = SwitchFFN(D, HID, E, capacity_factor=3.0)
    with torch.no_grad():
        ffn.router.weight.zero_()  # every token to expert 0 with gate 1/3
        ffn.w1.zero_()
        ffn.w2.zero_()
        ffn.w1[0, 0, 0] = 1e-38
        ffn.w2[0, 0, 0] = 1e38
    x = torch.zeros(1, D)
    x[0, 0] = 3.0e38  # expert output 3e38 is finite; x + 3e38/3 is not
    with pytest.raises(ValueError, match=r"^residual output overflowed float32$"):
        ffn(x)


def test_router_gate_output_contract():
    torch.manual_seed(0)
    router = SwitchRouter(D, E, capacity_factor=0.5)
    out = router(torch.randn(T, D))
    assert out.weights.shape == (T, 1) and out.indices.shape == (T, 1) and out.mask.shape == (T, 1)
    assert (out.weights[~out.mask] == 0).all() and (out.weights[out.mask] > 0).all()
    assert torch.allclose(out.probs.gather(1, out.indices), out.weights)
    assert out.aux["dropped_tokens"].item() == int((~out.mask).sum())
    assert out.aux["load"].sum().item() == T  # counted before capacity
    assert out.logits.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[T, 4\]"):
        router(torch.randn(T, D + 1))


# ---------------------------------------------------------------- argument checks and defaults


def test_switch_capacity_error_messages_name_the_problem():
    with pytest.raises(TypeError, match=r"^tokens must be an int, got float$"):
        switch_capacity(8.0, 3, 1.0)
    with pytest.raises(TypeError, match=r"^experts must be an int, got str$"):
        switch_capacity(8, "3", 1.0)
    with pytest.raises(TypeError, match=r"^minimum must be an int, got bool$"):
        switch_capacity(8, 3, 1.0, minimum=True)
    with pytest.raises(ValueError, match=r"^tokens must be >= 0, got -1$"):
        switch_capacity(-1, 3, 1.0)
    with pytest.raises(ValueError, match=r"^experts must be >= 1, got 0$"):
        switch_capacity(8, 0, 1.0)
    with pytest.raises(ValueError, match=r"^minimum must be >= 0, got -2$"):
        switch_capacity(8, 3, 1.0, minimum=-2)
    with pytest.raises(ValueError, match=r"^capacity_factor must be a finite number > 0, got inf$"):
        switch_capacity(8, 3, float("inf"))


def test_route_and_modules_validate_their_inputs():
    with pytest.raises(ValueError, match=r"^router logits must be \[T, E\], got shape \(4,\)$"):
        switch_route(torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match=r"^router logits overflowed float32$"):
        switch_route(torch.tensor([[0.0, float("inf")]]), 1.0)
    router = SwitchRouter(D, E)
    with pytest.raises(TypeError, match=r"^input must be a torch.Tensor, got list$"):
        router([[0.0] * D])
    for bad in ((0, E), (D, 0)):
        with pytest.raises(ValueError, match=r"^d_model and n_experts must be >= 1, got"):
            SwitchRouter(*bad)
    SwitchRouter(1, 1)  # the smallest valid router
    with pytest.raises(ValueError, match="capacity_factor"):
        SwitchRouter(D, E, capacity_factor=0.0)  # checked at construction, not first use
    with pytest.raises(ValueError, match="minimum"):
        SwitchRouter(D, E, minimum_capacity=-1)
    with pytest.raises(ValueError, match=r"^d_ff must be >= 1, got 0$"):
        SwitchFFN(D, 0, E)
    assert SwitchFFN(D, 1, E)(torch.randn(T, D))[0].shape == (T, D)  # d_ff = 1 is valid


def test_defaults_capacity_factor_minimum_and_alpha():
    x = torch.randn(T, D)
    # capacity factor 1.25 -> int(8 * 1.25 / 3) = 3; minimum 1 -> a factor of 0.1 gives 1 slot
    assert SwitchRouter(D, E).route(x).capacity == 3
    assert SwitchFFN(D, HID, E)(x)[1]["capacity"].item() == 3
    assert SwitchRouter(D, E, capacity_factor=0.1).route(x).capacity == 1
    assert switch_route(torch.zeros(T, E), 0.1).capacity == 1
    assert switch_route(torch.zeros(T, E), 0.1, minimum_capacity=4).capacity == 4
    # alpha reaches the loss on every path; uniform routing gives exactly alpha
    assert switch_route(torch.zeros(T, E), 1.0, alpha=0.5).aux_loss.item() == pytest.approx(0.5)
    router = SwitchRouter(D, E, alpha=0.3)
    with torch.no_grad():
        router.weight.zero_()
    assert router(x).aux["loss"].item() == pytest.approx(0.3)
    ffn = SwitchFFN(D, HID, E, alpha=0.7)
    with torch.no_grad():
        ffn.router.weight.zero_()
    assert ffn(x)[1]["loss"].item() == pytest.approx(0.7)


def test_initialisation_scales():
    torch.manual_seed(0)
    ffn = SwitchFFN(64, 100, 4)
    assert ffn.w1.std().item() == pytest.approx(64**-0.5, rel=0.05)
    assert ffn.w2.std().item() == pytest.approx(100**-0.5, rel=0.05)
    assert ffn.router.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)
    assert SwitchRouter(64, 16, init_std=0.5).weight.std().item() == pytest.approx(0.5, rel=0.1)


def test_route_intermediates_hand_computed():
    # token 0 prefers expert 1, token 1 expert 0, token 2 expert 1; capacity int(3 * 1 / 2) = 1
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(4.0), 0.0], [0.0, math.log(9.0)]])
    r = switch_route(logits, capacity_factor=1.0, minimum_capacity=0)
    torch.testing.assert_close(r.probabilities, torch.tensor([[0.25, 0.75], [0.8, 0.2], [0.1, 0.9]]))
    assert r.expert_index.tolist() == [1, 0, 1]
    torch.testing.assert_close(r.gate, torch.tensor([0.75, 0.8, 0.9]))
    assert r.capacity == 1 and r.positions.tolist() == [0, 0, 1]
    assert r.accepted.tolist() == [True, True, False]
    torch.testing.assert_close(r.fractions, torch.tensor([1 / 3, 2 / 3]))
    torch.testing.assert_close(r.mean_probabilities, torch.tensor([1.15 / 3, 1.85 / 3]))
    # alpha * E * sum f_i P_i = 0.01 * 2 * (1/3 * 1.15/3 + 2/3 * 1.85/3)
    assert r.aux_loss.item() == pytest.approx(0.02 * (1.15 + 3.7) / 9, rel=1e-5)
    assert r.dispatch.dtype == torch.bool and r.dispatch.shape == (3, 2, 1)
    assert r.dispatch.nonzero().tolist() == [[0, 1, 0], [1, 0, 0]]
    torch.testing.assert_close(r.combine[:, :, 0], torch.tensor([[0.0, 0.75], [0.8, 0.0], [0.0, 0.0]]))

    router = SwitchRouter(2, 2, capacity_factor=1.0, minimum_capacity=0)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    out = router(logits)  # x @ I = the logits above
    torch.testing.assert_close(out.aux["importance"], torch.tensor([1.15, 1.85]))
    torch.testing.assert_close(out.aux["fractions"], r.fractions)
    assert out.aux["capacity"].item() == 1 and out.aux["positions"].tolist() == [0, 0, 1]
    assert out.aux["dropped_tokens"].item() == 1
    assert out.aux["loss"].item() == pytest.approx(r.aux_loss.item())
    ffn_aux = SwitchFFN(2, 3, 2, capacity_factor=1.0, minimum_capacity=0)
    with torch.no_grad():
        ffn_aux.router.weight.copy_(torch.eye(2))
    _, aux = ffn_aux(logits)
    torch.testing.assert_close(aux["fractions"], r.fractions)
    assert aux["loss"].item() == pytest.approx(r.aux_loss.item()) and aux["capacity"].item() == 1


def test_ffn_matches_reference_with_a_larger_minimum_capacity():
    ffn = _ffn(0.1)
    ffn.router.minimum_capacity = 3
    x = torch.randn(T, D)
    y, aux = ffn(x)
    assert aux["capacity"].item() == 3
    ref = switch_ffn_reference(x, ffn.router.weight, ffn.w1, ffn.w2, 0.1, minimum_capacity=3)
    assert torch.allclose(y, ref, atol=1e-6)
