"""Vocabulary specialization: ``N_k(x, E) / N_x`` for input token types seen at least
``min_token_count`` times, summarised per layer as the token-weighted mean of its maximum over
experts; its baseline is the input key's of the token specialization (the routes of the counted
tokens shuffled against them), read from the shared token tables."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _baseline_plot, _fmt, _table, _tok, esc
from moee.analysis.specialization.sections.base import Draw, Results, Section


def _baseline(draw: Draw) -> list[float | None]:
    vocab = draw.drawn["token_specialization"]["input"]
    return [float(v) for v in vocab[0]] if vocab is not None else [None] * draw.acc.n_layers


def _by_layer(acc, decode, min_count: int) -> dict:
    E = acc.n_experts
    ids, n_x, counts = acc.token_table("input", min_count)
    by_layer = []
    for layer in range(acc.n_layers):
        if not ids.size:
            by_layer.append({"layer": layer, "n_token_types": 0, "weighted_max_ratio": None, "top": []})
            continue
        ratio = counts[:, layer] / n_x[:, None]  # [types, E]
        best = ratio.max(axis=1)  # max over experts per token type
        best_e = E - 1 - ratio[:, ::-1].argmax(axis=1)  # ties: the highest expert index
        top_types = np.argsort(-(best * np.log1p(n_x)), kind="stable")[:15]
        by_layer.append(
            {
                "layer": layer,
                "n_token_types": int(ids.size),
                "weighted_max_ratio": float((best * n_x).sum() / n_x.sum()),
                "top": [
                    {
                        "token": decode([int(ids[i])]),
                        "expert": int(best_e[i]),
                        "ratio": float(best[i]),
                        "n_x": int(n_x[i]),
                    }
                    for i in top_types
                ],
            }
        )
    return {"min_token_count": int(min_count), "by_layer": by_layer}


def _result(results: Results) -> dict:
    vocabulary = _by_layer(results.acc, results.decode, results.options.min_token_count)
    for entry, value in zip(vocabulary["by_layer"], results.baselines["vocabulary"]):
        entry["baseline"] = value
    return vocabulary


def _render(report: dict, page: Page) -> str:
    voc = report["vocabulary"]
    return (
        f"<p class='lead'>N_k(x,E)/N_x for token types seen at least {esc(str(voc['min_token_count']))} "
        "times; per layer the token-weighted mean of max<sub>E</sub> N_k(x,E)/N_x, beside its baseline: "
        "the same statistic with the routes of those tokens shuffled against them (permutation; rarer "
        "types are left out of the draws as of the statistic; it depends on how often each type "
        "occurs, so it is far above k/E for rare types).</p>"
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


SECTION = Section(
    "vocabulary",
    "Vocabulary specialization",
    result=_result,
    render=_render,
    baseline=_baseline,
    draw_order=1,
    null="routes of the counted tokens (types seen >= min_token_count times) shuffled against those tokens",
)
