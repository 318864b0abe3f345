"""Clustering-overlap metrics against scikit-learn/scipy and hand-made partitions."""

from itertools import combinations

import numpy as np
import pytest
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

from moee.analysis.overlap import (
    chance_agreement,
    clustering_overlap,
    kmeans_partition,
    matched_accuracy,
    overlap_sweep,
    pair_jaccard,
    partition_agreement,
)


def brute_jaccard(a, b):
    both = either = 0
    for i, j in combinations(range(len(a)), 2):
        in_a, in_b = a[i] == a[j], b[i] == b[j]
        both += in_a and in_b
        either += in_a or in_b
    return both / either if either else 1.0


def test_identical_partitions_score_one_even_when_relabelled():
    a = np.array([0, 0, 1, 1, 2, 2, 2, 3])
    b = np.array([7, 7, 5, 5, 9, 9, 9, 1])  # same partition, other label names
    scores = partition_agreement(a, b)
    assert scores == pytest.approx({"ami": 1.0, "nmi": 1.0, "jaccard": 1.0, "exact_match": 1.0})


def test_ami_nmi_match_sklearn_on_random_partitions():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 6, 300), rng.integers(0, 4, 300)
    scores = partition_agreement(a, b)
    assert scores["ami"] == pytest.approx(adjusted_mutual_info_score(a, b))
    assert scores["nmi"] == pytest.approx(normalized_mutual_info_score(a, b))


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
    chance = chance_agreement(a, b, permutations=3)
    assert chance["jaccard"] == pytest.approx(scores["jaccard"], abs=0.01)


def test_jaccard_hand_made():
    # together in a: {0,1}, {2,3}; in b: {0,1}, {0,2}, {1,2}; both: {0,1}; either: 4 pairs
    assert pair_jaccard([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(1 / 4)
    # a: all 6 pairs together; b: {0,1}, {2,3}: both 2, either 6
    assert pair_jaccard([0, 0, 0, 0], [0, 0, 1, 1]) == pytest.approx(2 / 6)
    # only singletons in both: identical partitions
    assert pair_jaccard([0, 1, 2], [5, 6, 7]) == 1.0
    # singletons vs one cluster: nothing together in both
    assert pair_jaccard([0, 1, 2], [0, 0, 0]) == 0.0


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


@pytest.mark.parametrize(
    "a,b,exc",
    [([0, 1, 2], [0, 1], ValueError), ([[0, 1]], [[0, 1]], ValueError), ([], [], ValueError)],
)
def test_bad_partitions_raise(a, b, exc):
    with pytest.raises(exc):
        partition_agreement(a, b)


def blobs(n_per=30, k=3, dim=10, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1, (k, dim)) * 5
    x = np.concatenate([c + rng.normal(0, 0.1, (n_per, dim)) for c in centers])
    return x, np.repeat(np.arange(k), n_per)


def test_kmeans_partition_recovers_blobs_and_is_deterministic():
    x, gold = blobs()
    p1 = kmeans_partition(x, 3, seed=4)
    assert np.array_equal(p1, kmeans_partition(x, 3, seed=4))
    assert partition_agreement(p1, gold)["ami"] == pytest.approx(1.0)


def test_kmeans_partition_rejects_bad_k_and_nan():
    x, _ = blobs()
    with pytest.raises(ValueError, match="k must be"):
        kmeans_partition(x, 1)
    with pytest.raises(TypeError):
        kmeans_partition(x, 2.5)
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        kmeans_partition(x, 2)


def test_clustering_overlap_same_structure_in_rw_and_hs():
    hs, gold = blobs(seed=1)
    rng = np.random.default_rng(3)
    # a different space with the same three groups: RW [n, L=2, E=4] probability blocks
    logits = np.eye(4)[gold % 4][:, None, :].repeat(2, axis=1) * 4 + rng.normal(0, 0.05, (len(gold), 2, 4))
    rw = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    out = clustering_overlap(rw, hs, 3, labels=gold)
    assert out["k"] == 3 and out["n"] == len(gold)
    assert out["rw_vs_hs"]["ami"] == pytest.approx(1.0)
    assert out["rw_vs_gold"]["exact_match"] == pytest.approx(1.0)
    assert out["hs_vs_gold"]["jaccard"] == pytest.approx(1.0)
    assert out["rw_vs_hs_chance"]["ami"] < 0.1
    sweep = overlap_sweep(rw, hs, [2, 3], labels=gold)
    assert [r["k"] for r in sweep] == [2, 3]


def test_clustering_overlap_rejects_mismatched_inputs():
    hs, gold = blobs()
    with pytest.raises(ValueError, match="different numbers of texts"):
        clustering_overlap(hs[:10], hs, 2)
    with pytest.raises(ValueError, match="labels"):
        clustering_overlap(hs, hs, 2, labels=gold[:5])
