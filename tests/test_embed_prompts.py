"""Prompt rendering: exact strings, the official text handling, and name/template resolution."""

import numpy as np
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
    tokenize_prompts,
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


# --------------------------------------------------------------------------- truncation

#: PromptEOL's words as single tokens of the tiny word-level tokenizer, so the template is visible in ids.
_EOL_WORDS = ("This", "sentence", ":", "means", "in", "one", 'word:"')
BODY = " ".join(["the", "cat", "sat", "on", "a", "big", "red", "mat", "under", "the", "sun"] * 4)  # 44 words


@pytest.fixture(scope="module")
def tiny():
    from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    tok = tiny_tokenizer((*TINY_WORDS, *_EOL_WORDS))
    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tok, max_length=16)


def _ids(emb, texts, prompt):
    return [r.input_ids.tolist() for r in emb.iter_token_routes(texts, prompt=prompt)]


def _hand_cut(emb, text: str, prompt: str | None) -> str:
    """The longest word prefix of ``text`` whose rendered prompt fits, found the slow way."""
    words = text.split()
    for n in range(len(words), -1, -1):
        cut = " ".join(words[:n])
        ids = emb.tokenizer(render_prompt(cut, prompt), add_special_tokens=True)["input_ids"]
        if len(ids) <= emb.max_length:
            return cut
    raise AssertionError("nothing fits")


def test_truncation_keeps_the_prompteol_template_and_its_last_token(tiny):
    """A long text under PromptEOL loses words of its own, never `means in one word:"`: its ids,
    and so its pooled last token and its HS, are those of the text cut by hand."""
    with pytest.warns(UserWarning, match=r"1 of 2 texts were longer than 16 tokens.* cut on the right by"):
        (long_ids, short_ids) = _ids(tiny, [BODY, "the cat"], "prompteol")
    cut = _hand_cut(tiny, BODY, "prompteol")
    assert BODY.startswith(cut) and len(cut.split()) < len(BODY.split())
    (expected,) = _ids(tiny, [cut], "prompteol")
    assert long_ids == expected and len(long_ids) == 16
    vocab = tiny.tokenizer.get_vocab()
    tail = [vocab[w] for w in ("means", "in", "one", 'word:"')]
    assert long_ids[-4:] == tail == short_ids[-4:]  # the pooled token is the template's last one
    with pytest.warns(UserWarning, match="prompt template kept whole"):
        hs_long = tiny.encode([BODY], method="hs", prompt="prompteol")
    hs_cut = tiny.encode([cut], method="hs", prompt="prompteol")
    np.testing.assert_allclose(hs_long, hs_cut, atol=1e-6)


def test_truncation_without_prompt_and_on_the_left(tiny):
    with pytest.warns(UserWarning, match="cut on the right by 28-28 tokens"):
        (ids,) = _ids(tiny, [BODY], None)
    assert ids == _ids(tiny, [" ".join(BODY.split()[:16])], None)[0]
    tiny.tokenizer.truncation_side = "left"
    try:
        with pytest.warns(UserWarning, match="cut on the left"):
            (left,) = _ids(tiny, [BODY], "prompteol")
    finally:
        tiny.tokenizer.truncation_side = "right"
    kept = " ".join(BODY.split()[-(16 - 7) :])  # the text's end, inside the whole template
    assert left == _ids(tiny, [kept], "prompteol")[0]


def test_tokenize_prompts_counts_the_cut_and_rejects_a_template_too_long(tiny):
    ids, cut = tokenize_prompts(tiny.tokenizer, [BODY, "the cat", ""], "prompteol", 16)
    assert [len(i) for i in ids] == [16, 9, 8] and cut == [44 + 7 - 16, 0, 0]  # "" is a token here
    with pytest.raises(ValueError, match="with an empty text is 8 tokens, more than the maximum length 5"):
        tokenize_prompts(tiny.tokenizer, [BODY], "prompteol", 5)
    with pytest.raises(ValueError, match="truncation side"):
        tokenize_prompts(tiny.tokenizer, [BODY], None, 5, side="middle")


@pytest.mark.slow
def test_long_texts_under_prompteol_with_the_bundled_model():
    """minilm-moe declares the 256-token context it was trained on, and a long real text cut
    to it under PromptEOL still ends with the template (real WordPiece offsets)."""
    from moee.data.offline_tasks import load_task_data
    from moee.embed.embedder import MoEEmbedder

    emb = MoEEmbedder.from_pretrained("minilm-moe", device="cpu")
    assert emb.max_length == 256
    assert emb.tokenizer.model_max_length == 256
    text = " ".join(r["text"] for r in load_task_data("reuters_classification")["test"][:3])
    with pytest.warns(UserWarning, match="1 of 2 texts were longer than 256 tokens"):
        (long_ids, short_ids) = _ids(emb, [text, "Wheat prices rose"], "prompteol")
    tail = emb.tokenizer(' means in one word:"', add_special_tokens=False)["input_ids"]
    assert len(long_ids) <= 256 and long_ids[-len(tail) :] == short_ids[-len(tail) :]
    # WordPiece decoding spaces the pieces apart: compare without spaces
    assert emb.tokenizer.decode(long_ids).replace(" ", "").endswith('."meansinoneword:"')
