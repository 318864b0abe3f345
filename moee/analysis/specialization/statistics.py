"""Streaming routing statistics of the specialization report and their permutation baselines.

``SpecializationAccumulator`` folds token routes in one text at a time into fixed-size arrays
(memory independent of the corpus length) and turns them into every report section except
``meta``; the baselines recompute each statistic with the routes shuffled against what it
relates them to. Layer agreement uses the contingency-table NMI and Hungarian matching of
``moee.analysis.overlap``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from moee.analysis.overlap import matched_from_table as _matched_from_table
from moee.analysis.overlap import nmi_from_table as _nmi_from_table

__all__ = ["SpecializationAccumulator", "BASELINE_SAMPLE_BYTES", "TOKEN_KEYS", "TOKEN_TABLE_BYTES"]

#: The three tokens a route can be attributed to (token specialization), with what each means.
TOKEN_KEYS = {
    "input": "the input token at the position",
    "next": "the ground-truth next token (position i + 1; the last position of a text has none)",
    "predicted": "the model's predicted next token (argmax of its LM logits at the position)",
}

#: Experts shown in the co-activation heatmaps (the most loaded ones of each layer).
HEATMAP_EXPERTS = 16


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


class _RouteSample:
    """A uniform sample of at most ``capacity`` token routes (top-k sets ``[L, k]``) for the
    permutation baselines, independent of the order in which texts arrive.

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
        self.n = 0  # rows filled
        self._threshold: np.uint64 | None = None  # largest priority kept once the sample is full

    def add(self, text_index: int, sel: np.ndarray) -> None:
        T = sel.shape[0]
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
            priority, pos, sel = priority[keep], pos[keep], sel[keep]
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
            self.n, done = b, done + take

    def compact(self) -> None:
        """Keep the ``capacity`` smallest priorities (in the buffers' front rows)."""
        if self.n > self.capacity:
            keep = np.argpartition(self.priority[: self.n], self.capacity - 1)[: self.capacity]
            for name in ("priority", "text", "pos", "sel"):
                buf = getattr(self, name)
                buf[: self.capacity] = buf[keep]
            self.n = self.capacity
        if self.n >= self.capacity:
            self._threshold = self.priority[: self.n].max()

    def routes(self) -> np.ndarray:
        """The sampled top-k sets ``[R, L, k]`` in corpus order (text, position)."""
        self.compact()
        n = self.n
        return self.sel[:n][np.lexsort((self.pos[:n], self.text[:n]))]


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


def _token_specialization_stats(
    groups: Iterator[tuple[int, int, np.ndarray]], sizes: np.ndarray, n_top: int
) -> tuple[np.ndarray, np.ndarray]:
    """From blocks of per-token-type expert counts ``[g, L, E]`` (types of ``sizes`` occurrences):
    the token-weighted mean of ``max_E N(t, E) / N_t`` per layer ``[L]`` and each expert's
    specialization (mean of its ``n_top`` highest ``N(t, E) / N_t``) ``[L, E]``."""
    weighted, best = None, None
    for g0, g1, counts in groups:
        frac = counts / sizes[g0:g1, None, None]
        w = (frac.max(axis=2) * sizes[g0:g1, None]).sum(axis=0)
        m = min(n_top, frac.shape[0])
        top = -np.partition(-frac, m - 1, axis=0)[:m]
        if best is None:
            weighted, best = w, top
        else:
            weighted = weighted + w
            both = np.concatenate([best, top], axis=0)
            m = min(n_top, both.shape[0])
            best = -np.partition(-both, m - 1, axis=0)[:m]
    if best is None:
        raise ValueError("no token types to count")
    return weighted / sizes.sum(), best.sum(axis=0) / n_top


