"""The self-contained HTML page of a specialization report, assembled from the section registry.

One file that works offline: static figures are matplotlib PNGs inlined as base64, the style
sheet and the token view's script are the project's own files in ``page_assets/`` inlined as
text, and nothing is fetched. Every section's markup and figures are in its module of
:mod:`moee.analysis.specialization.sections`; the table of contents, the single page and the
two-model comparison (a report with a ``compare`` block: every section of both models in two
columns) are all built from the registry, in its order.

Escaping: every string that comes from the corpus, the model or the command line goes through
``html.escape`` in markup; the token view's data is embedded as escaped JSON (see
:mod:`moee.analysis.specialization.sections.token_view`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moee.analysis.specialization import sections as registry
from moee.analysis.specialization.markup import (
    TOKEN_VIEW_MAX_VALUES,
    Page,
    _asset,
    _figure,
    _fmt,
    _grid,
    _nan,
    _subplots,
    _table,
    esc,
)
from moee.analysis.specialization.sections.base import Section
from moee.analysis.specialization.sections.token_view import token_view_payload

__all__ = [
    "SECTIONS",
    "Section",
    "TOKEN_VIEW_MAX_VALUES",
    "COMPARE_SECTION",
    "page_sections",
    "render_html",
    "token_view_payload",
]


def page_sections() -> tuple[Section, ...]:
    """The sections of the page, in page order: every registry section with a page part. A section
    whose key the report lacks is left out (unless it is ``always`` rendered)."""
    return tuple(s for s in registry.SECTIONS if s.render is not None)


#: The page's sections of the registry as it is at import (``page_sections()`` reads it anew).
SECTIONS: tuple[Section, ...] = page_sections()


def _compare(report: dict, page: Page) -> str | None:
    """Model B minus model A per layer, and how often the two pick the same experts."""
    cmp = report.get("compare")
    if not cmp:
        return None
    a, b = (esc(str(x)) for x in cmp["labels"])
    parts = [f"<p class='lead'>A = {a}, B = {b}. Every other section shows A and B side by side.</p>"]
    diffs = (cmp.get("differences") or {}).get("by_layer") or []
    if not cmp.get("same_shape", True) or not diffs:
        parts.append(
            "<p class='missing'>The two models differ in layers, experts or k: no per-layer differences.</p>"
        )
    else:
        metrics = [m for m in diffs[0] if m != "layer"]
        plotted = [m for m in metrics if any(r[m] is not None for r in diffs)]  # all-undefined: table only
        parts.append("<h3>Differences per layer (B - A)</h3>")
        parts.append(
            _table(["layer", *metrics], [[r["layer"], *[_fmt(r[m], 4) for m in metrics]] for r in diffs])
        )
        if plotted:
            fig, axes = _grid(len(plotted), cols=3, w=3.6, h=2.6)
            xs = [r["layer"] for r in diffs]
            for ax, m in zip(axes, plotted):
                v = np.nan_to_num(_nan(r[m] for r in diffs))
                ax.bar(xs, v, color=np.where(v >= 0, "#1f77b4", "#d62728"))
                ax.axhline(0, color="black", linewidth=0.8)
                ax.set_title(f"B - A: {m.replace('_', ' ')}", fontsize=8)
                ax.set_xlabel("MoE layer", fontsize=7)
                ax.tick_params(labelsize=7)
            parts.append(_figure(fig, "differences B - A", "Per-layer statistics of B minus those of A."))
    so = cmp.get("selection_overlap") or {}
    parts.append("<h3>Same tokens, same experts</h3>")
    if not so.get("available"):
        parts.append(f"<p class='missing'>Not computed: {esc(str(so.get('reason') or 'not available'))}.</p>")
    else:
        rows = so["by_layer"]
        rnd = so.get("random_baseline", {})
        fig, ax = _subplots(figsize=(6, 3))
        xs = [r["layer"] for r in rows]
        for key, marker in (("top1", "o"), ("topk", "s")):
            line = ax.plot(xs, [r[key] for r in rows], marker=marker, label=key)[0]
            ax.plot(
                xs, [r[f"{key}_permutation"] for r in rows], linestyle="--", color=line.get_color(), alpha=0.7
            )
            if key in rnd:
                ax.axhline(rnd[key], color=line.get_color(), linestyle=":", alpha=0.7)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("MoE layer")
        ax.legend(fontsize=7)
        parts.append(
            "<p>Share of tokens whose first choice (top1) or top-k (topk, mean |S<sub>A</sub> &cap; "
            "S<sub>B</sub>| / k) is the same expert id in A and B (meaningful for two checkpoints of one "
            "run), beside the permutation baseline (dashed) and random routing (dotted).</p>"
            + _table(
                ["layer", "top1", "permutation", "topk", "permutation"],
                [
                    [
                        r["layer"],
                        _fmt(r["top1"]),
                        _fmt(r["top1_permutation"]),
                        _fmt(r["topk"]),
                        _fmt(r["topk_permutation"]),
                    ]
                    for r in rows
                ],
            )
            + _figure(fig, "selection overlap", "Same expert ids on the same tokens, A vs B.")
        )
    return "".join(parts)


#: The comparison page's own section (after the summary), built from ``report["compare"]``.
COMPARE_SECTION = Section("compare", "Comparison: B - A and shared selections", render=_compare)


# ------------------------------------------------------------------------------------- pages


def _render_section(section: Section, report: dict, page: Page) -> str | None:
    if section.id not in report and not section.always:
        return None
    return section.render(report, page)


def _document(title: str, heading: str, sections: list[tuple[Section, str]], data_blocks: list[str]) -> str:
    toc = "".join(f"<li><a href='#{s.id}'>{esc(s.title)}</a></li>" for s, _ in sections)
    body = "".join(f"<section id='{s.id}'><h2>{esc(s.title)}</h2>{inner}</section>" for s, inner in sections)
    script = f"<script>{_asset('token_view.js')}</script>" if data_blocks else ""
    return "\n".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            "<meta name='viewport' content='width=device-width, initial-scale=1'>",
            f"<title>{esc(title)}</title><style>{_asset('page.css')}</style></head><body>",
            f"<nav id='toc'><h2>Contents</h2><ol>{toc}</ol></nav>",
            f"<main><h1>{heading}</h1>",
            body,
            "</main>",
            *data_blocks,
            script,
            "</body></html>",
        ]
    )


def _stages(sections: Sequence[Section], progress: bool):
    """The sections in order, with a progress bar on stderr naming the one being drawn (its figures
    take most of the page's time, seconds for a large model)."""
    from tqdm.auto import tqdm

    with tqdm(sections, desc="page", unit="section", disable=not progress) as bar:
        for section in bar:
            bar.set_postfix_str(section.id, refresh=True)
            yield section


def render_html(
    report: dict,
    *,
    expert_layers: Sequence[int] | None = None,
    token_view_max_values: int = TOKEN_VIEW_MAX_VALUES,
    progress: bool = False,
) -> str:
    """A self-contained HTML page (no external files) for a report dict: every section of
    ``SECTIONS`` the report has, a table of contents and the token view when the report holds a
    token sample. A report with a ``compare`` block (``moee report --compare``) becomes the
    comparison page: every section of model A and model B side by side, plus their differences.
    ``progress``: a progress bar per section on stderr."""
    if report.get("compare"):
        return _compare_page(report, expert_layers, token_view_max_values, progress)
    page = Page(expert_layers=expert_layers, token_view_max_values=token_view_max_values)
    sections = []
    for section in _stages(page_sections(), progress):
        inner = _render_section(section, report, page)
        if inner is not None:
            sections.append((section, inner))
    model = str(report["summary"].get("model", ""))
    return _document(
        f"moee expert-specialization report: {model}",
        f"Expert-specialization report <small>{esc(model)}</small>",
        sections,
        page.data_blocks,
    )


def _compare_page(
    report: dict, expert_layers: Sequence[int] | None, token_view_max_values: int, progress: bool = False
) -> str:
    cmp = report["compare"]
    labels = [str(x) for x in cmp.get("labels", ["A", "B"])]
    if len(labels) != 2 or not isinstance(cmp.get("b"), dict):
        raise ValueError("report['compare'] needs two labels and model B's report under 'b'")
    reports = [
        {k: v for k, v in report.items() if k != "compare"},
        {"meta": report.get("meta", {}), **cmp["b"]},
    ]
    pages = [
        Page(expert_layers=expert_layers, prefix=f"m{i}-", token_view_max_values=token_view_max_values // 2)
        for i in range(2)
    ]
    sections = []
    for section in _stages(page_sections(), progress):
        inner = [_render_section(section, r, p) for r, p in zip(reports, pages)]
        if all(x is None for x in inner):
            continue
        cols = "".join(
            f"<div><p class='col-label'>{esc(label)}</p>"
            f"{x if x is not None else '<p class=missing>not in this report</p>'}</div>"
            for label, x in zip(labels, inner)
        )
        sections.append((section, f"<div class='cols'>{cols}</div>"))
        if section.id == "summary":
            sections.append((COMPARE_SECTION, _compare(report, pages[0])))
    names = " vs ".join(esc(x) for x in labels)
    return _document(
        f"moee expert-specialization comparison: {' vs '.join(labels)}",
        f"Expert-specialization comparison <small>{names}</small>",
        sections,
        [b for p in pages for b in p.data_blocks],
    )
