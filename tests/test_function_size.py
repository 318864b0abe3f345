"""Functions a reader can hold: no function over 80 lines and no signature over 8 parameters in ``moee/``.

The rules, read from the source with ``ast`` (nothing is imported):

- a function is every ``def`` / ``async def`` in every ``.py`` file under ``moee/``: module functions,
  methods and nested functions alike, named ``module:qualname`` as Python's ``__qualname__`` names them
  (``moee.serving.app:create_app.<locals>.embeddings``);
- its length is its physical lines from the ``def`` line to its last line (``end_lineno - lineno + 1``)
  less its own docstring: signature, comments, blank lines and nested functions count, decorators and
  the docstring do not (prose that says why is never a reason to split; a nested function counts in
  its own length and in its enclosing function's). Lines are physical lines, as the package line
  count in ``docs/ARCHITECTURE.md`` counts them;
- its parameters are every name in its signature, positional-only, positional and keyword-only,
  ``*args`` and ``**kwargs`` one each (each is a thing a caller can pass and a reader must hold), less
  the first ``self`` / ``cls`` of a method (not of a ``staticmethod``).

The set of functions over either limit must equal ``EXCEPTIONS`` exactly: a new long function or wide
signature fails, and so does an entry that no longer needs its place (the list only shrinks). Two kinds
of entries: a documented ecosystem convention that fixes a signature (kept for good), and a function
in an area being converted by other work ("not yet split", with its measured size when listed).
``python tests/test_function_size.py`` prints the package's figures.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moee"
MAX_LINES = 80
MAX_PARAMETERS = 8

_CONVENTION_HF_FORWARD = (
    "transformers convention: a causal LM's forward takes the keywords PreTrainedModel.generate and "
    "Trainer pass (input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, "
    "use_cache, output_* flags, **kwargs)"
)

EXCEPTIONS: dict[str, str] = {
    # Ecosystem conventions: the signature is what callers outside moee pass.
    "moee.embed.embedder:MoEEmbedder.encode": (
        "sentence-transformers convention: SentenceTransformer.encode's keywords (prompt_name, prompt, "
        "batch_size, show_progress_bar, output_value, precision, convert_to_numpy, convert_to_tensor, "
        "device, normalize_embeddings, ...) so MTEB and sentence-transformers callers work unchanged"
    ),
    "moee.models.deepseek_v1:DeepseekV1ForCausalLM.forward": _CONVENTION_HF_FORWARD,
    "moee.moe.lm:MoEEForCausalLM.forward": _CONVENTION_HF_FORWARD,
    "moee.integrations.ray:MoEEmbedBatches.__init__": (
        "Ray Data convention: a callable class given to Dataset.map_batches is built by Ray in each "
        "actor as cls(*fn_constructor_args, **fn_constructor_kwargs), so its keywords (model, "
        "text_column, output_column, features, dtype, batch_size, id_column, load and the "
        "configuration fields as **config) are the plain dict a user writes as fn_constructor_kwargs "
        "(the module doc's example; moee embed --engine ray builds the same dict)"
    ),
    # Public keyword APIs on loaded objects: no settings class holds these values without fields a
    # library call lacks (AblateSettings requires a corpus path and an --out folder).
    "moee.analysis.expert_importance:expert_importance": (
        "public keyword API over a loaded model and LossCorpus (11 parameters; tests and moee ablate "
        "call it by keyword); its values are AblateSettings fields, which also require a corpus path "
        "and an output folder"
    ),
}


@dataclass(frozen=True)
class Function:
    """One ``def`` as the rules above measure it."""

    name: str
    lines: int
    parameters: int

    @property
    def too_large(self) -> bool:
        return self.lines > MAX_LINES or self.parameters > MAX_PARAMETERS


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """Every name in the signature, ``*args``/``**kwargs`` one each, less a method's ``self``/``cls``."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if in_class and not static and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The physical lines of the function's own docstring (0 without one)."""
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno - first.lineno + 1
    return 0


def measure_source(source: str, module: str) -> list[Function]:
    """Every function of one module's source, named ``module:qualname``."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1 - _docstring_lines(child)
                found.append(Function(f"{module}:{name}", lines, _parameters(child, in_class)))
                visit(child, name + ".<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", True)
            else:
                visit(child, prefix, in_class)

    visit(ast.parse(source), "", False)
    return found


def measure_package(package: Path = PACKAGE) -> list[Function]:
    """Every function under ``package``, modules named by their dotted path."""
    found: list[Function] = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.extend(measure_source(path.read_text(encoding="utf-8"), module))
    return found


FUNCTIONS = measure_package()


def _describe(function: Function) -> str:
    return f"{function.name} ({function.lines} lines, {function.parameters} parameters)"


def test_no_function_over_the_limits_but_the_listed_exceptions() -> None:
    over = {f.name: f for f in FUNCTIONS if f.too_large}
    new = sorted(set(over) - set(EXCEPTIONS))
    stale = sorted(set(EXCEPTIONS) - set(over))
    assert not new, (
        f"functions over {MAX_LINES} lines or {MAX_PARAMETERS} parameters (split them into named helpers, "
        "or group the parameters into the settings dataclass that holds them):\n"
        + "\n".join(_describe(over[name]) for name in new)
    )
    assert not stale, f"listed in EXCEPTIONS but within the limits now (remove them from the list): {stale}"


def test_every_exception_gives_its_reason() -> None:
    assert all(reason.strip() for reason in EXCEPTIONS.values())


def test_the_rules_on_a_known_source() -> None:
    source = '''
def short(a, b, /, c, *args, d, **kwargs):
    """Six names."""
    return a


class Thing:
    def method(self, a):
        def inner(x):
            return x

        return inner(a)

    @staticmethod
    def static(self, a):
        return a

    @classmethod
    def build(cls):
        return cls()
'''
    measured = {f.name: (f.lines, f.parameters) for f in measure_source(source, "m")}
    assert measured == {
        "m:short": (2, 6),  # docstring line left out
        "m:Thing.method": (5, 1),
        "m:Thing.method.<locals>.inner": (2, 1),
        "m:Thing.static": (2, 2),  # decorator line left out
        "m:Thing.build": (2, 0),
    }


def test_the_measure_sees_the_package() -> None:
    """The limits test passes on nothing measured: it must see the package's functions."""
    names = {f.name for f in FUNCTIONS}
    assert len(FUNCTIONS) > 1000
    assert "moee.embed.embedder:MoEEmbedder.encode" in names
    assert "moee.models:register_models" in names


if __name__ == "__main__":
    longest = max(FUNCTIONS, key=lambda f: f.lines)
    widest = max(FUNCTIONS, key=lambda f: f.parameters)
    print(f"functions measured: {len(FUNCTIONS)}")
    print(
        f"over {MAX_LINES} lines: {sum(f.lines > MAX_LINES for f in FUNCTIONS)}; longest {_describe(longest)}"
    )
    print(
        f"over {MAX_PARAMETERS} parameters: {sum(f.parameters > MAX_PARAMETERS for f in FUNCTIONS)}; "
        f"widest {_describe(widest)}"
    )
    for function in sorted(FUNCTIONS, key=lambda f: (-f.lines, f.name)):
        if function.too_large:
            print("  " + _describe(function))
