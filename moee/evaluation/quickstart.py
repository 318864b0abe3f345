"""``run_quickstart(settings)``: the library side of ``moee quickstart``
(:class:`moee.evaluation.settings.QuickstartSettings`): the whole pipeline on one model, offline.

It loads the model and the mini tasks, embeds every text of those tasks under the model's own
configuration and the paper's (one forward pass per text and configuration, shared by every
method), writes a sample as HS, RW, MoEE concat and MoEE sum embeddings, scores the four methods
and the dense baseline with mteb (:func:`moee.evaluation.runner.run_evaluation`, reusing those
forward passes), writes the expert-specialization report of the sample, and says where every
output went and how long each step took.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moee.evaluation.settings import QuickstartSettings
from moee.models.bundled import DEFAULT_MODEL

__all__ = [
    "ALPHA",
    "SAMPLE_PER_TASK",
    "all_texts",
    "embed_texts",
    "run_quickstart",
    "sample_rows",
    "write_sample",
]

#: Texts per task written as sample embeddings (step 2) and routed by the report (step 4).
SAMPLE_PER_TASK = 8

#: The rows the table compares: the model's configuration for every method, the paper's beside it.
ALPHA = {"alpha": "auto"}


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
    worst = max(report["layers"], key=lambda layer: layer["max_over_mean_load"])
    log(
        f"      {s['n_texts']} texts, {s['n_tokens']} tokens: mean CV(load) {s['mean_cv_load']:.3f}, "
        f"worst max/mean load {s['max_over_mean_load']:.2f} (layer {worst['layer']})\n"
        "      (a small sample of a few tasks: experts that prefer one task's texts show here as imbalance; "
        "`moee report` on a large, mixed corpus measures balance)"
    )
    return paths["html"]


def run_quickstart(settings: QuickstartSettings, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the pipeline into ``settings.out``; ``log`` gets the progress lines and the results
    table. Returns every output by name (``outputs``) and the seconds of each step (``steps``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from moee.embed.config import PAPER_FIELDS
    from moee.embed.methods import METHODS
    from moee.evaluation.runner import EvalSettings, quiet_metric_warnings, run_evaluation
    from moee.io import check_not_an_input

    quiet_metric_warnings()
    out = settings.out
    check_not_an_input(out, {"--model": settings.model})  # its outputs never land in or around the model
    start = time.perf_counter()
    steps: dict[str, float] = {}

    def step_done(name: str, since: float) -> float:
        now = time.perf_counter()
        steps[name] = now - since
        return now

    embedder, tasks = _load(settings, log)
    t = step_done("load", start)

    evaluation = EvalSettings(
        model=settings.model,
        load=settings.load,
        methods=METHODS,
        config=ALPHA,  # every other field: the model's configuration
        extra_cells=({**PAPER_FIELDS, **ALPHA},),  # the paper's configuration, beside it
        tasks="mini",
        out=out / "mteb",
        baseline=settings.baseline,
        command="moee quickstart",
    )
    cells = evaluation.cells(embedder.model_config)
    texts = all_texts(tasks)
    log(
        f"[2/4] embedding the {len(texts)} texts of {', '.join(t.metadata.name for t in tasks)} under the "
        "model's configuration and the paper's (one forward pass per text and configuration, shared by "
        "every method) ..."
    )
    caches = embed_texts(embedder, cells, texts, log=log)
    rows = sample_rows(tasks)
    emb_paths = write_sample(
        embedder, cells[0], caches[cells[0].feature_key()], rows, out / "embeddings", log=log
    )
    t = step_done("embed", t)

    log("[3/4] mteb: HS, RW, MoEE concat, MoEE sum (model's configuration), MoEE sum (paper's), baseline ...")
    summary = run_evaluation(
        evaluation, embedder=embedder, tasks=tasks, log=lambda m: log("      " + m), trace_caches=caches
    )
    table = Path(summary["tables_md"]).read_text(encoding="utf-8")
    log("")
    log(table.split("## Per task")[0])
    t = step_done("evaluate", t)
    log("[4/4] expert-specialization report ...")
    report = specialization_report(embedder, rows, out / "report", log=log)
    step_done("report", t)
    outputs = {
        "sample texts": out / "embeddings" / "texts.json",
        **{f"embeddings ({m})": p for m, p in emb_paths.items()},
        "results table (markdown)": summary["tables_md"],
        "results table (JSON)": summary["tables_json"],
        "label-free alpha choices": summary["alpha_choices"],
        "mteb result cache": out / "mteb" / "results",
        **({"expert-specialization report": report} if report is not None else {}),
    }
    return {"outputs": outputs, "steps": steps, "seconds": time.perf_counter() - start}


def _load(settings: QuickstartSettings, log: Callable[[str], None]) -> tuple[Any, list[Any]]:
    """Step 1: the model and the mini tasks' data."""
    from moee.embed.embedder import MoEEmbedder
    from moee.evaluation.runner import load_task_data, resolve_tasks

    log(f"[1/4] loading {settings.model or DEFAULT_MODEL} and the mini tasks ...")
    embedder = MoEEmbedder.from_pretrained(settings.model, settings.load)
    tasks = resolve_tasks("mini")
    load_task_data(tasks)
    own = embedder.default_config
    source = "its saved configuration" if embedder.model_config is not None else "the library defaults"
    log(
        f"      {embedder.name_or_path}: {embedder.n_moe_layers} MoE layers x {embedder.n_experts} experts, "
        f"hidden {embedder.hidden_size}; embeds with {source}: pooling {own.pooling}, "
        f"prompt {own.prompt_label}, score {own.score}"
    )
    return embedder, tasks
