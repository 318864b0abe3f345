"""What a section of the specialization report is, and what it is given.

A :class:`Section` is everything about one part of the report in one place: its id (the key of
``report.json`` and the element id and anchor of the page), its title, what it tallies per text
(:class:`Tally`, fed a :class:`TextRoutes`), its permutation baseline, its JSON part and its
page part. The accumulator (:mod:`moee.analysis.specialization.accumulator`) and the page
(:mod:`moee.analysis.specialization.html`) only iterate the registry of
:mod:`moee.analysis.specialization.sections`.

The heavy state stays shared, held once by the accumulator and read by the sections (never copied
into one): the per-token-type tables (``token_tables``), the route sample behind the baselines
(``Draw.sample``) and the per-layer marginals every section reads (``load``, ``first``,
``importance``, ``entropy_sum``; see :class:`Routed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from moee.analysis.specialization.markup import Page

__all__ = ["Draw", "Options", "Results", "Routed", "Section", "Shape", "Tally", "TextRoutes"]


@dataclass(frozen=True)
class Shape:
    """The accumulator's dimensions and context settings, what a section's tally is sized by."""

    n_layers: int
    n_experts: int
    top_k: int
    n_contexts: int
    context_window: int


@dataclass
class TextRoutes:
    """One text's routes as every tally reads them, computed once per text by the accumulator:
    token ids ``ids [T]``, dense router probabilities ``probs [T, L, E]``, the experts counted
    ``selection [T, L, k]``, the first choices ``first [T, L]``, the per-layer expert counts
    ``counts [L, E]``, its domain and the model's predicted next tokens (or ``None``)."""

    index: int
    ids: np.ndarray
    probs: np.ndarray
    selection: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    domain: str | None
    predicted: np.ndarray | None

    @cached_property
    def per_layer(self) -> np.ndarray:
        """The selection as a one-hot float32 ``[L, E, T]`` (built once, for the tallies that
        multiply it: co-activation and the cross-layer pairs)."""
        T, L, _ = self.selection.shape
        mask = np.zeros((T, L, self.probs.shape[2]), dtype=np.float32)
        np.put_along_axis(mask, np.asarray(self.selection), 1.0, axis=2)
        return mask.transpose(1, 2, 0)


class Tally(Protocol):
    """What one section keeps per text: fixed-size arrays (their bytes count in
    ``SpecializationAccumulator.state_bytes``; a dict attribute of arrays counts its values)."""

    def update(self, text: TextRoutes) -> None: ...


class Routed(Protocol):
    """The accumulator as the sections read it: its dimensions, the shared tables and marginals,
    and the tallies by section id."""

    n_layers: int
    n_experts: int
    top_k: int
    n_texts: int
    n_tokens: int
    permutations: int
    seed: int
    load: np.ndarray  # [L, E] tokens whose top-k holds the expert
    first: np.ndarray  # [L, E] first choices
    importance: np.ndarray  # [L, E] sum of dense probabilities
    entropy_sum: np.ndarray  # [L] sum of per-token dense entropies
    tallies: dict[str, Any]

    @property
    def token_tables(self) -> Any: ...

    def token_table(
        self, key: str = "input", min_token_count: int = 1
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class Options:
    """The knobs of ``SpecializationAccumulator.result``, what sections read of them."""

    n_top_tokens: int = 8
    min_token_count: int = 5
    n_coactivation_pairs: int = 10
    n_specialization_tokens: int = 10


@dataclass
class Draw:
    """What a section's baseline is drawn with: the one seeded generator (``rng``, shared by every
    section, drawn from in ``Section.draw_order``), the route sample ``sample [R, L, k]``, the
    baselines drawn before it (``drawn``, by section id), the progress bar (``step()``) and the
    sampled routes' tokens ``sample_tokens [R, len(TOKEN_KEYS)]`` (``-1``: none), by which a
    baseline keeps to the tokens its statistic counts."""

    acc: Routed
    rng: np.random.Generator
    sample: np.ndarray
    options: Options
    drawn: dict[str, Any]
    step: Callable[[], None]
    sample_tokens: np.ndarray | None = None


@dataclass
class Results:
    """What a section's JSON part is computed from: the accumulator, the decoder, the options, every
    section's baseline, and the other sections' results (``results["layers"]``, computed once)."""

    acc: Routed
    decode: Callable[[Sequence[int]], str]
    options: Options
    baselines: dict[str, Any]
    sections: dict[str, Section]
    _done: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, section_id: str) -> Any:
        if section_id not in self._done:
            section = self.sections[section_id]
            if section.result is None:
                raise KeyError(f"section {section_id!r} is filled by the report driver, not the accumulator")
            self._done[section_id] = section.result(self)
        return self._done[section_id]


@dataclass(frozen=True)
class Section:
    """One section of the report.

    ``id`` keys ``report.json`` and is the page element's id; ``title`` heads it on the page.
    ``result(results)`` returns its JSON part, or is ``None`` when the report driver fills it (the
    run's metadata, the saturation and the token view need other models or the texts).
    ``tally(shape)`` makes what it keeps per text (``None``: it reads the shared tables only).
    ``baseline(draw)`` draws its permutation baseline, read back as ``results.baselines[id]``;
    ``baseline_steps(acc)`` is how many progress steps that takes; ``draw_order`` is its place among
    the draws from the one seeded generator (a new section takes the next free number, so the other
    baselines keep their values). ``null`` says what its baseline shuffles (listed in the
    ``baselines`` section). ``render(report, page)`` returns its page markup, figures included, or
    ``None`` to leave it out; ``None`` for a section with no place of its own on the page.
    ``always`` renders it even when the report lacks its key (it reads other sections).
    """

    id: str
    title: str
    result: Callable[[Results], Any] | None = None
    render: Callable[[dict, Page], str | None] | None = None
    tally: Callable[[Shape], Tally] | None = None
    baseline: Callable[[Draw], Any] | None = None
    baseline_steps: Callable[[Routed], int] | None = None
    draw_order: int | None = None
    null: str | None = None
    always: bool = False
