#!/usr/bin/env python
"""Build the committed offline evaluation data under moee/data/offline/ from the real sources.

Every task samples only texts that moee_build/exclusions.py reserves for evaluation and that do not
leak into any training source (checked against every document of every training source: a run of
8 shared words, a whole-document copy, or a credit to a training source's author; see LEAK_RULE and
data/SOURCES.md). Writes each task's files and metadata.json (with its leak counts) and
leak_check.json (the rule and the hashed spans the sources share with any candidate). Deterministic
for a given --seed (default 0); needs the packages from scripts/install_data_sources.sh and the
'data' extra.

    python scripts/build_offline_data.py [--out moee/data/offline] [--debs build/debs] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # moee_build lives in the checkout, not in the installed package

from moee.data.offline_tasks import LEAK_CHECK_FILE, OFFLINE_TASKS, OfflineTask  # noqa: E402
from moee.provenance import package_versions  # noqa: E402
from moee_build.corpus import LeakReport, find_leaks  # noqa: E402
from moee_build.exclusions import (  # noqa: E402
    EVAL_BIBLE_BOOKS,
    EVAL_FORTUNE_CATEGORIES,
    LEAK_MIN_WORDS,
    LEAK_SPAN_WORDS,
    TRAINING_AUTHORS,
    is_eval_bible_book,
    is_eval_synset,
    span_key,
    span_words,
    text_key,
)
from moee_build.sources import (  # noqa: E402
    KJV_MODULE,
    SOURCES,
    TRAINING_SOURCES,
    WEB_MODULE,
    DataPaths,
    Fortune,
    Synset,
    Verse,
    iter_fortunes,
    iter_wordnet_synsets,
    read_bible,
    read_lee,
    read_reuters,
)

Rows = list[dict]

# ---------------------------------------------------------------------------------------------
# shared pools (each built once, in a deterministic order)

FORTUNE_MIN_CHARS, FORTUNE_MAX_CHARS = 20, 400
BIBLE_MIN_WORDS, BIBLE_MAX_WORDS = 5, 60
REUTERS_MAX_WORDS = 256

LEAK_RULE = (
    f"left out when it shares a run of {LEAK_SPAN_WORDS} consecutive words with a document of a training source "
    f"(a text of {LEAK_MIN_WORDS}-{LEAK_SPAN_WORDS - 1} words: all of its words in a row), equals a whole "
    "document, or is attributed to a training source's author; words normalised (NFKC, casefolded, "
    "punctuation and line breaks ignored) with closing attributions stripped"
)


@lru_cache(maxsize=1)
def _fortune_candidates(paths: DataPaths) -> dict[str, list[Fortune]]:
    """Short entries of the evaluation categories whose text occurs in exactly one category file."""
    cats_of: dict[str, set[str]] = defaultdict(set)
    entries = list(iter_fortunes(paths=paths))
    for f in entries:
        cats_of[text_key(f.text)].add(f.category)
    pool: dict[str, list[Fortune]] = {c: [] for c in EVAL_FORTUNE_CATEGORIES}
    seen: set[str] = set()
    for f in entries:
        key = text_key(f.text)
        if (
            f.category in pool
            and FORTUNE_MIN_CHARS <= len(f.text) <= FORTUNE_MAX_CHARS
            and len(cats_of[key]) == 1
            and key not in seen
        ):
            seen.add(key)
            pool[f.category].append(f)
    return pool


@lru_cache(maxsize=1)
def _synset_candidates(paths: DataPaths) -> list[Synset]:
    """Reserved noun and verb synsets with a gloss of at least three words, unique glosses."""
    out, seen = [], set()
    for s in iter_wordnet_synsets(("noun", "verb"), paths):
        key = text_key(s.gloss)
        if is_eval_synset(s.pos, s.offset) and len(s.gloss.split()) >= 3 and key not in seen:
            seen.add(key)
            out.append(s)
    return out


@lru_cache(maxsize=1)
def _verse_candidates(paths: DataPaths) -> list[tuple[Verse, Verse]]:
    """(KJV, WEB) pairs of the same verse in the reserved books: moderate length, each wording unique."""
    web = {(v.book, v.chapter, v.verse): v for v in read_bible(WEB_MODULE) if is_eval_bible_book(v.book)}
    pairs, seen = [], set()
    for k in read_bible(KJV_MODULE):
        w = web.get((k.book, k.chapter, k.verse))
        if w is None or not is_eval_bible_book(k.book):
            continue
        keys = {text_key(k.text), text_key(w.text)}
        if all(BIBLE_MIN_WORDS <= len(v.text.split()) <= BIBLE_MAX_WORDS for v in (k, w)) and not keys & seen:
            seen |= keys  # a repeated verse (same wording twice) would make retrieval ambiguous
            pairs.append((k, w))
    return pairs


def _reuters_text(text: str) -> str:
    return " ".join(text.split()[:REUTERS_MAX_WORDS])


def _candidates(paths: DataPaths) -> dict[str, list[str]]:
    """Every text a task may use, by task (the leak check runs once over all of them)."""
    fortunes = [f.text for entries in _fortune_candidates(paths).values() for f in entries]
    synsets = _synset_candidates(paths)
    verses = [v.text for pair in _verse_candidates(paths) for v in pair]
    return {
        "lee_sts": read_lee()[0],
        "fortunes_classification": fortunes,
        "reuters_classification": [
            _reuters_text(t) for split in ("train", "test") for t, _ in read_reuters(split, paths)
        ],
        "wordnet_supersense_clustering": [s.gloss for s in synsets],
        "fortunes_clustering": fortunes,
        "bible_pair_classification": verses,
        "bible_verse_retrieval": verses,
        "wordnet_definition_retrieval": [s.gloss for s in synsets] + [", ".join(s.words) for s in synsets],
    }


@lru_cache(maxsize=1)
def training_leaks(paths: DataPaths) -> tuple[dict[str, tuple[str, ...]], LeakReport]:
    """Normalised text key -> the training sources it leaks into, for every candidate text of
    every task, checked against every training source (``moee_build.corpus.find_leaks``)."""
    texts = list(dict.fromkeys(t for ts in _candidates(paths).values() for t in ts))
    report = find_leaks(texts, TRAINING_SOURCES, paths)
    leaks: dict[str, tuple[str, ...]] = {}
    for i in sorted(report.leaked()):
        key = text_key(texts[i])
        leaks[key] = tuple(dict.fromkeys(leaks.get(key, ()) + tuple(report.sources_of(i))))
    return leaks, report


def leaks_into_training(text: str, paths: DataPaths) -> bool:
    return text_key(text) in training_leaks(paths)[0]


def leak_summary(task: str, paths: DataPaths) -> dict:
    """How many of a task's candidate texts were left out for leaking, per training source."""
    leaks = training_leaks(paths)[0]
    candidates = list(dict.fromkeys(_candidates(paths)[task]))
    by_source: Counter[str] = Counter()
    dropped = 0
    for text in candidates:
        sources = leaks.get(text_key(text), ())
        dropped += bool(sources)
        by_source.update(sources)
    return {
        "rule": LEAK_RULE,
        "candidates": len(candidates),
        "left_out": dropped,
        "left_out_by_source": {s: by_source[s] for s in TRAINING_SOURCES if by_source[s]},
    }


