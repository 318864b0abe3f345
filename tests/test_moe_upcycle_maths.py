"""The arithmetic of upcycling on inputs small enough to check by hand: the balanced assignment and
k-means of neurons into experts, the shared-neuron scores, the neuron split, the layer-order check,
the calibration sample, and the router balancing (the mean component removed, then offsets along
the mean input only)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_moe_upcycle import dense_model
from test_moe_upcycle_start import SAMPLE, skewed_bert
from torch import nn

import moee.moe.upcycle as up
from moee.moe.upcycled import DenseFFN


# ----------------------------------------------------------------- balanced assignment and k-means
def test_balanced_assign_by_hand_closest_first_then_the_next_cluster_with_room():
    """Points 0-2 all prefer cluster 0, which takes its two closest (0, 1); point 2 goes to the
    cluster with room next round."""
    dist = torch.tensor([[0.0, 5], [1, 4], [2, 3], [9, 0]])
    assert up.balanced_assign(dist, 2).tolist() == [0, 0, 1, 1]


def test_balanced_assign_accepts_the_closest_proposers_not_the_first():
    dist = torch.tensor([[3.0, 9], [1, 9], [2, 9], [8, 9]])
    assert up.balanced_assign(dist, 2).tolist() == [1, 0, 0, 1]


def test_balanced_assign_ranks_each_clusters_proposers_from_their_own_start():
    """Round 1: cluster 0 takes point 0; point 2, alone in proposing cluster 1, takes it at once, so
    point 1, turned away from cluster 0, ends in cluster 2 (a cluster that ranked its proposers
    from the wrong start would turn point 2 away too, and point 1 would win cluster 1 later)."""
    dist = torch.tensor([[0.0, 1, 9], [0.5, 2, 9], [9, 3, 9]])
    assert up.balanced_assign(dist, 1).tolist() == [0, 2, 1]


def test_balanced_assign_breaks_ties_by_point_order():
    assert up.balanced_assign(torch.zeros(6, 3), 2).tolist() == [0, 0, 1, 1, 2, 2]
    many = up.balanced_assign(torch.zeros(400, 20), 20)  # large enough for an unstable sort to reorder ties
    assert many.tolist() == [c for c in range(20) for _ in range(20)] and many.dtype == torch.long


def test_balanced_assign_fills_every_cluster_exactly_and_refuses_an_uneven_split():
    dist = torch.rand(24, 4, generator=torch.Generator().manual_seed(0))
    labels = up.balanced_assign(dist, 6)
    assert torch.bincount(labels, minlength=4).tolist() == [6] * 4
    with pytest.raises(ValueError, match="^5 points cannot fill 2 clusters of 2$"):
        up.balanced_assign(torch.zeros(5, 2), 2)


def test_balanced_kmeans_centroids_are_the_final_clusters_means_in_the_points_dtype():
    points = torch.randn(12, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels, centroids = up.balanced_kmeans(points, 3, seed=2)
    assert centroids.dtype == torch.float64 and torch.bincount(labels).tolist() == [4, 4, 4]
    for c in range(3):
        torch.testing.assert_close(centroids[c], points[labels == c].mean(0), rtol=1e-6, atol=1e-6)


def test_balanced_kmeans_starts_from_distinct_points_drawn_with_the_seed():
    """One iteration: the balanced assignment to the seed's initial points, by squared distance."""
    points = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    labels, _ = up.balanced_kmeans(points, 3, n_iter=1, seed=5)
    start = points[torch.randperm(12, generator=torch.Generator().manual_seed(5))[:3]]
    assert labels.tolist() == up.balanced_assign(torch.cdist(points, start) ** 2, 4).tolist()
    assert not torch.equal(labels, up.balanced_kmeans(points, 3, n_iter=1, seed=6)[0])


def test_balanced_kmeans_defaults_to_seed_0_and_takes_one_cluster():
    points = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(
        up.balanced_kmeans(points, 3, n_iter=1)[0], up.balanced_kmeans(points, 3, n_iter=1, seed=0)[0]
    )
    assert not torch.equal(
        up.balanced_kmeans(points, 3, n_iter=1)[0], up.balanced_kmeans(points, 3, n_iter=1, seed=1)[0]
    )
    labels, centroids = up.balanced_kmeans(points, 1)
    assert labels.tolist() == [0] * 12
    torch.testing.assert_close(centroids[0], points.mean(0))


