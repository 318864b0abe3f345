"""Causal expert importance: the loss change when each expert is disabled, beside its load-matched
null, read from a ``moee ablate`` result (``importance.json``). The report routes texts and cannot
run the ablation's extra forward passes, so the driver reads the file (``--ablation``): it is
checked before any work starts (:func:`read_ablation`) and against the report's model once that
loads (:func:`ablation_section`), both through :mod:`moee.analysis.specialization.ablate_results`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moee.analysis.specialization.ablate_results import check_model, read_result, unavailable_html
from moee.analysis.specialization.ablate_results import number as _number
from moee.analysis.specialization.ablate_results import signed as _sci
from moee.analysis.specialization.markup import Page, _figure, _plt, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Section

__all__ = ["SECTION", "UNAVAILABLE", "ablation_section", "read_ablation"]

#: The section when no ablation is given.
UNAVAILABLE = {"available": False, "reason": "no ablation given (--ablation)"}
#: Experts listed in the page's table.
TOP_EXPERTS = 10
_EXPERT_NUMBERS = ("load", "delta")
_EXPERT_OPTIONAL = ("null", "excess", "max_activation")


def read_ablation(path: str | Path) -> dict:
    """The ``importance.json`` of ``path`` (the file, or the ``moee ablate --out`` folder holding
    it), refused with the fix when it is missing or not an expert-importance result."""
    return read_result(path, "importance", _format_problems)


def _format_problems(result: Any) -> str | None:
    if not isinstance(result, dict):
        return "not a JSON object"
    missing = [k for k in ("experts", "spearman_importance_load", "super_experts", "mode") if k not in result]
    if missing:
        return f"missing {', '.join(missing)}"
    experts = result["experts"]
    if not isinstance(experts, list) or not experts:
        return "'experts' is not a non-empty list"
    for i, row in enumerate(experts):
        if not isinstance(row, dict):
            return f"experts[{i}] is not an object"
        if not all(isinstance(row.get(k), int) and row[k] >= 0 for k in ("layer", "expert")):
            return f"experts[{i}] lacks a layer and expert index"
        bad = [k for k in _EXPERT_NUMBERS if not _number(row.get(k))]
        bad += [k for k in _EXPERT_OPTIONAL if row.get(k) is not None and not _number(row[k])]
        if bad:
            return f"experts[{i}] has no number for {', '.join(bad)}"
    corr = result["spearman_importance_load"]
    if not isinstance(corr, dict) or not isinstance(corr.get("by_layer"), dict):
        return "'spearman_importance_load' lacks by_layer"
    if not isinstance(result["super_experts"], dict):
        return "'super_experts' is not an object"
    return None


def ablation_section(
    result: dict, *, model: str | None, n_layers: int, n_experts: int, weights_digest: str | None = None
) -> dict:
    """The section's JSON part from a :func:`read_ablation` result, refused when it is an ablation
    of another model: its MoE layers and experts must be the report's, and the weights digest (when
    the ablation records one and ``weights_digest`` is given) or else the model name it records must
    be the report's ``model``."""
    pairs = [(int(r["layer"]), int(r["expert"])) for r in result["experts"]]
    meta = check_model(
        result,
        "importance",
        pairs,
        model=model,
        n_layers=n_layers,
        n_experts=n_experts,
        weights_digest=weights_digest,
    )
    source = result.get("source", "the ablation")
    keep = (
        "layer",
        "expert",
        "load",
        "delta",
        "null",
        "excess",
        "importance_rank",
        "load_rank",
        "max_activation",
    )
    corr = result["spearman_importance_load"]
    return {
        "available": True,
        "reason": None,
        "source": source,
        "model": meta.get("model"),
        "weights_digest": meta.get("weights_digest"),
        "command": meta.get("command"),
        "mode": result["mode"],
        "renormalize": result.get("renormalize"),
        "n_tokens": result.get("n_tokens"),
        "domains": result.get("domains"),
        "base_loss": (result.get("base") or {}).get("loss"),
        "null": result.get("null"),
        "experts": [{k: row.get(k) for k in keep} for row in result["experts"]],
        "spearman_importance_load": {
            "pooled": corr.get("pooled"),
            "pooled_excess": corr.get("pooled_excess"),
            "by_layer": corr["by_layer"],
        },
        "super_experts": result["super_experts"],
    }


def _render(report: dict, page: Page) -> str:
    ab = report["ablation"]
    if not ab.get("available"):
        return unavailable_html("an expert ablation", "importance", ab.get("reason"))
    rows = ab["experts"]
    fig = _importance_figure(ab)
    return (
        _lead(ab)
        + _top_table(rows)
        + _super_text(ab["super_experts"])
        + _figure(
            fig,
            "expert importance vs load",
            "Left: each expert's loss change when disabled (coloured by layer) and its load-matched "
            "null (grey crosses) against its load. Right: Spearman(importance, load) per layer.",
        )
    )


