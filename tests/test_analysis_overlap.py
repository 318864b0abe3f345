"""Clustering-overlap metrics against hand-computed values and naive second implementations.

Every expected number here is derived independently of scikit-learn/scipy: by hand, by brute
force over pairs or matchings, or by a direct transcription of the textbook formula (entropy,
mutual information, the expected mutual information of Vinh, Epps & Bailey 2010).
"""

import math
from collections import Counter
from itertools import combinations, permutations
from types import SimpleNamespace

import numpy as np
import pytest

import moee.analysis.overlap as overlap
from moee.analysis.overlap import (
    METRICS,
    ClusteringRuns,
    chance_agreement,
    clustering_overlap,
    flatten_rw,
    kmeans_partition,
    matched_accuracy,
    overlap_for_texts,
    overlap_sweep,
    pair_jaccard,
    partition_agreement,
    plot_overlap_sweep,
)
from moee.embed.methods import DEFAULT_SCORE

# ---------------------------------------------------------------------- naive references


def naive_entropy(labels):
    n = len(labels)
    return -sum(c / n * math.log(c / n) for c in Counter(labels).values())


def naive_mi(a, b):
    n = len(a)
    ca, cb, cab = Counter(a), Counter(b), Counter(zip(a, b))
    return sum(c / n * math.log(n * c / (ca[x] * cb[y])) for (x, y), c in cab.items())


def naive_nmi(a, b):
    ha, hb = naive_entropy(a), naive_entropy(b)
    if ha == hb == 0:
        return 1.0
    return naive_mi(a, b) / ((ha + hb) / 2)


def naive_emi(a, b):
    """Expected MI of two random partitions with these cluster sizes (hypergeometric model)."""
    n = len(a)
    lf = math.lgamma
    total = 0.0
    for ai in Counter(a).values():
        for bj in Counter(b).values():
            for nij in range(max(1, ai + bj - n), min(ai, bj) + 1):
                log_p = (
                    lf(ai + 1) + lf(bj + 1) + lf(n - ai + 1) + lf(n - bj + 1)
                    - lf(n + 1) - lf(nij + 1) - lf(ai - nij + 1) - lf(bj - nij + 1)
                    - lf(n - ai - bj + nij + 1)
                )  # fmt: skip
                total += nij / n * math.log(n * nij / (ai * bj)) * math.exp(log_p)
    return total


def naive_ami(a, b):
    emi = naive_emi(a, b)
    return (naive_mi(a, b) - emi) / ((naive_entropy(a) + naive_entropy(b)) / 2 - emi)


def brute_jaccard(a, b):
    both = either = 0
    for i, j in combinations(range(len(a)), 2):
        in_a, in_b = a[i] == a[j], b[i] == b[j]
        both += in_a and in_b
        either += in_a or in_b
    return both / either if either else 1.0


def brute_matched(a, b):
    """Best one-to-one cluster matching by trying every injection of the smaller side."""
    ua, ub = sorted(set(a)), sorted(set(b))
    pairs = Counter(zip(a, b))
    if len(ua) > len(ub):
        return brute_matched(b, a)
    best = max(sum(pairs[(x, y)] for x, y in zip(ua, perm)) for perm in permutations(ub, len(ua)))
    return best / len(a)


# ---------------------------------------------------------------------- metrics


def test_identical_partitions_score_one_even_when_relabelled():
    a = np.array([0, 0, 1, 1, 2, 2, 2, 3])
    b = np.array([7, 7, 5, 5, 9, 9, 9, 1])  # same partition, other label names
    scores = partition_agreement(a, b)
    assert scores == pytest.approx({"ami": 1.0, "nmi": 1.0, "jaccard": 1.0, "exact_match": 1.0})
    assert set(scores) == set(METRICS)