@pytest.mark.parametrize("n_clusters", [0, 5])
def test_balanced_kmeans_refuses_clusters_that_cannot_be_equal(n_clusters):
    with pytest.raises(
        ValueError, match=f"^12 points cannot be split into {n_clusters} clusters of equal size$"
    ):
        up.balanced_kmeans(torch.zeros(12, 2), n_clusters)


# ----------------------------------------------------------------- shared neurons and the split
def _ffn(w_act, w_down, w_up=None):
    return DenseFFN(
        w_act=torch.as_tensor(w_act, dtype=torch.float32),
        w_down=torch.as_tensor(w_down, dtype=torch.float32),
        act=nn.GELU(),
        w_up=None if w_up is None else torch.as_tensor(w_up, dtype=torch.float32),
    )


def test_shared_neurons_by_norm_multiply_input_output_and_up_norms():
    w_act = torch.diag(torch.tensor([1.0, 2, 3, 4]))  # row norms 1-4
    w_down = torch.diag(torch.tensor([4.0, 1, 1, 1]))  # column norms 4, 1, 1, 1: scores 4, 2, 3, 4
    assert up.select_shared_neurons(_ffn(w_act, w_down), 2).tolist() == [0, 3]
    w_up = torch.diag(torch.tensor([1.0, 1, 1, 0.5]))  # scores 4, 2, 3, 2
    assert up.select_shared_neurons(_ffn(w_act, w_down, w_up), 2).tolist() == [0, 2]


def test_shared_neurons_central_are_the_rows_closest_in_direction_to_the_mean_row():
    """Unit rows e1, ~e1, e2, -e2 and ~e1: their mean points along e1 (cosines 0.999, 0.995,
    -0.05, 0.05, 0.988), while the norm score would take rows 1 and 4 (the longest)."""
    w_act = torch.tensor([[1.0, 0], [2, 0.1], [0, 1], [0, -1], [1, -0.2]])
    ffn = _ffn(w_act, torch.ones(2, 5))
    assert up.select_shared_neurons(ffn, 2, "central").tolist() == [0, 1]
    assert up.select_shared_neurons(ffn, 2, "norm").tolist() == [1, 4]


def test_shared_neuron_counts_from_zero_to_one_below_the_width_and_named_errors():
    ffn = _ffn(torch.randn(4, 2, generator=torch.Generator().manual_seed(0)), torch.ones(2, 4))
    assert up.select_shared_neurons(ffn, 0).tolist() == [] and len(up.select_shared_neurons(ffn, 3)) == 3
    assert len(up.select_shared_neurons(ffn, 1, "central")) == 1
    for bad in (4, -1):
        with pytest.raises(ValueError, match=rf"^shared_neurons must be in \[0, d_ff=4\), got {bad}$"):
            up.select_shared_neurons(ffn, bad)
    with pytest.raises(
        ValueError, match=r"^shared-neuron selection must be one of \('norm', 'central'\), got 'x'$"
    ):
        up.select_shared_neurons(ffn, 1, "x")


def test_split_neurons_partitions_the_unshared_neurons_into_equal_sorted_groups():
    w_act = torch.randn(10, 3, generator=torch.Generator().manual_seed(4))
    ffn = _ffn(w_act, torch.zeros(3, 10))
    shared = torch.tensor([2, 7])
    groups, centroids = up.split_neurons(ffn, 4, shared, seed=1)
    assert [len(g) for g in groups] == [2] * 4
    assert sorted(torch.cat(groups).tolist()) == [0, 1, 3, 4, 5, 6, 8, 9]
    assert all(g.tolist() == sorted(g.tolist()) for g in groups)
    for g, c in zip(groups, centroids):
        torch.testing.assert_close(c, w_act[g].mean(0))
    with pytest.raises(
        ValueError,
        match="^d_ff=8 after removing 2 shared neurons is not divisible by n_experts=3: every expert must get "
        "the same number of neurons$",
    ):
        up.split_neurons(ffn, 3, shared)
    with pytest.raises(ValueError, match="^d_ff=10 is not divisible by n_experts=4"):
        up.split_neurons(ffn, 4)


