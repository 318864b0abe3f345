"""``moee quickstart``: the whole pipeline on the bundled default model, offline, in minutes.

1. embeds a sample of the offline evaluation texts with HS, RW, MoEE concat and MoEE sum
   (``embeddings/<method>.npy`` + JSON sidecars);
2. runs a fast subset of the offline mteb suite (one task per family) for the four methods
   (MoEE sum with the label-free alpha), and the dense baseline all-MiniLM-L6-v2;
3. prints the results table beside the baseline;
4. writes the expert-specialization report of the sample (``moee.analysis.specialization``),
   with the offline task of each text as its domain;
5. prints where every output went.

Steps 1 and 2 embed with the model's own configuration (its saved ``moee_embedding.json``, else the
library defaults; the bundled model's: mean pooling, no prompt), by the rule every command follows
(``moee.embed.config.resolve_config``); the outputs record it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

#: Texts per offline task in the embedding sample of step 1.
SAMPLE_PER_TASK = 40


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quickstart",
        help="offline demo: embed, evaluate a fast suite beside the baseline, report (a few minutes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("moee-quickstart"), help="output folder (default ./moee-quickstart)"
    )
    from moee.loading import add_loading_arguments

    add_loading_arguments(p)
    p.add_argument("--no-baseline", action="store_true", help="skip all-MiniLM-L6-v2")
    p.set_defaults(func=run)


def sample_texts(per_task: int = SAMPLE_PER_TASK) -> list[dict[str, str]]:
    """The first ``per_task`` distinct texts of every offline task (deterministic)."""
    from moee.data.offline_tasks import OFFLINE_TASKS, load_task_data

    rows: list[dict[str, str]] = []
    for name in OFFLINE_TASKS:
        data = load_task_data(name)
        texts: list[str] = []
        for stem in ("test", "queries", "corpus"):
            for row in data.get(stem, []):
                texts += [row[k] for k in ("text", "sentence1", "sentence2") if isinstance(row.get(k), str)]
        for text in list(dict.fromkeys(texts))[:per_task]:
            rows.append({"task": name, "text": text})
    return rows


def embed_sample(embedder: Any, rows: list[dict[str, str]], out_dir: Path, log=print) -> dict[str, Path]:
    """Step 1: HS, RW, MoEE concat and MoEE sum of the sample under the model's configuration
    (one forward pass for all four)."""
    from moee.embed.methods import METHODS
    from moee.embed.recipes import combine_features
    from moee.evaluation.adapter import TraceCache, model_identity
    from moee.io import run_metadata, write_embeddings, write_json_atomic

    texts = [r["text"] for r in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "texts.json", {"rows": rows})
    start = time.perf_counter()
    base = embedder.default_config  # the model's saved configuration, else the library defaults
    hs, rw = TraceCache(embedder, config=base).get_features(texts)
    log(
        f"embedded {len(texts)} texts in {time.perf_counter() - start:.1f}s (one forward pass for all methods)"
    )
    name, revision = model_identity(embedder)
    paths = {}
    for method in METHODS:
        config = base.replace(method=method)
        vectors = combine_features(hs, rw, method, alpha=config.numeric_alpha(), normalize=config.normalize)
        meta = {
            "model": name,
            "revision": revision,
            **config.to_dict(),  # the whole resolved configuration, as `moee embed` records it
            "alpha": config.alpha if config.uses_alpha else None,
            "texts": "texts.json",
            **run_metadata(),
        }
        paths[method] = write_embeddings(out_dir / f"{method}.npy", vectors, meta)
        log(f"  {method:12s} {vectors.shape[0]} x {vectors.shape[1]}")
    return paths


def specialization_report(embedder: Any, rows: list[dict[str, str]], out_dir: Path, log=print) -> Path | None:
    """Step 4: the expert-specialization report of the sample (domains = offline tasks).

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
        "corpus": "quickstart sample (domain = offline task)",
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
    from moee.embed.embedder import MoEEmbedder
    from moee.embed.methods import METHODS
    from moee.evaluation.runner import EvalSettings, quiet_metric_warnings, run_evaluation
    from moee.evaluation.tasks import QUICK_TASK_NAMES
    from moee.loading import LoadOptions

    quiet_metric_warnings()
    out: Path = args.out
    start = time.perf_counter()
    print(f"[1/4] loading {args.model or 'the bundled default model'} ...")
    loading = LoadOptions.from_args(args)
    embedder = MoEEmbedder.from_pretrained(args.model, loading)
    print(
        f"      {embedder.name_or_path}: {embedder.n_moe_layers} MoE layers x {embedder.n_experts} experts, "
        f"hidden {embedder.hidden_size}"
    )
    print("[2/4] embedding a sample of the offline data with HS, RW, MoEE concat, MoEE sum ...")
    rows = sample_texts()
    emb_paths = embed_sample(embedder, rows, out / "embeddings")
    own = embedder.default_config
    print(
        f"[3/4] mteb on {', '.join(QUICK_TASK_NAMES)} (the model's configuration: pooling {own.pooling}, "
        f"prompt {own.prompt_label}, score {own.score}; MoEE sum alpha auto) ..."
    )
    settings = EvalSettings(
        model=args.model,
        methods=METHODS,
        config={"alpha": "auto"},  # every other field: the model's configuration
        tasks=list(QUICK_TASK_NAMES),
        out=out / "mteb",
        baseline=not args.no_baseline,
        device=args.device,
        command="moee quickstart",
        loading=loading,
    )
    summary = run_evaluation(settings, embedder=embedder, log=lambda m: print("      " + m))
    table = Path(summary["tables_md"]).read_text(encoding="utf-8")
    print()
    print(table.split("## Per task")[0])
    print("[4/4] expert-specialization report ...")
    report = specialization_report(embedder, rows, out / "report")
    print()
    print(f"quickstart finished in {time.perf_counter() - start:.0f}s. Outputs:")
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
