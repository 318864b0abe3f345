"""The page toolkit of the specialization report's sections: figures, tables and number formats.

Every section's renderer (``sections/<name>.py``) draws with these: static figures are matplotlib
PNGs inlined as base64 (``_figure``), tables escape nothing themselves (cells are markup; escape
corpus text with ``esc`` before), and the page assets in ``page_assets/`` are inlined as text.
:mod:`moee.analysis.specialization.html` assembles the sections into the page.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

__all__ = [
    "TOKEN_VIEW_MAX_VALUES",
    "Page",
    "esc",
    "_asset",
    "_baseline_plot",
    "_figure",
    "_fmt",
    "_grid",
    "_nan",
    "_plt",
    "_subplots",
    "_table",
    "_tok",
]

esc = html.escape

#: Upper bound on the dense probabilities the token view embeds (tokens x layers x experts);
#: with 3-decimal rounding this keeps the page at a few MB for any model size.
TOKEN_VIEW_MAX_VALUES = 400_000


def _asset(name: str) -> str:
    text = (resources.files("moee.analysis.specialization") / "page_assets" / name).read_text("utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # would end the inline block
        raise ValueError(f"page asset {name} must not contain a closing </script> or </style> tag")
    return text


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(fig, alt: str, caption: str = "") -> str:
    """A matplotlib figure as an inline PNG ``<figure>``; ``caption`` is markup written by this
    module (never corpus text)."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # axes that count layers or checkpoints: integer ticks only
        if "layer" in ax.get_xlabel() or "order" in ax.get_xlabel():
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    cap = f"<figcaption>{caption}</figcaption>" if caption else ""
    return (
        f'<figure class=\'fig\'><img alt="{esc(alt)}" src="data:image/png;base64,{_png(fig)}">{cap}</figure>'
    )


def _subplots(*args, **kwargs):
    """``plt.subplots`` with matplotlib's constrained layout: titles, tick labels and colorbars of
    neighbouring axes are spaced so that none overlaps another (every figure of the page)."""
    return _plt().subplots(*args, layout="constrained", **kwargs)


def _grid(n: int, cols: int = 4, w: float = 3.2, h: float = 2.3):
    cols = max(1, min(cols, n))
    rows = int(np.ceil(n / cols))
    fig, axes = _subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    return fig, axes.ravel()[:n]


def _table(headers: Sequence[str], rows: Iterable[Sequence], *, raw_headers: bool = False) -> str:
    """A table; cells are markup (escape corpus text before), headers are escaped unless raw."""
    head = "".join(f"<th>{h if raw_headers else esc(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td{_num_class(c)}>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _num_class(cell) -> str:
    return " class='num'" if isinstance(cell, (int, float, np.integer, np.floating)) else ""


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _tok(token: str) -> str:
    """A token string shown with its whitespace visible (repr), escaped."""
    return f"<code>{esc(repr(token))}</code>"


def _nan(values) -> np.ndarray:
    """A list with ``None`` (undefined statistic) as a float array with NaN, for plotting."""
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def _baseline_plot(
    xs: Sequence[int], series: dict[str, tuple[Sequence, Sequence]], alt: str, caption: str
) -> str:
    """One line per statistic over MoE layers with its baseline dashed in the same colour."""
    fig, ax = _subplots(figsize=(5.5, 3))
    for name, (values, baseline) in series.items():
        line = ax.plot(xs, _nan(values), marker="o", label=name)[0]
        ax.plot(xs, _nan(baseline), linestyle="--", color=line.get_color(), label=f"{name}: permutation")
    ax.set_xlabel("MoE layer")
    ax.legend(fontsize=7)
    return _figure(fig, alt, caption)


@dataclass
class Page:
    """What a section renderer needs besides the report: the layers to show in detail and the
    prefix that keeps element ids unique when two reports share one page."""

    expert_layers: Sequence[int] | None = None
    prefix: str = ""
    token_view_max_values: int = TOKEN_VIEW_MAX_VALUES
    data_blocks: list[str] = field(default_factory=list)

    def layers_to_show(self, n_layers: int) -> list[int]:
        if self.expert_layers is not None:
            return [int(x) for x in self.expert_layers]
        return sorted({0, n_layers // 2, n_layers - 1})
