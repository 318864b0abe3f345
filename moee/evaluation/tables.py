"""Result tables from an ``mteb.ResultCache`` folder: per task and per family, markdown + JSON.

Averages follow the paper: a family score is the mean of its tasks' main scores (in percent),
and ``Avg`` is the mean of the family scores of Classification, Clustering,
PairClassification, Reranking, STS and Summarization (those present). Retrieval is not part
of the paper's average and is reported in its own column. For the paper's three models the
published numbers are printed beside ours.

Pair classification is scored by each model's own similarity: mteb records the average
precision of the similarity the encoder declares (``similarity_ap``; cosine for every encoder
here, which for MoEE(sum) is the paper's similarity sum, see ``moee.embed.methods``). mteb's
``max_ap``, the best of cosine / Manhattan / Euclidean / dot chosen on the test labels, is what
its main score of a pair task may be; it is read only to be shown beside the AP, labelled, and
never enters an average.

Everything here reads the cache; nothing is recomputed, so tables can be rebuilt at any time
(``moee evaluate --tables-only``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moee.embed.config import config_label
from moee.embed.methods import METHOD_REGISTRY, METHODS
from moee.evaluation.paper import FAMILIES, paper_model_key, paper_scores, task_family

#: Column headers of the family table (the paper's abbreviations).
FAMILY_ABBREV: dict[str, str] = {
    "Classification": "CLF",
    "Clustering": "Clust",
    "PairClassification": "PairCLF",
    "Reranking": "Rerank",
    "STS": "STS",
    "Summarization": "Summ",
    "Retrieval": "Retr",
}

#: Score read for a task of each family, where it is not the task's mteb main score
#: (first key present wins; see the module docstring).
FAMILY_SCORE_KEYS: dict[str, tuple[str, ...]] = {"PairClassification": ("similarity_ap", "cosine_ap")}

#: Extra scores shown beside a family's score (labelled, never averaged).
FAMILY_SIDE_SCORES: dict[str, tuple[str, ...]] = {"PairClassification": ("max_ap",)}

#: Table label of each method (from ``moee.embed.methods.METHOD_REGISTRY``).
METHOD_LABELS: dict[str, str] = {name: m.label for name, m in METHOD_REGISTRY.items()}


@dataclass(frozen=True)
class System:
    """One evaluated configuration: a model (name, revision) plus its embedding settings."""

    model: str
    revision: str
    config: tuple[tuple[str, Any], ...] = ()

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.config)

    @property
    def is_moee(self) -> bool:
        return "method" in self.settings

    def sort_key(self) -> tuple:
        s = self.settings
        method = s.get("method")
        return (
            not self.is_moee,  # MoE systems first, baselines last
            self.model,
            str(s.get("prompt", "")) != "none",
            METHODS.index(method) if method in METHODS else len(METHODS),
            str(s.get("alpha", "")),
            str(s.get("pooling", "")),
            str(s.get("score", "")),
        )

    def label(self) -> str:
        """A short human label, e.g. ``MoEE sum + PromptEOL (alpha=auto)`` or the baseline name."""
        if not self.is_moee:
            return self.model.split("/")[-1]
        return config_label(self.settings)


@dataclass
class ResultSet:
    """Scores (percent) per system and task, plus each task's family.

    ``side`` holds the labelled extra scores of ``FAMILY_SIDE_SCORES`` (system -> task -> name ->
    percent), shown beside the tables' scores and never averaged.
    """

    scores: dict[System, dict[str, float]] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)
    side: dict[System, dict[str, dict[str, float]]] = field(default_factory=dict)

    def add(self, system: System, task: str, score: float, family: str) -> None:
        """Record a main score; NaN (e.g. a correlation of constant similarities) is kept as undefined."""
        if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isinf(score):
            raise ValueError(f"score for {task} of {system.model} must be a number (or NaN), got {score!r}")
        self.scores.setdefault(system, {})[task] = float(score)
        self.families[task] = family

    def systems(self) -> list[System]:
        return sorted(self.scores, key=System.sort_key)

    def tasks(self) -> list[str]:
        order = {f: i for i, f in enumerate((*FAMILIES, "Retrieval"))}
        return sorted(
            self.families, key=lambda t: (order.get(self.families[t], len(order)), self.families[t], t)
        )


def lookup_family(task_name: str) -> str:
    """The family of a task: the paper's grouping, our offline tasks' type, else mteb's type."""
    family = task_family(task_name)
    if family:
        return family
    from moee.evaluation.tasks import offline_task_family

    family = offline_task_family(task_name)
    if family:
        return family
    try:
        import mteb

        return str(mteb.get_task(task_name).metadata.type)
    except (KeyError, ValueError):
        return "Other"


def _score_getter(family: str, path: Path) -> Callable[[Mapping[str, Any]], float]:
    """How to read a task's score from one split/subset's scores (see ``FAMILY_SCORE_KEYS``)."""
    keys = FAMILY_SCORE_KEYS.get(family)
    if keys is None:
        return lambda scores: scores["main_score"]

    def getter(scores: Mapping[str, Any]) -> float:
        for key in keys:
            if key in scores:
                return scores[key]
        raise ValueError(
            f"{path}: a {family} result needs one of {', '.join(keys)} (the AP of the model's own "
            f"similarity); it has only {', '.join(sorted(scores))}"
        )

    return getter


