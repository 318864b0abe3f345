"""Steering: what biasing chosen experts' router logits does to the next-token distribution (mean KL
to the unsteered one), to the embedding (cosine to the unsteered one) and to the experts' selection,
beside its null, the same biases on experts of the same layers drawn at random. Read from
``moee ablate --steer`` results (``steering.json``, ``--steering``, one per case, e.g. a boost and a
suppression of the same experts): each checked before any work starts (:func:`read_steering`) and
against the report's model once that loads (:func:`steering_section`), through
:mod:`moee.analysis.specialization.ablate_results`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moee.analysis.specialization.ablate_results import (
    check_model,
    index,
    number,
    read_result,
    signed,
    unavailable_html,
)
from moee.analysis.specialization.markup import Page, _figure, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Section

__all__ = ["SECTION", "UNAVAILABLE", "read_steering", "steering_section"]

#: The section when no steering result is given.
UNAVAILABLE = {"available": False, "reason": "no steering result given (--steering)"}
_SPREADS = ("kl_next_token", "embedding_cosine_mean", "selection_shift")


def _problems(result: dict) -> str | None:
    biases = result.get("biases")
    if not isinstance(biases, list) or not biases:
        return "'biases' is not a non-empty list"
    for i, b in enumerate(biases):
        if not isinstance(b, dict) or not (index(b.get("layer")) and index(b.get("expert"))):
            return f"biases[{i}] lacks a layer and expert index"
        if not number(b.get("bias")):
            return f"biases[{i}] has no number for bias"
    if not number(result.get("kl_next_token")):
        return "no number for kl_next_token"
    cosine = result.get("embedding_cosine")
    if not isinstance(cosine, dict) or not number(cosine.get("mean")):
        return "'embedding_cosine' has no mean"
    rates = result.get("selection_rate")
    if not isinstance(rates, list) or not all(
        isinstance(r, dict) and number(r.get("before")) and number(r.get("after")) for r in rates
    ):
        return "'selection_rate' is not a list of before/after rates"
    null = result.get("null")
    if null is not None:
        if not isinstance(null, dict):
            return "'null' is not an object"
        for key in _SPREADS:
            spread = null.get(key)
            if not isinstance(spread, dict) or not (number(spread.get("mean")) and number(spread.get("std"))):
                return f"null.{key} has no mean and std"
    return None


def read_steering(path: str | Path) -> dict:
    """The ``steering.json`` of ``path`` (the file, or the ``moee ablate --steer`` folder holding
    it), refused with the fix when it is missing or not a steering result."""
    return read_result(path, "steering", _problems)


def _pairs(result: dict) -> list[tuple[int, int]]:
    pairs = [(int(b["layer"]), int(b["expert"])) for b in result["biases"]]
    for draw in (result.get("null") or {}).get("draws") or []:
        pairs += [(int(b["layer"]), int(b["expert"])) for b in draw.get("biases") or []]
    return pairs


def steering_section(
    results: Sequence[dict],
    *,
    model: str | None,
    n_layers: int,
    n_experts: int,
    weights_digest: str | None = None,
) -> dict:
    """The section's JSON part from :func:`read_steering` results (one case each), refused when
    one is of another model (:func:`~moee.analysis.specialization.ablate_results.check_model`)."""
    cases = []
    for result in results:
        meta = check_model(
            result,
            "steering",
            _pairs(result),
            model=model,
            n_layers=n_layers,
            n_experts=n_experts,
            weights_digest=weights_digest,
        )
        null = result.get("null")
        cases.append(
            {
                "source": result.get("source"),
                "model": meta.get("model"),
                "weights_digest": meta.get("weights_digest"),
                "command": meta.get("command"),
                "biases": result["biases"],
                "n_tokens": result.get("n_tokens"),
                "kl_next_token": result["kl_next_token"],
                "embedding_cosine": result["embedding_cosine"],
                "selection_rate": result["selection_rate"],
                "selection_shift": result.get("selection_shift"),
                "null": None
                if null is None
                else {
                    "description": null.get("description"),
                    "seed": null.get("seed"),
                    "n_draws": len(null.get("draws") or []) or None,
                    "kl_exceeds_draws": null.get("kl_exceeds_draws"),
                    **{key: null[key] for key in _SPREADS},
                    "draws": [
                        {"biases": d.get("biases"), "kl_next_token": d.get("kl_next_token")}
                        for d in null.get("draws") or []
                    ],
                },
            }
        )
    return {"available": True, "reason": None, "cases": cases}


def _label(case: dict) -> str:
    return " ".join(f"{b['layer']}:{b['expert']}{b['bias']:+g}" for b in case["biases"])


def _render(report: dict, page: Page) -> str:
    st = report["steering"]
    if not st.get("available"):
        return unavailable_html("steering", "steering", st.get("reason"))
    cases = st["cases"]
    return (
        _lead(cases)
        + _case_table(cases)
        + _figure(
            _null_bars(cases),
            "steering vs random-expert null",
            "Per case (biases below the bars): the steered experts (red) and the same biases on random "
            "experts of the same layers (grey: mean, bars: sd over the draws). Left: next-token KL; "
            "middle: embedding change, 1 - cosine; right: mean change of the biased experts' selection rate.",
        )
    )


def _null_bars(cases: list[dict]) -> Any:
    """The figure: per case, the steered experts' KL, embedding change and selection shift beside
    the random-expert null's."""
    x = np.arange(len(cases))
    labels = [_label(c) for c in cases]
    fig, ax = _subplots(1, 3, figsize=(12, 3.4))
    panels = (
        ("KL(unsteered || steered), nats", lambda c: c["kl_next_token"], "kl_next_token", lambda v: v),
        (
            "1 - embedding cosine to unsteered",
            lambda c: 1.0 - c["embedding_cosine"]["mean"],
            "embedding_cosine_mean",
            lambda v: 1.0 - v,
        ),
        (
            "selection rate change (after - before)",
            lambda c: c.get("selection_shift"),
            "selection_shift",
            None,
        ),
    )
    for axis, (title, value, key, transform) in zip(ax, panels):
        steered = [value(c) if number(value(c)) else np.nan for c in cases]
        axis.bar(x - 0.2, steered, 0.4, color="tab:red", label="steered experts")
        nulls = [c["null"] for c in cases]
        if any(n is not None for n in nulls):
            mean = [np.nan if n is None else n[key]["mean"] for n in nulls]
            mean = [m if transform is None else transform(m) for m in mean]
            std = [0.0 if n is None else n[key]["std"] for n in nulls]
            axis.bar(
                x + 0.2,
                mean,
                0.4,
                yerr=std,
                capsize=2,
                color="lightgray",
                edgecolor="gray",
                label="random experts",
            )
        axis.axhline(0, color="black", linewidth=0.6)
        axis.set_xticks(x, labels, fontsize=7)
        axis.set_title(title, fontsize=9)
    ax[0].legend(fontsize=7)
    return fig


