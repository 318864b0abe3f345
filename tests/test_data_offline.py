"""The committed offline evaluation data: sizes, schemas, provenance, and no leakage into training."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from moee.data.offline_tasks import (
    FAMILIES,
    OFFLINE_TASKS,
    SCHEMAS,
    load_leak_check,
    load_task_data,
    load_task_metadata,
    task_texts,
)
from moee_build.corpus import SpanIndex, committed_leaks, find_contained, find_leaks, iter_corpus
from moee_build.exclusions import (
    EVAL_BIBLE_BOOKS,
    EVAL_FORTUNE_CATEGORIES,
    LEAK_MIN_WORDS,
    LEAK_SPAN_WORDS,
    attributed_source,
    is_eval_synset,
    text_key,
)
from moee_build.sources import FORTUNES_DIR, TRAINING_SOURCES, DataPaths

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


def test_every_family_has_a_task() -> None:
    assert {task.family for task in OFFLINE_TASKS.values()} == set(FAMILIES)


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


# --------------------------------------------------------------------------- leaks across sources


@pytest.mark.parametrize("name", sorted(OFFLINE_TASKS))
def test_no_eval_text_shares_a_long_span_with_any_training_source(name: str) -> None:
    """Every text of every task is checked against every training source, not only its own: a
    fortune quoting Shakespeare, a Luke verse repeating Matthew, a gloss shared by two synsets must
    not be evaluation text (``leak_check.json`` records the spans the sources share with any
    candidate, so this runs without the sources installed)."""
    texts = task_texts(name)
    leaks = committed_leaks(texts)
    assert {source: [texts[i][:60] for i in ids[:3]] for source, ids in leaks.items()} == {}


def test_no_fortune_is_credited_to_a_training_author(data: dict[str, dict]) -> None:
    for name in ("fortunes_classification", "fortunes_clustering"):
        credited = [t for t in texts_of(data[name]) if attributed_source(t)]
        assert credited == [], name


def test_the_leak_record_catches_what_it_was_built_for() -> None:
    """Texts of an earlier build that leaked: a Luke verse that shares its wording with Matthew and
    Mark, a fortune quoted from the Jargon File with other line breaks and a credit, a quotation
    credited to Shakespeare."""
    luke = (
        "As they were parting from him, Peter said to Jesus, \u201cMaster, it is good for us to be here. "
        "Let\u2019s make three tents: one for you, one for Moses, and one for Elijah,\u201d not knowing what he said."
    )
    kludge = (
        "Kludge, n.:\n    An ill-assorted collection of poorly-matching parts, forming a\n    distressing whole.\n"
        '        -- Jackson Granholm, "Datamation"'
    )
    puck = 'Lord, what fools these mortals be!\n        -- William Shakespeare, "A Midsummer-Night\'s Dream"'
    leaks = committed_leaks(
        [luke, kludge, puck, "A sentence that no source holds, written for this test only."]
    )
    assert leaks == {"kjv": [0], "web": [0], "shakespeare": [2], "jargon": [1]}


def test_leak_counts_are_recorded_per_task_and_source() -> None:
    check = load_leak_check()
    assert (check["span_words"], check["min_words"]) == (LEAK_SPAN_WORDS, LEAK_MIN_WORDS)
    assert set(check["spans"]) == set(TRAINING_SOURCES)
    assert all(len(k) == 16 and int(k, 16) >= 0 for keys in check["spans"].values() for k in keys)
    for name in OFFLINE_TASKS:
        record = load_task_metadata(name)["leak_check"]
        assert record["rule"] == check["rule"]
        assert record["left_out_by_source"] == check["left_out_by_task"][name]
        assert record["left_out"] <= sum(record["left_out_by_source"].values()) <= 9 * record["left_out"]
    fortunes = check["left_out_by_task"]["fortunes_classification"]
    assert fortunes["shakespeare"] > 0 and fortunes["fortunes"] > 0


def _sources_installed() -> bool:
    try:
        DataPaths().find(FORTUNES_DIR)
    except FileNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(
    not _sources_installed(), reason="training sources not installed (install_data_sources.sh)"
)
def test_no_eval_text_leaks_into_the_installed_training_sources() -> None:
    texts = sorted({t for name in OFFLINE_TASKS for t in task_texts(name)})
    try:
        report = find_leaks(texts, TRAINING_SOURCES)
    except (FileNotFoundError, ImportError) as exc:  # a source (or its reader package) not installed here
        pytest.skip(f"not every training source is installed: {exc}")
    assert {s: [texts[i][:60] for i in sorted(ids)[:3]] for s, ids in report.by_source.items() if ids} == {}


@pytest.mark.slow
@pytest.mark.skipif(not CORPUS.exists(), reason="build/corpus not built (scripts/build_corpus.py)")
def test_no_eval_text_shares_a_long_span_with_the_training_corpus() -> None:
    texts = sorted({t for name in OFFLINE_TASKS for t in task_texts(name)})
    index = SpanIndex(texts)
    hits = set().union(*(index.matches(r["text"]) for r in iter_corpus(CORPUS)))
    assert [texts[i][:60] for i in sorted(hits)[:5]] == []


@pytest.mark.slow
def test_build_code_is_not_part_of_the_installed_package():
    """The builders live in ``moee_build`` (never imported by ``moee``, not packaged); the runtime
    ``moee.data`` only holds the committed files and their loader ``offline_tasks``."""
    import importlib.util

    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    for name in ("sources", "corpus", "exclusions", "tokenizer", "offline"):
        assert importlib.util.find_spec(f"moee.data.{name}") is None or name == "offline"
    assert (root / "moee" / "data" / "offline").is_dir() and not (
        root / "moee" / "data" / "offline.py"
    ).exists()
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages = find_packages(str(root), **config["packages"]["find"])
    assert "moee.data" in packages and not any(p.split(".")[0] == "moee_build" for p in packages)
    assert "data/offline/**/*" in config["package-data"]["moee"]
    code = (
        "import sys, moee.data, moee.data.offline_tasks, moee.evaluation.tasks, moee.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('moee_build')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_offline_rows_and_corpus_records_share_the_package_jsonl_reader(tmp_path, monkeypatch):
    """One JSONL reader (``moee.io.iter_jsonl``): blank lines skipped, a bad line named by number."""
    import moee.data.offline_tasks as offline_tasks
    import moee.io

    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a", "label": 1}\n\n{"text": "b", "label": 2}\n[1]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:4: expected a JSON object, got list"):
        offline_tasks._read_rows(path, ("text", "label"))
    with pytest.raises(ValueError, match=r"rows.jsonl:4: expected a JSON object, got list"):
        list(iter_corpus(path))
    path.write_text('{"text": "a", "label": 1}\n\n{"text": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 3 lacks field\(s\) \['label'\]"):
        offline_tasks._read_rows(path, ("text", "label"))
    assert [r["text"] for r in iter_corpus(path)] == ["a", "b"]
    calls = []
    real = moee.io.iter_jsonl
    monkeypatch.setattr(offline_tasks, "iter_jsonl", lambda *a, **k: calls.append(a) or real(*a, **k))
    load_task_data("fortunes_classification")
    assert len(calls) == 2  # train.jsonl and test.jsonl
