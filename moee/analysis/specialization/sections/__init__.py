"""The registry of the specialization report's sections: one module per section, one entry here.

Each module defines ``SECTION`` (a :class:`~moee.analysis.specialization.sections.base.Section`):
what it tallies per text, its baseline, its JSON part and its page part with its figures.
:data:`SECTIONS` lists them in the order of ``report.json`` and of the page; the accumulator
tallies, draws and computes, and the page renders, by iterating it. Adding a section is one module
and one entry here (see docs/SPECIALIZATION.md, "Add a section").
"""

from __future__ import annotations

from collections.abc import Sequence

from moee.analysis.specialization.sections import (
    ablation,
    baselines,
    coactivation,
    cross_layer,
    domains,
    experts,
    layer_agreement,
    layers,
    meta,
    repetition,
    router_entropy,
    router_swap,
    saturation,
    steering,
    summary,
    token_specialization,
    token_view,
    vocabulary,
)
from moee.analysis.specialization.sections.base import Section

__all__ = ["SECTIONS", "check_sections"]


def check_sections(sections: Sequence[Section]) -> None:
    """Refuse a registry whose ids or baseline draw orders repeat, or whose baselines lack one."""
    ids = [s.id for s in sections]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"report sections share ids: {repeated}")
    drawn = [s for s in sections if s.baseline is not None]
    if any(s.draw_order is None for s in drawn):
        raise ValueError(
            "every section with a baseline needs a draw_order: "
            + ", ".join(s.id for s in drawn if s.draw_order is None)
        )
    orders = [s.draw_order for s in drawn]
    if len(set(orders)) != len(orders):
        raise ValueError(f"sections share a baseline draw_order: {sorted(orders)}")


#: Every section, in the order of report.json and of the page.
SECTIONS: tuple[Section, ...] = (
    meta.SECTION,
    summary.SECTION,
    token_view.SECTION,
    baselines.SECTION,
    layers.SECTION,
    router_entropy.SECTION,
    saturation.SECTION,
    token_specialization.SECTION,
    experts.SECTION,
    ablation.SECTION,
    router_swap.SECTION,
    steering.SECTION,
    vocabulary.SECTION,
    domains.SECTION,
    coactivation.SECTION,
    cross_layer.SECTION,
    repetition.SECTION,
    layer_agreement.SECTION,
)
check_sections(SECTIONS)
