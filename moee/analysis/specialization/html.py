"""The self-contained HTML page of a specialization report.

One file that works offline: static figures are matplotlib PNGs inlined as base64, the style
sheet and the token view's script are the project's own files in ``page_assets/`` inlined as
text, and nothing is fetched. The page is a registry of sections (``SECTIONS``: id, title,
renderer); the table of contents, the single page and the two-model comparison (a report
with a ``compare`` block: every section of both models in two columns) are all built from it,
so a new analysis is one entry plus its renderer.

Escaping: every string that comes from the corpus, the model or the command line goes through
``html.escape`` in markup; the token view's data travels as JSON inside
``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc.,
so no corpus text (``</script>``, ``<!--``) can end the block, and the script puts it in the
page with ``textContent`` only.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

__all__ = [
    "SECTIONS",
    "Section",
    "TOKEN_VIEW_MAX_VALUES",
    "COMPARE_SECTION",
    "render_html",
    "token_view_payload",
]

esc = html.escape

#: Upper bound on the dense probabilities the token view embeds (tokens x layers x experts);
#: with 3-decimal rounding this keeps the page at a few MB for any model size.
TOKEN_VIEW_MAX_VALUES = 400_000

#: Probabilities are embedded as integers ``round(p * scale)``: the bar chart and the top-k
#: labels need three decimals, and integers are a third the size of float text.
_TOKEN_VIEW_SCALE = 1000


def _asset(name: str) -> str:
    text = (resources.files("moee.analysis.specialization") / "page_assets" / name).read_text("utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # would end the inline block
        raise ValueError(f"page asset {name} must not contain a closing </script> or </style> tag")
    return text


# ----------------------------------------------------------------------------------- figures


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(fig, alt: str, caption: str = "") -> str:
    """A matplotlib figure as an inline PNG ``<figure>``; ``caption`` is markup written by this
    module (never corpus text)."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # axes that count layers or checkpoints: integer ticks only
        if "layer" in ax.get_xlabel() or "order" in ax.get_xlabel():
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    cap = f"<figcaption>{caption}</figcaption>" if caption else ""
    return (
        f'<figure class=\'fig\'><img alt="{esc(alt)}" src="data:image/png;base64,{_png(fig)}">{cap}</figure>'
    )


def _grid(n: int, cols: int = 4, w: float = 3.2, h: float = 2.3):
    plt = _plt()
    cols = max(1, min(cols, n))
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    return fig, axes.ravel()[:n]


# ------------------------------------------------------------------------------------ markup


def _table(headers: Sequence[str], rows: Iterable[Sequence], *, raw_headers: bool = False) -> str:
    """A table; cells are markup (escape corpus text before), headers are escaped unless raw."""
    head = "".join(f"<th>{h if raw_headers else esc(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td{_num_class(c)}>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _num_class(cell) -> str:
    return " class='num'" if isinstance(cell, (int, float, np.integer, np.floating)) else ""


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _tok(token: str) -> str:
    """A token string shown with its whitespace visible (repr), escaped."""
    return f"<code>{esc(repr(token))}</code>"


@dataclass
class Page:
    """What a section renderer needs besides the report: the layers to show in detail and the
    prefix that keeps element ids unique when two reports share one page."""

    expert_layers: Sequence[int] | None = None
    prefix: str = ""
    token_view_max_values: int = TOKEN_VIEW_MAX_VALUES
    data_blocks: list[str] = field(default_factory=list)

    def layers_to_show(self, n_layers: int) -> list[int]:
        if self.expert_layers is not None:
            return [int(x) for x in self.expert_layers]
        return sorted({0, n_layers // 2, n_layers - 1})


@dataclass(frozen=True)
class Section:
    """One section of the page: its element id (also the TOC anchor), title and renderer. The
    renderer returns the section's inner markup, or ``None`` when the report lacks its data (the
    section is then left out of the page and the TOC)."""

    id: str
    title: str
    render: Callable[[dict, Page], str | None]


# ---------------------------------------------------------------------------------- sections


def _summary(report: dict, page: Page) -> str:
    s = report["summary"]
    parts = [
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
                    s["n_layers"],
                    s["n_experts"],
                    f"{s['top_k']} ({esc(str(s.get('top_k_source', '')))}; {esc(str(s.get('selection', '')))})",
                    _fmt(s["mean_cv_importance"]),
                    _fmt(s["mean_cv_load"]),
                    _fmt(s["max_over_mean_load"], 2),
                    _fmt(s["mean_routing_entropy_normalized"]),
                    _fmt(s["mean_repetition_rate"]),
                ]
            ],
        )
    ]
    lifts = _lifts(report)
    if lifts:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for name, values in lifts.items():
            ax.plot(range(len(values)), _nan(values), marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle=":", label="at its baseline")
        ax.set_yscale("log")  # a JSD lift of 100 beside a vocabulary lift of 4
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("statistic / baseline (log scale)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        parts.append(
            _figure(
                fig,
                "specialisation over baseline",
                "At a glance: each specialisation statistic over its permutation baseline, per layer "
                "(1 = what routing that ignores the tokens, domains or positions would score).",
            )
        )
    meta = report.get("meta", {})
    if meta:
        parts.append(
            f"<p>Command: <code>{esc(str(meta.get('command', '')))}</code>; created "
            f"{esc(str(meta.get('timestamp', meta.get('utc', ''))))}; versions: "
            f"<code>{esc(json.dumps(meta.get('versions', {})))}</code></p>"
        )
    return "".join(parts)


