"""Run the evaluation: tasks x prompts x methods (+ the dense baseline), cached with mteb.

``run_evaluation`` is what ``moee evaluate`` (through ``run_evaluate``) and ``moee quickstart``
call, with an :class:`~moee.evaluation.settings.EvalSettings`. Order of work:

1. resolve the tasks (``paper``, ``offline``, ``quick`` or mteb task names) and load their
   data *before* the model, so that a task whose data cannot be had (the paper's suite with
   no network) fails at once with a clear ``TaskDataUnavailableError``;
2. for each prompt, one ``TraceCache``: each task's texts go through the model once, and the
   four methods are computed from the cached HS/RW (``alpha='auto'`` first picks the
   MoEE(sum) weight from the task's own texts, see ``moee.evaluation.alpha``);
3. ``mteb.evaluate`` per (configuration, task) into ``mteb.ResultCache(out)``; finished
   (configuration, task) pairs are skipped on a rerun;
4. the tables (``moee.evaluation.tables``) plus ``run.json`` (command, versions, alpha
   choices, timings).

Task seeds are reset before every evaluation so that every configuration sees the same
classifier subsamples and clustering bootstraps, independent of run order.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moee.embed.config import EmbeddingConfig
from moee.evaluation.adapter import (
    AUTO_ALPHA,
    BASELINE_NAME,
    MoEEMTEBEncoder,
    TraceCache,
    baseline_revision,
    load_baseline_encoder,
    model_config_of,
    model_identity,
    model_name,
)
from moee.evaluation.alpha import choose_alpha
from moee.evaluation.paper import paper_task_names
from moee.evaluation.settings import EvalSettings  # re-exported: where it has always been
from moee.models.bundled import DEFAULT_MODEL

#: Packages recorded with every run besides ``moee.io.package_versions``'s (baseline, classifiers).
EVAL_PACKAGES = ("sentence-transformers", "scikit-learn", "scipy", "datasets")


def quiet_metric_warnings() -> None:
    """Silence the metric warnings that weak embeddings trigger by the hundred (for the CLI).

    A constant similarity makes a correlation undefined (recorded as NaN, shown as "–" in the
    tables), and a classifier that never predicts a class makes its precision 0 (sklearn's
    UndefinedMetricWarning); the numbers are right, the warnings are noise in a terminal.
    """
    from scipy.stats import ConstantInputWarning
    from sklearn.exceptions import UndefinedMetricWarning

    warnings.filterwarnings("ignore", category=ConstantInputWarning)
    warnings.filterwarnings("ignore", category=UndefinedMetricWarning)


class TaskDataUnavailableError(RuntimeError):
    """A task's dataset could not be loaded (typically: hub dataset, no network)."""


def package_versions() -> dict[str, str | None]:
    """``moee.provenance.package_versions`` plus the libraries only evaluation numbers depend on."""
    from moee.provenance import CORE_PACKAGES
    from moee.provenance import package_versions as versions

    return versions((*CORE_PACKAGES, *EVAL_PACKAGES))


def resolve_tasks(spec: str | Sequence[str]) -> list[Any]:
    """Task objects for ``paper``, ``offline``, ``quick`` or a list / comma list of task names.

    Offline task names (ours) and mteb task names can be mixed; an unknown name raises
    ``ValueError`` listing the offline names.
    """
    import mteb

    from moee.evaluation.tasks import MINI_TASK_NAMES, OFFLINE_TASK_NAMES, QUICK_TASK_NAMES, offline_tasks

    if isinstance(spec, str):
        if spec == "paper":
            return list(mteb.get_tasks(tasks=paper_task_names(), languages=["eng"]))
        if spec == "offline":
            return offline_tasks()
        if spec == "quick":
            return offline_tasks(QUICK_TASK_NAMES)
        if spec == "mini":
            return offline_tasks(MINI_TASK_NAMES)
        names = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        names = list(spec)
    if not names:
        raise ValueError("no tasks given; use 'paper', 'offline', 'quick', 'mini' or task names")
    out = []
    for name in names:
        if name in ("paper", "offline", "quick", "mini"):
            out.extend(resolve_tasks(name))
        elif name in OFFLINE_TASK_NAMES or name in QUICK_TASK_NAMES or name in MINI_TASK_NAMES:
            out.extend(offline_tasks([name]))
        else:
            try:
                out.append(mteb.get_task(name))
            except KeyError as exc:
                raise ValueError(
                    f"unknown task {name!r}: not an offline task ({', '.join(OFFLINE_TASK_NAMES)}) "
                    "and not an mteb task name"
                ) from exc
    return out