def test_nmi_and_ami_hand_computed():
    # a = {0,1},{2,3}; b = {0,1,2},{3}. H(a) = log 2, H(b) = -(3/4 log 3/4 + 1/4 log 1/4),
    # the contingency [[2, 0], [1, 1]] over 4 items: MI = sum n_ij/N log(N n_ij / (a_i b_j))
    a, b = [0, 0, 1, 1], [0, 0, 0, 1]
    h_a = math.log(2)
    h_b = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    mi = 0.5 * math.log(4 * 2 / (2 * 3)) + 0.25 * math.log(4 * 1 / (2 * 3)) + 0.25 * math.log(4 * 1 / (2 * 1))
    scores = partition_agreement(a, b)
    assert scores["nmi"] == pytest.approx(mi / ((h_a + h_b) / 2))
    # E[MI] over random partitions with sizes (2, 2) and (3, 1): by the hypergeometric model the
    # 1-cluster of b falls in either half, so MI is always the same: E[MI] = MI, AMI = 0
    assert scores["ami"] == pytest.approx(0.0, abs=1e-9)
    # b independent of a within each half: MI = 0, and AMI is negative (below its expectation)
    a, b = [0, 0, 1, 1], [0, 1, 0, 1]
    scores = partition_agreement(a, b)
    assert scores["nmi"] == pytest.approx(0.0, abs=1e-12)
    assert scores["ami"] < 0


def test_ami_nmi_equal_a_naive_implementation_on_random_partitions():
    rng = np.random.default_rng(0)
    for n, ka, kb in ((60, 6, 4), (45, 3, 3), (30, 7, 2)):
        a, b = rng.integers(0, ka, n).tolist(), rng.integers(0, kb, n).tolist()
        scores = partition_agreement(a, b)
        assert scores["nmi"] == pytest.approx(naive_nmi(a, b), abs=1e-10)
        assert scores["ami"] == pytest.approx(naive_ami(a, b), abs=1e-10)


def test_independent_partitions_are_near_chance():
    rng = np.random.default_rng(1)
    k, n = 5, 5000
    a, b = rng.integers(0, k, n), rng.integers(0, k, n)
    scores = partition_agreement(a, b)
    assert abs(scores["ami"]) < 0.005
    assert scores["nmi"] < 0.005
    # together-in-a and together-in-b independent with p = 1/k: J = p^2 / (2p - p^2) = p / (2 - p)
    assert scores["jaccard"] == pytest.approx((1 / k) / (2 - 1 / k), abs=0.01)
    assert scores["exact_match"] == pytest.approx(1 / k, abs=0.03)


