"""Writing and reading a ``moee ablate`` result for the report's causal sections (expert importance,
router swap, steering), in one place: the report routes texts and cannot run the ablation's extra
forward passes, so it reads the file that ``moee ablate`` wrote. :func:`write_result` seals it (its
own content digest under :data:`SEAL_KEY`, ``moee.io.seal``, as embeddings sidecars are sealed);
:func:`read_result` checks the file before any work starts (it exists, is JSON, is the right kind of
result, has the section's shape and its seal matches its content: an edited number, a removed
``meta`` or a file without a seal is refused, naming the command to re-run); :func:`check_model`
checks it against the report's model once that loads (its MoE layers and experts, and its weights
digest or else its model name).

A result written before results were sealed is refused too, not read with a warning as an
embeddings sidecar of the previous format is: such a file carries no format mark, so it cannot be
told apart from a sealed one whose seal was removed with the edit, and a result is minutes of
``moee ablate`` to regenerate, where embeddings can be hours."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "BUNDLED",
    "KINDS",
    "check_model",
    "index",
    "number",
    "read_result",
    "result_kind",
    "signed",
    "unavailable_html",
    "write_result",
]

#: The key of a result's digest of its own content (``moee.io.seal``).
SEAL_KEY = "result_sha256"
#: The name ``moee ablate`` recorded for its default model (``--model`` left out) while that was
#: ``minilm-moe``; it now records the default's name (``moee.models.bundled.DEFAULT_MODEL``).
BUNDLED = "bundled default model"
#: The shipped model a result recording :data:`BUNDLED` was made with.
BUNDLED_WAS = "minilm-moe"
#: Each kind of ``moee ablate`` result: (its file, what it is called, the report flag that reads it,
#: the ``moee ablate`` flags that write it).
KINDS: dict[str, tuple[str, str, str, str]] = {
    "importance": ("importance.json", "expert-importance", "--ablation", "without --swap-from / --steer"),
    "swap": ("swap.json", "router-swap", "--router-swap", "--swap-from DONOR"),
    "steering": ("steering.json", "steering", "--steering", "--steer L:E=BIAS ..."),
}


def number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def index(value: Any) -> bool:
    """A non-negative int (not a bool): a layer or expert position in a result file."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def signed(x: Any, digits: int = 4) -> str:
    """A number with its sign, ``-`` when it is none."""
    return "-" if not number(x) else f"{x:+.{digits}f}"


def result_kind(result: Any) -> str | None:
    """Which kind of ``moee ablate`` result a JSON object is, by its keys (``None``: none)."""
    if not isinstance(result, dict):
        return None
    if "swaps" in result:
        return "swap"
    if "kl_next_token" in result:
        return "steering"
    if "experts" in result or "spearman_importance_load" in result:
        return "importance"
    return None


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _fix(kind: str) -> str:
    name, _, _, flags = KINDS[kind]
    return f"give the {name} that `moee ablate --corpus C {flags} --out DIR` writes (or DIR)"


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Write a ``moee ablate`` result as JSON, sealed (:data:`SEAL_KEY`), atomically."""
    from moee.io import seal, write_json_atomic

    return write_json_atomic(path, seal(result, SEAL_KEY))


def _rerun(result: dict, kind: str) -> str:
    """How to get a sealed result again: the command the file records, else the kind's."""
    meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
    command = meta.get("command")
    if isinstance(command, str) and command.startswith("moee ablate"):
        return f"re-run the command that wrote it: {command}"
    return f"re-run `moee ablate` ({_fix(kind)})"


