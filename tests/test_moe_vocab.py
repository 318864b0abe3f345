"""Vocabulary trimming and the causal template (moee/moe/vocab.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertLMHeadModel, PreTrainedTokenizerFast

from moee.moe.vocab import causal_template, keep_for_counts, trim_vocabulary

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "a",
    "b",
    "c",
    "d",
    "##a",
    "##b",
    "##c",
    "##d",
    "cab",
    "bad",
    "dab",
    "##ad",
    "abc",
]


def bert_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def lm(vocab: int = len(WORDS)):
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        is_decoder=True,
        pad_token_id=0,
    )
    model = BertLMHeadModel(cfg).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_()
    return model


def test_keep_for_counts_keeps_seen_special_and_single_character_tokens():
    tok = bert_tokenizer()
    counts = np.zeros(len(WORDS), dtype=np.int64)
    counts[WORDS.index("cab")] = 5
    counts[WORDS.index("bad")] = 1
    keep = keep_for_counts(tok, counts, min_count=2)
    names = {WORDS[i] for i in keep}
    assert "cab" in names and "bad" not in names and "dab" not in names and "abc" not in names
    assert {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "##d"} <= names
    with pytest.raises(ValueError, match="counts has 3 entries"):
        keep_for_counts(tok, np.zeros(3), 1)


def test_trimmed_model_gives_the_old_logits_on_kept_tokens():
    tok, model = bert_tokenizer(), lm()
    text = "cab bad abc dab"
    old_ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        old_logits = model(input_ids=old_ids).logits
    keep = [WORDS.index(w) for w in ("a", "b", "c", "d", "##a", "##b", "##c", "##d", "cab", "bad", "##ad")]
    model, new_tok, kept = trim_vocabulary(model, tok, keep)
    assert len(new_tok) == len(kept) == 16 and model.config.vocab_size == 16
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # kept words keep their token; dropped ones fall back to pieces
    pieces = new_tok.convert_ids_to_tokens(new_tok(text).input_ids)
    assert pieces == ["[CLS]", "cab", "bad", "a", "##b", "##c", "d", "##a", "##b", "[SEP]"]
    same = "cab bad"
    ids_new = new_tok(same, return_tensors="pt").input_ids
    ids_old = tok(same, return_tensors="pt").input_ids
    assert torch.equal(kept[ids_new], ids_old)
    with torch.no_grad():
        old = lm()(input_ids=ids_old).logits[..., kept]
        new = model(input_ids=ids_new).logits
    assert torch.allclose(old, new, atol=1e-6)
    assert old_logits.shape[-1] == len(WORDS)


def test_trim_rejects_ids_out_of_range_and_bpe():
    tok = bert_tokenizer()
    with pytest.raises(ValueError, match=r"must lie in \[0, 18\)"):
        trim_vocabulary(lm(), tok, [40])
    bpe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="supports WordPiece, WordLevel tokenizers, not BPE"):
        trim_vocabulary(lm(), bpe, [1])


def test_causal_template_adds_only_a_leading_bos():
    tok = causal_template(bert_tokenizer())
    assert tok.convert_ids_to_tokens(tok("cab bad").input_ids) == ["[CLS]", "cab", "bad"]
    assert tok.bos_token == "[CLS]" and tok.eos_token == "[SEP]"
    assert tok.bos_token_id == 2 and tok.eos_token_id == 3


def test_a_count_equal_to_min_count_is_kept():
    tok = bert_tokenizer()
    counts = np.zeros(len(WORDS), dtype=np.int64)
    counts[WORDS.index("cab")] = 2
    counts[WORDS.index("bad")] = 1
    names = {WORDS[i] for i in keep_for_counts(tok, counts, min_count=2)}
    assert "cab" in names and "bad" not in names


# the specials after the words: trimming words moves their ids, so every place that names them must follow
LATE = [w for w in WORDS if w not in ("[CLS]", "[SEP]")] + ["[CLS]", "[SEP]"]


def late_special_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(LATE)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.mark.parametrize("causal_first", [False, True])
def test_template_and_special_token_ids_follow_the_trimmed_vocabulary(causal_first):
    tok = late_special_tokenizer()
    if causal_first:
        tok = causal_template(tok)
    model = lm(len(LATE))
    model.config.sep_token_id = LATE.index("[SEP]")
    keep = [LATE.index(w) for w in ("a", "b", "c", "d", "cab")]
    model, new_tok, kept = trim_vocabulary(model, tok, keep)
    n = len(kept)
    assert new_tok.cls_token_id == n - 2 and new_tok.sep_token_id == n - 1
    assert model.config.sep_token_id == n - 1
    ids = new_tok("cab").input_ids
    want = ["[CLS]", "cab"] if causal_first else ["[CLS]", "cab", "[SEP]"]
    assert new_tok.convert_ids_to_tokens(ids) == want and max(ids) < n
    pair = new_tok("cab", "a").input_ids
    assert new_tok.convert_ids_to_tokens(pair)[:3] == ["[CLS]", "cab", "[SEP]"] and max(pair) < n


def test_keep_for_counts_defaults_to_tokens_seen_once():
    counts = np.zeros(len(WORDS), dtype=np.int64)
    counts[WORDS.index("bad")] = 1
    names = {WORDS[i] for i in keep_for_counts(bert_tokenizer(), counts)}
    assert "bad" in names and "cab" not in names


def test_a_non_fast_tokenizer_and_a_bpe_one_are_refused_by_name():
    from moee.moe.vocab import check_trimmable

    class Slow:
        pass

    with pytest.raises(TypeError, match="a fast .tokenizers-backed. tokenizer is needed, got Slow"):
        check_trimmable(Slow())
    with pytest.raises(TypeError, match="got Slow"):
        causal_template(Slow())
    check_trimmable(bert_tokenizer())  # WordPiece: fine
    with pytest.raises(ValueError, match="not BPE"):
        check_trimmable(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())))


def test_trimmed_and_causal_tokenizers_keep_their_special_names_and_length_limit():
    tok = bert_tokenizer()
    tok.model_max_length = 77
    _, trimmed, _ = trim_vocabulary(lm(), tok, [WORDS.index("cab")])
    causal = causal_template(tok)
    for new in (trimmed, causal):
        assert new.model_max_length == 77
        assert (new.unk_token, new.pad_token, new.mask_token) == ("[UNK]", "[PAD]", "[MASK]")
        assert (new.cls_token, new.sep_token) == ("[CLS]", "[SEP]")


def test_causal_template_pairs_and_chosen_bos_eos():
    tok = causal_template(bert_tokenizer())
    enc = tok("cab", "bad", return_token_type_ids=True)
    assert tok.convert_ids_to_tokens(enc.input_ids) == ["[CLS]", "cab", "[SEP]", "bad"]
    assert enc.token_type_ids == [0, 0, 0, 0]
    assert tok("cab", return_token_type_ids=True).token_type_ids == [0, 0]
    chosen = causal_template(bert_tokenizer(), bos="[MASK]", eos="[PAD]")
    assert chosen.convert_ids_to_tokens(chosen("cab", "bad").input_ids) == ["[MASK]", "cab", "[PAD]", "bad"]
    assert (chosen.bos_token, chosen.eos_token, chosen.bos_token_id, chosen.eos_token_id) == (
        "[MASK]",
        "[PAD]",
        4,
        0,
    )
    with pytest.raises(ValueError, match=r"'\[NOPE\]' is not in the vocabulary"):
        causal_template(bert_tokenizer(), bos="[NOPE]")
    with pytest.raises(ValueError, match=r"'\[NOPE\]' is not in the vocabulary"):
        causal_template(bert_tokenizer(), eos="[NOPE]")
    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    )
    with pytest.raises(ValueError, match=r"^the tokenizer has no CLS/SEP tokens: pass bos= and eos=$"):
        causal_template(bare)
    with pytest.raises(ValueError, match="has no CLS/SEP tokens"):
        causal_template(bare, bos="a")
    assert causal_template(bare, bos="a", eos="[UNK]").bos_token == "a"
