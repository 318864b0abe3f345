"""The specialization report's baselines against synthetic routers with known answers: a router
that ignores what a statistic relates routes to scores at (close to) that statistic's baseline,
one that depends on it scores far above; and the definitions a plausible slip would change (the
domains' JSD weights, the first choice, the heatmap's experts, the domain fraction's scale)."""

import numpy as np
import pytest

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator
from moee.analysis.specialization.sections.coactivation import (
    HEATMAP_EXPERTS,
    MIN_EXPECTED,
    _null_sets,
    _ratios,
    _set_counts,
)


def decode(ids):
    return " ".join(f"w{i}" for i in ids)


def routes(sel, E, rng=None):
    """Dense probabilities ``[T, L, E]`` whose top-k is ``sel [T, L, k]`` (weights falling with
    the slot; a little noise elsewhere)."""
    T, L, k = sel.shape
    p = np.full((T, L, E), 0.01 / E)
    np.put_along_axis(p, sel, (0.9 - 0.1 * np.arange(k) / k)[None, None, :], axis=2)
    return p / p.sum(axis=2, keepdims=True)


def random_sets(rng, n, E, k, weights=None):
    """``[n, k]`` distinct experts per token, drawn independently of everything (Gumbel top-k of
    fixed log-weights: uneven loads)."""
    logw = np.zeros(E) if weights is None else np.log(weights)
    return np.argsort(-(logw + rng.gumbel(size=(n, E))), axis=1)[:, :k]


# ----------------------------------------------------------------- token / vocabulary baseline
def test_token_baseline_draws_only_from_the_tokens_the_statistic_counts():
    """Frequent types (counted) route at random among experts 0-1, types seen once (not counted,
    min_token_count 5) among experts 2-3. Among the counted tokens routing ignores the token, so
    the statistic must sit at its baseline; drawing the rare types' routes too would put the
    baseline near a max over four experts instead of two."""
    rng = np.random.default_rng(0)
    acc = SpecializationAccumulator(1, 4, 1, draws=BaselineDraws(permutations=20, seed=3))
    rare = 1000
    for i in range(40):
        ids = np.concatenate([rng.integers(0, 10, 20), rare + np.arange(20) + 20 * i])
        experts = np.where(ids < 10, rng.integers(0, 2, ids.size), 2 + rng.integers(0, 2, ids.size))
        acc.update(ids, routes(experts[:, None, None], 4), text_index=i, predicted=ids)
    rep = acc.result(decode, min_token_count=5)
    voc = rep["vocabulary"]["by_layer"][0]
    assert voc["n_token_types"] == 10
    assert voc["weighted_max_ratio"] == pytest.approx(voc["baseline"], abs=0.02)
    for key in ("input", "predicted"):
        row = rep["token_specialization"]["by_key"][key]["by_layer"][0]
        assert row["weighted_max_fraction"] == pytest.approx(row["weighted_max_fraction_baseline"], abs=0.02)
    assert rep["baselines"]["exact"] is True


# ----------------------------------------------------------------- co-activation
def test_null_sets_keep_every_load_and_k_distinct_experts_per_token():
    rng = np.random.default_rng(1)
    sets = random_sets(rng, 500, 6, 3, weights=np.array([8, 4, 2, 1, 1, 1.0]))
    null = _null_sets(sets, rng)
    assert null.shape == sets.shape and (null >= 0).all()
    np.testing.assert_array_equal(
        np.bincount(null.ravel(), minlength=6), np.bincount(sets.ravel(), minlength=6)
    )
    assert (np.diff(np.sort(null, axis=1), axis=1) > 0).all()  # k distinct experts each
    assert not np.array_equal(null, sets)
    counts = _set_counts(null, 6)
    np.testing.assert_array_equal(np.diag(counts), np.bincount(sets.ravel(), minlength=6))
    assert counts.sum() == 500 * 3 * 3  # k^2 pairs a token, its k experts on the diagonal


def test_set_counts_and_ratios_by_hand():
    counts = _set_counts(np.array([[0, 1], [0, 2], [1, -1]]), 3)
    np.testing.assert_array_equal(counts, [[2, 1, 1], [1, 2, 0], [1, 0, 1]])
    np.testing.assert_allclose(_ratios(counts), [[0, 0.5, 0.5], [0.5, 0, 0], [1, 0, 0]])


def _coactivation(sets_of, n_texts=100, T=30, E=32, k=4, L=2, seed=0, **kw):
    rng = np.random.default_rng(seed)
    draws = BaselineDraws(kw.pop("permutations", 4), seed, kw.pop("baseline_sample", None))
    acc = SpecializationAccumulator(L, E, k, draws=draws, **kw)
    for i in range(n_texts):
        sel = np.stack([sets_of(rng, T) for _ in range(L)], axis=1)
        acc.update(rng.integers(0, 50, T), routes(sel, E), text_index=i, selected=sel)
    return acc, acc.result(decode, min_token_count=5)["coactivation"]


