"""Offline mteb tasks: load from the committed files with the network off, documented sizes."""

from __future__ import annotations

import socket

import pytest
from mteb.abstasks import AbsTaskRetrieval

from moee.evaluation.paper import PAPER_TASKS, paper_task_names
from moee.evaluation.runner import load_task_data, resolve_tasks, task_texts
from moee.evaluation.tasks import (
    OFFLINE_TASK_NAMES,
    QUICK_TASK_NAMES,
    offline_task_class,
    offline_task_family,
    offline_tasks,
)

# The sizes documented in moee/evaluation/tasks.py and eval/README.md: (family, rows per split).
DOCUMENTED = {
    "lee_sts": ("STS", {"test": 1225}),
    "fortunes_classification": ("Classification", {"train": 800, "test": 400}),
    "reuters_classification": ("Classification", {"train": 254, "test": 157}),
    "wordnet_supersense_clustering": ("Clustering", {"test": 600}),
    "fortunes_clustering": ("Clustering", {"test": 320}),
    "bible_pair_classification": ("PairClassification", {"test": 1000}),
    "bible_verse_retrieval": ("Retrieval", {"queries": 400, "corpus": 1600, "qrels": 400}),
    "wordnet_definition_retrieval": ("Retrieval", {"queries": 400, "corpus": 1600, "qrels": 400}),
}
N_LABELS = {
    "fortunes_classification": 8,
    "reuters_classification": 3,
    "wordnet_supersense_clustering": 12,
    "fortunes_clustering": 8,
}


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


QUICK_SIZES = {
    "lee_sts": {"test": 1225},
    "fortunes_classification_quick": {"train": 200, "test": 200},
    "fortunes_clustering": {"test": 320},
    "bible_pair_classification_quick": {"test": 300},
    "wordnet_definition_retrieval_quick": {"queries": 100, "corpus": 400, "qrels": 100},
}

# the smaller variants of `moee quickstart` (Lee: the pairs among 24 of the 50 documents)
MINI_SIZES = {
    "lee_sts_mini": {"test": 276},
    "fortunes_classification_mini": {"train": 96, "test": 96},
    "fortunes_clustering_mini": {"test": 96},
    "bible_pair_classification_mini": {"test": 64},
    "wordnet_definition_retrieval_mini": {"queries": 30, "corpus": 120, "qrels": 30},
}


def test_every_offline_data_set_has_a_task():
    assert set(OFFLINE_TASK_NAMES) == set(DOCUMENTED)
    assert list(QUICK_TASK_NAMES) == list(QUICK_SIZES)
    assert {offline_task_family(n) for n in QUICK_TASK_NAMES} == {d[0] for d in DOCUMENTED.values()}
    assert offline_task_family("STS12") is None


def _sizes(task) -> dict[str, int]:
    split = task.dataset["default"]
    if isinstance(task, AbsTaskRetrieval):
        t = split["test"]
        return {
            "queries": len(t["queries"]),
            "corpus": len(t["corpus"]),
            "qrels": sum(len(v) for v in t["relevant_docs"].values()),
        }
    return {name: len(ds) for name, ds in split.items()}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_offline_task_loads_without_network_with_documented_size(name, no_network):
    family, sizes = DOCUMENTED[name]
    (task,) = offline_tasks([name])
    assert task.metadata.name == name and task.metadata.type == family
    task.load_data()
    assert task.data_loaded
    assert _sizes(task) == sizes
    if name in N_LABELS:
        split = task.dataset["default"]["test"]
        labels = split["labels" if family == "Clustering" else "label"]
        assert len(set(labels)) == N_LABELS[name]
    if family == "PairClassification":
        assert sorted(set(task.dataset["default"]["test"]["labels"])) == [0, 1]
    texts = task_texts(task)
    assert texts and all(isinstance(t, str) and t for t in texts) and len(texts) == len(set(texts))


@pytest.mark.parametrize("name", sorted({**QUICK_SIZES, **MINI_SIZES}))
def test_quick_variants_are_seeded_subsets(name, no_network):
    (task,) = offline_tasks([name])
    task.load_data()
    assert _sizes(task) == {**QUICK_SIZES, **MINI_SIZES}[name]
    (again,) = offline_tasks([name])
    again.load_data()
    assert task_texts(again) == task_texts(task)  # the same subset every time
    if name.endswith(("_quick", "_mini")):
        (full,) = offline_tasks([name.rsplit("_", 1)[0]])
        assert task.metadata.dataset["revision"] != full.metadata.dataset["revision"]
        full.load_data()
        assert set(task_texts(task)) < set(task_texts(full))
    if name.startswith("wordnet_definition_retrieval"):  # every query keeps its relevant document
        split = task.dataset["default"]["test"]
        corpus = set(split["corpus"]["id"])
        assert all(set(docs) <= corpus for docs in split["relevant_docs"].values())


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_offline_task_metadata_records_source_licence_citation(name):
    meta = offline_task_class(name).metadata
    assert meta.reference and meta.reference.startswith("http")
    assert meta.license and meta.license != "not specified"
    assert "Licence:" in meta.description
    assert meta.bibtex_citation.startswith("@misc{") and len(meta.bibtex_citation) > 80
    assert len(meta.dataset["revision"]) == 12
    assert offline_task_class(name) is offline_task_class(name)  # one class per task


