"""How the baselines were drawn (permutations, seed, the route sample) and, per section, what its
baseline shuffles (``Section.null``): the block the accumulator returns as ``baselines()["method"]``."""

from __future__ import annotations

from moee.analysis.specialization.markup import Page, _table, esc
from moee.analysis.specialization.sections.base import Results, Section


def _result(results: Results) -> dict:
    return results.baselines["method"]


def _render(report: dict, page: Page) -> str:
    s, b = report["summary"], report.get("baselines", {})
    return (
        f"<p>Expert selection: {esc(str(s.get('selection', '')))}.</p>"
        "<p>Every baseline is the statistic itself recomputed with the routes shuffled against what the "
        f"statistic relates them to ({esc(str(b.get('kind', '')))}, {esc(str(b.get('permutations', '-')))} "
        f"draws, seed {esc(str(b.get('seed', '-')))}, {esc(str(b.get('sampled_tokens', '-')))} sampled token "
        f"routes{'; the whole corpus, so the permutation is exact' if b.get('exact') else ''}).</p>"
        + _table(
            ["statistic", "null (what is shuffled)"],
            [[esc(name), esc(str(v))] for name, v in b.items() if isinstance(v, str) and name != "kind"],
        )
    )


SECTION = Section("baselines", "Baselines", result=_result, render=_render, always=True)