def test_split_neurons_hands_its_seed_to_the_k_means_default_0():
    """40 neurons into 4 experts, where the k-means start matters: the seed given is the one used."""
    w_act = torch.randn(40, 3, generator=torch.Generator().manual_seed(7))
    ffn = _ffn(w_act, torch.zeros(3, 40))
    by_seed = {}
    for seed in (0, 1):
        labels, _ = up.balanced_kmeans(w_act, 4, seed=seed)
        by_seed[seed] = [torch.nonzero(labels == e).squeeze(1).tolist() for e in range(4)]
        assert [g.tolist() for g in up.split_neurons(ffn, 4, seed=seed)[0]] == by_seed[seed]
    assert by_seed[0] != by_seed[1]
    assert [g.tolist() for g in up.split_neurons(ffn, 4)[0]] == by_seed[0]


# ----------------------------------------------------------------- layer order
@pytest.mark.parametrize("order", [[], [True, 1], [-1], [0, 2], "01", [0.0]])
def test_layer_orders_that_are_refused(order):
    with pytest.raises(ValueError, match=r"non-empty list of layer indices in \[0, 2\)"):
        up._check_layer_order(order, 2)


def test_layer_orders_that_are_accepted_and_the_message_without_a_layer_count():
    for order, n_layers in ((None, 2), ([0, 1, 1, 0], 2), ((1, 0), 2), ([7], None)):
        up._check_layer_order(order, n_layers)
    with pytest.raises(ValueError, match=r"in \[0, number of layers\), got \[-1\]$"):
        up._check_layer_order([-1], None)


# ----------------------------------------------------------------- the calibration sample
def _vocab(n):
    return SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(weight=torch.zeros(n, 2)))


def test_calibration_sample_as_given_with_a_full_mask():
    ids, mask = up._calibration_sample(_vocab(50), [[1, 2], [3, 49]], None, seed=0)
    assert ids.dtype == torch.long and ids.tolist() == [[1, 2], [3, 49]] and mask.tolist() == [[1, 1], [1, 1]]
    ids, mask = up._calibration_sample(
        _vocab(50), torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([[True, False]]), seed=0
    )
    assert ids.dtype == mask.dtype == torch.long and mask.tolist() == [[1, 0]]


@pytest.mark.parametrize("ids", [[1, 2], [[]], [[-1, 2]], [[50, 1]]])
def test_calibration_sample_refuses_what_is_not_token_ids_of_the_vocabulary(ids):
    with pytest.raises(ValueError, match=r"calibration must be token ids \[n, L\] in \[0, 50\), got shape"):
        up._calibration_sample(_vocab(50), ids, None, seed=0)


def test_calibration_sample_refuses_a_mask_of_another_shape():
    with pytest.raises(ValueError, match=r"calibration_mask must have the shape of calibration \(1, 2\)"):
        up._calibration_sample(_vocab(50), [[1, 2]], [[1, 1, 1]], seed=0)


def test_calibration_sample_defaults_to_the_shipped_texts_or_seeded_random_ids():
    seen = {}

    def tokenizer(texts, **kw):
        seen.update(kw, n=len(texts), first=texts[0])
        return {
            "input_ids": torch.ones(len(texts), 3, dtype=torch.long),
            "attention_mask": torch.ones(len(texts), 3),
        }

    ids, mask = up._calibration_sample(_vocab(50), None, None, seed=0, tokenizer=tokenizer)
    from moee.embed.embedder import MINILM_MOE_DIR

    shipped = [
        json.loads(line)["text"] for line in (MINILM_MOE_DIR / "heldout.jsonl").read_text().splitlines()
    ]
    assert up.calibration_texts(3) == shipped[:3]
    assert seen["n"] == 256 and seen["first"] == shipped[0]
    assert seen["max_length"] == 32 and seen["truncation"] is True and seen["padding"] is True
    assert seen["return_tensors"] == "pt"
    ids, mask = up._calibration_sample(_vocab(50), None, None, seed=3)
    assert ids.tolist() == torch.randint(0, 50, (64, 32), generator=torch.Generator().manual_seed(3)).tolist()
    assert mask.tolist() == torch.ones(64, 32).tolist()


# ----------------------------------------------------------------- selections and the balancing
def test_selections_mask_the_slots_a_gate_drops():
    idx = torch.tensor([[0, 1], [2, 3]])
    assert up._selections(
        (None, None, idx, SimpleNamespace(mask=torch.tensor([[1, 0], [0, 1]])))
    ).tolist() == [
        [0, -1],
        [-1, 3],
    ]
    assert up._selections((None, None, idx, SimpleNamespace(mask=None))).tolist() == idx.tolist()
    assert up._selections((None, None, idx, SimpleNamespace())).tolist() == idx.tolist()


