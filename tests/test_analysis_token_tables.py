"""The specialization report's per-token-type tables: exact counts against a plain loop, the
row cap and its untracked tokens, growth without a vocabulary, overflow widening and blocked
reductions (numpy only: fast enough to mutation-test)."""

import numpy as np
import pytest

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator


def decode(ids):
    return " ".join(f"w{i}" for i in ids)


def _brute_counts(texts, L, E, key="input"):
    """``{token: [N_t, counts [L, E]]}`` by a plain loop over the texts ``(ids, selections)``."""
    out = {}
    for ids, sel in texts:
        pairs = zip(ids, sel) if key == "input" else zip(ids[1:], sel[:-1])
        for t, s in pairs:
            entry = out.setdefault(int(t), [0, np.zeros((L, E), dtype=np.int64)])
            entry[0] += 1
            for layer in range(L):
                entry[1][layer, s[layer]] += 1
    return out


def _random_texts(rng, n_texts, V, L, E, k):
    texts = []
    for _ in range(n_texts):
        T = int(rng.integers(1, 25))
        texts.append((rng.integers(0, V, T), np.argsort(rng.random((T, L, E)), axis=2)[..., :k]))
    return texts


@pytest.mark.parametrize("vocab_size", [None, 3000])
def test_token_tables_equal_a_plain_count_with_and_without_the_vocabulary(vocab_size):
    """More types than the first allocation (1024 rows): grown tables and whole-vocabulary tables
    both give every type's exact counts, in ascending token id."""
    L, E, k, V = 2, 5, 2, 3000
    texts = _random_texts(np.random.default_rng(1), 300, V, L, E, k)
    acc = SpecializationAccumulator(L, E, k, vocab_size=vocab_size)
    for i, (ids, sel) in enumerate(texts):
        acc.update(ids, np.full((ids.size, L, E), 1 / E), text_index=i, selected=sel)
    assert acc._types.n_types > 1024
    for key in ("input", "next"):
        want = _brute_counts(texts, L, E, key)
        ids, n_t, counts = acc.token_table(key)
        assert (ids.dtype, n_t.dtype, counts.dtype) == (np.int64, np.int64, np.int32)
        assert ids.tolist() == sorted(want)
        assert n_t.tolist() == [want[t][0] for t in sorted(want)]
        assert all(np.array_equal(c, want[t][1]) for t, c in zip(ids.tolist(), counts))
        ids3, n3, _ = acc.token_table(key, 3)
        assert ids3.tolist() == [t for t in sorted(want) if want[t][0] >= 3] and (n3 >= 3).all()
        assert acc._types.sizes(key, 3).tolist() == n3.tolist()  # the baselines' sizes
        assert acc._types.sizes(key).tolist() == n_t.tolist()
        assert acc._types.view(key)[0].tolist() == ids.tolist()  # default: every type seen


def test_token_tables_cap_counts_the_rest_as_untracked():
    """``max_token_types=3``: the first three types seen (by id inside a text) get rows, every
    later type's tokens are untracked, and the tracked counts stay exact."""
    L, E, k = 1, 3, 1
    ids_a, ids_b = np.array([5, 2, 5, 9, 2]), np.array([7, 2, 1, 1])
    sel_a, sel_b = np.array([[[0]], [[1]], [[0]], [[2]], [[1]]]), np.array([[[2]], [[1]], [[0]], [[0]]])
    acc = SpecializationAccumulator(L, E, k, max_token_types=3, draws=BaselineDraws(permutations=1))
    for i, (ids, sel) in enumerate([(ids_a, sel_a), (ids_b, sel_b), (np.array([4]), np.array([[[0]]]))]):
        acc.update(ids, np.full((ids.size, L, E), 1 / E), text_index=i, selected=sel)
    ids, n_t, counts = acc.token_table("input")
    assert ids.tolist() == [2, 5, 9] and n_t.tolist() == [3, 2, 1]
    assert counts[:, 0].tolist() == [[0, 3, 0], [2, 0, 0], [0, 0, 1]]
    ts = acc.result(decode, min_token_count=1)["token_specialization"]
    assert ts["n_token_types"] == 3 and ts["max_token_types"] == 3
    assert ts["by_key"]["input"]["untracked_tokens"] == 4  # 7, 1, 1, then 4 in a third text
    assert ts["by_key"]["input"]["n_tokens"] == 10
    assert ts["by_key"]["next"]["untracked_tokens"] == 2  # the next tokens 1, 1 (7 ends no text)
    with pytest.raises(ValueError, match="max_token_types"):
        SpecializationAccumulator(L, E, k, max_token_types=0)
    with pytest.raises(ValueError, match="vocab_size"):
        SpecializationAccumulator(L, E, k, vocab_size=-1)