WEIGHTS = np.linspace(3.0, 0.5, 32)


def test_an_independent_router_scores_at_its_coactivation_baseline():
    """3,000 tokens, each picking 4 of 32 experts independently (uneven loads): the largest of
    ~1,000 noisy ratios is far above the largest expected ratio, and at its null-sample baseline."""
    _, co = _coactivation(lambda rng, T: random_sets(rng, T, 32, 4, WEIGHTS))
    for row in co["by_layer"]:
        assert row["max_ratio"] == pytest.approx(row["max_ratio_baseline"], rel=0.1)
        assert row["max_ratio"] > 1.2 * row["max_ratio_independent"]  # the expectation is no baseline


def test_a_router_with_fixed_expert_pairs_scores_far_above_its_coactivation_baseline():
    def paired(rng, T):  # expert 2i always with 2i + 1
        first = 2 * random_sets(rng, T, 16, 2)
        return np.concatenate([first, first + 1], axis=1)

    _, co = _coactivation(paired)
    for row in co["by_layer"]:
        assert row["max_ratio"] == pytest.approx(1.0)
        assert row["max_ratio_baseline"] < 0.5


def test_coactivation_baseline_uses_as_many_tokens_as_the_corpus():
    """A route sample four times smaller than the corpus: the null still has the corpus's token
    count (drawn in blocks), so its maximum is as noisy as the statistic's, not more."""
    acc, co = _coactivation(lambda rng, T: random_sets(rng, T, 32, 4, WEIGHTS), baseline_sample=750)
    assert acc._sample.routes().shape[0] == 750 < acc.n_tokens
    for row in co["by_layer"]:
        assert row["max_ratio"] == pytest.approx(row["max_ratio_baseline"], rel=0.12)


def test_heatmap_experts_are_the_most_loaded_most_loaded_first_and_thin_cells_are_masked():
    """E = 24 > 16 shown, loads rising with the expert id: the heatmap shows experts 23, 22, ..., 8
    (not 0-15), and a cell whose expected count is below MIN_EXPECTED is None."""
    E = 24
    weights = np.arange(1, E + 1, dtype=float) ** 2
    acc, co = _coactivation(lambda rng, T: random_sets(rng, T, E, 2, weights), E=E, k=2, L=1, n_texts=40)
    order = np.argsort(-acc.load[0], kind="stable")
    assert co["top_experts"][0] == [int(e) for e in order[:HEATMAP_EXPERTS]]
    assert sorted(co["top_experts"][0]) == list(range(E - HEATMAP_EXPERTS, E))
    assert co["top_experts"][0][0] == int(acc.load[0].argmax())
    heat, indep = np.array(co["heatmaps"][0], dtype=float), np.asarray(co["independent_heatmaps"][0])
    counts = acc.tallies["coactivation"].counts[0]
    top = co["top_experts"][0]
    expected = np.diag(counts)[top][:, None] * indep
    assert co["heatmap_min_expected"] == MIN_EXPECTED
    np.testing.assert_array_equal(np.isnan(heat), expected < MIN_EXPECTED)
    assert np.isnan(heat).any() and (~np.isnan(heat)).any()
    a, b = 0, 1
    assert heat[a, b] == pytest.approx(counts[top[a], top[b]] / counts[top[a], top[a]], abs=1e-4)


# ----------------------------------------------------------------- domains and repetition
def _texts_router(n_texts=240, E=16, k=2, L=4, domains="abcd", by_domain=False, seed=0):
    """Every token of a text takes the same k experts, drawn per text (``by_domain``: per domain),
    texts dealt to the domains at random."""
    rng = np.random.default_rng(seed)
    acc = SpecializationAccumulator(L, E, k, draws=BaselineDraws(permutations=30, seed=seed))
    fixed = {d: random_sets(rng, L, E, k) for d in domains}
    for i in range(n_texts):
        T = int(rng.integers(10, 40))
        domain = domains[rng.integers(len(domains))]
        sets = fixed[domain] if by_domain else random_sets(rng, L, E, k)
        sel = np.broadcast_to(sets, (T, L, k)).copy()
        acc.update(rng.integers(0, 200, T), routes(sel, E), text_index=i, domain=domain, selected=sel)
    return acc, acc.result(decode, min_token_count=5)