def load_results(cache_dir: str | Path, tasks: Iterable[str] | None = None) -> ResultSet:
    """Read every result of an ``mteb.ResultCache`` folder (including experiment folders).

    ``tasks`` restricts to those task names. Scores (the main score, or the family's score of
    ``FAMILY_SCORE_KEYS``) are averaged over splits and subsets (as ``TaskResult.get_score``
    does) and reported in percent.
    """
    from mteb import ResultCache
    from mteb.results import TaskResult

    cache_dir = Path(cache_dir)
    if not (cache_dir / "results").is_dir():
        raise FileNotFoundError(f"no mteb results under {cache_dir} (expected {cache_dir / 'results'})")
    wanted = set(tasks) if tasks is not None else None
    paths = ResultCache(cache_dir).get_cache_paths(
        include_remote=False, require_model_meta=True, load_experiments="match_name"
    )
    results = ResultSet()
    for path in sorted(paths):
        if path.name == "run_settings.jsonl" or path.suffix != ".json":
            continue
        meta = json.loads((path.parent / "model_meta.json").read_text(encoding="utf-8"))
        task = TaskResult.from_disk(path)
        if wanted is not None and task.task_name not in wanted:
            continue
        config = tuple(sorted((meta.get("experiment_kwargs") or {}).items()))
        system = System(meta["name"], str(meta["revision"]), config)
        family = lookup_family(task.task_name)
        results.add(
            system, task.task_name, 100.0 * task.get_score(getter=_score_getter(family, path)), family
        )
        for key in FAMILY_SIDE_SCORES.get(family, ()):
            if all(key in s for split in task.scores.values() for s in split):
                value = 100.0 * task.get_score(getter=lambda scores, key=key: scores[key])
                results.side.setdefault(system, {}).setdefault(task.task_name, {})[key] = value
    return results


def family_scores(task_scores: Mapping[str, float], families: Mapping[str, str]) -> dict[str, Any]:
    """Family means and the paper-style average for one system.

    Returns ``{"families": {family: mean}, "avg": mean over the paper families present,
    "retrieval": mean of Retrieval tasks or None}``. A family appears only if the system has
    at least one of its tasks.
    """
    grouped: dict[str, list[float]] = defaultdict(list)
    for task, score in task_scores.items():
        if not math.isnan(score):  # undefined scores (constant similarities) are left out
            grouped[families[task]].append(score)
    fam = {f: sum(v) / len(v) for f, v in grouped.items()}
    in_avg = [fam[f] for f in FAMILIES if f in fam]
    return {
        "families": fam,
        "avg": sum(in_avg) / len(in_avg) if in_avg else None,
        "retrieval": fam.get("Retrieval"),
    }


def _paper_row(system: System) -> dict[str, Any] | None:
    key = paper_model_key(system.model)
    s = system.settings
    if key is None or not system.is_moee:
        return None
    if s.get("pooling", "last") != "last" or s.get("prompt") not in ("none", "prompteol"):
        return None
    return paper_scores(key, s["prompt"], s["method"])


def _side_columns(side: Mapping[str, Mapping[str, float]], tasks: Sequence[str]) -> dict[str, Any]:
    """``{score name: {task: percent}}`` of the side scores one system has (e.g. ``max_ap``)."""
    out: dict[str, dict[str, float]] = {}
    for task in tasks:
        for key, value in side.get(task, {}).items():
            out.setdefault(key, {})[task] = value
    return out


def build_tables(results: ResultSet) -> dict[str, Any]:
    """The JSON-able table document: per system its task scores, family means, Avg, paper row,
    and, under their own names (e.g. ``max_ap``), the labelled side scores it has."""
    systems = results.systems()
    tasks = results.tasks()
    present = [f for f in (*FAMILIES, "Retrieval") if any(results.families[t] == f for t in tasks)]
    extra = sorted({results.families[t] for t in tasks} - set(present))
    revisions: dict[str, set[str]] = defaultdict(set)
    for system in systems:
        revisions[system.model].add(system.revision)
    rows = []
    for system in systems:
        agg = family_scores(results.scores[system], results.families)
        several = len(revisions[system.model]) > 1  # tell revisions of one model apart
        rows.append(
            {
                "label": system.label(),
                "model": f"{system.model}@{system.revision}" if several else system.model,
                "revision": system.revision,
                "settings": system.settings,
                "tasks": {
                    t: (None if math.isnan(v) else v)
                    for t in tasks
                    if (v := results.scores[system].get(t)) is not None
                },
                "families": agg["families"],
                **_side_columns(results.side.get(system, {}), tasks),
                "avg": agg["avg"],
                "retrieval": agg["retrieval"],
                "complete": all(t in results.scores[system] for t in tasks),
                "paper": _paper_row(system),
            }
        )
    return {
        "families": present + extra,
        "avg_families": [f for f in FAMILIES if f in present],
        "tasks": [{"name": t, "family": results.families[t]} for t in tasks],
        "systems": rows,
    }


