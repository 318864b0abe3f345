"""Offline mteb tasks built from the committed real data in ``moee/data/offline/``.

One mteb task per offline data set (``moee.data.offline_tasks.OFFLINE_TASKS``), named like its data
folder, so ``--tasks lee_sts,bible_verse_retrieval`` means the same thing everywhere:

=============================  ==================  ==========================================
task                           mteb family         size
=============================  ==================  ==========================================
lee_sts                        STS                 1,225 rated pairs of 50 news documents
fortunes_classification        Classification      800 train / 400 test, 8 categories
reuters_classification         Classification      254 train / 157 test, corn / grain / other
wordnet_supersense_clustering  Clustering          600 glosses, 12 supersenses
fortunes_clustering            Clustering          320 entries, 8 categories
bible_pair_classification      PairClassification  1,000 KJV/WEB pairs (500 aligned)
bible_verse_retrieval          Retrieval           400 queries, 1,600 documents
wordnet_definition_retrieval   Retrieval           400 queries, 1,600 documents
=============================  ==================  ==========================================

Each task's ``TaskMetadata`` records the source (``reference``), licence (mteb's licence id when
one matches, else the licence's URL, with the exact licence text in the description) and
citation (``bibtex_citation``), taken from the data's ``metadata.json``. The dataset revision
is a hash of the committed files, so cached results are tied to the exact data. Nothing is
downloaded: ``load_data`` reads the package files (works with ``HF_HUB_OFFLINE=1``).

``--tasks quick`` (``QUICK_TASK_NAMES``) is one task per family, the larger ones as *quick
variants* (``<task>_quick``: a seeded subset of at most ``QUICK_LIMITS[task]`` rows per split,
its own task name and dataset revision so its results never mix with the full task's);
``moee quickstart`` runs the smaller *mini variants* (``--tasks mini``, ``<task>_mini``,
``MINI_LIMITS``) the same way.

Evaluation protocol, chosen to mirror the paper's mteb tasks: classification is logistic
regression on 16 training examples per label, 10 repetitions (as EmotionClassification);
clustering is mini-batch k-means with k = number of labels on 10 bootstrap samples of all
texts (v-measure); pair classification reports the average precision of the model's own
similarity (``similarity_ap``: cosine for every encoder here, not mteb's ``max_ap``, the best of
four similarity functions picked on the test labels); retrieval nDCG@10.
"""

from __future__ import annotations

import hashlib
import random
from functools import cache
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict
from mteb.abstasks import (
    AbsTaskClassification,
    AbsTaskClustering,
    AbsTaskPairClassification,
    AbsTaskRetrieval,
    AbsTaskSTS,
)
from mteb.abstasks.task_metadata import TaskMetadata

from moee.data.offline_tasks import OFFLINE_TASKS, load_task_data, load_task_metadata, task_dir

#: All offline task names, in the order of the tables.
OFFLINE_TASK_NAMES: tuple[str, ...] = tuple(OFFLINE_TASKS)

#: Suffix of the quick variants: the same data, subsampled (seeded), under another task name so
#: that their results never mix with the full tasks' in a result cache.
QUICK_SUFFIX = "_quick"

#: The fast subset of ``moee quickstart``: one task per family, each capped to at most this many
#: rows per split (retrieval: queries; the corpus keeps their relevant documents plus random
#: others up to four times as many). ``None``: the whole (small) task.
QUICK_LIMITS: dict[str, int | None] = {
    "lee_sts": None,
    "fortunes_classification": 200,
    "fortunes_clustering": None,
    "bible_pair_classification": 300,
    "wordnet_definition_retrieval": 100,
}
QUICK_TASK_NAMES: tuple[str, ...] = tuple(
    n if lim is None else n + QUICK_SUFFIX for n, lim in QUICK_LIMITS.items()
)

#: Suffix of the smaller variants ``moee quickstart`` runs (the same families and seeding as the
#: quick variants, about a third of their tokens: the main job's evaluation must take seconds).
MINI_SUFFIX = "_mini"
MINI_LIMITS: dict[str, int | None] = {
    "lee_sts": 24,  # documents: the 276 rated pairs among them
    "fortunes_classification": 96,  # 12 training texts per label on average
    "fortunes_clustering": 96,
    "bible_pair_classification": 64,
    "wordnet_definition_retrieval": 30,
}
MINI_TASK_NAMES: tuple[str, ...] = tuple(
    n if lim is None else n + MINI_SUFFIX for n, lim in MINI_LIMITS.items()
)