def _importance_figure(ab: dict) -> Any:
    """Left: importance and its null against load, coloured by layer; right: Spearman per layer."""
    plt = _plt()
    rows = ab["experts"]
    layers = np.asarray([r["layer"] for r in rows])
    load = np.asarray([r["load"] for r in rows], dtype=float)
    delta = np.asarray([r["delta"] for r in rows], dtype=float)
    null = np.asarray([np.nan if r.get("null") is None else r["null"] for r in rows], dtype=float)
    n_layers = int(layers.max()) + 1
    fig, ax = _subplots(1, 2, figsize=(11, 3.6), width_ratios=[2, 1])
    cmap = plt.get_cmap("viridis")
    norm = plt.Normalize(0, max(1, n_layers - 1))
    if not np.isnan(null).all():
        ax[0].scatter(load, null, marker="x", s=14, color="gray", alpha=0.7, label="load-matched null")
    ax[0].scatter(load, delta, c=layers, cmap=cmap, norm=norm, s=16, label="importance (disabled)")
    ax[0].axhline(0, color="black", linewidth=0.6)
    ax[0].set_xlabel("load (share of tokens whose top-k holds the expert)")
    ax[0].set_ylabel("loss change (nats/token)")
    ax[0].legend(fontsize=7)
    corr = ab["spearman_importance_load"]
    by_layer = sorted((int(k), v) for k, v in corr["by_layer"].items())
    ax[1].bar([k for k, _ in by_layer], [np.nan if v is None else v for _, v in by_layer], color=cmap(0.6))
    if _number(corr.get("pooled")):
        ax[1].axhline(corr["pooled"], color="black", linestyle="--", label="all experts")
        ax[1].legend(fontsize=7)
    ax[1].set_ylim(-1, 1)
    ax[1].set_xlabel("MoE layer")
    ax[1].set_title("Spearman(importance, load)", fontsize=9)
    fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=norm), ax=ax[0], label="MoE layer", fraction=0.04)
    return fig


def _top_table(rows: list[dict]) -> str:
    """The TOP_EXPERTS most important experts with their null, excess and load rank."""
    top = sorted(rows, key=lambda r: -r["delta"])[:TOP_EXPERTS]
    return _table(
        ["rank", "layer:expert", "load", "importance", "null", "excess", "load rank"],
        [
            [
                r["importance_rank"] if isinstance(r.get("importance_rank"), int) else "-",
                f"{int(r['layer'])}:{int(r['expert'])}",
                f"{r['load']:.3f}",
                _sci(r["delta"]),
                _sci(r.get("null")),
                _sci(r.get("excess")),
                r["load_rank"] if isinstance(r.get("load_rank"), int) else "-",
            ]
            for r in top
        ],
    )


def _super_text(sup: dict) -> str:
    """The super experts flagged, the loss of disabling them together and the largest activations."""
    flagged = sup.get("flagged") or []
    names = ", ".join(f"{esc(str(f.get('layer')))}:{esc(str(f.get('expert')))}" for f in flagged) or "none"
    super_text = (
        f"<p>Super experts (largest output |activation| at least {esc(str(sup.get('ratio')))} times the "
        f"median expert's): {names}"
        + (
            f"; disabling them together: {_sci(sup.get('delta'))} nats/token"
            if _number(sup.get("delta"))
            else ""
        )
        + ".</p>"
    )
    largest = [f for f in sup.get("largest") or [] if isinstance(f, dict) and _number(f.get("over_median"))]
    if largest:
        super_text = super_text[: -len("</p>")] + (
            " Largest activations over the median: "
            + ", ".join(
                f"{esc(str(f.get('layer')))}:{esc(str(f.get('expert')))} ({f['over_median']:.1f}x)"
                for f in largest[:5]
            )
            + ".</p>"
        )
    return super_text


def _lead(ab: dict) -> str:
    """The paragraph saying what was ablated, on what, the null and the importance-load correlation."""
    rows = ab["experts"]
    corr = ab["spearman_importance_load"]
    has_null = ab.get("null") is not None
    beyond = sum(1 for r in rows if _number(r.get("excess")) and r["excess"] > 0)
    domains = ab.get("domains") or {}
    return (
        "<p class='lead'>Causal importance (from <code>moee ablate</code>, "
        f"<code>{esc(str(ab.get('source')))}</code>): the change in next-token loss when one expert is "
        f"disabled (mode <code>{esc(str(ab.get('mode')))}</code>), on {esc(str(ab.get('n_tokens')))} "
        f"predicted tokens of the ablation's corpus ({esc(', '.join(map(str, domains)) or 'one domain')}; "
        f"base loss {_sci(ab.get('base_loss')).lstrip('+')} nats/token). "
        + (
            "The null is what disabling an expert of the same load costs when which expert it is does not "
            "matter: each token, with probability the expert's load, loses one of its k selected experts "
            "drawn at random (same layer, same mode); the excess is importance minus null "
            f"(as the ablation records it: {esc(str(ab.get('null')))}). {beyond} of {len(rows)} experts cost more than their null. "
            if has_null
            else "The load-matched null was not run (<code>--no-null</code>). "
        )
        + f"Spearman(importance, load) over all experts: {_sci(corr.get('pooled'), 3)}"
        + (f", of the excess: {_sci(corr.get('pooled_excess'), 3)}" if has_null else "")
        + ". The loads are the ablation corpus's, not this report's.</p>"
    )


SECTION = Section(
    "ablation",
    "Causal expert importance (ablation)",
    render=_render,
)
