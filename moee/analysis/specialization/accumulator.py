"""The streaming accumulator of the specialization report: shared state, then every section.

``SpecializationAccumulator`` folds token routes in one text at a time into fixed-size arrays
(memory independent of the corpus length). It holds the state every section reads (the per-layer
marginals, the per-token-type tables ``_TokenTables`` and the route sample ``_RouteSample`` of
:mod:`moee.analysis.specialization.statistics`, once each) and, per section of the registry
(:data:`moee.analysis.specialization.sections.SECTIONS`, read when used), that section's tally; ``baselines`` draws
every section's baseline from one seeded generator in their ``draw_order`` and ``result`` returns
every section's JSON part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moee.analysis.specialization import sections as registry
from moee.analysis.specialization.sections.base import Draw, Options, Results, Shape, Tally, TextRoutes
from moee.analysis.specialization.statistics import (
    BASELINE_SAMPLE_BYTES,
    TOKEN_KEYS,
    TOKEN_TABLE_BYTES,
    _RouteSample,
    _TokenTables,
)

__all__ = ["BaselineDraws", "SpecializationAccumulator"]


@dataclass(frozen=True)
class BaselineDraws:
    """How the permutation baselines are drawn: ``permutations`` draws per baseline from a
    generator seeded with ``seed``, on a sample of at most ``sample`` token routes (``None``: as
    many as fit in ``BASELINE_SAMPLE_BYTES``). Checked by `SpecializationAccumulator`."""

    permutations: int = 10
    seed: int = 0
    sample: int | None = None


class SpecializationAccumulator:
    """Streams token routes ``probs [T, L, E]`` into bounded-memory routing statistics.

    ``draws`` (`BaselineDraws`) sets the permutation baselines: ``permutations`` and ``seed``, and
    ``sample``, the bound on the number of token routes kept for them (default: as many as fit in
    ``BASELINE_SAMPLE_BYTES``).
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
        draws: BaselineDraws | None = None,
        n_contexts: int = 5,
        context_window: int = 6,
        vocab_size: int | None = None,
        max_token_types: int | None = None,
    ):
        draws = draws if draws is not None else BaselineDraws()
        permutations, seed, baseline_sample = draws.permutations, draws.seed, draws.sample
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
        self.importance = np.zeros((L, E))
        self.load = np.zeros((L, E), dtype=np.int64)
        self.first = np.zeros((L, E), dtype=np.int64)
        self.entropy_sum = np.zeros(L)
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
        shape = Shape(L, E, self.top_k, self.n_contexts, self.context_window)
        #: What each section keeps per text, by section id.
        self.tallies: dict[str, Tally] = {
            s.id: s.tally(shape) for s in registry.SECTIONS if s.tally is not None
        }

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
        text = TextRoutes(text_index, ids, p, np.asarray(sel), first, counts, domain, predicted)
        for tally in self.tallies.values():
            tally.update(text)
        for key, (tokens, routes) in (
            ("input", (ids, sel)),
            ("next", (ids[1:], sel[:-1])),
            ("predicted", (predicted, sel)),
        ):
            if tokens is not None and tokens.size:
                self._types.add(key, tokens, routes)
        tokens = np.full((T, len(TOKEN_KEYS)), -1, dtype=np.int64)
        tokens[:, 0], tokens[:-1, 1] = ids, ids[1:]  # input, next (TOKEN_KEYS order)
        if predicted is not None:
            tokens[:, 2] = predicted
        self._sample.add(text_index, np.asarray(sel), tokens)

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

    def state_bytes(self) -> int:
        """Bytes of every array the accumulator and its sections' tallies hold: what streaming keeps
        in memory, set by the model (token tables, co-activation, contexts) and the baseline sample's
        capacity, so the same at any corpus length when the vocabulary size is known (but for the
        index of the token types seen, 16 bytes a type; without it the tables double as types
        arrive, up to their cap)."""
        tables, sample = self._types, self._sample
        arrays = [  # the last text's selections (kept for checks) depend on the arrival order
            v for k, v in vars(self).items() if isinstance(v, np.ndarray) and not k.startswith("last_")
        ]
        for tally in self.tallies.values():
            for value in vars(tally).values():
                values = value.values() if isinstance(value, dict) else [value]
                arrays += [v for v in values if isinstance(v, np.ndarray)]
        arrays += [*tables.counts.values(), *tables.occurrences.values()]
        arrays += [tables.type_ids, tables._sorted_ids, tables._sorted_rows]
        arrays += [sample.priority, sample.text, sample.pos, sample.sel, sample.tok]
        return int(sum(a.nbytes for a in arrays))

    # ------------------------------------------------------------------ results
    @property
    def token_tables(self) -> _TokenTables:
        """The per-token-type tables (shared by every section that counts by token type)."""
        return self._types

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

    def baselines(self, min_token_count: int = 5, n_top: int = 10, *, progress: bool = False) -> dict:
        """Every section's baseline, by section id: its statistic under the null "routing does not
        depend on X", computed the way the statistic is computed, by permutation (seeded, mean over
        ``permutations`` draws; what each section shuffles is its ``Section.null``). The sections
        draw from one generator in their ``draw_order`` and share the route sample. ``"method"``
        describes the draws and every section's null (the ``baselines`` section of the report).
        ``min_token_count`` and ``n_top`` are those of the token statistics (see ``result``).
        """
        from tqdm.auto import tqdm

        rng = np.random.default_rng(self.seed)
        sample = self._sample.routes()
        options = Options(min_token_count=min_token_count, n_specialization_tokens=n_top)
        drawn: dict = {}
        order = sorted((s for s in registry.SECTIONS if s.baseline is not None), key=lambda s: s.draw_order)
        total = sum(s.baseline_steps(self) for s in order if s.baseline_steps is not None)
        with tqdm(total=total, desc="baselines", disable=not progress) as bar:
            draw = Draw(self, rng, sample, options, drawn, lambda: bar.update(1), self._sample.tokens())
            for section in order:
                drawn[section.id] = section.baseline(draw)
        drawn["method"] = {
            "kind": "permutation",
            "permutations": self.permutations,
            "seed": self.seed,
            "sampled_tokens": int(sample.shape[0]),
            "exact": bool(sample.shape[0] == self.n_tokens),
            **{s.id: s.null for s in registry.SECTIONS if s.null is not None},
        }
        return drawn

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
        """Every section the accumulator computes (all but ``meta``, ``saturation`` and
        ``token_view``, the driver's: they need other models or the texts), by section id in
        registry order, as plain JSON-ready Python objects."""
        if self.n_tokens == 0:
            raise ValueError("no tokens were routed: the corpus is empty or every text tokenised to nothing")
        decode = decode or (lambda ids: " ".join(str(i) for i in ids))
        options = Options(n_top_tokens, min_token_count, n_coactivation_pairs, n_specialization_tokens)
        base = self.baselines(min_token_count, n_specialization_tokens, progress=progress)
        results = Results(self, decode, options, base, {s.id: s for s in registry.SECTIONS})
        from tqdm.auto import tqdm

        computed = [s for s in registry.SECTIONS if s.result is not None]
        out = {}
        with tqdm(computed, desc="statistics", unit="section", disable=not progress) as bar:
            for section in bar:
                bar.set_postfix_str(section.id, refresh=True)
                out[section.id] = results[section.id]
        return out