def test_token_table_widens_before_a_count_could_overflow():
    """A table whose dtype could overflow is widened to int64 before the count that would, and not
    before: 127 tokens fit int8, the 128th widens it."""
    acc = SpecializationAccumulator(1, 2, 1, vocab_size=4)
    tables = acc._types
    tables.counts["input"] = tables.counts["input"].astype(np.int8)
    route = np.array([[[0.9, 0.1]]])
    acc.update(np.zeros(127, dtype=np.int64), np.tile(route, (127, 1, 1)), text_index=0)
    assert tables.counts["input"].dtype == np.int8
    acc.update(np.zeros(1, dtype=np.int64), route, text_index=1)
    assert tables.counts["input"].dtype == np.int64
    assert acc.token_table("input")[2][0, 0].tolist() == [128, 0]


def test_token_table_sizes_and_growth():
    """Rows: the vocabulary (capped by max_token_types) at once when it is known; else 1024 rows,
    doubled as types arrive, never past the cap; the default cap fills TOKEN_TABLE_BYTES."""
    from moee.analysis.specialization import TOKEN_KEYS, TOKEN_TABLE_BYTES

    L, E = 2, 4
    assert SpecializationAccumulator(L, E, 1, vocab_size=20)._types.type_ids.size == 20
    assert SpecializationAccumulator(L, E, 1, vocab_size=20, max_token_types=7)._types.type_ids.size == 7
    assert SpecializationAccumulator(L, E, 1, vocab_size=20)._types.max_types == 20
    default = SpecializationAccumulator(L, E, 1)._types
    assert default.max_types == TOKEN_TABLE_BYTES // (len(TOKEN_KEYS) * L * E * 4)
    assert default.type_ids.size == 1024 and default.counts["input"].shape == (1024, L, E)
    assert SpecializationAccumulator(L, E, 1, max_token_types=5)._types.type_ids.size == 5

    def fed(n_types, **kw):
        acc = SpecializationAccumulator(L, E, 1, **kw)
        ids = np.arange(n_types)
        acc.update(ids, np.full((n_types, L, E), 1 / E), text_index=0)
        return acc._types

    assert fed(1024).type_ids.size == 1024  # exactly full: no growth
    assert fed(1025).type_ids.size == 2048
    assert SpecializationAccumulator(L, E, 1, max_token_types=1)._types.type_ids.size == 1
    assert fed(3000).type_ids.size == 3000  # more than twice the rows at once: exactly what is needed
    capped = fed(1200, max_token_types=1100)
    assert capped.type_ids.size == 1100 and capped.n_types == 1100
    assert capped.untracked == {"input": 100, "next": 100, "predicted": 0}
    assert all(t.shape[0] == 1100 for t in capped.counts.values())
    assert all(o.size == 1100 for o in capped.occurrences.values())
    assert capped.type_ids[:1100].tolist() == list(range(1100))  # the first types by id


def test_observed_token_statistics_do_not_depend_on_the_row_block(monkeypatch):
    """The observed token specialization is reduced in blocks of token types: any block size gives
    the same numbers."""
    from moee.analysis.specialization.sections import token_specialization

    L, E, k = 2, 4, 1
    texts = _random_texts(np.random.default_rng(2), 60, 40, L, E, k)

    def run():
        acc = SpecializationAccumulator(L, E, k, draws=BaselineDraws(permutations=1))
        for i, (ids, sel) in enumerate(texts):
            acc.update(ids, np.full((ids.size, L, E), 1 / E), text_index=i, selected=sel)
        return acc.result(decode, min_token_count=2)["token_specialization"]

    whole = run()
    monkeypatch.setattr(token_specialization, "_ROW_BLOCK", 3)
    assert run() == whole