def load_task_data(tasks: Iterable[Any]) -> None:
    """Load every task's data now; raise ``TaskDataUnavailableError`` naming what is missing."""
    failures = []
    for task in tasks:
        if task.data_loaded:
            continue
        try:
            task.load_data()
        except Exception as exc:  # datasets raises many kinds (offline mode, connection, not found)
            path = task.metadata.dataset.get("path", "?")
            failures.append(
                f"  - {task.metadata.name} (dataset {path}): {type(exc).__name__}: {exc}".rstrip()
            )
    if failures:
        raise TaskDataUnavailableError(
            "could not load the data of these tasks:\n"
            + "\n".join(failures)
            + "\nThe paper's tasks are downloaded from the Hugging Face Hub: they need network access "
            "(unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) or a datasets cache that already holds them, "
            "and a GPU to be practical. Offline, use --tasks offline."
        )


def _training_summary(embedder: Any) -> dict[str, Any] | None:
    """Steps and held-out perplexity from a local model's ``metrics.json`` (our trained models)."""
    path = Path(str(getattr(embedder, "name_or_path", ""))) / "metrics.json"
    if not path.is_file():
        return None
    metrics = json.loads(path.read_text(encoding="utf-8"))
    keys = ("checkpoint", "steps", "max_steps", "train_tokens_seen", "heldout_ppl")
    return {k: metrics[k] for k in keys if k in metrics}


def _load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages: wall times mean little without them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if isinstance(v, str)))


def _column(ds: Any, name: str) -> list[str]:
    values = ds[name]
    flat: list[str] = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    return [v for v in flat if isinstance(v, str)]


def task_texts(task: Any) -> list[str]:
    """The distinct input texts of a loaded task, over its eval splits (and train split).

    Used only for the label-free alpha choice: labels and gold scores are never read.
    """
    from mteb.abstasks import (
        AbsTaskClassification,
        AbsTaskPairClassification,
        AbsTaskRetrieval,
        AbsTaskSTS,
    )

    if not task.data_loaded:
        load_task_data([task])
    splits = list(task.eval_splits)
    if isinstance(task, AbsTaskClassification):
        splits.append(task.train_split)
        columns = [task.input_column_name]
    elif isinstance(task, AbsTaskSTS):
        columns = list(task.column_names)
    elif isinstance(task, AbsTaskPairClassification):
        columns = [task.input1_column_name, task.input2_column_name]
    elif isinstance(task, AbsTaskRetrieval):
        columns = []
    else:
        columns = [getattr(task, "input_column_name", None) or getattr(task, "text_column_name", "text")]
        for extra in ("human_summaries_column_name", "machine_summaries_column_name"):
            if hasattr(task, extra):
                columns.append(getattr(task, extra))
    texts: list[str] = []
    subsets = task.dataset if set(task.hf_subsets) <= set(task.dataset) else {"default": task.dataset}
    for subset in task.hf_subsets:
        data = subsets.get(subset, subsets.get("default"))
        for split in dict.fromkeys(splits):
            if split not in data:
                continue
            part = data[split]
            if isinstance(task, AbsTaskRetrieval):
                texts += _column(part["queries"], "text") + _column(part["corpus"], "text")
            else:
                for col in columns:
                    if isinstance(col, str) and col in part.column_names:
                        texts += _column(part, col)
    return _unique(texts)


def _reset_seed(task: Any) -> None:
    """Make every configuration see the same subsamples and bootstraps."""
    from mteb._set_seed import _set_seed

    task.rng_state, task.np_rng = _set_seed(task.seed)


