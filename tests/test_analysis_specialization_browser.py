"""The report page in a real browser: headless Chromium (the system's, driven by Playwright; nothing
downloads a browser) opens the generated page and checks that no script fails, every figure
rendered, corpus text shows literally (no alert fires), and hovering a token shows its routing.

The browser is looked up as $MOEE_CHROMIUM, then chromium / chromium-browser / google-chrome on
PATH; ``scripts/install.sh --dev`` installs Debian's chromium. Without one the test skips and
says how to install it.
"""

import json
import os
import shutil

import pytest
from test_analysis_specialization_page import HOSTILE, E, K, L, compare_report, make_report

from moee.analysis.specialization.html import render_html, token_view_payload

playwright = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)


def _chromium() -> str | None:
    found = os.environ.get("MOEE_CHROMIUM")
    if found:
        return found
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


CHROMIUM = _chromium()
if CHROMIUM is None:
    pytest.skip(
        "no Chromium found (set MOEE_CHROMIUM, or install it: `bash scripts/install.sh --dev` or "
        "`apt-get install chromium`)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, tmp_path, page_html: str):
    """Load ``page_html`` from a file; returns the page and the console errors, uncaught
    exceptions and dialogs (alert/confirm) seen so far (lists that keep filling)."""
    path = tmp_path / "report.html"
    path.write_text(page_html, encoding="utf-8")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(5000)  # a missing element fails fast, not after 30 s
    problems: list[str] = []
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

    def dialog(d):
        problems.append(f"dialog {d.type}: {d.message}")
        d.dismiss()

    page.on("dialog", dialog)
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, problems


#: Per image: its natural width and the alpha of its last row's pixels (matplotlib figures are
#: opaque, so a truncated or undecodable PNG shows as width 0 or transparent rows).
_IMAGE_STATE = """async () => Promise.all(Array.from(document.images).map(async (img) => {
  try { await img.decode(); } catch (e) { return [0, 0]; }
  const c = document.createElement("canvas");
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const ctx = c.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const row = ctx.getImageData(0, c.height - 1, c.width, 1).data;
  let opaque = 0;
  for (let i = 3; i < row.length; i += 4) opaque += row[i] === 255 ? 1 : 0;
  return [img.naturalWidth, opaque / c.width];
}))"""


def _every_figure_rendered(page) -> None:
    n_figures = page.locator("figure img").count()
    assert n_figures >= 6
    state = page.evaluate(_IMAGE_STATE)
    assert len(state) == n_figures
    assert all(width > 0 and opaque == 1.0 for width, opaque in state), state


@pytest.mark.slow
def test_report_page_renders_and_the_token_view_shows_routing(browser, tmp_path):
    """The two-model page (each section twice, two token views) of hand-made reports whose corpus
    holds markup: the first view in detail, the second independent of it. One page, to keep the
    test fast; the single-model page is the next test's."""
    report, other = make_report(), make_report(n_texts=3, seed=1)
    payload = token_view_payload(report)
    page, problems = _open(browser, tmp_path, render_html(compare_report(report, other)))
    _every_figure_rendered(page)
    views = page.locator(".token-view[data-ready='1']")
    assert views.count() == 2
    view = views.nth(0)
    tokens = view.locator("[data-token]")
    assert tokens.count() == payload["n_tokens"]
    # corpus text shows literally: the hostile lines are text of their token spans
    texts = tokens.all_text_contents()
    flat = [t for text in payload["texts"] for t in text["tokens"]]
    assert texts == [t[0] for t in flat]
    assert set(HOSTILE) <= set(texts)
    assert page.locator("img[src='x']").count() == 0
    # hover: the panel shows the token's top-k in every layer and a bar per expert
    i = next(j for j, t in enumerate(flat) if t[0] == HOSTILE[0])
    tokens.nth(i).hover()
    panel = view.locator(".tv-panel")
    assert HOSTILE[0] in panel.locator(".tv-head").text_content()
    rows = panel.locator(".tv-row")
    assert rows.count() == L
    _, selected, dense, predicted = flat[i]
    for layer in range(L):
        row = rows.nth(layer)
        assert row.locator("rect").count() == E
        expected = ", ".join(f"E{e} {dense[layer][e] / 1000:.3f}" for e in selected[layer])
        assert row.locator(".tv-topk").text_content() == f"selected: {expected}"
        assert len(selected[layer]) == K
    assert panel.locator(".tv-pred").text_content() == f"predicted next token: {json.dumps(predicted)}"
    # another token replaces it; a click pins it against further hovers
    tokens.nth(0).hover()
    assert panel.locator(".tv-head").text_content().startswith("token 0:")
    tokens.nth(1).click()
    tokens.nth(2).hover()
    assert panel.locator(".tv-head").text_content().startswith("token 1:")
    # layer selector recolours by the chosen layer's first choice; the filter dims the misses
    colours = lambda: tokens.evaluate_all("ts => ts.map(t => t.style.backgroundColor)")  # noqa: E731
    before = colours()
    view.locator(".tv-layer").select_option("0")
    firsts = [t[1][0][0] for t in flat]
    after = colours()
    assert after != before
    assert len({c for c, f in zip(after, firsts) if f == firsts[0]}) == 1  # one colour per expert
    view.locator(".tv-filter").select_option("2")
    dimmed = tokens.evaluate_all("ts => ts.map(t => t.classList.contains('dim'))")
    assert dimmed == [2 not in t[1][0] for t in flat]
    # the second view has its own data and panel
    second = views.nth(1)
    second.locator("[data-token]").nth(0).hover()
    assert second.locator(".tv-row").count() == L
    assert second.locator(".tv-head").text_content().startswith("token 0:")
    assert panel.locator(".tv-head").text_content().startswith("token 1:")  # still the pinned one
    assert problems == []


@pytest.mark.slow
def test_the_page_written_for_a_real_model_works(browser, tmp_path, tiny_embedder):
    """The page ``write_report`` writes for the tiny OLMoE: no script error, every figure drawn,
    and hovering a token shows the selected experts report.json holds for it."""
    from moee.analysis.specialization import BaselineDraws, ReportOptions, build_report, write_report
    from moee.capture.tiny import TINY_WORDS

    texts = [" ".join(TINY_WORDS[(5 * i + 3 * j) % len(TINY_WORDS)] for j in range(4 + i)) for i in range(6)]
    options = ReportOptions(min_token_count=1, draws=BaselineDraws(permutations=2))
    report = build_report(tiny_embedder, texts, progress=False, options=options)
    report["meta"] = {"command": "moee report <tiny>"}  # what the command adds
    paths = write_report(report, tmp_path / "out")
    page, problems = _open(browser, tmp_path, paths["html"].read_text(encoding="utf-8"))
    _every_figure_rendered(page)
    tv = json.loads(paths["json"].read_text())["token_view"]["texts"][0]
    tokens = page.locator("[data-token]")
    assert tokens.nth(0).text_content() == tv["tokens"][0]
    tokens.nth(0).hover()
    rows = page.locator(".tv-panel .tv-row")
    n_layers = report["summary"]["n_layers"]
    assert rows.count() == n_layers
    for layer in range(n_layers):
        experts = [f"E{e} " for e in tv["selected"][0][layer]]
        text = rows.nth(layer).locator(".tv-topk").text_content()
        assert [part.split(" ")[0] + " " for part in text.removeprefix("selected: ").split(", ")] == experts
    assert problems == []
