"""The recipes' model-free parts on inputs small enough to check by hand: character offsets of a
fast tokenizer, the first text token, the registry, and the layer choices of HS and RW (parsing,
resolving, selecting, weighting) and the prompt ensemble."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

import moee.embed.recipes as rc


# ----------------------------------------------------------------- offsets and the first text token
def _fast():
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "a": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", model_max_length=512
    )


def test_offsets_give_ids_and_character_spans_with_specials_at_zero():
    out = rc._offsets(_fast(), ["hello world", "a"], "echo")
    assert out == [([1, 3, 4, 2], [(0, 0), (0, 5), (6, 11), (0, 0)]), ([1, 5, 2], [(0, 0), (0, 1), (0, 0)])]
    assert all(isinstance(a, int) and isinstance(b, int) for _, spans in out for a, b in spans)


def test_offsets_do_not_cut_long_texts():
    out = rc._offsets(_fast(), [" ".join(["hello"] * 600)], "echo")
    assert len(out[0][0]) == 602


def test_offsets_need_a_fast_tokenizer():
    class Slow:
        is_fast = False

    with pytest.raises(
        ValueError,
        match="^recipe 'echo' needs a fast tokenizer \\(character offsets\\) to find the text's tokens; Slow has none$",
    ):
        rc._offsets(Slow(), ["x"], "echo")
    with pytest.raises(ValueError, match="object has none"):
        rc._offsets(object(), ["x"], "echo")


def test_first_token_after_skips_specials_and_tokens_ending_at_or_before_the_character():
    spans = [(0, 0), (0, 5), (5, 6), (6, 11), (0, 0)]
    assert rc._first_token_after(spans, 0) == 1
    assert rc._first_token_after(spans, 5) == 2  # ends at 6 > 5
    assert rc._first_token_after(spans, 6) == 3
    assert rc._first_token_after(spans, 11) == 5  # none: the length
    assert rc._first_token_after([(3, 3), (2, 4)], 2) == 1  # an empty span is no token


# ----------------------------------------------------------------- the registry
def test_recipe_spec_and_hooks():
    assert rc.recipe_spec(None).name == "plain" and rc.recipe_spec("echo").name == "echo"
    assert rc.RECIPE_NAMES == ("echo", "token_prepending")
    with pytest.raises(
        ValueError, match="^unknown recipe 'x'; expected None or one of: echo, token_prepending$"
    ):
        rc.recipe_spec("x")
    assert isinstance(rc.recipe_hooks(None, object()), nullcontext)
    assert isinstance(rc.recipe_hooks("echo", object()), nullcontext)
    with pytest.raises(ValueError, match="unknown recipe"):
        rc.recipe_hooks("x", object())

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(4))

    model = Decoder()
    hooks = rc.recipe_hooks("token_prepending", model)
    assert isinstance(hooks, rc.TokenPrepending)
    assert hooks._modules == [model.layers[i] for i in rc.token_prepending_layers(4)]


# ----------------------------------------------------------------- HS layers
@pytest.mark.parametrize(
    "value, parsed",
    [
        (None, None),
        (3, 3),
        (np.int64(-2), -2),
        ("4", 4),
        (" -1 ", -1),
        ("2:6", (2, 6)),
        ("-3:-1", (-3, -1)),
        ((1, 3), (1, 3)),
        ([0, 2], (0, 2)),
        (range(2, 5), (2, 5)),
        ((2, -1), (2, -1)),  # signs differ: checked against the model
    ],
)
def test_parse_hs_layer_accepts(value, parsed):
    assert rc.parse_hs_layer(value) == parsed


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("x", ValueError, "^hs_layer must be an int or START:STOP, got 'x'$"),
        ("1:2:3", ValueError, "START:STOP"),
        (range(0, 4, 2), ValueError, r"^hs_layer range must have step 1, got range\(0, 4, 2\)$"),
        ((1, 2, 3), ValueError, r"^hs_layer range must be \(start, stop\), got \(1, 2, 3\)$"),
        ((3, 3), ValueError, "^hs_layer range 3:3 is empty$"),
        ((4, 2), ValueError, "^hs_layer range 4:2 is empty$"),
        ((-1, -2), ValueError, "is empty"),
        ((0, 0), ValueError, "^hs_layer range 0:0 is empty$"),
        ((1, 0), ValueError, "^hs_layer range 1:0 is empty$"),
        ((True, 2), TypeError, "^hs_layer must be an int, got True$"),
        (1.0, TypeError, "^hs_layer must be an int, got 1.0$"),
    ],
)
def test_parse_hs_layer_refuses(value, error, message):
    with pytest.raises(error, match=message):
        rc.parse_hs_layer(value)


def test_hs_layer_ranges_resolve_against_the_model_and_average():
    assert rc._resolve_layer_range(-1, 4) == [3] and rc._resolve_layer_range(0, 4) == [0]
    assert rc._resolve_layer_range(-4, 4) == [0]
    assert rc._resolve_layer_range((1, 3), 4) == [1, 2] and rc._resolve_layer_range((-2, 4), 4) == [2, 3]
    assert rc._resolve_layer_range((0, 4), 4) == [0, 1, 2, 3] and rc._resolve_layer_range((-4, -3), 4) == [0]
    for bad in (4, -5):
        with pytest.raises(
            ValueError, match=f"^hs_layer {bad} is out of range for a model with 4 decoder layers$"
        ):
            rc._resolve_layer_range(bad, 4)
    for bad in ((2, 9), (-9, 2), (3, 1), (5, 6)):
        with pytest.raises(
            ValueError, match=f"^hs_layer range {bad[0]}:{bad[1]} is out of range for 4 decoder layers$"
        ):
            rc._resolve_layer_range(bad, 4)
    hs = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    picked = rc.select_hs(hs, (1, 3))
    assert picked.dtype == np.float32
    np.testing.assert_array_equal(picked, (hs[:, 1] + hs[:, 2]) / 2)
    np.testing.assert_array_equal(rc.select_hs(hs, -1), hs[:, 3])


# ----------------------------------------------------------------- RW layers
@pytest.mark.parametrize(
    "value, parsed",
    [
        (None, None),
        ([2, 0], (0, 2)),
        ((1,), (1,)),
        ("0, 2", (0, 2)),
        ("2,,0,", (0, 2)),
        ("-1", (-1,)),
        ({3: 2, 0: 0.5}, ((0, 0.5), (3, 2.0))),
        ([(1, 1), (0, 0)], ((0, 0.0), (1, 1.0))),
        ("0:0.5,3:2", ((0, 0.5), (3, 2.0))),
        ("1:1, 0", None),  # a mix is an error, below
    ],
)
def test_parse_rw_layers_accepts(value, parsed):
    if parsed is None and value is not None:
        with pytest.raises(ValueError, match="rw_layers must be 'I,J,..' or 'I:W,J:W,..'"):
            rc.parse_rw_layers(value)
        return
    got = rc.parse_rw_layers(value)
    assert got == parsed
    if parsed and isinstance(parsed[0], tuple):
        assert all(isinstance(w, float) for _, w in got)


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("x", ValueError, r"^rw_layers must be 'I,J,\.\.' or 'I:W,J:W,\.\.', got 'x'$"),
        ([], ValueError, r"^rw_layers must name at least one MoE layer, got \[\]$"),
        ("", ValueError, "at least one MoE layer, got \\[\\]"),
        (3, ValueError, "^rw_layers must name at least one MoE layer, got 3$"),
        ([(0, 1, 2)], ValueError, r"^rw_layers weights must be \(index, weight\) pairs, got \(0, 1, 2\)$"),
        ([(0, -1)], ValueError, "^rw_layers weight of layer 0 must be a finite number >= 0, got -1$"),
        ([(1, float("inf"))], ValueError, "weight of layer 1 must be a finite number"),
        ([(1, True)], ValueError, "weight of layer 1 must be a finite number >= 0, got True"),
        ([(1, "2")], ValueError, "got '2'"),
        ([(0, 1), (0, 2)], ValueError, r"^rw_layers names a layer twice: \[0, 0\]$"),
        ([(0, 0), (1, 0)], ValueError, "^rw_layers weights are all 0: no routing would be left$"),
        ([1, 1], ValueError, r"^rw_layers names a layer twice: \[1, 1\]$"),
        ([1.5], TypeError, "^rw_layers index must be an int, got 1.5$"),
        ([(True, 1)], TypeError, "^rw_layers index must be an int, got True$"),
    ],
)
def test_parse_rw_layers_refuses(value, error, message):
    with pytest.raises(error, match=message):
        rc.parse_rw_layers(value)


def test_rw_layers_resolve_select_and_weigh_in_model_order():
    assert rc.resolve_rw_layers((-1, 0), 4) == [(0, 1.0), (3, 1.0)]
    assert rc.resolve_rw_layers(((2, 0.5), (-4, 2.0)), 4) == [(0, 2.0), (2, 0.5)]
    for bad in (4, -5):
        with pytest.raises(
            ValueError, match=f"^rw_layers index {bad} is out of range for a model with 4 MoE layers$"
        ):
            rc.resolve_rw_layers((bad,), 4)
    with pytest.raises(
        ValueError, match=r"^rw_layers names a layer twice once negative indices are resolved: \[-1, 3\]$"
    ):
        rc.resolve_rw_layers((-1, 3), 4)
    rw = np.arange(2 * 4 * 2, dtype=np.float64).reshape(2, 4, 2)
    plain = rc.select_rw(rw, (3, 1))
    assert plain.dtype == np.float32
    np.testing.assert_array_equal(plain, rw[:, [1, 3]])
    weighted = rc.select_rw(rw, ((3, 2.0), (1, 0.5)))
    np.testing.assert_array_equal(weighted, rw[:, [1, 3]] * np.array([0.5, 2.0])[None, :, None])
    unweighted = rc.select_rw(rw, ((3, 2.0), (1, 0.5)), weighted=False)
    np.testing.assert_array_equal(unweighted, rw[:, [1, 3]])
    unweighted[0, 0, 0] = -7  # a copy: the features are not written through
    assert rw[0, 1, 0] == 2.0


def test_weigh_rw_checks_the_layer_count_and_leaves_unit_weights_alone():
    sel = np.ones((1, 2, 3), dtype=np.float32)
    assert rc.weigh_rw(sel, ((0, 1.0), (2, 1.0)), 4) is sel
    assert rc.weigh_rw(sel, (0, 2), 4) is sel
    out = rc.weigh_rw(sel, ((0, 1.0), (2, 3.0)), 4)
    assert out is not sel and out.dtype == np.float32 and out[0, :, 0].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="^rw_layers names 1 layers, the features hold 2$"):
        rc.weigh_rw(sel, ((0, 2.0),), 4)


def test_rw_layer_indices_and_count():
    assert rc.rw_layer_indices(None) is None
    assert rc.rw_layer_indices((0, 2)) == [0, 2] and rc.rw_layer_indices(((1, 0.5), (3, 2.0))) == [1, 3]
    assert rc.rw_layer_count(None, 8) == 8 and rc.rw_layer_count((0, 2), 8) == 2


# ----------------------------------------------------------------- the prompt ensemble
def test_an_ensemble_is_the_mean_of_the_prompts_vectors_normalised_again():
    one = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    assert rc.combine_ensemble([one], True) is one
    two = rc.combine_ensemble([one, np.array([[0.0, 5.0], [0.0, 0.0]], dtype=np.float32)], True)
    assert two.dtype == np.float32 and two.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(two[0], np.array([1.5, 4.5]) / np.hypot(1.5, 4.5), rtol=1e-6)
    assert two[1].tolist() == [0.0, 0.0]  # a zero row stays zero
    raw = rc.combine_ensemble([one, one * 3], False)
    np.testing.assert_allclose(raw, one * 2)
    # unit vectors (their mean is shorter than 1), each row normalised on its own, zero rows written
    a = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=np.float32)
    b = np.array([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]], dtype=np.float32)
    for _ in range(3):
        junk = [np.full((3, 2), 7.0) for _ in range(8)]
        del junk
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy warns of a division `where` without `out`
            out = rc.combine_ensemble([a, b], True)
        np.testing.assert_allclose(out, [[2**-0.5, 2**-0.5], [0.0, 1.0], [0.0, 0.0]], rtol=1e-6)


# ----------------------------------------------------------------- echo
def _emb(max_length=64):
    return SimpleNamespace(
        tokenizer=_fast(), max_length=max_length, truncation_side="right", empty_ids=[1, 2]
    )


def test_echo_pools_from_the_first_token_of_the_second_copy():
    """[CLS] Rewrite the sentence : hello world , rewritten sentence : hello world [SEP]: the
    second copy starts at index 11; with a prompt, the prompt's first token there starts it."""
    out, cut = rc._tokenize_echo(_emb(), ["hello world", "a"], None)
    assert cut == [0, 0]
    assert out[0].ids == [1, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0, 3, 4, 2] and out[0].pool_from == 11
    assert out[1].ids == [1, 0, 0, 0, 0, 5, 0, 0, 0, 0, 5, 2] and out[1].pool_from == 10
    prompted, _ = rc._tokenize_echo(_emb(), ["hello world"], "a {text}")
    assert prompted[0].ids == [1, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0, 5, 3, 4, 0, 2] and prompted[0].pool_from == 11
    assert rc._tokenize_echo(_emb(), [], None) == ([], [])


