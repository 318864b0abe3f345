"""Consecutive-token repetition of the first choice (Mixtral paper, section 5): the rate at which
adjacent tokens of a text keep the same first-choice expert, beside its exact permutation
expectation with each text's first choices shuffled against its own positions.

The null keeps the text grouping: a router whose choice depends on the text alone (one expert for a
whole text) repeats at rate 1 and so does its baseline; only an order inside the text (the next
token staying with the expert of this one) lifts the rate above it."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _subplots, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes


class _Repeats:
    """Adjacent pairs with the same first choice per layer, the number of adjacent pairs, and the
    expected number of such pairs with each text's first choices shuffled over its positions."""

    def __init__(self, shape: Shape):
        self.n_experts = shape.n_experts
        self.repeats = np.zeros(shape.n_layers, dtype=np.int64)
        self.expected = np.zeros(shape.n_layers)
        self.n_adjacent = 0

    def update(self, text: TextRoutes) -> None:
        first, T = text.first, text.first.shape[0]
        if T > 1:
            self.repeats += (first[1:] == first[:-1]).sum(0)
            self.n_adjacent += T - 1
            L, E = first.shape[1], self.n_experts
            c = np.bincount((first + np.arange(L) * E).ravel(), minlength=L * E).reshape(L, E)
            # a random order of the text's T choices: (T - 1) adjacent pairs, each equal with
            # probability sum_E c_E (c_E - 1) / (T (T - 1))
            self.expected += (c * (c - 1)).sum(axis=1) / T


def _baseline(draw: Draw) -> list[float]:
    """``sum_texts sum_E c_E (c_E - 1) / T / (adjacent pairs)`` with ``c_E`` a text's first-choice
    counts: the exact expectation of the rate when each text's first choices are shuffled against
    its positions (texts keep their own choices)."""
    tally = draw.acc.tallies["repetition"]
    if not tally.n_adjacent:
        return [0.0] * draw.acc.n_layers
    return [float(v) for v in tally.expected / tally.n_adjacent]


def _result(results: Results) -> dict:
    tally, base = results.acc.tallies["repetition"], results.baselines["repetition"]
    return {
        "n_adjacent_pairs": int(tally.n_adjacent),
        "by_layer": [
            {
                "layer": layer,
                "rate": float(tally.repeats[layer] / tally.n_adjacent) if tally.n_adjacent else 0.0,
                "baseline": base[layer],
            }
            for layer in range(results.acc.n_layers)
        ],
    }


def _render(report: dict, page: Page) -> str:
    rep = report["repetition"]["by_layer"]
    fig, ax = _subplots(figsize=(5.5, 3))
    xs = [r["layer"] for r in rep]
    ax.plot(xs, [r["rate"] for r in rep], marker="o", label="first-choice repetition")
    ax.plot(xs, [r["baseline"] for r in rep], linestyle="--", label="baseline (permutation)")
    ax.set_xlabel("MoE layer")
    ax.legend(fontsize=7)
    return (
        "<p class='lead'>Rate at which consecutive tokens of a text keep the same first choice, beside "
        "its baseline: each text's first choices shuffled against its own positions (exact permutation "
        "expectation; texts keep their choices, so a router that picks one expert per text scores at "
        "it).</p>"
        + _table(
            ["layer", "rate", "baseline (permutation)"],
            [[r["layer"], _fmt(r["rate"]), _fmt(r["baseline"])] for r in rep],
        )
        + _figure(fig, "repetition", "First-choice repetition per layer beside its permutation baseline.")
    )


SECTION = Section(
    "repetition",
    "Consecutive-token repetition of the first choice",
    result=_result,
    render=_render,
    tally=_Repeats,
    baseline=_baseline,
    draw_order=5,
    null="each text's first choices shuffled against its own positions (exact expectation)",
)
