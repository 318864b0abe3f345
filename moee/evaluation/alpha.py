r"""A label-free choice of the MoEE(sum) weight alpha, and the alpha sensitivity curve.

MoEE(sum) scores a pair of texts by ``s_a = (c_h + a c_r) / (1 + a)``, where ``c_h`` and
``c_r`` are the cosine similarities of their hidden states and routing weights. The paper's
camera-ready chooses ``a`` without labels "to maximise the Spearman correlation between the
combined similarity and its components", without publishing the exact rule. Ours:

**Rule ``spearman`` (default, maximin rank agreement).** Draw ``m`` random pairs of the
task's own (unlabelled) texts, compute ``c_h`` and ``c_r`` on them, and choose

.. math::

    a^* = \arg\max_{a \in G} \min\big(\rho_S(s_a, c_h),\ \rho_S(s_a, c_r)\big)

over the log-spaced grid ``G = {2^{k/4} : k = -16..16}`` (1/16 ... 16). The combined score
should rank pairs in a way both views agree with; maximising the *worse* of the two
agreements avoids the trivial optima ``a = 0`` (which ignores RW) and ``a -> inf`` (which
ignores HS). ``rho_S(s_a, c_h)`` falls and ``rho_S(s_a, c_r)`` rises with ``a``, so ``a*`` is
where the two agreements cross. Ties go to the grid value closest to 1 (log scale).

**Rule ``spread`` (variance matching).** ``a = std(c_h) / std(c_r)`` on the same pairs, clipped
to the grid's range: each component then contributes the same spread to ``s_a``, the
similarity-level analogue of the paper's z-scoring of each embedding.

Both rules see only texts (never labels or gold scores), and only the texts of the task
being evaluated. ``alpha_sensitivity`` then measures what a grid of alphas would have scored
on a labelled STS task, to show how much the choice matters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import rankdata, spearmanr

from moee.embed.config import EmbeddingConfig, resolve_config
from moee.embed.validation import check_choice, check_positive_int
from moee.evaluation.settings import ALPHA_RULES  # re-exported: the rules' names

#: The alpha grid: 2^(k/4) for k = -16..16, i.e. 1/16 ... 16 with 1.0 in the middle.
ALPHA_GRID: tuple[float, ...] = tuple(float(2.0 ** (k / 4)) for k in range(-16, 17))


@dataclass
class AlphaChoice:
    """The chosen weight and the evidence behind it (stored next to results)."""

    alpha: float
    rule: str
    n_texts: int
    n_pairs: int
    seed: int
    grid: list[float] = field(default_factory=list)
    rho_h: list[float] = field(default_factory=list)
    rho_r: list[float] = field(default_factory=list)
    spread_alpha: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def random_pairs(n: int, n_pairs: int, seed: int = 0) -> np.ndarray:
    """``[m, 2]`` distinct unordered pairs ``i < j`` of ``range(n)``; all pairs if there are few."""
    n = int(n)
    if n < 2:
        raise ValueError(f"need at least 2 texts to form pairs, got {n}")
    n_pairs = check_positive_int("n_pairs", n_pairs)
    total = n * (n - 1) // 2
    if total <= n_pairs:
        i, j = np.triu_indices(n, k=1)
        return np.stack([i, j], axis=1)
    rng = np.random.default_rng(seed)
    chosen: set[tuple[int, int]] = set()
    while len(chosen) < n_pairs:
        a = rng.integers(0, n, size=2 * (n_pairs - len(chosen)))
        b = rng.integers(0, n, size=a.shape[0])
        for x, y in zip(a.tolist(), b.tolist()):
            if x != y:
                chosen.add((min(x, y), max(x, y)))
                if len(chosen) == n_pairs:
                    break
    return np.array(sorted(chosen), dtype=np.int64)


def pair_similarities(
    hs: np.ndarray, rw: np.ndarray, left: np.ndarray, right: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Cosine of HS and of (flattened) RW between rows ``left[k]`` and ``right[k]``."""
    h, r = _unit(hs), _unit(rw)
    if h.shape[0] != r.shape[0]:
        raise ValueError(f"hs and rw disagree on the number of rows: {h.shape[0]} vs {r.shape[0]}")
    c_h = np.einsum("ij,ij->i", h[left], h[right])
    c_r = np.einsum("ij,ij->i", r[left], r[right])
    return c_h, c_r


def _spearman_with_ranks(x: np.ndarray, ranks_y: np.ndarray) -> float:
    rx = rankdata(x)
    rx = rx - rx.mean()
    ry = ranks_y - ranks_y.mean()
    denom = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")


