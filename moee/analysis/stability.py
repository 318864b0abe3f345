"""Prompt stability of RW and HS similarities (the paper's Fig. 4).

The same sentence pairs are embedded under each of the nine stability prompts. For every method
(HS, RW) and prompt we get one similarity per pair (cosine of the last-token vectors). Spearman
correlations between those score vectors say how much a method's *ranking of pairs* moves when
only the prompt wording changes. Summary numbers, as in the paper (HS-HS 0.52, RW-RW 0.63,
RW-HS 0.51 on STS12 with DeepSeekMoE):

* ``hs_hs``: mean Spearman over the 36 pairs of distinct prompts, HS scores against HS scores;
* ``rw_rw``: the same for RW;
* ``rw_hs``: mean over all 81 (RW prompt i, HS prompt j) combinations (the paper does not say
  whether it pairs equal prompts only, so ``rw_hs_same_prompt``, the mean over the 9 i = j
  entries, is reported too).

When human scores are given, each (method, prompt) score vector's Spearman against them is
reported as well (``gold``).

Texts shared by several pairs are embedded once per prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np
from scipy.stats import spearmanr

from moee.embed.methods import DEFAULT_SCORE

__all__ = [
    "STABILITY_METHODS",
    "pair_cosines",
    "unique_pairs",
    "stability_matrix",
    "summarize_stability",
    "prompt_stability",
    "plot_stability_heatmap",
]

STABILITY_METHODS = ("hs", "rw")


def pair_cosines(emb: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Cosine similarity of each index pair ``pairs [P, 2]`` over the rows of ``emb [n, d]``."""
    emb = np.asarray(emb, dtype=np.float64)
    pairs = np.asarray(pairs)
    if emb.ndim != 2:
        raise ValueError(f"emb must be [n, d], got shape {emb.shape}")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or not np.issubdtype(pairs.dtype, np.integer):
        raise ValueError(
            f"pairs must be an integer array [P, 2], got shape {pairs.shape} dtype {pairs.dtype}"
        )
    if pairs.size and (pairs.min() < 0 or pairs.max() >= emb.shape[0]):
        raise ValueError(f"pair indices must lie in [0, {emb.shape[0]})")
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    unit = np.divide(emb, norms, out=np.zeros_like(emb), where=norms > 0)
    return np.einsum("pd,pd->p", unit[pairs[:, 0]], unit[pairs[:, 1]])


def unique_pairs(pairs: Sequence[tuple[str, str]]) -> tuple[list[str], np.ndarray]:
    """Distinct texts (first-seen order) and the ``[P, 2]`` index array of the pairs into them."""
    if len(pairs) == 0:
        raise ValueError("pairs is empty")
    index: dict[str, int] = {}
    rows = []
    for pos, pair in enumerate(pairs):
        if len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise TypeError(f"pair {pos} must be two strings, got {pair!r}")
        rows.append([index.setdefault(t, len(index)) for t in pair])
    return list(index), np.asarray(rows, dtype=np.int64)


def stability_matrix(scores: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Spearman correlation matrix between named score vectors of equal length."""
    names = list(scores)
    if len(names) < 2:
        raise ValueError("need at least two score vectors")
    mat = np.column_stack([np.asarray(scores[n], dtype=np.float64) for n in names])
    if mat.shape[0] < 3:
        raise ValueError(f"need at least 3 pairs for a rank correlation, got {mat.shape[0]}")
    rho = spearmanr(mat).statistic
    return names, np.atleast_2d(np.asarray(rho, dtype=np.float64))


def summarize_stability(names: Sequence[str], rho: np.ndarray) -> dict[str, float]:
    """HS-HS, RW-RW (distinct prompts) and RW-HS (all / same prompt) means of a matrix whose names
    are ``"<method>:<prompt>"``."""
    pos = {name: i for i, name in enumerate(names)}
    prompts = [n.split(":", 1)[1] for n in names if n.startswith("hs:")]

    def mean(pairs):
        vals = [rho[pos[a], pos[b]] for a, b in pairs]
        return float(np.mean(vals)) if vals else float("nan")

    out = {}
    for m in STABILITY_METHODS:
        out[f"{m}_{m}"] = mean([(f"{m}:{a}", f"{m}:{b}") for a, b in combinations(prompts, 2)])
    out["rw_hs"] = mean([(f"rw:{a}", f"hs:{b}") for a in prompts for b in prompts])
    out["rw_hs_same_prompt"] = mean([(f"rw:{a}", f"hs:{a}") for a in prompts])
    return out


def prompt_stability(
    embedder,
    pairs: Sequence[tuple[str, str]],
    *,
    prompts: Mapping[str, str] | None = None,
    gold: Sequence[float] | None = None,
    score: str = DEFAULT_SCORE,
    progress: bool = True,
) -> dict:
    """Embed every pair under every prompt and compute the stability matrix and its summary.

    ``embedder`` is a ``MoEEmbedder`` (its ``trace`` gives last-token HS and RW); ``prompts`` maps
    a short name to a template (default: the paper's nine, ``STABILITY_PROMPTS``).
    """
    from moee.embed.methods import combine

    if prompts is None:
        from moee.embed.prompts import STABILITY_PROMPTS

        prompts = STABILITY_PROMPTS
    if len(prompts) < 2:
        raise ValueError("need at least two prompts to measure stability")
    texts, idx = unique_pairs(pairs)
    if gold is not None and len(gold) != len(idx):
        raise ValueError(f"gold has {len(gold)} scores for {len(idx)} pairs")
    scores: dict[str, np.ndarray] = {}
    iterator = prompts.items()
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(list(iterator), desc="prompts", unit="prompt")
    for name, template in iterator:
        trace = embedder.trace(texts, pooling="last", prompt=template, score=score)
        for method in STABILITY_METHODS:
            emb = combine(trace.hs, trace.rw, method, normalize=True)
            scores[f"{method}:{name}"] = pair_cosines(emb, idx)
    ordered = {f"{m}:{p}": scores[f"{m}:{p}"] for m in STABILITY_METHODS for p in prompts}
    names, rho = stability_matrix(ordered)
    out = {
        "n_pairs": int(len(idx)),
        "n_texts": len(texts),
        # the paper's pooling, explicitly (not the model's configuration), recorded with the score
        "pooling": "last",
        "score": score,
        "prompts": dict(prompts),
        "names": names,
        "spearman": rho.round(6).tolist(),
        "summary": summarize_stability(names, rho),
    }
    if gold is not None:
        gold_arr = np.asarray(gold, dtype=np.float64)
        out["gold"] = {n: float(spearmanr(ordered[n], gold_arr).statistic) for n in names}
    return out


def plot_stability_heatmap(result: Mapping, path, *, title: str | None = None):
    """Heatmap of the (method, prompt) Spearman matrix, HS block first then RW (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rho = result["names"], np.asarray(result["spearman"])
    fig, ax = plt.subplots(figsize=(8.5, 7.5), dpi=100)
    im = ax.imshow(rho, vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    half = len(names) / 2 - 0.5
    ax.axhline(half, color="black", linewidth=1)
    ax.axvline(half, color="black", linewidth=1)
    s = result["summary"]
    ax.set_title(
        title
        or f"Spearman of pair similarities across prompts (n={result['n_pairs']} pairs)\n"
        f"HS-HS {s['hs_hs']:.2f}  RW-RW {s['rw_rw']:.2f}  RW-HS {s['rw_hs']:.2f}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
