"""``moee quickstart``: the whole pipeline on the bundled default model, offline, in about a minute.

1. loads the model and the mini variants of the offline suite (one task per family, ``--tasks
   mini``);
2. embeds every text of those tasks under two configurations: **the model's own** (its saved
   ``moee_embedding.json``, else the library defaults; the bundled model's: mean pooling, no prompt),
   resolved by the rule every command follows (``moee.embed.config.resolve_config``), and **the
   paper's** (MoEE sum, PromptEOL, last token, softmax RW). One forward pass per text and
   configuration serves every method; a sample of the texts is written as HS, RW, MoEE concat and
   MoEE sum embeddings (``embeddings/<method>.npy`` + JSON sidecars, which record the configuration);
3. scores the four methods under the model's configuration, the paper's configuration and the dense
   baseline all-MiniLM-L6-v2 with mteb (MoEE sum with the label-free alpha; every text is embedded
   once per model, the vectors of step 2 are reused) and prints the table;
4. writes the expert-specialization report of the sample (``moee.analysis.specialization``), with
   the task of each text as its domain;
5. prints where every output went and how long each step took.

The mini tasks are small (seeded subsets: a smoke test of the whole pipeline, not a benchmark):
the full suite is ``moee evaluate --tasks offline`` (``eval/run_offline.sh``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

#: Texts per task written as sample embeddings (step 2) and routed by the report (step 4).
SAMPLE_PER_TASK = 8

#: The rows the table compares: the model's configuration for every method, the paper's beside it.
ALPHA = {"alpha": "auto"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quickstart",
        help="offline demo: embed, evaluate the model's and the paper's configuration beside the "
        "baseline, report (about a minute on 2 CPU cores)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("moee-quickstart"), help="output folder (default ./moee-quickstart)"
    )
    from moee.cli_options import add_loading_arguments

    add_loading_arguments(p)
    p.add_argument("--no-baseline", action="store_true", help="skip all-MiniLM-L6-v2")
    p.set_defaults(func=run)


def sample_rows(tasks: list[Any], per_task: int = SAMPLE_PER_TASK) -> list[dict[str, str]]:
    """The first ``per_task`` distinct texts of every task (deterministic), with the task's name."""
    from moee.evaluation.runner import task_texts

    return [
        {"task": task.metadata.name, "text": text} for task in tasks for text in task_texts(task)[:per_task]
    ]


def all_texts(tasks: list[Any]) -> list[str]:
    """Every distinct input text of the tasks, in task order (what the evaluation embeds)."""
    from moee.evaluation.runner import task_texts

    return list(dict.fromkeys(t for task in tasks for t in task_texts(task)))


def embed_texts(embedder: Any, configs: list[Any], texts: list[str], log=print) -> dict[tuple, Any]:
    """Step 2: one forward pass per text and feature configuration; returns the trace caches (feature
    key -> ``TraceCache``) the evaluation reads instead of running the model again."""
    from moee.evaluation.adapter import TraceCache

    caches: dict[tuple, Any] = {}
    for config in configs:
        key = config.feature_key()
        if key in caches:
            continue
        start = time.perf_counter()
        caches[key] = cache = TraceCache(embedder, config=config)
        cache.get_features(texts, show_progress_bar=True)
        log(
            f"      {len(texts)} texts under {config.replace(method='hs').label}: "
            f"{time.perf_counter() - start:.1f}s"
        )
    return caches


def write_sample(
    embedder: Any, config: Any, cache: Any, rows: list[dict[str, str]], out_dir: Path, log=print
) -> dict[str, Path]:
    """HS, RW, MoEE concat and MoEE sum of the sample under ``config``, from ``cache`` (no forward pass)."""
    from moee.embed.methods import METHODS
    from moee.embed.recipes import combine_features
    from moee.evaluation.adapter import model_identity
    from moee.io import run_metadata, texts_digest, write_embeddings, write_json_atomic

    texts = [r["text"] for r in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "texts.json", {"rows": rows})
    hs, rw = cache.get_features(texts)
    name, revision = model_identity(embedder)
    paths = {}
    alpha = config.alpha if config.alpha != "auto" else 1.0
    for method in METHODS:
        cell = config.replace(method=method, alpha=alpha)
        vectors = combine_features(hs, rw, method, alpha=cell.numeric_alpha(), normalize=cell.normalize)
        meta = {
            "model": name,
            "revision": revision,
            **cell.to_dict(),  # the whole resolved configuration, as `moee embed` records it
            "alpha": cell.alpha if cell.uses_alpha else None,
            "texts": "texts.json",
            "texts_sha256": texts_digest(texts)[0],  # what `moee search` checks, as for `moee embed`
            "weights_digest": embedder.weights_digest,
            **run_metadata(),
        }
        paths[method] = write_embeddings(out_dir / f"{method}.npy", vectors, meta)
    log(f"      sample: {len(texts)} texts x {', '.join(METHODS)} -> {out_dir}")
    return paths


