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


def test_a_configuration_is_checked_where_it_is_built_and_trusted_below(monkeypatch):
    """An ``EmbeddingConfig`` checks its pooling (and every other field) when it is built, where
    ``moee embed``'s settings or ``encode``'s keywords build it; ``encode(config=...)`` builds none
    again on its way down (features, one trace per prompt), and the only other pooling check is
    the recorder's own, for its direct callers."""
    from moee.capture import recorder
    from moee.capture.tiny import tiny_model, tiny_tokenizer
    from moee.embed import config as config_module
    from moee.embed.config import EmbeddingConfig
    from moee.embed.embedder import MoEEmbedder

    emb = MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer())
    config = EmbeddingConfig(pooling="mean", prompt=("prompteol", "meaning"))  # two prompts: two forwards
    checked, built = [], []
    check_choice = config_module.check_choice  # the one check (moee.capture.vocabulary's)

    def counting(kind, value, allowed):
        checked.append(kind)
        return check_choice(kind, value, allowed)

    post_init = EmbeddingConfig.__post_init__
    monkeypatch.setattr(config_module, "check_choice", counting)
    monkeypatch.setattr(recorder, "check_choice", counting, raising=False)
    monkeypatch.setattr(EmbeddingConfig, "__post_init__", lambda self: built.append(1) or post_init(self))
    emb.encode(["a cat", "a dog"], config=config)
    assert built == [] and checked.count("pooling") == 2  # the recorder's, once per forward
    with pytest.raises(ValueError, match="^unknown pooling 'max'; expected one of: last, mean$"):
        emb.encode(["a cat"], pooling="max")  # a Python caller's keywords: checked by the same function
