"""Parsing, cleaning, chunking, exclusion and tokenizer-training rules of moee.data (no packages needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moee_build.corpus import (
    SpanIndex,
    build_corpus,
    chunk_text,
    find_contained,
    find_leaks,
    is_heldout,
    iter_corpus,
)
from moee_build.exclusions import (
    WORDNET_EVAL_MODULUS,
    attributed_source,
    attribution,
    is_eval_synset,
    normalize_text,
    span_words,
    stable_bucket,
    strip_attribution,
    text_key,
)
from moee_build.sources import (
    SOURCES,
    TRAINING_SOURCES,
    DataPaths,
    Document,
    _parse_synset_line,
    _read_arff_text_label,
    clean_osis,
    clean_rst,
    parse_diatheke_osis,
    reflow,
)


def test_normalisation_and_keys() -> None:
    assert normalize_text("  Hello\n\tWORLD  ") == "hello world"
    assert text_key("Hello  world") == text_key("hello world\n")
    assert text_key("hello world") != text_key("hello, world")


def test_stable_bucket_is_fixed_and_checked() -> None:
    # pinned values: the split must not change between runs, machines or Python versions
    assert stable_bucket("abc", 100) == stable_bucket("abc", 100)
    assert [stable_bucket(f"k{i}", 7) for i in range(5)] == [stable_bucket(f"k{i}", 7) for i in range(5)]
    with pytest.raises(ValueError):
        stable_bucket("abc", 0)
    share = sum(is_eval_synset("noun", off) for off in range(10_000)) / 10_000
    assert abs(share - 1 / WORDNET_EVAL_MODULUS) < 0.02


def test_synset_line_parsing() -> None:
    line = (
        "02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 001 @ 02083346 n 0000 | a member of the genus "
        'Canis; "the dog barked all night"'
    )
    s = _parse_synset_line("noun", line)
    assert (s.offset, s.lexname, s.words) == (
        2084071,
        "noun.animal",
        ("dog", "domestic dog", "Canis familiaris"),
    )
    assert s.gloss == "a member of the genus Canis"
    assert s.examples == ("the dog barked all night",)
    adj = _parse_synset_line(
        "adj", '00001740 00 a 01 able(p) 0 000 | (usually followed by `to\') having ability; "able to swim"'
    )
    assert adj.words == ("able",) and adj.lexname == "adj.all"


def test_osis_verse_parsing() -> None:
    dump = (
        'Genesis 1:1: <w>In</w> <w>the</w> <w>beginning</w>, <w>God</w><w>created</w> the heavens.<milestone type="line"/>\n'
        "A Psalm by David.  Psalms 3:1: Yahweh, how <w>my</w> adversaries<note>n1</note> increased!  \n"
        "<title>Heading</title> I John 1:1: ¶ That which was from the beginning\n"
        'Tobit 6:18: <milestone type="line"/>\n'
    )
    verses = parse_diatheke_osis(dump)
    assert [v.ref for v in verses] == ["Genesis 1:1", "Psalms 3:1", "I John 1:1"]
    assert verses[0].text == "In the beginning, God created the heavens."
    assert verses[1].text == "Yahweh, how my adversaries increased!"  # heading and note dropped
    assert verses[2].text == "That which was from the beginning"
    assert clean_osis("a &amp; b") == "a & b"


def test_rst_cleaning() -> None:
    rst = (
        ":mod:`json` --- JSON encoder\n"
        "============================\n\n"
        ".. module:: json\n"
        "   :synopsis: Encode and decode\n\n"
        "Use :func:`~json.dumps` or :func:`loads <json.loads>` and ``indent``\n"
        "to format; see `the RFC <https://x>`_. Example::\n\n"
        "    >>> json.dumps([1])\n"
        "    '[1]'\n"
    )
    text = clean_rst(rst)
    assert "====" not in text and "module::" not in text and ":synopsis:" not in text
    assert "json --- JSON encoder" in text
    assert "Use dumps or loads and indent to format; see the RFC. Example:" in text
    assert "    >>> json.dumps([1])" in text  # code keeps its indentation and line breaks


def test_reflow_keeps_paragraphs() -> None:
    assert reflow("a b\nc\n\n\nd\ne") == "a b c\n\nd e"


def test_arff_reader(tmp_path: Path) -> None:
    f = tmp_path / "x.arff"
    f.write_text(
        "@relation r\n@attribute Text string\n@attribute class {0,1}\n@data\n"
        "'GRAIN UP\\nprices rose, isn\\'t it',1\n'other news &#3;',0\n",
        encoding="utf-8",
    )
    assert _read_arff_text_label(f) == [("GRAIN UP prices rose, isn't it", 1), ("other news", 0)]


def test_chunking_respects_limits_and_keeps_text() -> None:
    text = "\n\n".join(" ".join(f"w{p}_{i}" for i in range(n)) for p, n in enumerate([10, 30, 500, 5]))
    chunks = chunk_text(text, max_words=64)
    assert all(len(c.split()) <= 64 for c in chunks)
    assert " ".join(" ".join(chunks).split()) == " ".join(text.split())  # nothing lost, order kept
    verse = "\n".join(f"line {i} of the verse" for i in range(40))
    assert all(c.count("\n") >= 1 for c in chunk_text(verse, max_words=50))  # splits at line breaks
    with pytest.raises(ValueError):
        chunk_text("x", max_words=0)


def test_find_contained() -> None:
    hay = ["the quick brown fox jumps over the lazy dog", "Short one"]
    texts = ["Quick brown fox jumps", "brown fox sleeps over there", "short ONE", "short"]
    assert find_contained(texts, hay) == [0, 2]


def test_build_corpus_dedups_excludes_and_is_deterministic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = [
        Document("fortunes", "a", "Alpha beta gamma.\n\nDelta epsilon."),
        Document("fortunes", "b", "alpha   BETA gamma."),  # duplicate after normalisation
        Document("fortunes", "c", "An evaluation text."),
    ] + [Document("fortunes", f"n{i}", f"note number {i} here") for i in range(300)]
    src = SOURCES["fortunes"]
    monkeypatch.setitem(
        SOURCES, "fortunes", src.__class__(**{**src.__dict__, "read": lambda paths: iter(docs)})
    )
    m1 = build_corpus(tmp_path / "a", sources=["fortunes"], eval_texts=["an evaluation text."], max_words=4)
    build_corpus(tmp_path / "b", sources=["fortunes"], eval_texts=["an evaluation text."], max_words=4)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    st = m1["sources"]["fortunes"]
    assert st["duplicates_dropped"] == 1 and st["eval_matches_dropped"] == 1
    recs = list(iter_corpus(tmp_path / "a" / "train.jsonl")) + list(
        iter_corpus(tmp_path / "a" / "heldout.jsonl")
    )
    assert len(recs) == st["chunks"] == 302
    assert all(is_heldout(r["text"]) for r in iter_corpus(tmp_path / "a" / "heldout.jsonl"))
    assert 0 < st["heldout_chunks"] < 20
    assert m1["sources"]["fortunes"]["licence"] == SOURCES["fortunes"].licence
    assert (
        json.loads((tmp_path / "a" / "manifest.json").read_text())["files"]["train"]["records"]
        == st["train_chunks"]
    )
    with pytest.raises(ValueError, match="unknown source"):
        build_corpus(tmp_path / "c", sources=["nope"])


QUOTE = (
    "Neither a borrower nor a lender be;\nFor loan oft loses both itself and friend.\n"
    '        -- William Shakespeare, "Hamlet"'
)
PLAY = "POLONIUS. ... Neither a borrower, nor a lender be:\n    For loan oft loses both itself and friend,\n    And borrowing dulls the edge of husbandry."


def test_attributions_are_stripped_and_credited() -> None:
    assert (
        strip_attribution(QUOTE)
        == "Neither a borrower nor a lender be;\nFor loan oft loses both itself and friend."
    )
    assert attribution(QUOTE) == '-- William Shakespeare, "Hamlet"'
    assert attributed_source(QUOTE) == "shakespeare"
    assert attributed_source("Fame is a vapor.\n        -- Mark Twain") is None
    assert attributed_source('Emma was happy.\n\t-- Jane Austen, "Emma"') == "austen"
    # a dash inside a line, or a text that is nothing but a credit, is not an attribution
    assert strip_attribution("I haven't lost my mind -- it's backed up on tape.") == (
        "I haven't lost my mind -- it's backed up on tape."
    )
    assert strip_attribution("-- anonymous") == "-- anonymous"
    # words ignore punctuation, line breaks, case and curly apostrophes
    assert span_words("Don\u2019t PANIC,\nplease!") == ["don't", "panic", "please"]


def test_span_index_finds_quotations_that_whole_text_containment_misses() -> None:
    """A quotation differs from its source in punctuation and line breaks and carries a credit the
    source lacks, so containment never sees it; a run of 8 shared words does."""
    assert find_contained([QUOTE], [PLAY]) == []
    texts = [
        QUOTE,
        "A text about nothing in the play at all, long enough to be indexed.",
        "for loan oft loses",
    ]
    index = SpanIndex(texts)
    spans: set[tuple[str, ...]] = set()
    assert index.matches(PLAY, spans) == {0, 2}  # the 4-word text: all of its words in a row
    assert ("neither", "a", "borrower", "nor", "a", "lender", "be", "for") in spans
    eight = ["Neither a borrower nor a lender be, for ever and ever, said nobody at all."]
    assert SpanIndex(eight).matches(PLAY) == {0}  # exactly 8 shared words in a row
    assert SpanIndex(eight, span=9).matches(PLAY) == set()
    assert SpanIndex(["oft loses both"]).matches(PLAY) == set()  # under LEAK_MIN_WORDS: not indexed
    with pytest.raises(ValueError, match="min_words"):
        SpanIndex(texts, span=4, min_words=5)


def test_find_leaks_per_source(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(name: str, text: str):
        src = SOURCES[name]
        doc = Document(name, "d", text)
        monkeypatch.setitem(
            SOURCES, name, src.__class__(**{**src.__dict__, "read": lambda paths: iter([doc])})
        )

    fake("shakespeare", PLAY)
    fake("jargon", "kludge n an ill assorted collection of poorly matching parts forming a distressing whole")
    texts = [
        QUOTE,
        "Kludge, n.:\n    An ill-assorted collection of poorly-matching parts, forming a\n    distressing whole.",
        'The ripest fruit falls first.\n        -- William Shakespeare, "Richard II"',  # credited, not in the text
        "Nothing here is in any source at all, whatever its length may be.",
    ]
    report = find_leaks(texts, ["shakespeare", "jargon"])
    assert report.by_source == {"shakespeare": {0, 2}, "jargon": {1}}
    assert report.sources_of(1) == ["jargon"] and report.leaked() == {0, 1, 2}


def test_build_corpus_drops_chunks_sharing_a_span_with_an_eval_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = [Document("shakespeare", "hamlet", PLAY), Document("shakespeare", "other", "To be, or not to be.")]
    src = SOURCES["shakespeare"]
    monkeypatch.setitem(
        SOURCES, "shakespeare", src.__class__(**{**src.__dict__, "read": lambda paths: iter(docs)})
    )
    m = build_corpus(tmp_path, sources=["shakespeare"], eval_texts=[QUOTE], span_texts=[QUOTE])
    st = m["sources"]["shakespeare"]
    assert st["eval_matches_dropped"] == 0 and st["eval_spans_dropped"] == 1 and st["chunks"] == 1
    assert "8 words" in m["span_rule"]


def test_registry_has_provenance_for_every_source() -> None:
    for s in SOURCES.values():
        assert s.licence and s.citation and s.origin
    assert set(TRAINING_SOURCES) == {n for n, s in SOURCES.items() if s.read is not None}
    assert {"lee", "reuters"}.isdisjoint(TRAINING_SOURCES)


def test_missing_package_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="install_data_sources"):
        DataPaths(debs_dir=tmp_path, root=tmp_path).find("usr/share/wordnet")


@pytest.mark.slow
def test_tokenizer_training_is_deterministic_and_configured(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from moee_build.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    texts = [f"The {w} sat on the mat number {i}." for i in range(200) for w in ("cat", "dog", "naïve café")]
    a = train_tokenizer(texts, vocab_size=400)
    b = train_tokenizer(texts, vocab_size=400)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    a.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.padding_side == "left" and tok.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN]) == [0, 1]
    s = "emoji 🙂 and tabs\tstay"
    assert tok.decode(tok(s)["input_ids"]) == s  # byte-level: lossless, no unknown tokens
    batch = tok(["a", "the cat sat"], padding=True)
    assert batch["attention_mask"][0][0] == 0 and batch["input_ids"][0][0] == tok.pad_token_id
    with pytest.raises(ValueError):
        train_tokenizer(texts, vocab_size=100)