def test_jaccard_hand_made():
    # together in a: {0,1}, {2,3}; in b: {0,1}, {0,2}, {1,2}; both: {0,1}; either: 4 pairs
    assert pair_jaccard([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(1 / 4)
    # a: all 6 pairs together; b: {0,1}, {2,3}: both 2, either 6
    assert pair_jaccard([0, 0, 0, 0], [0, 0, 1, 1]) == pytest.approx(2 / 6)
    assert pair_jaccard([0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(2 / 6)  # symmetric
    # only singletons in both: identical partitions
    assert pair_jaccard([0, 1, 2], [5, 6, 7]) == 1.0
    # singletons vs one cluster: nothing together in both
    assert pair_jaccard([0, 1, 2], [0, 0, 0]) == 0.0
    # a: {0,1,2} {3,4}: 4 pairs; b: {0,1} {2,3,4}: 4 pairs; both: {0,1}, {3,4} -> 2 / 6
    assert pair_jaccard([0, 0, 0, 1, 1], [0, 0, 1, 1, 1]) == pytest.approx(2 / 6)


def test_jaccard_equals_brute_force_pair_count():
    rng = np.random.default_rng(2)
    for _ in range(5):
        a, b = rng.integers(0, 4, 40), rng.integers(0, 3, 40)
        assert pair_jaccard(a, b) == pytest.approx(brute_jaccard(a, b))


def test_exact_match_hand_made():
    # best matching a0->b1 (2), a1->b0 (2), a2->b2 (1): 5 of 6
    assert matched_accuracy([0, 0, 1, 1, 2, 2], [1, 1, 0, 0, 0, 2]) == pytest.approx(5 / 6)
    # unequal cluster counts: one a-cluster can match only one b-cluster
    assert matched_accuracy([0, 0, 0, 0], [0, 0, 1, 1]) == pytest.approx(0.5)
    # contingency [[3, 2], [2, 0]]: greedy a0->b0 gives 3 + 0, the optimal a0->b1, a1->b0 gives 2 + 2
    a = [0, 0, 0, 0, 0, 1, 1]
    b = [0, 0, 0, 1, 1, 0, 0]
    assert matched_accuracy(a, b) == pytest.approx(4 / 7)


def test_exact_match_equals_brute_force_matching():
    rng = np.random.default_rng(5)
    for ka, kb in ((3, 4), (4, 3), (4, 4)):
        a, b = rng.integers(0, ka, 25).tolist(), rng.integers(0, kb, 25).tolist()
        assert matched_accuracy(a, b) == pytest.approx(brute_matched(a, b))


def test_chance_agreement_is_the_mean_over_seeded_size_preserving_permutations():
    a = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    b = [1, 1, 0, 0, 2, 2, 2, 3, 3, 3]
    # the documented recipe, written out: mean of the four metrics between a and 10 permutations
    # of b drawn from numpy's generator seeded with 0
    rng = np.random.default_rng(0)
    perms = [rng.permutation(b).tolist() for _ in range(10)]
    expected = {
        "ami": np.mean([naive_ami(a, p) for p in perms]),
        "nmi": np.mean([naive_nmi(a, p) for p in perms]),
        "jaccard": np.mean([brute_jaccard(a, p) for p in perms]),
        "exact_match": np.mean([brute_matched(a, p) for p in perms]),
    }
    assert chance_agreement(a, b) == pytest.approx(expected, abs=1e-10)
    rng = np.random.default_rng(7)
    perms = [rng.permutation(b).tolist() for _ in range(1)]
    one = chance_agreement(a, b, permutations=1, seed=7)
    assert one["jaccard"] == pytest.approx(brute_jaccard(a, perms[0]))
    assert one["exact_match"] == pytest.approx(brute_matched(a, perms[0]))
    with pytest.raises(ValueError, match="permutations must be >= 1, got 0"):
        chance_agreement(a, b, permutations=0)


def test_chance_agreement_of_independent_partitions_matches_their_scores():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 5, 5000), rng.integers(0, 5, 5000)
    chance = chance_agreement(a, b, permutations=3)
    assert chance["jaccard"] == pytest.approx(partition_agreement(a, b)["jaccard"], abs=0.01)


@pytest.mark.parametrize(
    "a,b,message",
    [
        ([0, 1, 2], [0, 1], "different numbers of items: 3 vs 2"),
        ([[0, 1]], [0, 1], r"labels_a must be a 1-D sequence of cluster labels, got shape \(1, 2\)"),
        ([0, 1], [[0, 1]], r"labels_b must be a 1-D sequence of cluster labels, got shape \(1, 2\)"),
        ([], [0], "labels_a is empty"),
        ([0], [], "labels_b is empty"),
    ],
)
def test_bad_partitions_raise(a, b, message):
    with pytest.raises(ValueError, match=message):
        partition_agreement(a, b)


def test_flatten_rw():
    rw = np.arange(24).reshape(2, 3, 4)
    flat = flatten_rw(rw)
    assert flat.shape == (2, 12)
    np.testing.assert_array_equal(flat[1], np.arange(12, 24))  # layer order
    np.testing.assert_array_equal(flatten_rw(flat), flat)
    with pytest.raises(ValueError, match=r"rw must be \[n, L, E\] or \[n, d\], got shape \(4,\)"):
        flatten_rw(np.zeros(4))


# ---------------------------------------------------------------------- k-means


def blobs(n_per=30, k=3, dim=10, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1, (k, dim)) * 5
    x = np.concatenate([c + rng.normal(0, 0.1, (n_per, dim)) for c in centers])
    return x, np.repeat(np.arange(k), n_per)


def test_kmeans_partition_recovers_blobs_and_is_deterministic():
    x, gold = blobs()
    p1 = kmeans_partition(x, 3, seed=4)
    assert p1.dtype == np.int64 and p1.shape == (90,)
    assert np.array_equal(p1, kmeans_partition(x, 3, seed=4))
    assert partition_agreement(p1, gold)["ami"] == pytest.approx(1.0)


def test_kmeans_partition_clusters_directions_not_lengths():
    # two directions, each at very different lengths (and norms below 1): cosine geometry puts
    # every row with its direction; raw Euclidean k-means would split by length instead
    rng = np.random.default_rng(0)
    dirs = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    gold = np.repeat([0, 1], 20)
    scale = np.tile(np.r_[np.full(10, 0.01), np.full(10, 50.0)], 2)[:, None]
    x = dirs[gold] * scale + rng.normal(0, 1e-4, (40, 3)) * scale
    assert partition_agreement(kmeans_partition(x, 2), gold)["ami"] == pytest.approx(1.0)
    by_length = kmeans_partition(x, 2, normalize=False)
    assert partition_agreement(by_length, gold)["ami"] < 0.5
    # integer input and an all-zero row (kept at zero instead of dividing by 0)
    xi = np.repeat(np.array([[3, 0], [0, 3], [5, 0], [0, 7]]), 5, axis=0)
    xi[0] = 0
    labels = kmeans_partition(xi, 2)
    first, second = np.r_[1:5, 10:15], np.r_[5:10, 15:20]
    assert len(set(labels[first])) == len(set(labels[second])) == 1 and labels[1] != labels[5]


def test_kmeans_partition_uses_the_documented_recipe(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, **kwargs):
            seen.append(kwargs)

        def fit_predict(self, x):
            seen.append(x)
            return np.arange(x.shape[0]) % 2

    monkeypatch.setattr(overlap, "KMeans", Recorder)
    x = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    kmeans_partition(x, 2)
    assert seen[0] == {"n_clusters": 2, "n_init": 10, "random_state": 0}
    # rows scaled to unit length; the all-zero row stays exactly zero
    np.testing.assert_array_equal(
        seen[1], [[0.6, 0.8, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    )
    kmeans_partition(x, 3, seed=5, n_init=2, normalize=False)
    assert seen[2] == {"n_clusters": 3, "n_init": 2, "random_state": 5}
    np.testing.assert_allclose(seen[3], x)
    seen.clear()
    clustering_overlap(np.ones((4, 2, 3)) + np.eye(4)[:, None, :3], np.eye(4), 2, seed=3, n_init=4)
    assert seen[0] == seen[2] == {"n_clusters": 2, "n_init": 4, "random_state": 3}
    assert seen[1].shape == (4, 6)  # RW flattened to L*E
    # the defaults and the options reach k-means from every entry point
    rw, hs = np.ones((4, 2, 3)) + np.eye(4)[:, None, :3], np.eye(4)
    for run in (
        lambda **kw: clustering_overlap(rw, hs, 2, **kw),
        lambda **kw: overlap_sweep(rw, hs, [2], **kw),
        lambda **kw: overlap_for_texts(
            FakeTracer(rw, hs), ["a", "b", "c", "d"], [2], clustering=ClusteringRuns(**kw)
        ),
    ):
        seen.clear()
        run()
        assert seen[0] == seen[2] == {"n_clusters": 2, "n_init": 10, "random_state": 0}
        seen.clear()
        run(n_init=3, seed=6)
        assert seen[0] == seen[2] == {"n_clusters": 2, "n_init": 3, "random_state": 6}


def test_kmeans_partition_rejects_bad_k_and_nan():
    x, _ = blobs(n_per=2, k=2, dim=10)  # n = 4 rows of 10 dims
    assert kmeans_partition(x, 4).shape == (4,)  # k = n is allowed
    with pytest.raises(ValueError, match=r"k must be in \[2, n=4\], got 1"):
        kmeans_partition(x, 1)
    with pytest.raises(ValueError, match=r"k must be in \[2, n=4\], got 5"):
        kmeans_partition(x, 5)
    with pytest.raises(TypeError, match="k must be an int, got float"):
        kmeans_partition(x, 2.5)
    with pytest.raises(TypeError, match="k must be an int, got bool"):
        kmeans_partition(x, True)
    with pytest.raises(ValueError, match=r"x must be a 2-D \[n, d\] matrix, got shape \(4,\)"):
        kmeans_partition(np.zeros(4), 2)
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="^x contains NaN or infinite values$"):
        kmeans_partition(x, 2)
    x[0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        kmeans_partition(x, 2)


# ---------------------------------------------------------------------- overlap of RW and HS


def _rw_with_groups(gold, seed=3):
    rng = np.random.default_rng(seed)
    logits = np.eye(4)[gold % 4][:, None, :].repeat(2, axis=1) * 4 + rng.normal(0, 0.05, (len(gold), 2, 4))
    return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


@pytest.mark.slow
def test_clustering_overlap_same_structure_in_rw_and_hs():
    hs, gold = blobs(seed=1)
    rw = _rw_with_groups(gold)  # a different space with the same three groups
    out = clustering_overlap(rw, hs, 3, labels=gold)
    assert out["k"] == 3 and out["n"] == len(gold)
    assert out["rw_vs_hs"] == pytest.approx({"ami": 1.0, "nmi": 1.0, "jaccard": 1.0, "exact_match": 1.0})
    assert out["rw_vs_gold"]["exact_match"] == pytest.approx(1.0)
    assert out["hs_vs_gold"]["jaccard"] == pytest.approx(1.0)
    assert out["rw_vs_hs_chance"]["ami"] < 0.1
    # chance: 10 size-preserving permutations seeded like the clustering (seed 0 by default);
    # both partitions equal gold up to relabelling, so it is chance_agreement(gold, gold)
    assert out["rw_vs_hs_chance"] == pytest.approx(chance_agreement(gold, gold, permutations=10, seed=0))
    assert "rw_vs_gold" not in clustering_overlap(rw, hs, 3)


@pytest.mark.slow
def test_clustering_overlap_passes_its_options_on():
    hs, gold = blobs(seed=1)
    rw = _rw_with_groups(gold)
    out = clustering_overlap(rw, hs, 3, seed=2, chance_permutations=3)
    assert out["rw_vs_hs_chance"] == pytest.approx(chance_agreement(gold, gold, permutations=3, seed=2))
    sweep = overlap_sweep(rw, hs, [2, 3], labels=gold, seed=2, chance_permutations=3)
    assert [r["k"] for r in sweep] == [2, 3]
    assert sweep[1] == clustering_overlap(rw, hs, 3, labels=gold, seed=2, chance_permutations=3)
    assert sweep[1]["rw_vs_gold"]["ami"] == pytest.approx(1.0)
    default = overlap_sweep(rw, hs, [3])[0]
    assert default["rw_vs_hs_chance"] == pytest.approx(chance_agreement(gold, gold, permutations=10, seed=0))
    assert "rw_vs_gold" not in default
    with pytest.raises(ValueError, match="^ks must list at least one k$"):
        overlap_sweep(rw, hs, [])


def test_clustering_overlap_rejects_mismatched_inputs():
    hs, gold = blobs()  # 90 texts x 10 dims
    with pytest.raises(ValueError, match="different numbers of texts: 12 vs 90"):
        clustering_overlap(hs[:12], hs, 2)
    with pytest.raises(ValueError, match="labels has 5 entries for 90 texts"):
        clustering_overlap(hs, hs, 2, labels=gold[:5])
    with pytest.raises(ValueError, match=r"hs must be \[n, hidden\], got shape \(90,\)"):
        clustering_overlap(hs, hs[:, 0], 2)


class FakeTracer:
    """Traces with fixed RW/HS; records how it was called."""

    def __init__(self, rw, hs):
        self.rw, self.hs, self.calls = rw, hs, []

    def trace(self, texts, **kwargs):
        self.calls.append((texts, kwargs))
        return SimpleNamespace(rw=self.rw, hs=self.hs, prompt=kwargs["prompt"] or "none")


@pytest.mark.slow
def test_overlap_for_texts_traces_once_and_sweeps():
    hs, gold = blobs(seed=1)
    rw = _rw_with_groups(gold)
    tracer = FakeTracer(rw, hs)
    texts = tuple(f"t{i}" for i in range(len(gold)))
    runs = ClusteringRuns(seed=2, chance_permutations=3)
    out = overlap_for_texts(tracer, texts, [2, 3], labels=gold, prompt="prompteol", clustering=runs, batch_size=7)  # fmt: skip
    assert tracer.calls == [
        (list(texts), {"pooling": "last", "prompt": "prompteol", "score": DEFAULT_SCORE, "batch_size": 7})
    ]
    assert out["n_texts"] == 90 and out["prompt"] == "prompteol"
    assert (out["rw_dim"], out["hs_dim"], out["n_gold_classes"]) == (8, 10, 3)
    assert out["sweep"] == overlap_sweep(rw, hs, [2, 3], labels=gold, seed=2, chance_permutations=3)
    out = overlap_for_texts(FakeTracer(rw, hs), list(texts), [3])
    assert out["n_gold_classes"] is None and "rw_vs_gold" not in out["sweep"][0]
    assert out["sweep"][0]["rw_vs_hs_chance"] == pytest.approx(chance_agreement(gold, gold, seed=0))
    tracer = FakeTracer(rw, hs)
    overlap_for_texts(tracer, texts, [3])
    assert tracer.calls[0][1] == {"pooling": "last", "prompt": None, "score": DEFAULT_SCORE, "batch_size": 32}


@pytest.mark.slow
def test_plot_overlap_sweep_draws_every_curve(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    hs, gold = blobs(seed=1)
    res = {"sweep": overlap_sweep(_rw_with_groups(gold), hs, [2, 3], labels=gold, chance_permutations=2)}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path = plot_overlap_sweep({"toy": res}, tmp_path / "sweep.png", paper={"ami": 0.29})
    assert path == tmp_path / "sweep.png" and path.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == list(METRICS)
    for m, ax in zip(METRICS, axes):
        lines = {line.get_label(): line for line in ax.get_lines()}
        np.testing.assert_allclose(
            lines["toy: RW vs HS"].get_ydata(), [r["rw_vs_hs"][m] for r in res["sweep"]]
        )
        np.testing.assert_allclose(
            lines["toy: RW vs gold"].get_ydata(), [r["rw_vs_gold"][m] for r in res["sweep"]]
        )
        np.testing.assert_allclose(
            lines["toy: HS vs gold"].get_ydata(), [r["hs_vs_gold"][m] for r in res["sweep"]]
        )
        chance = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert len(chance) == 1
        np.testing.assert_allclose(chance[0].get_ydata(), [r["rw_vs_hs_chance"][m] for r in res["sweep"]])
        curves = [lines["toy: RW vs HS"], lines["toy: RW vs gold"], lines["toy: HS vs gold"], chance[0]]
        for line in curves:
            np.testing.assert_allclose(line.get_xdata(), [2, 3])
            assert line.get_color() == "C0"  # one colour per data set, chance included
        assert [line.get_marker() for line in curves[:3]] == ["o", "^", "s"]
        assert [line.get_linestyle() for line in curves[:3]] == ["-", "--", "--"]
        assert [line.get_alpha() for line in curves[:3]] == [None, 0.6, 0.35]
        assert ("paper (DeepSeekMoE)" in lines) == (m == "ami")
        assert ax.get_xscale() == "log" and ax.get_xlabel() == "k"
        assert ax.xaxis.get_transform().base == 2
    assert axes[0].get_legend() is not None and all(ax.get_legend() is None for ax in axes[1:])
    paper = {line.get_label(): line for line in axes[0].get_lines()}["paper (DeepSeekMoE)"]
    np.testing.assert_allclose(paper.get_ydata(), [0.29, 0.29])
    assert (paper.get_color(), paper.get_linewidth()) == ("black", 0.8)
    # layout: one row of panels, 4 inches each, 100 dpi; small fonts
    assert tuple(fig.get_size_inches()) == pytest.approx((4 * len(METRICS), 3.4)) and fig.dpi == 100
    x0 = [ax.get_position().x0 for ax in axes]
    assert x0 == sorted(x0) and len(set(x0)) == len(METRICS)  # side by side, left to right
    assert axes[0].title.get_fontsize() == 9
    assert axes[0].get_legend().get_texts()[0].get_fontsize() == 6
    plt.close(fig)
    # a sweep of one k plots too
    one = {"sweep": res["sweep"][:1]}
    figures.clear()
    plot_overlap_sweep({"toy": one}, tmp_path / "one.png")
    assert len(figures[0].axes[0].get_lines()) == 4
    plt.close(fig)


def test_table_nmi_and_matching_equal_the_label_versions():
    """The contingency-table forms (used by the streaming specialization report) give exactly
    scikit-learn's NMI and the Hungarian exact match of the labels, empty rows/columns included."""
    from sklearn.metrics import normalized_mutual_info_score

    from moee.analysis.overlap import matched_accuracy, matched_from_table, nmi_from_table

    rng = np.random.default_rng(0)
    for trial in range(200):
        n_a, n_b = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        a = rng.integers(0, n_a, 50)
        b = (a + rng.integers(0, 2, 50) * rng.integers(0, n_b, 50)) % n_b
        table = np.zeros((n_a + 2, n_b + 2), dtype=np.int64)  # two never-used labels per side
        np.add.at(table, (a, b), 1)
        assert nmi_from_table(table) == normalized_mutual_info_score(a, b), trial
        assert matched_from_table(table) == matched_accuracy(a, b), trial
    assert nmi_from_table(np.zeros((3, 3))) == 0.0 and matched_from_table(np.zeros((3, 3))) == 0.0