def _ratio(x, base):
    return x / base if x is not None and base else None


def _lifts(report: dict) -> dict[str, list]:
    """Per layer, statistic / permutation baseline of the specialisation statistics the report has."""
    out = {}
    voc = report.get("vocabulary", {}).get("by_layer")
    if voc:
        out["vocabulary max ratio"] = [_ratio(v["weighted_max_ratio"], v.get("baseline")) for v in voc]
    ts = report.get("token_specialization", {}).get("by_key", {})
    for key, v in ts.items():
        if v.get("available"):
            out[f"{key}-token max fraction"] = [
                _ratio(r["weighted_max_fraction"], r["weighted_max_fraction_baseline"]) for r in v["by_layer"]
            ]
    spec = report.get("domains", {}).get("specialization_by_layer")
    if report.get("domains", {}).get("available") and spec:
        out["domain JSD"] = [_ratio(r["jsd"], r["jsd_baseline"]) for r in spec]
    rep = report.get("repetition", {}).get("by_layer")
    if rep:
        out["repetition"] = [_ratio(r["rate"], r["baseline"]) for r in rep]
    return {k: v for k, v in out.items() if any(x is not None for x in v)}


def _baselines(report: dict, page: Page) -> str:
    s, b = report["summary"], report.get("baselines", {})
    return (
        f"<p>Expert selection: {esc(str(s.get('selection', '')))}.</p>"
        "<p>Every baseline is the statistic itself recomputed with the routes shuffled against what the "
        f"statistic relates them to ({esc(str(b.get('kind', '')))}, {esc(str(b.get('permutations', '-')))} "
        f"draws, seed {esc(str(b.get('seed', '-')))}, {esc(str(b.get('sampled_tokens', '-')))} sampled token "
        f"routes{'; the whole corpus, so the permutation is exact' if b.get('exact') else ''}).</p>"
        + _table(
            ["statistic", "null (what is shuffled)"],
            [[esc(name), esc(str(v))] for name, v in b.items() if isinstance(v, str) and name != "kind"],
        )
    )


def _layers(report: dict, page: Page) -> str:
    plt = _plt()
    s = report["summary"]
    L, E = s["n_layers"], s["n_experts"]
    layers = report["layers"]
    xs = np.arange(L)
    fig, ax = plt.subplots(1, 3, figsize=(12, 3))
    ax[0].plot(xs, [x["cv_importance"] for x in layers], marker="o", label="CV(importance)")
    ax[0].plot(xs, [x["cv_load"] for x in layers], marker="s", label="CV(load)")
    ax[0].legend(fontsize=7)
    ax[1].plot(xs, [x["max_over_mean_load"] for x in layers], marker="o", color="#d62728")
    ax[1].set_title("max / mean load", fontsize=9)
    ax[2].plot(xs, [x["routing_entropy_normalized"] for x in layers], marker="o", label="per-token")
    ax[2].plot(xs, [x["load_entropy_normalized"] for x in layers], marker="s", label="of the load")
    ax[2].set_title("entropy / log E", fontsize=9)
    ax[2].legend(fontsize=7)
    for a in ax:
        a.set_xlabel("MoE layer")
    balance = _figure(
        fig, "balance per layer", "Per-layer balance: CV of importance and load, max/mean load, entropy."
    )
    fig, axes = _grid(L)
    for layer, a in zip(layers, axes):
        a.bar(np.arange(E), np.asarray(layer["load_fraction"]) * E, color="#1f9e89", width=1.0)
        a.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        a.set_title(f"layer {layer['layer']}: max/mean {layer['max_over_mean_load']:.2f}", fontsize=8)
        a.tick_params(labelsize=6)
    fig.supxlabel("expert", fontsize=8)
    fig.supylabel("load / mean load", fontsize=8)
    hist = _figure(
        fig, "load histograms", "Load of every expert over the mean load (dashed: perfect balance)."
    )
    fig, a = plt.subplots(figsize=(min(12, 2 + E * 0.15), 0.8 + L * 0.3))
    im = a.imshow(np.asarray([x["load_fraction"] for x in layers]) * E, aspect="auto", cmap="viridis")
    a.set_xlabel("expert")
    a.set_ylabel("MoE layer")
    fig.colorbar(im, ax=a, label="load / mean")
    heat = _figure(fig, "load heatmap", "Load over mean load, every layer and expert.")
    table = _table(
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
            for x in layers
        ],
    )
    return (
        "<p class='lead'>Load = tokens whose top-k contains the expert; importance = sum of dense router "
        "probabilities; CV = std/mean (population std); Shazeer et al. 2017 (Table 6) read CV ~3 and "
        "max/mean 17.8 for an unbalanced router and 1.07-1.47 with balancing losses.</p>"
        + table
        + balance
        + "<h3>Token-level load histograms</h3>"
        + hist
        + heat
    )