@lru_cache(maxsize=1)
def fortune_pool(paths: DataPaths) -> dict[str, list[Fortune]]:
    """Fortune candidates that do not leak into any training source."""
    return {
        cat: [f for f in entries if not leaks_into_training(f.text, paths)]
        for cat, entries in _fortune_candidates(paths).items()
    }


@lru_cache(maxsize=1)
def reserved_synsets(paths: DataPaths) -> list[Synset]:
    """Synset candidates whose gloss does not leak into any training source."""
    return [s for s in _synset_candidates(paths) if not leaks_into_training(s.gloss, paths)]


@lru_cache(maxsize=1)
def aligned_verses(paths: DataPaths) -> list[tuple[Verse, Verse]]:
    """Verse pairs neither of whose wordings leaks into any training source (a gospel verse
    shares its wording with a parallel in another gospel, a quotation with its source)."""
    return [p for p in _verse_candidates(paths) if not any(leaks_into_training(v.text, paths) for v in p)]


# ---------------------------------------------------------------------------------------------
# tasks: each returns {file name: rows} and extra metadata


def build_lee_sts(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    docs, sims = read_lee()
    documents = [{"id": i, "text": d} for i, d in enumerate(docs)]
    rows = [
        {"id1": i, "id2": j, "score": round(float(sims[i, j]), 6)}
        for i in range(len(docs))
        for j in range(i + 1, len(docs))
    ]
    extra = {
        "score_range": [0.0, 1.0],
        "score_note": (
            "score is the value of gensim's similarities0-1.txt: the mean of the human ratings on "
            "Lee et al.'s 1-5 scale divided by 5 (so observed scores lie in [0.2, 1.0]); only the "
            "upper triangle (i < j) is used. Spearman correlation is unaffected by this scaling."
        ),
        "unique_texts": len(docs),
    }
    return {"documents.jsonl": documents, "test.jsonl": rows}, extra


def build_fortunes_classification(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    pool = fortune_pool(paths)
    train, test = [], []
    for cat in EVAL_FORTUNE_CATEGORIES:
        picked = rng.sample(pool[cat], 150)
        train += [{"text": f.text, "label": cat} for f in picked[:100]]
        test += [{"text": f.text, "label": cat} for f in picked[100:]]
    rng.shuffle(train)
    rng.shuffle(test)
    extra = {
        "labels": list(EVAL_FORTUNE_CATEGORIES),
        "selection": f"entries of {FORTUNE_MIN_CHARS}-{FORTUNE_MAX_CHARS} characters found in exactly one category "
        "file; 150 sampled per category, 100 train + 50 test",
    }
    return {"train.jsonl": train, "test.jsonl": test}, extra


def build_reuters_classification(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    out = {}
    caps = {"train": 150, "test": 100}
    for split, cap in caps.items():
        rows = read_reuters(split, paths)
        other = [i for i, (_, lab) in enumerate(rows) if lab == "other"]
        keep = set(rng.sample(other, cap)) | {i for i, (_, lab) in enumerate(rows) if lab != "other"}
        out[f"{split}.jsonl"] = [
            {"text": _reuters_text(t), "label": lab} for i, (t, lab) in enumerate(rows) if i in keep
        ]
    extra = {
        "labels": ["corn", "grain", "other"],
        "selection": "ModApte train/test split as shipped; every corn and grain document kept, 'other' "
        "(neither label) subsampled to 150 train / 100 test; 'grain' means grain but not corn; texts cut to "
        f"their first {REUTERS_MAX_WORDS} words (headline first) to bound the CPU cost",
    }
    return out, extra


WORDNET_CLUSTER_SUPERSENSES = (
    "noun.animal",
    "noun.artifact",
    "noun.body",
    "noun.food",
    "noun.location",
    "noun.person",
    "noun.plant",
    "noun.substance",
    "verb.change",
    "verb.communication",
    "verb.contact",
    "verb.motion",
)


def build_wordnet_clustering(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    by_lex: dict[str, list[Synset]] = defaultdict(list)
    for s in reserved_synsets(paths):
        by_lex[s.lexname].append(s)
    rows = []
    for lex in WORDNET_CLUSTER_SUPERSENSES:
        rows += [
            {"text": s.gloss, "label": lex, "synset": f"{s.pos}:{s.offset:08d}"}
            for s in rng.sample(by_lex[lex], 50)
        ]
    rng.shuffle(rows)
    extra = {
        "labels": list(WORDNET_CLUSTER_SUPERSENSES),
        "selection": "50 glosses (definition only, no lemma, no example) per supersense from the reserved synsets",
    }
    return {"test.jsonl": rows}, extra


def build_fortunes_clustering(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    pool = fortune_pool(paths)
    rows = []
    for cat in EVAL_FORTUNE_CATEGORIES:
        rows += [{"text": f.text, "label": cat} for f in rng.sample(pool[cat], 40)]
    rng.shuffle(rows)
    extra = {
        "labels": list(EVAL_FORTUNE_CATEGORIES),
        "selection": "40 entries per category (same pool as the classification task)",
    }
    return {"test.jsonl": rows}, extra


def build_bible_pairs(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    pairs = aligned_verses(paths)
    by_chapter: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, (k, _) in enumerate(pairs):
        by_chapter[(k.book, k.chapter)].append(i)
    picked = rng.sample(range(len(pairs)), 1000)
    rows = []
    for n, i in enumerate(picked):
        k, w = pairs[i]
        if n % 2 == 0:
            rows.append({"sentence1": k.text, "sentence2": w.text, "label": 1, "ref1": k.ref, "ref2": w.ref})
        else:
            j = rng.choice([j for j in by_chapter[(k.book, k.chapter)] if j != i])
            w2 = pairs[j][1]
            rows.append(
                {"sentence1": k.text, "sentence2": w2.text, "label": 0, "ref1": k.ref, "ref2": w2.ref}
            )
    extra = {
        "labels": {
            "1": "same verse (KJV / WEB)",
            "0": "KJV verse with the WEB text of another verse of the same chapter",
        },
        "selection": f"verses of {', '.join(EVAL_BIBLE_BOOKS)} with {BIBLE_MIN_WORDS}-{BIBLE_MAX_WORDS} words in both "
        "translations; 1,000 distinct KJV verses, alternately paired with their own WEB verse or a random other "
        "verse of the same chapter",
    }
    return {"test.jsonl": rows}, extra


def _retrieval_files(queries: Rows, corpus: Rows, qrels: Rows) -> dict[str, Rows]:
    return {"queries.jsonl": queries, "corpus.jsonl": corpus, "qrels.jsonl": qrels}


def build_bible_retrieval(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    pairs = aligned_verses(paths)
    order = rng.sample(range(len(pairs)), 1600)
    qset = set(order[:400])
    queries = [{"id": f"kjv:{pairs[i][0].ref}", "text": pairs[i][0].text} for i in sorted(qset)]
    corpus = [{"id": f"web:{pairs[i][1].ref}", "text": pairs[i][1].text} for i in sorted(order)]
    qrels = [
        {"query_id": f"kjv:{pairs[i][0].ref}", "doc_id": f"web:{pairs[i][1].ref}", "score": 1}
        for i in sorted(qset)
    ]
    extra = {
        "selection": f"400 KJV verses of {', '.join(EVAL_BIBLE_BOOKS)} as queries; the corpus holds their 400 WEB "
        "renderings plus 1,200 other WEB verses of the same books; one relevant document per query",
    }
    return _retrieval_files(queries, corpus, qrels), extra


def build_wordnet_retrieval(paths: DataPaths, rng: random.Random) -> tuple[dict[str, Rows], dict]:
    synsets, seen = [], set()
    for s in reserved_synsets(paths):
        words = ", ".join(s.words)
        if text_key(words) not in seen:
            seen.add(text_key(words))
            synsets.append(s)
    synsets = [s for s in synsets if not leaks_into_training(", ".join(s.words), paths)]
    order = rng.sample(range(len(synsets)), 1600)
    qset = set(order[:400])

    def sid(s: Synset) -> str:
        return f"{s.pos}:{s.offset:08d}"

    queries = [{"id": "q:" + sid(synsets[i]), "text": synsets[i].gloss} for i in sorted(qset)]
    corpus = [{"id": sid(synsets[i]), "text": ", ".join(synsets[i].words)} for i in sorted(order)]
    qrels = [
        {"query_id": "q:" + sid(synsets[i]), "doc_id": sid(synsets[i]), "score": 1} for i in sorted(qset)
    ]
    extra = {
        "selection": "400 glosses of reserved noun/verb synsets as queries; the corpus holds the lemma lists "
        "('word, word') of those synsets plus 1,200 other reserved synsets, every lemma list unique",
    }
    return _retrieval_files(queries, corpus, qrels), extra


BUILDERS: dict[str, Callable[[DataPaths, random.Random], tuple[dict[str, Rows], dict]]] = {
    "lee_sts": build_lee_sts,
    "fortunes_classification": build_fortunes_classification,
    "reuters_classification": build_reuters_classification,
    "wordnet_supersense_clustering": build_wordnet_clustering,
    "fortunes_clustering": build_fortunes_clustering,
    "bible_pair_classification": build_bible_pairs,
    "bible_verse_retrieval": build_bible_retrieval,
    "wordnet_definition_retrieval": build_wordnet_retrieval,
}


def _row_texts(files: dict[str, Rows]) -> list[str]:
    return [
        r[k] for rows in files.values() for r in rows for k in ("text", "sentence1", "sentence2") if k in r
    ]


def write_task(
    task: OfflineTask,
    out_dir: Path,
    files: dict[str, Rows],
    extra: dict,
    seed: int,
    command: str,
    leak_check: dict | None = None,
) -> dict:
    d = out_dir / task.name
    d.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for fname, rows in files.items():
        with open(d / fname, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
        sizes[fname.removesuffix(".jsonl")] = len(rows)
    if sizes != task.sizes:
        raise ValueError(f"{task.name}: built sizes {sizes} differ from the declared {task.sizes}")
    labels = Counter(r["label"] for rows in files.values() for r in rows if "label" in r)
    meta = {
        "name": task.name,
        "family": task.family,
        "description": task.description,
        "main_score": task.main_score,
        "sizes": sizes,
        "label_counts": {str(k): v for k, v in sorted(labels.items(), key=lambda kv: str(kv[0]))} or None,
        "sources": {s: SOURCES[s].info() for s in task.sources},
        "seed": seed,
        "build_command": command,
        "versions": package_versions(("gensim", "moee"), missing="not installed", omit_missing=()),
        **extra,
    }
    if leak_check is not None:
        meta["leak_check"] = leak_check
    (d / "metadata.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("moee/data/offline"))
    ap.add_argument("--debs", type=Path, default=Path("build/debs"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args(argv)
    paths = DataPaths(debs_dir=args.debs)
    names = [t for t in args.tasks.split(",") if t] or list(BUILDERS)
    command = "python scripts/build_offline_data.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    for name in names:
        if name not in OFFLINE_TASKS:
            raise SystemExit(f"unknown task {name!r}; known: {sorted(OFFLINE_TASKS)}")
    for name in names:
        rng = random.Random(f"{args.seed}:{name}")
        files, extra = BUILDERS[name](paths, rng)
        leaked = [t for t in _row_texts(files) if leaks_into_training(t, paths)]
        if leaked:  # a fixed set (Lee, Reuters) cannot be resampled: its leaks must be dealt with by hand
            raise SystemExit(
                f"{name}: {len(leaked)} texts leak into the training sources, e.g. {leaked[0][:80]!r}"
            )
        summary = leak_summary(name, paths)
        meta = write_task(OFFLINE_TASKS[name], args.out, files, extra, args.seed, command.strip(), summary)
        print(f"{name:32s} {meta['family']:20s} {meta['sizes']} left out {summary['left_out_by_source']}")
    write_leak_check(args.out / LEAK_CHECK_FILE, paths, command.strip())
    return 0


def write_leak_check(path: Path, paths: DataPaths, command: str) -> None:
    """The committed record of the leak check: its rule, per task the candidates left out per
    source, and per source the keys of the spans it shares with any candidate (see
    ``moee_build.corpus.committed_leaks``), so the committed data can be re-checked anywhere."""
    leaks, report = training_leaks(paths)
    spans = {}
    for source in TRAINING_SOURCES:
        keys = {span_key(g) for g in report.spans[source]}
        for i in report.by_source[source]:  # whole short texts equal to a document
            words = span_words(report.texts[i])
            if len(words) < LEAK_SPAN_WORDS:
                keys.add(span_key(words))
        spans[source] = sorted(keys)
    doc = {
        "rule": LEAK_RULE,
        "span_words": LEAK_SPAN_WORDS,
        "min_words": LEAK_MIN_WORDS,
        "training_authors": {s: list(v) for s, v in TRAINING_AUTHORS.items()},
        "build_command": command,
        "candidates": len(report.texts),
        "candidates_left_out": len(leaks),
        "left_out_by_task": {name: leak_summary(name, paths)["left_out_by_source"] for name in OFFLINE_TASKS},
        "spans": spans,
    }
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
