"""The one place that decides which real texts are reserved for evaluation.

The training corpus (``scripts/build_corpus.py``) and the offline evaluation data
(``scripts/build_offline_data.py``) both read these rules, so an evaluation text can never
leak into training unnoticed: whole sources, whole fortune categories and whole Bible books
are reserved, and WordNet synsets are reserved by a stable hash of their identity (so the
split does not depend on file order or on which tasks sample them).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

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