def _generalized_jsd(dists: np.ndarray, weights: np.ndarray) -> float:
    """Jensen-Shannon divergence of distributions ``dists [D, E]`` (rows sum to 1) with mixture
    weights ``weights [D]``: ``H(sum_d w_d p_d) - sum_d w_d H(p_d)`` (nats; 0 iff all equal)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    mix = (w[:, None] * dists).sum(axis=0)
    return float(max(0.0, _entropy(mix) - sum(wd * _entropy(p) for wd, p in zip(w, dists))))


def _set_joint(sel_a: np.ndarray, sel_b: np.ndarray, n_experts: int) -> np.ndarray:
    """``C[a, b]``: tokens whose set ``sel_a [N, k]`` holds a and whose ``sel_b [N, k]`` holds b."""
    E = n_experts
    sel_a, sel_b = np.asarray(sel_a, dtype=np.int64), np.asarray(sel_b, dtype=np.int64)
    keys = (sel_a[:, :, None] * E + sel_b[:, None, :]).ravel()
    return np.bincount(keys, minlength=E * E).reshape(E, E)


def _transition_stats(joint: np.ndarray, n_tokens: int, k: int, min_expected: float = 5.0) -> dict:
    """Excess of a cross-layer joint ``C [E, E]`` over independence ``X = load_a load_b / N``
    (the exact expectation with one layer's routes shuffled against the other's): the total
    variation ``sum |C - X| / (2 N k^2)`` and the lift ``C / X`` of pairs with ``X >= min_expected``."""
    C = joint.astype(np.float64)
    X = np.outer(C.sum(axis=1), C.sum(axis=0)) / (n_tokens * k * k) if n_tokens else np.zeros_like(C)
    excess = float(np.abs(C - X).sum() / (2 * n_tokens * k * k)) if n_tokens else 0.0
    ok = X >= min_expected
    lift = np.divide(C, X, out=np.zeros_like(C), where=X > 0)
    return {
        "excess": excess,
        "lift": lift,
        "expected": X,
        "max_lift": float(lift[ok].max()) if ok.any() else None,
    }


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


#: Token types per block when the observed token statistics are reduced (bounds their temporaries).
_ROW_BLOCK = 4096

#: Default bound on the memory of the route sample behind the permutation baselines (bytes).
BASELINE_SAMPLE_BYTES = 1 << 26


class SpecializationAccumulator:
    """Streams token routes ``probs [T, L, E]`` into bounded-memory routing statistics.

    ``permutations`` and ``seed`` set the permutation baselines; ``baseline_sample`` bounds the
    number of token routes kept for them (default: as many as fit in ``BASELINE_SAMPLE_BYTES``).
    ``vocab_size`` (the model's, when known) sizes the per-token-type tables at once;
    ``max_token_types`` caps their rows (default: every type of the vocabulary, at most as many
    as fit in ``TOKEN_TABLE_BYTES``); types seen beyond the cap are reported as untracked.
    """

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        top_k: int,
        *,
        n_contexts: int = 5,
        context_window: int = 6,
        permutations: int = 10,
        seed: int = 0,
        baseline_sample: int | None = None,
        vocab_size: int | None = None,
        max_token_types: int | None = None,
    ):
        for name, value in (
            ("n_layers", n_layers),
            ("n_experts", n_experts),
            ("top_k", top_k),
            ("vocab_size", 1 if vocab_size is None else vocab_size),
            ("max_token_types", 1 if max_token_types is None else max_token_types),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > n_experts:
            raise ValueError(f"top_k={top_k} exceeds n_experts={n_experts}")
        if n_contexts < 1 or context_window < 0:
            raise ValueError("n_contexts must be >= 1 and context_window >= 0")
        if (
            isinstance(permutations, bool)
            or not isinstance(permutations, (int, np.integer))
            or permutations < 1
        ):
            raise ValueError(f"permutations must be a positive int, got {permutations!r}")
        L, E = int(n_layers), int(n_experts)
        if baseline_sample is None:
            baseline_sample = max(1024, min(1 << 18, BASELINE_SAMPLE_BYTES // (2 * L * int(top_k))))
        if (
            isinstance(baseline_sample, bool)
            or not isinstance(baseline_sample, (int, np.integer))
            or baseline_sample < 1
        ):
            raise ValueError(f"baseline_sample must be a positive int, got {baseline_sample!r}")
        self.permutations, self.seed = int(permutations), int(seed)
        self._sample = _RouteSample(int(baseline_sample), L, int(top_k), E, int(seed))
        self.n_layers, self.n_experts, self.top_k = L, E, int(top_k)
        self.n_contexts, self.context_window = int(n_contexts), int(context_window)
        self.n_texts = 0
        self.n_tokens = 0
        self.last_selection: np.ndarray | None = None
        self.last_first: np.ndarray | None = None
        self.n_adjacent = 0
        self.importance = np.zeros((L, E))
        self.load = np.zeros((L, E), dtype=np.int64)
        self.first = np.zeros((L, E), dtype=np.int64)
        self.entropy_sum = np.zeros(L)
        self.coactivation = np.zeros((L, E, E), dtype=np.int64)
        self.repeats = np.zeros(L, dtype=np.int64)
        self.layer_joint = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)
        self.domain_tokens: dict[str, int] = {}
        self.domain_load: dict[str, np.ndarray] = {}
        self.selection_entropy_sum = np.zeros(L)
        self.set_joint = np.zeros((max(L - 1, 0), E, E), dtype=np.int64)
        if max_token_types is None:
            max_token_types = max(1, TOKEN_TABLE_BYTES // (len(TOKEN_KEYS) * L * E * 4))
            if vocab_size is not None:
                max_token_types = min(max_token_types, int(vocab_size))
        self._types = _TokenTables(
            L,
            E,
            TOKEN_KEYS,
            int(max_token_types),
            capacity=int(max_token_types) if vocab_size is not None else 1024,
        )
        width = 2 * self.context_window + 1
        self.best_prob = np.full((self.n_contexts, L, E), -np.inf)
        self.best_text = np.full((self.n_contexts, L, E), -1, dtype=np.int64)
        self.best_pos = np.full((self.n_contexts, L, E), -1, dtype=np.int64)
        self.best_ctx = np.full((self.n_contexts, L, E, width), -1, dtype=np.int64)

    def update(
        self,
        input_ids: np.ndarray,
        probs: np.ndarray,
        *,
        text_index: int,
        domain: str | None = None,
        selection: np.ndarray | None = None,
        selected: np.ndarray | None = None,
        predicted: np.ndarray | None = None,
    ) -> None:
        """Fold one text's routes in: ``input_ids [T]`` and dense router probabilities ``probs [T, L, E]``.

        ``predicted [T]``: the model's argmax next token at each position (from the same forward's
        LM logits), for the token specialization by predicted next token; without it that key
        stays empty.

        ``selected [T, L, k]`` are the expert indices the router itself chose (its own top k, group
        limits and biases included); without them the top k is re-derived by ranking
        ``selection [T, L, E]``, the scores the router ranks when they differ from ``probs`` (a
        selection-only bias, DeepSeek-V3 style), default ``probs``. The first choice is the
        selected expert with the highest router probability (the largest routing weight: softmax
        and sigmoid weights both rise with the logit). ``last_selection`` keeps the experts
        counted for this text (what the report counts, for checks).
        """
        ids = np.asarray(input_ids, dtype=np.int64).ravel()
        p = np.asarray(probs, dtype=np.float64)
        L, E = self.n_layers, self.n_experts
        if p.ndim != 3 or p.shape[1:] != (L, E):
            raise ValueError(f"probs must be [T, {L}, {E}], got shape {p.shape}")
        rank = p if selection is None else np.asarray(selection, dtype=np.float64)
        if rank.shape != p.shape:
            raise ValueError(f"selection must have the shape of probs {p.shape}, got {rank.shape}")
        if p.shape[0] != ids.size:
            raise ValueError(f"input_ids has {ids.size} tokens but probs has {p.shape[0]}")
        if ids.size and ids.min() < 0:
            raise ValueError("input_ids must be non-negative token ids")
        if predicted is not None:
            predicted = np.asarray(predicted, dtype=np.int64).ravel()
            if predicted.size != ids.size or (predicted.size and predicted.min() < 0):
                raise ValueError(
                    f"predicted must hold {ids.size} non-negative token ids, got {predicted.size}"
                )
        if not np.isfinite(p).all():
            raise ValueError(f"text {text_index}: router probabilities contain NaN or inf")
        T = p.shape[0]
        sel = self.selection(p, rank, selected)
        self.n_texts += 1
        if T == 0:
            return
        self.n_tokens += T
        self.last_selection = np.asarray(sel)
        first = self.first_choices(p, sel)  # [T, L]
        self.last_first = first
        layer_off = (np.arange(L) * E)[None, :, None]
        flat = (sel + layer_off).ravel()
        counts = np.bincount(flat, minlength=L * E).reshape(L, E)
        self.load += counts
        self.first += np.bincount((first + layer_off[..., 0]).ravel(), minlength=L * E).reshape(L, E)
        self.importance += p.sum(0)
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(p > 0, p * np.log(p), 0.0)
            self.entropy_sum += -plogp.sum(axis=(0, 2))
            w = np.take_along_axis(p, np.asarray(sel), axis=2)
            w = w / w.sum(axis=2, keepdims=True)
            self.selection_entropy_sum += -np.where(w > 0, w * np.log(w), 0.0).sum(axis=(0, 2))
        mask = np.zeros((T, L, E), dtype=np.float32)
        np.put_along_axis(mask, np.asarray(sel), 1.0, axis=2)
        per_layer = mask.transpose(1, 2, 0)  # [L, E, T]
        self.coactivation += np.rint(per_layer @ per_layer.transpose(0, 2, 1)).astype(np.int64)
        if L > 1:
            self.set_joint += np.rint(per_layer[:-1] @ per_layer[1:].transpose(0, 2, 1)).astype(np.int64)
        if T > 1:
            self.repeats += (first[1:] == first[:-1]).sum(0)
            self.n_adjacent += T - 1
        if L > 1:
            pair_off = (np.arange(L - 1) * E * E)[None, :]
            keys = pair_off + first[:, :-1] * E + first[:, 1:]
            self.layer_joint += np.bincount(keys.ravel(), minlength=(L - 1) * E * E).reshape(L - 1, E, E)
        if domain is not None:
            self.domain_tokens[domain] = self.domain_tokens.get(domain, 0) + T
            if domain not in self.domain_load:
                self.domain_load[domain] = np.zeros((L, E), dtype=np.int64)
            self.domain_load[domain] += counts
        for key, (tokens, routes) in (
            ("input", (ids, sel)),
            ("next", (ids[1:], sel[:-1])),
            ("predicted", (predicted, sel)),
        ):
            if tokens is not None and tokens.size:
                self._types.add(key, tokens, routes)
        self._sample.add(text_index, np.asarray(sel))
        self._update_contexts(ids, p, text_index)

    def selection(
        self, probs: np.ndarray, rank: np.ndarray, selected: np.ndarray | None = None
    ) -> np.ndarray:
        """The experts counted per token ``[T, L, k]``: ``selected`` (checked) when the router gave
        its own choice, else the top k of ``rank [T, L, E]`` (order inside the top k is irrelevant)."""
        L, E, k = self.n_layers, self.n_experts, self.top_k
        T = probs.shape[0]
        if selected is not None:
            return self._check_selected(selected, T)
        if k < E:
            return np.argpartition(-rank, k - 1, axis=2)[..., :k]
        return np.broadcast_to(np.arange(E), (T, L, E))

    def _check_selected(self, selected: np.ndarray, T: int) -> np.ndarray:
        L, E, k = self.n_layers, self.n_experts, self.top_k
        sel = np.asarray(selected)
        if sel.shape != (T, L, k):
            raise ValueError(
                f"selected must be [T, L, k] = [{T}, {L}, {k}] expert indices, got shape {sel.shape}"
            )
        if sel.size and not np.issubdtype(sel.dtype, np.integer):
            raise ValueError(f"selected must hold integer expert indices, got dtype {sel.dtype}")
        sel = sel.astype(np.int64)
        if sel.size and (sel.min() < 0 or sel.max() >= E):
            raise ValueError(f"selected holds expert indices outside [0, {E})")
        if k > 1 and sel.size and (np.diff(np.sort(sel, axis=2), axis=2) == 0).any():
            raise ValueError("selected lists the same expert twice for one token")
        return sel

    def _update_contexts(self, ids: np.ndarray, p: np.ndarray, text_index: int) -> None:
        M, W = self.n_contexts, self.context_window
        T = p.shape[0]
        if T > M:
            pos = np.argpartition(-p, M - 1, axis=0)[:M]  # [M, L, E]
        else:
            pos = np.broadcast_to(np.arange(T)[:, None, None], (T, self.n_layers, self.n_experts))
        cand_prob = np.take_along_axis(p, pos, axis=0)
        padded = np.concatenate([np.full(W, -1), ids, np.full(W, -1)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * W + 1)  # [T, 2W+1]
        cand_ctx = windows[pos]  # [m, L, E, 2W+1]
        all_prob = np.concatenate([self.best_prob, cand_prob], axis=0)
        all_text = np.concatenate(
            [self.best_text, np.full(cand_prob.shape, text_index, dtype=np.int64)], axis=0
        )
        all_pos = np.concatenate([self.best_pos, pos], axis=0)
        all_ctx = np.concatenate([self.best_ctx, cand_ctx], axis=0)
        # highest probability first; ties go to the earlier text and position, so the result
        # does not depend on the order in which texts arrive
        order = np.lexsort((all_pos, all_text, -all_prob), axis=0)[:M]
        self.best_prob = np.take_along_axis(all_prob, order, axis=0)
        self.best_text = np.take_along_axis(all_text, order, axis=0)
        self.best_pos = np.take_along_axis(all_pos, order, axis=0)
        self.best_ctx = np.take_along_axis(all_ctx, order[..., None], axis=0)

    def state_bytes(self) -> int:
        """Bytes of every array the accumulator holds: what streaming keeps in memory, set by the
        model (token tables, co-activation, contexts) and the baseline sample's capacity, so the
        same at any corpus length when the vocabulary size is known (but for the index of the token
        types seen, 16 bytes a type; without it the tables double as types arrive, up to their cap)."""
        tables, sample = self._types, self._sample
        arrays = [  # the last text's selections (kept for checks) depend on the arrival order
            v for k, v in vars(self).items() if isinstance(v, np.ndarray) and not k.startswith("last_")
        ]
        arrays += [*self.domain_load.values(), *tables.counts.values(), *tables.occurrences.values()]
        arrays += [tables.type_ids, tables._sorted_ids, tables._sorted_rows]
        arrays += [sample.priority, sample.text, sample.pos, sample.sel]
        return int(sum(a.nbytes for a in arrays))

    # ------------------------------------------------------------------ results
    def token_table(
        self, key: str = "input", min_token_count: int = 1
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(token ids, N_x, N_k(x, layer, E) [G, L, E])`` for the token types x of ``key``
        (``TOKEN_KEYS``: the input, next or predicted token) seen at least ``min_token_count``
        times, in ascending token id."""
        return self._types.view(key, min_token_count)

    def first_choices(self, probs: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """The first choice ``[T, L]``: the selected expert with the highest router probability."""
        best = np.take_along_axis(probs, sel, axis=2).argmax(axis=2)
        return np.take_along_axis(sel, best[..., None], axis=2)[..., 0]

    def result(
        self,
        decode: Callable[[Sequence[int]], str] | None = None,
        *,
        n_top_tokens: int = 8,
        min_token_count: int = 5,
        n_coactivation_pairs: int = 10,
        n_specialization_tokens: int = 10,
        progress: bool = False,
    ) -> dict:
        """Every report section except ``meta``, ``saturation`` and ``token_view`` (the driver's,
        they need other models or the texts) as plain JSON-ready Python objects."""
        if self.n_tokens == 0:
            raise ValueError("no tokens were routed: the corpus is empty or every text tokenised to nothing")
        decode = decode or (lambda ids: " ".join(str(i) for i in ids))
        L, E, k, N = self.n_layers, self.n_experts, self.top_k, self.n_tokens
        mean_load = N * k / E
        entropy = self.entropy_sum / N
        layers = []
        for layer in range(L):
            layers.append(
                {
                    "layer": layer,
                    "cv_importance": _cv(self.importance[layer]),
                    "cv_load": _cv(self.load[layer]),
                    "max_over_mean_load": float(self.load[layer].max() / mean_load),
                    "min_over_mean_load": float(self.load[layer].min() / mean_load),
                    "dead_experts": int((self.load[layer] == 0).sum()),
                    "routing_entropy": float(entropy[layer]),
                    "routing_entropy_normalized": float(entropy[layer] / np.log(E)) if E > 1 else 0.0,
                    "load_entropy_normalized": _entropy(self.load[layer]) / np.log(E) if E > 1 else 0.0,
                    "load_fraction": (self.load[layer] / (N * k)).round(6).tolist(),
                    "importance_fraction": (self.importance[layer] / N).round(6).tolist(),
                }
            )
        experts = self._experts_section(decode, n_top_tokens, min_token_count)
        vocabulary = self._vocabulary_section(decode, min_token_count)
        base = self.baselines(min_token_count, n_specialization_tokens, progress=progress)
        for entry, value in zip(vocabulary["by_layer"], base["vocabulary"]):
            entry["baseline"] = value
        names = sorted(self.domain_tokens)
        domains = {"available": bool(self.domain_tokens), "names": names, "domains": {}}
        jsd = self._domain_jsd(np.stack([self.domain_load[d] for d in names])) if names else [None] * L
        domains["specialization_by_layer"] = [
            {"layer": layer, "jsd": j, "jsd_baseline": b}
            for layer, (j, b) in enumerate(zip(jsd, base["domain_jsd"]))
        ]
        for d, baseline in zip(names, base["domains"]):
            max_fraction = (self.domain_load[d] / self.domain_tokens[d]).max(axis=1)
            domains["domains"][d] = {
                "n_tokens": int(self.domain_tokens[d]),
                "fraction": (self.domain_load[d] / self.domain_tokens[d]).round(6).tolist(),
                "max_fraction_by_layer": max_fraction.round(6).tolist(),
                "baseline_by_layer": [round(b, 6) for b in baseline],
                "lift_over_baseline_by_layer": [
                    round(float(m / b), 4) if b > 0 else None for m, b in zip(max_fraction, baseline)
                ],
            }
        coact = self._coactivation_section(n_coactivation_pairs)
        token_specialization = self._token_specialization_section(
            decode, base["token_specialization"], min_token_count, n_specialization_tokens
        )
        repetition = {
            "n_adjacent_pairs": int(self.n_adjacent),
            "by_layer": [
                {
                    "layer": layer,
                    "rate": float(self.repeats[layer] / self.n_adjacent) if self.n_adjacent else 0.0,
                    "baseline": base["repetition"][layer],
                }
                for layer in range(L)
            ],
        }
        agreement = {
            "pairs": [
                {
                    "layers": [layer, layer + 1],
                    "nmi": _nmi_from_table(self.layer_joint[layer].astype(np.float64)),
                    "matched_agreement": _matched_from_table(self.layer_joint[layer]),
                    "nmi_baseline": nmi_b,
                    "matched_baseline": matched_b,
                }
                for layer, (nmi_b, matched_b) in enumerate(base["layer_agreement"])
            ],
        }
        summary = {
            "n_texts": int(self.n_texts),
            "n_tokens": int(N),
            "n_layers": L,
            "n_experts": E,
            "top_k": k,
            "mean_cv_importance": float(np.mean([x["cv_importance"] for x in layers])),
            "mean_cv_load": float(np.mean([x["cv_load"] for x in layers])),
            "max_over_mean_load": float(max(x["max_over_mean_load"] for x in layers)),
            "mean_routing_entropy_normalized": float(
                np.mean([x["routing_entropy_normalized"] for x in layers])
            ),
            "mean_repetition_rate": float(np.mean([r["rate"] for r in repetition["by_layer"]])),
        }
        return {
            "summary": summary,
            "baselines": base["method"],
            "layers": layers,
            "experts": experts,
            "domains": domains,
            "vocabulary": vocabulary,
            "coactivation": coact,
            "repetition": repetition,
            "layer_agreement": agreement,
            "token_specialization": token_specialization,
            "router_entropy": self._router_entropy_section(),
            "cross_layer": self._cross_layer_section(base["cross_layer"]),
        }

    def _token_specialization_section(self, decode, base: dict, min_count: int, n_top: int) -> dict:
        """Token specialization by each ``TOKEN_KEYS`` key (OLMoE paper, section 5): for expert e
        and token t, ``N(t, e) / N_t``, the fraction of t's occurrences routed to e; per expert the
        mean over its ``n_top`` most specialised types (missing ones count 0); per layer the
        token-weighted mean of ``max_e N(t, e) / N_t``."""
        L, E, k = self.n_layers, self.n_experts, self.top_k
        random = k / E
        by_key = {}
        for key, description in TOKEN_KEYS.items():
            entry = {
                "available": self._types.tokens[key] > 0,
                "reason": None,
                "description": description,
                "n_tokens": int(self._types.tokens[key]),
                "untracked_tokens": int(self._types.untracked[key]),
            }
            if not entry["available"]:
                entry["reason"] = (
                    "no LM logits were given (the model has no recognised LM head)"
                    if key == "predicted"
                    else "no positions to count"
                )
            ids, n_t, counts = self.token_table(key, min_count)
            blocks = ((g, g + _ROW_BLOCK, counts[g : g + _ROW_BLOCK]) for g in range(0, ids.size, _ROW_BLOCK))
            observed = _token_specialization_stats(blocks, n_t, n_top) if ids.size else None
            null = base.get(key)
            experts, layers = [], []
            for layer in range(L):
                row = []
                for e in range(E):
                    c = counts[:, layer, e]
                    hit = np.flatnonzero(c)
                    frac = c[hit] / np.maximum(n_t[hit], 1)
                    best = np.lexsort((-c[hit], -frac))[:n_top]  # most specialised, then most frequent
                    row.append(
                        {
                            "expert": e,
                            "specialization": float(observed[1][layer, e]) if observed else None,
                            "specialization_baseline": float(null[1][layer, e]) if null else None,
                            "top": [
                                {
                                    "token": decode([int(ids[hit[i]])]),
                                    "token_id": int(ids[hit[i]]),
                                    "fraction": round(float(frac[i]), 6),
                                    "count": int(c[hit[i]]),
                                    "n_t": int(n_t[hit[i]]),
                                }
                                for i in best
                            ],
                        }
                    )
                experts.append(row)
                layers.append(
                    {
                        "layer": layer,
                        "weighted_max_fraction": float(observed[0][layer]) if observed else None,
                        "weighted_max_fraction_baseline": float(null[0][layer]) if null else None,
                        "mean_expert_specialization": float(observed[1][layer].mean()) if observed else None,
                        "mean_expert_specialization_baseline": float(null[1][layer].mean()) if null else None,
                        "random_baseline": random,
                    }
                )
            by_key[key] = {**entry, "by_layer": layers, "experts": experts}
        return {
            "keys": list(TOKEN_KEYS),
            "min_token_count": int(min_count),
            "n_top": int(n_top),
            "random_baseline": random,
            "n_token_types": int(self._types.n_types),
            "max_token_types": int(self._types.max_types),
            "by_key": by_key,
        }

    def _router_entropy_section(self) -> dict:
        """Router entropy and KL to uniform, per layer: of the dense distribution (per token,
        averaged), of the selection (the dense distribution restricted to the k selected experts
        and renormalised), and of the marginals (load and mean dense distribution)."""
        L, E, k, N = self.n_layers, self.n_experts, self.top_k, self.n_tokens
        logE, logk = float(np.log(E)), float(np.log(k))
        layers = []
        for layer in range(L):
            dense = float(self.entropy_sum[layer] / N)
            sel = float(self.selection_entropy_sum[layer] / N)
            load_h = _entropy(self.load[layer].astype(np.float64))
            imp_h = _entropy(self.importance[layer])
            layers.append(
                {
                    "layer": layer,
                    "dense_entropy": dense,
                    "dense_entropy_normalized": dense / logE if E > 1 else 0.0,
                    "dense_kl_uniform": max(0.0, logE - dense),
                    "selection_entropy": sel,
                    "selection_entropy_normalized": sel / logk if k > 1 else 0.0,
                    "selection_kl_uniform": max(0.0, logk - sel),
                    "load_entropy": load_h,
                    "load_kl_uniform": max(0.0, logE - load_h),
                    "importance_entropy": imp_h,
                    "importance_kl_uniform": max(0.0, logE - imp_h),
                }
            )
        return {
            "by_layer": layers,
            "baseline": {
                "dense_entropy": logE,
                "dense_kl_uniform": 0.0,
                "selection_entropy": logk,
                "selection_kl_uniform": 0.0,
                "load_kl_uniform": 0.0,
                "description": "a uniform router (every expert 1/E): entropy log E, KL to uniform 0; "
                "selection: log k and 0 (equal weights on the k selected)",
            },
        }

    def _cross_layer_section(self, base: list, n_pairs: int = 10) -> dict:
        """Which expert of layer l+1 follows which of layer l, beyond chance: the joint of their
        top-k sets against independence (see ``_transition_stats``)."""
        L, N, k = self.n_layers, self.n_tokens, self.top_k
        pairs, matrices = [], {}
        show = sorted({0, (L - 1) // 2, L - 2}) if L > 1 else []
        for layer in range(L - 1):
            st = _transition_stats(self.set_joint[layer], N, k)
            lift, X, C = st["lift"], st["expected"], self.set_joint[layer]
            ranked = np.where(X >= 5.0, lift, -np.inf)
            flat = np.argsort(-ranked, axis=None, kind="stable")[:n_pairs]
            load_a = C.sum(axis=1) / k
            top = [
                {
                    "a": int(a),
                    "b": int(b),
                    "count": int(C[a, b]),
                    "expected": round(float(X[a, b]), 3),
                    "lift": round(float(lift[a, b]), 4),
                    "p_b_given_a": round(float(C[a, b] / load_a[a]), 6) if load_a[a] else 0.0,
                }
                for a, b in zip(*np.unravel_index(flat, lift.shape))
                if np.isfinite(ranked[a, b])
            ]
            pairs.append(
                {
                    "layers": [layer, layer + 1],
                    "excess": st["excess"],
                    "excess_baseline": base[layer][0],
                    "max_lift": st["max_lift"],
                    "max_lift_baseline": base[layer][1],
                    "top_pairs": top,
                }
            )
            if layer in show:
                matrices[str(layer)] = lift.round(3).tolist()
        return {"pairs": pairs, "heatmap_layers": show, "matrices": matrices}

    def baselines(self, min_token_count: int = 5, n_top: int = 10, *, progress: bool = False) -> dict:
        """Every statistic's value under the null "routing does not depend on X", computed the way
        the statistic is computed, by permutation (seeded, mean over ``permutations`` draws):

        * token specialization (per ``TOKEN_KEYS`` key; ``vocabulary`` is the input key's
          weighted max): routes shuffled against tokens: each token type seen at least
          ``min_token_count`` times takes as many random routes of the corpus (from the route
          sample) as it has occurrences; the token-weighted mean of ``max_E N_k(x, E) / N_x``
          and each expert's mean over its ``n_top`` most specialised types;
        * domains: routes shuffled against domain labels the same way (a domain takes ``N_D``
          random token routes): ``max_E N_k(E, D) / N_D`` per domain and the JSD of the domains'
          load distributions;
        * layer agreement: layer l+1's first choices shuffled against layer l's: a random table
          with the exact margins of the joint counts, then its NMI and matched agreement;
        * cross-layer pairs: layer l+1's top-k sets shuffled against layer l's within the route
          sample (exact when it holds the corpus; a smaller sample only raises the baseline);
        * repetition: first choices shuffled against positions; its expectation is exact,
          ``sum_E c_E (c_E - 1) / (N (N - 1))`` with ``c_E`` the first-choice counts.
        """
        L, E, N, k = self.n_layers, self.n_experts, self.n_tokens, self.top_k
        rng = np.random.default_rng(self.seed)
        sample = self._sample.routes()
        names = sorted(self.domain_tokens)
        dom_sizes = np.array([self.domain_tokens[d] for d in names], dtype=np.int64)
        P = self.permutations
        from tqdm.auto import tqdm

        bar = tqdm(total=P * (len(TOKEN_KEYS) + 1) + 2 * (L - 1), desc="baselines", disable=not progress)
        token_spec = {}
        for key in TOKEN_KEYS:
            sizes = self._types.sizes(key, min_token_count)
            if not sizes.size:
                token_spec[key] = None
                continue
            runs = []
            for _ in range(P):
                runs.append(
                    _token_specialization_stats(_permuted_group_counts(sizes, sample, E, rng), sizes, n_top)
                )
                bar.update(1)
            token_spec[key] = (
                np.mean([r[0] for r in runs], axis=0),
                np.mean([r[1] for r in runs], axis=0),
            )
        doms = np.zeros((P, dom_sizes.size, L))
        jsd = np.zeros((P, L))
        for i in range(P):
            if dom_sizes.size:
                counts = np.zeros((dom_sizes.size, L, E), dtype=np.int64)
                for g0, g1, c in _permuted_group_counts(dom_sizes, sample, E, rng):
                    counts[g0:g1] = c
                doms[i] = counts.max(axis=2) / dom_sizes[:, None]
                jsd[i] = self._domain_jsd(counts)
            bar.update(1)
        agreement = []
        for layer in range(L - 1):
            joint = self.layer_joint[layer]
            runs = [_random_table(joint.sum(1), joint.sum(0), rng) for _ in range(P)]
            agreement.append(
                (
                    float(np.mean([_nmi_from_table(t.astype(np.float64)) for t in runs])),
                    float(np.mean([_matched_from_table(t) for t in runs])),
                )
            )
            bar.update(1)
        R = sample.shape[0]
        cross = []
        for layer in range(L - 1):
            stats = [
                _transition_stats(
                    _set_joint(sample[:, layer], sample[rng.permutation(R), layer + 1], E), R, k
                )
                for _ in range(P)
            ]
            bar.update(1)
            lifts = [st["max_lift"] for st in stats if st["max_lift"] is not None]
            cross.append(
                (float(np.mean([st["excess"] for st in stats])), float(np.mean(lifts)) if lifts else None)
            )
        bar.close()
        c = self.first.astype(np.float64)
        repetition = ((c * (c - 1)).sum(axis=1) / (N * (N - 1))).tolist() if N > 1 else [0.0] * L
        vocab = token_spec["input"]
        return {
            "vocabulary": [float(v) for v in vocab[0]] if vocab is not None else [None] * L,
            "token_specialization": token_spec,
            "domains": doms.mean(axis=0).tolist(),
            "domain_jsd": jsd.mean(axis=0).tolist() if len(names) > 1 else [None] * L,
            "layer_agreement": agreement,
            "cross_layer": cross,
            "repetition": [float(r) for r in repetition],
            "method": {
                "kind": "permutation",
                "permutations": P,
                "seed": self.seed,
                "sampled_tokens": int(sample.shape[0]),
                "exact": bool(sample.shape[0] == N),
                "vocabulary": "routes shuffled against tokens (token types seen >= min_token_count times)",
                "token_specialization": "routes shuffled against the token of each key (input, next, "
                "predicted; types seen >= min_token_count times); random routing k/E beside it",
                "domains": "token routes shuffled against domain labels (max fraction and JSD)",
                "layer_agreement": "first choices of layer l+1 shuffled against layer l (exact margins)",
                "cross_layer": "top-k sets of layer l+1 shuffled against layer l's within the route sample",
                "repetition": "first choices shuffled against positions (exact expectation)",
                "coactivation": "none by permutation (shuffling routes keeps each token's set); "
                "reference (k-1)/(E-1) is uniform independent choice and (k-1) q_b / (1 - q_a) "
                "independent choice with the observed loads q",
                "saturation": "the checkpoint's routes shuffled against the tokens (exact "
                "expectation: product of the two marginals); random routing 1/E (top-1), k/E (top-k)",
            },
        }

    def _domain_jsd(self, counts: np.ndarray) -> list[float | None]:
        """Per layer, the JSD of the domains' load distributions ``counts [D, L, E]`` weighted by
        the domains' token shares (``None`` with fewer than two domains)."""
        D, L, _ = counts.shape
        if D < 2:
            return [None] * L
        sizes = counts.sum(axis=2)  # [D, L] = N_D * k
        return [
            _generalized_jsd(counts[:, layer] / sizes[:, layer, None], sizes[:, layer]) for layer in range(L)
        ]

    def _experts_section(self, decode, n_top: int, min_count: int) -> list[list[dict]]:
        L, E, W = self.n_layers, self.n_experts, self.context_window
        ids, n_x, counts = self.token_table("input")
        out: list[list[dict]] = []
        for layer in range(L):
            row = []
            for e in range(E):
                c = counts[:, layer, e]
                hit = np.flatnonzero(c)
                frequent = hit[np.argsort(-c[hit], kind="stable")[:n_top]]  # ties: lower token id
                top = [
                    {
                        "token": decode([int(ids[i])]),
                        "token_id": int(ids[i]),
                        "count": int(c[i]),
                        "share_of_token": float(c[i] / n_x[i]),
                    }
                    for i in frequent
                ]
                ok = hit[n_x[hit] >= min_count]
                ratio = c[ok] / n_x[ok]
                spec = [
                    {"token": decode([int(ids[ok[i]])]), "ratio": float(ratio[i]), "n_x": int(n_x[ok[i]])}
                    for i in np.lexsort((-c[ok], -ratio))[:n_top]  # highest ratio, then most frequent
                ]
                contexts = []
                for m in range(self.n_contexts):
                    if not np.isfinite(self.best_prob[m, layer, e]):
                        continue
                    ctx = self.best_ctx[m, layer, e]
                    left = [int(i) for i in ctx[:W] if i >= 0]
                    right = [int(i) for i in ctx[W + 1 :] if i >= 0]
                    contexts.append(
                        {
                            "prob": float(self.best_prob[m, layer, e]),
                            "text_index": int(self.best_text[m, layer, e]),
                            "left": decode(left) if left else "",
                            "token": decode([int(ctx[W])]),
                            "right": decode(right) if right else "",
                        }
                    )
                row.append(
                    {
                        "expert": e,
                        "load": int(self.load[layer, e]),
                        "top_tokens": top,
                        "specialized_tokens": spec,
                        "top_contexts": contexts,
                    }
                )
            out.append(row)
        return out

    def _vocabulary_section(self, decode, min_count: int) -> dict:
        E = self.n_experts
        ids, n_x, counts = self.token_table("input", min_count)
        by_layer = []
        for layer in range(self.n_layers):
            if not ids.size:
                by_layer.append({"layer": layer, "n_token_types": 0, "weighted_max_ratio": None, "top": []})
                continue
            ratio = counts[:, layer] / n_x[:, None]  # [types, E]
            best = ratio.max(axis=1)  # max over experts per token type
            best_e = E - 1 - ratio[:, ::-1].argmax(axis=1)  # ties: the highest expert index
            top_types = np.argsort(-(best * np.log1p(n_x)), kind="stable")[:15]
            by_layer.append(
                {
                    "layer": layer,
                    "n_token_types": int(ids.size),
                    "weighted_max_ratio": float((best * n_x).sum() / n_x.sum()),
                    "top": [
                        {
                            "token": decode([int(ids[i])]),
                            "expert": int(best_e[i]),
                            "ratio": float(best[i]),
                            "n_x": int(n_x[i]),
                        }
                        for i in top_types
                    ],
                }
            )
        return {"min_token_count": int(min_count), "by_layer": by_layer}

    def _coactivation_section(self, n_pairs: int) -> dict:
        L, E, k = self.n_layers, self.n_experts, self.top_k
        layers, heat_experts, heatmaps, indep_maps = [], [], [], []
        for layer in range(L):
            c = self.coactivation[layer].astype(np.float64)
            diag = np.diag(c).copy()
            ratio = np.divide(c, diag[:, None], out=np.zeros_like(c), where=diag[:, None] > 0)
            np.fill_diagonal(ratio, 0.0)
            flat = np.argsort(-ratio, axis=None, kind="stable")[:n_pairs]
            pairs = [
                {"i": int(i), "j": int(j), "ratio": float(ratio[i, j]), "n_i": int(diag[i])}
                for i, j in zip(*np.unravel_index(flat, ratio.shape))
                if ratio[i, j] > 0
            ]
            q = self.load[layer] / max(1, self.load[layer].sum())
            indep = (k - 1) * q[None, :] / np.maximum(1.0 - q[:, None], 1e-12)
            np.fill_diagonal(indep, 0.0)
            off = ~np.eye(E, dtype=bool) & (diag[:, None] > 0) & (indep > 0)
            top_e = np.argsort(-self.load[layer], kind="stable")[: min(E, HEATMAP_EXPERTS)]
            heat_experts.append([int(e) for e in top_e])
            heatmaps.append(ratio[np.ix_(top_e, top_e)].round(4).tolist())
            indep_maps.append(indep[np.ix_(top_e, top_e)].round(4).tolist())
            layers.append(
                {
                    "layer": layer,
                    "max_ratio": float(ratio.max()),
                    "max_ratio_baseline": float(indep.max()),
                    "mean_lift": float((ratio[off] / indep[off]).mean()) if off.any() else None,
                    "top_pairs": pairs,
                }
            )
        return {
            "uniform": (k - 1) / (E - 1) if E > 1 else 0.0,
            "top_experts": heat_experts,
            "heatmaps": heatmaps,
            "independent_heatmaps": indep_maps,
            "by_layer": layers,
            "matrix_layers": sorted({0, L // 2, L - 1}),
            "matrices": {
                str(layer): np.divide(
                    self.coactivation[layer],
                    np.diag(self.coactivation[layer])[:, None],
                    out=np.zeros((E, E)),
                    where=np.diag(self.coactivation[layer])[:, None] > 0,
                )
                .round(4)
                .tolist()
                for layer in sorted({0, L // 2, L - 1})
            },
        }
