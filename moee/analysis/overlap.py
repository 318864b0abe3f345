"""Clustering overlap between RW and HS embeddings of the same texts (the paper's Table 1).

The paper clusters the same inputs twice, once by routing weights (RW) and once by hidden states
(HS), and reports AMI/NMI ~0.29, Jaccard 0.06 and exact match 45.54% for DeepSeekMoE, without
publishing k, the data or the Jaccard recipe. Our definitions:

* clustering: scikit-learn ``KMeans(n_clusters=k, n_init=10, random_state=seed)`` on L2-normalised
  rows (cosine geometry, the geometry every similarity in this project uses); RW is flattened to
  ``[n, L*E]`` in layer order.
* AMI / NMI: ``sklearn.metrics.adjusted_mutual_info_score`` / ``normalized_mutual_info_score``
  (arithmetic normalisation, scikit-learn's default).
* Jaccard (pair counting): over all unordered pairs of texts, ``|pairs together in both| /
  |pairs together in at least one|``. Computed from the contingency table through
  ``sklearn.metrics.cluster.pair_confusion_matrix`` (O(n + k^2), never O(n^2) pairs). Two
  partitions made only of singletons share no "together" pair; they are identical, so 1.0.
* exact match: the fraction of texts whose cluster in A maps to their cluster in B under the
  one-to-one cluster matching that maximises agreement (``scipy.optimize.linear_sum_assignment`` on
  the contingency table; unequal cluster counts leave the extra clusters unmatched).
* chance: the same four numbers between A and a random permutation of B's labels (cluster sizes
  kept), averaged over a few permutations, so a Jaccard of 0.06 can be read against what k alone
  produces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_mutual_info_score, mutual_info_score, normalized_mutual_info_score
from sklearn.metrics.cluster import contingency_matrix, pair_confusion_matrix

from moee.embed.methods import DEFAULT_SCORE

__all__ = [
    "pair_jaccard",
    "matched_accuracy",
    "matched_from_table",
    "nmi_from_table",
    "partition_agreement",
    "chance_agreement",
    "kmeans_partition",
    "clustering_overlap",
    "overlap_sweep",
    "flatten_rw",
    "ClusteringRuns",
    "overlap_for_texts",
    "plot_overlap_sweep",
]

METRICS = ("ami", "nmi", "jaccard", "exact_match")


def _labels(a: Sequence | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of cluster labels, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    return arr


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = _labels(a, "labels_a"), _labels(b, "labels_b")
    if a.shape != b.shape:
        raise ValueError(f"the two partitions label different numbers of items: {a.size} vs {b.size}")
    return a, b


def pair_jaccard(labels_a, labels_b) -> float:
    """Pair-counting Jaccard: pairs co-clustered in both / pairs co-clustered in either."""
    a, b = _pair(labels_a, labels_b)
    (_, only_b), (only_a, both) = pair_confusion_matrix(a, b)
    union = int(both) + int(only_a) + int(only_b)
    return 1.0 if union == 0 else float(both) / union


def matched_from_table(table: np.ndarray) -> float:
    """Exact match under the optimal one-to-one (Hungarian) matching of a contingency table's rows
    to its columns (0.0 for an empty table); streaming callers keep only the table."""
    table = np.asarray(table)
    total = table.sum()
    if total <= 0:
        return 0.0
    rows, cols = linear_sum_assignment(table, maximize=True)
    return float(table[rows, cols].sum()) / float(total)


def _margin_entropy(margin: np.ndarray) -> float:
    """scikit-learn's label entropy computed from the label counts (the same operations, so
    ``nmi_from_table`` equals ``normalized_mutual_info_score`` bit for bit)."""
    pi = margin[margin > 0]
    if pi.size <= 1:
        return 0.0
    pi_sum = np.sum(pi)
    return float(-np.sum((pi / pi_sum) * (np.log(pi) - math.log(pi_sum))))


def nmi_from_table(table: np.ndarray) -> float:
    """``normalized_mutual_info_score`` (arithmetic normalisation) of the labels whose contingency
    table this is, from the table alone: memory O(table), not O(items). 0.0 for an empty table;
    1.0 when both sides have a single label (scikit-learn's convention)."""
    table = np.asarray(table, dtype=np.float64)
    if table.sum() <= 0:
        return 0.0
    rows, cols = table.sum(1), table.sum(0)
    if (rows > 0).sum() == 1 and (cols > 0).sum() == 1:
        return 1.0
    # without the empty rows and columns, as scikit-learn's own table of the labels has none
    mi = float(mutual_info_score(None, None, contingency=table[rows > 0][:, cols > 0]))
    if mi == 0:
        return 0.0
    return float(mi / ((_margin_entropy(rows) + _margin_entropy(cols)) / 2))


def matched_accuracy(labels_a, labels_b) -> float:
    """Exact match after the optimal one-to-one (Hungarian) matching of A's clusters to B's."""
    a, b = _pair(labels_a, labels_b)
    return matched_from_table(contingency_matrix(a, b))


def partition_agreement(labels_a, labels_b) -> dict[str, float]:
    """AMI, NMI, pair Jaccard and Hungarian exact match between two partitions of the same items."""
    a, b = _pair(labels_a, labels_b)
    return {
        "ami": float(adjusted_mutual_info_score(a, b)),
        "nmi": float(normalized_mutual_info_score(a, b)),
        "jaccard": pair_jaccard(a, b),
        "exact_match": matched_accuracy(a, b),
    }


def chance_agreement(labels_a, labels_b, *, permutations: int = 10, seed: int = 0) -> dict[str, float]:
    """Mean agreement between A and randomly permuted B (same cluster sizes): the independence level."""
    a, b = _pair(labels_a, labels_b)
    if permutations < 1:
        raise ValueError(f"permutations must be >= 1, got {permutations}")
    rng = np.random.default_rng(seed)
    runs = [partition_agreement(a, rng.permutation(b)) for _ in range(permutations)]
    return {m: float(np.mean([r[m] for r in runs])) for m in METRICS}


def flatten_rw(rw: np.ndarray) -> np.ndarray:
    """``[n, L, E]`` routing weights to ``[n, L*E]`` in layer order (2-D input passes through)."""
    rw = np.asarray(rw)
    if rw.ndim == 3:
        return rw.reshape(rw.shape[0], -1)
    if rw.ndim == 2:
        return rw
    raise ValueError(f"rw must be [n, L, E] or [n, d], got shape {rw.shape}")


def kmeans_partition(
    x: np.ndarray, k: int, *, seed: int = 0, n_init: int = 10, normalize: bool = True
) -> np.ndarray:
    """k-means labels of the rows of ``x`` (L2-normalised first unless ``normalize=False``)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"x must be a 2-D [n, d] matrix, got shape {x.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 2 <= k <= x.shape[0]:
        raise ValueError(f"k must be in [2, n={x.shape[0]}], got {k}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values")
    if normalize:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    model = KMeans(n_clusters=int(k), n_init=n_init, random_state=seed)
    return model.fit_predict(x).astype(np.int64)


def clustering_overlap(
    rw: np.ndarray,
    hs: np.ndarray,
    k: int,
    *,
    labels: Sequence | None = None,
    seed: int = 0,
    n_init: int = 10,
    chance_permutations: int = 10,
) -> dict:
    """Cluster RW and HS of the same texts with k-means and compare the two partitions.

    Returns ``{"k", "n", "rw_vs_hs", "rw_vs_hs_chance", and, when gold labels are given,
    "rw_vs_gold", "hs_vs_gold"}``, each a dict of ``METRICS``.
    """
    rw2, hs = flatten_rw(rw), np.asarray(hs)
    if hs.ndim != 2:
        raise ValueError(f"hs must be [n, hidden], got shape {hs.shape}")
    if rw2.shape[0] != hs.shape[0]:
        raise ValueError(f"rw and hs describe different numbers of texts: {rw2.shape[0]} vs {hs.shape[0]}")
    if labels is not None and len(labels) != hs.shape[0]:
        raise ValueError(f"labels has {len(labels)} entries for {hs.shape[0]} texts")
    part_rw = kmeans_partition(rw2, k, seed=seed, n_init=n_init)
    part_hs = kmeans_partition(hs, k, seed=seed, n_init=n_init)
    out = {
        "k": int(k),
        "n": int(hs.shape[0]),
        "rw_vs_hs": partition_agreement(part_rw, part_hs),
        "rw_vs_hs_chance": chance_agreement(part_rw, part_hs, permutations=chance_permutations, seed=seed),
    }
    if labels is not None:
        gold = np.asarray(labels)
        out["rw_vs_gold"] = partition_agreement(part_rw, gold)
        out["hs_vs_gold"] = partition_agreement(part_hs, gold)
    return out


def overlap_sweep(
    rw: np.ndarray,
    hs: np.ndarray,
    ks: Sequence[int],
    *,
    labels: Sequence | None = None,
    seed: int = 0,
    n_init: int = 10,
    chance_permutations: int = 10,
) -> list[dict]:
    """``clustering_overlap`` for every k in ``ks`` (same texts, same seed)."""
    if not ks:
        raise ValueError("ks must list at least one k")
    return [
        clustering_overlap(
            rw, hs, k, labels=labels, seed=seed, n_init=n_init, chance_permutations=chance_permutations
        )
        for k in ks
    ]


@dataclass(frozen=True)
class ClusteringRuns:
    """How every k of a sweep is clustered and its chance level drawn: k-means with ``n_init``
    restarts seeded with ``seed``, and the chance agreement averaged over ``chance_permutations``
    size-preserving permutations drawn from the same seed (the keywords of ``clustering_overlap``)."""

    seed: int = 0
    n_init: int = 10
    chance_permutations: int = 10


def overlap_for_texts(
    embedder,
    texts: Sequence[str],
    ks: Sequence[int],
    *,
    labels: Sequence | None = None,
    prompt: str | None = None,
    clustering: ClusteringRuns | None = None,
    batch_size: int = 32,
    score: str = DEFAULT_SCORE,
) -> dict:
    """Trace ``texts`` once (last-token HS and RW under ``score``, by default the routers' own
    scoring rule) and run ``overlap_sweep`` over ``ks`` as ``clustering`` says (default:
    ``ClusteringRuns()``)."""
    runs = clustering if clustering is not None else ClusteringRuns()
    trace = embedder.trace(list(texts), pooling="last", prompt=prompt, score=score, batch_size=batch_size)
    sweep = overlap_sweep(
        trace.rw,
        trace.hs,
        ks,
        labels=labels,
        seed=runs.seed,
        n_init=runs.n_init,
        chance_permutations=runs.chance_permutations,
    )
    return {
        "n_texts": len(texts),
        "prompt": trace.prompt,
        # the paper's pooling, explicitly (not the model's configuration), recorded with the score
        "pooling": "last",
        "score": score,
        "rw_dim": int(trace.rw.shape[1] * trace.rw.shape[2]),
        "hs_dim": int(trace.hs.shape[1]),
        "n_gold_classes": None if labels is None else len(set(labels)),
        "sweep": sweep,
    }


def plot_overlap_sweep(results: dict[str, dict], path, *, paper: dict[str, float] | None = None):
    """One panel per metric: RW-vs-HS (solid), chance (dotted) and RW/HS vs gold (dashed) against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4), dpi=100)
    for m, ax in zip(METRICS, axes):
        for ci, (name, res) in enumerate(results.items()):
            colour = f"C{ci}"
            ks = [r["k"] for r in res["sweep"]]
            ax.plot(
                ks,
                [r["rw_vs_hs"][m] for r in res["sweep"]],
                marker="o",
                color=colour,
                label=f"{name}: RW vs HS",
            )
            ax.plot(ks, [r["rw_vs_hs_chance"][m] for r in res["sweep"]], linestyle=":", color=colour)
            if "rw_vs_gold" in res["sweep"][0]:
                ax.plot(
                    ks,
                    [r["rw_vs_gold"][m] for r in res["sweep"]],
                    linestyle="--",
                    marker="^",
                    color=colour,
                    alpha=0.6,
                    label=f"{name}: RW vs gold",
                )
                ax.plot(
                    ks,
                    [r["hs_vs_gold"][m] for r in res["sweep"]],
                    linestyle="--",
                    marker="s",
                    color=colour,
                    alpha=0.35,
                    label=f"{name}: HS vs gold",
                )
        if paper and m in paper:
            ax.axhline(paper[m], color="black", linewidth=0.8, label="paper (DeepSeekMoE)")
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("k")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
