"""The self-contained HTML page of a specialization report (plots as base64 PNG, text escaped)."""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["render_html"]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figures(report: dict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    L, E, k = s["n_layers"], s["n_experts"], s["top_k"]
    figs = {}
    # per-layer load histograms (sorted), small multiples
    cols = min(4, L)
    rows = int(np.ceil(L / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.2 * rows), squeeze=False)
    for ax in axes.ravel()[L:]:
        ax.axis("off")
    for layer, ax in zip(report["layers"], axes.ravel()):
        frac = np.asarray(layer["load_fraction"]) * E  # load / mean load
        ax.bar(np.arange(E), frac, color="#1f9e89", width=1.0)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"layer {layer['layer']}: max/mean {layer['max_over_mean_load']:.2f}", fontsize=8)
        ax.tick_params(labelsize=6)
    fig.supxlabel("expert", fontsize=8)
    fig.supylabel("load / mean load", fontsize=8)
    figs["load_histograms"] = _png(fig)
    # load heatmap [L, E]
    fig, ax = plt.subplots(figsize=(min(12, 2 + E * 0.15), 0.8 + L * 0.3))
    im = ax.imshow(
        np.asarray([x["load_fraction"] for x in report["layers"]]) * E, aspect="auto", cmap="viridis"
    )
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax, label="load / mean")
    figs["load_heatmap"] = _png(fig)
    # per-layer balance statistics
    fig, ax = plt.subplots(1, 3, figsize=(12, 3))
    xs = np.arange(L)
    ax[0].plot(xs, [x["cv_importance"] for x in report["layers"]], marker="o", label="CV(importance)")
    ax[0].plot(xs, [x["cv_load"] for x in report["layers"]], marker="s", label="CV(load)")
    ax[0].legend(fontsize=7)
    ax[1].plot(xs, [x["max_over_mean_load"] for x in report["layers"]], marker="o", color="#d62728")
    ax[1].set_title("max / mean load", fontsize=9)
    ax[2].plot(xs, [x["routing_entropy_normalized"] for x in report["layers"]], marker="o", label="per-token")
    ax[2].plot(xs, [x["load_entropy_normalized"] for x in report["layers"]], marker="s", label="of the load")
    ax[2].set_title("entropy / log E", fontsize=9)
    ax[2].legend(fontsize=7)
    for a in ax:
        a.set_xlabel("MoE layer")
    figs["balance"] = _png(fig)
    # domain specialization
    doms = report["domains"]["domains"]
    if doms:
        show = sorted({0, L // 2, L - 1})
        fig, axes = plt.subplots(
            1, len(show), figsize=(4.2 * len(show), 0.9 + 0.35 * len(doms)), squeeze=False
        )
        for ax, layer in zip(axes[0], show):
            corpus_share = np.asarray(report["layers"][layer]["load_fraction"]) * k  # N_k(E) / N
            mat = np.divide(
                np.asarray([doms[d]["fraction"][layer] for d in doms]),
                corpus_share,
                out=np.zeros((len(doms), E)),
                where=corpus_share > 0,
            )
            im = ax.imshow(mat, aspect="auto", cmap="magma", vmin=0)
            ax.set_yticks(range(len(doms)), list(doms), fontsize=7)
            ax.set_title(f"layer {layer}: (N_k(E,D)/N_D) / (N_k(E)/N)", fontsize=8)
            ax.set_xlabel("expert", fontsize=8)
            fig.colorbar(im, ax=ax)
        figs["domains"] = _png(fig)
    # repetition and layer agreement
    fig, ax = plt.subplots(1, 2, figsize=(10, 3))
    rep = report["repetition"]["by_layer"]
    ax[0].plot(xs, [r["rate"] for r in rep], marker="o", label="first-choice repetition")
    ax[0].plot(xs, [r["baseline"] for r in rep], linestyle="--", label="baseline (permutation)")
    ax[0].set_xlabel("MoE layer")
    ax[0].legend(fontsize=7)
    pairs = report["layer_agreement"]["pairs"]
    if pairs:
        ax[1].plot([p["layers"][0] for p in pairs], [p["nmi"] for p in pairs], marker="o", label="NMI")
        ax[1].plot(
            [p["layers"][0] for p in pairs],
            [p["matched_agreement"] for p in pairs],
            marker="s",
            label="matched",
        )
        for key, style in (("nmi_baseline", "--"), ("matched_baseline", ":")):
            ax[1].plot(
                [p["layers"][0] for p in pairs],
                [p[key] for p in pairs],
                linestyle=style,
                color="gray",
                label=key.replace("_", " ") + " (permutation)",
            )
        ax[1].set_xlabel("layer l (vs l+1)")
        ax[1].legend(fontsize=7)
    else:
        ax[1].axis("off")
    figs["repetition_agreement"] = _png(fig)
    # co-activation heatmaps
    mats = report["coactivation"]["matrices"]
    fig, axes = plt.subplots(1, len(mats), figsize=(4 * len(mats), 3.6), squeeze=False)
    for ax, (layer, mat) in zip(axes[0], mats.items()):
        off = np.asarray(mat, dtype=float)
        np.fill_diagonal(off, np.nan)  # the diagonal is 1 by definition and would swamp the scale
        im = ax.imshow(off, cmap="Blues", vmin=0)
        ax.set_title(f"layer {layer}: N(Ei,Ej)/N(Ei), diagonal blank", fontsize=8)
        ax.set_xlabel("Ej")
        ax.set_ylabel("Ei")
        fig.colorbar(im, ax=ax)
    figs["coactivation"] = _png(fig)
    return figs


def _table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def render_html(report: dict, *, expert_layers: Sequence[int] | None = None) -> str:
    """A self-contained HTML page (no external files, plots as base64 PNG) for a report dict."""
    esc = html.escape
    s = report["summary"]
    L = s["n_layers"]
    figs = _figures(report)
    show_layers = list(expert_layers) if expert_layers is not None else sorted({0, L // 2, L - 1})
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>moee expert-specialization report: {esc(s.get('model', ''))}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:13px;margin:0.5em 0}td,th{border:1px solid #ccc;"
        "padding:2px 6px;vertical-align:top}th{background:#f0f0f0}img{max-width:100%}"
        "code,.ctx{font-family:monospace}.ctx b{background:#ffe08a}</style></head><body>",
        "<h1>Expert-specialization report</h1><section id='summary'><h2>Summary</h2>",
        _table(
            [
                "model",
                "texts",
                "tokens",
                "MoE layers",
                "experts",
                "top-k (source)",
                "mean CV(imp)",
                "mean CV(load)",
                "max max/mean",
                "mean entropy/logE",
                "mean repetition",
            ],
            [
                [
                    esc(str(s.get("model", ""))),
                    s["n_texts"],
                    s["n_tokens"],
                    L,
                    s["n_experts"],
                    f"{s['top_k']} ({esc(str(s.get('top_k_source', '')))}; {esc(str(s.get('selection', '')))})",
                    _fmt(s["mean_cv_importance"]),
                    _fmt(s["mean_cv_load"]),
                    _fmt(s["max_over_mean_load"], 2),
                    _fmt(s["mean_routing_entropy_normalized"]),
                    _fmt(s["mean_repetition_rate"]),
                ]
            ],
        ),
    ]
    meta = report.get("meta", {})
    if meta:
        parts.append(
            f"<p>Command: <code>{esc(str(meta.get('command', '')))}</code>; created {esc(str(meta.get('timestamp', meta.get('utc', ''))))}; "
            f"versions: <code>{esc(json.dumps(meta.get('versions', {})))}</code></p>"
        )
    b = report.get("baselines", {})
    parts.append("</section><section id='baselines'><h2>Baselines</h2>")
    parts.append(
        f"<p>Expert selection: {esc(str(s.get('selection', '')))}.</p>"
        "<p>Every baseline is the statistic itself recomputed with the routes shuffled against what the "
        f"statistic relates them to ({esc(str(b.get('kind', '')))}, {b.get('permutations', '-')} draws, seed "
        f"{b.get('seed', '-')}, {b.get('sampled_tokens', '-')} sampled token routes"
        f"{'; the whole corpus, so the permutation is exact' if b.get('exact') else ''}).</p>"
    )
    parts.append(
        _table(
            ["statistic", "null (what is shuffled)"],
            [
                [esc(name), esc(str(b[name]))]
                for name in ("vocabulary", "domains", "repetition", "layer_agreement", "coactivation")
                if name in b
            ],
        )
    )
    parts.append("</section><section id='layers'><h2>Per-layer load balance</h2>")
    parts.append(
        "<p>Load = tokens whose top-k contains the expert; importance = sum of dense router probabilities; "
        "CV = std/mean (population std); Shazeer et al. 2017 (Table 6) read CV ~3 and max/mean 17.8 "
        "for an unbalanced router and 1.07-1.47 with balancing losses.</p>"
    )
    parts.append(
        _table(
            [
                "layer",
                "CV(importance)",
                "CV(load)",
                "max/mean",
                "min/mean",
                "dead",
                "entropy (nats)",
                "entropy/logE",
            ],
            [
                [
                    x["layer"],
                    _fmt(x["cv_importance"]),
                    _fmt(x["cv_load"]),
                    _fmt(x["max_over_mean_load"], 2),
                    _fmt(x["min_over_mean_load"], 2),
                    x["dead_experts"],
                    _fmt(x["routing_entropy"]),
                    _fmt(x["routing_entropy_normalized"]),
                ]
                for x in report["layers"]
            ],
        )
    )
    parts += [
        _img(figs["balance"], "balance per layer"),
        "<h3>Token-level load histograms</h3>",
        _img(figs["load_histograms"], "load histograms"),
        _img(figs["load_heatmap"], "load heatmap"),
        "</section>",
    ]
    parts.append("<section id='experts'><h2>What each expert selects</h2>")
    parts.append(
        f"<p>Layers shown: {show_layers} (every layer is in report.json). Contexts are the "
        "positions with the highest router probability for the expert; the routed token is highlighted.</p>"
    )
    for layer in show_layers:
        rows = []
        for ex in report["experts"][layer]:
            toks = ", ".join(
                f"<code>{esc(repr(t['token']))}</code> {t['count']}" for t in ex["top_tokens"][:6]
            )
            spec = ", ".join(
                f"<code>{esc(repr(t['token']))}</code> {t['ratio']:.2f}" for t in ex["specialized_tokens"][:5]
            )
            ctx = "<br>".join(
                f"<span class='ctx'>{esc(c['left'])}<b>{esc(c['token'])}</b>{esc(c['right'])}</span> ({c['prob']:.2f})"
                for c in ex["top_contexts"][:3]
            )
            rows.append([ex["expert"], ex["load"], toks, spec, ctx])
        parts.append(f"<h3>MoE layer {layer}</h3>")
        parts.append(
            _table(
                [
                    "expert",
                    "load",
                    "top tokens (count)",
                    "most specialised tokens N_k(x,E)/N_x",
                    "strongest contexts (prob)",
                ],
                rows,
            )
        )
    parts.append("</section><section id='domains'><h2>Domain specialization</h2>")
    doms = report["domains"]
    if doms["available"]:
        parts.append(
            "<p>max<sub>E</sub> N_k(E,D)/N_D per layer (OLMoE paper, section 5), beside its baseline: the "
            "same statistic with the token routes shuffled against the domain labels (permutation). "
            "Cells: statistic / baseline (lift). The heatmaps divide each expert's share of the domain "
            "by its share of the corpus (1 = no preference).</p>"
        )
        parts.append(
            _table(
                ["domain", "tokens", *[f"L{i}" for i in range(L)]],
                [
                    [
                        esc(d),
                        v["n_tokens"],
                        *[
                            f"{_fmt(m)} / {_fmt(b)} ({_fmt(lift, 2)}x)"
                            for m, b, lift in zip(
                                v["max_fraction_by_layer"],
                                v["baseline_by_layer"],
                                v["lift_over_baseline_by_layer"],
                            )
                        ],
                    ]
                    for d, v in doms["domains"].items()
                ],
            )
        )
        parts.append(_img(figs["domains"], "domain specialization"))
    else:
        parts.append(
            "<p>No domain labels were given (use <code>--domain-field</code> with a .jsonl corpus).</p>"
        )
    parts.append("</section><section id='vocabulary'><h2>Vocabulary specialization</h2>")
    voc = report["vocabulary"]
    parts.append(
        f"<p>N_k(x,E)/N_x for token types seen at least {voc['min_token_count']} times; per layer the "
        "token-weighted mean of max<sub>E</sub> N_k(x,E)/N_x, beside its baseline: the same statistic "
        "with the routes shuffled against the tokens (permutation; it depends on how often each type "
        "occurs, so it is far above k/E for rare types).</p>"
    )
    parts.append(
        _table(
            [
                "layer",
                "token types",
                "weighted max ratio",
                "baseline",
                "most specialised tokens (expert, ratio)",
            ],
            [
                [
                    v["layer"],
                    v.get("n_token_types", 0),
                    _fmt(v["weighted_max_ratio"]),
                    _fmt(v.get("baseline")),
                    ", ".join(
                        f"<code>{esc(repr(t['token']))}</code>&rarr;E{t['expert']} {t['ratio']:.2f}"
                        for t in v["top"][:8]
                    ),
                ]
                for v in voc["by_layer"]
            ],
        )
    )
    parts.append("</section><section id='coactivation'><h2>Expert co-activation</h2>")
    co = report["coactivation"]
    parts.append(
        f"<p>N(Ei,Ej)/N(Ei); uniform independent choice of k experts gives (k-1)/(E-1) = {co['uniform']:.4f}. "
        "There is no permutation baseline here: shuffling routes against tokens keeps each token's set.</p>"
    )
    parts.append(
        _table(
            ["layer", "max ratio", "top pairs (Ei&rarr;Ej ratio)"],
            [
                [
                    c["layer"],
                    _fmt(c["max_ratio"]),
                    ", ".join(f"E{p['i']}&rarr;E{p['j']} {p['ratio']:.2f}" for p in c["top_pairs"][:6]),
                ]
                for c in co["by_layer"]
            ],
        )
    )
    parts.append(_img(figs["coactivation"], "co-activation"))
    parts.append(
        "</section><section id='repetition'><h2>Consecutive-token repetition of the first choice</h2>"
    )
    parts.append(
        "<p>Rate at which consecutive tokens of a text keep the same first choice, beside its baseline: "
        "first choices shuffled against positions (exact permutation expectation).</p>"
    )
    parts.append(
        _table(
            ["layer", "rate", "baseline (permutation)"],
            [[r["layer"], _fmt(r["rate"]), _fmt(r["baseline"])] for r in report["repetition"]["by_layer"]],
        )
    )
    parts.append("</section><section id='layer_agreement'><h2>Layer-to-layer routing agreement</h2>")
    parts.append(
        "<p>First choices of adjacent MoE layers: NMI of the joint counts and the fraction that agrees under "
        "the best one-to-one expert matching (expert ids of different layers are unrelated), each beside its "
        "baseline: layer l+1's first choices shuffled against layer l's (permutation, same margins).</p>"
    )
    parts.append(
        _table(
            ["layers", "NMI", "NMI baseline", "matched agreement", "matched baseline"],
            [
                [
                    f"{p['layers'][0]}&rarr;{p['layers'][1]}",
                    _fmt(p["nmi"]),
                    _fmt(p["nmi_baseline"]),
                    _fmt(p["matched_agreement"]),
                    _fmt(p["matched_baseline"]),
                ]
                for p in report["layer_agreement"]["pairs"]
            ],
        )
    )
    parts.append(_img(figs["repetition_agreement"], "repetition and agreement"))
    parts.append("</section></body></html>")
    return "\n".join(parts)