def test_the_sample_of_four_rows_is_split_and_of_three_used_whole():
    assert up._split_sample(4) == (slice(None, 3), slice(3, None))
    assert up._split_sample(3) == (slice(None), slice(None))


def _moe(top_k=1, dense=None, **kw):
    """A 4-expert upcycle of ``dense`` (default the skewed BERT) calibrated on the sample, its
    start warnings silenced (several tests start raw routers on purpose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        return up.upcycle(
            skewed_bert() if dense is None else dense, n_experts=4, top_k=top_k, calibration=SAMPLE, **kw
        )


def _inputs(model, ids):
    """Each MoE layer's FFN inputs on ``ids`` (every token: the sample has no padding)."""
    seen = []
    handles = [
        ffn.register_forward_pre_hook(
            lambda _m, a, i=i: seen.append((i, a[0].reshape(-1, a[0].shape[-1]).double()))
        )
        for i, ffn in enumerate(model.moe_ffns())
    ]
    try:
        with torch.no_grad():
            up._forward_base(model, ids, torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat([x for j, x in seen if j == i]) for i in range(len(model.moe_ffns()))]


def _rows(model):
    return [ffn.router.gate.w_gate.weight.detach().double() for ffn in model.moe_ffns()]


@pytest.mark.slow
def test_balanced_rows_are_the_mean_removed_rows_plus_offsets_along_the_mean_input(monkeypatch):
    """Without offset rounds every router row is orthogonal to its layer's mean FFN input on the
    balanced rows of the sample; with them each row differs from that only along the mean input,
    by a per-expert amount."""
    fit = SAMPLE[:24]
    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 0)
    mean_only = _moe()
    monkeypatch.undo()
    settled, raw = _moe(), _moe(balance_router=False)
    for layer, (x, w0, w, r) in enumerate(
        zip(_inputs(mean_only, fit), _rows(mean_only), _rows(settled), _rows(raw))
    ):
        m = x.mean(0)
        assert (w0 @ m).abs().max() < 1e-4 * w0.norm() * m.norm(), layer
        torch.testing.assert_close(w0, r - torch.outer(r @ m, m) / m.dot(m), rtol=1e-4, atol=1e-5)
        diff = w - w0
        along = torch.outer(diff @ m / m.dot(m), m)
        torch.testing.assert_close(diff, along, rtol=1e-4, atol=1e-5)
        assert (diff @ m).abs().max() > 0  # the offsets moved
    assert max(r["max_over_mean"] for r in up.router_load_report(settled, fit)) <= 1.1
    assert settled.router_load_report == up.router_load_report(settled, SAMPLE[24:])


@pytest.mark.slow
def test_settled_offsets_keep_the_most_even_round(monkeypatch):
    """One round: the even-est of one is the start, so the rows stay the mean-removed ones."""
    model = _moe(balance_router=False)
    ffn = model.moe_ffns()[0]
    x = _inputs(model, SAMPLE)[0]
    w = torch.randn(4, x.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    along = x.mean(0) / x.mean(0).dot(x.mean(0))
    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 1)
    assert torch.equal(up._settle_offsets(ffn, x, w, along), w)
    monkeypatch.undo()
    assert torch.equal(up._settle_offsets(ffn, x[:1], w, along), w)  # one token: no spread to scale by
    assert not torch.equal(up._settle_offsets(ffn, x, w, along), w)


def _layer0():
    """Layer 0 of a raw 4-expert top-1 upcycle: its gate, its FFN inputs on the sample, its rows
    with the mean input's component removed, and the direction the offsets move along."""
    model = _moe(balance_router=False)
    ffn = model.moe_ffns()[0]
    x = _inputs(model, SAMPLE)[0]
    m = x.mean(0)
    r = ffn.router.gate.w_gate.weight.detach().double()
    return ffn, x, r - torch.outer(r @ m, m) / m.dot(m), m / m.dot(m)


def _ratio(ffn, x, rows):
    """Each expert's selections by the gate with ``rows`` on ``x``, over the mean."""
    with torch.no_grad():
        ffn.router.gate.w_gate.weight.copy_(rows.float())
        chosen = up._selections(ffn.router(x.float())).reshape(-1)
    counts = torch.bincount(chosen[chosen >= 0], minlength=4).double()
    return counts / counts.mean()


