"""The one place that decides which real texts are reserved for evaluation.

The training corpus (``scripts/build_corpus.py``) and the offline evaluation data
(``scripts/build_offline_data.py``) both read these rules, so an evaluation text can never
leak into training unnoticed: whole sources, whole fortune categories and whole Bible books
are reserved, and WordNet synsets are reserved by a stable hash of their identity (so the
split does not depend on file order or on which tasks sample them).

Reserving units is not enough when the same words recur in another source (a fortune quoting
Shakespeare, a Luke verse repeating Matthew), so both builders also compare texts by long shared
spans of normalised words (``LEAK_SPAN_WORDS``, ``span_words``; ``moee_build.corpus.SpanIndex``).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence

#: Sources used only for evaluation; nothing from them enters the training corpus.
EVAL_ONLY_SOURCES: tuple[str, ...] = ("lee", "reuters")

#: Fortune categories used as labels by the offline classification/clustering tasks.
EVAL_FORTUNE_CATEGORIES: tuple[str, ...] = (
    "computers",
    "definitions",
    "education",
    "food",
    "law",
    "literature",
    "politics",
    "science",
)

#: Bible books (as diatheke names them) whose verses the offline pair/retrieval tasks use,
#: reserved in both translations.
EVAL_BIBLE_BOOKS: tuple[str, ...] = ("Proverbs", "Luke", "Romans")

#: One WordNet synset in ``WORDNET_EVAL_MODULUS`` is reserved for evaluation.
WORDNET_EVAL_MODULUS = 8


def stable_bucket(key: str, modulus: int) -> int:
    """A platform-independent hash bucket (Python's ``hash`` is salted per process)."""
    if modulus < 1:
        raise ValueError(f"modulus must be >= 1, got {modulus}")
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % modulus


def is_eval_synset(pos: str, offset: int | str) -> bool:
    """Whether the WordNet synset ``(pos, offset)`` is reserved for evaluation."""
    return stable_bucket(f"wordnet:{pos}:{int(offset):08d}", WORDNET_EVAL_MODULUS) == 0


def is_eval_fortune_category(category: str) -> bool:
    return category in EVAL_FORTUNE_CATEGORIES


def is_eval_bible_book(book: str) -> bool:
    return book in EVAL_BIBLE_BOOKS


_WS = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """The normal form used for exact-duplicate and leakage checks: NFKC, casefolded, one space."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text)).strip().casefold()


def text_key(text: str) -> str:
    """Hex digest of the normalised text (the identity of a text for dedup and exclusion)."""
    return hashlib.sha1(normalize_text(text).encode("utf-8")).hexdigest()


#: An evaluation text *leaks* into a training source when it shares a run of this many
#: consecutive words (``span_words``) with one of the source's documents; a shorter text leaks
#: when all of its words occur there in a row (see ``moee_build.corpus.SpanIndex``).
LEAK_SPAN_WORDS = 8

#: Texts of fewer words are only checked as whole units: a phrase of two or three words (a
#: lemma list, a short gloss) recurs in any large text without being a copy of it.
LEAK_MIN_WORDS = 4

# A closing attribution: a line starting with "--" (or a dash) and at most two more lines.
_ATTRIBUTION = re.compile(r"\n[ \t]*(?:--|\u2014|\u2015)(?!-)[^\n]*(?:\n[^\n]*){0,2}\Z")
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def strip_attribution(text: str) -> str:
    """``text`` without a closing attribution line such as ``-- William Shakespeare, "Hamlet"``.

    A quotation carries its author's name but the quoted work does not, so whole-text
    containment could never see a fortune that quotes a training text.
    """
    m = _ATTRIBUTION.search(text)
    return text[: m.start()].rstrip() if m and m.start() > 0 and len(m.group()) <= 200 else text


#: Training sources whose authors evaluation texts may quote, by the names an attribution uses:
#: a quotation attributed to one of them is treated as leaked even when it is misquoted.
TRAINING_AUTHORS: dict[str, tuple[str, ...]] = {
    "shakespeare": ("shakespeare",),
    "austen": ("jane austen",),
}


def attribution(text: str) -> str:
    """The closing attribution of ``text`` (``""`` if there is none), see ``strip_attribution``."""
    return text[len(strip_attribution(text)) :].strip()


def attributed_source(text: str) -> str | None:
    """The training source whose author ``text``'s attribution names (``TRAINING_AUTHORS``), if any."""
    credit = normalize_text(attribution(text))
    for source, names in TRAINING_AUTHORS.items():
        if any(name in credit for name in names):
            return source
    return None


def span_key(words: Sequence[str]) -> str:
    """A stable 64-bit hex digest of a run of words (the committed form of a shared span)."""
    return hashlib.blake2b(" ".join(words).encode("utf-8"), digest_size=8).hexdigest()


def span_words(text: str) -> list[str]:
    """The words used for span matching: attribution stripped, normalised, punctuation and line
    breaks ignored (a quotation is rarely punctuated like its source), curly apostrophes straight."""
    return _WORD.findall(normalize_text(strip_attribution(text)).replace("\u2019", "'"))