def _is_cached(cache: Any, encoder_or_meta: Any, task: Any) -> bool:
    """Whether ``cache`` already holds every split and subset of ``task`` for this model."""
    meta = getattr(encoder_or_meta, "mteb_model_meta", encoder_or_meta)
    existing = cache.load_task_result(task.metadata.name, meta)
    return existing is not None and not existing.get_missing_evaluations(task)


def _evaluate(encoder: Any, task: Any, cache: Any, settings: EvalSettings) -> float:
    import mteb

    _reset_seed(task)
    start = time.perf_counter()
    result = mteb.evaluate(
        encoder,
        [task],
        cache=cache,
        overwrite_strategy="always" if settings.overwrite else "only-missing",
        encode_kwargs={"batch_size": settings.batch_size, "show_progress_bar": False},
        show_progress_bar=False,
        co2_tracker=False,
    )
    if result.exceptions:
        raise RuntimeError(f"{task.metadata.name}: {result.exceptions[0].exception}")
    return time.perf_counter() - start


def _moee_encoder(
    embedder: Any,
    revision: str,
    config: EmbeddingConfig,
    traces: TraceCache | None,
    alpha_by_task: dict[str, float] | None = None,
) -> MoEEMTEBEncoder:
    """The encoder of one configuration; alpha only matters (and is only recorded) where the
    method uses it."""
    return MoEEMTEBEncoder(
        embedder,
        revision,
        config=config,
        alpha_by_task=alpha_by_task if config.uses_alpha else None,
        trace_cache=traces,
    )


def _alpha_key(embedder: Any, revision: str, config: EmbeddingConfig) -> str:
    """What label-free alpha choices are stored under: they depend on the weights and on how RW/HS
    are pooled and scored, and on the recipe options (which change the features too)."""
    key = f"{model_name(embedder)}@{revision} pooling={config.pooling} score={config.score}"
    return f"{key} {config.recipe_label}" if config.recipe_label else key