#: Every subset level: suffix -> (row limits, the mark its dataset revisions carry).
SUBSETS: dict[str, tuple[dict[str, int | None], str]] = {
    QUICK_SUFFIX: (QUICK_LIMITS, "q"),
    MINI_SUFFIX: (MINI_LIMITS, "m"),
}

# mteb licence ids for the sources whose licence has one; others are recorded by URL.
_LICENCE_IDS = {"lee": "lgpl"}
_LICENCE_URLS = {
    "fortunes": "https://metadata.ftp-master.debian.org/changelogs/main/f/fortune-mod/unstable_copyright",
    "reuters": "http://www.daviddlewis.com/resources/testcollections/reuters21578/readme.txt",
    "wordnet": "https://wordnet.princeton.edu/license-and-commercial-use",
    "kjv": "https://www.crosswire.org/sword/modules/ModInfo.jsp?modName=KJV",
    "web": "https://ebible.org/web/copyright.htm",
}
_DOMAINS = {
    "lee": ["News", "Written"],
    "fortunes": ["Fiction", "Written"],
    "reuters": ["News", "Written"],
    "wordnet": ["Encyclopaedic", "Written"],
    "kjv": ["Religious", "Written"],
    "web": ["Religious", "Written"],
}
_ANNOTATIONS = {
    "lee": "human-annotated",
    "fortunes": "human-annotated",
    "reuters": "expert-annotated",
    "wordnet": "expert-annotated",
    "kjv": "derived",
    "web": "derived",
}
_TYPES = {
    "STS": "STS",
    "Classification": "Classification",
    "Clustering": "Clustering",
    "PairClassification": "PairClassification",
    "Retrieval": "Retrieval",
}


def _split_name(name: str) -> tuple[str, int | None, str]:
    """``fortunes_classification_quick`` -> (``fortunes_classification``, its row limit, ``_quick``);
    a full task -> (its name, ``None``, ``""``)."""
    for suffix, (limits, _) in SUBSETS.items():
        base = name[: -len(suffix)]
        if name.endswith(suffix) and limits.get(base):
            return base, limits[base], suffix
    return name, None, ""


def offline_task_family(name: str) -> str | None:
    """The mteb family (task type) of an offline task (or quick variant), ``None`` for any other name."""
    spec = OFFLINE_TASKS.get(_split_name(name)[0])
    return spec.family if spec else None


def _subsample(rows: list[dict[str, Any]], limit: int | None, seed: str) -> list[dict[str, Any]]:
    """At most ``limit`` rows, a seeded random subset kept in file order."""
    if limit is None or len(rows) <= limit:
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in keep]


