#!/usr/bin/env python
"""Build the committed offline evaluation data under moee/data/offline/ from the real sources.

Every task samples only texts that moee/data/exclusions.py reserves for evaluation (so none of
them is in the training corpus). Deterministic for a given --seed (default 0); needs the packages
from scripts/install_data_sources.sh and the 'data' extra.

    python scripts/build_offline_data.py [--out moee/data/offline] [--debs build/debs] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import moee
from moee.data.corpus import find_contained
from moee.data.exclusions import (
    EVAL_BIBLE_BOOKS,
    EVAL_FORTUNE_CATEGORIES,
    is_eval_bible_book,
    is_eval_synset,
    text_key,
)
from moee.data.offline import OFFLINE_TASKS, OfflineTask
from moee.data.sources import (
    KJV_MODULE,
    SOURCES,
    WEB_MODULE,
    DataPaths,
    Fortune,
    Synset,
    Verse,
    iter_documents,
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


def not_in_training(texts: list[str], sources: tuple[str, ...], paths: DataPaths) -> list[bool]:
    """For each text, whether it does NOT occur inside a training document of ``sources``.

    The exclusion rules keep evaluation units out of training, but the same wording can recur
    elsewhere (a gospel verse repeated in another gospel, a fortune quoted inside another, a gloss
    shared by two synsets); such texts are not used for evaluation.
    """
    haystack = (d.text for src in sources for d in iter_documents(src, paths))
    inside = set(find_contained(texts, haystack))
    return [i not in inside for i in range(len(texts))]


@lru_cache(maxsize=1)
def fortune_pool(paths: DataPaths) -> dict[str, list[Fortune]]:
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
    for cat, entries in pool.items():
        keep = not_in_training([f.text for f in entries], ("fortunes",), paths)
        pool[cat] = [f for f, k in zip(entries, keep) if k]
    return pool


@lru_cache(maxsize=1)
def reserved_synsets(paths: DataPaths) -> list[Synset]:
    """Reserved noun and verb synsets with a gloss of at least three words, unique glosses."""
    out, seen = [], set()
    for s in iter_wordnet_synsets(("noun", "verb"), paths):
        key = text_key(s.gloss)
        if is_eval_synset(s.pos, s.offset) and len(s.gloss.split()) >= 3 and key not in seen:
            seen.add(key)
            out.append(s)
    keep = not_in_training([s.gloss for s in out], ("wordnet",), paths)
    return [s for s, k in zip(out, keep) if k]


@lru_cache(maxsize=1)
def aligned_verses(paths: DataPaths) -> list[tuple[Verse, Verse]]:
    """(KJV, WEB) pairs of the same verse in the reserved books: moderate length, each wording
    unique, neither wording found in the training Bibles."""
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
    keep = not_in_training([v.text for pair in pairs for v in pair], ("kjv", "web"), paths)
    return [p for n, p in enumerate(pairs) if keep[2 * n] and keep[2 * n + 1]]


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
            {"text": " ".join(t.split()[:REUTERS_MAX_WORDS]), "label": lab}
            for i, (t, lab) in enumerate(rows)
            if i in keep
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
    keep = not_in_training([", ".join(s.words) for s in synsets], ("wordnet",), paths)
    synsets = [s for s, k in zip(synsets, keep) if k]
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


def write_task(
    task: OfflineTask, out_dir: Path, files: dict[str, Rows], extra: dict, seed: int, command: str
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
        "versions": {
            "python": platform.python_version(),
            "gensim": _version("gensim"),
            "moee": moee.__version__,
        },
        **extra,
    }
    (d / "metadata.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def _version(mod: str) -> str:
    try:
        return version(mod)
    except Exception:  # noqa: BLE001 - recorded, not fatal
        return "not installed"


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
        rng = random.Random(f"{args.seed}:{name}")
        files, extra = BUILDERS[name](paths, rng)
        meta = write_task(OFFLINE_TASKS[name], args.out, files, extra, args.seed, command.strip())
        print(f"{name:32s} {meta['family']:20s} {meta['sizes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
