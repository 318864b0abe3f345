"""The co-activation section's statistics on inputs small enough to check by hand: the table of a
layer's top-k sets, its ratios, the null sample's shuffle and repair, the baseline's token count,
and every field of the section's JSON against a direct re-computation (loops over pairs)."""

from types import SimpleNamespace

import numpy as np
import pytest

import moee.analysis.specialization.sections.coactivation as co


def _sets(rng, n, E, k, weights):
    """``[n, k]`` distinct experts per token (Gumbel top-k of ``log(weights)``: uneven loads)."""
    with np.errstate(divide="ignore"):
        logw = np.log(np.asarray(weights, dtype=float))
    return np.argsort(-(logw + rng.gumbel(size=(n, E))), axis=1)[:, :k]


# ----------------------------------------------------------------- tally, table and ratios
def test_the_tally_counts_each_pair_of_a_tokens_top_k_and_the_load_on_the_diagonal():
    tally = co._Coactivation(SimpleNamespace(n_layers=1, n_experts=3))
    sel = np.array([[0, 1], [0, 2], [0, 1]])
    one_hot = np.zeros((1, 3, 3))  # [L, E, T]
    for t, (a, b) in enumerate(sel):
        one_hot[0, [a, b], t] = 1.0
    tally.update(SimpleNamespace(per_layer=one_hot))
    tally.update(SimpleNamespace(per_layer=one_hot))
    np.testing.assert_array_equal(tally.counts[0], 2 * np.array([[3, 2, 1], [2, 2, 0], [1, 0, 1]]))


def test_set_counts_hold_every_block_of_tokens(monkeypatch):
    """Five tokens in blocks of two: every block adds to the table (none replaces it)."""
    monkeypatch.setattr(co, "_PAIR_BLOCK", 2)
    sets = np.array([[0, 1], [1, 2], [0, 2], [0, 1], [2, -1]])
    np.testing.assert_array_equal(co._set_counts(sets, 3), [[3, 2, 1], [2, 3, 1], [1, 1, 3]])


def test_set_counts_of_many_experts_stored_narrow_do_not_overflow():
    """The route sample stores expert ids as int16; with 256 experts a pair key a * E + b reaches
    65,535, past int16: the keys must be computed wide."""
    sets = np.array([[255, 254], [255, 0]], dtype=np.int16)
    counts = co._set_counts(sets, 256)
    assert counts[255, 255] == 2 and counts[255, 254] == counts[254, 255] == 1 and counts[0, 255] == 1
    assert counts.sum() == 2 * 4


def test_ratios_of_a_never_selected_expert_are_zero_not_left_over_memory():
    """Expert 2 is never selected: its row is 0 (not 0/0, nor whatever memory the division left).
    Freed arrays of 7.0 of the same size sit in numpy's allocation cache first, so an output left
    unwritten would show them."""
    counts = np.array([[2, 1, 0], [1, 1, 0], [0, 0, 0]])
    for _ in range(3):
        junk = [np.full((3, 3), 7.0) for _ in range(8)]
        del junk
        ratio = co._ratios(counts)
        np.testing.assert_array_equal(ratio, [[0, 0.5, 0], [1, 0, 0], [0, 0, 0]])


# ----------------------------------------------------------------- the null sample
def test_null_sets_without_repair_rounds_drop_exactly_the_repeats_of_the_shuffle(monkeypatch):
    """With no repair round the null is the shuffled entries themselves, each repeat of an earlier
    entry of its token dropped (-1): a direct re-computation with the same generator."""
    monkeypatch.setattr(co, "_REPAIR_ROUNDS", 0)
    sets = _sets(np.random.default_rng(0), 60, 5, 3, [6, 3, 1, 1, 1])
    null = co._null_sets(sets, np.random.default_rng(7))
    expected = sets.ravel()[np.random.default_rng(7).permutation(sets.size)].reshape(sets.shape)
    for row in expected:
        for j in range(row.size):
            if row[j] in row[:j]:
                row[j] = -1
    assert (expected == -1).any()
    np.testing.assert_array_equal(null, expected)


@pytest.mark.parametrize("E, k", [(32, 4), (8, 3)])
def test_null_sets_repair_every_token_within_eight_rounds(monkeypatch, E, k):
    """Each round swaps one repeat of every token that holds one: on 2,000 tokens with uneven loads
    eight rounds leave no entry dropped (swapping another slot than the repeat needs many more)."""
    monkeypatch.setattr(co, "_REPAIR_ROUNDS", 8)
    for seed in range(4):
        sets = _sets(np.random.default_rng(seed), 2000, E, k, np.linspace(3, 0.5, E))
        null = co._null_sets(sets, np.random.default_rng(seed))
        assert (null >= 0).all()
        assert (np.diff(np.sort(null, axis=1), axis=1) > 0).all()
        np.testing.assert_array_equal(
            np.bincount(null.ravel(), minlength=E), np.bincount(sets.ravel(), minlength=E)
        )


