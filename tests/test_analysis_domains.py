"""The domain section's statistics on inputs small enough to check by hand: the tally's bounded,
order-independent sample of texts, the null's dealing of texts to domains, the weighted JSD, the
baseline's means and every field of the section's JSON against a direct re-computation."""

from types import SimpleNamespace

import numpy as np
import pytest

import moee.analysis.specialization.sections.domains as dom
from moee.analysis.specialization.statistics import _mix64


def _text(index, domain, counts, n_tokens=None):
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts[0].sum()) if n_tokens is None else n_tokens
    return SimpleNamespace(index=index, domain=domain, ids=np.zeros(n, dtype=np.int64), counts=counts)


def _tally(L=1, E=2):
    return dom._Domains(SimpleNamespace(n_layers=L, n_experts=E))


def _priority(index):
    return int(_mix64(np.uint64(index) + np.uint64(0x632BE59BD9B4E019)))


# ----------------------------------------------------------------- the tally
@pytest.mark.parametrize(
    "L, E, capacity",
    [
        (2, 4, 1 << 16),
        (1, 64, (1 << 24) // 272),
        (64, 256, (1 << 24) // (4 * 64 * 256 + 16)),
        (512, 1024, 64),
    ],
)
def test_the_text_sample_holds_as_many_texts_as_its_memory_bound_allows(L, E, capacity):
    """At most 65,536 texts, at least 64, else as many as 16 MiB of counts (4 bytes each) and
    16 bytes of token count and priority a text hold."""
    tally = _tally(L, E)
    assert tally.capacity == capacity
    # allocated at the first labelled text: a corpus without domain labels holds no sample
    assert tally.text_counts.nbytes == tally.text_tokens.nbytes == tally.text_priority.nbytes == 0
    tally.update(_text(0, "a", np.ones((L, E))))
    assert tally.text_counts.shape == (capacity, L, E) and tally.text_tokens.shape == (capacity,)
    if capacity > 64:
        held = tally.text_counts.nbytes + tally.text_tokens.nbytes + tally.text_priority.nbytes
        assert held <= dom.DOMAIN_TEXT_BYTES


def test_the_tally_sums_each_domains_tokens_texts_and_loads_and_skips_unlabelled_texts():
    tally = _tally()
    tally.update(_text(0, "a", [[2, 1]], n_tokens=3))
    tally.update(_text(1, "b", [[0, 2]], n_tokens=2))
    tally.update(_text(2, "a", [[1, 1]], n_tokens=2))
    tally.update(_text(3, None, [[5, 5]], n_tokens=10))
    assert tally.tokens == {"a": 5, "b": 2} and tally.texts == {"a": 2, "b": 1}
    np.testing.assert_array_equal(tally.load["a"], [[3, 2]])
    assert tally.load["a"].dtype == np.int64 and tally.n_sampled == 3


def test_a_full_sample_keeps_the_texts_of_lowest_priority_whatever_their_order(monkeypatch):
    """Capacity 4 for 10 texts: the 4 whose fixed hash of the text index is smallest, the same set
    when the texts arrive in reverse."""
    monkeypatch.setattr(dom, "_MAX_TEXTS", 4)
    monkeypatch.setattr(dom, "_MIN_TEXTS", 1)
    kept = sorted(range(10), key=_priority)[:4]
    held = []
    for order in (range(10), reversed(range(10))):
        tally = _tally()
        assert tally.capacity == 4
        for i in order:
            tally.update(_text(i, "a", [[i, 1]], n_tokens=i + 1))
        rows = sorted(
            zip(tally.text_tokens.tolist(), tally.text_counts[:, 0, 0].tolist(), tally.text_priority.tolist())
        )
        held.append(rows)
        assert tally.n_sampled == 4
    assert held[0] == held[1] == sorted((i + 1, i, _priority(i)) for i in kept)


# ----------------------------------------------------------------- the null's draw
def _filled(n_texts, domains, L=1, E=3):
    """Text i of domain ``domains[i % len]`` with 2**i tokens (a draw's token count names the texts it drew)."""
    tally = _tally(L, E)
    for i in range(n_texts):
        counts = np.zeros((L, E), dtype=np.int64)
        counts[:, i % E] = 1 << i
        tally.update(_text(i, domains[i % len(domains)], counts, n_tokens=1 << i))
    return tally


def _drawn(tokens):
    return [sorted(i for i in range(40) if int(t) >> i & 1) for t in tokens]


def test_a_draw_of_a_whole_sample_deals_every_text_out_once():
    tally = _filled(9, "aab")
    names = sorted(tally.tokens)
    counts, tokens = tally.draw(names, np.random.default_rng(0))
    got = _drawn(tokens)
    assert [len(g) for g in got] == [tally.texts[d] for d in names] == [6, 3]
    assert sorted(sum(got, [])) == list(range(9))
    np.testing.assert_array_equal(counts.sum(axis=0), sum(tally.text_counts[: tally.n_sampled]))


def test_a_draw_from_a_partial_sample_takes_as_many_texts_as_each_domain_has(monkeypatch):
    """12 texts (7 of a, 5 of b), a sample of 5 texts of one token each: each domain draws its own
    number of texts, with replacement, from the sample in its fixed (priority) order."""
    monkeypatch.setattr(dom, "_MAX_TEXTS", 5)
    monkeypatch.setattr(dom, "_MIN_TEXTS", 1)
    tally = _tally(1, 3)
    for i in range(12):
        counts = np.zeros((1, 3), dtype=np.int64)
        counts[0, i % 3] = 1
        tally.update(_text(i, "a" if i % 12 < 7 else "b", counts, n_tokens=1))
    assert tally.n_sampled == 5
    counts, tokens = tally.draw(["a", "b"], np.random.default_rng(1))
    assert tokens.tolist() == [7, 5] and counts.sum(axis=(1, 2)).tolist() == [7, 5]
    order = np.argsort(tally.text_priority[:5], kind="stable")
    picks = order[np.random.default_rng(1).integers(0, 5, 12)]
    np.testing.assert_array_equal(counts[0], tally.text_counts[picks[:7]].sum(axis=0))
    np.testing.assert_array_equal(counts[1], tally.text_counts[picks[7:]].sum(axis=0))


def test_a_draw_is_the_same_in_blocks_and_whatever_order_the_texts_arrived_in(monkeypatch):
    tally = _filled(9, "aab")
    whole = tally.draw(["a", "b"], np.random.default_rng(5))
    monkeypatch.setattr(dom, "_TEXT_BLOCK", 2)
    blocked = tally.draw(["a", "b"], np.random.default_rng(5))
    reversed_tally = _tally(1, 3)
    for i in reversed(range(9)):
        counts = np.zeros((1, 3), dtype=np.int64)
        counts[:, i % 3] = 1 << i
        reversed_tally.update(_text(i, "aab"[i % 3], counts, n_tokens=1 << i))
    again = reversed_tally.draw(["a", "b"], np.random.default_rng(5))
    for a, b, c in zip(whole, blocked, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


# ----------------------------------------------------------------- JSD
def test_generalized_jsd_by_hand():
    two = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert dom._generalized_jsd(two, np.array([1, 1])) == pytest.approx(np.log(2))
    h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    assert dom._generalized_jsd(two, np.array([6, 2])) == pytest.approx(h)  # weights normalised
    same = np.array([[0.3, 0.7], [0.3, 0.7], [0.3, 0.7]])
    assert dom._generalized_jsd(same, np.array([1, 2, 3])) == 0.0


def test_domain_jsd_weights_domains_by_their_selections_per_layer():
    counts = np.array([[[3, 1], [2, 2]], [[0, 4], [0, 8]]], dtype=np.int64)  # [D=2, L=2, E=2]
    got = dom._domain_jsd(counts)

    def by_hand(a, b):
        wa, wb = a.sum() / (a.sum() + b.sum()), b.sum() / (a.sum() + b.sum())
        pa, pb = a / a.sum(), b / b.sum()

        def h(p):
            return -sum(x * np.log(x) for x in p if x > 0)

        return h(wa * pa + wb * pb) - wa * h(pa) - wb * h(pb)

    assert got == [
        pytest.approx(by_hand(counts[0, 0], counts[1, 0])),
        pytest.approx(by_hand(counts[0, 1], counts[1, 1])),
    ]
    assert dom._domain_jsd(counts[:1]) == [None, None]


# ----------------------------------------------------------------- baseline and JSON
def _results(tally, L, permutations=3, seed=0):
    steps = []
    acc = SimpleNamespace(n_layers=L, permutations=permutations, tallies={"domains": tally})
    draw = SimpleNamespace(acc=acc, rng=np.random.default_rng(seed), step=lambda: steps.append(1))
    return acc, draw, steps


def test_baseline_is_the_mean_over_draws_of_each_domains_max_fraction_and_the_jsd(monkeypatch):
    tally = _filled(9, "aab", L=2)
    acc, draw, steps = _results(tally, L=2, permutations=3)
    seen = []
    real = tally.draw

    def record(names, rng):
        out = real(names, rng)
        seen.append(out)
        return out

    monkeypatch.setattr(tally, "draw", record)
    base = dom._baseline(draw)
    assert len(steps) == 3 and len(seen) == 3
    max_fraction = np.mean([c.max(axis=2) / t[:, None] for c, t in seen], axis=0)
    np.testing.assert_allclose(base["max_fraction"], max_fraction)
    np.testing.assert_allclose(base["jsd"], np.mean([dom._domain_jsd(c) for c, _ in seen], axis=0))


def test_baseline_fraction_of_a_domain_of_one_one_token_text():
    """Domain b is one text of one token (expert 1 in both slots of layer 0's count): its null
    max fraction is the drawn text's largest count over 1 token, not over a floor above it."""
    tally = _tally(1, 2)
    tally.update(_text(0, "a", [[1, 1]], n_tokens=1))
    tally.update(_text(1, "b", [[0, 2]], n_tokens=1))
    acc, draw, steps = _results(tally, L=1, permutations=4)
    base = dom._baseline(draw)
    assert all(1.0 <= v <= 2.0 for row in base["max_fraction"] for v in row)  # a draw gives each text once
    assert sum(base["max_fraction"][1]) + sum(base["max_fraction"][0]) == pytest.approx(3.0)


def test_baseline_of_one_domain_has_no_jsd_and_of_none_zero_fractions():
    acc, draw, steps = _results(_filled(4, "a", L=2), L=2, permutations=2)
    base = dom._baseline(draw)
    assert base["jsd"] == [None, None] and len(base["max_fraction"]) == 1
    acc, draw, steps = _results(_tally(2, 3), L=2, permutations=2)
    assert dom._baseline(draw) == {"max_fraction": [], "jsd": [None, None]} and len(steps) == 2


def test_result_every_field_against_a_direct_computation():
    tally = _tally(L=2, E=3)
    texts = [("b", [[3, 0, 3], [1, 3, 2]]), ("a", [[1, 4, 1], [0, 6, 0]]), ("b", [[2, 4, 0], [5, 1, 0]])]
    for i, (d, counts) in enumerate(texts):
        tally.update(_text(i, d, counts, n_tokens=3))  # top-2: 6 selections over 3 tokens a layer
    base = {"max_fraction": [[0.7, 0.0], [1.0 / 3, 0.3]], "jsd": [0.01, 0.02]}
    acc = SimpleNamespace(n_layers=2, tallies={"domains": tally})
    out = dom._result(SimpleNamespace(acc=acc, baselines={"domains": base}))
    assert out["available"] is True and out["names"] == ["a", "b"]
    assert out["sampled_texts"] == 3 and out["exact"] is True
    load = {"a": np.array([[1, 4, 1], [0, 6, 0]]), "b": np.array([[5, 4, 3], [6, 4, 2]])}
    tokens = {"a": 3, "b": 6}
    jsd = dom._domain_jsd(np.stack([load["a"], load["b"]]))
    assert out["specialization_by_layer"] == [
        {"layer": 0, "jsd": pytest.approx(jsd[0]), "jsd_baseline": 0.01},
        {"layer": 1, "jsd": pytest.approx(jsd[1]), "jsd_baseline": 0.02},
    ]
    for d, b in zip("ab", base["max_fraction"]):
        fraction = load[d] / tokens[d]
        got = out["domains"][d]
        assert got["n_tokens"] == tokens[d] and got["n_texts"] == (1 if d == "a" else 2)
        assert got["fraction"] == fraction.round(6).tolist()
        assert got["max_fraction_by_layer"] == fraction.max(axis=1).round(6).tolist()
        assert got["baseline_by_layer"] == [round(x, 6) for x in b]
        lifts = [round(m / x, 4) if x > 0 else None for m, x in zip(fraction.max(axis=1), b)]
        assert got["lift_over_baseline_by_layer"] == lifts
    assert out["domains"]["a"]["lift_over_baseline_by_layer"][1] is None  # a zero baseline
    assert out["domains"]["b"]["baseline_by_layer"][0] == 0.333333  # six places
    assert (
        out["domains"]["a"]["fraction"][0][0] == 0.333333
        and out["domains"]["b"]["max_fraction_by_layer"][1] == 1.0
    )
    assert out["domains"]["a"]["lift_over_baseline_by_layer"][0] == 1.9048  # (4/3) / 0.7, four places


def test_result_of_a_sample_that_missed_texts_is_not_exact_and_of_no_labels_unavailable(monkeypatch):
    monkeypatch.setattr(dom, "_MAX_TEXTS", 2)
    monkeypatch.setattr(dom, "_MIN_TEXTS", 1)
    tally = _filled(5, "ab", L=1)
    base = {"max_fraction": [[0.1], [0.1]], "jsd": [0.0]}
    acc = SimpleNamespace(n_layers=1, tallies={"domains": tally})
    out = dom._result(SimpleNamespace(acc=acc, baselines={"domains": base}))
    assert out["sampled_texts"] == 2 and out["exact"] is False
    empty = dom._result(
        SimpleNamespace(
            acc=SimpleNamespace(n_layers=2, tallies={"domains": _tally(2, 3)}),
            baselines={"domains": {"max_fraction": [], "jsd": [None, None]}},
        )
    )
    assert empty["available"] is False and empty["names"] == [] and empty["domains"] == {}
    assert empty["specialization_by_layer"] == [
        {"layer": i, "jsd": None, "jsd_baseline": None} for i in range(2)
    ]