def test_a_router_that_depends_on_the_text_alone_scores_at_its_domain_baselines():
    """Routing depends on the text, not its domain: the domains' JSD and max fractions sit at the
    baseline that deals the labels out to whole texts (shuffling single tokens against the labels
    would put the baseline several times lower). Repetition is 1, and so is its baseline."""
    _, rep = _texts_router()
    spec = rep["domains"]["specialization_by_layer"]
    ratio = np.mean([r["jsd"] / r["jsd_baseline"] for r in spec])
    assert 0.75 < ratio < 1.3
    lifts = [v for d in rep["domains"]["domains"].values() for v in d["lift_over_baseline_by_layer"]]
    assert 0.8 < np.mean(lifts) < 1.2
    assert rep["domains"]["exact"] is True and rep["domains"]["sampled_texts"] == 240
    for r in rep["repetition"]["by_layer"]:
        assert r["rate"] == pytest.approx(1.0) and r["baseline"] == pytest.approx(1.0)


def test_a_router_that_depends_on_the_domain_scores_far_above_its_domain_baselines():
    _, rep = _texts_router(by_domain=True)
    for r in rep["domains"]["specialization_by_layer"]:
        assert r["jsd"] > 3 * r["jsd_baseline"]


def test_an_independent_router_repeats_at_its_within_text_baseline():
    rng = np.random.default_rng(4)
    acc = SpecializationAccumulator(2, 8, 2, draws=BaselineDraws(permutations=2))
    for i in range(200):
        T = int(rng.integers(5, 30))
        sel = np.stack([random_sets(rng, T, 8, 2, np.linspace(4, 1, 8)) for _ in range(2)], axis=1)
        acc.update(rng.integers(0, 50, T), routes(sel, 8), text_index=i, selected=sel)
    for r in acc.result(decode, min_token_count=5)["repetition"]["by_layer"]:
        assert r["rate"] == pytest.approx(r["baseline"], abs=0.02)


def test_domain_text_sample_is_bounded_and_independent_of_arrival_order(monkeypatch):
    import moee.analysis.specialization.sections.domains as domains

    monkeypatch.setattr(domains, "_MIN_TEXTS", 8)
    monkeypatch.setattr(domains, "DOMAIN_TEXT_BYTES", 8 * (4 * 2 * 3 + 16))
    rng = np.random.default_rng(2)
    texts = [(i, rng.integers(0, 3, (int(rng.integers(1, 9)), 2, 1)), "ab"[i % 2]) for i in range(30)]

    def run(items):
        acc = SpecializationAccumulator(2, 3, 1, draws=BaselineDraws(permutations=5, seed=1))
        for i, sel, d in items:
            acc.update(np.arange(sel.shape[0]), routes(sel, 3), text_index=i, domain=d, selected=sel)
        return acc, acc.result(decode, min_token_count=1)["domains"]

    acc, forward = run(texts)
    _, backward = run(texts[::-1])
    tally = acc.tallies["domains"]
    assert tally.capacity == 8 and tally.n_sampled == 8 and tally.text_counts.shape[0] == 8
    assert forward["exact"] is False and forward["sampled_texts"] == 8
    assert forward == backward
    assert sum(d["n_texts"] for d in forward["domains"].values()) == 30


# ----------------------------------------------------------------- definitions
def test_domain_jsd_weights_the_domains_by_their_token_shares():
    """Domain a: 30 tokens, all expert 0; domain b: 10 tokens, all expert 1. Disjoint loads: the JSD
    is the entropy of the weights (3/4, 1/4), not log 2 as with equal weights."""
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=2))
    for i in range(6):
        acc.update(np.arange(5), routes(np.zeros((5, 1, 1), int), 2), text_index=i, domain="a")
    for i in range(6, 8):
        acc.update(np.arange(5), routes(np.ones((5, 1, 1), int), 2), text_index=i, domain="b")
    jsd = acc.result(decode, min_token_count=1)["domains"]["specialization_by_layer"][0]["jsd"]
    w = np.array([0.75, 0.25])
    assert jsd == pytest.approx(-(w * np.log(w)).sum())


def test_domain_fraction_is_the_share_of_the_domains_tokens_so_it_sums_to_k():
    """k = 2: every token counts for two experts, so a domain's fractions N_k(E, D) / N_D sum to 2
    and an expert in every token's top-k has fraction 1."""
    rng = np.random.default_rng(0)
    acc = SpecializationAccumulator(1, 5, 2, draws=BaselineDraws(permutations=2))
    for i in range(10):
        sel = np.stack([np.zeros(8, int), 1 + rng.integers(0, 4, 8)], axis=1)[:, None, :]
        acc.update(np.arange(8), routes(sel, 5), text_index=i, domain="ab"[i % 2], selected=sel)
    doms = acc.result(decode, min_token_count=1)["domains"]["domains"]
    for d in doms.values():
        assert sum(d["fraction"][0]) == pytest.approx(2.0, abs=1e-5)
        assert d["fraction"][0][0] == pytest.approx(1.0) and d["max_fraction_by_layer"][0] == pytest.approx(
            1.0
        )


