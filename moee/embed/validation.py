"""Input checks shared by every entry point (Python API, CLI, evaluation adapters).

They live in one place so that every caller gives the same clear message for the same
mistake, and so that a bad row is reported by its index instead of surfacing later as an
obscure tokenizer or shape error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np

from moee.capture.vocabulary import check_choice  # re-exported: the one check of a name

__all__ = ["check_alpha", "check_choice", "check_positive_int", "check_texts"]


def check_texts(texts: Any) -> list[str]:
    """Return ``texts`` as a list of str, or raise naming the first bad item.

    Accepts any sequence (list, tuple, 1-D numpy array or pandas Series of str); iterators
    and generators are rejected, since they could be consumed only once. A bare ``str``/``bytes`` is
    rejected instead of being split into characters; ``None`` and non-str items are rejected
    with their index, because silently skipping them would shift every later row.
    Empty strings are allowed (they are legitimate, if uninformative, inputs). A text that
    cannot be encoded as UTF-8 (a lone surrogate) is rejected with its index and position.
    """
    if isinstance(texts, (str, bytes, bytearray)):
        raise TypeError(
            f"texts must be a list of str, got a single {type(texts).__name__}; wrap it in a list: [text]"
        )
    if isinstance(texts, np.ndarray) or (hasattr(texts, "ndim") and hasattr(texts, "tolist")):
        # numpy arrays and array-likes such as a pandas Series
        if texts.ndim != 1:
            raise TypeError(f"texts must be a 1-D sequence of str, got an array of shape {texts.shape}")
        texts = texts.tolist()
    elif not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a list (or other sequence) of str, got {type(texts).__name__}")
    out = list(texts)
    for i, item in enumerate(out):
        if item is None:
            raise TypeError(f"texts[{i}] is None; every item must be a str")
        if not isinstance(item, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(item).__name__}")
        if not item.isascii():
            _check_encodable(i, item)
    return out


def _check_encodable(i: int, text: str) -> None:
    """A lone surrogate (e.g. from ``errors="surrogateescape"``) has no UTF-8 form, so a tokenizer
    fails on it without naming the row; name it here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"texts[{i}] contains a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}; "
            "it is not valid Unicode text (decode the input with errors='replace' or fix it)"
        ) from None


def check_alpha(alpha: Any) -> float:
    """Return the MoEE(sum) weight as a float; it must be a finite real number >= 0."""
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    value = float(alpha)
    if not math.isfinite(value):
        raise ValueError(f"alpha must be finite, got {value}")
    if value < 0:
        raise ValueError(f"alpha must be >= 0, got {value}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an int >= 1 (batch sizes, k, nlist ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)
