"""``moee evaluate``: MTEB evaluation of HS / RW / MoEE embeddings (and the dense baseline).

    moee evaluate --tasks offline --out eval/results/offline --baseline
    moee evaluate --model allenai/OLMoE-1B-7B-0924 --tasks paper --out runs/olmoe   # network + GPU
    moee evaluate --tables-only --out eval/results/offline                          # rebuild tables

Every configuration flag left out (pooling, score, alpha, recipe options; ``--prompts``) comes from
the model's saved configuration, else the library default, exactly as for ``moee embed``: a score
reported here is the score of the vectors ``moee embed`` writes with the same flags. ``--alpha auto``
chooses the MoEE(sum) weight per task without labels.

Results are cached with ``mteb.ResultCache`` under ``--out`` (a rerun only does what is
missing); the tables (``tables.md`` / ``tables.json``) are rebuilt from that cache.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from moee.evaluation.settings import EVAL_NOT_FLAGS as NOT_FLAGS
from moee.evaluation.settings import EvalSettings

__all__ = ["NOT_FLAGS", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate embeddings with mteb (offline tasks, the paper's suite or named tasks)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, EvalSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.evaluation.runner import TaskDataUnavailableError, quiet_metric_warnings, run_evaluate

    argv = sys.argv[1:]
    command = "moee " + shlex.join(argv) if argv[:1] == ["evaluate"] else None
    settings = settings_of(EvalSettings, args, command=command)  # every flag checked here
    quiet_metric_warnings()
    try:
        result = run_evaluate(settings)
    except TaskDataUnavailableError as exc:
        print(f"moee evaluate: error: {exc}", file=sys.stderr)
        return 2
    tables = Path(result["tables_md"]).read_text(encoding="utf-8")
    if settings.tables_only:
        print(tables)
        print(f"tables: {result['tables_md']} and {result['tables_json']}")
        return 0
    print()
    print(tables.split("## Per task")[0])
    for label, path in result["outputs"].items():
        print(f"{label}: {path}")
    return 0
