"""Expert co-activation within a token's top-k: of the tokens that select expert a, the fraction
that also select b, N(a, b) / N(a), over every pair of a token's top-k set.

Its baseline is the same statistic (the maximum over pairs) on a null sample: each layer's
selected experts shuffled across tokens, so the experts a token holds are independent of one
another but every expert keeps its load and every token k distinct experts, with as many tokens
as the corpus. The maximum of ~E^2 noisy ratios is far above the largest expected ratio, so only
the statistic itself computed on such a sample is its baseline. Beside it, the closed-form
expectation of each ratio under independent choice with the observed loads, (k - 1) q_b / (1 - q_a),
is the reference of the heatmaps' lift."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _subplots, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes

#: Experts shown in the co-activation heatmaps (the most loaded ones of each layer).
HEATMAP_EXPERTS = 16

#: Heatmap cells whose expected count under independence, N(a) (k - 1) q_b / (1 - q_a), is below
#: this are masked (``None``): their ratio is a handful of tokens.
MIN_EXPECTED = 5.0

#: Rounds of swaps that give a token that drew an expert twice another token's entry (the null),
#: the random partner entries tried per repeat and round, and the repeats handled at once.
_REPAIR_ROUNDS, _CANDIDATES, _REPAIR_BLOCK = 200, 8, 1 << 14

#: Tokens per block when co-occurrence counts are tallied from sets (bounds the temporaries).
_PAIR_BLOCK = 1 << 15


class _Coactivation:
    """``counts [L, E, E]``: tokens whose top-k holds both experts (the diagonal: the load)."""

    def __init__(self, shape: Shape):
        L, E = shape.n_layers, shape.n_experts
        self.counts = np.zeros((L, E, E), dtype=np.int64)

    def update(self, text: TextRoutes) -> None:
        per_layer = text.per_layer
        self.counts += np.rint(per_layer @ per_layer.transpose(0, 2, 1)).astype(np.int64)


def _ratios(counts: np.ndarray) -> np.ndarray:
    """``N(a, b) / N(a)`` of a co-occurrence table ``counts [E, E]`` (diagonal: the loads), 0 on
    the diagonal and for experts never selected."""
    c = np.asarray(counts, dtype=np.float64)
    diag = np.diag(c).copy()
    ratio = np.divide(c, diag[:, None], out=np.zeros_like(c), where=diag[:, None] > 0)
    np.fill_diagonal(ratio, 0.0)
    return ratio


def _set_counts(sets: np.ndarray, n_experts: int) -> np.ndarray:
    """The co-occurrence table ``[E, E]`` of top-k sets ``sets [N, k]`` (entries ``-1``: none)."""
    E = n_experts
    out = np.zeros(E * E, dtype=np.int64)
    sets = np.asarray(sets, dtype=np.int64)
    for t0 in range(0, sets.shape[0], _PAIR_BLOCK):
        block = sets[t0 : t0 + _PAIR_BLOCK]
        a, b = block[:, :, None], block[:, None, :]
        keys = (a * E + b)[(a >= 0) & (b >= 0)]
        out += np.bincount(keys.ravel(), minlength=E * E)
    return out.reshape(E, E)


def _null_sets(sets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``sets [N, k]`` with their entries shuffled across tokens: every expert keeps its load, and
    a token that drew an expert twice swaps the repeat with a random entry of another token that
    lacks it (and whose entry the first token lacks), until every token holds k distinct experts.
    The observed sets are such an arrangement, so one exists; an entry still repeated after
    ``_REPAIR_ROUNDS`` rounds is dropped (``-1``)."""
    N, k = sets.shape
    flat = np.asarray(sets, dtype=np.int64).ravel()[rng.permutation(N * k)]
    out = flat.reshape(N, k)
    earlier = np.tri(k, k, -1, dtype=bool)  # [i, j]: j < i
    rows = np.arange(N)
    for round_ in range(_REPAIR_ROUNDS + 1):
        sub = out[rows]
        repeated = ((sub[:, :, None] == sub[:, None, :]) & earlier).any(axis=2)  # repeats an earlier slot
        bad = repeated.any(axis=1)
        rows, repeated = rows[bad], repeated[bad]
        if not rows.size or round_ == _REPAIR_ROUNDS:
            break
        for b0 in range(0, rows.size, _REPAIR_BLOCK):
            mrow = rows[b0 : b0 + _REPAIR_BLOCK]
            moved = mrow * k + repeated[b0 : b0 + _REPAIR_BLOCK].argmax(axis=1)  # one repeat a row
            value = flat[moved]
            cand = rng.integers(0, N * k, size=(mrow.size, _CANDIDATES))
            crow, cval = cand // k, flat[cand]
            ok = (crow != mrow[:, None]) & ~(out[crow] == value[:, None, None]).any(axis=2)
            ok &= ~(out[mrow][:, None, :] == cval[:, :, None]).any(axis=2)
            has = ok.any(axis=1)
            pick = cand[np.arange(mrow.size), ok.argmax(axis=1)][has]
            moved, prow = moved[has], crow[np.arange(mrow.size), ok.argmax(axis=1)][has]
            # one swap per row a block: two swaps into one row could repeat an expert again
            used, counts = np.unique(np.concatenate([moved // k, prow]), return_counts=True)
            once = np.isin(moved // k, used[counts == 1]) & np.isin(prow, used[counts == 1])
            moved, pick = moved[once], pick[once]
            flat[moved], flat[pick] = flat[pick], flat[moved].copy()
    if rows.size:
        out[rows] = np.where(repeated, -1, out[rows])
    return out


def _baseline(draw: Draw) -> list[float]:
    """Per layer, the mean over ``permutations`` draws of ``max_(a != b) N(a, b) / N(a)`` on a null
    sample of as many tokens as the corpus: the sampled sets (permuted when the corpus fits in the
    sample, else drawn with replacement, in blocks of the sample's size) shuffled by ``_null_sets``."""
    acc, rng, sample = draw.acc, draw.rng, draw.sample
    R, L, E, N = sample.shape[0], acc.n_layers, acc.n_experts, acc.n_tokens
    out = np.zeros((acc.permutations, L))
    for i in range(acc.permutations):
        if R:
            for layer in range(L):
                counts = np.zeros((E, E), dtype=np.int64)
                for t0 in range(0, N, R):
                    n = min(R, N - t0)
                    rows = rng.permutation(R) if N <= R else rng.integers(0, R, n)
                    counts += _set_counts(_null_sets(sample[rows, layer], rng), E)
                out[i, layer] = _ratios(counts).max()
        draw.step()
    return [float(v) for v in out.mean(axis=0)]


def _pairs(acc, n_pairs: int, baseline: list[float]) -> dict:
    L, E, k = acc.n_layers, acc.n_experts, acc.top_k
    layers, heat_experts, heatmaps, indep_maps = [], [], [], []
    for layer in range(L):
        c = acc.tallies["coactivation"].counts[layer]
        diag = np.diag(c).astype(np.float64)
        ratio = _ratios(c)
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
        # the most loaded experts, most loaded first (ties: the lower id)
        top_e = np.argsort(-acc.load[layer], kind="stable")[: min(E, HEATMAP_EXPERTS)]
        heat_experts.append([int(e) for e in top_e])
        shown = ratio[np.ix_(top_e, top_e)].round(4)
        enough = (diag[top_e, None] * indep[np.ix_(top_e, top_e)]) >= MIN_EXPECTED
        heatmaps.append([[float(v) if ok else None for v, ok in zip(r, m)] for r, m in zip(shown, enough)])
        indep_maps.append(indep[np.ix_(top_e, top_e)].round(4).tolist())
        layers.append(
            {
                "layer": layer,
                "max_ratio": float(ratio.max()),
                "max_ratio_baseline": baseline[layer],
                "max_ratio_independent": float(indep.max()),
                "mean_lift": float((ratio[off] / indep[off]).mean()) if off.any() else None,
                "top_pairs": pairs,
            }
        )
    return {
        "uniform": (k - 1) / (E - 1) if E > 1 else 0.0,
        "top_experts": heat_experts,
        "heatmaps": heatmaps,
        "heatmap_min_expected": MIN_EXPECTED,
        "independent_heatmaps": indep_maps,
        "by_layer": layers,
        "matrix_layers": sorted({0, L // 2, L - 1}),
        "matrices": {
            str(layer): _ratios(acc.tallies["coactivation"].counts[layer]).round(4).tolist()
            for layer in sorted({0, L // 2, L - 1})
        },
    }


def _result(results: Results) -> dict:
    return _pairs(results.acc, results.options.n_coactivation_pairs, results.baselines["coactivation"])


def _render(report: dict, page: Page) -> str:
    co = report["coactivation"]
    by_layer = co["by_layer"]
    has_base = bool(by_layer) and "max_ratio_baseline" in by_layer[0]
    has_indep = bool(by_layer) and "max_ratio_independent" in by_layer[0]
    headers = [
        "layer",
        "max ratio",
        *(["baseline (null sample)"] if has_base else []),
        *(["largest expected ratio"] if has_indep else []),
        *(["mean lift"] if has_base else []),
        "top pairs (Ei&rarr;Ej ratio)",
    ]
    rows = [
        [
            c["layer"],
            _fmt(c["max_ratio"]),
            *([_fmt(c["max_ratio_baseline"])] if has_base else []),
            *([_fmt(c["max_ratio_independent"])] if has_indep else []),
            *([_fmt(c["mean_lift"], 2)] if has_base else []),
            ", ".join(f"E{p['i']}&rarr;E{p['j']} {p['ratio']:.2f}" for p in c["top_pairs"][:6]),
        ]
        for c in by_layer
    ]
    parts = [
        "<p class='lead'>Of the tokens that select expert a, the fraction that also select b, "
        "N(a,b)/N(a), over all pairs within a token's top-k; per layer its maximum over pairs beside its "
        "baseline: the same maximum on a null sample of as many tokens, each layer's selected experts "
        "shuffled across tokens (every expert keeps its load, every token k distinct experts). The "
        "largest expected ratio under independent choice with the real loads, (k-1) q<sub>b</sub> / "
        "(1 - q<sub>a</sub>) with q = load/(N k), is no baseline of a maximum over ~E&sup2; noisy ratios; "
        "it is the reference of each cell's lift (mean lift: over all pairs). Uniform independent choice "
        f"gives (k-1)/(E-1) = {co['uniform']:.4f}.</p>",
        _table(headers, rows, raw_headers=True),
    ]
    if co.get("heatmaps"):
        parts.append(_coactivation_top_experts(co, page, report["summary"]["n_layers"]))
    elif co.get("matrices"):
        mats = co["matrices"]
        fig, axes = _subplots(1, len(mats), figsize=(4 * len(mats), 3.6), squeeze=False)
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
    """Heatmaps of P(b|a) and its lift over the independent expectation for the most loaded experts
    (most loaded first), cells with too few expected tokens masked."""
    show = [layer for layer in page.layers_to_show(L) if layer < len(co["heatmaps"])]
    fig, axes = _subplots(2, len(show), figsize=(4.2 * len(show), 7.4), squeeze=False)
    for j, layer in enumerate(show):
        top = co["top_experts"][layer]
        heat = np.asarray(co["heatmaps"][layer], dtype=float)  # None (masked) -> NaN
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
            im = a.imshow(np.ma.masked_invalid(mat), cmap=cmap, **kw)
            a.set_facecolor("#d9d9d9")  # masked and blank cells
            a.set_xticks(range(len(top)), [str(t) for t in top], fontsize=6, rotation=90)
            a.set_yticks(range(len(top)), [str(t) for t in top], fontsize=6)
            a.set_title(f"layer {layer}: {title}", fontsize=8)
            a.set_xlabel("expert b", fontsize=7)
            a.set_ylabel("expert a", fontsize=7)
            fig.colorbar(im, ax=a)
    masked = co.get("heatmap_min_expected")
    return _figure(
        fig,
        "co-activation of the most loaded experts",
        f"The {len(co['top_experts'][show[0]]) if show else 0} most loaded experts of each layer, most "
        "loaded first: P(b|a) (diagonal blank) and its log2 lift over the independent expectation "
        "(k-1) q<sub>b</sub> / (1 - q<sub>a</sub>)"
        + (f"; grey: fewer than {masked:g} tokens expected in the cell." if masked else "."),
    )


SECTION = Section(
    "coactivation",
    "Expert co-activation",
    result=_result,
    render=_render,
    tally=_Coactivation,
    baseline=_baseline,
    baseline_steps=lambda acc: acc.permutations,
    draw_order=6,
    null="the max over pairs on a null sample of as many tokens: each layer's selected experts "
    "shuffled across tokens (loads kept, k distinct experts a token); (k-1) q_b / (1 - q_a), "
    "independent choice with the observed loads q, is each cell's expectation",
)
