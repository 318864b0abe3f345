"""Prompt templates: PromptEOL, the paper's nine stability prompts, and user templates.

A template is any string containing the placeholder ``{text}``. Rendering uses
``str.replace`` (not ``str.format``), so braces elsewhere in a template or in the text
are left untouched.

Text handling follows the official MoE-Embedding code (tianyi-lab/MoE-Embedding,
``moee.py``) whenever a template is used:

1. the text is stripped of surrounding whitespace;
2. a full stop is appended unless the text already ends with one of
   ``FINAL_PUNCTUATION`` (``. ? ! " '``), checked *before* step 3, exactly as the official
   code does; an empty text stays empty (no lone ".");
3. every double quote ``"`` inside the text becomes a single quote ``'``, so the text
   cannot close the template's own quotes.

Deliberate difference: the official code also replaces every ``_`` in the rendered prompt
by a space, which silently alters texts (identifiers, URLs); we do not.

With ``prompt=None`` the text is embedded exactly as given (no stripping, no punctuation).

Truncation (``tokenize_prompts``) cuts the *text*, never the template: a text whose rendered
prompt is longer than the model's maximum length is shortened at a token boundary of the text
until the rendered prompt fits, so PromptEOL's closing ``means in one word:"`` (whose last token
is the one pooled) survives. The result is exactly the tokenization of the template rendered
around the shortened text; special tokens the tokenizer adds are kept as well. Cutting costs about
what tokenizing the text costs, whatever its length: the text is tokenized alone once (its token
boundaries), and only the few shortened texts the search tries are ever built.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

PLACEHOLDER = "{text}"

#: PromptEOL (Jiang et al. 2023) as used by the official code: the trailing quote makes the
#: next token the one-word summary.
PROMPTEOL = 'This sentence : "{text}" means in one word:"'

#: Characters that count as final punctuation (no full stop is appended after them).
FINAL_PUNCTUATION = ".?!\"'"

#: The nine prompts of the paper's Table 2 (prompt-stability study), in the paper's order,
#: with the paper's ``*sent*`` replaced by ``{text}``. These are the printed wordings; the
#: official code's variants additionally wrap the text in double quotes and differ in the
#: final colon. Pass such a variant as a template if you need it.
STABILITY_PROMPTS: dict[str, str] = {
    "meaning": "This sentence: {text} means in one word:",
    "style": "In one word, describe the style of the following sentence - {text}:",
    "sentiment": (
        "In one word, describe the sentiment of the following sentence "
        "(positive, neutral, or negative) - {text}:"
    ),
    "tone": (
        "In one word, describe the tone of the following sentence - {text} "
        "(e.g., formal, informal, humorous, serious):"
    ),
    "intent": (
        "In one word, describe the intent behind the following sentence "
        "(e.g., request, suggestion, command) - {text}:"
    ),
    "complexity": (
        "In one word, rate the complexity of the following sentence (simple, moderate, complex) - {text}:"
    ),
    "subjectivity": "In one word, describe whether the following sentence is subjective or objective - {text}:",
    "language_style": (
        "In one word, describe the language style of the following sentence "
        "(e.g., academic, conversational, literary) - {text}:"
    ),
    "grammar": (
        "In one word, describe the grammatical structure of the following sentence "
        "(simple, compound, complex) - {text}:"
    ),
}

#: Every name ``resolve_prompt`` accepts.
PROMPT_NAMES: tuple[str, ...] = ("prompteol", *STABILITY_PROMPTS)


def resolve_prompt(prompt: str | None) -> str | None:
    """Turn a prompt argument into a template (or ``None`` for no prompt).

    Accepts ``None``, ``"prompteol"``, a stability-prompt name, or a template containing
    ``{text}``; anything else raises ``ValueError`` so a typo in a name is never embedded
    literally as a prompt.
    """
    if prompt is None:
        return None
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be None or a str, got {type(prompt).__name__}")
    if prompt == "prompteol":
        return PROMPTEOL
    if prompt in STABILITY_PROMPTS:
        return STABILITY_PROMPTS[prompt]
    if PLACEHOLDER in prompt:
        return prompt
    raise ValueError(
        f"unknown prompt {prompt!r}: expected None, one of {', '.join(PROMPT_NAMES)}, "
        f"or a template containing {PLACEHOLDER!r}"
    )


def prepare_text(text: str) -> str:
    """Apply the official code's text handling (strip, final full stop, quotes), see module doc."""
    text = text.strip()
    if text and text[-1] not in FINAL_PUNCTUATION:
        text += "."
    return text.replace('"', "'")


def render_prompt(text: str, prompt: str | None, *, prepare: bool = True) -> str:
    """Render one text with a prompt (name, template or ``None``); ``prepare=False`` puts the text
    in as given (a recipe's own frame around an unprompted text, e.g. echo's)."""
    template = resolve_prompt(prompt)
    if template is None:
        return text
    return template.replace(PLACEHOLDER, prepare_text(text) if prepare else text)


def render_prompts(texts: list[str], prompt: str | None, *, prepare: bool = True) -> list[str]:
    """Render many texts, resolving the prompt once."""
    return [render_prompt(t, resolve_prompt(prompt), prepare=prepare) for t in texts]


def _ids(tokenizer: Any, strings: list[str], *, special: bool = True) -> list[list[int]]:
    """Token ids with the tokenizer's special tokens (``special=False``: without), nothing truncated."""
    out = tokenizer(
        strings, add_special_tokens=special, truncation=False, return_attention_mask=False, verbose=False
    )["input_ids"]
    return [list(ids) for ids in out]


