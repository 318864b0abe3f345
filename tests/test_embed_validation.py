"""Input checks: clear TypeError/ValueError that name the problem and the row."""

import math

import numpy as np
import pytest

from moee.embed.validation import check_alpha, check_choice, check_positive_int, check_texts


def test_check_texts_accepts_sequences_and_keeps_order():
    assert check_texts(["b", "a", ""]) == ["b", "a", ""]
    assert check_texts(("x", "y")) == ["x", "y"]
    assert check_texts(np.array(["p", "q"])) == ["p", "q"]
    assert check_texts([]) == []
    pd = pytest.importorskip("pandas")
    assert check_texts(pd.Series(["s", "t"], index=[5, 3])) == ["s", "t"]


@pytest.mark.parametrize("bad", ["a text", b"bytes", bytearray(b"x")])
def test_check_texts_rejects_single_string(bad):
    with pytest.raises(TypeError, match="wrap it in a list"):
        check_texts(bad)


@pytest.mark.parametrize("bad", [None, 3, {"a": 1}, {"a", "b"}, (t for t in ["a"])])
def test_check_texts_rejects_non_sequences(bad):
    with pytest.raises(TypeError, match="texts must be a list"):
        check_texts(bad)


def test_check_texts_rejects_2d_array():
    with pytest.raises(TypeError, match="1-D"):
        check_texts(np.array([["a", "b"]]))


def test_check_texts_names_none_item():
    with pytest.raises(TypeError, match=r"texts\[2\] is None"):
        check_texts(["a", "b", None])


@pytest.mark.parametrize("item,typename", [(1, "int"), (b"x", "bytes"), (["a"], "list"), (1.5, "float")])
def test_check_texts_names_non_str_item(item, typename):
    with pytest.raises(TypeError, match=rf"texts\[1\] must be a str, got {typename}"):
        check_texts(["ok", item])


def test_check_choice():
    assert check_choice("method", "rw", ("hs", "rw")) == "rw"
    with pytest.raises(ValueError, match=r"unknown method 'xx'; expected one of: hs, rw"):
        check_choice("method", "xx", ("hs", "rw"))
    with pytest.raises(ValueError, match="unknown pooling None"):
        check_choice("pooling", None, ("last", "mean"))


def test_check_alpha():
    assert check_alpha(0) == 0.0
    assert check_alpha(2) == 2.0
    assert check_alpha(np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match=">= 0"):
        check_alpha(-0.1)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            check_alpha(bad)
    for bad in ("1", None, True):
        with pytest.raises(TypeError, match="alpha must be a real number"):
            check_alpha(bad)


def test_check_positive_int():
    assert check_positive_int("k", 3) == 3
    with pytest.raises(ValueError, match="k must be >= 1"):
        check_positive_int("k", 0)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        check_positive_int("batch_size", 2.0)


def test_check_texts_names_a_lone_surrogate():
    """A lone surrogate (e.g. from a bad decode with errors='surrogateescape') cannot be encoded as
    UTF-8, so the tokenizer would fail without saying which row."""
    with pytest.raises(ValueError, match=r"texts\[2\] contains a lone surrogate U\+DC80 at character 3"):
        check_texts(["ok", "fine é", "abc\udc80def"])
    assert check_texts(["emoji 🙂 ok"]) == ["emoji 🙂 ok"]
