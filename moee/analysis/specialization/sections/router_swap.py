"""Router swap: the loss change when one MoE layer's router (then every layer's) comes from a donor
checkpoint of the same architecture, beside its null, the layer's own router with its expert order
permuted (same loads, assignment destroyed), read from ``moee ablate --swap-from`` (``swap.json``,
``--router-swap``): checked before any work starts (:func:`read_swap`) and against the report's
model once that loads (:func:`router_swap_section`), through
:mod:`moee.analysis.specialization.ablate_results`."""

from __future__ import annotations

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

__all__ = ["SECTION", "UNAVAILABLE", "read_swap", "router_swap_section"]

#: The section when no router swap is given.
UNAVAILABLE = {"available": False, "reason": "no router swap given (--router-swap)"}
_OPTIONAL = ("null", "null_std", "recovered")
_KEEP = ("layer", "router", "delta", "delta_by_domain", "null", "null_std", "null_by_domain", "recovered")


def _problems(result: dict) -> str | None:
    rows = result.get("swaps")
    if not isinstance(rows, list) or not rows:
        return "'swaps' is not a non-empty list"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"swaps[{i}] is not an object"
        layer = row.get("layer")
        if layer != "all" and not index(layer):
            return f"swaps[{i}] has no layer (an index or 'all')"
        bad = [] if number(row.get("delta")) else ["delta"]
        bad += [k for k in _OPTIONAL if row.get(k) is not None and not number(row[k])]
        if bad:
            return f"swaps[{i}] has no number for {', '.join(bad)}"
    return None


def read_swap(path: str | Path) -> dict:
    """The ``swap.json`` of ``path`` (the file, or the ``moee ablate --swap-from`` folder holding
    it), refused with the fix when it is missing or not a router-swap result."""
    return read_result(path, "swap", _problems)


def router_swap_section(
    result: dict, *, model: str | None, n_layers: int, n_experts: int, weights_digest: str | None = None
) -> dict:
    """The section's JSON part from a :func:`read_swap` result, refused when it is a swap of
    another model (:func:`~moee.analysis.specialization.ablate_results.check_model`)."""
    pairs = [(int(r["layer"]), 0) for r in result["swaps"] if r["layer"] != "all"]
    meta = check_model(
        result,
        "swap",
        pairs,
        model=model,
        n_layers=n_layers,
        n_experts=n_experts,
        weights_digest=weights_digest,
    )
    return {
        "available": True,
        "reason": None,
        "source": result.get("source"),
        "model": meta.get("model"),
        "weights_digest": meta.get("weights_digest"),
        "command": meta.get("command"),
        "donor": result.get("donor"),
        "donor_digest": result.get("donor_digest"),
        "n_tokens": result.get("n_tokens"),
        "base_loss": (result.get("base") or {}).get("loss"),
        "null": result.get("null"),
        "null_draws": result.get("null_draws"),
        "seed": result.get("seed"),
        "swaps": [{k: row.get(k) for k in _KEEP} for row in result["swaps"]],
    }


def _nan(rows: list[dict], key: str) -> np.ndarray:
    return np.asarray([row[key] if number(row.get(key)) else np.nan for row in rows], dtype=float)


def _render(report: dict, page: Page) -> str:
    sw = report["router_swap"]
    if not sw.get("available"):
        return unavailable_html("a router swap", "swap", sw.get("reason"))
    rows = sw["swaps"]
    has_null = not np.isnan(_nan(rows, "null")).all()
    fig = _swap_figure(rows, has_null)
    return (
        _lead(sw, has_null)
        + _swap_table(rows)
        + _figure(
            fig,
            "router swap vs permuted-router null",
            "Left: loss change per MoE layer with the donor's router (blue) and with the layer's own router "
            "with permuted experts (grey, the null; bars: sd over the draws). Right: the share of the "
            "null's cost the donor's router recovers.",
        )
    )


