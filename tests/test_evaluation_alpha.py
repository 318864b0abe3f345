"""The label-free MoEE(sum) weight and the sensitivity curve (pure numerics, no model)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from moee.embed.methods import combine
from moee.evaluation.alpha import (
    ALPHA_GRID,
    alpha_sensitivity,
    choose_alpha,
    choose_alpha_from_similarities,
    pair_similarities,
    random_pairs,
)


def test_grid_is_symmetric_in_log_space_and_contains_one():
    assert 1.0 in ALPHA_GRID and min(ALPHA_GRID) == 1 / 16 and max(ALPHA_GRID) == 16
    assert np.allclose(np.log(ALPHA_GRID), -np.log(ALPHA_GRID[::-1]))


def test_random_pairs_are_distinct_and_ordered():
    pairs = random_pairs(500, 2000, seed=3)
    assert pairs.shape == (2000, 2)
    assert (pairs[:, 0] < pairs[:, 1]).all()
    assert len({tuple(p) for p in pairs.tolist()}) == 2000
    assert np.array_equal(pairs, random_pairs(500, 2000, seed=3))
    assert not np.array_equal(pairs, random_pairs(500, 2000, seed=4))


def test_random_pairs_all_pairs_when_few_texts():
    pairs = random_pairs(5, 2000)
    assert len(pairs) == 10
    with pytest.raises(ValueError, match="at least 2"):
        random_pairs(1, 10)


def test_pair_similarities_match_moee_sum_cosine():
    rng = np.random.default_rng(0)
    hs, rw = rng.normal(size=(20, 16)), rng.random(size=(20, 3, 4))
    left, right = np.arange(10), np.arange(10, 20)
    c_h, c_r = pair_similarities(hs, rw, left, right)
    for alpha in (0.25, 1.0, 3.0):
        emb = combine(hs, rw, "moee_sum", alpha=alpha)
        cos = np.einsum("ij,ij->i", emb[left], emb[right])
        assert np.allclose(cos, (c_h + alpha * c_r) / (1 + alpha), atol=1e-6)


def test_spread_rule_matches_standard_deviation_ratio():
    rng = np.random.default_rng(1)
    c_h, c_r = rng.normal(0, 0.2, 3000), rng.normal(0, 0.05, 3000)
    alpha, *_ = choose_alpha_from_similarities(c_h, c_r, rule="spread")
    assert alpha == pytest.approx(c_h.std() / c_r.std())


def test_spearman_rule_balances_the_two_components():
    """Independent components: the maximin alpha is where both contribute the same spread."""
    rng = np.random.default_rng(2)
    c_h, c_r = rng.normal(0, 0.3, 4000), rng.normal(0, 0.03, 4000)  # spread ratio 10
    alpha, rho_h, rho_r, spread = choose_alpha_from_similarities(c_h, c_r, rule="spearman")
    assert 10 / 1.5 < alpha < 10 * 1.5
    k = ALPHA_GRID.index(alpha)
    assert min(rho_h[k], rho_r[k]) == pytest.approx(max(np.minimum(rho_h, rho_r)))
    assert rho_h[0] > rho_h[-1] and rho_r[0] < rho_r[-1]  # monotone trade-off


def test_spearman_rule_ties_go_to_one_and_degenerate_components():
    x = np.linspace(-1, 1, 50)
    assert choose_alpha_from_similarities(x, 2 * x)[0] == 1.0  # identical rankings: every alpha ties
    assert choose_alpha_from_similarities(x, np.zeros_like(x))[0] == 0.0  # RW carries nothing
    assert choose_alpha_from_similarities(np.ones_like(x), x)[0] == max(ALPHA_GRID)  # HS carries nothing
    with pytest.raises(ValueError, match="unknown alpha rule"):
        choose_alpha_from_similarities(x, x, rule="labels")


def test_choose_alpha_is_reproducible():
    rng = np.random.default_rng(5)
    hs, rw = rng.normal(size=(300, 32)), rng.random(size=(300, 4, 8))
    a = choose_alpha(hs, rw, seed=0, n_pairs=500)
    b = choose_alpha(hs, rw, seed=0, n_pairs=500)
    assert a == b and a.n_pairs == 500 and a.n_texts == 300 and a.alpha in ALPHA_GRID
    assert len(a.rho_h) == len(a.grid) == len(ALPHA_GRID)
    assert set(a.to_dict()) >= {"alpha", "rule", "rho_h", "rho_r", "spread_alpha"}


def test_alpha_sensitivity_curve_and_its_ends():
    rng = np.random.default_rng(7)
    gold = rng.random(400)
    c_h = gold + rng.normal(0, 0.5, 400)
    c_r = gold + rng.normal(0, 0.2, 400)
    curve = alpha_sensitivity(c_h, c_r, gold)
    assert len(curve["spearman"]) == len(ALPHA_GRID)
    assert curve["hs_only"] == pytest.approx(100 * spearmanr(gold, c_h)[0])
    # the curve runs from near HS-only (small alpha) to near RW-only (large alpha)
    assert abs(curve["spearman"][0] - curve["hs_only"]) < abs(curve["spearman"][0] - curve["rw_only"])
    assert abs(curve["spearman"][-1] - curve["rw_only"]) < abs(curve["spearman"][-1] - curve["hs_only"])
    with pytest.raises(ValueError, match="same shape"):
        alpha_sensitivity(c_h, c_r[:-1], gold)


# Label columns of each mteb task family, as the offline tasks build them.
_LABEL_COLUMNS = ("label", "labels", "score")


def _poison_labels(task) -> int:
    """Replace every label / gold-score column by marker strings; return how many were replaced."""
    from datasets import Dataset

    replaced = 0
    for subset in task.dataset.values():
        for split, part in list(subset.items()):
            if not isinstance(part, Dataset):
                continue
            for col in _LABEL_COLUMNS:
                if col in part.column_names:
                    markers = [f"LABEL-LEAK-{i}" for i in range(len(part))]
                    part = part.remove_columns(col).add_column(col, markers)
                    replaced += 1
            subset[split] = part
    return replaced


@pytest.mark.parametrize(
    "name",
    [
        "lee_sts",
        "fortunes_classification",
        "fortunes_clustering",
        "bible_pair_classification",
        "bible_verse_retrieval",
    ],
)
def test_alpha_texts_never_read_a_label_or_score_column(name):
    """The label-free alpha sees only the texts: with every label and gold score replaced by marker
    strings (or removed), the texts the alpha rule is given are exactly the same, and contain no marker."""
    from moee.evaluation.runner import task_texts
    from moee.evaluation.tasks import offline_tasks

    (task,) = offline_tasks([name])
    task.load_data()
    before = task_texts(task)
    replaced = _poison_labels(task)
    assert replaced > 0 or name.endswith("retrieval")  # retrieval keeps its relevance judgements apart
    after = task_texts(task)
    assert after == before
    assert not any(t.startswith("LABEL-LEAK-") for t in after)
