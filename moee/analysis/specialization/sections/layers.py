"""Per-layer load balance: CV of importance and load, max/min over mean load, dead experts and
the routing entropy, from the shared marginals (no tally, no permutation baseline)."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _grid, _subplots, _table
from moee.analysis.specialization.sections.base import Results, Section
from moee.analysis.specialization.statistics import _cv, _entropy


def _result(results: Results) -> list[dict]:
    acc = results.acc
    L, E, k, N = acc.n_layers, acc.n_experts, acc.top_k, acc.n_tokens
    mean_load = N * k / E
    entropy = acc.entropy_sum / N
    layers = []
    for layer in range(L):
        layers.append(
            {
                "layer": layer,
                "cv_importance": _cv(acc.importance[layer]),
                "cv_load": _cv(acc.load[layer]),
                "max_over_mean_load": float(acc.load[layer].max() / mean_load),
                "min_over_mean_load": float(acc.load[layer].min() / mean_load),
                "dead_experts": int((acc.load[layer] == 0).sum()),
                "routing_entropy": float(entropy[layer]),
                "routing_entropy_normalized": float(entropy[layer] / np.log(E)) if E > 1 else 0.0,
                "load_entropy_normalized": _entropy(acc.load[layer]) / np.log(E) if E > 1 else 0.0,
                "load_fraction": (acc.load[layer] / (N * k)).round(6).tolist(),
                "importance_fraction": (acc.importance[layer] / N).round(6).tolist(),
            }
        )
    return layers


def _render(report: dict, page: Page) -> str:
    s = report["summary"]
    L, E = s["n_layers"], s["n_experts"]
    layers = report["layers"]
    xs = np.arange(L)
    fig, ax = _subplots(1, 3, figsize=(12, 3))
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
    fig, a = _subplots(figsize=(min(12, 2 + E * 0.15), 0.8 + L * 0.3))
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


SECTION = Section("layers", "Per-layer load balance", result=_result, render=_render)
