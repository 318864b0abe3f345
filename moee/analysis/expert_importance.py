"""Causal tests of experts: what the next-token loss loses when an expert is disabled, a router swapped,
or experts steered (the interventions of :mod:`moee.capture.interventions`).

The corpus is tokenised once into chunks of at most ``seq_len`` tokens, up to ``max_tokens`` tokens
(:func:`build_corpus`; the file is read lazily and reading stops there). One unablated pass
(:func:`baseline`) keeps the per-token next-token losses (``[N]`` float32, the only per-token state),
each expert's load (the fraction of real tokens whose router selects it) and each expert's largest
output activation; every intervention is then one more pass over the same batches, reduced at once
to loss sums per domain, so memory is bounded by one batch plus ``O(N)`` floats.

Importance (:func:`expert_importance`) of expert ``(l, e)``: mean over predicted tokens of
``loss(disabled) - loss(base)`` in nats/token, overall and per domain. Its null is
:func:`moee.capture.interventions.drop_assignments` at rate = the expert's load: each token loses,
with that probability, one of its ``k`` selected experts drawn uniformly, so the null removes as
many (token, expert) assignments in the same layer as disabling the expert does in expectation,
spread over all experts ("a random expert of equal load"). The figure is the Spearman rank
correlation of importance with load (per layer and pooled): near 1 means importance is load.

Super experts (Su et al. 2025, "Unveiling Super Experts in Mixture-of-Experts Large Language
Models"): an expert's score is the largest ``|activation|`` of its output over the tokens routed to
it; it is flagged when that is at least ``super_ratio`` times the median score of all experts, and
the loss change of disabling the flagged experts together is reported.

Cost: one forward pass over the corpus per disabled expert and one per null (``2 L E`` passes
for all experts; ``--no-null`` halves it), plus the baseline (which also runs every expert once
more on its own tokens for the activation scores). ``scripts/bench_ablate.py`` measures it.

Router swap (:func:`router_swap`) of layer ``l``: the loss change when its router is the donor's,
beside the null of its own router with the expert order permuted (same loads, assignment gone), so
a swap reads as "the donor's router costs X of the Y a scrambled router costs"
(``recovered`` = 1 - X/Y). Steering (:func:`steering_effect`): KL of the next-token distribution,
embedding cosine and selection rates under logit biases, beside the same biases on random other
experts of the same layers (:func:`null_biases`). Both cost ``1 + null_draws`` passes per row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from moee.capture.interventions import (
    _find_dispatch,
    bias_experts,
    disable_experts,
    drop_assignments,
    moe_block,
    permute_router,
    swap_routers,
)
from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import RouterSpec, find_routers

__all__ = [
    "DEFAULT_DOMAIN",
    "LossCorpus",
    "NULL_DRAWS",
    "Baseline",
    "baseline",
    "build_corpus",
    "expert_importance",
    "intervention_loss",
    "null_biases",
    "read_corpus",
    "router_swap",
    "spearman",
    "steering_effect",
]

#: The domain of every text when the corpus has no domain field.
DEFAULT_DOMAIN = "all"


@dataclass
class LossCorpus:
    """Token chunks (``ids``: 1-D int64 tensors of 2..seq_len tokens) and each chunk's domain."""

    ids: list[torch.Tensor]
    domains: list[str]
    pad_id: int = 0

    @property
    def n_predicted(self) -> int:
        """Tokens whose next-token loss is measured (all but each chunk's first)."""
        return sum(len(c) - 1 for c in self.ids)

    @property
    def domain_names(self) -> list[str]:
        return sorted(set(self.domains))

    def token_domains(self) -> torch.Tensor:
        """The domain index (into :attr:`domain_names`) of every predicted token, in loss order."""
        names = {d: i for i, d in enumerate(self.domain_names)}
        return torch.cat([torch.full((len(c) - 1,), names[d]) for c, d in zip(self.ids, self.domains)])

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, attention_mask)`` right-padded batches in corpus order."""
        for start in range(0, len(self.ids), batch_size):
            rows = self.ids[start : start + batch_size]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)], mask[i, : len(r)] = r, 1
            yield ids, mask


def read_corpus(
    path: str | Path, *, field: str | None = None, domain_field: str | None = None
) -> Iterator[tuple[str, str]]:
    """``(text, domain)`` of each text of a .txt/.jsonl/.parquet corpus, lazily (the domain is
    :data:`DEFAULT_DOMAIN` without ``domain_field``; ``domain_field`` needs a .jsonl corpus)."""
    from moee.io import check_input_file, input_format, iter_jsonl, read_texts

    path = check_input_file(path, "--corpus")
    if domain_field is None:
        for text in read_texts(path, field=field):
            yield text, DEFAULT_DOMAIN
        return
    if input_format(path) != "jsonl":
        raise ValueError(f"--domain-field needs a .jsonl corpus, got {path}")
    key = field or "text"
    for n, record in iter_jsonl(path):
        if key not in record or domain_field not in record:
            missing = key if key not in record else domain_field
            raise ValueError(f"{path}:{n}: no field {missing!r} (fields: {', '.join(map(repr, record))})")
        yield str(record[key]), str(record[domain_field])


def build_corpus(
    texts: Iterable[tuple[str, str]],
    tokenizer: Any,
    *,
    seq_len: int = 128,
    max_tokens: int | None = None,
    per_domain_tokens: int | None = None,
) -> LossCorpus:
    """Tokenise ``(text, domain)`` pairs into chunks of at most ``seq_len`` tokens, stopping at
    ``max_tokens`` tokens in all; ``per_domain_tokens`` caps each domain (so a corpus sorted by
    domain still gives every domain its share). Chunks of one token predict nothing and are dropped."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    chunks, domains, total = [], [], 0
    taken: dict[str, int] = {}
    for text, domain in texts:
        if max_tokens is not None and total >= max_tokens:
            break
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        for start in range(0, len(ids), seq_len):
            room = [len(ids)]
            if max_tokens is not None:
                room.append(max_tokens - total)
            if per_domain_tokens is not None:
                room.append(per_domain_tokens - taken.get(domain, 0))
            piece = ids[start : start + min(seq_len, *room)]
            if len(piece) < 2:
                break
            chunks.append(torch.tensor(piece, dtype=torch.long))
            domains.append(domain)
            total += len(piece)
            taken[domain] = taken.get(domain, 0) + len(piece)
    if not chunks:
        raise ValueError("the corpus gives no text of two tokens or more")
    pad = getattr(tokenizer, "pad_token_id", None)
    return LossCorpus(chunks, domains, pad_id=int(pad) if pad is not None else 0)