def _draw(sample, n_tokens, permutations=2, seed=0, n_experts=6):
    L = sample.shape[1]
    steps = []
    acc = SimpleNamespace(n_layers=L, n_experts=n_experts, n_tokens=n_tokens, permutations=permutations)
    draw = SimpleNamespace(
        acc=acc, rng=np.random.default_rng(seed), sample=sample, step=lambda: steps.append(1)
    )
    return draw, steps


def _recording_null_sets(monkeypatch):
    seen = []
    real = co._null_sets

    def record(sets, rng):
        seen.append(np.array(sets))
        return real(sets, rng)

    monkeypatch.setattr(co, "_null_sets", record)
    return seen


def test_baseline_of_a_corpus_the_sample_holds_whole_uses_each_sampled_token_once(monkeypatch):
    seen = _recording_null_sets(monkeypatch)
    sample = np.stack(
        [_sets(np.random.default_rng(s), 40, 6, 2, [4, 3, 2, 1, 1, 1]) for s in range(2)], axis=1
    )
    draw, steps = _draw(sample, n_tokens=40, permutations=3)
    out = co._baseline(draw)
    assert len(out) == 2 and len(steps) == 3 and len(seen) == 3 * 2
    for i, sets in enumerate(seen):  # per permutation, per layer: the layer's sampled sets, reordered
        layer = i % 2
        key = lambda s: sorted(map(tuple, s))  # noqa: E731
        assert key(sets) == key(sample[:, layer])


def test_baseline_of_a_corpus_larger_than_the_sample_draws_as_many_tokens_as_the_corpus(monkeypatch):
    """A sample of 30 tokens for a corpus of 100: blocks of 30, 30, 30 and 10 sampled tokens."""
    seen = _recording_null_sets(monkeypatch)
    sample = _sets(np.random.default_rng(3), 30, 6, 2, [4, 3, 2, 1, 1, 1])[:, None, :]
    draw, _ = _draw(sample, n_tokens=100, permutations=2)
    co._baseline(draw)
    assert [s.shape[0] for s in seen] == [30, 30, 30, 10] * 2


def test_baseline_is_the_mean_over_draws_of_the_null_samples_largest_ratio(monkeypatch):
    maxima = []
    real = co._ratios

    def record(counts):
        r = real(counts)
        maxima.append(r.max())
        return r

    monkeypatch.setattr(co, "_ratios", record)
    sample = _sets(np.random.default_rng(4), 50, 6, 2, [4, 3, 2, 1, 1, 1])[:, None, :]
    draw, _ = _draw(sample, n_tokens=50, permutations=4)
    assert co._baseline(draw) == [pytest.approx(np.mean(maxima))]
    assert len(set(maxima)) > 1


def test_baseline_without_a_sample_is_zero():
    draw, steps = _draw(np.zeros((0, 2, 2), dtype=np.int16), n_tokens=0, permutations=2)
    assert co._baseline(draw) == [0.0, 0.0] and len(steps) == 2


# ----------------------------------------------------------------- the section's JSON
def _acc(layers, E, k):
    """A stand-in accumulator whose co-activation table is that of the given top-k sets."""
    counts = np.stack([co._set_counts(s, E) for s in layers])
    load = np.stack([np.diag(c) for c in counts]).astype(np.float64)
    return SimpleNamespace(
        n_layers=len(layers),
        n_experts=E,
        top_k=k,
        load=load,
        tallies={"coactivation": SimpleNamespace(counts=counts)},
    )


def _expected_layer(c, load, k, n_pairs, baseline):
    """The section's per-layer entry, computed pair by pair."""
    E = len(c)
    ratio = [[c[a][b] / c[a][a] if a != b and c[a][a] > 0 else 0.0 for b in range(E)] for a in range(E)]
    order = sorted((-ratio[a][b], a, b) for a in range(E) for b in range(E))[:n_pairs]
    pairs = [{"i": a, "j": b, "ratio": -r, "n_i": int(c[a][a])} for r, a, b in order if -r > 0]
    total = max(1.0, float(sum(load)))
    q = [x / total for x in load]
    indep = [[(k - 1) * q[b] / max(1.0 - q[a], 1e-12) if a != b else 0.0 for b in range(E)] for a in range(E)]
    lifts = [
        ratio[a][b] / indep[a][b]
        for a in range(E)
        for b in range(E)
        if a != b and c[a][a] > 0 and indep[a][b] > 0
    ]
    top = sorted(range(E), key=lambda e: (-load[e], e))[:16]
    heat = [
        [round(ratio[a][b], 4) if c[a][a] * indep[a][b] >= co.MIN_EXPECTED else None for b in top]
        for a in top
    ]
    entry = {
        "layer": None,
        "max_ratio": max(max(r) for r in ratio),
        "max_ratio_baseline": baseline,
        "max_ratio_independent": max(max(r) for r in indep),
        "mean_lift": sum(lifts) / len(lifts) if lifts else None,
        "top_pairs": pairs,
    }
    return entry, top, heat, [[round(indep[a][b], 4) for b in top] for a in top], ratio