def choose_task_alphas(
    cache: TraceCache, tasks: Sequence[Any], *, rule: str, max_texts: int, batch_size: int, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """The label-free MoEE(sum) weight of each task, from (at most ``max_texts`` of) its texts."""
    choices = {}
    for task in tasks:
        texts = task_texts(task)
        if len(texts) > max_texts:
            rng = np.random.default_rng(seed)
            texts = [texts[i] for i in sorted(rng.choice(len(texts), size=max_texts, replace=False))]
        hs, rw = cache.get(texts, batch_size=batch_size)
        choices[task.metadata.name] = choose_alpha(hs, rw, rule=rule, seed=seed).to_dict()
    return choices


@dataclass(frozen=True)
class _Run:
    """What every part of one run shares: the settings, the model, mteb's result cache and the two
    records kept as it goes (the label-free alpha choices, rewritten after each new choice so an
    interrupted run keeps them, and the seconds of each evaluation)."""

    settings: EvalSettings
    embedder: Any
    revision: str
    cache: Any  # mteb.ResultCache under settings.out
    alpha_path: Path
    all_choices: dict[str, dict[str, dict[str, dict[str, Any]]]]  # alpha key -> prompt -> task -> choice
    timings: dict[str, float]
    log: Callable[[str], None]

    def write_alpha_choices(self) -> None:
        self.alpha_path.write_text(json.dumps(self.all_choices, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class _Resolved:
    """The run's configuration resolved against the loaded model (its saved configuration, if any)."""

    model_config: Any
    base: EmbeddingConfig
    prompts: list[Any]
    cells: list[EmbeddingConfig]


def _tasks_and_embedder(
    settings: EvalSettings, embedder: Any, tasks: Sequence[Any] | None, log: Callable[[str], None]
) -> tuple[Sequence[Any], Any]:
    """The tasks with their data loaded, then the model: data that cannot be had fails before the
    (slow) model load."""
    if tasks is None:
        tasks = resolve_tasks(settings.tasks)
    log(f"tasks: {', '.join(t.metadata.name for t in tasks)}")
    load_task_data(tasks)
    if embedder is None:
        from moee.embed.embedder import MoEEmbedder

        log(f"loading model {settings.model or DEFAULT_MODEL} ...")
        embedder = MoEEmbedder.from_pretrained(settings.model, settings.load)
    return tasks, embedder


def _resolve(settings: EvalSettings, embedder: Any, log: Callable[[str], None]) -> _Resolved:
    """Every cell checked as a configuration of this model, and the base configuration logged with
    where its values came from."""
    model_config = model_config_of(embedder)
    cells = settings.cells(model_config)  # every cell is a valid configuration of this model too
    base = settings.base_config(model_config)
    prompts = settings.prompt_list(model_config)
    source = "the model's saved configuration" if model_config is not None else "the library defaults"
    given = ", ".join(sorted(settings.config)) or "none"
    shown = {k: v for k, v in base.experiment_kwargs().items() if k not in ("method", "prompt")}
    log(f"configuration {shown} (given: {given}; the rest from {source})")
    return _Resolved(model_config, base, prompts, cells)


def _start_run(
    settings: EvalSettings,
    embedder: Any,
    groups: dict[tuple, list[EmbeddingConfig]],
    log: Callable[[str], None],
) -> _Run:
    """The result cache and the records of earlier runs under ``out``: ``--overwrite`` drops the
    alpha choices of this run's configurations and every timing."""
    import mteb

    out = Path(settings.out)
    revision = model_identity(embedder)[1]
    alpha_path = out / "alpha_choices.json"
    all_choices = json.loads(alpha_path.read_text(encoding="utf-8")) if alpha_path.is_file() else {}
    if settings.overwrite:
        for group in groups.values():
            all_choices.pop(_alpha_key(embedder, revision, group[0]), None)
    timings_path = out / "timings.json"
    # a cell the cache already holds keeps the seconds measured when it ran (a rerun that only
    # rebuilds the tables from the cache must not erase them)
    timings = (
        {}
        if settings.overwrite or not timings_path.is_file()
        else json.loads(timings_path.read_text(encoding="utf-8"))
    )
    cache = mteb.ResultCache(out)
    return _Run(settings, embedder, revision, cache, alpha_path, all_choices, timings, log)


def _feature_groups(cells: Sequence[EmbeddingConfig]) -> dict[tuple, list[EmbeddingConfig]]:
    """The cells by the features they share: one forward pass per text serves a whole group (all
    methods of a prompt)."""
    groups: dict[tuple, list[EmbeddingConfig]] = {}
    for cell in cells:
        groups.setdefault(cell.feature_key(), []).append(cell)
    return groups


def _group_tag(features: EmbeddingConfig, base: EmbeddingConfig) -> str:
    """How a group is named in the log and the timings: its prompt, plus pooling and score where they
    differ from the base configuration's."""
    prompt_name = features.prompt_label
    if (features.pooling, features.score) == (base.pooling, base.score):
        return prompt_name
    return f"{prompt_name}, pooling={features.pooling}, score={features.score}"


def _task_alpha(
    run: _Run,
    alpha_choices: dict[str, dict[str, Any]],
    features: EmbeddingConfig,
    traces: TraceCache,
    task: Any,
) -> dict[str, Any]:
    """The task's label-free alpha choice: the recorded one if made under the same rule, else chosen
    now from the task's texts and recorded at once."""
    settings, name, prompt_name = run.settings, task.metadata.name, features.prompt_label
    choice = alpha_choices.get(prompt_name, {}).get(name)
    if choice is None or choice.get("rule") != settings.alpha_rule:
        choice = choose_task_alphas(
            traces,
            [task],
            rule=settings.alpha_rule,
            max_texts=settings.alpha_max_texts,
            batch_size=settings.batch_size,
        )[name]
        alpha_choices.setdefault(prompt_name, {})[name] = choice
        run.alpha_path.parent.mkdir(parents=True, exist_ok=True)
        run.write_alpha_choices()
    return choice


def _evaluate_task(
    run: _Run,
    group: list[EmbeddingConfig],
    tag: str,
    traces: TraceCache,
    alpha_choices: dict[str, dict[str, Any]],
    task: Any,
) -> None:
    """Every cell of a group that the cache lacks for this task, sharing one alpha choice."""
    settings, name = run.settings, task.metadata.name
    pending = [
        c
        for c in group
        if settings.overwrite
        or not _is_cached(run.cache, _moee_encoder(run.embedder, run.revision, c, traces), task)
    ]
    if not pending:
        run.log(f"[{tag}] {name}: all methods already in the cache")
        return
    alpha_by_task = None
    if any(c.uses_alpha and c.alpha == AUTO_ALPHA for c in pending):
        choice = _task_alpha(run, alpha_choices, group[0], traces, task)
        alpha_by_task = {name: choice["alpha"]}
        run.log(f"[{tag}] {name}: alpha={choice['alpha']:.4g} ({settings.alpha_rule} rule, label-free)")
    for cell in pending:
        encoder = _moee_encoder(run.embedder, run.revision, cell, traces, alpha_by_task)
        seconds = _evaluate(encoder, task, run.cache, settings)
        run.timings[f"{cell.method}/{tag}/{name}"] = round(seconds, 2)
        run.log(f"[{tag}] {name} {cell.method}: {seconds:.1f}s")


def _evaluate_groups(
    run: _Run,
    groups: dict[tuple, list[EmbeddingConfig]],
    base: EmbeddingConfig,
    tasks: Sequence[Any],
    trace_caches: dict[tuple, TraceCache] | None,
) -> dict[str, dict[str, float]]:
    """Every group over every task; returns configuration tag -> task -> its label-free alpha (for the
    groups whose alpha is chosen)."""
    chosen: dict[str, dict[str, float]] = {}
    for key, group in groups.items():
        features = group[0]
        tag = _group_tag(features, base)
        alpha_choices = run.all_choices.setdefault(_alpha_key(run.embedder, run.revision, features), {})
        own_cache = trace_caches is None or key not in trace_caches
        traces = TraceCache(run.embedder, config=features) if own_cache else trace_caches[key]
        if trace_caches is not None:
            trace_caches[key] = traces
        for task in tasks:
            _evaluate_task(run, group, tag, traces, alpha_choices, task)
        if any(c.uses_alpha and c.alpha == AUTO_ALPHA for c in group):
            chosen[tag] = {t: c["alpha"] for t, c in alpha_choices.get(features.prompt_label, {}).items()}
        if trace_caches is None:  # caches the caller shares are its to keep
            traces.clear()  # rows are kept across the tasks of a prompt: tasks share some texts
    return chosen


def _evaluate_baseline(run: _Run, tasks: Sequence[Any]) -> None:
    """The dense baseline on every task the cache lacks it for, loaded only if one does."""
    from mteb.models import ModelMeta

    baseline = None
    baseline_probe = ModelMeta.create_empty({"name": BASELINE_NAME, "revision": baseline_revision()})
    for task in tasks:
        if not run.settings.overwrite and _is_cached(run.cache, baseline_probe, task):
            run.log(f"[baseline] {task.metadata.name}: already in the cache")
            continue
        if baseline is None:
            run.log("loading baseline all-MiniLM-L6-v2 ...")
            baseline = load_baseline_encoder(device=run.settings.load.device)
        seconds = _evaluate(baseline, task, run.cache, run.settings)
        run.timings[f"baseline/{task.metadata.name}"] = round(seconds, 2)
        run.log(f"[baseline] {task.metadata.name}: {seconds:.1f}s")


def _run_info(
    run: _Run,
    resolved: _Resolved,
    tasks: Sequence[Any],
    chosen: dict[str, dict[str, float]],
    seconds: float,
    cpu_seconds: float,
) -> dict[str, Any]:
    """What ``run.json`` records: the command, model, configuration and its resolution, versions and
    timings."""
    from moee.provenance import CORE_PACKAGES, run_record

    settings, base = run.settings, resolved.base
    record = run_record(settings.command or " ".join(sys.argv), packages=(*CORE_PACKAGES, *EVAL_PACKAGES))
    model_config = resolved.model_config
    return {
        "command": record["command"],
        "model": settings.model or DEFAULT_MODEL,
        "model_name": model_name(run.embedder),
        "model_revision": run.revision,
        "model_training": _training_summary(run.embedder),
        "methods": list(settings.methods),
        "prompts": [settings.cell_config("hs", p, model_config).prompt_label for p in resolved.prompts],
        **{
            k: v
            for k, v in base.experiment_kwargs().items()
            if k in ("recipe", "hs_layer", "rw_layers", "reference")
        },
        "alpha": base.alpha,
        "alpha_rule": settings.alpha_rule if base.alpha == AUTO_ALPHA else None,
        "alpha_choices": chosen,
        "pooling": base.pooling,
        "score": base.score,
        # the resolution: the fields given, and the model's saved configuration the rest came from
        "config_given": sorted(settings.config),
        **(
            {"extra_cells": [c.experiment_kwargs() for c in resolved.cells[-len(settings.extra_cells) :]]}
            if settings.extra_cells
            else {}
        ),
        "model_config": model_config.to_record() if model_config is not None else None,
        "tasks": [t.metadata.name for t in tasks],
        "versions": record["versions"],
        "git_revision": record["git_revision"],
        **({"quantization": record["quantization"]} if "quantization" in record else {}),
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "load_average": _load_average(),
        **settings.extra,
    }


def run_evaluation(
    settings: EvalSettings,
    *,
    embedder: Any = None,
    tasks: Sequence[Any] | None = None,
    log: Callable[[str], None] = print,
    trace_caches: dict[tuple, TraceCache] | None = None,
) -> dict[str, Any]:
    """Evaluate, cache, and write the tables; returns a summary with the output paths.

    ``embedder`` (a loaded ``MoEEmbedder``) and ``tasks`` (task objects) may be passed in to
    reuse them; otherwise they come from ``settings``. ``trace_caches`` (feature key ->
    ``TraceCache``, see ``EmbeddingConfig.feature_key``) shares pooled features with the caller:
    caches found there are used, the ones made are added, and none is cleared.
    """
    import datasets

    datasets.disable_progress_bars()
    out = Path(settings.out)
    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks, embedder = _tasks_and_embedder(settings, embedder, tasks, log)
    resolved = _resolve(settings, embedder, log)
    groups = _feature_groups(resolved.cells)
    run = _start_run(settings, embedder, groups, log)
    chosen = _evaluate_groups(run, groups, resolved.base, tasks, trace_caches)
    if settings.baseline:
        _evaluate_baseline(run, tasks)
    total = time.perf_counter() - t0
    run_info = _run_info(run, resolved, tasks, chosen, total, time.process_time() - cpu0)
    from moee.evaluation.tables import write_tables

    paths = write_tables(out, out, tasks=[t.metadata.name for t in tasks], extra=run_info)
    run.write_alpha_choices()
    (out / "timings.json").write_text(json.dumps(run.timings, indent=2) + "\n", encoding="utf-8")
    log(f"done in {total:.0f}s")
    return {
        "out": out,
        "tables_md": paths["markdown"],
        "tables_json": paths["json"],
        "alpha_choices": run.alpha_path,
        "timings": out / "timings.json",
        "seconds": total,
        "embedder": embedder,
        "tasks": tasks,
        "config": resolved.base,
        "prompts": resolved.prompts,
    }


def run_evaluate(settings: EvalSettings, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The library side of ``moee evaluate``: with ``tables_only`` the tables rebuilt from the cache
    under ``out``, else :func:`run_evaluation` (and, with ``alpha_sensitivity``, the alpha
    sensitivity curve); returns the tables' paths and every output by name (``outputs``)."""
    from moee.evaluation.tables import write_tables

    out = Path(settings.out)
    if settings.tables_only:
        paths = write_tables(out, out)
        return {"tables_md": paths["markdown"], "tables_json": paths["json"], "outputs": {}}
    from moee.io import check_not_an_input

    check_not_an_input(out, {"--model": settings.model})  # results never land in or around the model
    summary = run_evaluation(settings, log=log)
    outputs: dict[str, Any] = {"tables": summary["tables_md"], "tables (JSON)": summary["tables_json"]}
    if settings.alpha_sensitivity:
        from moee.evaluation.alpha import write_alpha_sensitivity

        outputs.update(
            write_alpha_sensitivity(
                summary["embedder"], out, config=summary["config"], prompts=summary["prompts"]
            )
        )
    outputs.update({"alpha choices": summary["alpha_choices"], "mteb result cache": out / "results"})
    return {**summary, "outputs": outputs}
