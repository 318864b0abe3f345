"""Prompt rendering: exact strings, the official text handling, and name/template resolution."""

import pytest

from moee.embed.prompts import (
    FINAL_PUNCTUATION,
    PROMPT_NAMES,
    PROMPTEOL,
    STABILITY_PROMPTS,
    prepare_text,
    render_prompt,
    render_prompts,
    resolve_prompt,
)


def test_prompteol_template_is_exact():
    assert PROMPTEOL == 'This sentence : "{text}" means in one word:"'


def test_prompteol_rendering_exact_strings():
    assert render_prompt("A man is playing a guitar", "prompteol") == (
        'This sentence : "A man is playing a guitar." means in one word:"'
    )
    # final punctuation kept, no extra full stop
    assert (
        render_prompt("Is it raining?", "prompteol") == 'This sentence : "Is it raining?" means in one word:"'
    )
    assert render_prompt("Wow!", "prompteol") == 'This sentence : "Wow!" means in one word:"'
    # surrounding whitespace stripped before the punctuation check
    assert (
        render_prompt("  hello world \n", "prompteol") == 'This sentence : "hello world." means in one word:"'
    )
    # inner double quotes become single quotes
    assert render_prompt('He said "hi" to me', "prompteol") == (
        'This sentence : "He said \'hi\' to me." means in one word:"'
    )
    # a text ending in a double quote counts as punctuated (checked before the quote swap)
    assert (
        render_prompt('He said "hi"', "prompteol") == 'This sentence : "He said \'hi\'" means in one word:"'
    )
    # underscores are NOT replaced (the official code's side effect is deliberately dropped)
    assert render_prompt("snake_case", "prompteol") == 'This sentence : "snake_case." means in one word:"'


def test_final_punctuation_set_is_documented():
    assert set(FINAL_PUNCTUATION) == set(".?!\"'")
    for ch in FINAL_PUNCTUATION:
        assert prepare_text("x" + ch).startswith("x") and not prepare_text("x" + ch).endswith(ch + ".")
    for ch in ",;:)":
        assert prepare_text("x" + ch) == "x" + ch + "."


def test_empty_text_stays_empty():
    assert prepare_text("") == ""
    assert prepare_text("   ") == ""
    assert render_prompt("", "prompteol") == 'This sentence : "" means in one word:"'


def test_no_prompt_keeps_text_verbatim():
    assert resolve_prompt(None) is None
    assert render_prompt('  raw "text"  ', None) == '  raw "text"  '
    assert render_prompts(["a", " b "], None) == ["a", " b "]


def test_nine_stability_prompts_in_paper_order():
    assert list(STABILITY_PROMPTS) == [
        "meaning",
        "style",
        "sentiment",
        "tone",
        "intent",
        "complexity",
        "subjectivity",
        "language_style",
        "grammar",
    ]
    assert STABILITY_PROMPTS["meaning"] == "This sentence: {text} means in one word:"
    assert STABILITY_PROMPTS["style"] == "In one word, describe the style of the following sentence - {text}:"
    assert STABILITY_PROMPTS["sentiment"] == (
        "In one word, describe the sentiment of the following sentence (positive, neutral, or negative) - {text}:"
    )
    assert STABILITY_PROMPTS["tone"] == (
        "In one word, describe the tone of the following sentence - {text} "
        "(e.g., formal, informal, humorous, serious):"
    )
    assert STABILITY_PROMPTS["intent"] == (
        "In one word, describe the intent behind the following sentence "
        "(e.g., request, suggestion, command) - {text}:"
    )
    assert STABILITY_PROMPTS["complexity"] == (
        "In one word, rate the complexity of the following sentence (simple, moderate, complex) - {text}:"
    )
    assert STABILITY_PROMPTS["subjectivity"] == (
        "In one word, describe whether the following sentence is subjective or objective - {text}:"
    )
    assert STABILITY_PROMPTS["language_style"] == (
        "In one word, describe the language style of the following sentence "
        "(e.g., academic, conversational, literary) - {text}:"
    )
    assert STABILITY_PROMPTS["grammar"] == (
        "In one word, describe the grammatical structure of the following sentence "
        "(simple, compound, complex) - {text}:"
    )
    assert all(t.count("{text}") == 1 for t in STABILITY_PROMPTS.values())
    assert render_prompt("It works", "tone") == (
        "In one word, describe the tone of the following sentence - It works. "
        "(e.g., formal, informal, humorous, serious):"
    )


def test_resolve_names_and_templates():
    assert resolve_prompt("prompteol") == PROMPTEOL
    for name in STABILITY_PROMPTS:
        assert resolve_prompt(name) == STABILITY_PROMPTS[name]
    assert PROMPT_NAMES[0] == "prompteol" and len(PROMPT_NAMES) == 10
    assert resolve_prompt("Query: {text}") == "Query: {text}"


@pytest.mark.parametrize("bad", ["promptEOL", "meanings", "", "Query: {txt}", "no placeholder here"])
def test_resolve_rejects_unknown_strings(bad):
    with pytest.raises(ValueError, match="unknown prompt"):
        resolve_prompt(bad)


def test_resolve_rejects_non_str():
    with pytest.raises(TypeError, match="prompt must be None or a str"):
        resolve_prompt(3)


def test_braces_elsewhere_are_safe():
    # str.format would fail on these; str.replace does not
    assert render_prompt("set {a, b} and {0}", 'JSON {"q": "{text}"} {0}') == (
        'JSON {"q": "set {a, b} and {0}."} {0}'
    )
    # a text containing the placeholder is inserted verbatim, not substituted again
    assert render_prompt("{text}", "<{text}>") == "<{text}.>"


def test_render_prompts_matches_render_prompt():
    texts = ["one", 'two "2"', "three?"]
    assert render_prompts(texts, "prompteol") == [render_prompt(t, "prompteol") for t in texts]