def _input_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


#: Logits per slice when the losses' float32 arithmetic runs: a ``[rows, vocab]`` block at a time,
#: never float32 copies of the batch's ``[B, T, V]`` logits (at batch 16 x 128 tokens and a 152k
#: vocabulary each copy is 1.2 GB; in bfloat16 they were two such copies beside the model's own).
LOSS_LOGITS = 1 << 22


def _row_slices(logits: torch.Tensor, length: int) -> Iterator[tuple[int, slice]]:
    """``(row, positions)`` covering ``logits[:, :length]`` in blocks of about :data:`LOSS_LOGITS`."""
    step = max(1, LOSS_LOGITS // int(logits.shape[-1]))
    for row in range(logits.shape[0]):
        for start in range(0, length, step):
            yield row, slice(start, min(start + step, length))


def _next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T - 1]`` float32 next-token losses of ``logits [B, T, V]`` (any dtype), computed a
    slice at a time (:func:`_row_slices`)."""
    targets = ids[:, 1:].to(logits.device)
    nll = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for row, where in _row_slices(logits, targets.shape[1]):
        nll[row, where] = F.cross_entropy(logits[row, where].float(), targets[row, where], reduction="none")
    return nll


def _kl_per_token(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float32 KL(softmax(base) || softmax(other)) of two ``[B, T, V]`` logits, a slice
    at a time (:func:`_row_slices`)."""
    kl = torch.empty(base.shape[:2], dtype=torch.float32, device=base.device)
    for row, where in _row_slices(base, base.shape[1]):
        p = base[row, where].float().log_softmax(-1)
        q = other[row, where].float().log_softmax(-1)
        kl[row, where] = (p.exp() * (p - q)).sum(-1)
    return kl


