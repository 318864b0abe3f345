"""The capture layer points one way: it imports nothing from the layers above it, and its modules
import each other without cycles. Read from the source with ``ast`` (function-level and
``TYPE_CHECKING`` imports included), so a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moee.capture

CAPTURE = Path(moee.capture.__file__).parent
#: The layers above capture: capture is imported by them, never the other way round.
ABOVE = ("moee.embed", "moee.evaluation", "moee.analysis", "moee.commands")


def _module_name(path: Path) -> str:
    parts = path.relative_to(CAPTURE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, anywhere in the file: absolute
    names, with relative imports resolved against ``module`` and ``from X import y`` counted as
    both ``X`` and ``X.y`` (``y`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def _capture_imports() -> dict[str, set[str]]:
    return {
        _module_name(path): imported_modules(path.read_text(), _module_name(path), path.name == "__init__.py")
        for path in sorted(CAPTURE.rglob("*.py"))
    }


def test_the_import_parser_sees_function_level_relative_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from moee.embed.config import EmbeddingConfig\n"
        "def f():\n    import moee.evaluation.runner\n    from . import registry\n"
        "    from ..analysis import stability\n"
    )
    found = imported_modules(source, "moee.capture.x")
    assert {"moee.embed.config", "moee.evaluation.runner", "moee.capture.registry", "moee.analysis"} <= found


def test_capture_imports_nothing_from_the_layers_above() -> None:
    offenders = {
        module: sorted(name for name in names if any(name == a or name.startswith(a + ".") for a in ABOVE))
        for module, names in _capture_imports().items()
    }
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"capture modules import from the layers above them: {offenders}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path that returns to its start), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_capture_modules_import_each_other_without_cycles() -> None:
    imports = _capture_imports()
    # The package's own __init__ re-exports its modules lazily and is imported before any of them,
    # so it is not an edge of the module graph.
    modules = {m for m in imports if m != "moee.capture"}
    graph = {m: {n for n in imports[m] if n in modules and n != m} for m in modules}
    assert (cycle := _cycle(graph)) is None, "capture import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["moee.capture.vocabulary", "moee.embed.methods"])
def test_the_vocabulary_loads_without_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {module} loads torch"


def test_the_embed_layer_re_exports_captures_vocabulary() -> None:
    from moee.capture import architectures, recorder, vocabulary
    from moee.embed import methods

    assert (methods.POOLINGS, methods.SCORES, methods.DEFAULT_SCORE) == (
        vocabulary.POOLINGS,
        vocabulary.SCORES,
        vocabulary.DEFAULT_SCORE,
    )
    assert (
        architectures.SCORES is vocabulary.SCORES and moee.capture.DEFAULT_SCORE == vocabulary.DEFAULT_SCORE
    )
    assert recorder.POOLINGS == (*vocabulary.POOLINGS, "tokens")
