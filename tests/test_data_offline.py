"""The committed offline evaluation data: sizes, schemas, provenance, and no leakage into training."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from moee.data.corpus import find_contained, iter_corpus
from moee.data.exclusions import EVAL_BIBLE_BOOKS, EVAL_FORTUNE_CATEGORIES, is_eval_synset, text_key
from moee.data.offline import (
    FAMILIES,
    OFFLINE_TASKS,
    SCHEMAS,
    load_task_data,
    load_task_metadata,
    tasks_by_family,
)

CORPUS = Path(__file__).resolve().parents[1] / "build" / "corpus" / "train.jsonl"


@pytest.fixture(scope="module")
def data() -> dict[str, dict]:
    return {name: load_task_data(name) for name in OFFLINE_TASKS}


def texts_of(task: dict) -> list[str]:
    out = []
    for value in task.values():
        if isinstance(value, list):
            for row in value:
                out += [row[f] for f in ("text", "sentence1", "sentence2") if isinstance(row.get(f), str)]
    return out


@pytest.mark.parametrize("name", sorted(OFFLINE_TASKS))
def test_task_has_documented_size_and_schema(data: dict[str, dict], name: str) -> None:
    task, spec = data[name], OFFLINE_TASKS[name]
    assert task["family"] == spec.family in FAMILIES
    for stem, fields in SCHEMAS[spec.family].items():
        rows = task[stem]
        assert len(rows) == spec.sizes[stem]
        for row in rows:
            assert all(f in row for f in fields)
            for f in ("text", "sentence1", "sentence2"):
                if f in row:
                    assert isinstance(row[f], str) and row[f].strip()
    meta = load_task_metadata(name)
    assert meta["sizes"] == spec.sizes and meta["family"] == spec.family
    for src in spec.sources:
        assert meta["sources"][src]["licence"] and meta["sources"][src]["citation"]
    assert meta["build_command"].startswith("python scripts/build_offline_data.py")
    assert spec.n_texts <= 2000  # keeps the whole offline suite fast on CPU


def test_lee_pairs_are_the_upper_triangle(data: dict[str, dict]) -> None:
    task = data["lee_sts"]
    pairs = task["test"]
    assert len(pairs) == 1225 == math.comb(50, 2)
    assert {(r["id1"], r["id2"]) for r in pairs} == {(i, j) for i in range(50) for j in range(i + 1, 50)}
    assert all(0.0 <= r["score"] <= 1.0 for r in pairs)
    assert len({r["score"] for r in pairs}) > 20  # real ratings, not a constant
    docs = {d["id"]: d["text"] for d in task["documents"]}
    assert all(r["sentence1"] == docs[r["id1"]] and r["sentence2"] == docs[r["id2"]] for r in pairs)


def test_classification_labels_and_splits(data: dict[str, dict]) -> None:
    fc = data["fortunes_classification"]
    assert Counter(r["label"] for r in fc["train"]) == {c: 100 for c in EVAL_FORTUNE_CATEGORIES}
    assert Counter(r["label"] for r in fc["test"]) == {c: 50 for c in EVAL_FORTUNE_CATEGORIES}
    train_keys = {text_key(r["text"]) for r in fc["train"]}
    assert not train_keys & {text_key(r["text"]) for r in fc["test"]}
    rc = data["reuters_classification"]
    for split in ("train", "test"):
        assert set(Counter(r["label"] for r in rc[split])) == {"corn", "grain", "other"}


def test_clustering_is_balanced(data: dict[str, dict]) -> None:
    wc = Counter(r["label"] for r in data["wordnet_supersense_clustering"]["test"])
    assert len(wc) == 12 and set(wc.values()) == {50}
    for r in data["wordnet_supersense_clustering"]["test"]:
        pos, offset = r["synset"].split(":")
        assert is_eval_synset(pos, offset)  # only synsets reserved for evaluation
    assert set(Counter(r["label"] for r in data["fortunes_clustering"]["test"]).values()) == {40}


def test_pair_classification_is_balanced_and_aligned(data: dict[str, dict]) -> None:
    rows = data["bible_pair_classification"]["test"]
    assert Counter(r["label"] for r in rows) == {0: 500, 1: 500}
    for r in rows:
        assert (r["ref1"] == r["ref2"]) == (r["label"] == 1)
        assert r["ref1"].rsplit(" ", 1)[0] in EVAL_BIBLE_BOOKS
        assert r["ref1"].split(":")[0] == r["ref2"].split(":")[0]  # negatives come from the same chapter


@pytest.mark.parametrize("name", ["bible_verse_retrieval", "wordnet_definition_retrieval"])
def test_retrieval_qrels_point_into_the_corpus(data: dict[str, dict], name: str) -> None:
    task = data[name]
    qids = [q["id"] for q in task["queries"]]
    dids = [d["id"] for d in task["corpus"]]
    assert len(set(qids)) == len(qids) and len(set(dids)) == len(dids)
    assert {r["query_id"] for r in task["qrels"]} == set(qids)
    assert {r["doc_id"] for r in task["qrels"]} <= set(dids)
    assert len({text_key(d["text"]) for d in task["corpus"]}) == len(dids)  # no indistinguishable documents


def test_families_cover_the_issue(data: dict[str, dict]) -> None:
    for family in FAMILIES:
        assert tasks_by_family(family)


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown offline task"):
        load_task_data("no_such_task")
    with pytest.raises(TypeError):
        load_task_data(3)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.skipif(not CORPUS.exists(), reason="build/corpus not built (scripts/build_corpus.py)")
def test_no_eval_text_in_training_corpus(data: dict[str, dict]) -> None:
    texts = sorted({t for task in data.values() for t in texts_of(task) if len(t.split()) >= 4})
    leaked = find_contained(texts, (r["text"] for r in iter_corpus(CORPUS)))
    assert [texts[i] for i in leaked] == []
