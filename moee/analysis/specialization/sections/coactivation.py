"""Expert co-activation within a token's top-k: of the tokens that select expert a, the fraction
that also select b, beside independent choice with the observed loads (a permutation of routes
against tokens keeps each token's set, so it is no baseline here)."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _plt, _table
from moee.analysis.specialization.sections.base import Results, Section, Shape, TextRoutes

#: Experts shown in the co-activation heatmaps (the most loaded ones of each layer).
HEATMAP_EXPERTS = 16


class _Coactivation:
    """``counts [L, E, E]``: tokens whose top-k holds both experts (the diagonal: the load)."""

    def __init__(self, shape: Shape):
        L, E = shape.n_layers, shape.n_experts
        self.counts = np.zeros((L, E, E), dtype=np.int64)

    def update(self, text: TextRoutes) -> None:
        per_layer = text.per_layer
        self.counts += np.rint(per_layer @ per_layer.transpose(0, 2, 1)).astype(np.int64)


def _pairs(acc, n_pairs: int) -> dict:
    L, E, k = acc.n_layers, acc.n_experts, acc.top_k
    layers, heat_experts, heatmaps, indep_maps = [], [], [], []
    for layer in range(L):
        c = acc.tallies["coactivation"].counts[layer].astype(np.float64)
        diag = np.diag(c).copy()
        ratio = np.divide(c, diag[:, None], out=np.zeros_like(c), where=diag[:, None] > 0)
        np.fill_diagonal(ratio, 0.0)
        flat = np.argsort(-ratio, axis=None, kind="stable")[:n_pairs]
        pairs = [
            {"i": int(i), "j": int(j), "ratio": float(ratio[i, j]), "n_i": int(diag[i])}
            for i, j in zip(*np.unravel_index(flat, ratio.shape))
            if ratio[i, j] > 0
        ]
        q = acc.load[layer] / max(1, acc.load[layer].sum())
        indep = (k - 1) * q[None, :] / np.maximum(1.0 - q[:, None], 1e-12)
        np.fill_diagonal(indep, 0.0)
        off = ~np.eye(E, dtype=bool) & (diag[:, None] > 0) & (indep > 0)
        top_e = np.argsort(-acc.load[layer], kind="stable")[: min(E, HEATMAP_EXPERTS)]
        heat_experts.append([int(e) for e in top_e])
        heatmaps.append(ratio[np.ix_(top_e, top_e)].round(4).tolist())
        indep_maps.append(indep[np.ix_(top_e, top_e)].round(4).tolist())
        layers.append(
            {
                "layer": layer,
                "max_ratio": float(ratio.max()),
                "max_ratio_baseline": float(indep.max()),
                "mean_lift": float((ratio[off] / indep[off]).mean()) if off.any() else None,
                "top_pairs": pairs,
            }
        )
    return {
        "uniform": (k - 1) / (E - 1) if E > 1 else 0.0,
        "top_experts": heat_experts,
        "heatmaps": heatmaps,
        "independent_heatmaps": indep_maps,
        "by_layer": layers,
        "matrix_layers": sorted({0, L // 2, L - 1}),
        "matrices": {
            str(layer): np.divide(
                acc.tallies["coactivation"].counts[layer],
                np.diag(acc.tallies["coactivation"].counts[layer])[:, None],
                out=np.zeros((E, E)),
                where=np.diag(acc.tallies["coactivation"].counts[layer])[:, None] > 0,
            )
            .round(4)
            .tolist()
            for layer in sorted({0, L // 2, L - 1})
        },
    }


def _result(results: Results) -> dict:
    return _pairs(results.acc, results.options.n_coactivation_pairs)


def _render(report: dict, page: Page) -> str:
    co = report["coactivation"]
    by_layer = co["by_layer"]
    has_base = bool(by_layer) and "max_ratio_baseline" in by_layer[0]
    headers = [
        "layer",
        "max ratio",
        *(["independent max", "mean lift"] if has_base else []),
        "top pairs (Ei&rarr;Ej ratio)",
    ]
    rows = [
        [
            c["layer"],
            _fmt(c["max_ratio"]),
            *([_fmt(c["max_ratio_baseline"]), _fmt(c["mean_lift"], 2)] if has_base else []),
            ", ".join(f"E{p['i']}&rarr;E{p['j']} {p['ratio']:.2f}" for p in c["top_pairs"][:6]),
        ]
        for c in by_layer
    ]
    parts = [
        "<p class='lead'>Of the tokens that select expert a, the fraction that also select b, "
        "N(a,b)/N(a), over all pairs within a token's top-k. Uniform independent choice of k experts "
        f"gives (k-1)/(E-1) = {co['uniform']:.4f}; the independent baseline with the real loads "
        "q = load/(N k) is (k-1) q<sub>b</sub> / (1 - q<sub>a</sub>) (lift = ratio over it). A "
        "permutation of routes against tokens would keep each token's set, so it is no baseline here.</p>",
        _table(headers, rows, raw_headers=True),
    ]
    if co.get("heatmaps"):
        parts.append(_coactivation_top_experts(co, page, report["summary"]["n_layers"]))
    elif co.get("matrices"):
        plt = _plt()
        mats = co["matrices"]
        fig, axes = plt.subplots(1, len(mats), figsize=(4 * len(mats), 3.6), squeeze=False)
        for ax, (layer, mat) in zip(axes[0], mats.items()):
            off = np.asarray(mat, dtype=float)
            np.fill_diagonal(off, np.nan)  # the diagonal is 1 by definition and would swamp the scale
            im = ax.imshow(off, cmap="Blues", vmin=0)
            ax.set_title(f"layer {layer}: N(Ei,Ej)/N(Ei), diagonal blank", fontsize=8)
            ax.set_xlabel("Ej")
            ax.set_ylabel("Ei")
            fig.colorbar(im, ax=ax)
        parts.append(_figure(fig, "co-activation", "Co-activation N(Ei,Ej)/N(Ei), diagonal blank."))
    return "".join(parts)


def _coactivation_top_experts(co: dict, page: Page, L: int) -> str:
    """Heatmaps of P(b|a) and its lift over the independent baseline for the most loaded experts."""
    plt = _plt()
    show = [layer for layer in page.layers_to_show(L) if layer < len(co["heatmaps"])]
    fig, axes = plt.subplots(2, len(show), figsize=(4 * len(show), 7), squeeze=False)
    for j, layer in enumerate(show):
        top = co["top_experts"][layer]
        heat = np.asarray(co["heatmaps"][layer], dtype=float)
        base = np.asarray(co["independent_heatmaps"][layer], dtype=float)
        np.fill_diagonal(heat, np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            lift = np.log2(np.divide(heat, base, out=np.full_like(heat, np.nan), where=base > 0))
        lift[~np.isfinite(lift)] = np.nan
        for i, (mat, title, cmap) in enumerate(
            ((heat, "P(b|a)", "Blues"), (lift, "log2 P(b|a)/independent", "RdBu_r"))
        ):
            a = axes[i][j]
            kw = {"vmin": 0} if i == 0 else {"vmin": -2, "vmax": 2}
            im = a.imshow(mat, cmap=cmap, **kw)
            a.set_xticks(range(len(top)), [str(t) for t in top], fontsize=6, rotation=90)
            a.set_yticks(range(len(top)), [str(t) for t in top], fontsize=6)
            a.set_title(f"layer {layer}: {title}", fontsize=8)
            a.set_xlabel("expert b", fontsize=7)
            a.set_ylabel("expert a", fontsize=7)
            fig.colorbar(im, ax=a)
    return _figure(
        fig,
        "co-activation of the most loaded experts",
        "The most loaded experts (most loaded first): P(b|a) (diagonal blank) and its log2 lift over the "
        "independent baseline (k-1) q<sub>b</sub> / (1 - q<sub>a</sub>).",
    )


SECTION = Section(
    "coactivation",
    "Expert co-activation",
    result=_result,
    render=_render,
    tally=_Coactivation,
    null="none by permutation (shuffling routes keeps each token's set); "
    "reference (k-1)/(E-1) is uniform independent choice and (k-1) q_b / (1 - q_a) "
    "independent choice with the observed loads q",
)
