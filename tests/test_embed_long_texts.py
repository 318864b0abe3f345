"""Long texts: cutting one to the model's length costs about what tokenizing it costs.

The cut is checked against the straightforward search it replaces (every shortened text built
up front, which costs the square of a text's length) on many texts, prompts, sides and
tokenizers, a slow tokenizer without offsets included; memory is checked on a million characters.
"""

from __future__ import annotations

import random
import sys
import tracemalloc
import warnings
from pathlib import Path

import pytest

from moee.embed.prompts import PROMPTEOL, _cut_points, _ids, _largest_fitting, fit_prompts, render_prompt
from moee.embed.recipes import ECHO_PREFIX, recipe_spec

WORDS = ["the", "cat", "sat", "on", "mat", 'said "hi"', "naïve", "東京", "x_y", "!", "?", "it's", "   ", "\n"]
WORDS += ["supercalifragilistic", "1234567", "{text}", "{", "é"]


def _quadratic_fit(tokenizer, texts, prompt, max_length, side, prepare):
    """The search as it was written before: every shortened text built up front. Kept as the
    oracle the on-demand pieces must match exactly (ids, cut counts, kept texts, errors)."""
    out = [_ids(tokenizer, [render_prompt(t, prompt, prepare=prepare)])[0] for t in texts]
    cut, kept = [0] * len(out), list(texts)
    for i, ids in enumerate(out):
        if len(ids) <= max_length:
            continue
        text = texts[i]
        points, _ = _cut_points(tokenizer, text, side)
        pieces = ["", *[p for p in (text[:q] if side == "right" else text[q:] for q in points) if p != text]]
        tried = {}

        def fits(k, pieces=pieces, tried=tried):
            tried.setdefault(k, _ids(tokenizer, [render_prompt(pieces[k], prompt, prepare=prepare)])[0])
            return len(tried[k]) <= max_length

        keep = _largest_fitting(fits, len(pieces), len(pieces) - (len(ids) - max_length))
        if keep < 0:
            return "refused"
        whole, left = _ids(tokenizer, [text, pieces[keep]])
        out[i], cut[i], kept[i] = tried[keep], len(whole) - len(left), pieces[keep]
    return out, cut, kept


def _bpe_with_bos():
    """A small byte-level BPE that adds a BOS token (the Llama/OLMoE kind of special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def _tokenizers():
    from transformers import AutoTokenizer, ByT5Tokenizer

    from moee.capture.tiny import TINY_WORDS, tiny_tokenizer
    from moee.embed.embedder import MINILM_MOE_DIR

    slow = ByT5Tokenizer()  # a slow tokenizer: no offsets, so the cut falls back to word boundaries
    assert not slow.is_fast
    return {
        "word-level": tiny_tokenizer([*TINY_WORDS, *WORDS]),
        "wordpiece (bundled)": AutoTokenizer.from_pretrained(MINILM_MOE_DIR),
        "byte-level BPE with BOS": _bpe_with_bos(),
        "byt5 (slow)": slow,
    }


@pytest.mark.slow
def test_cutting_matches_the_quadratic_search_exactly():
    """Same ids, cut counts and kept texts as the search that built every piece, for texts that fit
    and texts that are cut, on both sides, with and without the official text handling, with a
    template holding the text twice (echo), and the same refusal when no text fits."""
    prompts = [None, PROMPTEOL, "This sentence: {text} means in one word:", "Q: {text} A:"]
    prompts += [ECHO_PREFIX + "{text}", ECHO_PREFIX + PROMPTEOL]
    rng = random.Random(0)
    seen = {"cut": 0, "fits": 0, "refused": 0}
    for name, tokenizer in _tokenizers().items():
        for _ in range(40):
            texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60))) for _ in range(4)]
            prompt, side, prepare = rng.choice(prompts), rng.choice(["right", "left"]), rng.random() < 0.7
            max_length = rng.randint(4, 80)
            expected = _quadratic_fit(tokenizer, texts, prompt, max_length, side, prepare)
            try:
                got = fit_prompts(tokenizer, texts, prompt, max_length, side=side, prepare=prepare)
            except ValueError as exc:
                assert expected == "refused", (name, exc)
                seen["refused"] += 1
                continue
            assert got == expected, (name, prompt, side, prepare, max_length, texts)
            seen["cut" if any(got[1]) else "fits"] += 1
    assert min(seen.values()) >= 10, seen  # every outcome was exercised


@pytest.fixture(scope="module")
def bundled():
    from moee.embed.embedder import MoEEmbedder

    return MoEEmbedder.from_pretrained(None, device="cpu")


@pytest.mark.parametrize("recipe", [None, "echo", "token_prepending"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_every_recipe_cuts_a_long_text_in_memory_linear_in_its_length(bundled, recipe, side):
    """Every entry point that cuts goes through the same search: 100,000 characters (20,000
    tokens) cost about 10 MiB of Python objects (ids and offsets), where one copy of the text per
    token boundary cost a gigabyte."""
    text = "word " * 20_000
    bundled.tokenizer.truncation_side = side
    try:
        tracemalloc.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            toks, cut = recipe_spec(recipe).tokenize(bundled, [text], PROMPTEOL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        bundled.tokenizer.truncation_side = "right"
    assert len(toks[0].ids) <= bundled.max_length and cut[0] > 0
    assert peak < 200 * len(text), f"{peak / 2**20:.0f} MiB traced for a {len(text):,}-character text"


@pytest.mark.slow
def test_a_million_character_text_embeds_within_half_a_gigabyte_of_the_loaded_model():
    """``encode`` of one 1,000,000-character text with the bundled model: the process's peak
    memory grows by under 512 MiB past the loaded model (the text, its ids and offsets) and the
    cut takes a few tokenizer passes; the quadratic cut needed tens of gigabytes here. The peak is
    the measuring process's own high-water mark (``VmHWM``), which a fork from this large test
    process does not inflate, restarted after loading; it stops itself past 4 GiB."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_long_texts import measure

    got = measure(1_000_000, limit_bytes=4 << 30, timeout=180)
    assert "over_limit_bytes" not in got, (
        f"peak memory passed 4 GiB ({got['over_limit_bytes'] / 2**30:.2f} GiB)"
    )
    assert got["returncode"] == 0 and got["last_truncation"] == 1, got
    growth = got["peak_rss_bytes"] - got["loaded_rss_bytes"]
    assert growth < 512 << 20, f"the 1M-character text added {growth / 2**20:.0f} MiB past the loaded model"
    assert got["cut_s"] < 5 * got["tokenize_s"] + 1.0, got