def _round(ffn, x, w, along):
    """The first update: ``b = -step * spread * log(load / mean)``, spread of the centred scores."""
    spread = ((x - x.mean(0)) @ w.T).std()
    return w + torch.outer(-0.05 * spread * torch.log(_ratio(ffn, x, w).clamp_min(0.05)), along)


def test_one_settling_round_by_hand_and_the_strictly_better_round_kept(monkeypatch):
    ffn, x, w, along = _layer0()
    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 2)
    after = _round(ffn, x, w, along)
    assert _ratio(ffn, x, after).max() < _ratio(ffn, x, w).max()  # this sample improves in one round
    torch.testing.assert_close(up._settle_offsets(ffn, x, w, along), after, rtol=1e-6, atol=1e-9)
    # two tokens that pick the same expert: one pair that one round splits (kept), one it does not
    # (a tie: the first round stays); a sample of two tokens is settled too
    _ratio(ffn, x, w)  # the gate holds the rows w
    with torch.no_grad():
        top = up._selections(ffn.router(x.float()))[:, 0].tolist()
    split = stay = None
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            if top[i] != top[j] or (split is not None and stay is not None):
                continue
            pair = x[[i, j]]
            better = bool(_ratio(ffn, pair, _round(ffn, pair, w, along)).max() < _ratio(ffn, pair, w).max())
            if better and split is None:
                split = pair
            if not better and stay is None:
                stay = pair
    assert split is not None and stay is not None
    torch.testing.assert_close(
        up._settle_offsets(ffn, split, w, along), _round(ffn, split, w, along), rtol=1e-6, atol=1e-9
    )
    assert torch.equal(up._settle_offsets(ffn, stay, w, along), w)


@pytest.mark.slow
def test_settling_revives_a_dead_last_expert():
    ffn, x, w, along = _layer0()
    spread = float(((x - x.mean(0)) @ w.T).std())
    dead = w.clone()
    dead[3] = w[3] - 5 * spread * along  # about 5 spreads below its own score on every token
    assert _ratio(ffn, x, dead)[3] == 0
    settled = up._settle_offsets(ffn, x, dead, along)
    assert _ratio(ffn, x, settled)[3] > 0.5


def test_load_report_against_a_count_of_each_layers_selections_without_padding():
    """A 4-expert top-2 model on the sample with its last three columns masked as padding: every
    field from the router's own selections on the unmasked tokens, counted here directly."""
    model = _moe(top_k=2, balance_router=False)
    mask = torch.ones_like(SAMPLE)
    mask[:, 9:] = 0
    seen = []
    hooks = [
        ffn.router.register_forward_hook(lambda _m, _a, out, i=i: seen.append((i, out[2].detach())))
        for i, ffn in enumerate(model.moe_ffns())
    ]
    try:
        report = up.router_load_report(model, SAMPLE, mask)
    finally:
        for h in hooks:
            h.remove()
    keep = mask.reshape(-1).bool()
    for layer, row in enumerate(report):
        chosen = torch.cat([idx for i, idx in seen if i == layer])[keep]
        counts = torch.bincount(chosen.reshape(-1), minlength=4).double()
        share = counts / counts.sum()
        assert row["layer"] == layer and row["ceiling"] == 2.0
        assert row["load"] == [round(float(v), 4) for v in share]
        assert row["max_over_mean"] == pytest.approx(float(share.max() * 4))
        assert row["dead"] == int((counts == 0).sum())
        assert row["collapsed"] == (row["max_over_mean"] > 2.0 or row["dead"] > 0)
    assert any(r["collapsed"] for r in report) and len(report) == len(model.moe_ffns())


def test_load_report_of_a_sample_with_no_counted_token():
    """Every token masked: max/mean 0, every expert dead, collapsed."""
    model = _moe(top_k=2, balance_router=False)
    report = up.router_load_report(model, SAMPLE[:2], torch.zeros_like(SAMPLE[:2]))
    assert all(r["max_over_mean"] == 0.0 and r["dead"] == 4 and r["collapsed"] for r in report)
    assert all(r["load"] == [0.0] * 4 for r in report)