def test_echo_cuts_the_text_once_and_an_empty_text_pools_its_last_token():
    out, cut = rc._tokenize_echo(_emb(12), ["hello world hello world hello world hello"], None)
    assert cut == [6] and out[0].ids == [1, 0, 0, 0, 0, 3, 0, 0, 0, 0, 3, 2] and out[0].pool_from == 10
    empty, _ = rc._tokenize_echo(_emb(), [""], None)
    assert empty[0].pool_from == len(empty[0].ids) - 1


def test_echo_cuts_on_the_embedders_side_and_needs_a_fast_tokenizer():
    emb = _emb(12)
    emb.truncation_side = "left"
    out, cut = rc._tokenize_echo(emb, ["a world hello world hello world hello"], None)
    assert cut == [6] and out[0].ids[5] == 3  # left: the text's last word "hello" is kept
    right, _ = rc._tokenize_echo(_emb(12), ["a world hello world hello world hello"], None)
    assert right[0].ids[5] == 5  # right: its first word "a" is kept
    slow = _emb()
    slow.tokenizer.__class__ = type("SlowLike", (PreTrainedTokenizerFast,), {"is_fast": False})
    with pytest.raises(ValueError, match="^recipe 'echo' needs a fast tokenizer"):
        rc._tokenize_echo(slow, ["hello"], None)


