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
"""

from __future__ import annotations

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


def render_prompt(text: str, prompt: str | None) -> str:
    """Render one text with a prompt (name, template or ``None``)."""
    template = resolve_prompt(prompt)
    if template is None:
        return text
    return template.replace(PLACEHOLDER, prepare_text(text))


def render_prompts(texts: list[str], prompt: str | None) -> list[str]:
    """Render many texts, resolving the prompt once."""
    template = resolve_prompt(prompt)
    if template is None:
        return list(texts)
    return [template.replace(PLACEHOLDER, prepare_text(t)) for t in texts]