def _experts(report: dict, page: Page) -> str:
    L = report["summary"]["n_layers"]
    show = page.layers_to_show(L)
    parts = [
        f"<p class='lead'>Layers shown: {esc(str(show))} (every layer is in report.json). Contexts are "
        "the positions with the highest router probability for the expert; the routed token is "
        "highlighted.</p>"
    ]
    plt = _plt()
    conc = np.asarray(
        [
            [
                (ex["top_tokens"][0]["count"] / ex["load"]) if ex["load"] and ex["top_tokens"] else np.nan
                for ex in row
            ]
            for row in report["experts"]
        ],
        dtype=float,
    )
    fig, ax = plt.subplots(figsize=(min(12, 2 + conc.shape[1] * 0.15), 0.8 + conc.shape[0] * 0.3))
    im = ax.imshow(conc, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax, label="top token's share of load")
    parts.append(
        _figure(
            fig,
            "token concentration of each expert",
            "How much of each expert's load is its single most frequent token (1 = a one-token expert).",
        )
    )
    for layer in show:
        rows = []
        for ex in report["experts"][layer]:
            toks = ", ".join(f"{_tok(t['token'])} {t['count']}" for t in ex["top_tokens"][:6])
            spec = ", ".join(f"{_tok(t['token'])} {t['ratio']:.2f}" for t in ex["specialized_tokens"][:5])
            ctx = "<br>".join(
                f"<span class='ctx'>{esc(c['left'])}<b>{esc(c['token'])}</b>{esc(c['right'])}</span> "
                f"({c['prob']:.2f})"
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
    return "".join(parts)


def _domains(report: dict, page: Page) -> str:
    doms = report["domains"]
    if not doms.get("available"):
        return "<p>No domain labels were given (use <code>--domain-field</code> with a .jsonl corpus).</p>"
    plt = _plt()
    s = report["summary"]
    L, E, k = s["n_layers"], s["n_experts"], s["top_k"]
    d = doms["domains"]
    names = list(doms.get("names") or d)
    mats = []
    for layer in range(L):
        corpus_share = np.asarray(report["layers"][layer]["load_fraction"]) * k  # N_k(E) / N
        mats.append(
            np.divide(
                np.asarray([d[n]["fraction"][layer] for n in names]),
                corpus_share,
                out=np.zeros((len(names), E)),
                where=corpus_share > 0,
            )
        )
    vmax = max(1.0, float(np.percentile(np.concatenate([m.ravel() for m in mats]), 99)))  # one scale
    cols = min(4, L)
    fig, axes = _grid(L, cols=cols, w=3.6, h=0.8 + 0.26 * len(names))
    for layer, (ax, mat) in enumerate(zip(axes, mats)):
        im = ax.imshow(mat, aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set_yticks(range(len(names)), names if layer % cols == 0 else [], fontsize=7)
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
        if layer >= L - cols:
            ax.set_xlabel("expert", fontsize=7)
    fig.colorbar(im, ax=list(axes), fraction=0.02, pad=0.01, label="share / corpus share")
    parts = [
        "<p class='lead'>max<sub>E</sub> N_k(E,D)/N_D per layer (OLMoE paper, section 5), beside its "
        "baseline: the same statistic with the token routes shuffled against the domain labels "
        "(permutation). Cells: statistic / baseline (lift). The heatmaps divide each expert's share of "
        "the domain by its share of the corpus (1 = no preference).</p>",
        _table(
            ["domain", "tokens", *[f"L{i}" for i in range(L)]],
            [
                [
                    esc(n),
                    d[n]["n_tokens"],
                    *[
                        f"{_fmt(m)} / {_fmt(b)} ({_fmt(lift, 2)}x)"
                        for m, b, lift in zip(
                            d[n]["max_fraction_by_layer"],
                            d[n]["baseline_by_layer"],
                            d[n]["lift_over_baseline_by_layer"],
                        )
                    ],
                ]
                for n in names
            ],
        ),
        _figure(
            fig,
            "domain x expert load",
            "Domain x expert load per layer: (N_k(E,D)/N_D) / (N_k(E)/N), 1 = the expert's corpus share.",
        ),
    ]
    spec = doms.get("specialization_by_layer")
    if spec:
        fig, ax = plt.subplots(figsize=(5.5, 3))
        xs = [r["layer"] for r in spec]
        ax.plot(xs, _nan(r["jsd"] for r in spec), marker="o", label="JSD of the domains' loads")
        ax.plot(xs, _nan(r["jsd_baseline"] for r in spec), linestyle="--", color="gray", label="permutation")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("nats")
        ax.legend(fontsize=7)
        parts.append(
            "<h3>Domain specialisation score</h3><p>Generalised Jensen-Shannon divergence of the domains' "
            "load distributions over experts (weights: the domains' token shares), beside the same "
            "statistic with routes shuffled against the domain labels.</p>"
            + _table(
                ["layer", "JSD (nats)", "permutation"],
                [[r["layer"], _fmt(r["jsd"], 4), _fmt(r["jsd_baseline"], 4)] for r in spec],
            )
            + _figure(
                fig, "domain JSD", "Domain specialisation (JSD) per layer beside its permutation baseline."
            )
        )
    return "".join(parts)


def _vocabulary(report: dict, page: Page) -> str:
    voc = report["vocabulary"]
    return (
        f"<p class='lead'>N_k(x,E)/N_x for token types seen at least {esc(str(voc['min_token_count']))} "
        "times; per layer the token-weighted mean of max<sub>E</sub> N_k(x,E)/N_x, beside its baseline: "
        "the same statistic with the routes shuffled against the tokens (permutation; it depends on how "
        "often each type occurs, so it is far above k/E for rare types).</p>"
        + _table(
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
                        f"{_tok(t['token'])}&rarr;E{t['expert']} {t['ratio']:.2f}" for t in v["top"][:8]
                    ),
                ]
                for v in voc["by_layer"]
            ],
        )
        + _baseline_plot(
            [v["layer"] for v in voc["by_layer"]],
            {
                "weighted max ratio": (
                    [v["weighted_max_ratio"] for v in voc["by_layer"]],
                    [v.get("baseline") for v in voc["by_layer"]],
                )
            },
            "vocabulary specialization",
            "Token-weighted max<sub>E</sub> N_k(x,E)/N_x per layer; dashed: its permutation baseline.",
        )
    )