def _crafted_report(monkeypatch, winners, top_k=1):
    """The load report of a 4-expert model whose every router scores expert e by input feature e,
    fed inputs whose largest feature is ``winners[t]`` for token t (the selections are chosen here)."""
    model = _moe(top_k=top_k, balance_router=False)
    d = model.moe_ffns()[0].router.gate.w_gate.weight.shape[1]
    x = torch.zeros(len(winners), d)
    for t, e in enumerate(winners):
        x[t, e] = 1.0
    with torch.no_grad():
        for ffn in model.moe_ffns():
            ffn.router.gate.w_gate.weight.copy_(torch.eye(4, d))
    monkeypatch.setattr(up, "_forward_base", lambda m, ids, mask: [f.router(x) for f in m.moe_ffns()])
    return up.router_load_report(model, torch.zeros(1, len(winners), dtype=torch.long))


def test_load_report_at_exactly_the_collapse_threshold_is_not_collapsed(monkeypatch):
    report = _crafted_report(monkeypatch, [0, 0, 0, 1, 2, 3])  # loads 3, 1, 1, 1 of 6: max/mean 2
    assert all(r["max_over_mean"] == 2.0 and r["dead"] == 0 and not r["collapsed"] for r in report)
    assert report[0]["load"] == [0.5, 0.1667, 0.1667, 0.1667]


def test_load_report_of_a_single_selection(monkeypatch):
    report = _crafted_report(monkeypatch, [2])
    assert (
        report[0]["load"] == [0.0, 0.0, 1.0, 0.0]
        and report[0]["max_over_mean"] == 4.0
        and report[0]["dead"] == 3
    )


def test_balance_routers_refuses_router_rows_for_another_number_of_layers():
    model = _moe(balance_router=False)
    rows = _rows(model)
    with pytest.raises(ValueError, match="1 router weights for 2 MoE layers"):
        up.balance_routers(model, rows[:-1], SAMPLE, torch.ones_like(SAMPLE))


@pytest.mark.slow
def test_mean_removal_of_inputs_whose_mean_is_short(monkeypatch):
    """A BERT with its LayerNorms scaled down, so that every layer's mean FFN input has squared norm
    below 1: the projection divides by |m|^2 itself (a floor of 1 would leave part of the component)."""
    from test_moe_upcycle import dense_model

    def dense():  # upcycle() converts a loaded model in place: a fresh one for each call
        model = dense_model("bert")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm" in name:
                    p.mul_(0.05)
        return model

    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 0)
    model = _moe(dense=dense())
    monkeypatch.undo()
    for x, w in zip(_inputs(model, SAMPLE[:24]), _rows(model)):
        m = x.mean(0)
        assert m.dot(m) < 1
        assert (w @ m).abs().max() < 1e-4 * w.norm() * m.norm()
    settled = _moe(dense=dense())
    # five rounds by hand on layer 0 (whose inputs no balancing changes): the offsets move along
    # m / |m|^2, one unit of score per unit of offset on the average token
    ffn, x = model.moe_ffns()[0], _inputs(model, SAMPLE[:24])[0]
    w, m = _rows(model)[0], x.mean(0)
    spread = ((x - m) @ w.T).std()
    offset, best, after = torch.zeros(4, dtype=torch.float64), float("inf"), w
    for _ in range(5):
        rows = w + torch.outer(offset, m / m.dot(m))
        ratio = _ratio(ffn, x, rows)
        if float(ratio.max()) < best:
            best, after = float(ratio.max()), rows
        offset = offset - 0.05 * spread * torch.log(ratio.clamp_min(0.05))
    assert not torch.equal(after, w)
    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 5)
    one = _moe(dense=dense())
    torch.testing.assert_close(_rows(one)[0], after, rtol=1e-5, atol=1e-6)
    assert max(r["max_over_mean"] for r in up.router_load_report(settled, SAMPLE[:24])) <= 1.1


def test_balancing_runs_each_layer_once_cost_linear_in_depth(monkeypatch):
    """One forward pass balances every router (each layer settles on the inputs the balanced
    layers below produce, as it routes them): a 6-layer model runs each FFN once, not the
    1 + 2 + ... + 6 = 21 layer passes of a forward from layer 0 for every layer."""
    model = _moe(balance_router=False, dense=dense_model("llama", num_hidden_layers=6))
    calls = []
    handles = [
        ffn.register_forward_pre_hook(lambda _m, _a, i=i: calls.append(i))
        for i, ffn in enumerate(model.moe_ffns())
    ]
    monkeypatch.setattr(up, "_SETTLE_ROUNDS", 2)
    try:
        up.balance_routers(model, _rows(model), SAMPLE[:24], torch.ones_like(SAMPLE[:24]))
    finally:
        for h in handles:
            h.remove()
    assert calls == list(range(6))
