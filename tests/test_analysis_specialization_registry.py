"""The specialization report is a registry of sections: every section module is registered, the
JSON and the page use the same ids in the registry's order, and a new section is one module (the
example of docs/SPECIALIZATION.md, "Add a section") that reaches the JSON and the page."""

from __future__ import annotations

import importlib
import pkgutil
import re

import numpy as np
import pytest

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator, render_html, write_report
from moee.analysis.specialization import sections as registry
from moee.analysis.specialization.html import page_sections
from moee.analysis.specialization.markup import Page, _table
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes
from moee.analysis.specialization.sections.token_view import TokenView

L, E, K = 2, 4, 2
#: The sections the report driver fills (they need other models, the texts or the command line).
DRIVER = {"meta", "saturation", "ablation", "router_swap", "steering", "token_view"}


def _accumulator(n_texts: int = 12, seed: int = 0) -> SpecializationAccumulator:
    rng = np.random.default_rng(seed)
    acc = SpecializationAccumulator(L, E, K, draws=BaselineDraws(permutations=2, seed=seed))
    for i in range(n_texts):
        ids = rng.integers(0, 9, 6 + i % 3)
        p = rng.dirichlet(np.ones(E), size=(ids.size, L))
        acc.update(ids, p, text_index=i, domain="ab"[i % 2])
    return acc


def _report(acc: SpecializationAccumulator) -> dict:
    rep = acc.result(min_token_count=1)
    rep["summary"]["model"] = "m"
    rep["meta"] = {"command": "moee report", "versions": {}}
    rep["saturation"] = {"available": False, "reason": "no checkpoints given (--checkpoints)"}
    rep["ablation"] = {"available": False, "reason": "no ablation given (--ablation)"}
    rep["router_swap"] = {"available": False, "reason": "no router swap given (--router-swap)"}
    rep["steering"] = {"available": False, "reason": "no steering result given (--steering)"}
    view = TokenView(n_texts=1, max_tokens=8)
    probs = np.full((3, L, E), 1 / E)
    selected = np.broadcast_to(np.arange(K), (3, L, K))
    view.add(
        {
            "index": 0,
            "domain": "a",
            "ids": np.arange(3),
            "probs": probs,
            "selected": selected,
            "predicted": None,
        }
    )
    rep["token_view"] = view.result(lambda ids: " ".join(map(str, ids)))
    return rep


def test_every_section_module_is_registered_once():
    package = registry.__path__
    modules = {m.name for m in pkgutil.iter_modules(package)} - {"base"}
    defined = {importlib.import_module(f"{registry.__name__}.{m}").SECTION.id: m for m in modules}
    registered = [s.id for s in registry.SECTIONS]
    assert sorted(registered) == sorted(defined), "a section module is missing from SECTIONS (or the reverse)"
    assert all(
        importlib.import_module(f"{registry.__name__}.{m}").SECTION in registry.SECTIONS for m in modules
    )


def test_the_registry_refuses_repeated_ids_and_draw_orders():
    layers = registry.SECTIONS[4]
    with pytest.raises(ValueError, match="share ids"):
        registry.check_sections([*registry.SECTIONS, layers])
    drawn = next(s for s in registry.SECTIONS if s.baseline is not None)
    twin = Section("twin", "Twin", baseline=drawn.baseline, draw_order=drawn.draw_order)
    with pytest.raises(ValueError, match="draw_order"):
        registry.check_sections([*registry.SECTIONS, twin])
    with pytest.raises(ValueError, match="needs a draw_order"):
        registry.check_sections([Section("x", "X", baseline=drawn.baseline)])


def test_who_fills_each_section_and_what_its_baseline_says():
    assert {s.id for s in registry.SECTIONS if s.result is None} == DRIVER
    assert {s.id for s in registry.SECTIONS if s.render is None} == {"meta"}  # shown in the summary
    assert all(s.null for s in registry.SECTIONS if s.baseline is not None)
    acc = _accumulator()
    method = acc.baselines()["method"]
    assert [k for k in method if k in {s.id for s in registry.SECTIONS}] == [
        s.id for s in registry.SECTIONS if s.null is not None
    ]
    assert list(acc.result(min_token_count=1)) == [s.id for s in registry.SECTIONS if s.result is not None]


def _page_ids(page: str) -> tuple[list[str], list[str]]:
    return re.findall(r"<section id='([^']+)'>", page), re.findall(r"<li><a href='#([^']+)'>", page)