def read_result(path: str | Path, kind: str, problems: Callable[[dict], str | None]) -> dict:
    """The ``kind`` result of ``path`` (the file, or the ``moee ablate --out`` folder holding it),
    refused with the fix when it is missing, not JSON, another kind of result, ``problems`` (the
    section's shape check: a reason, or ``None``) finds it malformed, or its seal is missing or
    does not match its content (:func:`write_result`). ``source`` is added."""
    name, label, flag, _ = KINDS[kind]
    given = Path(path).expanduser()
    file = given / name if given.is_dir() else given
    if not file.is_file():
        held = [k for k, (n, *_) in KINDS.items() if given.is_dir() and (given / n).is_file()]
        also = "".join(
            f" ({given} holds {KINDS[k][0]}, {_a(KINDS[k][1])} result: pass it to {KINDS[k][2]})"
            for k in held
        )
        raise FileNotFoundError(f"{flag} {path}: no such file {file}{also}; {_fix(kind)}")
    try:
        result = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {file} is not JSON ({exc}); {_fix(kind)}") from None
    found = result_kind(result)
    if found is not None and found != kind:
        _, other, other_flag, _ = KINDS[found]
        raise ValueError(
            f"{flag} {path}: {file} is {_a(other)} result, not {label}: pass it to {other_flag}; {_fix(kind)}"
        )
    reason = "not a JSON object" if not isinstance(result, dict) else problems(result)
    if reason:
        raise ValueError(f"{flag} {path}: {file} is not {_a(label)} result ({reason}); {_fix(kind)}")
    from moee.io import check_seal

    try:  # no seal: written by an older moee, or edited with the seal removed
        check_seal(result, file, remedy=_rerun(result, kind), key=SEAL_KEY)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    return {**result, "source": str(file)}


def _local(spec: str | None) -> str | None:
    """A model argument as a comparable name: shipped models (``None``: the default) and local
    folders by their resolved path, Hub ids as given."""
    if spec == BUNDLED:
        spec = BUNDLED_WAS
    from moee.models.bundled import BUNDLED as SHIPPED
    from moee.models.bundled import config_dir

    if spec is None or spec in SHIPPED:
        return str(Path(config_dir(spec)).resolve())
    local = Path(spec).expanduser()
    return str(local.resolve()) if local.exists() else spec


def check_model(
    result: dict,
    kind: str,
    pairs: Iterable[tuple[int, int]],
    *,
    model: str | None,
    n_layers: int,
    n_experts: int,
    weights_digest: str | None = None,
) -> dict:
    """Refuse a :func:`read_result` result of another model than the report's: its recorded experts
    per MoE layer (``n_experts``) and its ``(layer, expert)`` ``pairs`` must fit the report's
    model, and the weights digest (when the result records one and ``weights_digest`` is given) or
    else the model name it records must be the report's ``model``. Returns its ``meta``."""
    _, label, flag, _ = KINDS[kind]
    meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
    source = result.get("source", f"the {label} result")
    fix = "run `moee ablate --model M ...` on the report's model and pass its output"
    recorded = result.get("n_experts")
    if (
        isinstance(recorded, list)
        and recorded != [n_experts] * n_layers
        or any(layer >= n_layers or e >= n_experts for layer, e in pairs)
    ):
        raise ValueError(
            f"{flag} {source}: {_a(label)} result of another model (experts per MoE layer "
            f"{recorded if isinstance(recorded, list) else 'beyond the model'}, the report's model has "
            f"{n_layers} layers of {n_experts}); {fix}"
        )
    digest = meta.get("weights_digest")
    if digest is not None and weights_digest is not None:
        if str(digest) != str(weights_digest):
            raise ValueError(
                f"{flag} {source}: {_a(label)} result of other weights (digest {digest}, the report's "
                f"model {model} has {weights_digest}); {fix}"
            )
    elif meta.get("model") is not None and _local(str(meta["model"])) != _local(model):
        raise ValueError(
            f"{flag} {source}: {_a(label)} result of {meta['model']}, not of the report's model {model}; {fix}"
        )
    return meta


def unavailable_html(what: str, kind: str, reason: str | None) -> str:
    """The page of a causal section that was not given: which command and flag provide it."""
    from moee.analysis.specialization.markup import esc

    name, _, flag, flags = KINDS[kind]
    write = "" if flags.startswith("without") else f" {flags}"
    return (
        f"<p>Not given: {esc(str(reason or what))}. The report routes texts and cannot run the "
        f"extra forward passes of {esc(what)}: run <code>moee ablate --model M --corpus C{esc(write)} "
        f"--out DIR</code> on this model, then pass <code>{flag} DIR</code> (or its "
        f"<code>{name}</code>) to <code>moee report</code>.</p>"
    )
