"""Cross-layer expert pairs: which expert of layer l+1 the tokens of an expert of layer l go on to
select, beyond chance: the joint of their top-k sets against independence (excess and lift),
beside layer l+1's top-k sets shuffled against layer l's within the route sample."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _grid, _nan, _subplots, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes


class _SetJoint:
    """``joint [L - 1, E, E]``: tokens whose top-k set holds a in layer l and b in layer l + 1."""

    def __init__(self, shape: Shape):
        L, E = shape.n_layers, shape.n_experts
        self.joint = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)

    def update(self, text: TextRoutes) -> None:
        if text.selection.shape[1] > 1:
            per_layer = text.per_layer
            self.joint += np.rint(per_layer[:-1] @ per_layer[1:].transpose(0, 2, 1)).astype(np.int64)


def _set_joint(sel_a: np.ndarray, sel_b: np.ndarray, n_experts: int) -> np.ndarray:
    """``C[a, b]``: tokens whose set ``sel_a [N, k]`` holds a and whose ``sel_b [N, k]`` holds b."""
    E = n_experts
    sel_a, sel_b = np.asarray(sel_a, dtype=np.int64), np.asarray(sel_b, dtype=np.int64)
    keys = (sel_a[:, :, None] * E + sel_b[:, None, :]).ravel()
    return np.bincount(keys, minlength=E * E).reshape(E, E)


def _transition_stats(joint: np.ndarray, n_tokens: int, k: int, min_expected: float = 5.0) -> dict:
    """Excess of a cross-layer joint ``C [E, E]`` over independence ``X = load_a load_b / N``
    (the exact expectation with one layer's routes shuffled against the other's): the total
    variation ``sum |C - X| / (2 N k^2)`` and the lift ``C / X`` of pairs with ``X >= min_expected``."""
    C = joint.astype(np.float64)
    X = np.outer(C.sum(axis=1), C.sum(axis=0)) / (n_tokens * k * k) if n_tokens else np.zeros_like(C)
    excess = float(np.abs(C - X).sum() / (2 * n_tokens * k * k)) if n_tokens else 0.0
    ok = X >= min_expected
    lift = np.divide(C, X, out=np.zeros_like(C), where=X > 0)
    return {
        "excess": excess,
        "lift": lift,
        "expected": X,
        "max_lift": float(lift[ok].max()) if ok.any() else None,
    }


def _baseline(draw: Draw) -> list[tuple[float, float | None]]:
    """Per adjacent pair, the mean excess and max lift of ``permutations`` shuffles of layer l+1's
    sampled top-k sets against layer l's (exact when the sample holds the corpus)."""
    acc, rng, sample = draw.acc, draw.rng, draw.sample
    R, E, k = sample.shape[0], acc.n_experts, acc.top_k
    cross = []
    for layer in range(acc.n_layers - 1):
        stats = [
            _transition_stats(_set_joint(sample[:, layer], sample[rng.permutation(R), layer + 1], E), R, k)
            for _ in range(acc.permutations)
        ]
        draw.step()
        lifts = [st["max_lift"] for st in stats if st["max_lift"] is not None]
        cross.append(
            (float(np.mean([st["excess"] for st in stats])), float(np.mean(lifts)) if lifts else None)
        )
    return cross


