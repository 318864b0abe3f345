"""The whole package points one way: no import cycle, and no module imports a layer above its own.

The layers are written down once, in ``scripts/import_graph.py`` (``LAYERS``): base utilities <
model (loading, capture, moe, models) < embed < application (evaluation, analysis, index,
integrations, serving) < commands < cli. The graph is read from the source with ``ast``:
function-level and ``TYPE_CHECKING`` imports count like module-level ones (a lazy import defers
a dependency, it does not remove it); only the package root's lazy re-exports are left out.
``tests/test_capture_layers.py`` holds the capture layer to the same rule on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import import_graph  # noqa: E402

GRAPH = import_graph.build()


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "moee"


def test_every_module_is_in_a_layer() -> None:
    missing = import_graph.unlayered(GRAPH)
    assert not missing, f"modules in no layer (add them to LAYERS in scripts/import_graph.py): {missing}"


def test_the_package_has_no_import_cycle() -> None:
    found = {
        " <-> ".join(c): [import_graph._where(i, GRAPH) for i in import_graph.cycle_edges(GRAPH, c)]
        for c in import_graph.cycles(GRAPH)
    }
    assert not found, f"import cycles (move the shared code down to break them): {found}"


def test_no_module_imports_a_higher_layer() -> None:
    upward = [import_graph._where(i, GRAPH) for i in import_graph.upward_arrows(GRAPH)]
    assert not upward, "modules import a layer above their own (move the shared code down):\n" + "\n".join(
        upward
    )


def test_the_graph_sees_the_package() -> None:
    """The checks above pass on an empty graph: it must hold the arrows the package is known to have."""
    arrows = {(i.source, i.target, i.in_function) for i in GRAPH.imports}
    assert ("moee.cli_options", "moee.loading", False) in arrows
    assert ("moee.embed_corpus", "moee.integrations.ray", True) in arrows
    assert ("moee.models", "moee.moe.lm", True) in arrows  # a registry's computed import
    assert GRAPH.function_statements > 0 and GRAPH.statements > GRAPH.function_statements


def test_a_function_level_import_of_a_higher_layer_is_an_upward_arrow(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "moee/__init__.py": "def __getattr__(name):\n    from moee.commands import embed\n",
            "moee/io.py": "def f():\n    from moee.commands.embed import run\n",
            "moee/capture/__init__.py": "",
            "moee/capture/tiny.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..embed import x\n",
            "moee/embed/__init__.py": "",
            "moee/embed/x.py": "import moee.io\n",
            "moee/commands/__init__.py": "",
            "moee/commands/embed.py": "from moee import io\n",
        },
    )
    graph = import_graph.build(package)
    upward = {(i.source, i.target, i.in_function) for i in import_graph.upward_arrows(graph)}
    assert upward == {("moee.io", "moee.commands.embed", True), ("moee.capture.tiny", "moee.embed.x", False)}
    assert graph.function_statements == 2 and graph.statements == 6


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "moee/__init__.py": "def __getattr__(name):\n    import moee.embed.a\n",
            "moee/embed/__init__.py": "",
            "moee/embed/a.py": "from moee.embed import b\n",
            "moee/embed/b.py": "def f():\n    from . import c\n",
            "moee/embed/c.py": "import moee.embed.a\nimport moee\n",
        },
    )
    graph = import_graph.build(package)
    assert import_graph.cycles(graph) == [["moee.embed.a", "moee.embed.b", "moee.embed.c"]]
    assert {
        (i.source, i.target)
        for i in import_graph.cycle_edges(graph, ["moee.embed.a", "moee.embed.b", "moee.embed.c"])
    } == {
        ("moee.embed.a", "moee.embed.b"),
        ("moee.embed.b", "moee.embed.c"),
        ("moee.embed.c", "moee.embed.a"),
    }


@pytest.mark.parametrize(
    ("module", "layer"),
    [("moee.io", "base"), ("moee.loading", "model"), ("moee.embed.config", "embed"), ("moee.cli", "cli")],
)
def test_a_module_takes_the_layer_of_its_longest_entry(module: str, layer: str) -> None:
    assert import_graph.LAYERS[import_graph.layer_of(module)][0] == layer
