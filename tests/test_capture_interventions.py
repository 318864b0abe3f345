"""Routing interventions (moee.capture.interventions) on tiny random models of real MoE architectures.

Each intervention must do what it says to the router's own selection (read back with the
recorder), change nothing when it has nothing to do, and leave no hook behind, also on an exception.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moee.capture.interventions import (
    bias_experts,
    disable_experts,
    drop_assignments,
    force_experts,
    permute_router,
    router_permutation,
    swap_routers,
)
from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import find_routers, supported_architectures
from moee.capture.tiny import tiny_model

ARCHS = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "moee_lm")


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    model = tiny_model(request.param, n_layers=2)
    torch.manual_seed(1)
    return request.param, model, torch.randint(4, 100, (2, 9))


def _run(model, ids):
    specs = find_routers(model)
    with torch.no_grad(), RoutingRecorder(model, specs, pooling="tokens") as rec:
        rec.set_batch(torch.ones_like(ids))
        logits = model(input_ids=ids).logits
    return logits, rec.token_selection()


def test_empty_interventions_change_nothing_and_add_no_hook(arch) -> None:
    _, model, ids = arch
    base, _ = _run(model, ids)
    before = _hooks(model)
    with (
        disable_experts(model, []),
        bias_experts(model, {(0, 1): 0.0}),
        drop_assignments(model, 0, 0.0),
        swap_routers(model, model, []),
    ):
        assert _hooks(model) == before
        same, _ = _run(model, ids)
    assert torch.equal(base, same)


def test_force_selects_the_expert_at_every_token(arch) -> None:
    _, model, ids = arch
    before = _hooks(model)
    with force_experts(model, [(0, 3)]):
        _, selection = _run(model, ids)
    assert bool((selection[:, :, 0] == 3).any(-1).all())
    assert _hooks(model) == before


def test_reselect_never_selects_the_expert_and_changes_the_output(arch) -> None:
    _, model, ids = arch
    base, selection = _run(model, ids)
    target = int(selection[:, :, 0, 0].flatten().mode().values)  # an expert the router does choose
    with disable_experts(model, [(0, target)]):
        out, chosen = _run(model, ids)
    assert not bool((chosen[:, :, 0] == target).any())
    assert (chosen[:, :, 0] >= 0).all()  # still k experts per token
    assert not torch.allclose(out, base)


def test_zero_keeps_the_selection_but_drops_the_expert(arch) -> None:
    _, model, ids = arch
    base, selection = _run(model, ids)
    target = int(selection[:, :, 0, 0].flatten().mode().values)
    with disable_experts(model, [(0, target)], mode="zero"):
        out, chosen = _run(model, ids)
    assert torch.equal(chosen, selection)
    assert not torch.allclose(out, base)


def test_bias_shifts_selection_towards_the_expert(arch) -> None:
    _, model, ids = arch
    _, selection = _run(model, ids)
    rate = (selection[:, :, 0] == 5).any(-1).float().mean()
    with bias_experts(model, {(0, 5): 2.0}):
        _, steered = _run(model, ids)
    assert (steered[:, :, 0] == 5).any(-1).float().mean() >= rate


def test_identical_router_swap_changes_nothing_another_does(arch) -> None:
    name, model, ids = arch
    base, _ = _run(model, ids)
    with swap_routers(model, copy.deepcopy(model)):
        same, _ = _run(model, ids)
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    donor = tiny_model(name, n_layers=2, seed=7)
    with torch.no_grad():  # some tiny routers start at zero: give the donor's its own random weights
        for spec in find_routers(donor):
            for p in spec.module.parameters():
                p.normal_()
    with swap_routers(model, donor):
        other, _ = _run(model, ids)
    assert not torch.allclose(other, base)


def test_a_permuted_router_sends_each_token_to_the_permuted_experts(arch) -> None:
    """Expert e gets the logit of expert perm[e]: a token that chose j now chooses perm^-1(j), in the
    permuted layer only, so the loads are the old ones permuted."""
    _, model, ids = arch
    model = copy.deepcopy(model)
    specs = find_routers(model)
    with torch.no_grad():  # some tiny routers start at zero (all logits tie): no order to permute
        for spec in specs:
            for p in spec.module.parameters():
                p.normal_(generator=torch.Generator().manual_seed(0))
    _, base = _run(model, ids)
    last = len(specs) - 1
    inverse = torch.argsort(router_permutation(specs[last].n_experts, 5 + last))  # seed + layer
    with permute_router(model, [last], seed=5):
        _, permuted = _run(model, ids)
    assert torch.equal(permuted[:, :, :last], base[:, :, :last])  # the other layers untouched
    assert torch.equal(permuted[:, :, last].sort(-1).values, inverse[base[:, :, last]].sort(-1).values)


def test_router_permutations_are_seeded_derangements() -> None:
    for seed in range(20):
        perm = router_permutation(8, seed)
        assert sorted(perm.tolist()) == list(range(8)) and not (perm == torch.arange(8)).any()
        assert torch.equal(perm, router_permutation(8, seed))
    assert len({tuple(router_permutation(8, s).tolist()) for s in range(20)}) > 10
    with pytest.raises(ValueError, match="no other order"):
        router_permutation(1, 0)


def test_hooks_are_removed_on_an_exception(tiny_olmoe) -> None:
    before = _hooks(tiny_olmoe)
    for make in (
        lambda: disable_experts(tiny_olmoe, [(0, 1)]),
        lambda: disable_experts(tiny_olmoe, [(0, 1)], mode="zero", renormalize=True),
        lambda: force_experts(tiny_olmoe, [(1, 2)]),
        lambda: drop_assignments(tiny_olmoe, 1, 0.5),
        lambda: swap_routers(tiny_olmoe, copy.deepcopy(tiny_olmoe)),
        lambda: permute_router(tiny_olmoe, seed=3),
    ):
        with pytest.raises(RuntimeError, match="boom"), make():
            assert _hooks(tiny_olmoe) > before
            raise RuntimeError("boom")
        assert _hooks(tiny_olmoe) == before


def test_a_never_selected_expert_changes_nothing_in_either_mode() -> None:
    # 32 experts, top-1, 18 tokens: at least 14 experts of each layer are never selected
    model = tiny_model("olmoe", n_layers=2, n_experts=32, top_k=1, norm_topk_prob=True)
    ids = torch.randint(4, 100, (2, 9))
    base, selection = _run(model, ids)
    unused = [(i, next(e for e in range(32) if not bool((selection[:, :, i] == e).any()))) for i in range(2)]
    for mode in ("reselect", "zero"):
        with disable_experts(model, unused, mode=mode):
            out, chosen = _run(model, ids)
        torch.testing.assert_close(out, base, rtol=0, atol=1e-6)
        assert torch.equal(chosen, selection)


def test_zero_renormalize_keeps_each_tokens_total(tiny_olmoe) -> None:
    specs = find_routers(tiny_olmoe)
    block = tiny_olmoe.model.layers[0].mlp
    seen = []
    handle = block.experts.register_forward_pre_hook(lambda m, a: seen.append((a[1].clone(), a[2].clone())))
    try:
        ids = torch.randint(4, 100, (1, 12))
        with torch.no_grad():
            tiny_olmoe(input_ids=ids)
            with disable_experts(tiny_olmoe, [(0, 2)], mode="zero", renormalize=True, routers=specs):
                tiny_olmoe(input_ids=ids)
    finally:
        handle.remove()
    (index, weights), (_, edited) = seen
    torch.testing.assert_close(edited.sum(-1), weights.sum(-1))
    assert bool((edited[index == 2] == 0).all())


def test_bad_requests_are_refused(tiny_olmoe) -> None:
    with pytest.raises(ValueError, match="out of range"), disable_experts(tiny_olmoe, [(5, 0)]):
        pass
    with pytest.raises(ValueError, match="out of range"), bias_experts(tiny_olmoe, {(0, 99): 1.0}):
        pass
    with pytest.raises(ValueError, match="mode must be"), disable_experts(tiny_olmoe, [(0, 1)], mode="cut"):
        pass
    with (
        pytest.raises(ValueError, match="all 8 experts"),
        disable_experts(tiny_olmoe, [(0, e) for e in range(8)]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="not the same architecture"),
        swap_routers(tiny_olmoe, tiny_model("olmoe", n_layers=3)),
    ):
        pass


@pytest.mark.all_architectures
@pytest.mark.parametrize("model_type", supported_architectures())
def test_force_and_reselect_act_on_every_supported_architecture(model_type) -> None:
    """The logit edit reaches the router's own selection in every architecture capture supports."""
    model = tiny_model(model_type)
    ids = torch.randint(4, 100, (1, 6))
    specs = find_routers(model)

    def selection(context):
        with torch.no_grad(), context, RoutingRecorder(model, specs, pooling="tokens") as rec:
            rec.set_batch(torch.ones_like(ids))
            model(input_ids=ids, use_cache=False)
        return rec.token_selection()[:, :, 0]

    assert bool((selection(force_experts(model, [(0, 1)], routers=specs)) == 1).any(-1).all())
    assert not bool((selection(disable_experts(model, [(0, 1)], routers=specs)) == 1).any())
