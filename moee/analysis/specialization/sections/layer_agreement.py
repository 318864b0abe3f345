"""Layer-to-layer agreement of the first choices of adjacent MoE layers: NMI of their joint counts
and the exact match under the best one-to-one expert matching (expert ids of different layers are
unrelated), each beside a random table with the same margins (layer l+1 shuffled against l)."""

from __future__ import annotations

import numpy as np

from moee.analysis.overlap import matched_from_table as _matched_from_table
from moee.analysis.overlap import nmi_from_table as _nmi_from_table
from moee.analysis.specialization.markup import Page, _figure, _fmt, _subplots, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes
from moee.analysis.specialization.statistics import _random_table


class _Joint:
    """``joint [L - 1, E, E]``: tokens with first choice a in layer l and b in layer l + 1."""

    def __init__(self, shape: Shape):
        L, E = shape.n_layers, shape.n_experts
        self.joint = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)

    def update(self, text: TextRoutes) -> None:
        L, E = text.first.shape[1], self.joint.shape[-1]
        if L > 1:
            first = text.first
            pair_off = (np.arange(L - 1) * E * E)[None, :]
            keys = pair_off + first[:, :-1] * E + first[:, 1:]
            self.joint += np.bincount(keys.ravel(), minlength=(L - 1) * E * E).reshape(L - 1, E, E)


def _baseline(draw: Draw) -> list[tuple[float, float]]:
    """Per adjacent pair, the mean NMI and matched agreement of ``permutations`` random tables with
    the joint's exact margins."""
    rng, P = draw.rng, draw.acc.permutations
    agreement = []
    for joint in draw.acc.tallies["layer_agreement"].joint:
        runs = [_random_table(joint.sum(1), joint.sum(0), rng) for _ in range(P)]
        agreement.append(
            (
                float(np.mean([_nmi_from_table(t.astype(np.float64)) for t in runs])),
                float(np.mean([_matched_from_table(t) for t in runs])),
            )
        )
        draw.step()
    return agreement


def _result(results: Results) -> dict:
    joint = results.acc.tallies["layer_agreement"].joint
    return {
        "pairs": [
            {
                "layers": [layer, layer + 1],
                "nmi": _nmi_from_table(joint[layer].astype(np.float64)),
                "matched_agreement": _matched_from_table(joint[layer]),
                "nmi_baseline": nmi_b,
                "matched_baseline": matched_b,
            }
            for layer, (nmi_b, matched_b) in enumerate(results.baselines["layer_agreement"])
        ],
    }


def _render(report: dict, page: Page) -> str:
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
        fig, ax = _subplots(figsize=(5.5, 3))
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


SECTION = Section(
    "layer_agreement",
    "Layer-to-layer routing agreement",
    result=_result,
    render=_render,
    tally=_Joint,
    baseline=_baseline,
    baseline_steps=lambda acc: max(acc.n_layers - 1, 0),
    draw_order=3,
    null="first choices of layer l+1 shuffled against layer l (exact margins)",
)
