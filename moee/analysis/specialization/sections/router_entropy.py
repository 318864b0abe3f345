"""Router entropy and KL to uniform per layer: of the dense distribution (per token, averaged), of
the selection (the dense distribution restricted to the k selected experts, renormalised) and of
the marginals (load and mean dense distribution); the reference is a uniform router."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Results, Section, Shape, TextRoutes
from moee.analysis.specialization.statistics import _entropy


class _SelectionEntropy:
    """``entropy_sum [L]``: the sum over tokens of the entropy of the selected experts' weights."""

    def __init__(self, shape: Shape):
        self.entropy_sum = np.zeros(shape.n_layers)

    def update(self, text: TextRoutes) -> None:
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.take_along_axis(text.probs, np.asarray(text.selection), axis=2)
            w = w / w.sum(axis=2, keepdims=True)
            self.entropy_sum += -np.where(w > 0, w * np.log(w), 0.0).sum(axis=(0, 2))


def _entropies(acc) -> dict:
    """Router entropy and KL to uniform, per layer: of the dense distribution (per token,
    averaged), of the selection (the dense distribution restricted to the k selected experts
    and renormalised), and of the marginals (load and mean dense distribution)."""
    L, E, k, N = acc.n_layers, acc.n_experts, acc.top_k, acc.n_tokens
    logE, logk = float(np.log(E)), float(np.log(k))
    layers = []
    for layer in range(L):
        dense = float(acc.entropy_sum[layer] / N)
        sel = float(acc.tallies["router_entropy"].entropy_sum[layer] / N)
        load_h = _entropy(acc.load[layer].astype(np.float64))
        imp_h = _entropy(acc.importance[layer])
        layers.append(
            {
                "layer": layer,
                "dense_entropy": dense,
                "dense_entropy_normalized": dense / logE if E > 1 else 0.0,
                "dense_kl_uniform": max(0.0, logE - dense),
                "selection_entropy": sel,
                "selection_entropy_normalized": sel / logk if k > 1 else 0.0,
                "selection_kl_uniform": max(0.0, logk - sel),
                "load_entropy": load_h,
                "load_kl_uniform": max(0.0, logE - load_h),
                "importance_entropy": imp_h,
                "importance_kl_uniform": max(0.0, logE - imp_h),
            }
        )
    return {
        "by_layer": layers,
        "baseline": {
            "dense_entropy": logE,
            "dense_kl_uniform": 0.0,
            "selection_entropy": logk,
            "selection_kl_uniform": 0.0,
            "load_kl_uniform": 0.0,
            "description": "a uniform router (every expert 1/E): entropy log E, KL to uniform 0; "
            "selection: log k and 0 (equal weights on the k selected)",
        },
    }


def _result(results: Results) -> dict:
    return _entropies(results.acc)


def _render(report: dict, page: Page) -> str:
    re_ = report["router_entropy"]
    rows = re_["by_layer"]
    s = report["summary"]
    E = s["n_experts"]
    xs = [r["layer"] for r in rows]
    fig, ax = _subplots(1, 2, figsize=(11, 3.2))
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


SECTION = Section(
    "router_entropy",
    "Router entropy and KL to uniform",
    result=_result,
    render=_render,
    tally=_SelectionEntropy,
)