def test_the_first_choice_of_a_re_derived_selection_is_its_top_scoring_expert():
    """The top k re-derived from selection scores that differ from the probabilities (a
    selection-only bias) lists the top-biased expert first; the first choice is still the selected
    expert with the highest probability (the largest routing weight), not the first listed. The
    router's own indices in no particular order: the same rule."""
    rng = np.random.default_rng(0)
    E, k, T = 8, 3, 400
    probs = rng.dirichlet(np.ones(E), size=(T, 1))
    rank = probs + rng.uniform(0, 0.3, size=(1, 1, E))  # a bias on the selection only
    acc = SpecializationAccumulator(1, E, k)
    sel = acc.selection(probs, rank)
    best = np.take_along_axis(sel, np.take_along_axis(probs, sel, 2).argmax(2)[..., None], 2)[:, 0, 0]
    assert (sel[:, 0, 0] != best).sum() > 20  # the listing order is not the probability ranking
    acc.update(np.arange(T), probs, text_index=0, selection=rank)
    np.testing.assert_array_equal(acc.last_first[:, 0], best)
    np.testing.assert_array_equal(acc.first[0], np.bincount(best, minlength=E))
    shuffled = rng.permuted(np.argsort(-probs, axis=2)[..., :k], axis=2)
    assert (shuffled[:, 0, 0] != probs[:, 0].argmax(axis=1)).any()
    acc = SpecializationAccumulator(1, E, k)
    acc.update(np.arange(T), probs, text_index=0, selected=shuffled)
    np.testing.assert_array_equal(acc.last_first[:, 0], probs[:, 0].argmax(axis=1))
    rep = acc.result(decode, min_token_count=1)
    assert rep["repetition"]["by_layer"][0]["rate"] == pytest.approx(
        np.mean(probs[1:, 0].argmax(1) == probs[:-1, 0].argmax(1))
    )


def test_repetition_counts_two_token_texts_and_texts_without_pairs():
    """A one-token text has no adjacent pair (rate and baseline 0); a two-token text has one."""
    acc = SpecializationAccumulator(1, 2, 1)
    acc.update(np.array([1]), routes(np.zeros((1, 1, 1), int), 2), text_index=0)
    assert acc.baselines()["repetition"] == [0.0]
    acc.update(np.array([1, 2]), routes(np.zeros((2, 1, 1), int), 2), text_index=1)
    rep = acc.result(decode, min_token_count=1)["repetition"]
    assert rep["n_adjacent_pairs"] == 1 and rep["by_layer"][0] == {"layer": 0, "rate": 1.0, "baseline": 1.0}


def test_token_baselines_of_a_key_without_counted_types_and_a_single_draw():
    """Inputs all distinct (no input type counted) but one predicted token throughout: the input
    key has no baseline, the predicted key still has one; one draw over two layers."""
    acc = SpecializationAccumulator(2, 3, 1, draws=BaselineDraws(permutations=1))
    sel = np.zeros((12, 2, 1), int)
    sel[::2] = 1
    acc.update(np.arange(12), routes(sel, 3), text_index=0, predicted=np.full(12, 7))
    rep = acc.result(decode, min_token_count=5)
    by_key = rep["token_specialization"]["by_key"]
    assert by_key["input"]["by_layer"][1]["weighted_max_fraction_baseline"] is None
    assert rep["vocabulary"]["by_layer"][1]["baseline"] is None
    predicted = by_key["predicted"]
    assert predicted["by_layer"][1]["weighted_max_fraction_baseline"] == pytest.approx(0.5)
    assert predicted["experts"][1][0]["specialization_baseline"] == pytest.approx(0.05)  # 6/12 over n_top 10


def test_counted_routes_fall_back_to_the_whole_sample_when_it_holds_no_counted_token():
    from moee.analysis.specialization.sections.base import Draw
    from moee.analysis.specialization.sections.token_specialization import counted_routes

    sample = np.arange(6).reshape(3, 1, 2)
    tokens = np.array([[4, 5, -1], [9, -1, -1], [4, 2, -1]])
    draw = Draw(None, None, sample, None, {}, lambda: None, tokens)
    np.testing.assert_array_equal(counted_routes(draw, 0, np.array([4])), sample[[0, 2]])
    np.testing.assert_array_equal(counted_routes(draw, 1, np.array([2])), sample[[2]])
    np.testing.assert_array_equal(counted_routes(draw, 0, np.array([99])), sample)
    np.testing.assert_array_equal(
        counted_routes(Draw(None, None, sample, None, {}, lambda: None), 0, []), sample
    )
