"""Router saturation over training (OLMoE paper, section 5): per layer, the overlap of each
checkpoint's top-1 / top-k selection with the final checkpoint's on the same tokens. It needs
other models, so the report driver fills it (``report.saturation_section``); here are its null,
its page part and its figure."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _plt, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Section


def _render(report: dict, page: Page) -> str:
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
    fig, ax = _subplots(1, 2, figsize=(11, 3.4))
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
    tokenization = sat.get("tokenization") or {}
    warning = (
        "<p class='missing'>These checkpoints tokenise the corpus differently from the model this page "
        f"describes ({esc(str(tokenization.get('model') or 'the model'))}): they are another model's "
        "training series, and their saturation says nothing about this model's routing.</p>"
        if tokenization.get("same_as_model") is False
        else ""
    )
    return (
        warning
        + f"<p class='lead'>Router saturation (OLMoE paper, section 5): for the first {esc(str(sat.get('n_texts')))} "
        f"texts ({esc(str(sat.get('n_tokens')))} tokens), the share of tokens whose first choice (left) or top-k "
        f"(right) in each checkpoint matches the final checkpoint <code>{esc(str(sat.get('final', '')))}</code>, "
        "per layer (coloured) and on average (black), beside the permutation baseline (tokens shuffled) "
        "and random routing.</p>"
        + table
        + _figure(fig, "router saturation", "Overlap with the final checkpoint's routing over training.")
    )


SECTION = Section(
    "saturation",
    "Router saturation over training",
    render=_render,
    null="the checkpoint's routes shuffled against the tokens (exact "
    "expectation: product of the two marginals); random routing 1/E (top-1), k/E (top-k)",
)
