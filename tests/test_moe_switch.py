"""Switch top-1 routing with capacity against the seeds' invariants (SEED_SPEC section 4, Appendix A.8)."""

from __future__ import annotations

import pytest
import torch

from moee.moe import SwitchFFN, SwitchRouter, switch_capacity, switch_route
from moee.moe.switch import switch_ffn_reference

# the seeds' reduced reference shapes: T = 8 tokens, D = 4, E = 3 experts, H = 8
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


def test_router_trains_through_unrenormalised_top1_gate():
    ffn = _ffn(3.0)
    x = torch.randn(T, D)
    y, aux = ffn(x)
    (y**2).sum().backward()  # the seeds' illustrative squared-output objective, no aux loss
    assert ffn.router.weight.grad.abs().sum() > 0
    before = ffn.router.weight.detach().clone()
    torch.optim.SGD(ffn.parameters(), lr=0.1).step()
    assert not torch.equal(ffn.router.weight, before)


def test_expert_and_residual_overflow_raise():
    ffn = _ffn(3.0)
    with torch.no_grad():
        ffn.w1.fill_(1e20)
        ffn.w2.fill_(1e20)
    with pytest.raises(ValueError, match="expert outputs overflowed float32"):
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
    with pytest.raises(ValueError, match="residual output overflowed float32"):
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