def _swap_figure(rows: list[dict], has_null: bool) -> Any:
    """Left: each swap's loss change beside its permuted null; right: the share recovered."""
    labels = [str(r["layer"]) for r in rows]
    x = np.arange(len(rows))
    delta, null, std = _nan(rows, "delta"), _nan(rows, "null"), _nan(rows, "null_std")
    fig, ax = _subplots(1, 2 if has_null else 1, figsize=(11 if has_null else 7, 3.4), squeeze=False)
    ax = ax[0]
    width = 0.4 if has_null else 0.7
    ax[0].bar(x - (width / 2 if has_null else 0), delta, width, label="donor's router", color="tab:blue")
    if has_null:
        ax[0].bar(
            x + width / 2,
            null,
            width,
            yerr=np.nan_to_num(std),
            capsize=2,
            label="own router, experts permuted (null)",
            color="lightgray",
            edgecolor="gray",
        )
    ax[0].axhline(0, color="black", linewidth=0.6)
    ax[0].set_xticks(x, labels)
    ax[0].set_xlabel("router replaced (MoE position; 'all': every one)")
    ax[0].set_ylabel("loss change (nats/token)")
    ax[0].legend(fontsize=7)
    if has_null:
        recovered = _nan(rows, "recovered")
        ax[1].bar(x, recovered, 0.6, color="tab:green")
        ax[1].axhline(1, color="black", linestyle="--", linewidth=0.6)
        ax[1].axhline(0, color="black", linewidth=0.6)
        ax[1].set_xticks(x, labels)
        ax[1].set_xlabel("router replaced (MoE position; 'all': every one)")
        ax[1].set_title("recovered = 1 - swap / null", fontsize=9)
    return fig


def _swap_table(rows: list[dict]) -> str:
    """One row per swap: the donor's loss change, the null, its spread and the share recovered."""
    return _table(
        ["layer", "router", "donor's router", "permuted null", "null spread (sd)", "recovered"],
        [
            [
                esc(str(r["layer"])),
                esc(str(r.get("router"))),
                signed(r.get("delta")),
                signed(r.get("null")),
                "-" if not number(r.get("null_std")) else f"{r['null_std']:.4f}",
                "-" if not number(r.get("recovered")) else f"{r['recovered']:.3f}",
            ]
            for r in rows
        ],
    )


def _lead(sw: dict, has_null: bool) -> str:
    """The paragraph saying what was swapped, on what, the null and the every-layer reading."""
    rows = sw["swaps"]
    every = next((r for r in rows if r["layer"] == "all"), None)
    reading = ""
    if every is not None and number(every.get("null")):
        reading = (
            f" Every layer at once: the donor's routers cost {signed(every['delta'])} nats/token of the "
            f"{signed(every['null'])} that permuted routers cost"
            + (f" (recovered {every['recovered']:.3f})" if number(every.get("recovered")) else "")
            + "."
        )
    donor = esc(str(sw.get("donor")))
    digest = (
        f" (weights digest <code>{esc(str(sw['donor_digest']))}</code>)" if sw.get("donor_digest") else ""
    )
    return (
        "<p class='lead'>Router swap (from <code>moee ablate --swap-from</code>, "
        f"<code>{esc(str(sw.get('source')))}</code>): the change in next-token loss when one MoE layer's "
        f"router, and last every layer's, is the donor's, <code>{donor}</code>{digest}, on "
        f"{esc(str(sw.get('n_tokens')))} predicted tokens of the swap's corpus (base loss "
        f"{signed(sw.get('base_loss')).lstrip('+')} nats/token). "
        + (
            "The null is the same layer's own router with its expert order permuted (a derangement: the "
            "same loads, every token sent to other experts; mean and spread of "
            f"{esc(str(sw.get('null_draws')))} seeded draws, seed {esc(str(sw.get('seed')))}), so a swap "
            "reads as: the donor's router costs X of the Y a scrambled router costs; recovered = 1 - X/Y "
            "(1: the donor routes like the model's own router, 0: no better than a scrambled one)." + reading
            if has_null
            else "The permuted-router null was not run (<code>--no-null</code>)."
        )
        + "</p>"
    )


SECTION = Section("router_swap", "Router swap (donor checkpoint)", render=_render)
