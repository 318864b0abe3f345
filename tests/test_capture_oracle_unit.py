"""The oracle's selection check alone, model-free: fast enough to be the test file of a mutation run
(``bash scripts/mutation.sh moee/capture/oracle.py``, docs/mutation.md)."""

import torch


def test_a_different_top_k_passes_the_oracle_only_as_a_tie_within_the_rounding():
    """In bf16 a block may break a tie its own way (DeepSeekMoE-16B at real size: 99.8% of tokens
    agree, the rest are ties); a set with a lower score than the top-k is still a failure."""
    from moee.capture.oracle import selection_agreement

    scores = torch.tensor([[0.50, 0.30, 0.30, 0.10], [0.50, 0.30, 0.30, 0.10], [0.50, 0.30, 0.29, 0.10]])
    index = torch.tensor([[0, 1], [2, 0], [0, 2]])  # the top-k; a tie broken the other way; a lower one
    same, tie = selection_agreement(scores, index, rel_tol=1 / 64)
    assert same.tolist() == [True, True, False] or same.tolist() == [True, False, False]
    assert (same | tie).tolist()[:2] == [True, True]
    strict_same, strict_tie = selection_agreement(scores, index, rel_tol=0.0)
    assert not bool(strict_same[2] or strict_tie[2])  # 0.29 vs 0.30 is a different choice at no tolerance
    _, loose_tie = selection_agreement(scores, index, rel_tol=0.05)
    assert bool(loose_tie[2])  # and a tie once the tolerance covers 0.01 of 0.5
    _, tight_tie = selection_agreement(scores, index, rel_tol=1 / 64)
    assert not bool(tight_tie[2])  # 0.01 > 0.5 / 64: not a tie at bf16's tolerance


def test_the_tie_tolerance_is_per_token_and_includes_its_bound():
    """The tolerance scales with each token's own largest score (a small-scored token is not judged by
    another token's scale), and a gap exactly at the tolerance is still a tie."""
    from moee.capture.oracle import selection_agreement

    scores = torch.tensor([[1.0, 0.5, 0.25, 0.0], [0.1, 0.05, 0.02, 0.0]])
    index = torch.tensor([[0, 2], [2, 0]])  # each row: its second-best swapped for its third
    same, tie = selection_agreement(scores, index, rel_tol=0.25)
    assert same.tolist() == [False, False]
    assert tie.tolist() == [True, False]  # row 0: gap 0.25 == 0.25 * 1.0; row 1: gap 0.03 > 0.25 * 0.1
