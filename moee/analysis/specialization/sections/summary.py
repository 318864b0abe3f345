"""The report's summary: the corpus and model dimensions and the per-layer means of the other
sections; on the page, every specialisation statistic over its baseline at a glance, and the run's
metadata (``report["meta"]``)."""

from __future__ import annotations

import json

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _nan, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Results, Section


def _result(results: Results) -> dict:
    acc, layers, repetition = results.acc, results["layers"], results["repetition"]
    return {
        "n_texts": int(acc.n_texts),
        "n_tokens": int(acc.n_tokens),
        "n_layers": acc.n_layers,
        "n_experts": acc.n_experts,
        "top_k": acc.top_k,
        "mean_cv_importance": float(np.mean([x["cv_importance"] for x in layers])),
        "mean_cv_load": float(np.mean([x["cv_load"] for x in layers])),
        "max_over_mean_load": float(max(x["max_over_mean_load"] for x in layers)),
        "mean_routing_entropy_normalized": float(np.mean([x["routing_entropy_normalized"] for x in layers])),
        "mean_repetition_rate": float(np.mean([r["rate"] for r in repetition["by_layer"]])),
    }


def _render(report: dict, page: Page) -> str:
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
        fig, ax = _subplots(figsize=(7, 3.2))
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


SECTION = Section("summary", "Summary", result=_result, render=_render)
