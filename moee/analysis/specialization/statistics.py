"""The shared statistics of the specialization report: its heavy streaming state and the math
several sections use.

``_TokenTables`` (expert counts per token type) and ``_RouteSample`` (the bounded route sample
behind the permutation baselines) are held once by the accumulator
(:mod:`moee.analysis.specialization.accumulator`) and read by every section that needs them;
the permutation helpers draw the baselines from the sample. What only one section computes lives
in that section's module (:mod:`moee.analysis.specialization.sections`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["BASELINE_SAMPLE_BYTES", "TOKEN_KEYS", "TOKEN_TABLE_BYTES"]

#: The three tokens a route can be attributed to (token specialization), with what each means.
TOKEN_KEYS = {
    "input": "the input token at the position",
    "next": "the ground-truth next token (position i + 1; the last position of a text has none)",
    "predicted": "the model's predicted next token (argmax of its LM logits at the position)",
}


#: Default bound on the memory of the per-token-type tables, all ``TOKEN_KEYS`` together (bytes).
TOKEN_TABLE_BYTES = 1 << 30


class _TokenTables:
    """Expert counts ``N(t, layer, expert)`` and occurrences ``N_t`` per token type t, one dense
    table ``[types, L, E]`` per key of ``keys``, over at most ``max_types`` token types.

    A type gets its row when first seen (by id within a text), so memory is set by the model
    (its vocabulary x layers x experts, capped at ``max_types`` rows), never by the corpus
    length. Tokens of types seen after the rows ran out are counted in ``untracked``, their
    routes left out of the tables. ``capacity`` rows are allocated and written at once (the whole
    vocabulary when it is known: the memory is taken, and any shortage shows, at the start, not
    hours into a corpus); without it the tables double as types arrive, up to ``max_types``.
    """

    def __init__(self, n_layers: int, n_experts: int, keys, max_types: int, capacity: int):
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.max_types = int(max_types)
        capacity = max(1, min(int(capacity), self.max_types))
        self.n_types = 0
        self._sorted_ids = np.zeros(0, dtype=np.int64)  # every tracked token id, ascending
        self._sorted_rows = np.zeros(0, dtype=np.int64)  # the row of each of them
        self.type_ids = np.zeros(capacity, dtype=np.int64)  # the token id of each row
        self.counts = {key: np.full((capacity, n_layers, n_experts), 0, dtype=np.int32) for key in keys}
        self.occurrences = {key: np.zeros(capacity, dtype=np.int64) for key in keys}
        self.tokens = dict.fromkeys(keys, 0)
        self.untracked = dict.fromkeys(keys, 0)

    def _grow(self, needed: int) -> None:
        capacity = self.type_ids.size
        if needed <= capacity:
            return
        capacity = min(self.max_types, max(needed, 2 * capacity))
        extra = capacity - self.type_ids.size
        self.type_ids = np.concatenate([self.type_ids, np.zeros(extra, dtype=np.int64)])
        for key, table in self.counts.items():
            self.counts[key] = np.concatenate([table, np.zeros((extra, *table.shape[1:]), dtype=table.dtype)])
            self.occurrences[key] = np.concatenate([self.occurrences[key], np.zeros(extra, dtype=np.int64)])

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """The row of every token (``-1`` for a type left untracked), giving new types rows."""
        ids = self._sorted_ids
        new = np.unique(tokens)
        if ids.size:
            new = new[ids[np.minimum(np.searchsorted(ids, new), ids.size - 1)] != new]
        new = new[: self.max_types - self.n_types]
        if new.size:
            self._grow(self.n_types + new.size)
            new_rows = np.arange(self.n_types, self.n_types + new.size)
            self.type_ids[new_rows] = new
            self.n_types += new.size
            where = np.searchsorted(ids, new)
            self._sorted_ids = np.insert(ids, where, new)
            self._sorted_rows = np.insert(self._sorted_rows, where, new_rows)
            ids = self._sorted_ids
        at = np.minimum(np.searchsorted(ids, tokens), ids.size - 1)
        return np.where(ids[at] == tokens, self._sorted_rows[at], -1)

    def add(self, key: str, tokens: np.ndarray, routes: np.ndarray) -> None:
        """Count ``tokens [n]`` with their selected experts ``routes [n, L, k]`` under ``key``."""
        L, E = self.n_layers, self.n_experts
        self.tokens[key] += int(tokens.size)
        rows = self.rows(tokens)
        tracked = rows >= 0
        self.untracked[key] += int(tokens.size - tracked.sum())
        rows, routes = rows[tracked], routes[tracked]
        table = self.counts[key]
        if self.tokens[key] > np.iinfo(table.dtype).max:  # a count could overflow: widen once
            table = self.counts[key] = table.astype(np.int64)
        np.add.at(self.occurrences[key], rows, 1)
        flat = (rows[:, None, None] * L + np.arange(L)[None, :, None]) * E + routes
        np.add.at(table.reshape(-1), flat.ravel(), 1)

    def _rows_by_id(self, key: str, min_count: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the types of ``key`` seen at least ``min_count`` times (at least once), in
        ascending token id, and their occurrences."""
        n = self.n_types
        order = np.argsort(self.type_ids[:n], kind="stable")
        occ = self.occurrences[key][order]
        keep = occ >= max(1, int(min_count))
        return order[keep], occ[keep]

    def counted_ids(self, key: str, min_count: int = 1) -> np.ndarray:
        """The token ids (ascending) of the types of ``key`` seen at least ``min_count`` times:
        the tokens a statistic over ``view(key, min_count)`` counts, and so the only ones its
        permutation baseline may draw routes from."""
        return self.type_ids[self._rows_by_id(key, min_count)[0]]

    def sizes(self, key: str, min_count: int = 1) -> np.ndarray:
        """``N_t`` of ``view`` alone, without copying the counts."""
        return self._rows_by_id(key, min_count)[1]

    def view(self, key: str, min_count: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(token ids, N_t, counts [G, L, E])`` of the types of ``key`` seen at least
        ``min_count`` times (at least once), in ascending token id."""
        order, occ = self._rows_by_id(key, min_count)
        return self.type_ids[order], occ, self.counts[key][order]


def _cv(v: np.ndarray) -> float:
    mean = float(np.mean(v))
    return float(np.std(v) / mean) if mean > 0 else 0.0


def _entropy(counts: np.ndarray) -> float:
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed pseudo-random uint64 for every uint64 key."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


#: Default bound on the memory of the route sample behind the permutation baselines (bytes).
BASELINE_SAMPLE_BYTES = 1 << 26


class _RouteSample:
    """A uniform sample of at most ``capacity`` token routes (top-k sets ``[L, k]``) for the
    permutation baselines, independent of the order in which texts arrive, each with the token it
    is attributed to under every ``TOKEN_KEYS`` key (``-1``: none), so a baseline can draw from
    the tokens its statistic counts only.

    Every token gets a fixed pseudo-random priority from (seed, text index, position) and the
    sample keeps the ``capacity`` smallest (bottom-k sampling), so memory is bounded and the same
    corpus gives the same sample in any chunking. A corpus with at most ``capacity`` tokens is
    held whole, which makes the baselines exact permutation tests.

    Tokens are written in place into buffers of ``capacity`` + a quarter rows, allocated once
    (zeroed lazily by the OS: a small corpus touches only the rows it fills), and compacting
    keeps the best ``capacity`` of them in the same buffers. They are never reallocated: a
    sample reallocated every few hundred texts lands each time at a new place of the C heap,
    between the forward's activations, and keeps pages of it from being handed back.
    """

    def __init__(self, capacity: int, n_layers: int, top_k: int, n_experts: int, seed: int):
        self.capacity = int(capacity)
        self.seed = int(seed)
        self.size = self.capacity + max(1, self.capacity // 4)  # the kept rows + room for new ones
        dtype = np.int16 if n_experts <= np.iinfo(np.int16).max else np.int32
        self.priority = np.zeros(self.size, dtype=np.uint64)
        self.text = np.zeros(self.size, dtype=np.int64)
        self.pos = np.zeros(self.size, dtype=np.int64)
        self.sel = np.zeros((self.size, n_layers, top_k), dtype=dtype)
        self.tok = np.full((self.size, len(TOKEN_KEYS)), -1, dtype=np.int64)
        self.n = 0  # rows filled
        self._threshold: np.uint64 | None = None  # largest priority kept once the sample is full

    def add(self, text_index: int, sel: np.ndarray, tokens: np.ndarray | None = None) -> None:
        """Offer one text's routes ``sel [T, L, k]`` and their tokens ``tokens [T, len(TOKEN_KEYS)]``
        (default: none, ``-1``)."""
        T = sel.shape[0]
        tok = np.full((T, len(TOKEN_KEYS)), -1, dtype=np.int64) if tokens is None else np.asarray(tokens)
        pos = np.arange(T, dtype=np.int64)
        with np.errstate(over="ignore"):
            salt = _mix64(
                np.uint64(text_index) ^ _mix64(np.uint64(self.seed) + np.uint64(0x9E3779B97F4A7C15))
            )
            priority = _mix64(salt + pos.astype(np.uint64))
        if self._threshold is not None:
            keep = priority < self._threshold
            if not keep.any():
                return
            priority, pos, sel, tok = priority[keep], pos[keep], sel[keep], tok[keep]
        done = 0
        while done < pos.size:
            if self.n == self.size:
                self.compact()
            take = min(pos.size - done, self.size - self.n)
            a, b = self.n, self.n + take
            self.priority[a:b] = priority[done : done + take]
            self.text[a:b] = text_index
            self.pos[a:b] = pos[done : done + take]
            self.sel[a:b] = sel[done : done + take]
            self.tok[a:b] = tok[done : done + take]
            self.n, done = b, done + take

    def compact(self) -> None:
        """Keep the ``capacity`` smallest priorities (in the buffers' front rows)."""
        if self.n > self.capacity:
            keep = np.argpartition(self.priority[: self.n], self.capacity - 1)[: self.capacity]
            for name in ("priority", "text", "pos", "sel", "tok"):
                buf = getattr(self, name)
                buf[: self.capacity] = buf[keep]
            self.n = self.capacity
        if self.n >= self.capacity:
            self._threshold = self.priority[: self.n].max()

    def _order(self) -> np.ndarray:
        self.compact()
        n = self.n
        return np.lexsort((self.pos[:n], self.text[:n]))

    def routes(self) -> np.ndarray:
        """The sampled top-k sets ``[R, L, k]`` in corpus order (text, position)."""
        return self.sel[: self.n][self._order()]

    def tokens(self) -> np.ndarray:
        """The sampled routes' tokens ``[R, len(TOKEN_KEYS)]`` (``-1``: none), in the order of
        ``routes``."""
        return self.tok[: self.n][self._order()]


def _group_blocks(ends: np.ndarray, max_groups: int, max_tokens: int) -> Iterator[tuple[int, int, int, int]]:
    """Blocks ``(g0, g1, t0, t1)`` of consecutive groups (token range ``[t0, t1)``) with at most
    ``max_groups`` groups and, unless one group alone is longer, ``max_tokens`` tokens."""
    g0, t0, G = 0, 0, ends.size
    while g0 < G:
        g1 = g0 + 1
        while g1 < G and g1 - g0 < max_groups and ends[g1] - t0 <= max_tokens:
            g1 += 1
        yield g0, g1, t0, int(ends[g1 - 1])
        g0, t0 = g1, int(ends[g1 - 1])


def _permuted_group_counts(
    sizes: np.ndarray, sample: np.ndarray, n_experts: int, rng: np.random.Generator
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Blocks ``(g0, g1, counts [g1 - g0, L, E])`` of the expert counts of each group when group
    g's ``sizes[g]`` tokens take routes drawn at random from ``sample [R, L, k]``: a random
    permutation of the sample split into the groups when they fit in it (an exact permutation
    test when the sample is the whole corpus), draws with replacement otherwise. Memory is
    bounded by the block sizes; every permutation statistic reduces these blocks."""
    sizes = np.asarray(sizes, dtype=np.int64)
    R, L, k = sample.shape
    E = n_experts
    total = int(sizes.sum())
    if total == 0 or R == 0:
        return
    perm = rng.permutation(R) if total <= R else None
    ends = np.cumsum(sizes)
    max_groups = max(1, (1 << 20) // (L * E))
    max_tokens = max(1, (1 << 21) // (L * k))
    layer_off = (np.arange(L) * E)[None, :, None]
    for g0, g1, t0, t1 in _group_blocks(ends, max_groups, max_tokens):
        counts = np.zeros((g1 - g0) * L * E, dtype=np.int64)
        for s0 in range(t0, t1, max_tokens):
            s1 = min(t1, s0 + max_tokens)
            idx = perm[s0:s1] if perm is not None else rng.integers(0, R, s1 - s0)
            group = np.searchsorted(ends, np.arange(s0, s1), side="right") - g0
            keys = (group[:, None, None] * (L * E) + layer_off + sample[idx]).ravel()
            counts += np.bincount(keys, minlength=counts.size)
        yield g0, g1, counts.reshape(g1 - g0, L, E)


def _permuted_group_max(
    sizes: np.ndarray, sample: np.ndarray, n_experts: int, rng: np.random.Generator
) -> np.ndarray:
    """``max_E`` of each group's expert counts ``[G, L]`` under ``_permuted_group_counts``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    out = np.zeros((sizes.size, sample.shape[1]), dtype=np.int64)
    for g0, g1, counts in _permuted_group_counts(sizes, sample, n_experts, rng):
        out[g0:g1] = counts.max(axis=2)
    return out


def _overlap(ref: np.ndarray, other: np.ndarray, ref_first: np.ndarray, other_first: np.ndarray) -> tuple:
    """Per layer: share of tokens with the same first choice, and mean ``|S_ref ∩ S_other| / k``
    over token selections ``[N, L, k]``; plus both statistics' exact expectation when the other's
    routes are shuffled against the tokens (products of the two marginals)."""
    N, L, k = ref.shape
    E = int(max(ref.max(), other.max())) + 1 if N else 1
    top1 = (ref_first == other_first).mean(axis=0)
    hit = (ref[:, :, :, None] == other[:, :, None, :]).any(axis=3).sum(axis=2)
    topk = hit.mean(axis=0) / k
    off = (np.arange(L) * E)[None, :, None]

    def marg(x):
        return np.bincount((x + off).ravel(), minlength=L * E).reshape(L, E) / N

    top1_null = (marg(ref_first[..., None]) * marg(other_first[..., None])).sum(axis=1)
    topk_null = (marg(ref) * marg(other)).sum(axis=1) / k
    return top1, topk, top1_null, topk_null


def _random_table(rows: np.ndarray, cols: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A contingency table with these margins, drawn as a uniformly random pairing of the row
    labels with the column labels (one side permuted against the other)."""
    remaining = np.asarray(cols, dtype=np.int64).copy()
    table = np.zeros((len(rows), remaining.size), dtype=np.int64)
    for i, r in enumerate(np.asarray(rows, dtype=np.int64)):
        if r > 0:
            table[i] = rng.multivariate_hypergeometric(remaining, int(r))
            remaining -= table[i]
    return table
