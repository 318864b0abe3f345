"""Seal `moee ablate` results written before results were sealed, once, after checking them.

`moee report` refuses a `moee ablate` result (importance.json, swap.json, steering.json) without
its content digest (``result_sha256``): re-running `moee ablate` is the way to get one. Where the
run cannot be repeated (its donor checkpoint or corpus is gone) this seals an unsealed result in
place instead, and only one that checks: it must read as its kind of result with the report's
shape checks, and the weights digest it records must be the current weights of the local model it
names (the bundled model when it names none), so only a result of the model as it is now is sealed.
A file that already carries a seal is left alone, and refused when the seal does not match.

    python scripts/seal_ablate_results.py analysis/ablation_experts/importance.json \\
        analysis/router_swap/swap.json analysis/steering/*/steering.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from moee.analysis.specialization.ablate_results import (
    BUNDLED,
    KINDS,
    SEAL_KEY,
    result_kind,
    write_result,
)
from moee.analysis.specialization.sections import ablation, router_swap, steering
from moee.embed.embedder import MINILM_MOE_DIR
from moee.embed.reference import weights_digest

#: Each kind's shape check, as the report's reader applies it.
READERS = {
    "importance": ablation.read_ablation,
    "swap": router_swap.read_swap,
    "steering": steering.read_steering,
}


def seal_file(path: Path) -> str:
    """Seal one result (see the module docstring); returns what was done."""
    original = path.read_text(encoding="utf-8")
    result = json.loads(original)
    kind = result_kind(result)
    if kind is None:
        raise ValueError(f"{path} is not a moee ablate result (one of {', '.join(KINDS)})")
    if SEAL_KEY in result:
        READERS[kind](path)  # its seal must match
        return "already sealed"
    meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
    recorded = meta.get("weights_digest")
    if recorded is None:
        raise ValueError(f"{path} records no weights digest: re-run `moee ablate` instead")
    model = meta.get("model")
    folder = MINILM_MOE_DIR if model in (None, BUNDLED) else Path(str(model))
    if not folder.is_dir():
        raise ValueError(
            f"{path}: its model {model} is not a local folder here; re-run `moee ablate` instead"
        )
    current = weights_digest(SimpleNamespace(name_or_path=str(folder)))
    if current != recorded:
        raise ValueError(
            f"{path} is a result of other weights ({recorded}) than {folder} now holds ({current}); "
            "re-run `moee ablate` instead"
        )
    write_result(path, result)
    try:
        READERS[kind](path)
    except ValueError:
        path.write_text(original, encoding="utf-8")  # as it was
        raise
    return f"sealed ({kind}, weights {recorded})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path, help="importance.json / swap.json / steering.json")
    args = parser.parse_args(argv)
    for path in args.files:
        print(f"{path}: {seal_file(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
