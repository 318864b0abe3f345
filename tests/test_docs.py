"""The README and the docs it points to stay true to the repository.

A newcomer reads the README first and follows its links: a link that resolves to nothing, a set-up
command that is not the one CI runs, a command or flag the CLI no longer has, or a figure that is
not the committed result would each mislead them. The README also stays short enough to read in
a few minutes; details live in docs/ (one page per concept) and every move keeps these checks.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_DOC = DOCS / "CLI.md"
RESULTS_DOC = DOCS / "RESULTS.md"
# the pages written for a newcomer: every repository path they name in backticks must exist
NEWCOMER_PAGES = (
    README,
    DOCS / "API.md",
    CLI_DOC,
    DOCS / "SERVING.md",
    RESULTS_DOC,
    DOCS / "CONTRIBUTING.md",
)
README_MAX_LINES = 150

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(
    r"`((?:moee|moee_build|scripts|tests|eval|analysis|configs|docs|data|\.ci)/[A-Za-z0-9_./<>*-]*"
    r"|[A-Z][A-Z_]*\.md)`"
)
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")
_CODE_BLOCK = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)}


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


def _markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_every_markdown_link_resolves() -> None:
    broken = {str(p.relative_to(ROOT)): b for p in _markdown_pages() if (b := _broken_links(p))}
    assert not broken, f"links to files or headings that do not exist (fix the target or the link): {broken}"


def test_the_link_check_sees_broken_links(tmp_path: Path) -> None:
    """The check must catch a missing file and a missing heading, or the test above passes on anything."""
    (tmp_path / "b.md").write_text("# A heading\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#a-heading) [x](c.md) [y](b.md#nothing) [web](https://example.org)\n"
    )
    assert _broken_links(page) == ["c.md", "b.md#nothing"]


def test_every_path_the_newcomer_pages_name_exists() -> None:
    gone = {}
    for page in NEWCOMER_PAGES:
        named = {m.group(1) for m in _PATH.finditer(page.read_text(encoding="utf-8"))}
        missing = sorted(
            p for p in named if not any(c in p for c in "<>*") and not (ROOT / p.rstrip("/")).exists()
        )
        if missing:
            gone[page.name] = missing
    assert not gone, f"paths named in backticks that do not exist: {gone}"


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = ci[ci.index("# The README's test command, verbatim:") + 1]
    blocks = _CODE_BLOCK.findall(README.read_text(encoding="utf-8"))
    assert any(command in block.splitlines() for block in blocks), (
        f"README.md's set-up commands no longer include the command .ci/run runs: {command!r}"
    )


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES} so it reads in five minutes: "
        "put details in the docs/ page for their concept and link it"
    )


def _cli_sections() -> dict[str, str]:
    """docs/CLI.md's text per command, from one '## `moee NAME`' heading to the next."""
    parts = re.split(r"^## `moee ([a-z-]+)`$", CLI_DOC.read_text(encoding="utf-8"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _commands() -> list[str]:
    from moee.cli import COMMANDS

    return [name.replace("_", "-") for name in COMMANDS]


def test_every_command_is_in_the_readme_and_in_the_cli_doc() -> None:
    readme = README.read_text(encoding="utf-8")
    sections = _cli_sections()
    assert not [c for c in _commands() if f"| `moee {c}` |" not in readme], (
        "README.md's command table lacks commands"
    )
    assert sorted(sections) == sorted(_commands()), (
        "docs/CLI.md needs one '## `moee NAME`' section per command"
    )


def _flags_by_command(section: str, text: str, commands: list[str]) -> dict[str, set[str]]:
    """The flags a section names, each under the command it belongs to: the last `moee NAME` before it
    on its code line or in its code span, else the section's own command."""
    blocks = _CODE_BLOCK.findall(text)
    spans = [line for block in blocks for line in block.splitlines()]
    spans += re.findall(r"`([^`]+)`", _CODE_BLOCK.sub("", text))
    named = re.compile(r"\bmoee(?:\.cli)? (" + "|".join(map(re.escape, commands)) + r")\b")
    found: dict[str, set[str]] = {}
    for span in spans:
        owner = section
        for match in sorted([*named.finditer(span), *_FLAG.finditer(span)], key=lambda m: m.start()):
            if match.re is named:
                owner = match.group(1)
            else:
                found.setdefault(owner, set()).add(match.group(0))
    return found


def test_every_flag_the_cli_doc_names_exists() -> None:
    from moee.cli import build_parser

    parsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    unknown = {}
    for section, text in _cli_sections().items():
        for command, flags in _flags_by_command(section, text, list(parsers)).items():
            missing = flags - set(parsers[command]._option_string_actions)
            if missing:
                unknown[f"{section} section, moee {command}"] = sorted(missing)
    assert not unknown, (
        f"docs/CLI.md names flags its commands do not have (moee COMMAND --help lists them): {unknown}"
    )


def test_the_flag_check_attributes_flags_to_their_command() -> None:
    text = "```bash\nmoee embed x --out y\n```\nfor `moee search --server` or `--overwrite`; `--multi_gpu`"
    assert _flags_by_command("embed", text, ["embed", "search"]) == {
        "embed": {"--out", "--overwrite"},
        "search": {"--server"},
    }


def _table_rows(text: str, first_cells: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in first_cells:
            rows.append(cells)
    return rows


def _numbers(cells: list[str]) -> list[str]:
    return [c for c in cells if re.fullmatch(r"-?\d+\.\d+", c)]


#: The result folders the README's results table quotes (`bash eval/run_offline.sh`,
#: `bash eval/run_smollm2_moe.sh`).
README_RESULTS = ("offline", "offline_mean", "smollm2_moe/mean", "smollm2_moe/paper", "smollm2_moe/dense")


def test_the_readme_figures_are_the_committed_results() -> None:
    """Each row of the README's results table is a row of the tables the evaluation scripts wrote."""
    models = (
        "moee/smollm2-moe",
        "moee/smollm2-dense-upcycle",
        "moee/default-model",
        "sentence-transformers/all-MiniLM-L6-v2",
    )
    rows = _table_rows(README.read_text(encoding="utf-8"), models)
    assert len(rows) == 9, "README.md's results table is missing rows"
    assert {cells[0] for cells in rows} == set(models), "README.md's results table lacks a model"
    committed = [
        (cells[0], _numbers(cells))
        for name in README_RESULTS
        for cells in _table_rows(
            (ROOT / "eval" / "results" / name / "tables.md").read_text(encoding="utf-8"), models
        )
    ]
    strays = [cells for cells in rows if (cells[0], _numbers(cells)) not in committed]
    assert not strays, (
        f"README.md rows not in eval/results/offline*/tables.md (rerun, or copy them): {strays}"
    )


def test_the_results_doc_quotes_the_committed_isotropy_figures() -> None:
    measured = (ROOT / "eval" / "results" / "isotropy" / "isotropy.md").read_text(encoding="utf-8")
    means = {}  # (table, variant) -> the per-method means, std dropped
    for table, text in enumerate(measured.split("### A default linear probe")):
        for cells in _table_rows(text, ("default model", "all-MiniLM-L6-v2")):
            means[table, cells[1]] = [
                re.match(r"-?\d+\.\d+", c).group(0) for c in cells[2:] if re.match(r"\d", c)
            ]
    quoted = _table_rows(
        RESULTS_DOC.read_text(encoding="utf-8"),
        (
            "mean pairwise cosine, default configuration",
            "the same without the reference (`--reference none`)",
            "default probe accuracy, default configuration",
            "the same without the reference",
        ),
    )
    expected = [
        means[0, "model configuration"] + means[0, "dense baseline"],
        means[0, "without the reference"],
        means[1, "model configuration"] + means[1, "dense baseline"],
        means[1, "without the reference"],
    ]
    assert [_numbers(cells) for cells in quoted] == expected, "docs/RESULTS.md differs from isotropy.md"


def test_the_support_table_quotes_the_deepseek_comparison() -> None:
    """docs/support_table.md's account of the paper's models carries the figures the comparison recorded."""
    script = runpy.run_path(str(ROOT / "scripts" / "support_table.py"), run_name="support_table")
    assert script["paper_models_section"]() in (DOCS / "support_table.md").read_text(encoding="utf-8")


@pytest.mark.slow  # loads the bundled model
def test_the_readme_quick_start_runs() -> None:
    block = next(b for b in _CODE_BLOCK.findall(README.read_text(encoding="utf-8")) if "import moee" in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    assert "['A cat sat on the mat.'," in printed.getvalue()  # the kitten query finds the cat first