def choose_alpha_from_similarities(
    c_h: np.ndarray,
    c_r: np.ndarray,
    *,
    rule: str = "spearman",
    grid: Sequence[float] = ALPHA_GRID,
) -> tuple[float, list[float], list[float], float]:
    """Apply a rule to the component similarities of unlabelled pairs.

    Returns ``(alpha, rho_h per grid value, rho_r per grid value, spread alpha)``.
    A constant component carries no ranking information: if ``c_r`` is constant alpha is 0,
    if ``c_h`` is constant alpha is the largest grid value.
    """
    check_choice("alpha rule", rule, ALPHA_RULES)
    c_h = np.asarray(c_h, dtype=np.float64)
    c_r = np.asarray(c_r, dtype=np.float64)
    grid = [float(a) for a in grid]
    if not grid or min(grid) <= 0:
        raise ValueError("grid must be non-empty and positive")
    sd_h, sd_r = float(c_h.std()), float(c_r.std())
    if sd_r == 0:
        return 0.0, [], [], 0.0
    if sd_h == 0:
        return max(grid), [], [], max(grid)
    spread = float(np.clip(sd_h / sd_r, min(grid), max(grid)))
    ranks_h, ranks_r = rankdata(c_h), rankdata(c_r)
    rho_h = [_spearman_with_ranks(c_h + a * c_r, ranks_h) for a in grid]
    rho_r = [_spearman_with_ranks(c_h + a * c_r, ranks_r) for a in grid]
    if rule == "spread":
        return spread, rho_h, rho_r, spread
    worst = np.minimum(rho_h, rho_r)
    best = np.flatnonzero(worst >= worst.max() - 1e-12)
    pick = min(best, key=lambda k: abs(np.log(grid[k])))
    return grid[pick], rho_h, rho_r, spread


def choose_alpha(
    hs: np.ndarray,
    rw: np.ndarray,
    *,
    rule: str = "spearman",
    n_pairs: int = 2000,
    seed: int = 0,
    grid: Sequence[float] = ALPHA_GRID,
) -> AlphaChoice:
    """Choose alpha for a set of texts from their pooled HS ``[n, d]`` and RW ``[n, L, E]``.

    Pairs are drawn at random (fixed ``seed``) among the ``n`` texts; nothing else is used.
    """
    hs = np.asarray(hs)
    n = hs.shape[0]
    pairs = random_pairs(n, n_pairs, seed)
    c_h, c_r = pair_similarities(hs, rw, pairs[:, 0], pairs[:, 1])
    alpha, rho_h, rho_r, spread = choose_alpha_from_similarities(c_h, c_r, rule=rule, grid=grid)
    return AlphaChoice(
        alpha=alpha,
        rule=rule,
        n_texts=int(n),
        n_pairs=int(len(pairs)),
        seed=seed,
        grid=[float(a) for a in grid] if rho_h else [],
        rho_h=rho_h,
        rho_r=rho_r,
        spread_alpha=spread,
    )


def alpha_sensitivity(
    c_h: np.ndarray, c_r: np.ndarray, gold: np.ndarray, grid: Sequence[float] = ALPHA_GRID
) -> dict[str, object]:
    """Spearman (x100) between gold scores and ``s_a`` for each ``a`` in ``grid``, plus both ends.

    ``s_a`` ranks pairs exactly as the cosine of the MoEE(sum) vectors does, so each value is
    what mteb's ``cosine_spearman`` reports for that alpha.
    """
    c_h, c_r, gold = (np.asarray(v, dtype=np.float64) for v in (c_h, c_r, gold))
    if not (c_h.shape == c_r.shape == gold.shape):
        raise ValueError(
            f"c_h, c_r and gold must have the same shape, got {c_h.shape}, {c_r.shape}, {gold.shape}"
        )
    curve = [100.0 * float(spearmanr(gold, (c_h + a * c_r) / (1 + a))[0]) for a in grid]
    return {
        "grid": [float(a) for a in grid],
        "spearman": curve,
        "hs_only": 100.0 * float(spearmanr(gold, c_h)[0]),
        "rw_only": 100.0 * float(spearmanr(gold, c_r)[0]),
    }


def _score_at(c_h: np.ndarray, c_r: np.ndarray, gold: np.ndarray, alpha: float) -> float:
    return 100.0 * float(spearmanr(gold, (c_h + alpha * c_r) / (1 + alpha))[0])


@dataclass(frozen=True)
class _StsPairs:
    """An offline STS task's test pairs: each distinct text once, and the pairs as indices into it."""

    texts: list[str]
    left: np.ndarray
    right: np.ndarray
    gold: np.ndarray

    @classmethod
    def load(cls, task: str) -> _StsPairs:
        from moee.data.offline_tasks import OFFLINE_TASKS, load_task_data

        if OFFLINE_TASKS.get(task) is None or OFFLINE_TASKS[task].family != "STS":
            raise ValueError(f"{task!r} is not an offline STS task")
        rows = load_task_data(task)["test"]
        texts = list(dict.fromkeys([r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]))
        index = {t: i for i, t in enumerate(texts)}
        left = np.array([index[r["sentence1"]] for r in rows])
        right = np.array([index[r["sentence2"]] for r in rows])
        gold = np.array([float(r["score"]) for r in rows])
        return cls(texts, left, right, gold)