def _case_table(cases: list[dict]) -> str:
    """One row per case: its KL, embedding cosine and selection rates beside the null's."""
    rows = []
    for c in cases:
        null = c["null"]
        rates = ", ".join(
            f"{esc(str(r.get('layer')))}:{esc(str(r.get('expert')))} {r['before']:.3f}&rarr;{r['after']:.3f}"
            for r in c["selection_rate"]
        )
        rows.append(
            [
                esc(_label(c)),
                f"{c['kl_next_token']:.4f}",
                "-"
                if null is None
                else f"{null['kl_next_token']['mean']:.4f} &plusmn; {null['kl_next_token']['std']:.4f}",
                "-"
                if null is None or not isinstance(null.get("kl_exceeds_draws"), int)
                else f"{null['kl_exceeds_draws']} of {null.get('n_draws')}",
                f"{c['embedding_cosine']['mean']:.4f}",
                "-"
                if null is None
                else f"{null['embedding_cosine_mean']['mean']:.4f} &plusmn; {null['embedding_cosine_mean']['std']:.4f}",
                rates,
                "-" if null is None else signed(null["selection_shift"]["mean"], 3),
            ]
        )
    table = _table(
        [
            "biases (layer:expert bias)",
            "KL",
            "null KL (mean &plusmn; sd)",
            "KL above null draws",
            "embedding cosine",
            "null cosine",
            "selection rate before &rarr; after",
            "null selection change",
        ],
        rows,
        raw_headers=True,
    )
    return table


def _lead(cases: list[dict]) -> str:
    """The paragraph saying what was steered and measured, and what the null was (if it ran)."""
    sources = ", ".join(f"<code>{esc(str(c.get('source')))}</code>" for c in cases)
    described = next((c["null"].get("description") for c in cases if c["null"] is not None), None)
    return (
        f"<p class='lead'>Steering (from <code>moee ablate --steer</code>, {sources}): the router logits of "
        "the listed experts get the listed bias before the router selects; shown are the mean KL of the "
        "next-token distribution to the unsteered one (nats, over the result's corpus tokens), the mean "
        "cosine of each text's embedding to its unsteered embedding, and the biased experts' selection "
        "rates. "
        + (
            "The null is the same biases on experts of the same layers drawn at random (other than the "
            f"steered ones; as recorded: {esc(str(described))}), measured alike: steered experts that move "
            "the output more than the random ones do are special, a KL within the null's spread is what "
            "any expert of that bias would do.</p>"
            if described is not None
            else "The random-expert null was not run (<code>--no-null</code>).</p>"
        )
    )


SECTION = Section("steering", "Expert steering (router logit bias)", render=_render)
