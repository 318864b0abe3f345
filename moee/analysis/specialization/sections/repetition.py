"""Consecutive-token repetition of the first choice (Mixtral paper, section 5): the rate at which
adjacent tokens of a text keep the same first-choice expert, beside its exact permutation
expectation (first choices shuffled against positions)."""

from __future__ import annotations

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _plt, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes


class _Repeats:
    def __init__(self, shape: Shape):
        self.repeats = np.zeros(shape.n_layers, dtype=np.int64)
        self.n_adjacent = 0

    def update(self, text: TextRoutes) -> None:
        first, T = text.first, text.first.shape[0]
        if T > 1:
            self.repeats += (first[1:] == first[:-1]).sum(0)
            self.n_adjacent += T - 1


def _baseline(draw: Draw) -> list[float]:
    """``sum_E c_E (c_E - 1) / (N (N - 1))`` with ``c_E`` the first-choice counts: the exact
    expectation of the rate when first choices are shuffled against positions."""
    acc = draw.acc
    N, L = acc.n_tokens, acc.n_layers
    c = acc.first.astype(np.float64)
    repetition = ((c * (c - 1)).sum(axis=1) / (N * (N - 1))).tolist() if N > 1 else [0.0] * L
    return [float(r) for r in repetition]


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


SECTION = Section(
    "repetition",
    "Consecutive-token repetition of the first choice",
    result=_result,
    render=_render,
    tally=_Repeats,
    baseline=_baseline,
    draw_order=5,
    null="first choices shuffled against positions (exact expectation)",
)
