"""docs/ARCHITECTURE.md names every module of the package, and only modules that exist.

The layout table is where a reader looks up which module owns a concept; a module missing from it
is a concept with no documented home, and a path in it that no longer exists sends the reader to
nothing. Paths are written in full (``moee/capture/oracle.py``) so this check can read them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"

# a repository path in backticks: a module, a folder or a file of the packages and tool folders
_PATH = re.compile(r"`((?:moee|moee_build|scripts|tests|eval|analysis|configs|docs)/[A-Za-z0-9_./<>*-]*)`")


def _package_modules() -> set[str]:
    modules = set()
    for package in ("moee", "moee_build"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "__init__.py" or "page_assets" in path.parts:
                continue
            modules.add(path.relative_to(ROOT).as_posix())
    return modules


def _named_paths(text: str) -> set[str]:
    return {m.group(1) for m in _PATH.finditer(text)}


def test_every_package_module_is_in_the_layout() -> None:
    named = _named_paths(DOC.read_text(encoding="utf-8"))
    missing = sorted(m for m in _package_modules() if m not in named)
    assert not missing, f"docs/ARCHITECTURE.md does not name these modules (write their full path): {missing}"


def test_every_named_path_exists() -> None:
    named = _named_paths(DOC.read_text(encoding="utf-8"))
    concrete = [p for p in named if not any(c in p for c in "<>*")]
    gone = sorted(p for p in concrete if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/ARCHITECTURE.md names paths that do not exist: {gone}"


def test_the_check_reads_paths() -> None:
    """The pattern must see the layout's paths, or the two tests above pass on any text."""
    sample = "| `moee/capture/oracle.py` | x | `moee/models/` and `scripts/support_table.py` |"
    assert _named_paths(sample) == {"moee/capture/oracle.py", "moee/models/", "scripts/support_table.py"}