def _cut_points(tokenizer: Any, text: str, side: str) -> tuple[list[int], int | None]:
    """Character positions where ``text`` may be cut: its token boundaries (word boundaries for a
    tokenizer without offsets). Right side: ends of tokens; left side: starts, last first. Also the
    text's number of tokens without special tokens, read off the same pass (``None`` without
    offsets), so a long text is tokenized alone only once."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        spans, n_tokens = enc["offset_mapping"], len(enc["input_ids"])
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a tokenizer without offsets
        spans, n_tokens = [m.span() for m in re.finditer(r"\S+", text)], None
    spans = [(int(a), int(b)) for a, b in spans if b > a]
    if side == "left":
        return sorted({a for a, _ in spans}, reverse=True), n_tokens
    return sorted({b for _, b in spans}), n_tokens


class _Pieces:
    """The shortened texts a cut may leave, made on demand: ``[k]`` keeps ``k`` cut points (``[0]``
    is the empty text; the whole text, too long, is never one of them).

    Why on demand: a long text has a cut point per token, and a copy of the text per cut point
    costs memory and time with the square of its length; the search reads a handful of them."""

    def __init__(self, text: str, points: list[int], side: str) -> None:
        self.text, self.side = text, side
        # a point that keeps the whole text (the end on the right, the start on the left) is no cut
        self.points = [p for p in points if (p < len(text) if side == "right" else p > 0)]

    def __len__(self) -> int:
        return 1 + len(self.points)

    def __getitem__(self, k: int) -> str:
        if k == 0:
            return ""
        p = self.points[k - 1]
        return self.text[:p] if self.side == "right" else self.text[p:]


def _largest_fitting(fits: Callable[[int], bool], n: int, guess: int) -> int:
    """The largest ``i`` in ``[0, n)`` with ``fits(i)`` (``fits`` falls with ``i``; ``fits(n)`` is
    known to be false), or -1; a search that starts at ``guess`` and widens its steps."""
    g = min(max(guess, 0), n - 1)
    if fits(g):
        lo, step = g, 1
        while lo + step < n and fits(lo + step):
            lo += step
            step *= 2
        hi = min(lo + step, n)
    else:
        hi, step = g, 1
        while hi - step >= 0 and not fits(hi - step):
            hi -= step
            step *= 2
        lo = max(hi - step, -1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def tokenize_prompts(
    tokenizer: Any,
    texts: Sequence[str],
    prompt: str | None,
    max_length: int,
    *,
    side: str = "right",
) -> tuple[list[list[int]], list[int]]:
    """Token ids of every text rendered with ``prompt``, each at most ``max_length`` long.

    A too long text is cut on ``side`` (``right`` keeps its beginning, ``left`` its end) at one of
    its token boundaries, as little as possible, and the template is rendered around what is left
    (see the module docstring), so the template and the special tokens are never cut. Returns the
    ids and, per text, how many tokens the cut removed (0 for texts that fit). Raises
    ``ValueError`` when the template alone (with an empty text) is longer than ``max_length``.
    """
    ids, cut, _ = fit_prompts(tokenizer, texts, prompt, max_length, side=side)
    return ids, cut


def fit_prompts(
    tokenizer: Any,
    texts: Sequence[str],
    prompt: str | None,
    max_length: int,
    *,
    side: str = "right",
    prepare: bool = True,
) -> tuple[list[list[int]], list[int], list[str]]:
    """:func:`tokenize_prompts` plus, per text, the (possibly shortened) text that was rendered.

    A template may hold ``{text}`` more than once (echo embeddings): every copy is cut alike, so
    the last copy is always whole, and the count of cut tokens is the text's own loss (the tokens
    the text lost, once), not the sum over its copies. The kept texts let a recipe find its
    positions in the rendered string (``moee.embed.recipes``). ``prepare=False`` renders the text
    as given (no full stop, no quote rewriting; see :func:`render_prompt`).
    """
    if side not in ("right", "left"):
        raise ValueError(f"truncation side must be 'right' or 'left', got {side!r}")
    template = resolve_prompt(prompt)
    texts = list(texts)
    kept = list(texts)
    out = _ids(tokenizer, render_prompts(texts, template, prepare=prepare)) if texts else []
    cut = [0] * len(out)
    for i, ids in enumerate(out):
        if len(ids) <= max_length:
            continue
        text = texts[i]
        points, n_tokens = _cut_points(tokenizer, text, side)
        piece = _Pieces(text, points, side)
        tried: dict[int, list[int]] = {}

        def fits(k: int, piece: _Pieces = piece, tried: dict[int, list[int]] = tried) -> bool:
            if k not in tried:
                tried[k] = _ids(tokenizer, [render_prompt(piece[k], template, prepare=prepare)])[0]
            return len(tried[k]) <= max_length

        keep = _largest_fitting(fits, len(piece), len(piece) - (len(ids) - max_length))
        if keep < 0:
            raise ValueError(
                f"the prompt {prompt!r} with an empty text is {len(tried[0])} tokens, more than the maximum "
                f"length {max_length}: no text would fit"
            )
        # the text alone, its own loss once: a single text gets as many special tokens as any other
        if n_tokens is None:
            whole, left = (len(s) for s in _ids(tokenizer, [text, piece[keep]]))
        else:
            whole, left = n_tokens, len(_ids(tokenizer, [piece[keep]], special=False)[0])
        out[i], cut[i], kept[i] = tried[keep], whole - left, piece[keep]
    return out, cut, kept