def _check_pairs(layers, E, k, n_pairs):
    acc = _acc(layers, E, k)
    baseline = [0.1 * (i + 1) for i in range(len(layers))]
    out = co._pairs(acc, n_pairs, baseline)
    L = len(layers)
    shown = sorted({0, L // 2, L - 1})
    assert set(out) == {
        "uniform",
        "top_experts",
        "heatmaps",
        "heatmap_min_expected",
        "independent_heatmaps",
        "by_layer",
        "matrix_layers",
        "matrices",
    }
    assert out["uniform"] == pytest.approx((k - 1) / (E - 1) if E > 1 else 0.0)
    assert out["heatmap_min_expected"] == co.MIN_EXPECTED and out["matrix_layers"] == shown
    for layer in range(L):
        c, load = acc.tallies["coactivation"].counts[layer], acc.load[layer]
        entry, top, heat, indep, ratio = _expected_layer(
            c.tolist(), load.tolist(), k, n_pairs, baseline[layer]
        )
        entry["layer"] = layer
        got = out["by_layer"][layer]
        assert set(got) == set(entry)
        assert got["top_pairs"] == [dict(p, ratio=pytest.approx(p["ratio"])) for p in entry["top_pairs"]]
        for key in ("layer", "max_ratio", "max_ratio_baseline", "max_ratio_independent", "mean_lift"):
            assert got[key] == (None if entry[key] is None else pytest.approx(entry[key])), key
        assert out["top_experts"][layer] == top
        assert out["heatmaps"][layer] == [
            [None if v is None else pytest.approx(v, abs=1e-12) for v in r] for r in heat
        ]
        assert out["independent_heatmaps"][layer] == [[pytest.approx(v, abs=1e-12) for v in r] for r in indep]
        if layer in shown:
            expected = [[round(v, 4) for v in r] for r in ratio]
            assert out["matrices"][str(layer)] == [[pytest.approx(v, abs=1e-12) for v in r] for r in expected]
    assert sorted(out["matrices"]) == [str(layer) for layer in shown]
    return out


def test_pairs_of_five_layers_every_field_against_a_pair_by_pair_computation():
    """20 experts (more than the 16 a heatmap shows), top-2. Layer 0: uneven random sets, one expert
    selected once and one never; layer 1: experts paired 2i with 2i + 1, every load equal (ties in
    ratio and load: the lower id first); layers 2-4: random sets with other loads."""
    rng = np.random.default_rng(11)
    w = np.r_[np.linspace(4, 1, 18), 0.0, 0.0]
    first = np.vstack([_sets(rng, 80, 20, 2, w), [[18, 0]]])
    paired = np.array([[2 * i, 2 * i + 1] for i in range(10)] * 3)
    later = [_sets(rng, 120, 20, 2, np.linspace(1, s, 20)) for s in (2.0, 5.0, 0.3)]
    out = _check_pairs([first, paired, *later], E=20, k=2, n_pairs=25)
    assert out["by_layer"][1]["top_pairs"][0] == {"i": 0, "j": 1, "ratio": 1.0, "n_i": 3}
    assert len(out["by_layer"][1]["top_pairs"]) == 20  # only the 20 nonzero ratios
    assert out["top_experts"][1] == list(range(16))


def test_heatmap_cell_at_exactly_the_minimum_expected_count_is_shown():
    """Expert 0 with every token, 1 and 2 with half each (k = 2): the expected count of cell (0, 1)
    is N(0) (k - 1) q_1 / (1 - q_0) = 10 * 0.25 / 0.5 = 5.0, exactly the minimum: shown; (1, 0) is
    5 * 0.5 / 0.75 < 5: masked."""
    sets = np.array([[0, 1]] * 5 + [[0, 2]] * 5)
    thirds = np.array([[0, 1]] * 10 + [[0, 2]] * 20)  # cell (0, 1): ratio 1/3, shown to 4 places
    out = _check_pairs([sets, thirds], E=3, k=2, n_pairs=4)
    heat = out["heatmaps"][0]
    assert heat[0][1] == 0.5 and heat[1][0] is None
    assert out["top_experts"][1] == [0, 2, 1] and out["heatmaps"][1][0][2] == 0.3333


def test_pairs_of_top_1_routing_have_no_lift_and_two_experts_top_2_a_uniform_ratio_of_one():
    out = _check_pairs([np.array([[0], [1], [1]])], E=2, k=1, n_pairs=3)
    assert out["by_layer"][0]["mean_lift"] is None and out["uniform"] == 0.0
    out = _check_pairs([np.array([[0, 1], [1, 0]])], E=2, k=2, n_pairs=3)
    assert out["uniform"] == 1.0
    assert co._pairs(_acc([np.array([[0]])], 1, 1), 2, [0.0])["uniform"] == 0.0