def test_echo_refuses_a_tokenizer_that_tokenizes_the_same_text_two_ways(monkeypatch):
    real = rc._offsets
    monkeypatch.setattr(rc, "_offsets", lambda *a: [([9, *ids], spans) for ids, spans in real(*a)])
    with pytest.raises(RuntimeError, match="^the tokenizer gave different ids for the same echo text$"):
        rc._tokenize_echo(_emb(), ["hello"], None)


# ----------------------------------------------------------------- token prepending hooks
class _Layer(torch.nn.Module):
    def forward(self, hidden_states, *rest, **kw):
        self.rest = rest  # what reached the layer besides the states
        return hidden_states


class _Decoder(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(n))


def test_token_prepending_chooses_and_checks_its_layers():
    model = _Decoder(8)
    assert rc.TokenPrepending(model).layers == [1, 2]
    assert rc.TokenPrepending(model, layers=[3])._modules == [model.layers[3]]
    assert rc.TokenPrepending(model, layers=())._modules == []
    for bad in ([0], [8], [1, 2.0]):
        with pytest.raises(ValueError, match=r"^token_prepending layers must be in 1\.\.7, got \["):
            rc.TokenPrepending(model, layers=bad)
    with pytest.raises(ValueError, match="^token_prepending cannot find the decoder layers of Linear$"):
        rc.TokenPrepending(torch.nn.Linear(2, 2))


