"""Measure the import graph of the ``moee`` package: import cycles, upward arrows between layers,
function-level imports and package lines.

Read from the source with ``ast``, so an import inside a function or under ``TYPE_CHECKING`` is an
arrow like any other: a lazy import defers a dependency, it does not remove it. ``LAYERS`` is the one
place the layer order is written down (``docs/ARCHITECTURE.md`` describes it and
``tests/test_package_layers.py`` holds the package to it).

    python scripts/import_graph.py            # the numbers, every cycle and every upward arrow
    python scripts/import_graph.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "moee"

#: The layers of the package, lowest first: a module may import its own layer and the layers below
#: it, never a layer above (that is an upward arrow). A module belongs to the layer of the longest
#: entry that names it or a package holding it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("moee.io", "moee.provenance", "moee.data")),
    (
        "model",
        (
            "moee.loading",
            "moee.capture",
            "moee.moe",
            "moee.models",
            "moee.upcycle_settings",
            "moee.train_settings",
        ),
    ),
    ("embed", ("moee.embed", "moee.corpus", "moee.shard")),
    (
        "application",
        (
            "moee.evaluation",
            "moee.analysis",
            "moee.index",
            "moee.integrations",
            "moee.serving",
            "moee.benchmarking",
            "moee.embed_corpus",
            "moee.search",
        ),
    ),
    ("commands", ("moee.cli_options", "moee.commands")),
    ("cli", ("moee.cli",)),
)

#: Arrows the rules allow: the package root re-exports its public names lazily (inside
#: ``__getattr__``); ``import moee`` runs it before any module, so it is no edge of the graph.
LAZY_ROOT = "moee"


@dataclass(frozen=True)
class Import:
    """One arrow: ``source`` imports ``target`` at ``line``, inside a function or at module level."""

    source: str
    target: str
    line: int
    in_function: bool


@dataclass
class Graph:
    root: Path = ROOT
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    statements: int = 0
    function_statements: int = 0
    lines: int = 0


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The module names one import node names: for ``from X import y`` both ``X.y`` (``y`` may be
    a submodule) and ``X``; relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
    ):
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the package ``name`` lands in: the longest prefix that is a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _computed_imports(tree: ast.AST, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules a file imports by a computed name (``importlib.import_module(name)``): every string
    constant of the file that names a module below the package root (a registry such as
    ``moee.models.MODEL_TYPES``), with its line. Counted as imports inside a function."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", getattr(n.func, "id", None)) == "import_module"
        and not (n.args and isinstance(n.args[0], ast.Constant))
    ]
    if not calls:
        return []
    return [
        (n.value, n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value and n.value in modules
    ]


def _walk(node: ast.AST, in_function: bool = False):
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inside
        yield from _walk(child, inside)


def build(package: Path = PACKAGE) -> Graph:
    """The import graph of every ``.py`` file under ``package``."""
    root = package.parent
    graph = Graph(root=root)
    paths = sorted(package.rglob("*.py"))
    graph.modules = {module_name(p, root): p for p in paths}
    for path in paths:
        module = module_name(path, root)
        source = path.read_text(encoding="utf-8")
        graph.lines += len(source.splitlines())
        tree = ast.parse(source)
        for target, line in _computed_imports(tree, graph.modules):
            if target != module:
                graph.imports.append(Import(module, target, line, True))
        for node, in_function in _walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph.statements += 1
                graph.function_statements += in_function
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # `from X import y`: the arrow goes to the submodule X.y when there is one, else to X
                submodules = [n for n in names[:-1] if n in graph.modules]
                names = submodules or names[-1:]
            targets = {_resolve(n, graph.modules) for n in names} - {None, module}
            graph.imports += [Import(module, t, node.lineno, in_function) for t in sorted(targets)]
    return graph


def edges(graph: Graph) -> list[Import]:
    """The arrows the layering rules judge: all but the package root's lazy re-exports."""
    return [i for i in graph.imports if not (i.source == LAZY_ROOT and i.in_function)]


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the layer holding ``module`` (the longest matching entry)."""
    best: tuple[int, int] | None = None
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and (
                best is None or len(member) > best[0]
            ):
                best = (len(member), index)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in scripts/import_graph.py")
    return best[1]


def unlayered(graph: Graph) -> list[str]:
    """Modules of the package in no layer (the package root is above the layers: it only re-exports)."""
    out = []
    for module in graph.modules:
        if module == LAZY_ROOT:
            continue
        try:
            layer_of(module)
        except KeyError:
            out.append(module)
    return out


def upward_arrows(graph: Graph) -> list[Import]:
    """Arrows from a module to a module of a higher layer (modules in no layer: :func:`unlayered`)."""
    judged = set(graph.modules) - set(unlayered(graph)) - {LAZY_ROOT}
    return [
        i for i in edges(graph) if {i.source, i.target} <= judged and layer_of(i.target) > layer_of(i.source)
    ]


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    adjacency: dict[str, set[str]] = {m: set() for m in graph.modules}
    for i in edges(graph):
        adjacency[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(adjacency[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(adjacency) + 100))
    for node in sorted(adjacency):
        if node not in index:
            connect(node)
    return sorted(found)


def cycle_edges(graph: Graph, component: list[str]) -> list[Import]:
    """The arrows inside one strongly connected component: the ones to cut."""
    members = set(component)
    return [i for i in edges(graph) if i.source in members and i.target in members]


def _where(i: Import, graph: Graph) -> str:
    path = graph.modules[i.source].relative_to(graph.root).as_posix()
    return f"{path}:{i.line} {i.source} -> {i.target}" + (" (in a function)" if i.in_function else "")


def report(graph: Graph) -> dict:
    found = cycles(graph)
    return {
        "modules": len(graph.modules),
        "package_lines": graph.lines,
        "import_statements": graph.statements,
        "function_level_imports": graph.function_statements,
        "cycles": [{"modules": c, "edges": [_where(i, graph) for i in cycle_edges(graph, c)]} for c in found],
        "upward_arrows": [_where(i, graph) for i in upward_arrows(graph)],
        "unlayered": unlayered(graph),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--package", type=Path, default=PACKAGE, help="the package folder to measure (default: moee/)"
    )
    args = parser.parse_args(argv)
    result = report(build(args.package))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"modules: {result['modules']}, package lines: {result['package_lines']}")
    print(
        f"import statements: {result['import_statements']}, "
        f"inside functions: {result['function_level_imports']}"
    )
    print(f"import cycles: {len(result['cycles'])}")
    for cycle in result["cycles"]:
        print("  " + " <-> ".join(cycle["modules"]))
        for edge in cycle["edges"]:
            print("    " + edge)
    pairs = {edge.split(" ", 1)[1].removesuffix(" (in a function)") for edge in result["upward_arrows"]}
    print(f"upward arrows: {len(result['upward_arrows'])} import statements, {len(pairs)} module pairs")
    for edge in result["upward_arrows"]:
        print("  " + edge)
    if result["unlayered"]:
        print(f"modules in no layer: {result['unlayered']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