def _limit_data(data: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """Apply a subset limit to loaded data: row splits; queries + corpus + qrels; for pairs drawn from
    a set of ``documents`` (Lee: every pair of 50 documents), the pairs among ``limit`` documents (a
    row limit would keep nearly every document, and documents are what costs)."""
    if limit is None:
        return data
    out = dict(data)
    if "documents" in data:
        docs = _subsample(data["documents"], limit, f"{data['name']}:documents")
        ids = {d["id"] for d in docs}
        out["documents"] = docs
        out["test"] = [r for r in data["test"] if r["id1"] in ids and r["id2"] in ids]
        return out
    if "queries" in data:
        queries = _subsample(data["queries"], limit, f"{data['name']}:queries")
        qids = {q["id"] for q in queries}
        qrels = [q for q in data["qrels"] if q["query_id"] in qids]
        relevant = {q["doc_id"] for q in qrels}
        others = [d for d in data["corpus"] if d["id"] not in relevant]
        extra = _subsample(others, max(0, 4 * limit - len(relevant)), f"{data['name']}:corpus")
        keep = relevant | {d["id"] for d in extra}
        out.update(queries=queries, qrels=qrels, corpus=[d for d in data["corpus"] if d["id"] in keep])
        return out
    for split in ("train", "test"):
        if split in data:
            out[split] = _subsample(data[split], limit, f"{data['name']}:{split}")
    return out


def _files_revision(name: str) -> str:
    """A hash of the task's committed files: results are tied to the exact data."""
    sha = hashlib.sha256()
    folder = task_dir(name)
    for res in sorted(folder.iterdir(), key=lambda r: r.name):
        if res.name.endswith((".jsonl", ".json")):
            sha.update(res.name.encode())
            sha.update(res.read_bytes())
    return sha.hexdigest()[:12]


def _bibtex(key: str, citation: str, url: str) -> str:
    text = citation.replace("{", "(").replace("}", ")")
    return f"@misc{{{key},\n  note = {{{text}}},\n  howpublished = {{\\url{{{url}}}}},\n}}\n"


def _metadata(name: str, limit: int | None = None, suffix: str = QUICK_SUFFIX) -> TaskMetadata:
    spec = OFFLINE_TASKS[name]
    meta = load_task_metadata(name)
    sources: dict[str, dict[str, str]] = meta.get("sources", {})
    first = spec.sources[0]
    licences = "; ".join(f"{s}: {info.get('licence', '?')}" for s, info in sources.items())
    if len(spec.sources) == 1 and first in _LICENCE_IDS:
        licence = _LICENCE_IDS[first]
    else:
        licence = _LICENCE_URLS.get(first, "not specified")
    description = f"{spec.description} Licence: {licences}. Built by scripts/build_offline_data.py."
    revision = _files_revision(name)
    if limit is not None:
        kind = "Quick" if suffix == QUICK_SUFFIX else suffix.strip("_").capitalize()
        description = f"{kind} variant: a seeded subset of at most {limit} rows per split. {description}"
        revision = f"{revision[:8]}-{SUBSETS[suffix][1]}{limit}"
    return TaskMetadata(
        name=name if limit is None else name + suffix,
        dataset={"path": f"moee/data/offline/{name}", "revision": revision},
        description=description,
        reference=sources.get(first, {}).get("url") or None,
        type=_TYPES[spec.family],
        category="t2t",
        modalities=["text"],
        eval_splits=["test"],
        eval_langs=["eng-Latn"],
        main_score=spec.main_score,
        domains=sorted({d for s in spec.sources for d in _DOMAINS.get(s, ["Written"])}),
        license=licence,
        annotations_creators=_ANNOTATIONS.get(first, "derived"),
        dialect=[],
        sample_creation="found",
        bibtex_citation="".join(
            _bibtex(s, info.get("citation", ""), info.get("url", "")) for s, info in sources.items()
        ),
    )


def _label_ids(rows: list[dict[str, Any]]) -> dict[Any, int]:
    return {label: i for i, label in enumerate(sorted({r["label"] for r in rows}, key=str))}


class _OfflineData:
    """Mixin: ``load_data`` reads the committed files instead of the Hugging Face Hub."""

    offline_name: str
    row_limit: int | None = None

    def _load(self) -> dict[str, Any]:
        return _limit_data(load_task_data(self.offline_name), self.row_limit)

    def load_data(self, num_proc: int | None = None, *, timer: Any = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        self.dataset = {"default": self._build(self._load())}
        self.data_loaded = True

    def _build(self, data: dict[str, Any]) -> Any:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


class OfflineSTS(_OfflineData, AbsTaskSTS):
    """Pairs with a gold similarity in [min_score, max_score] (Spearman of cosines)."""

    min_score = 0
    max_score = 1

    def _build(self, data: dict[str, Any]) -> DatasetDict:
        rows = data["test"]
        lo, hi = data["metadata"].get("score_range", [0.0, 1.0])
        self.min_score, self.max_score = lo, hi
        return DatasetDict(
            {
                "test": Dataset.from_dict(
                    {
                        "sentence1": [r["sentence1"] for r in rows],
                        "sentence2": [r["sentence2"] for r in rows],
                        "score": [float(r["score"]) for r in rows],
                    }
                )
            }
        )


class OfflineClassification(_OfflineData, AbsTaskClassification):
    """Logistic regression on 16 embedded training texts per label, 10 repetitions."""

    samples_per_label = 16
    n_experiments = 10

    def _calculate_scores(self, y_test: Any, y_pred: Any) -> Any:
        # mteb hands over a lazy `datasets` column, which sklearn re-reads row by row for each of
        # its ~10 metrics (two thirds of the task's run time); one conversion, the same scores
        return super()._calculate_scores(np.asarray(list(y_test)), y_pred)

    def _build(self, data: dict[str, Any]) -> DatasetDict:
        ids = _label_ids(data["train"] + data["test"])
        return DatasetDict(
            {
                split: Dataset.from_dict(
                    {
                        "text": [r["text"] for r in data[split]],
                        "label": [ids[r["label"]] for r in data[split]],
                    }
                )
                for split in ("train", "test")
            }
        )


class OfflineClustering(_OfflineData, AbsTaskClustering):
    """k-means (k = number of labels) on 10 bootstrap samples of all texts; v-measure."""

    max_fraction_of_documents_to_embed = None
    max_document_to_embed = None
    n_clusters = 10

    def _build(self, data: dict[str, Any]) -> DatasetDict:
        rows = data["test"]
        self.max_documents_per_cluster = len(rows)
        return DatasetDict(
            {
                "test": Dataset.from_dict(
                    {"sentences": [r["text"] for r in rows], "labels": [r["label"] for r in rows]}
                )
            }
        )


class OfflinePairClassification(_OfflineData, AbsTaskPairClassification):
    """Binary pairs (1 = paraphrase); average precision of the model's declared similarity."""

    def _build(self, data: dict[str, Any]) -> DatasetDict:
        rows = data["test"]
        return DatasetDict(
            {
                "test": Dataset.from_dict(
                    {
                        "sentence1": [r["sentence1"] for r in rows],
                        "sentence2": [r["sentence2"] for r in rows],
                        "labels": [int(r["label"]) for r in rows],
                    }
                )
            }
        )


class OfflineRetrieval(_OfflineData, AbsTaskRetrieval):
    """Queries against a corpus with graded relevance (qrels); nDCG@10."""

    def load_data(self, num_proc: int | None = None, *, timer: Any = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        data = self._load()
        relevant: dict[str, dict[str, int]] = {}
        for q in data["qrels"]:
            relevant.setdefault(str(q["query_id"]), {})[str(q["doc_id"])] = int(q["score"])
        split = {
            "corpus": Dataset.from_dict(
                {
                    "id": [str(d["id"]) for d in data["corpus"]],
                    "text": [d["text"] for d in data["corpus"]],
                    "title": ["" for _ in data["corpus"]],
                }
            ),
            "queries": Dataset.from_dict(
                {"id": [str(q["id"]) for q in data["queries"]], "text": [q["text"] for q in data["queries"]]}
            ),
            "relevant_docs": relevant,
            "top_ranked": None,
        }
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


_BASES = {
    "STS": OfflineSTS,
    "Classification": OfflineClassification,
    "Clustering": OfflineClustering,
    "PairClassification": OfflinePairClassification,
    "Retrieval": OfflineRetrieval,
}


@cache
def offline_task_class(name: str) -> type:
    """The mteb task class of an offline data set or of its quick variant (built once)."""
    base_name, limit, suffix = _split_name(name)
    if base_name not in OFFLINE_TASKS:
        known = OFFLINE_TASK_NAMES + QUICK_TASK_NAMES + MINI_TASK_NAMES
        raise ValueError(f"unknown offline task {name!r}; known: {', '.join(dict.fromkeys(known))}")
    base = _BASES[OFFLINE_TASKS[base_name].family]
    class_name = "".join(part.capitalize() for part in name.split("_"))
    attrs = {
        "metadata": _metadata(base_name, limit, suffix or QUICK_SUFFIX),
        "offline_name": base_name,
        "row_limit": limit,
        "__module__": __name__,
    }
    return type(class_name, (base,), attrs)


def offline_tasks(names: tuple[str, ...] | list[str] | None = None) -> list[Any]:
    """Fresh task objects for ``names`` (default: all offline tasks), in the given order."""
    return [offline_task_class(n)() for n in (names or OFFLINE_TASK_NAMES)]