def test_token_prepending_replaces_the_placeholder_state_positionally_or_by_keyword_and_removes_its_hooks():
    model = _Decoder(4)
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    tp = rc.TokenPrepending(model, layers=[1])
    with tp:
        assert len(model.layers[1]._forward_pre_hooks) == 1
        with pytest.raises(
            RuntimeError, match=r"^call TokenPrepending\.set_batch\(\) before the forward pass$"
        ):
            model.layers[1](hidden)
        tp.set_batch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 2]))
        assert tp._rows[0].dtype == torch.long
        out = model.layers[1](hidden)
        assert out[0, 0].tolist() == hidden[0, 2].tolist() and out[1, 1].tolist() == hidden[1, 2].tolist()
        assert out[0, 1].tolist() == hidden[0, 1].tolist() and hidden[0, 0].tolist() == [0.0, 1.0]  # a copy
        model.layers[1](hidden, "mask", "cache")
        assert model.layers[1].rest == ("mask", "cache")  # the other positional inputs pass through
        by_name = model.layers[1](hidden_states=hidden)
        torch.testing.assert_close(by_name, out)
        assert model.layers[0](hidden) is hidden  # other layers untouched
        with pytest.raises(
            RuntimeError, match=r"^_Layer: expected \[batch, seq, \.\.\., hidden\] input states$"
        ):
            model.layers[1](hidden[0])
        with pytest.raises(RuntimeError, match="expected"):
            model.layers[1](hidden_states=None)
    assert len(model.layers[1]._forward_pre_hooks) == 0


def test_token_prepending_that_fails_to_install_removes_what_it_installed():
    model = _Decoder(4)
    tp = rc.TokenPrepending(model, layers=[1, 2])

    def refuse(*a, **k):
        raise OSError("no")

    model.layers[2].register_forward_pre_hook = refuse
    with pytest.raises(OSError):
        with tp:
            pass
    assert len(model.layers[1]._forward_pre_hooks) == 0 and tp._handles == []