def _baseline_plot(
    xs: Sequence[int], series: dict[str, tuple[Sequence, Sequence]], alt: str, caption: str
) -> str:
    """One line per statistic over MoE layers with its baseline dashed in the same colour."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3))
    for name, (values, baseline) in series.items():
        line = ax.plot(xs, _nan(values), marker="o", label=name)[0]
        ax.plot(xs, _nan(baseline), linestyle="--", color=line.get_color(), label=f"{name}: permutation")
    ax.set_xlabel("MoE layer")
    ax.legend(fontsize=7)
    return _figure(fig, alt, caption)


def _coactivation(report: dict, page: Page) -> str:
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


def _repetition(report: dict, page: Page) -> str:
    plt = _plt()
    rep = report["repetition"]["by_layer"]
    fig, ax = plt.subplots(figsize=(5.5, 3))
    xs = [r["layer"] for r in rep]
    ax.plot(xs, [r["rate"] for r in rep], marker="o", label="first-choice repetition")
    ax.plot(xs, [r["baseline"] for r in rep], linestyle="--", label="baseline (permutation)")
    ax.set_xlabel("MoE layer")
    ax.legend(fontsize=7)
    return (
        "<p class='lead'>Rate at which consecutive tokens of a text keep the same first choice, beside "
        "its baseline: first choices shuffled against positions (exact permutation expectation).</p>"
        + _table(
            ["layer", "rate", "baseline (permutation)"],
            [[r["layer"], _fmt(r["rate"]), _fmt(r["baseline"])] for r in rep],
        )
        + _figure(fig, "repetition", "First-choice repetition per layer beside its permutation baseline.")
    )


def _layer_agreement(report: dict, page: Page) -> str:
    pairs = report["layer_agreement"]["pairs"]
    parts = [
        "<p class='lead'>First choices of adjacent MoE layers: NMI of the joint counts and the fraction "
        "that agrees under the best one-to-one expert matching (expert ids of different layers are "
        "unrelated), each beside its baseline: layer l+1's first choices shuffled against layer l's "
        "(permutation, same margins).</p>",
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
                for p in pairs
            ],
        ),
    ]
    if pairs:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(5.5, 3))
        xs = [p["layers"][0] for p in pairs]
        ax.plot(xs, [p["nmi"] for p in pairs], marker="o", label="NMI")
        ax.plot(xs, [p["matched_agreement"] for p in pairs], marker="s", label="matched")
        for key, style in (("nmi_baseline", "--"), ("matched_baseline", ":")):
            ax.plot(xs, [p[key] for p in pairs], linestyle=style, color="gray", label=key.replace("_", " "))
        ax.set_xlabel("layer l (vs l+1)")
        ax.legend(fontsize=7)
        parts.append(
            _figure(fig, "layer agreement", "Adjacent-layer agreement beside its permutation baselines.")
        )
    return "".join(parts)


# -------------------------------------------------------------------------------- token view


def token_view_payload(report: dict, max_values: int = TOKEN_VIEW_MAX_VALUES) -> dict | None:
    """What the token view embeds: the report's token sample (``report["token_view"]``) as
    ``[text, selected [L][k], dense [L][E] in 1/scale, predicted next token or None]`` per token,
    at most ``max_values`` dense probabilities (whole tokens, in corpus order); ``None`` when the
    report has no token sample."""
    tv = report.get("token_view")
    if not tv or not tv.get("texts"):
        return None
    s = report["summary"]
    L, E, k = int(s["n_layers"]), int(s["n_experts"]), int(s["top_k"])
    budget = max(1, max_values // (L * E))
    texts, used = [], 0
    for i, text in enumerate(tv["texts"]):
        if used >= budget:
            break
        n = min(len(text["tokens"]), budget - used)
        if n == 0:
            continue
        shape = f"selected must be [T, {L}, k] and probs [T, {L}, {E}] for its {len(text['tokens'])} tokens"
        try:
            selected = np.asarray(text["selected"][:n], dtype=np.int64)
            probs = np.asarray(text["probs"][:n], dtype=np.float64)
        except ValueError as err:  # ragged lists
            raise ValueError(f"token_view text {i}: {shape}, got ragged lists ({err})") from None
        if selected.ndim != 3 or selected.shape[:2] != (n, L) or probs.shape != (n, L, E):
            raise ValueError(
                f"token_view text {i}: {shape}, got {list(selected.shape)} and {list(probs.shape)}"
            )
        if (selected < 0).any() or (selected >= E).any():
            raise ValueError(f"token_view text {i}: expert ids outside [0, {E})")
        predicted = text.get("predicted") or [None] * n
        dense = np.rint(probs * _TOKEN_VIEW_SCALE).astype(np.int64).tolist()
        tokens = [
            [str(t), sel, d, None if q is None else str(q)]
            for t, sel, d, q in zip(text["tokens"][:n], selected.tolist(), dense, predicted[:n])
        ]
        label = f"text {text.get('text_index', i)}"
        if text.get("domain") is not None:
            label += f" · {text['domain']}"
        texts.append({"label": label, "tokens": tokens})
        used += n
    return {
        "n_layers": L,
        "n_experts": E,
        "top_k": k,
        "layer": L // 2,
        "scale": _TOKEN_VIEW_SCALE,
        "n_tokens": used,
        "texts": texts,
    }


def _json_for_script(data) -> str:
    """JSON that is safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` survive, so no
    ``</script>`` or ``<!--`` can appear; JSON.parse restores them."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _token_view(report: dict, page: Page) -> str | None:
    payload = token_view_payload(report, page.token_view_max_values)
    if payload is None:
        return None
    data_id = f"{page.prefix}token-view-data"
    page.data_blocks.append(
        f"<script type='application/json' id='{data_id}'>{_json_for_script(payload)}</script>"
    )
    total = sum(len(t["tokens"]) for t in report["token_view"]["texts"])
    return (
        f"<p class='lead'>{payload['n_tokens']} tokens of the corpus"
        f"{f' (of {total} in report.json)' if total > payload['n_tokens'] else ''}, each coloured by its "
        "first-choice expert in the chosen layer. Hover a token (or click to pin it) to see its dense "
        "routing distribution in every layer, the selected experts coloured, with their top-k; pick an "
        "expert to highlight the tokens whose top-k contains it.</p>"
        f"<div class='token-view' id='{page.prefix}token-view' data-source='{data_id}'>"
        "<noscript>The token view needs JavaScript.</noscript></div>"
    )


def _nan(values) -> np.ndarray:
    """A list with ``None`` (undefined statistic) as a float array with NaN, for plotting."""
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def _router_entropy(report: dict, page: Page) -> str:
    plt = _plt()
    re_ = report["router_entropy"]
    rows = re_["by_layer"]
    s = report["summary"]
    E = s["n_experts"]
    xs = [r["layer"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.2))
    ax[0].plot(xs, [r["dense_entropy_normalized"] for r in rows], marker="o", label="dense H(p) / log E")
    ax[0].plot(xs, [r["selection_entropy_normalized"] for r in rows], marker="s", label="selection H / log k")
    ax[0].plot(xs, [r["load_entropy"] / np.log(E) for r in rows], marker="^", label="load H / log E")
    ax[0].axhline(1.0, color="gray", linestyle=":", label="uniform router")
    ax[0].set_ylim(0, 1.05)
    ax[0].set_title("entropy (normalised)", fontsize=9)
    for key, marker in (("dense", "o"), ("selection", "s"), ("load", "^"), ("importance", "v")):
        ax[1].plot(xs, [r[f"{key}_kl_uniform"] for r in rows], marker=marker, label=f"{key}")
    ax[1].axhline(0.0, color="gray", linestyle=":", label="uniform router")
    ax[1].set_title("KL to uniform (nats)", fontsize=9)
    for a in ax:
        a.set_xlabel("MoE layer")
        a.legend(fontsize=7)
    desc = re_.get("baseline", {}).get("description", "")
    return (
        "<p class='lead'>Per token, the entropy of the dense router distribution over all E experts and "
        "of its probabilities restricted to the k selected (renormalised), with the KL divergence to "
        "uniform (log E - H); of the corpus, the entropy of the load and of the mean dense distribution "
        f"(importance). Baseline: {esc(str(desc))}</p>"
        + _table(
            [
                "layer",
                "dense H",
                "H/logE",
                "KL(p||U)",
                "selection H",
                "H/logk",
                "KL sel",
                "load KL",
                "importance KL",
            ],
            [
                [
                    r["layer"],
                    _fmt(r["dense_entropy"]),
                    _fmt(r["dense_entropy_normalized"]),
                    _fmt(r["dense_kl_uniform"]),
                    _fmt(r["selection_entropy"]),
                    _fmt(r["selection_entropy_normalized"]),
                    _fmt(r["selection_kl_uniform"]),
                    _fmt(r["load_kl_uniform"]),
                    _fmt(r["importance_kl_uniform"]),
                ]
                for r in rows
            ],
        )
        + _figure(
            fig, "router entropy", "Router entropy and KL to uniform per layer (dotted: a uniform router)."
        )
    )


def _saturation(report: dict, page: Page) -> str:
    sat = report["saturation"]
    if not sat.get("available"):
        return (
            f"<p>Not computed: {esc(str(sat.get('reason') or 'no checkpoints'))}. Pass "
            "<code>--checkpoints</code> (intermediate checkpoints of the same training run) to compare "
            "each checkpoint's routing with the final one.</p>"
        )
    plt = _plt()
    cks = sat["checkpoints"]
    xs = np.asarray(
        [np.nan if c.get("fraction_of_training") is None else 100 * c["fraction_of_training"] for c in cks]
    )
    xlabel = "% of training"
    if np.isnan(xs).any():
        xs, xlabel = np.arange(len(cks), dtype=float), "checkpoint (training order)"
    rows = sat["by_layer"]
    rnd = sat.get("random_baseline", {})
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    cmap = plt.get_cmap("viridis")
    for a, key in zip(ax, ("top1", "topk")):
        for r in rows:
            a.plot(xs, r[key], color=cmap(r["layer"] / max(1, len(rows) - 1)), linewidth=0.9, alpha=0.8)
        a.plot(xs, sat[f"mean_{key}"], color="black", linewidth=2.2, marker="o", label="mean over layers")
        a.plot(
            xs,
            np.mean([r[f"{key}_permutation"] for r in rows], axis=0),
            color="gray",
            linestyle="--",
            label="permutation",
        )
        if key in rnd:
            a.axhline(
                rnd[key], color="gray", linestyle=":", label=f"random {'1/E' if key == 'top1' else 'k/E'}"
            )
        a.set_ylim(0, 1.02)
        a.set_xlabel(xlabel)
        a.set_title("first choice = final's" if key == "top1" else "|top-k ∩ final top-k| / k", fontsize=9)
        a.legend(fontsize=7)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, max(1, len(rows) - 1)))
    fig.colorbar(sm, ax=ax, label="MoE layer", fraction=0.03)
    table = _table(
        ["checkpoint", "step", "% of training", "mean top-1 overlap", "mean top-k overlap"],
        [
            [
                esc(str(c["name"])),
                "-" if c.get("step") is None else c["step"],
                "-" if c.get("fraction_of_training") is None else f"{100 * c['fraction_of_training']:.1f}",
                _fmt(t1),
                _fmt(tk),
            ]
            for c, t1, tk in zip(cks, sat["mean_top1"], sat["mean_topk"])
        ],
    )
    return (
        f"<p class='lead'>Router saturation (OLMoE paper, section 5): for the first {esc(str(sat.get('n_texts')))} "
        f"texts ({esc(str(sat.get('n_tokens')))} tokens), the share of tokens whose first choice (left) or top-k "
        f"(right) in each checkpoint matches the final checkpoint <code>{esc(str(sat.get('final', '')))}</code>, "
        "per layer (coloured) and on average (black), beside the permutation baseline (tokens shuffled) "
        "and random routing.</p>"
        + table
        + _figure(fig, "router saturation", "Overlap with the final checkpoint's routing over training.")
    )


def _token_specialization(report: dict, page: Page) -> str:
    ts = report["token_specialization"]
    keys = [k for k in ts["keys"] if ts["by_key"][k].get("available")]
    missing = [k for k in ts["keys"] if not ts["by_key"][k].get("available")]
    s = report["summary"]
    L = s["n_layers"]
    parts = [
        "<p class='lead'>For each token type t (seen at least "
        f"{esc(str(ts.get('min_token_count')))} times), the fraction of its occurrences whose top-k "
        "contains expert e, N(t,e)/N_t, keyed three ways: the input token, the true next token and the "
        "model's predicted next token (OLMoE paper, section 5). Per layer: the token-weighted mean of "
        "max<sub>e</sub> N(t,e)/N_t, and the mean over experts of the expert's specialisation (mean "
        f"N(t,e)/N_t over its {esc(str(ts.get('n_top')))} top tokens), each beside the permutation "
        f"baseline (routes shuffled against the keys) and random routing k/E = {_fmt(ts.get('random_baseline'))}.</p>"
    ]
    for k in missing:
        parts.append(
            f"<p class='missing'>{esc(k)}: not available ({esc(str(ts['by_key'][k].get('reason') or ''))}).</p>"
        )
    untracked = {k: ts["by_key"][k].get("untracked_tokens") or 0 for k in keys}
    if any(untracked.values()):
        parts.append(
            f"<p class='missing'>The token tables hold {esc(str(ts.get('max_token_types')))} token types "
            "(the memory cap); tokens of types seen after they filled are not counted here: "
            + ", ".join(f"{esc(k)} {n:,} of {ts['by_key'][k]['n_tokens']:,}" for k, n in untracked.items())
            + ".</p>"
        )
    if not keys:
        return "".join(parts)
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    colors = dict(zip(ts["keys"], ("#1f77b4", "#d62728", "#2ca02c")))
    for a, stat in zip(ax, ("weighted_max_fraction", "mean_expert_specialization")):
        for k in keys:
            rows = ts["by_key"][k]["by_layer"]
            xs = [r["layer"] for r in rows]
            a.plot(xs, _nan(r[stat] for r in rows), marker="o", color=colors.get(k), label=k)
            a.plot(
                xs, _nan(r[f"{stat}_baseline"] for r in rows), linestyle="--", color=colors.get(k), alpha=0.7
            )
        if ts.get("random_baseline") is not None:
            a.axhline(ts["random_baseline"], color="gray", linestyle=":", label="random k/E")
        a.set_xlabel("MoE layer")
        a.set_title(stat.replace("_", " ") + " (dashed: permutation)", fontsize=9)
        a.legend(fontsize=7)
    headers = ["layer"]
    for k in keys:
        headers += [f"{k}: max frac / perm", f"{k}: expert spec / perm"]
    rows = []
    for layer in range(L):
        row = [layer]
        for k in keys:
            r = ts["by_key"][k]["by_layer"][layer]
            row += [
                f"{_fmt(r['weighted_max_fraction'])} / {_fmt(r['weighted_max_fraction_baseline'])}",
                f"{_fmt(r['mean_expert_specialization'])} / {_fmt(r['mean_expert_specialization_baseline'])}",
            ]
        rows.append(row)
    parts.append(_table(headers, rows))
    parts.append(
        _figure(fig, "token specialization", "Token specialisation by input, next and predicted token.")
    )
    for layer in page.layers_to_show(L):
        parts.append(f"<h3>MoE layer {layer}: each expert's most specialised tokens</h3>")
        detail = []
        for e in range(s["n_experts"]):
            row = [e]
            for k in keys:
                ex = ts["by_key"][k]["experts"][layer][e]
                top = ", ".join(f"{_tok(t['token'])} {t['fraction']:.2f}" for t in ex["top"][:5])
                row.append(f"{_fmt(ex['specialization'])} ({_fmt(ex['specialization_baseline'])}): {top}")
            detail.append(row)
        parts.append(_table(["expert", *[f"{k}: spec (perm): top tokens N(t,e)/N_t" for k in keys]], detail))
    return "".join(parts)


def _cross_layer(report: dict, page: Page) -> str:
    cl = report["cross_layer"]
    pairs = cl["pairs"]
    if not pairs:
        return "<p>One MoE layer only: no adjacent pairs.</p>"
    plt = _plt()
    xs = [p["layers"][0] for p in pairs]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.2))
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


def _compare(report: dict, page: Page) -> str | None:
    """Model B minus model A per layer, and how often the two pick the same experts."""
    cmp = report.get("compare")
    if not cmp:
        return None
    plt = _plt()
    a, b = (esc(str(x)) for x in cmp["labels"])
    parts = [f"<p class='lead'>A = {a}, B = {b}. Every other section shows A and B side by side.</p>"]
    diffs = (cmp.get("differences") or {}).get("by_layer") or []
    if not cmp.get("same_shape", True) or not diffs:
        parts.append(
            "<p class='missing'>The two models differ in layers, experts or k: no per-layer differences.</p>"
        )
    else:
        metrics = [m for m in diffs[0] if m != "layer"]
        plotted = [m for m in metrics if any(r[m] is not None for r in diffs)]  # all-undefined: table only
        parts.append("<h3>Differences per layer (B - A)</h3>")
        parts.append(
            _table(["layer", *metrics], [[r["layer"], *[_fmt(r[m], 4) for m in metrics]] for r in diffs])
        )
        if plotted:
            fig, axes = _grid(len(plotted), cols=3, w=3.6, h=2.6)
            xs = [r["layer"] for r in diffs]
            for ax, m in zip(axes, plotted):
                v = np.nan_to_num(_nan(r[m] for r in diffs))
                ax.bar(xs, v, color=np.where(v >= 0, "#1f77b4", "#d62728"))
                ax.axhline(0, color="black", linewidth=0.8)
                ax.set_title(f"B - A: {m.replace('_', ' ')}", fontsize=8)
                ax.set_xlabel("MoE layer", fontsize=7)
                ax.tick_params(labelsize=7)
            parts.append(_figure(fig, "differences B - A", "Per-layer statistics of B minus those of A."))
    so = cmp.get("selection_overlap") or {}
    parts.append("<h3>Same tokens, same experts</h3>")
    if not so.get("available"):
        parts.append(f"<p class='missing'>Not computed: {esc(str(so.get('reason') or 'not available'))}.</p>")
    else:
        rows = so["by_layer"]
        rnd = so.get("random_baseline", {})
        fig, ax = plt.subplots(figsize=(6, 3))
        xs = [r["layer"] for r in rows]
        for key, marker in (("top1", "o"), ("topk", "s")):
            line = ax.plot(xs, [r[key] for r in rows], marker=marker, label=key)[0]
            ax.plot(
                xs, [r[f"{key}_permutation"] for r in rows], linestyle="--", color=line.get_color(), alpha=0.7
            )
            if key in rnd:
                ax.axhline(rnd[key], color=line.get_color(), linestyle=":", alpha=0.7)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("MoE layer")
        ax.legend(fontsize=7)
        parts.append(
            "<p>Share of tokens whose first choice (top1) or top-k (topk, mean |S<sub>A</sub> &cap; "
            "S<sub>B</sub>| / k) is the same expert id in A and B (meaningful for two checkpoints of one "
            "run), beside the permutation baseline (dashed) and random routing (dotted).</p>"
            + _table(
                ["layer", "top1", "permutation", "topk", "permutation"],
                [
                    [
                        r["layer"],
                        _fmt(r["top1"]),
                        _fmt(r["top1_permutation"]),
                        _fmt(r["topk"]),
                        _fmt(r["topk_permutation"]),
                    ]
                    for r in rows
                ],
            )
            + _figure(fig, "selection overlap", "Same expert ids on the same tokens, A vs B.")
        )
    return "".join(parts)


#: Every section of the page, in page order. A section whose key the report lacks is left out.
SECTIONS: tuple[Section, ...] = (
    Section("summary", "Summary", _summary),
    Section("token_view", "Token view", _token_view),
    Section("baselines", "Baselines", _baselines),
    Section("layers", "Per-layer load balance", _layers),
    Section("router_entropy", "Router entropy and KL to uniform", _router_entropy),
    Section("saturation", "Router saturation over training", _saturation),
    Section(
        "token_specialization", "Token specialisation: input, next and predicted token", _token_specialization
    ),
    Section("experts", "What each expert selects", _experts),
    Section("vocabulary", "Vocabulary specialization", _vocabulary),
    Section("domains", "Domain specialization", _domains),
    Section("coactivation", "Expert co-activation", _coactivation),
    Section("cross_layer", "Cross-layer expert pairs", _cross_layer),
    Section("repetition", "Consecutive-token repetition of the first choice", _repetition),
    Section("layer_agreement", "Layer-to-layer routing agreement", _layer_agreement),
)

#: The comparison page's own section (after the summary), built from ``report["compare"]``.
COMPARE_SECTION = Section("compare", "Comparison: B - A and shared selections", _compare)


# ------------------------------------------------------------------------------------- pages


def _render_section(section: Section, report: dict, page: Page) -> str | None:
    if section.id not in report and section.id != "baselines":
        return None
    return section.render(report, page)


def _document(title: str, heading: str, sections: list[tuple[Section, str]], data_blocks: list[str]) -> str:
    toc = "".join(f"<li><a href='#{s.id}'>{esc(s.title)}</a></li>" for s, _ in sections)
    body = "".join(f"<section id='{s.id}'><h2>{esc(s.title)}</h2>{inner}</section>" for s, inner in sections)
    script = f"<script>{_asset('token_view.js')}</script>" if data_blocks else ""
    return "\n".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            "<meta name='viewport' content='width=device-width, initial-scale=1'>",
            f"<title>{esc(title)}</title><style>{_asset('page.css')}</style></head><body>",
            f"<nav id='toc'><h2>Contents</h2><ol>{toc}</ol></nav>",
            f"<main><h1>{heading}</h1>",
            body,
            "</main>",
            *data_blocks,
            script,
            "</body></html>",
        ]
    )


def render_html(
    report: dict,
    *,
    expert_layers: Sequence[int] | None = None,
    token_view_max_values: int = TOKEN_VIEW_MAX_VALUES,
) -> str:
    """A self-contained HTML page (no external files) for a report dict: every section of
    ``SECTIONS`` the report has, a table of contents and the token view when the report holds a
    token sample. A report with a ``compare`` block (``moee report --compare``) becomes the
    comparison page: every section of model A and model B side by side, plus their differences."""
    if report.get("compare"):
        return _compare_page(report, expert_layers, token_view_max_values)
    page = Page(expert_layers=expert_layers, token_view_max_values=token_view_max_values)
    sections = []
    for section in SECTIONS:
        inner = _render_section(section, report, page)
        if inner is not None:
            sections.append((section, inner))
    model = str(report["summary"].get("model", ""))
    return _document(
        f"moee expert-specialization report: {model}",
        f"Expert-specialization report <small>{esc(model)}</small>",
        sections,
        page.data_blocks,
    )


def _compare_page(report: dict, expert_layers: Sequence[int] | None, token_view_max_values: int) -> str:
    cmp = report["compare"]
    labels = [str(x) for x in cmp.get("labels", ["A", "B"])]
    if len(labels) != 2 or not isinstance(cmp.get("b"), dict):
        raise ValueError("report['compare'] needs two labels and model B's report under 'b'")
    reports = [
        {k: v for k, v in report.items() if k != "compare"},
        {"meta": report.get("meta", {}), **cmp["b"]},
    ]
    pages = [
        Page(expert_layers=expert_layers, prefix=f"m{i}-", token_view_max_values=token_view_max_values // 2)
        for i in range(2)
    ]
    sections = []
    for section in SECTIONS:
        inner = [_render_section(section, r, p) for r, p in zip(reports, pages)]
        if all(x is None for x in inner):
            continue
        cols = "".join(
            f"<div><p class='col-label'>{esc(label)}</p>"
            f"{x if x is not None else '<p class=missing>not in this report</p>'}</div>"
            for label, x in zip(labels, inner)
        )
        sections.append((section, f"<div class='cols'>{cols}</div>"))
        if section.id == "summary":
            sections.append((COMPARE_SECTION, _compare(report, pages[0])))
    names = " vs ".join(esc(x) for x in labels)
    return _document(
        f"moee expert-specialization comparison: {' vs '.join(labels)}",
        f"Expert-specialization comparison <small>{names}</small>",
        sections,
        [b for p in pages for b in p.data_blocks],
    )