def _pairs(acc, base: list, n_pairs: int = 10) -> dict:
    """Which expert of layer l+1 follows which of layer l, beyond chance: the joint of their
    top-k sets against independence (see ``_transition_stats``)."""
    L, N, k = acc.n_layers, acc.n_tokens, acc.top_k
    pairs, matrices = [], {}
    show = sorted({0, (L - 1) // 2, L - 2}) if L > 1 else []
    for layer in range(L - 1):
        st = _transition_stats(acc.tallies["cross_layer"].joint[layer], N, k)
        lift, X, C = st["lift"], st["expected"], acc.tallies["cross_layer"].joint[layer]
        ranked = np.where(X >= 5.0, lift, -np.inf)
        flat = np.argsort(-ranked, axis=None, kind="stable")[:n_pairs]
        load_a = C.sum(axis=1) / k
        top = [
            {
                "a": int(a),
                "b": int(b),
                "count": int(C[a, b]),
                "expected": round(float(X[a, b]), 3),
                "lift": round(float(lift[a, b]), 4),
                "p_b_given_a": round(float(C[a, b] / load_a[a]), 6) if load_a[a] else 0.0,
            }
            for a, b in zip(*np.unravel_index(flat, lift.shape))
            if np.isfinite(ranked[a, b])
        ]
        pairs.append(
            {
                "layers": [layer, layer + 1],
                "excess": st["excess"],
                "excess_baseline": base[layer][0],
                "max_lift": st["max_lift"],
                "max_lift_baseline": base[layer][1],
                "top_pairs": top,
            }
        )
        if layer in show:
            matrices[str(layer)] = lift.round(3).tolist()
    return {"pairs": pairs, "heatmap_layers": show, "matrices": matrices}


def _result(results: Results) -> dict:
    return _pairs(results.acc, results.baselines["cross_layer"])


def _render(report: dict, page: Page) -> str:
    cl = report["cross_layer"]
    pairs = cl["pairs"]
    if not pairs:
        return "<p>One MoE layer only: no adjacent pairs.</p>"
    xs = [p["layers"][0] for p in pairs]
    fig, ax = _subplots(1, 2, figsize=(11, 3.2))
    for a, key, title in (
        (ax[0], "excess", "excess co-selection over independence"),
        (ax[1], "max_lift", "max lift C/X"),
    ):
        a.plot(xs, _nan(p[key] for p in pairs), marker="o", label=key.replace("_", " "))
        a.plot(
            xs, _nan(p[f"{key}_baseline"] for p in pairs), linestyle="--", color="gray", label="permutation"
        )
        a.set_xlabel("layer l (vs l+1)")
        a.set_title(title, fontsize=9)
        a.legend(fontsize=7)
    parts = [
        "<p class='lead'>Which experts of layer l+1 the tokens of an expert of layer l go on to select: "
        "C[a,b] tokens with a in the top-k of layer l and b in that of l+1, against independence "
        "X[a,b] = load<sub>l</sub>[a] load<sub>l+1</sub>[b] / N. Excess = sum |C - X| / (2 N k<sup>2</sup>); "
        "lift = C/X over pairs with X &ge; 5; both beside the permutation baseline (layer l+1's routes "
        "shuffled against layer l's).</p>",
        _table(
            ["layers", "excess", "baseline", "max lift", "baseline", "top pairs a→b lift (P(b|a))"],
            [
                [
                    f"{p['layers'][0]}&rarr;{p['layers'][1]}",
                    _fmt(p["excess"]),
                    _fmt(p["excess_baseline"]),
                    _fmt(p["max_lift"], 2),
                    _fmt(p["max_lift_baseline"], 2),
                    ", ".join(
                        f"E{t['a']}&rarr;E{t['b']} {t['lift']:.2f} ({t['p_b_given_a']:.2f})"
                        for t in p["top_pairs"][:5]
                    ),
                ]
                for p in pairs
            ],
        ),
        _figure(fig, "cross-layer pairs", "Cross-layer co-selection beside its permutation baseline."),
    ]
    mats = cl.get("matrices", {})
    if mats:
        fig, axes = _grid(len(mats), cols=3, w=4.2, h=3.6)
        for a, (layer, mat) in zip(axes, mats.items()):
            m = np.asarray(mat, dtype=float)
            lg = np.log2(np.where(m > 0, m, np.nan))
            lim = max(1.0, float(np.nanmax(np.abs(lg))) if np.isfinite(lg).any() else 1.0)
            im = a.imshow(lg, cmap="RdBu_r", vmin=-lim, vmax=lim)
            a.set_title(f"layer {layer} → {int(layer) + 1}: log2 lift", fontsize=8)
            a.set_xlabel(f"expert b in layer {int(layer) + 1}", fontsize=7)
            a.set_ylabel(f"expert a in layer {layer}", fontsize=7)
            fig.colorbar(im, ax=a)
        parts.append(
            _figure(
                fig, "cross-layer lift heatmaps", "log2 C/X: red = more often together than independence."
            )
        )
    return "".join(parts)


SECTION = Section(
    "cross_layer",
    "Cross-layer expert pairs",
    result=_result,
    render=_render,
    tally=_SetJoint,
    baseline=_baseline,
    baseline_steps=lambda acc: max(acc.n_layers - 1, 0),
    draw_order=4,
    null="top-k sets of layer l+1 shuffled against layer l's within the route sample",
)