def _prompt_curve(
    embedder: object, cell: EmbeddingConfig, pairs: _StsPairs, batch_size: int, seed: int
) -> dict:
    """One prompt's curve (``alpha_sensitivity``) with what each label-free rule picks and scores,
    the score at alpha 1 and the best alpha of the grid by the labels."""
    from moee.evaluation.adapter import TraceCache

    hs, rw = TraceCache(embedder, config=cell).get(pairs.texts, batch_size=batch_size)
    c_h, c_r = pair_similarities(hs, rw, pairs.left, pairs.right)
    curve = alpha_sensitivity(c_h, c_r, pairs.gold)
    chosen = {}
    for rule in ALPHA_RULES:
        a = choose_alpha(hs, rw, rule=rule, seed=seed).alpha
        chosen[rule] = {"alpha": a, "spearman": _score_at(c_h, c_r, pairs.gold, a)}
    curve["chosen"] = chosen
    curve["at_alpha_1"] = _score_at(c_h, c_r, pairs.gold, 1.0)
    curve["best_alpha_with_labels"] = float(curve["grid"][int(np.argmax(curve["spearman"]))])
    return curve


def _plot_curve(ax: Any, curve: dict, color: str, label: str) -> None:
    """A prompt's curve in its colour: its HS-only (dotted) and RW-only (dashed) ends, and the rules'
    picks (circle: spearman, square: spread)."""
    ax.plot(curve["grid"], curve["spearman"], color=color, marker=".", label=f"MoEE sum, prompt={label}")
    ax.axhline(curve["hs_only"], color=color, ls=":", lw=1)
    ax.axhline(curve["rw_only"], color=color, ls="--", lw=1)
    for rule, marker in zip(ALPHA_RULES, ("o", "s")):
        c = curve["chosen"][rule]
        ax.plot([c["alpha"]], [c["spearman"]], marker=marker, color=color, ms=8, mfc="none", ls="none")


def _label_axes(ax: Any, task: str, model: str) -> None:
    """The axes, title (``model`` as name@revision) and legend of the sensitivity plot."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("alpha (weight of RW similarity)")
    ax.set_ylabel(f"{task} Spearman x100")
    ax.set_title(
        f"MoEE(sum) alpha sensitivity, {model}\n"
        "dotted: HS only, dashed: RW only; circle: spearman rule, square: spread rule (label-free)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)


def write_alpha_sensitivity(
    embedder: object,
    out_dir: str | Path,
    *,
    config: EmbeddingConfig | None = None,
    prompts: Sequence[str | Sequence[str] | None] | None = None,
    task: str = "lee_sts",
    batch_size: int = 32,
    seed: int = 0,
) -> dict[str, Path]:
    """The alpha sensitivity curve of an offline STS task: ``alpha_sensitivity.json`` and ``.png``.

    For every prompt: the task's Spearman (x100) for each alpha of ``ALPHA_GRID``, the HS-only
    and RW-only ends, and the alphas both label-free rules pick from the task's texts (with
    the score each would get). The features are ``config``'s (pooling, score, recipe options; by
    default the model's saved configuration, else the library's: ``resolve_config``) under each
    of ``prompts`` (default: ``config``'s prompt). Rerun with ``moee evaluate --alpha-sensitivity``.
    """
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moee.evaluation.adapter import model_config_of, model_identity

    if config is None:
        config = resolve_config(model_config_of(embedder))
    if prompts is None:
        prompts = [config.prompt]

    pairs = _StsPairs.load(task)
    name, revision = model_identity(embedder)
    doc: dict[str, object] = {
        "task": task,
        "model": name,
        "revision": revision,
        "pooling": config.pooling,
        "score": config.score,
        "config": {k: v for k, v in config.to_dict().items() if k not in ("method", "alpha", "normalize")},
        "n_pairs": len(pairs.gold),
        "n_texts": len(pairs.texts),
        "prompts": {},
    }
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, prompt in enumerate(prompts):
        cell = config.replace(prompt=prompt)
        curve = _prompt_curve(embedder, cell, pairs, batch_size, seed)
        doc["prompts"][cell.prompt_label] = curve
        _plot_curve(ax, curve, f"C{k}", cell.prompt_label)
    _label_axes(ax, task, f"{name}@{revision}")
    fig.tight_layout()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, js = out_dir / "alpha_sensitivity.png", out_dir / "alpha_sensitivity.json"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    js.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return {"alpha sensitivity plot": png, "alpha sensitivity data": js}
