"""The committed offline evaluation data (``moee/data/offline/<task>/``) and its loader.

The files are built by ``scripts/build_offline_data.py`` from real, human-labelled sources (see
each task's ``metadata.json`` and ``moee/data/offline/README.md``) and are read here through
``importlib.resources``, so they load from an installed wheel with the network off.

Row tasks (STS, Classification, Clustering, PairClassification) load as
``{"name", "family", "metadata", "<split>": [row, ...]}``; Retrieval tasks as
``{"name", "family", "metadata", "queries", "corpus", "qrels"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from moee.io import iter_jsonl

FAMILIES = ("STS", "Classification", "Clustering", "PairClassification", "Retrieval")


@dataclass(frozen=True)
class OfflineTask:
    """Static description of one offline task (sizes are checked against the files by the tests)."""

    name: str
    family: str
    description: str
    main_score: str
    sources: tuple[str, ...]
    #: rows per file stem (``test`` -> ``test.jsonl``)
    sizes: dict[str, int]

    @property
    def n_texts(self) -> int:
        """Distinct texts an evaluation needs to embed (an STS task's pairs reuse its documents)."""
        if self.family == "STS":
            return self.sizes["documents"]
        if self.family == "PairClassification":
            return 2 * self.sizes["test"]
        return sum(n for stem, n in self.sizes.items() if stem != "qrels")


OFFLINE_TASKS: dict[str, OfflineTask] = {
    t.name: t
    for t in (
        OfflineTask(
            "lee_sts",
            "STS",
            "Lee et al. (2005) news documents: 1,225 document pairs with mean human similarity ratings.",
            "cosine_spearman",
            ("lee",),
            {"documents": 50, "test": 1225},
        ),
        OfflineTask(
            "fortunes_classification",
            "Classification",
            "Classify BSD fortune-database entries into 8 categories (computers, definitions, education, "
            "food, law, literature, politics, science).",
            "accuracy",
            ("fortunes",),
            {"train": 800, "test": 400},
        ),
        OfflineTask(
            "reuters_classification",
            "Classification",
            "Reuters-21578 ModApte newswire: corn / grain (not corn) / other.",
            "accuracy",
            ("reuters",),
            {"train": 254, "test": 157},
        ),
        OfflineTask(
            "wordnet_supersense_clustering",
            "Clustering",
            "Cluster WordNet 3.0 glosses by their lexicographer file (12 noun and verb supersenses).",
            "v_measure",
            ("wordnet",),
            {"test": 600},
        ),
        OfflineTask(
            "fortunes_clustering",
            "Clustering",
            "Cluster BSD fortune-database entries by category (8 categories).",
            "v_measure",
            ("fortunes",),
            {"test": 320},
        ),
        OfflineTask(
            "bible_pair_classification",
            "PairClassification",
            "Is a World English Bible verse a rendering of this King James verse (1) or of another verse "
            "of the same chapter (0)?",
            "similarity_ap",
            ("kjv", "web"),
            {"test": 1000},
        ),
        OfflineTask(
            "bible_verse_retrieval",
            "Retrieval",
            "Retrieve the World English Bible rendering of a King James verse among 1,600 WEB verses.",
            "ndcg_at_10",
            ("kjv", "web"),
            {"queries": 400, "corpus": 1600, "qrels": 400},
        ),
        OfflineTask(
            "wordnet_definition_retrieval",
            "Retrieval",
            "Retrieve the WordNet synset (its lemma list) that a gloss defines, among 1,600 synsets.",
            "ndcg_at_10",
            ("wordnet",),
            {"queries": 400, "corpus": 1600, "qrels": 400},
        ),
    )
}

#: Required fields of each row, per family and file stem.
SCHEMAS: dict[str, dict[str, tuple[str, ...]]] = {
    "STS": {"documents": ("id", "text"), "test": ("id1", "id2", "score")},
    "Classification": {"train": ("text", "label"), "test": ("text", "label")},
    "Clustering": {"test": ("text", "label")},
    "PairClassification": {"test": ("sentence1", "sentence2", "label", "ref1", "ref2")},
    "Retrieval": {
        "queries": ("id", "text"),
        "corpus": ("id", "text"),
        "qrels": ("query_id", "doc_id", "score"),
    },
}


def _task(name: str) -> OfflineTask:
    if not isinstance(name, str):
        raise TypeError(f"task name must be a string, got {type(name).__name__}")
    if name not in OFFLINE_TASKS:
        raise ValueError(f"unknown offline task {name!r}; known: {sorted(OFFLINE_TASKS)}")
    return OFFLINE_TASKS[name]


def task_dir(name: str) -> resources.abc.Traversable:
    """The package-data folder of a task (works from a source checkout and from a wheel)."""
    _task(name)
    return resources.files("moee.data").joinpath("offline", name)


def _read_rows(res: resources.abc.Traversable, required: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for lineno, row in iter_jsonl(res):
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{res}: line {lineno} lacks field(s) {missing}")
        rows.append(row)
    return rows


def load_task_metadata(name: str) -> dict[str, Any]:
    """The task's ``metadata.json`` (sources, licences, citations, sizes, build command)."""
    with task_dir(name).joinpath("metadata.json").open("r", encoding="utf-8") as fh:
        return json.load(fh)


def load_task_data(name: str) -> dict[str, Any]:
    """All rows of an offline task, keyed by file stem (see the module docstring).

    Raises ``ValueError`` for an unknown task, a missing file, a row without a required field,
    or a file whose row count differs from ``OFFLINE_TASKS[name].sizes``.
    """
    task = _task(name)
    folder = task_dir(name)
    out: dict[str, Any] = {"name": name, "family": task.family, "metadata": load_task_metadata(name)}
    for stem, required in SCHEMAS[task.family].items():
        res = folder.joinpath(f"{stem}.jsonl")
        if not res.is_file():
            raise ValueError(f"offline task {name!r}: missing data file {stem}.jsonl")
        rows = _read_rows(res, required)
        if len(rows) != task.sizes[stem]:
            raise ValueError(
                f"offline task {name!r}: {stem}.jsonl has {len(rows)} rows, expected {task.sizes[stem]}"
            )
        out[stem] = rows
    if task.family == "STS":  # pairs are stored as document ids; attach the texts
        texts = {d["id"]: d["text"] for d in out["documents"]}
        for row in out["test"]:
            row["sentence1"], row["sentence2"] = texts[row["id1"]], texts[row["id2"]]
    return out


def task_texts(name: str) -> list[str]:
    """The distinct texts of an offline task (every input an evaluation embeds), in file order."""
    data = load_task_data(name)
    family = data["family"]
    if family == "STS":
        texts = [d["text"] for d in data["documents"]]
    elif family == "PairClassification":
        texts = [t for r in data["test"] for t in (r["sentence1"], r["sentence2"])]
    elif family == "Retrieval":
        texts = [q["text"] for q in data["queries"]] + [d["text"] for d in data["corpus"]]
    else:
        texts = [r["text"] for stem in SCHEMAS[family] for r in data[stem]]
    return list(dict.fromkeys(texts))


#: The committed record of the leak check (``scripts/build_offline_data.py``): its rule, and per
#: training source the keys (``moee_build/exclusions.py``: ``span_key``) of the word spans that source
#: shares with any candidate evaluation text, so committed data can be re-checked without the
#: training sources installed.
LEAK_CHECK_FILE = "leak_check.json"


def load_leak_check() -> dict[str, Any]:
    """The committed leak-check record (see ``LEAK_CHECK_FILE``)."""
    with resources.files("moee.data").joinpath("offline", LEAK_CHECK_FILE).open("r", encoding="utf-8") as fh:
        return json.load(fh)
