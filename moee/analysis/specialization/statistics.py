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

__all__ = ["SpecializationAccumulator", "BASELINE_SAMPLE_BYTES"]


class _SparseCounter:
    """Counts of non-negative int64 keys, kept as sorted unique arrays and compacted in bulk."""

    def __init__(self, compact_every: int = 2_000_000):
        self.keys = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._n_pending = 0
        self._compact_every = compact_every

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(np.asarray(keys, dtype=np.int64).ravel())
        self._n_pending += self._pending[-1].size
        if self._n_pending >= self._compact_every:
            self.compact()

    def compact(self) -> None:
        if not self._pending:
            return
        new = np.concatenate(self._pending)
        keys = np.concatenate([self.keys, new])
        weights = np.concatenate([self.counts, np.ones(new.size, dtype=np.int64)])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=weights, minlength=self.keys.size).astype(np.int64)
        self._pending, self._n_pending = [], 0


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
    """

    def __init__(self, capacity: int, n_layers: int, top_k: int, n_experts: int, seed: int):
        self.capacity = int(capacity)
        self.seed = int(seed)
        self._dtype = np.int16 if n_experts <= np.iinfo(np.int16).max else np.int32
        self.priority = np.zeros(0, dtype=np.uint64)
        self.text = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.sel = np.zeros((0, n_layers, top_k), dtype=self._dtype)
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._n_pending = 0
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
        self._pending.append(
            (priority, np.full(pos.size, text_index, dtype=np.int64), pos, sel.astype(self._dtype))
        )
        self._n_pending += pos.size
        if self._n_pending >= self.capacity:
            self.compact()

    def compact(self) -> None:
        if not self._pending:
            return
        parts = list(zip(*self._pending))
        self.priority = np.concatenate([self.priority, *parts[0]])
        self.text = np.concatenate([self.text, *parts[1]])
        self.pos = np.concatenate([self.pos, *parts[2]])
        self.sel = np.concatenate([self.sel, *parts[3]])
        self._pending, self._n_pending = [], 0
        if self.priority.size > self.capacity:
            keep = np.argpartition(self.priority, self.capacity - 1)[: self.capacity]
            self.priority, self.text, self.pos = self.priority[keep], self.text[keep], self.pos[keep]
            self.sel = self.sel[keep]
        if self.priority.size >= self.capacity:
            self._threshold = self.priority.max()

    def routes(self) -> np.ndarray:
        """The sampled top-k sets ``[R, L, k]`` in corpus order (text, position)."""
        self.compact()
        return self.sel[np.lexsort((self.pos, self.text))]


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


def _permuted_group_max(
    sizes: np.ndarray, sample: np.ndarray, n_experts: int, rng: np.random.Generator
) -> np.ndarray:
    """``max_E`` of each group's expert counts ``[G, L]`` when group g's ``sizes[g]`` tokens take
    routes drawn at random from ``sample [R, L, k]``: a random permutation of the sample split into
    the groups when they fit in it (an exact permutation test when the sample is the whole
    corpus), draws with replacement otherwise. Memory is bounded by the block sizes."""
    sizes = np.asarray(sizes, dtype=np.int64)
    R, L, k = sample.shape
    E = n_experts
    out = np.zeros((sizes.size, L), dtype=np.int64)
    total = int(sizes.sum())
    if total == 0 or R == 0:
        return out
    perm = rng.permutation(R) if total <= R else None
    ends = np.cumsum(sizes)
    max_groups = max(1, (1 << 22) // (L * E))
    max_tokens = max(1, (1 << 23) // (L * k))
    layer_off = (np.arange(L) * E)[None, :, None]
    for g0, g1, t0, t1 in _group_blocks(ends, max_groups, max_tokens):
        counts = np.zeros((g1 - g0) * L * E, dtype=np.int64)
        for s0 in range(t0, t1, max_tokens):
            s1 = min(t1, s0 + max_tokens)
            idx = perm[s0:s1] if perm is not None else rng.integers(0, R, s1 - s0)
            group = np.searchsorted(ends, np.arange(s0, s1), side="right") - g0
            keys = (group[:, None, None] * (L * E) + layer_off + sample[idx]).ravel()
            counts += np.bincount(keys, minlength=counts.size)
        out[g0:g1] = counts.reshape(g1 - g0, L, E).max(axis=2)
    return out


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


#: Default bound on the memory of the route sample behind the permutation baselines (bytes).
BASELINE_SAMPLE_BYTES = 1 << 26


class SpecializationAccumulator:
    """Streams token routes ``probs [T, L, E]`` into bounded-memory routing statistics.

    ``permutations`` and ``seed`` set the permutation baselines; ``baseline_sample`` bounds the
    number of token routes kept for them (default: as many as fit in ``BASELINE_SAMPLE_BYTES``).
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
    ):
        for name, value in (("n_layers", n_layers), ("n_experts", n_experts), ("top_k", top_k)):
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
        self._vocab = _SparseCounter()  # key = (token_id * L + layer) * E + expert
        self._tokens = _SparseCounter()  # key = token_id
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
    ) -> None:
        """Fold one text's routes in: ``input_ids [T]`` and dense router probabilities ``probs [T, L, E]``.

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
        L, E, k = self.n_layers, self.n_experts, self.top_k
        if p.ndim != 3 or p.shape[1:] != (L, E):
            raise ValueError(f"probs must be [T, {L}, {E}], got shape {p.shape}")
        rank = p if selection is None else np.asarray(selection, dtype=np.float64)
        if rank.shape != p.shape:
            raise ValueError(f"selection must have the shape of probs {p.shape}, got {rank.shape}")
        if p.shape[0] != ids.size:
            raise ValueError(f"input_ids has {ids.size} tokens but probs has {p.shape[0]}")
        if ids.size and ids.min() < 0:
            raise ValueError("input_ids must be non-negative token ids")
        if not np.isfinite(p).all():
            raise ValueError(f"text {text_index}: router probabilities contain NaN or inf")
        T = p.shape[0]
        if selected is not None:
            sel = self._check_selected(selected, T)
        elif k < E:  # order inside the top k is irrelevant for counts
            sel = np.argpartition(-rank, k - 1, axis=2)[..., :k]
        else:
            sel = np.broadcast_to(np.arange(E), (T, L, E))
        self.n_texts += 1
        if T == 0:
            return
        self.n_tokens += T
        self.last_selection = np.asarray(sel)
        best = np.take_along_axis(p, sel, axis=2).argmax(axis=2)  # first choice among the selected
        first = np.take_along_axis(sel, best[..., None], axis=2)[..., 0]  # [T, L]
        layer_off = (np.arange(L) * E)[None, :, None]
        flat = (sel + layer_off).ravel()
        counts = np.bincount(flat, minlength=L * E).reshape(L, E)
        self.load += counts
        self.first += np.bincount((first + layer_off[..., 0]).ravel(), minlength=L * E).reshape(L, E)
        self.importance += p.sum(0)
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(p > 0, p * np.log(p), 0.0)
        self.entropy_sum += -plogp.sum(axis=(0, 2))
        mask = np.zeros((T, L, E), dtype=np.float32)
        np.put_along_axis(mask, np.asarray(sel), 1.0, axis=2)
        per_layer = mask.transpose(1, 2, 0)  # [L, E, T]
        self.coactivation += np.rint(per_layer @ per_layer.transpose(0, 2, 1)).astype(np.int64)
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
        self._tokens.add(ids)
        self._vocab.add(((ids[:, None, None] * L + np.arange(L)[None, :, None]) * E + sel).ravel())
        self._sample.add(text_index, np.asarray(sel))
        self._update_contexts(ids, p, text_index)

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

    # ------------------------------------------------------------------ results
    def vocabulary_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sparse ``N_k(x, E)`` triples ``(token, layer, expert, count)`` and ``N_x`` per triple."""
        self._vocab.compact()
        self._tokens.compact()
        L, E = self.n_layers, self.n_experts
        keys, counts = self._vocab.keys, self._vocab.counts
        token, rest = np.divmod(keys, L * E)
        layer, expert = np.divmod(rest, E)
        n_x = self._tokens.counts[np.searchsorted(self._tokens.keys, token)]
        return token, layer, expert, counts, n_x

    def result(
        self,
        decode: Callable[[Sequence[int]], str] | None = None,
        *,
        n_top_tokens: int = 8,
        min_token_count: int = 5,
        n_coactivation_pairs: int = 10,
    ) -> dict:
        """Every report section except ``meta`` as plain JSON-ready Python objects."""
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
        token, lay, exp_, cnt, n_x = self.vocabulary_counts()
        experts = self._experts_section(decode, token, lay, exp_, cnt, n_x, n_top_tokens, min_token_count)
        vocabulary = self._vocabulary_section(decode, token, lay, exp_, cnt, n_x, min_token_count)
        base = self.baselines(min_token_count)
        for entry, value in zip(vocabulary["by_layer"], base["vocabulary"]):
            entry["baseline"] = value
        names = sorted(self.domain_tokens)
        domains = {"available": bool(self.domain_tokens), "domains": {}}
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
        }

    def baselines(self, min_token_count: int = 5) -> dict:
        """Every statistic's value under the null "routing does not depend on X", computed the way
        the statistic is computed, by permutation (seeded, mean over ``permutations`` draws):

        * vocabulary: routes shuffled against tokens: each token type seen at least
          ``min_token_count`` times takes as many random routes of the corpus (from the route
          sample) as it has occurrences; the token-weighted mean of ``max_E N_k(x, E) / N_x``;
        * domains: routes shuffled against domain labels the same way (a domain takes ``N_D``
          random token routes): ``max_E N_k(E, D) / N_D`` per domain;
        * layer agreement: layer l+1's first choices shuffled against layer l's: a random table
          with the exact margins of the joint counts, then its NMI and matched agreement;
        * repetition: first choices shuffled against positions; its expectation is exact,
          ``sum_E c_E (c_E - 1) / (N (N - 1))`` with ``c_E`` the first-choice counts.
        """
        L, E, N = self.n_layers, self.n_experts, self.n_tokens
        rng = np.random.default_rng(self.seed)
        sample = self._sample.routes()
        self._tokens.compact()
        type_sizes = self._tokens.counts[self._tokens.counts >= min_token_count]
        names = sorted(self.domain_tokens)
        dom_sizes = np.array([self.domain_tokens[d] for d in names], dtype=np.int64)
        P = self.permutations
        vocab = np.zeros((P, L))
        doms = np.zeros((P, dom_sizes.size, L))
        for i in range(P):
            if type_sizes.size:
                vocab[i] = _permuted_group_max(type_sizes, sample, E, rng).sum(axis=0) / type_sizes.sum()
            if dom_sizes.size:
                doms[i] = _permuted_group_max(dom_sizes, sample, E, rng) / dom_sizes[:, None]
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
        c = self.first.astype(np.float64)
        repetition = ((c * (c - 1)).sum(axis=1) / (N * (N - 1))).tolist() if N > 1 else [0.0] * L
        return {
            "vocabulary": [float(v) if type_sizes.size else None for v in vocab.mean(axis=0)],
            "domains": doms.mean(axis=0).tolist(),
            "layer_agreement": agreement,
            "repetition": [float(r) for r in repetition],
            "method": {
                "kind": "permutation",
                "permutations": P,
                "seed": self.seed,
                "sampled_tokens": int(sample.shape[0]),
                "exact": bool(sample.shape[0] == N),
                "vocabulary": "routes shuffled against tokens (token types seen >= min_token_count times)",
                "domains": "token routes shuffled against domain labels",
                "layer_agreement": "first choices of layer l+1 shuffled against layer l (exact margins)",
                "repetition": "first choices shuffled against positions (exact expectation)",
                "coactivation": "none by permutation (shuffling routes keeps each token's set); "
                "reference (k-1)/(E-1) is uniform independent choice",
            },
        }

    def _experts_section(self, decode, token, lay, exp_, cnt, n_x, n_top, min_count) -> list[list[dict]]:
        L, E, W = self.n_layers, self.n_experts, self.context_window
        order = np.lexsort((-cnt, exp_, lay))  # grouped by (layer, expert), most frequent token first
        token, lay, exp_, cnt, n_x = token[order], lay[order], exp_[order], cnt[order], n_x[order]
        starts = np.searchsorted(lay * E + exp_, np.arange(L * E))
        ends = np.append(starts[1:], token.size)
        out: list[list[dict]] = []
        for layer in range(L):
            row = []
            for e in range(E):
                s, t = starts[layer * E + e], ends[layer * E + e]
                top = [
                    {
                        "token": decode([int(x)]),
                        "token_id": int(x),
                        "count": int(c),
                        "share_of_token": float(c / nx),
                    }
                    for x, c, nx in zip(token[s : s + n_top], cnt[s : s + n_top], n_x[s : s + n_top])
                ]
                ok = n_x[s:t] >= min_count
                spec = []
                if ok.any():
                    ratio = cnt[s:t][ok] / n_x[s:t][ok]
                    best = np.argsort(-ratio, kind="stable")[:n_top]
                    spec = [
                        {
                            "token": decode([int(token[s:t][ok][i])]),
                            "ratio": float(ratio[i]),
                            "n_x": int(n_x[s:t][ok][i]),
                        }
                        for i in best
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

    def _vocabulary_section(self, decode, token, lay, exp_, cnt, n_x, min_count) -> dict:
        L = self.n_layers
        by_layer = []
        for layer in range(L):
            m = (lay == layer) & (n_x >= min_count)
            if not m.any():
                by_layer.append({"layer": layer, "n_token_types": 0, "weighted_max_ratio": None, "top": []})
                continue
            t, c, nx = token[m], cnt[m], n_x[m]
            ratio = c / nx
            # max over experts per token type
            uniq, inv = np.unique(t, return_inverse=True)
            best = np.zeros(uniq.size)
            np.maximum.at(best, inv, ratio)
            weights = np.zeros(uniq.size)
            weights[inv] = nx
            order = np.lexsort((ratio, inv))  # grouped by token type, highest ratio last
            last = np.append(np.flatnonzero(np.diff(inv[order])), order.size - 1)
            best_e = exp_[m][order[last]]
            top_types = np.argsort(-(best * np.log1p(weights)), kind="stable")[:15]
            by_layer.append(
                {
                    "layer": layer,
                    "n_token_types": int(uniq.size),
                    "weighted_max_ratio": float((best * weights).sum() / weights.sum()),
                    "top": [
                        {
                            "token": decode([int(uniq[i])]),
                            "expert": int(best_e[i]),
                            "ratio": float(best[i]),
                            "n_x": int(weights[i]),
                        }
                        for i in top_types
                    ],
                }
            )
        return {"min_token_count": int(min_count), "by_layer": by_layer}

    def _coactivation_section(self, n_pairs: int) -> dict:
        L, E, k = self.n_layers, self.n_experts, self.top_k
        layers = []
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
            layers.append({"layer": layer, "max_ratio": float(ratio.max()), "top_pairs": pairs})
        return {
            "uniform": (k - 1) / (E - 1) if E > 1 else 0.0,
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
