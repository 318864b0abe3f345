"""Embedding methods: definitions, the MoEE(sum) cosine identity, per-row independence."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from moee.embed.methods import DEFAULT_SCORE, METHODS, POOLINGS, SCORES, combine, output_dim


def _cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _data(n=5, d=6, layers=3, experts=4, seed=0):
    rng = np.random.default_rng(seed)
    hs = rng.normal(size=(n, d))
    rw = rng.dirichlet(np.ones(experts), size=(n, layers))
    return hs, rw


def test_constants():
    assert METHODS == ("hs", "rw", "moee_concat", "moee_sum")
    assert POOLINGS == ("last", "mean")
    assert SCORES == ("native", "softmax", "selection", "logits")
    assert DEFAULT_SCORE == "native"  # the architecture's own rule; "softmax" stays the paper's option


def test_hs_and_rw_definitions():
    hs, rw = _data()
    np.testing.assert_allclose(combine(hs, rw, "hs", normalize=False), hs, rtol=1e-6)
    np.testing.assert_allclose(combine(hs, rw, "rw", normalize=False), rw.reshape(5, -1), rtol=1e-6)
    out = combine(hs, rw, "hs")
    np.testing.assert_allclose(out, hs / np.linalg.norm(hs, axis=1, keepdims=True), rtol=1e-6)
    # rw flattened in layer order: layer 0's experts first
    np.testing.assert_allclose(combine(None, rw, "rw", normalize=False)[:, :4], rw[:, 0, :], rtol=1e-6)
    # the unused input may be None
    assert combine(hs, None, "hs").shape == (5, 6)


def test_concat_definition():
    hs, rw = _data()
    r = rw.reshape(5, -1)
    expected = np.concatenate(
        [
            np.sqrt(6) * hs / np.linalg.norm(hs, axis=1, keepdims=True),
            np.sqrt(12) * r / np.linalg.norm(r, axis=1, keepdims=True),
        ],
        axis=1,
    )
    np.testing.assert_allclose(combine(hs, rw, "moee_concat", normalize=False), expected, rtol=1e-6)
    normed = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(combine(hs, rw, "moee_concat"), normed, rtol=1e-5, atol=1e-7)
    assert combine(hs, rw, "moee_concat").shape == (5, output_dim("moee_concat", 6, 3, 4))


def test_sum_definition_and_unit_norm():
    hs, rw = _data()
    out = combine(hs, rw, "moee_sum", alpha=2.0, normalize=False)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
    r = rw.reshape(5, -1)
    expected = np.concatenate(
        [
            hs / np.linalg.norm(hs, axis=1, keepdims=True),
            np.sqrt(2) * r / np.linalg.norm(r, axis=1, keepdims=True),
        ],
        axis=1,
    ) / np.sqrt(3)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    assert out.dtype == np.float32


finite = st.floats(-1e3, 1e3, allow_nan=False, width=64)


@settings(max_examples=200, deadline=None)
@given(
    h=arrays(np.float64, (2, 7), elements=finite),
    r=arrays(np.float64, (2, 2, 5), elements=st.floats(0, 1, allow_nan=False)),
    alpha=st.floats(0, 100, allow_nan=False),
)
def test_sum_cosine_identity(h, r, alpha):
    rf = r.reshape(2, -1)
    norms = [np.linalg.norm(h[0]), np.linalg.norm(h[1]), np.linalg.norm(rf[0]), np.linalg.norm(rf[1])]
    if min(norms) < 1e-6:
        return  # identity is about nonzero vectors; zero rows are tested separately
    out = combine(h, r, "moee_sum", alpha=alpha).astype(np.float64)
    expected = (_cos(h[0], h[1]) + alpha * _cos(rf[0], rf[1])) / (1 + alpha)
    assert abs(float(out[0] @ out[1]) - expected) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_rows_are_independent(method):
    hs, rw = _data(n=8)
    full = combine(hs, rw, method, alpha=0.7)
    for i in range(8):
        alone = combine(hs[i : i + 1], rw[i : i + 1], method, alpha=0.7)
        np.testing.assert_array_equal(alone[0], full[i])
    perm = np.random.default_rng(1).permutation(8)
    np.testing.assert_array_equal(combine(hs[perm], rw[perm], method, alpha=0.7), full[perm])
    # a single-row batch gives a finite vector (the official code's batch z-score gives NaN here)
    assert np.isfinite(combine(hs[:1], rw[:1], method)).all()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("normalize", [True, False])
def test_zero_rows_stay_zero(method, normalize):
    hs, rw = _data(n=3)
    hs[1] = 0
    rw[1] = 0
    out = combine(hs, rw, method, normalize=normalize)
    assert np.isfinite(out).all()
    assert not out[1].any()
    assert out[0].any() and out[2].any()


def test_empty_input_gives_empty_matrix():
    out = combine(np.zeros((0, 6)), np.zeros((0, 3, 4)), "moee_sum")
    assert out.shape == (0, 18) and out.dtype == np.float32


def test_alpha_zero_sum_equals_hs_padded():
    hs, rw = _data()
    out = combine(hs, rw, "moee_sum", alpha=0.0)
    np.testing.assert_allclose(out[:, :6], combine(hs, rw, "hs"), rtol=1e-6)
    assert not out[:, 6:].any()


def test_bad_inputs():
    hs, rw = _data()
    with pytest.raises(ValueError, match="unknown method 'mean'"):
        combine(hs, rw, "mean")
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        combine(hs, rw, "moee_sum", alpha=-1)
    with pytest.raises(ValueError, match="alpha must be finite"):
        combine(hs, rw, "moee_sum", alpha=float("inf"))
    with pytest.raises(ValueError, match="disagree on the number of rows: 5 vs 4"):
        combine(hs, rw[:4], "moee_concat")
    with pytest.raises(ValueError, match="hs must have 2 dimensions"):
        combine(hs[0], rw, "hs")
    with pytest.raises(ValueError, match="rw must have 2 or 3 dimensions"):
        combine(hs, rw[..., None], "rw")
    with pytest.raises(ValueError, match="hs is required"):
        combine(None, rw, "moee_sum")
    bad = hs.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="hs contains NaN or inf \\(first in row 3\\)"):
        combine(bad, rw, "hs")
    with pytest.raises(TypeError, match="numeric array"):
        combine(np.array([["a"]]), None, "hs")


def test_output_dim_of_every_method_and_bad_method():
    assert {m: output_dim(m, 6, 3, 4) for m in METHODS} == {
        "hs": 6,
        "rw": 12,
        "moee_concat": 18,
        "moee_sum": 18,
    }
    hs, rw = _data()
    for method in METHODS:
        assert combine(hs, rw, method).shape[1] == output_dim(method, 6, 3, 4)
    with pytest.raises(ValueError, match="unknown method 'mean'; expected one of: hs, rw"):
        output_dim("mean", 6, 3, 4)


def test_default_alpha_is_one():
    hs, rw = _data()
    np.testing.assert_array_equal(combine(hs, rw, "moee_sum"), combine(hs, rw, "moee_sum", alpha=1.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32])
def test_float_and_integer_inputs_of_any_width(dtype):
    hs, rw = _data()
    hs_t, rw_t = (hs * 10).astype(dtype), (rw * 10).astype(dtype)
    expected = combine(hs_t.astype(np.float64), rw_t.astype(np.float64), "moee_concat")
    np.testing.assert_allclose(combine(hs_t, rw_t, "moee_concat"), expected, rtol=1e-6)