@pytest.mark.slow
def test_json_and_page_carry_the_same_ids_in_registry_order(tmp_path):
    rep = _report(_accumulator())
    paths = write_report(rep, tmp_path)
    import json

    written = json.loads(paths["json"].read_text())
    assert list(written) == [s.id for s in registry.SECTIONS]
    sections, toc = _page_ids(paths["html"].read_text())
    assert sections == toc == [s.id for s in page_sections()]
    assert set(sections) <= set(written)  # every part of the page is a part of the JSON, same id


def test_a_report_without_a_registered_section_is_refused(tmp_path):
    rep = _report(_accumulator())
    del rep["cross_layer"]
    with pytest.raises(ValueError, match=r"missing sections: \['cross_layer'\]"):
        write_report(rep, tmp_path)


@pytest.mark.slow
def test_a_section_the_report_lacks_is_left_off_the_page():
    rep = _report(_accumulator())
    del rep["layer_agreement"]
    sections, toc = _page_ids(render_html(rep))
    assert "layer_agreement" not in sections and "layer_agreement" not in toc
    assert "baselines" in sections  # it reads the summary: always on the page


# ------------------------------------------------------------ the example of docs/SPECIALIZATION.md
class _Positions:
    """``sums [L, E]``: the sum of the positions (token index in its text) of the tokens whose
    top-k holds the expert."""

    def __init__(self, shape: Shape):
        self.sums = np.zeros((shape.n_layers, shape.n_experts))

    def update(self, text: TextRoutes) -> None:
        pos = np.arange(text.ids.size, dtype=np.float64)
        for layer in range(text.selection.shape[1]):
            np.add.at(
                self.sums[layer], text.selection[:, layer].ravel(), np.repeat(pos, text.selection.shape[2])
            )


def _positions_baseline(draw: Draw) -> list[float]:
    """Positions shuffled against routes: every expert's mean position is the corpus mean."""
    sums = draw.acc.tallies["positions"].sums
    return [float(sums[layer].sum() / draw.acc.load[layer].sum()) for layer in range(draw.acc.n_layers)]


def _positions_result(results: Results) -> dict:
    acc = results.acc
    mean = np.divide(
        acc.tallies["positions"].sums,
        acc.load,
        out=np.zeros((acc.n_layers, acc.n_experts)),
        where=acc.load > 0,
    )
    return {"mean_position": mean.round(4).tolist(), "baseline": results.baselines["positions"]}


def _positions_render(report: dict, page: Page) -> str:
    pos = report["positions"]
    rows = [
        [layer, f"{base:.2f}", ", ".join(f"{m:.2f}" for m in row)]
        for layer, (row, base) in enumerate(zip(pos["mean_position"], pos["baseline"]))
    ]
    return _table(["layer", "corpus mean", "mean position per expert"], rows)


POSITIONS = Section(
    "positions",
    "Where in a text each expert is chosen",
    result=_positions_result,
    render=_positions_render,
    tally=_Positions,
    baseline=_positions_baseline,
    draw_order=7,
    null="positions shuffled against routes (exact: the corpus mean position)",
)


@pytest.mark.slow
def test_a_new_section_is_one_registry_entry_and_reaches_the_json_and_the_page(monkeypatch, tmp_path):
    before = _report(_accumulator())
    bytes_before = _accumulator().state_bytes()
    monkeypatch.setattr(registry, "SECTIONS", (*registry.SECTIONS, POSITIONS))
    registry.check_sections(registry.SECTIONS)
    acc = _accumulator()
    rep = _report(acc)
    assert {k: v for k, v in rep.items() if k != "positions"} == {
        **before,
        "baselines": {**before["baselines"], "positions": POSITIONS.null},
    }  # the other sections (and their seeded baselines) do not move
    # brute force: the mean position of the tokens selecting expert e of layer 0
    rng = np.random.default_rng(0)
    sums, counts = np.zeros(E), np.zeros(E)
    for i in range(12):
        ids = rng.integers(0, 9, 6 + i % 3)
        p = rng.dirichlet(np.ones(E), size=(ids.size, L))
        top = np.argsort(-p[:, 0], axis=1)[:, :K]
        for t, row in enumerate(top):
            sums[row] += t
            counts[row] += 1
    np.testing.assert_allclose(rep["positions"]["mean_position"][0], np.round(sums / counts, 4))
    assert rep["positions"]["baseline"][0] == pytest.approx(sums.sum() / counts.sum())
    paths = write_report(rep, tmp_path)
    sections, toc = _page_ids(paths["html"].read_text())
    assert sections[-1] == toc[-1] == "positions"
    assert acc.state_bytes() == bytes_before + acc.tallies["positions"].sums.nbytes