def _fmt(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.2f}"


def _cell(ours: float | None, paper: float | None) -> str:
    return _fmt(ours) if paper is None else f"{_fmt(ours)} ({paper:.2f})"


def family_markdown(doc: Mapping[str, Any]) -> str:
    """The family table: one row per system, paper numbers in parentheses where published."""
    fams = [f for f in doc["families"] if f != "Retrieval"]
    has_retrieval = "Retrieval" in doc["families"]
    header = ["Model", "Method", *[FAMILY_ABBREV.get(f, f) for f in fams], "Avg"]
    if has_retrieval:
        header.append("Retr")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in doc["systems"]:
        paper = row["paper"]
        cells = [row["model"], row["label"]]
        for f in fams:
            cells.append(_cell(row["families"].get(f), paper["families"].get(f) if paper else None))
        cells.append(_cell(row["avg"], paper["avg"] if paper else None))
        if has_retrieval:
            cells.append(_fmt(row["retrieval"]))
        lines.append("| " + " | ".join(cells) + " |")
    scores = (
        "mteb scores x 100: the task's main score, except for PairCLF (below)"
        if "PairClassification" in doc["families"]
        else "mteb main scores x 100"
    )
    notes = [
        "",
        f"Avg = mean of the family scores ({', '.join(FAMILY_ABBREV[f] for f in doc['avg_families'])}); "
        f"Retrieval is reported separately, as in the paper. Scores are {scores}.",
    ]
    if "PairClassification" in doc["families"]:
        notes.append(
            "PairCLF = average precision of each model's own similarity (cosine; for MoEE sum the "
            "similarity sum). mteb's max_ap (the best of cosine, Manhattan, Euclidean and dot, picked on "
            "the test labels) is listed separately in the per-task table and is not averaged."
        )
    if any(r["paper"] for r in doc["systems"]):
        notes.append(
            "Numbers in parentheses: the paper's published values (arXiv 2410.10814 v1, Tables 3-4)."
        )
        if "PairClassification" in doc["families"]:
            notes.append(
                "The paper's PairCLF values are mteb main scores, which for pair tasks are max_ap in the "
                "mteb 1.x releases since August 2024: compare them with the max_ap rows as well."
            )
    if any(v is None for r in doc["systems"] for v in r["tasks"].values()):
        notes.append("–: score undefined (e.g. constant similarities); left out of the averages.")
    if not all(r["complete"] for r in doc["systems"]):
        notes.append("Some systems lack some tasks; their averages cover only the tasks they have.")
    return "\n".join(lines + notes) + "\n"


def task_markdown(doc: Mapping[str, Any], *, short_labels: Sequence[str] | None = None) -> str:
    """The per-task table: one row per task, one column per system."""
    systems = doc["systems"]
    labels = list(short_labels) if short_labels else [r["label"] for r in systems]
    header = ["Family", "Task", *labels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in doc["tasks"]:
        cells = [task["family"], task["name"]]
        for row in systems:
            paper = row["paper"]["tasks"].get(task["name"]) if row["paper"] else None
            cells.append(_cell(row["tasks"].get(task["name"]), paper))
        lines.append("| " + " | ".join(cells) + " |")
        for key in FAMILY_SIDE_SCORES.get(task["family"], ()):
            if any(task["name"] in row.get(key, {}) for row in systems):
                label = f"{task['name']} ({key}, not averaged)"
                side = [_fmt(row.get(key, {}).get(task["name"])) for row in systems]
                lines.append("| " + " | ".join([task["family"], label, *side]) + " |")
    legend = [""] + [f"- {label}: {r['model']} {r['label']}" for label, r in zip(labels, systems)]
    return "\n".join(lines + (legend if short_labels else [])) + "\n"


def write_tables(
    cache_dir: str | Path,
    out_dir: str | Path,
    *,
    tasks: Iterable[str] | None = None,
    extra: Mapping[str, Any] | None = None,
    stem: str = "tables",
) -> dict[str, Path]:
    """Build the tables from ``cache_dir`` and write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``.

    ``extra`` (command, versions, alpha choices ...) is stored under ``"run"`` in the JSON
    and printed at the end of the markdown; without it, a rebuild keeps the previous ``"run"``.
    """
    results = load_results(cache_dir, tasks)
    if not results.scores:
        raise ValueError(f"no results for the requested tasks under {cache_dir}")
    doc = build_tables(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    md_path = out_dir / f"{stem}.md"
    if extra is None and json_path.is_file():  # a rebuild keeps the record of the run
        extra = json.loads(json_path.read_text(encoding="utf-8")).get("run")
    if extra:
        doc["run"] = dict(extra)
    json_path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    md = ["## Family averages", "", family_markdown(doc), "## Per task", "", task_markdown(doc)]
    if extra:
        md += ["## Run", "", "```json", json.dumps(dict(extra), indent=2, default=str), "```", ""]
    md_path.write_text("\n".join(md), encoding="utf-8")
    return {"json": json_path, "markdown": md_path}