def test_unknown_offline_task():
    with pytest.raises(ValueError, match="unknown offline task"):
        offline_task_class("nope")
    with pytest.raises(ValueError, match="unknown task 'NoSuchTask'"):
        resolve_tasks("lee_sts,NoSuchTask")
    with pytest.raises(ValueError, match="no tasks"):
        resolve_tasks(" , ")


def test_task_specs_resolve():
    assert [t.metadata.name for t in resolve_tasks("offline")] == list(OFFLINE_TASK_NAMES)
    assert [t.metadata.name for t in resolve_tasks("quick")] == list(QUICK_TASK_NAMES)
    assert [t.metadata.name for t in resolve_tasks("lee_sts,STS12")] == ["lee_sts", "STS12"]


def test_paper_suite_resolves_offline_and_its_data_fails_clearly(no_network):
    tasks = resolve_tasks("paper")
    assert sorted(t.metadata.name for t in tasks) == sorted(paper_task_names())
    types = {t.metadata.name: t.metadata.type for t in tasks}
    for family, names in PAPER_TASKS.items():
        assert {types[n] for n in names} == {family}
    from moee.evaluation.runner import TaskDataUnavailableError

    with pytest.raises(TaskDataUnavailableError, match="need network access") as err:
        load_task_data([t for t in tasks if t.metadata.name == "STS12"])
    assert "STS12 (dataset mteb/sts12-sts)" in str(err.value)


def test_task_texts_of_paper_task_layouts():
    """The alpha rule reads the texts of every paper task layout (data injected, no download)."""
    from datasets import Dataset, DatasetDict

    def loaded(name, dataset):
        task = next(t for t in resolve_tasks(name) if t.metadata.name == name)
        task.dataset, task.data_loaded = dataset, True
        return task

    summ = loaded(
        "SummEval",
        DatasetDict(
            {
                "test": Dataset.from_dict(
                    {
                        "text": ["doc"],
                        "human_summaries": [["h1", "h2"]],
                        "machine_summaries": [["m1", "h1"]],
                        "relevance": [[1.0, 2.0]],
                    }
                )
            }
        ),
    )
    assert task_texts(summ) == ["doc", "h1", "h2", "m1"]
    legacy = loaded(
        "MedrxivClusteringS2S",
        DatasetDict(
            {"test": Dataset.from_dict({"sentences": [["a", "b"], ["b", "c"]], "labels": [["x", "y"]] * 2})}
        ),
    )
    assert task_texts(legacy) == ["a", "b", "c"]
    rerank = loaded(
        "AskUbuntuDupQuestions",
        {
            "default": {
                "test": {
                    "queries": Dataset.from_dict({"id": ["q"], "text": ["query"]}),
                    "corpus": Dataset.from_dict({"id": ["d1", "d2"], "text": ["doc one", "query"]}),
                    "relevant_docs": {"q": {"d1": 1}},
                    "top_ranked": {"q": ["d1", "d2"]},
                }
            }
        },
    )
    assert task_texts(rerank) == ["query", "doc one"]


def test_mini_lee_keeps_every_pair_among_its_documents(no_network):
    """The mini STS variant limits documents, not rows: 24 of the 50 documents and all 276 of their
    pairs (a row limit would keep nearly every document, and documents are what the model reads)."""
    (task,) = offline_tasks(["lee_sts_mini"])
    task.load_data()
    texts = task_texts(task)
    assert len(texts) == 24 and _sizes(task) == {"test": 24 * 23 // 2}
    (full,) = offline_tasks(["lee_sts"])
    full.load_data()
    pairs = {
        (a, b)
        for a, b in zip(
            full.dataset["default"]["test"]["sentence1"], full.dataset["default"]["test"]["sentence2"]
        )
    }
    kept = set(texts)
    assert {(a, b) for a, b in pairs if a in kept and b in kept} == set(
        zip(task.dataset["default"]["test"]["sentence1"], task.dataset["default"]["test"]["sentence2"])
    )