def specialization_report(embedder: Any, rows: list[dict[str, str]], out_dir: Path, log=print) -> Path | None:
    """Step 4: the expert-specialization report of the sample (domains = tasks).

    Uses ``moee.analysis.specialization`` when this installation has it; otherwise says so.
    """
    try:
        from moee.analysis.specialization import build_report, write_report
    except ImportError:
        log("      skipped: this installation has no moee.analysis.specialization")
        return None
    from moee.io import run_metadata

    report = build_report(embedder, [(r["text"], r["task"]) for r in rows], progress=False)
    report["meta"] = {
        **run_metadata(["moee", "quickstart"]),
        "corpus": "quickstart sample (domain = mini task)",
    }
    paths = write_report(report, out_dir)
    s = report["summary"]
    log(
        f"      {s['n_texts']} texts, {s['n_tokens']} tokens: mean CV(load) {s['mean_cv_load']:.3f}, "
        f"worst max/mean load {s['max_over_mean_load']:.2f}"
    )
    return paths["html"]


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from moee.embed.config import PAPER_FIELDS
    from moee.embed.embedder import MoEEmbedder
    from moee.embed.methods import METHODS
    from moee.evaluation.runner import (
        EvalSettings,
        load_task_data,
        quiet_metric_warnings,
        resolve_tasks,
        run_evaluation,
    )
    from moee.loading import LoadOptions

    quiet_metric_warnings()
    out: Path = args.out
    from moee.io import check_not_an_input

    check_not_an_input(out, {"--model": args.model})  # its outputs never land in or around the model
    start = time.perf_counter()
    steps: dict[str, float] = {}

    def step_done(name: str, since: float) -> float:
        now = time.perf_counter()
        steps[name] = now - since
        return now

    print(f"[1/4] loading {args.model or 'the bundled default model'} and the mini tasks ...")
    loading = LoadOptions.from_args(args)
    embedder = MoEEmbedder.from_pretrained(args.model, loading)
    tasks = resolve_tasks("mini")
    load_task_data(tasks)
    own = embedder.default_config
    source = "its saved configuration" if embedder.model_config is not None else "the library defaults"
    print(
        f"      {embedder.name_or_path}: {embedder.n_moe_layers} MoE layers x {embedder.n_experts} experts, "
        f"hidden {embedder.hidden_size}; embeds with {source}: pooling {own.pooling}, "
        f"prompt {own.prompt_label}, score {own.score}"
    )
    t = step_done("load", start)

    settings = EvalSettings(
        model=args.model,
        methods=METHODS,
        config=ALPHA,  # every other field: the model's configuration
        extra_cells=[{**PAPER_FIELDS, **ALPHA}],  # the paper's configuration, beside it
        tasks="mini",
        out=out / "mteb",
        baseline=not args.no_baseline,
        device=args.device,
        command="moee quickstart",
        loading=loading,
    )
    cells = settings.cells(embedder.model_config)
    texts = all_texts(tasks)
    print(
        f"[2/4] embedding the {len(texts)} texts of {', '.join(t.metadata.name for t in tasks)} under the "
        "model's configuration and the paper's (one forward pass per text and configuration, shared by "
        "every method) ..."
    )
    caches = embed_texts(embedder, cells, texts, log=print)
    rows = sample_rows(tasks)
    emb_paths = write_sample(embedder, cells[0], caches[cells[0].feature_key()], rows, out / "embeddings")
    t = step_done("embed", t)

    print(
        "[3/4] mteb: HS, RW, MoEE concat, MoEE sum (model's configuration), MoEE sum (paper's), baseline ..."
    )
    summary = run_evaluation(
        settings, embedder=embedder, tasks=tasks, log=lambda m: print("      " + m), trace_caches=caches
    )
    table = Path(summary["tables_md"]).read_text(encoding="utf-8")
    print()
    print(table.split("## Per task")[0])
    t = step_done("evaluate", t)
    print("[4/4] expert-specialization report ...")
    report = specialization_report(embedder, rows, out / "report")
    step_done("report", t)
    print()
    timing = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in steps.items())
    print(f"quickstart finished in {time.perf_counter() - start:.0f}s ({timing}). Outputs:")
    outputs = {
        "sample texts": out / "embeddings" / "texts.json",
        **{f"embeddings ({m})": p for m, p in emb_paths.items()},
        "results table (markdown)": summary["tables_md"],
        "results table (JSON)": summary["tables_json"],
        "label-free alpha choices": summary["alpha_choices"],
        "mteb result cache": out / "mteb" / "results",
    }
    if report is not None:
        outputs["expert-specialization report"] = report
    for label, path in outputs.items():
        print(f"  {label:32s} {path}")
    return 0