def _batch_losses(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token losses of the real predicted positions of one batch, row by row, float32."""
    device = _input_device(model)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    nll = _next_token_nll(logits, ids)
    real = (mask[:, 1:] * mask[:, :-1]).bool()
    return nll.cpu()[real]


def intervention_loss(
    model: nn.Module,
    corpus: LossCorpus,
    intervention: Callable[[], AbstractContextManager] | None = None,
    *,
    batch_size: int = 16,
) -> torch.Tensor:
    """Per predicted token (corpus order) the next-token loss under ``intervention()``, float32 ``[N]``."""
    out = []
    with intervention() if intervention is not None else nullcontext(), torch.inference_mode():
        for ids, mask in corpus.batches(batch_size):
            out.append(_batch_losses(model, ids, mask))
    return torch.cat(out)


@dataclass
class Baseline:
    """The unablated pass: per-token losses, expert loads ``[L, E]`` and activation scores ``[L, E]``."""

    losses: torch.Tensor
    domains: torch.Tensor
    domain_names: list[str]
    load: torch.Tensor
    max_activation: torch.Tensor
    seconds: float
    routers: list[RouterSpec] = field(repr=False, default_factory=list)

    def by_domain(self, values: torch.Tensor) -> dict[str, float]:
        """The mean of per-token ``values`` in each domain."""
        sums = torch.zeros(len(self.domain_names), dtype=torch.float64).index_add_(
            0, self.domains, values.double()
        )
        counts = torch.bincount(self.domains, minlength=len(self.domain_names)).clamp_min(1)
        return {d: float(s / c) for d, s, c in zip(self.domain_names, sums, counts)}


def _activation_hook(spec: RouterSpec, scores: torch.Tensor, row: int):
    """An experts pre-hook that runs each dispatched expert alone on its tokens (weight 1) and keeps
    the largest ``|output|`` in ``scores[row, e]``."""
    busy = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if busy:
            return
        found = _find_dispatch(args, kwargs)
        if found is None:
            return
        (ik, ikey), (wk, wkey) = found
        index = args[ikey] if ik == "arg" else kwargs[ikey]
        weights = args[wkey] if wk == "arg" else kwargs[wkey]
        n = index.shape[0]
        busy.append(True)
        try:
            for e in torch.unique(index).tolist():
                if not 0 <= e < spec.n_experts:
                    continue
                rows = (index == e).any(-1)
                count = int(rows.sum())

                def sub(v, rows=rows, count=count, e=e):
                    if v is index:
                        return torch.full((count, 1), e, dtype=index.dtype, device=index.device)
                    if v is weights:
                        return torch.ones((count, 1), dtype=weights.dtype, device=weights.device)
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
                        if v.dtype == torch.bool and v.shape == index.shape:
                            return torch.ones((count, 1), dtype=torch.bool, device=v.device)
                        return v[rows]
                    return v

                out = module(*(sub(a) for a in args), **{k: sub(v) for k, v in kwargs.items()})
                out = out[0] if isinstance(out, tuple) else out
                scores[row, e] = max(float(scores[row, e]), float(out.detach().abs().max()))
        finally:
            busy.clear()

    return hook


def baseline(
    model: nn.Module, corpus: LossCorpus, *, batch_size: int = 16, routers: Sequence[RouterSpec] | None = None
) -> Baseline:
    """The unablated pass over ``corpus``: losses, loads and activation scores (see the module docstring)."""
    specs = list(routers) if routers is not None else find_routers(model)
    n_e = max(s.n_experts for s in specs)
    counts = torch.zeros(len(specs), n_e, dtype=torch.float64)
    scores = torch.zeros(len(specs), n_e)
    n_real = 0
    losses = []
    handles = []
    start = time.perf_counter()
    try:
        for i, spec in enumerate(specs):
            try:
                block = moe_block(model, spec)
            except ValueError:
                continue
            handles.append(
                block.experts.register_forward_pre_hook(_activation_hook(spec, scores, i), with_kwargs=True)
            )
        with torch.inference_mode():
            for ids, mask in corpus.batches(batch_size):
                with RoutingRecorder(model, specs, pooling="tokens") as rec:
                    rec.set_batch(mask)
                    losses.append(_batch_losses(model, ids, mask))
                    selection = rec.token_selection()
                real = mask.bool()
                n_real += int(real.sum())
                if selection is not None:
                    chosen = selection[real]  # [n, L, k]
                    for i in range(len(specs)):
                        picked = chosen[:, i][chosen[:, i] >= 0]
                        counts[i] += torch.bincount(picked, minlength=n_e).double()[:n_e]
    finally:
        for handle in handles:
            handle.remove()
    return Baseline(
        losses=torch.cat(losses),
        domains=corpus.token_domains(),
        domain_names=corpus.domain_names,
        load=(counts / max(n_real, 1)).float(),
        max_activation=scores,
        seconds=time.perf_counter() - start,
        routers=specs,
    )


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties averaged); ``None`` when either side is constant or short."""
    from scipy.stats import spearmanr

    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    value = float(spearmanr(a, b).statistic)
    return None if math.isnan(value) else value


def _effect(base: Baseline, losses: torch.Tensor) -> tuple[float, dict[str, float]]:
    delta = losses - base.losses
    return float(delta.double().mean()), base.by_domain(delta)


def expert_importance(
    model: nn.Module,
    corpus: LossCorpus,
    *,
    experts: Sequence[tuple[int, int]] | None = None,
    mode: str = "reselect",
    renormalize: bool = False,
    null: bool = True,
    seed: int = 0,
    super_ratio: float = 10.0,
    batch_size: int = 16,
    base: Baseline | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Importance of ``experts`` (every expert of every MoE layer when ``None``), beside the
    load-matched null, their rank correlation with load, and the super experts (module docstring).

    Returns a JSON-ready dict: ``base`` (loss overall and per domain), ``experts`` (one row per
    expert: ``layer``, ``expert``, ``router``, ``load``, ``delta``, ``delta_by_domain``, ``null``,
    ``null_by_domain``, ``excess`` = delta - null, ``importance_rank``, ``load_rank``),
    ``spearman_importance_load`` (pooled and per layer), ``super_experts`` and ``cost``."""
    if experts is not None and len(experts) == 0:  # refused before the baseline pass, not after
        raise ValueError("experts is empty: give at least one (layer, expert) pair, or None for all")
    specs = find_routers(model)
    base = base or baseline(model, corpus, batch_size=batch_size, routers=specs)
    if experts is None:
        experts = [(i, e) for i, s in enumerate(specs) for e in range(s.n_experts)]
    rows = []
    t0, c0 = time.perf_counter(), time.process_time()
    for n, (layer, expert) in enumerate(experts):
        loss = intervention_loss(
            model,
            corpus,
            partial(
                disable_experts, model, [(layer, expert)], mode=mode, renormalize=renormalize, routers=specs
            ),
            batch_size=batch_size,
        )
        row = _row(base, specs[layer].name, layer, expert, *_effect(base, loss))
        if null:
            rate = float(base.load[layer, expert])
            loss = intervention_loss(
                model,
                corpus,
                partial(
                    drop_assignments,
                    model,
                    layer,
                    rate,
                    mode=mode,
                    renormalize=renormalize,
                    seed=seed + 1000 * layer + expert,
                    routers=specs,
                ),
                batch_size=batch_size,
            )
            row["null"], row["null_by_domain"] = _effect(base, loss)
            row["excess"] = row["delta"] - row["null"]
        rows.append(row)
        if progress is not None:
            progress(n + 1, len(experts))
    ablation_seconds, ablation_cpu = time.perf_counter() - t0, time.process_time() - c0
    _rank(rows)
    return {
        "n_tokens": len(base.losses),
        "domains": {
            d: int(c)
            for d, c in zip(base.domain_names, torch.bincount(base.domains, minlength=len(base.domain_names)))
        },
        "mode": mode,
        "renormalize": renormalize,
        "base": {"loss": float(base.losses.double().mean()), "loss_by_domain": base.by_domain(base.losses)},
        "layers": [s.name for s in specs],
        "n_experts": [s.n_experts for s in specs],
        "null": LOAD_MATCHED_NULL if null else None,
        "experts": rows,
        "spearman_importance_load": _importance_load_correlation(rows, null),
        "super_experts": super_experts(
            model, corpus, base, mode=mode, renormalize=renormalize, ratio=super_ratio, batch_size=batch_size
        ),
        "cost": _cost(base, len(rows), null, ablation_seconds, ablation_cpu),
    }


#: How the load-matched null is drawn, as every result records it.
LOAD_MATCHED_NULL = (
    "load-matched: each token, with probability the expert's load, loses one of its k selected "
    "experts drawn uniformly (same layer, same mode)"
)


def _row(
    base: Baseline, router: str, layer: int, expert: int, delta: float, by_domain: dict
) -> dict[str, Any]:
    """One expert's result row: where it is, its load and largest activation, its loss change."""
    return {
        "layer": layer,
        "expert": expert,
        "router": router,
        "load": float(base.load[layer, expert]),
        "max_activation": float(base.max_activation[layer, expert]),
        "delta": delta,
        "delta_by_domain": by_domain,
    }


def _rank(rows: list[dict[str, Any]]) -> None:
    """Give every row its ``importance_rank`` and ``load_rank`` (1 = largest)."""
    by_importance = sorted(range(len(rows)), key=lambda j: -rows[j]["delta"])
    by_load = sorted(range(len(rows)), key=lambda j: -rows[j]["load"])
    for rank, j in enumerate(by_importance, start=1):
        rows[j]["importance_rank"] = rank
    for rank, j in enumerate(by_load, start=1):
        rows[j]["load_rank"] = rank


def _importance_load_correlation(rows: list[dict[str, Any]], null: bool) -> dict[str, Any]:
    """Spearman(importance, load) pooled and per layer, and of the excess over the null when it ran."""
    layers = sorted({r["layer"] for r in rows})
    correlation = {
        "pooled": spearman([r["delta"] for r in rows], [r["load"] for r in rows]),
        "by_layer": {
            str(layer): spearman(
                [r["delta"] for r in rows if r["layer"] == layer],
                [r["load"] for r in rows if r["layer"] == layer],
            )
            for layer in layers
        },
    }
    if null:
        correlation["pooled_excess"] = spearman([r["excess"] for r in rows], [r["load"] for r in rows])
    return correlation


def _cost(base: Baseline, n_rows: int, null: bool, seconds: float, cpu: float) -> dict[str, float]:
    """What the ablation cost: its passes (two per expert with the null), seconds and throughput."""
    return {
        "baseline_seconds": base.seconds,
        "ablation_seconds": seconds,
        "passes": n_rows * (2 if null else 1),
        "seconds_per_expert": seconds / max(n_rows, 1),
        "cpu_seconds_per_expert": cpu / max(n_rows, 1),
        "tokens_per_second": len(base.losses) * n_rows * (2 if null else 1) / max(seconds, 1e-9),
    }


def super_experts(
    model: nn.Module,
    corpus: LossCorpus,
    base: Baseline,
    *,
    mode: str = "reselect",
    renormalize: bool = False,
    ratio: float = 10.0,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Experts whose largest output ``|activation|`` is ``ratio`` times the median expert's, and the
    loss change of disabling them together (``None`` when none is flagged)."""
    scores = base.max_activation
    seen = scores[scores > 0]
    median = float(seen.median()) if seen.numel() else 0.0
    flagged = [
        (i, e)
        for i in range(scores.shape[0])
        for e in range(scores.shape[1])
        if median > 0 and float(scores[i, e]) >= ratio * median
    ]
    result: dict[str, Any] = {
        "ratio": ratio,
        "median_max_activation": median,
        "flagged": [
            {
                "layer": i,
                "expert": e,
                "max_activation": float(scores[i, e]),
                "over_median": float(scores[i, e]) / median,
            }
            for i, e in flagged
        ],
        "delta": None,
        "delta_by_domain": None,
    }
    top = sorted(
        ((float(scores[i, e]), i, e) for i in range(scores.shape[0]) for e in range(scores.shape[1])),
        reverse=True,
    )[:5]
    result["largest"] = [
        {"layer": i, "expert": e, "over_median": v / median if median else None} for v, i, e in top
    ]
    if flagged:
        by_layer: dict[int, int] = {}
        for i, _ in flagged:
            by_layer[i] = by_layer.get(i, 0) + 1
        if any(n >= base.routers[i].n_experts for i, n in by_layer.items()):
            result["note"] = "every expert of a layer is flagged; not disabled"
            return result
        loss = intervention_loss(
            model,
            corpus,
            lambda: disable_experts(model, flagged, mode=mode, renormalize=renormalize, routers=base.routers),
            batch_size=batch_size,
        )
        result["delta"], result["delta_by_domain"] = _effect(base, loss)
    return result


#: Null draws of the router swap and of steering (permutations / random expert sets), by default.
NULL_DRAWS = 3


def _spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, standard deviation (population) and the draws themselves."""
    t = torch.tensor(list(values), dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std(unbiased=False)), "draws": [float(v) for v in values]}


def _above_noise(spread: dict[str, Any]) -> bool:
    """Whether a null's mean cost is positive and, with two or more draws, above twice its
    standard error: a ratio to a null that is indistinguishable from zero is noise (a layer
    whose scrambled router costs nothing measurable has no cost to recover)."""
    n = len(spread["draws"])
    standard_error = spread["std"] / math.sqrt(n - 1) if n > 1 else 0.0
    return spread["mean"] > 2 * standard_error  # >= 0, so a positive mean is implied


def router_swap(
    model: nn.Module,
    donor: nn.Module,
    corpus: LossCorpus,
    *,
    null: bool = True,
    null_draws: int = NULL_DRAWS,
    seed: int = 0,
    batch_size: int = 16,
    base: Baseline | None = None,
) -> dict[str, Any]:
    """Loss change (nats/token, overall and per domain) when one MoE layer's router, then every
    layer's, comes from ``donor`` (same architecture), beside its null: the same layer(s) routed by
    their own router with the expert order permuted (:func:`moee.capture.interventions.permute_router`,
    ``null_draws`` derangements, draw ``j`` of layer ``i`` seeded ``seed + 1000 j + i``; the "all" row
    permutes every layer with the same permutations). ``recovered`` = 1 - delta / null: the share of
    a scrambled router's cost the donor's router does not pay; ``None`` where the null is not above
    its noise (:func:`_above_noise`: positive and above twice its standard error)."""
    if null and null_draws < 1:
        raise ValueError(f"null_draws must be at least 1, got {null_draws}")
    specs = find_routers(model)
    base = base or baseline(model, corpus, batch_size=batch_size, routers=specs)
    rows = []
    for layer in [*range(len(specs)), None]:
        layers = None if layer is None else [layer]
        loss = intervention_loss(
            model, corpus, partial(swap_routers, model, donor, layers, routers=specs), batch_size=batch_size
        )
        delta, by_domain = _effect(base, loss)
        row: dict[str, Any] = {
            "layer": "all" if layer is None else layer,
            "router": "all" if layer is None else specs[layer].name,
            "delta": delta,
            "delta_by_domain": by_domain,
        }
        if null:
            effects = [
                _effect(
                    base,
                    intervention_loss(
                        model,
                        corpus,
                        partial(permute_router, model, layers, seed=seed + 1000 * j, routers=specs),
                        batch_size=batch_size,
                    ),
                )
                for j in range(null_draws)
            ]
            spread = _spread([d for d, _ in effects])
            row["null"], row["null_std"] = spread["mean"], spread["std"]
            row["null_by_domain"] = {
                d: sum(by[d] for _, by in effects) / len(effects) for d in base.domain_names
            }
            row["recovered"] = 1.0 - delta / row["null"] if _above_noise(spread) else None
        rows.append(row)
    return {
        "n_tokens": len(base.losses),
        "base": {"loss": float(base.losses.double().mean()), "loss_by_domain": base.by_domain(base.losses)},
        "layers": [s.name for s in specs],
        "n_experts": [s.n_experts for s in specs],
        "null": (
            f"permuted router: the layer's own router with its expert order deranged (mean of {null_draws} "
            f"seeded draws, seed {seed}): the same loads, every token sent to other experts"
            if null
            else None
        ),
        "seed": seed,
        "null_draws": null_draws if null else 0,
        "swaps": rows,
    }


def null_biases(
    biases: dict[tuple[int, int], float],
    n_experts: Sequence[int],
    *,
    draws: int = NULL_DRAWS,
    seed: int = 0,
) -> list[dict[tuple[int, int], float]]:
    """The steering null's bias sets: draw ``j`` (generator seeded ``seed + j``) moves each layer's
    biases onto as many distinct experts of that layer drawn uniformly from those not steered there
    (layers in increasing order, biases in the order given)."""
    by_layer: dict[int, list[tuple[int, float]]] = {}
    for (layer, expert), value in biases.items():
        by_layer.setdefault(int(layer), []).append((int(expert), float(value)))
    for layer, pairs in by_layer.items():
        if not 0 <= layer < len(n_experts):
            raise ValueError(f"MoE layer {layer} out of range: the model has {len(n_experts)} MoE layers")
        if 2 * len(pairs) > n_experts[layer]:
            raise ValueError(
                f"MoE layer {layer}: {len(pairs)} steered experts of {n_experts[layer]} leave too few others "
                "for the null; steer fewer experts there"
            )
    out = []
    for j in range(draws):
        generator = torch.Generator().manual_seed(seed + j)
        drawn: dict[tuple[int, int], float] = {}
        for layer in sorted(by_layer):
            steered = {e for e, _ in by_layer[layer]}
            others = [e for e in range(n_experts[layer]) if e not in steered]
            pick = torch.randperm(len(others), generator=generator)[: len(by_layer[layer])].tolist()
            for (_, value), k in zip(by_layer[layer], pick):
                drawn[(layer, others[k])] = value
        out.append(drawn)
    return out


def _steered_outputs(
    embedder: Any,
    corpus: LossCorpus,
    texts: Sequence[str],
    bias_sets: Sequence[dict[tuple[int, int], float]],
    batch_size: int,
) -> list[dict[str, Any]]:
    """For each bias set: the mean KL(unsteered || steered) of the next-token distribution over
    ``corpus`` tokens, each biased expert's selection rate before and after, and the cosines of the
    texts' embeddings to their unsteered ones (one unsteered pass per batch, shared by every set)."""
    import numpy as np

    model, specs = embedder.model, embedder.routers
    device = _input_device(model)
    kl_sums, n = [0.0] * len(bias_sets), 0
    counts = [{key: [0, 0] for key in biases} for biases in bias_sets]
    n_real = 0

    def run(ids, mask, biases):
        context = bias_experts(model, biases, routers=specs) if biases is not None else nullcontext()
        with context, RoutingRecorder(model, specs, pooling="tokens") as rec:
            rec.set_batch(mask)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            return logits, rec.token_selection()  # in the model's dtype: float32 only a slice at a time

    with torch.inference_mode():
        for ids, mask in corpus.batches(batch_size):
            real = mask.bool()
            base_logits, base_sel = run(ids, mask, None)
            n += int(real.sum())
            n_real += int(real.sum())
            for s, biases in enumerate(bias_sets):
                logits, sel = run(ids, mask, biases)
                kl = _kl_per_token(base_logits, logits).cpu()[real]
                kl_sums[s] += float(kl.double().sum())
                for layer, expert in biases:
                    for j, picked in enumerate((base_sel, sel)):
                        if picked is not None:
                            counts[s][(layer, expert)][j] += int(
                                (picked[real][:, layer] == expert).any(-1).sum()
                            )

    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    plain = unit(embedder.encode(list(texts), batch_size=batch_size, show_progress_bar=False))
    out = []
    for s, biases in enumerate(bias_sets):
        with bias_experts(model, biases, routers=specs):
            steered = unit(embedder.encode(list(texts), batch_size=batch_size, show_progress_bar=False))
        cosine = (plain * steered).sum(1)
        rates = [
            {"layer": i, "expert": e, "before": c[0] / max(n_real, 1), "after": c[1] / max(n_real, 1)}
            for (i, e), c in counts[s].items()
        ]
        out.append(
            {
                "biases": [{"layer": i, "expert": e, "bias": float(v)} for (i, e), v in biases.items()],
                "n_tokens": n,
                "kl_next_token": kl_sums[s] / max(n, 1),
                "selection_rate": rates,
                "selection_shift": sum(r["after"] - r["before"] for r in rates) / max(len(rates), 1),
                "embedding_cosine": {
                    "n_texts": len(texts),
                    "mean": float(cosine.mean()),
                    "min": float(cosine.min()),
                    "median": float(np.median(cosine)),
                },
            }
        )
    return out


def steering_effect(
    embedder: Any,
    corpus: LossCorpus,
    texts: Sequence[str],
    biases: dict[tuple[int, int], float],
    *,
    null: bool = True,
    null_draws: int = NULL_DRAWS,
    seed: int = 0,
    batch_size: int = 16,
) -> dict[str, Any]:
    """What biasing ``biases`` (``(layer, expert) -> logit bias``) does: the mean KL(unsteered ||
    steered) of the next-token distribution over ``corpus`` tokens (nats), the selection rate of
    each biased expert before and after (``selection_shift``: the mean of after - before), and the
    cosine of each text's embedding (``embedder.encode``, the model's own configuration) to its
    unsteered embedding; beside the null (``null``): the same biases on experts of the same layers
    drawn at random (:func:`null_biases`, ``null_draws`` draws from ``seed``), each measured alike
    (``null.draws``) with the mean and spread of each figure, and how many draws the steered
    experts' KL exceeds."""
    if null and null_draws < 1:
        raise ValueError(f"null_draws must be at least 1, got {null_draws}")
    bad = {pair: value for pair, value in biases.items() if not math.isfinite(float(value))}
    if bad:  # before any forward pass: a NaN bias would turn every logit of its layer into NaN
        raise ValueError(f"steering biases must be finite numbers, got {bad}")
    specs = embedder.routers
    sets = [biases]
    if null:
        sets += null_biases(biases, [s.n_experts for s in specs], draws=null_draws, seed=seed)
    measured = _steered_outputs(embedder, corpus, texts, sets, batch_size)
    result = {
        **measured[0],
        "layers": [s.name for s in specs],
        "n_experts": [s.n_experts for s in specs],
        "null": None,
    }
    if null:
        draws = measured[1:]
        result["null"] = {
            "description": (
                f"the same biases on other experts of the same layers drawn uniformly ({null_draws} seeded "
                f"draws, seed {seed})"
            ),
            "seed": seed,
            "kl_next_token": _spread([d["kl_next_token"] for d in draws]),
            "embedding_cosine_mean": _spread([d["embedding_cosine"]["mean"] for d in draws]),
            "selection_shift": _spread([d["selection_shift"] for d in draws]),
            "kl_exceeds_draws": sum(1 for d in draws if result["kl_next_token"] > d["kl_next_token"]),
            "draws": [{k: v for k, v in d.items() if k != "n_tokens"} for d in draws],
        }
    return result
