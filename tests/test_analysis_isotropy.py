"""The cone figure: mean pairwise cosine of distinct rows, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from moee.analysis.isotropy import pairwise_cosine_stats


def test_known_values():
    x = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    cos = [0.0, 1 / np.sqrt(2), 1 / np.sqrt(2)]  # (0,1), (0,2), (1,2)
    got = pairwise_cosine_stats(x)
    assert got["pairs"] == 3
    assert got["mean"] == pytest.approx(np.mean(cos), abs=1e-12)
    assert got["std"] == pytest.approx(np.std(cos), abs=1e-12)


def test_a_cone_and_an_isotropic_cloud():
    rng = np.random.default_rng(0)
    iso = rng.standard_normal((300, 64))
    assert abs(pairwise_cosine_stats(iso)["mean"]) < 0.01
    assert pairwise_cosine_stats(iso + 5.0)["mean"] > 0.9  # a shared offset: a narrow cone
    assert pairwise_cosine_stats(np.ones((4, 3)))["mean"] == pytest.approx(1.0)
    assert pairwise_cosine_stats(np.ones((4, 3)))["std"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("bad", [np.ones((1, 3)), np.ones(3), np.array([[1.0, 0.0], [0.0, 0.0]])])
def test_bad_input_is_refused(bad):
    with pytest.raises(ValueError):
        pairwise_cosine_stats(bad)
