"""Gating networks for the from-scratch MoE (Shazeer et al. 2017; Zhou et al. 2022; Wang et al. 2024).

Every gate maps token vectors ``x [N, d]`` to a :class:`GateOutput`:

* ``weights [N, k]`` and ``indices [N, k]`` (long): the selected experts and their gate values,
  ordered by decreasing gate value. The layer dispatches with these.
* ``probs [N, E]``: the same gate values scattered into a dense matrix, exact zeros elsewhere.
* ``logits [N, E]``: the clean router logits (``x W_g``), what routing-weight capture records.
* ``aux``: always ``"loss"`` (a scalar, already multiplied by the gate's own loss weights, zero
  when the gate has none), ``"importance"`` and ``"load"`` (``[E]`` each); gate-specific extras
  are listed in each class.
* ``mask [N, k]`` (bool) or ``None``: gates that select a *variable* number of experts per token
  (strictly balanced, expert choice, Switch after capacity) pad every row to the widest row;
  padded slots have ``mask == False``, ``weight == 0`` and a valid (but meaningless) index, so a
  layer that ignores the mask still computes the right output, only with some wasted work.
  ``None`` means every slot is a real selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moee.moe.losses import check_k, cv_squared, keep_top_k_with_indices, prob_in_top_k

__all__ = [
    "GateOutput",
    "top_k_gating",
    "noisy_top_k",
    "SoftmaxGate",
    "NoisyTopKGate",
    "Hierarchy",
    "HierarchicalGate",
    "BatchwiseBalancedGate",
    "ExpertChoiceGate",
    "LossFreeBalancedGate",
    "switch_capacity",
]


@dataclass
class GateOutput:
    """What every gate returns; see the module docstring for the meaning of each field."""

    weights: Tensor
    indices: Tensor
    probs: Tensor
    logits: Tensor
    aux: dict[str, Tensor] = field(default_factory=dict)
    mask: Tensor | None = None

    @property
    def k(self) -> int:
        """Number of expert slots per token (the width of ``weights``/``indices``)."""
        return self.weights.shape[-1]

    @property
    def n_experts(self) -> int:
        return self.probs.shape[-1]


def switch_capacity(tokens: int, experts: int, capacity_factor: float, minimum: int = 1) -> int:
    """Expert capacity ``max(minimum, min(tokens, int(tokens * capacity_factor / experts)))``.

    Shared by Switch routing (``moee.moe.switch``) and expert choice; it lives here so that
    ``switch`` depends on ``gates`` and never the other way round.

    The pinned Mesh-TensorFlow convention: floor, then clamp to the token count, then the minimum
    (minimum 1 here by default instead of upstream's 4, so tiny batches keep a slot).
    """
    for name, value in (("tokens", tokens), ("experts", experts), ("minimum", minimum)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    if minimum < 0:
        raise ValueError(f"minimum must be >= 0, got {minimum}")
    if not (
        isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor > 0
    ):
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor!r}")
    return max(minimum, min(tokens, int(tokens * capacity_factor / experts)))


def _check_input(x: Tensor, d_model: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"gate input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != d_model:
        raise ValueError(f"gate input must have shape [N, {d_model}], got {tuple(x.shape)}")


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_weight(value: float, name: str) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name} must be a non-negative number, got {value}")


def _zero_linear(d_in: int, d_out: int) -> nn.Linear:
    """Bias-free projection initialised to exactly zero (Shazeer Appendix A: uniform start)."""
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.zeros_(layer.weight)
    return layer


def _normal_linear(d_in: int, d_out: int, init_std: float) -> nn.Linear:
    """Bias-free projection with a small random init, for gates *without* exploration noise.

    Zero init is right for the noisy gate (its noise breaks the ties), but a deterministic gate
    whose scores are all equal selects by position (topk tie order), which is degenerate.
    """
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=init_std)
    return layer


def _gate_linear(d_in: int, d_out: int, noisy: bool, init_std: float) -> nn.Linear:
    """Router projection: zero with exploration noise (Shazeer et al. 2017, Appendix A), random without.

    The paper's zero init goes together with its noise; a noise-free gate started at zero would
    send every token to the same k experts (topk's tie order) and never see another choice.
    """
    return _zero_linear(d_in, d_out) if noisy else _normal_linear(d_in, d_out, init_std)


def _pack_selection(selected: Tensor, gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Turn a variable-size selection ``selected [N, E]`` (bool) into padded ``[N, w]`` slots.

    ``w`` is the largest number of experts any row selected (at least 1). Real selections come
    first, in decreasing gate order; padded slots get weight 0 and ``mask == False``.
    Returns ``(weights, indices, mask)``.
    """
    width = max(1, int(selected.sum(1).max())) if selected.numel() else 1
    width = min(width, selected.shape[1])
    key = torch.where(selected, gates.detach(), torch.full_like(gates, float("-inf")))
    indices = key.topk(width, dim=-1).indices
    mask = selected.gather(1, indices)
    weights = gates.gather(1, indices) * mask.to(gates.dtype)
    return weights, indices, mask


def top_k_gating(h: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``G = Softmax(KeepTopK(H, k))`` along the last axis.

    Returns ``(probs, weights, indices)``: the dense gates (exactly ``E - k`` zeros per row,
    the rest positive and summing to 1), and the k selected gate values and expert ids in
    decreasing order. With k = 1 the surviving gate is the constant 1, so it has no gradient.
    """
    masked, indices = keep_top_k_with_indices(h, k)
    probs = torch.softmax(masked, dim=-1)
    return probs, probs.gather(-1, indices), indices


def _selection_counts(probs: Tensor) -> Tensor:
    """Hard load: how many rows select each expert (``G > 0``), summed over all leading axes."""
    return (probs > 0).flatten(0, -2).sum(0).to(probs.dtype)


class SoftmaxGate(nn.Module):
    """Dense softmax gate ``G_sigma(x) = Softmax(x W_g)`` (k = E, nothing is skipped).

    The classic soft mixture: every expert gets a positive weight, so every expert runs on every
    token. ``aux["loss"]`` is ``w_importance * CV(Importance)^2``; ``load`` is the count of
    selections, i.e. ``N`` for every expert.
    """

    def __init__(self, d_model: int, n_experts: int, w_importance: float = 0.0) -> None:
        super().__init__()
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_experts, "n_experts")
        _check_weight(w_importance, "w_importance")
        self.d_model, self.n_experts, self.k = d_model, n_experts, n_experts
        self.w_importance = float(w_importance)
        self.w_gate = _zero_linear(d_model, n_experts)

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        logits = self.w_gate(x)
        probs = torch.softmax(logits, dim=-1)
        indices = torch.arange(self.n_experts, device=x.device).expand(x.shape[0], -1)
        importance = probs.sum(0)
        loss = self.w_importance * cv_squared(importance)
        aux = {"loss": loss, "importance": importance, "load": _selection_counts(probs)}
        return GateOutput(weights=probs, indices=indices, probs=probs, logits=logits, aux=aux)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_experts={self.n_experts}, w_importance={self.w_importance}"


def noisy_top_k(
    clean: Tensor, noise_logits: Tensor | None, k: int, add_noise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Shared core of the noisy top-k gates, along the last axis of ``clean``.

    ``H = clean + N(0, 1) * softplus(noise_logits)`` when ``add_noise`` (a fresh draw per entry),
    else ``H = clean``. Returns ``(probs, weights, indices, load_terms)`` where ``load_terms`` is
    the per-row contribution to Load: the smooth estimator ``P(x, i)`` when noise was added, the
    hard indicator ``G(x)_i > 0`` otherwise (Shazeer's reference does the same).
    """
    if add_noise:
        if noise_logits is None:
            raise ValueError("noise_logits are required when add_noise is True")
        noise_std = F.softplus(noise_logits)
        h = clean + torch.randn_like(clean) * noise_std
    else:
        h = clean
    probs, weights, indices = top_k_gating(h, k)
    if add_noise and k < clean.shape[-1]:
        load_terms = prob_in_top_k(clean, h, noise_std, k)
    else:
        load_terms = (probs > 0).to(probs.dtype)
    return probs, weights, indices, load_terms


def balance_aux(importance: Tensor, load: Tensor, w_importance: float, w_load: float) -> dict[str, Tensor]:
    """The Shazeer balancing terms every noisy gate reports: weighted CV^2 losses plus the raw vectors."""
    imp_loss = w_importance * cv_squared(importance)
    ld_loss = w_load * cv_squared(load)
    return {
        "loss": imp_loss + ld_loss,
        "importance_loss": imp_loss,
        "load_loss": ld_loss,
        "importance": importance,
        "load": load,
    }


class NoisyTopKGate(nn.Module):
    """Shazeer et al. (2017) noisy top-k gate with importance and load losses.

    ``H(x) = x W_g + StandardNormal() * Softplus(x W_noise)`` in training mode (``noisy=True``);
    in eval mode, or with ``noisy=False``, ``H(x) = x W_g``. ``G(x) = Softmax(KeepTopK(H(x), k))``.
    With noise, ``W_g`` and ``W_noise`` are zero-initialised (the paper's choice), so at step 0 the
    clean logits are 0, the noise std is ``ln 2`` for every expert and the selection is uniform at
    random. Without noise nothing would break the ties of a zero ``W_g``, so it is drawn from
    ``N(0, init_std^2)`` instead.

    ``aux``: ``importance = sum_x G(x)``; ``load = sum_x P(x, i)`` (smooth estimator) when noise is
    on, else the selection counts; ``importance_loss = w_importance * CV^2(importance)``,
    ``load_loss = w_load * CV^2(load)``, ``loss`` = their sum.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        k: int,
        noisy: bool = True,
        w_importance: float = 0.0,
        w_load: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_experts, "n_experts")
        check_k(k, n_experts)
        _check_weight(w_importance, "w_importance")
        _check_weight(w_load, "w_load")
        self.d_model, self.n_experts, self.k = d_model, n_experts, k
        self.noisy = bool(noisy)
        self.w_importance, self.w_load = float(w_importance), float(w_load)
        self.w_gate = _gate_linear(d_model, n_experts, self.noisy, init_std)
        self.w_noise = _zero_linear(d_model, n_experts) if self.noisy else None

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        clean = self.w_gate(x)
        add_noise = self.noisy and self.training
        noise_logits = self.w_noise(x) if add_noise else None
        probs, weights, indices, load_terms = noisy_top_k(clean, noise_logits, self.k, add_noise)
        importance = probs.sum(0)
        load = load_terms.sum(0)
        aux = balance_aux(importance, load, self.w_importance, self.w_load)
        if add_noise:  # what the noise-free (eval, inference) routing would pick: training reports its load
            aux["clean_indices"] = clean.detach().topk(self.k, dim=-1).indices
        return GateOutput(weights=weights, indices=indices, probs=probs, logits=clean, aux=aux)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_experts={self.n_experts}, k={self.k}, noisy={self.noisy}, "
            f"w_importance={self.w_importance}, w_load={self.w_load}"
        )


@dataclass(frozen=True)
class Hierarchy:
    """The shape of a :class:`HierarchicalGate`: ``n_groups`` groups of ``experts_per_group``
    experts, ``k_primary`` groups and ``k_secondary`` experts of each chosen group per token."""

    n_groups: int
    experts_per_group: int
    k_primary: int
    k_secondary: int


class HierarchicalGate(nn.Module):
    """Two-level hierarchical gate (Shazeer et al. 2017, Appendix B).

    ``a = n_groups`` groups of ``b = experts_per_group`` experts, flat expert id ``i * b + j``.
    A primary noisy top-``k_primary`` gate picks groups; each group ``i`` has its own secondary
    noisy top-``k_secondary`` gate ``G_i``; the combined gate is
    ``G_H(x)_{i*b+j} = G_primary(x)_i * G_i(x)_j``, so ``k = k_primary * k_secondary`` experts are
    active and the weights sum to 1.

    All secondary gates are evaluated for every token in one batched einsum (``[N, a, b]``), which
    costs ``d * n`` per token like a flat gate; the paper's branching-factor saving is about which
    device holds which group, not about this arithmetic.

    Balancing (verbatim formulas): ``Importance_H(X)_{i,j} = sum_x G_primary(x)_i G_i(x)_j`` and
    ``Load_H(X)_{i,j} = Load_primary(X)_i * Load_i(X^(i))_j / |X^(i)|`` with
    ``X^(i) = {x : G_primary(x)_i > 0}``. When ``|X^(i)| = 0`` (no token chose group i) the term is
    defined as 0 instead of 0/0. ``aux["loss"] = w_importance * CV^2(Importance_H) +
    w_load * CV^2(Load_H)``. Initialisation as in :class:`NoisyTopKGate`: zero with noise,
    ``N(0, init_std^2)`` without.

    ``logits`` are ``log_softmax(primary)_i + log_softmax(secondary_i)_j``, so that their softmax
    over all ``E`` experts is the dense (pre-top-k) product distribution. ``aux`` also holds
    ``primary_logits [N, a]``, ``secondary_logits [N, a, b]`` and ``group_counts [a]`` (``|X^(i)|``).
    """

    def __init__(
        self,
        d_model: int,
        hierarchy: Hierarchy,
        noisy: bool = True,
        w_importance: float = 0.0,
        w_load: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        n_groups, experts_per_group = hierarchy.n_groups, hierarchy.experts_per_group
        k_primary, k_secondary = hierarchy.k_primary, hierarchy.k_secondary
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_groups, "n_groups")
        _check_positive_int(experts_per_group, "experts_per_group")
        check_k(k_primary, n_groups, "k_primary")
        check_k(k_secondary, experts_per_group, "k_secondary")
        _check_weight(w_importance, "w_importance")
        _check_weight(w_load, "w_load")
        self.d_model, self.n_groups, self.experts_per_group = d_model, n_groups, experts_per_group
        self.n_experts = n_groups * experts_per_group
        self.k_primary, self.k_secondary = k_primary, k_secondary
        self.k = k_primary * k_secondary
        self.noisy = bool(noisy)
        self.w_importance, self.w_load = float(w_importance), float(w_load)
        self.w_gate = _gate_linear(d_model, n_groups, self.noisy, init_std)
        self.w_noise = _zero_linear(d_model, n_groups) if self.noisy else None
        secondary = torch.zeros(n_groups, d_model, experts_per_group)
        self.w_gate_secondary = nn.Parameter(secondary if self.noisy else secondary.normal_(std=init_std))
        self.w_noise_secondary = (
            nn.Parameter(torch.zeros(n_groups, d_model, experts_per_group)) if self.noisy else None
        )

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        n, a, b = x.shape[0], self.n_groups, self.experts_per_group
        add_noise = self.noisy and self.training

        clean_p = self.w_gate(x)
        noise_p = self.w_noise(x) if add_noise else None
        probs_p, w_p, idx_p, load_terms_p = noisy_top_k(clean_p, noise_p, self.k_primary, add_noise)

        clean_s = torch.einsum("nd,adb->nab", x, self.w_gate_secondary)
        noise_s = torch.einsum("nd,adb->nab", x, self.w_noise_secondary) if add_noise else None
        probs_s, w_s, idx_s, load_terms_s = noisy_top_k(clean_s, noise_s, self.k_secondary, add_noise)

        probs = (probs_p.unsqueeze(-1) * probs_s).reshape(n, a * b)
        gather_idx = idx_p.unsqueeze(-1).expand(-1, -1, self.k_secondary)
        weights = (w_p.unsqueeze(-1) * w_s.gather(1, gather_idx)).reshape(n, self.k)
        indices = (idx_p.unsqueeze(-1) * b + idx_s.gather(1, gather_idx)).reshape(n, self.k)

        in_group = probs_p > 0  # x in X^(i)
        group_counts = in_group.sum(0).to(probs.dtype)  # |X^(i)|
        load_primary = load_terms_p.sum(0)  # [a]
        load_secondary = (load_terms_s * in_group.unsqueeze(-1).to(probs.dtype)).sum(0)  # [a, b]
        safe_counts = group_counts.clamp(min=1.0).unsqueeze(-1)
        load = torch.where(
            group_counts.unsqueeze(-1) > 0,
            load_primary.unsqueeze(-1) * load_secondary / safe_counts,
            torch.zeros_like(load_secondary),
        ).reshape(a * b)
        importance = probs.sum(0)
        logits = (F.log_softmax(clean_p, -1).unsqueeze(-1) + F.log_softmax(clean_s, -1)).reshape(n, a * b)
        aux = {
            **balance_aux(importance, load, self.w_importance, self.w_load),
            "group_counts": group_counts,
            "primary_logits": clean_p,
            "secondary_logits": clean_s,
        }
        return GateOutput(weights=weights, indices=indices, probs=probs, logits=logits, aux=aux)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_groups={self.n_groups}, experts_per_group={self.experts_per_group}, "
            f"k_primary={self.k_primary}, k_secondary={self.k_secondary}, noisy={self.noisy}"
        )


def batchwise_mask(scores: Tensor, m: int) -> Tensor:
    """``M_batchwise(X, m)``: 1 where ``X_{j,i}`` is among the top m values of column i (bool ``[N, E]``).

    The sort runs along the batch axis, per expert, so every expert column has exactly m ones.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [N, E], got shape {tuple(scores.shape)}")
    check_k(m, scores.shape[0], "m")
    top_rows = scores.topk(m, dim=0).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter(0, top_rows, True)


class BatchwiseBalancedGate(nn.Module):
    """Strictly balanced gate (Shazeer et al. 2017, Appendix F).

    Scores ``X = Softmax(x W_g)`` (the dense gate ``G_sigma``). Training: ``M_batchwise`` keeps, for
    each expert, the ``m = max(1, k*|X| // n)`` examples with the highest score for it (exactly m per
    expert, ``n*m`` assignments, k per example on average only); the gate is the masked scores
    renormalised per row. Inference (eval mode): ``M_threshold(x, T)_i = [x_i > T_i]`` with learned
    thresholds ``T [n]`` (initialised to ``1/n``), since a batch-dependent mask cannot be used on
    single inputs; each row's selection then depends on that row alone.

    ``T`` is trained by ``L_batchwise = sum_j sum_i (M_threshold(X_j, T)_i - M_batchwise_{j,i}) *
    (X_{j,i} - T_i)``, evaluated per row j (the paper's ``M_threshold(x, T)`` inside the sum over j
    is read as ``x = X_j``). Scores are detached in it, so it moves only ``T`` (up where the
    threshold admits too much, down where it admits too little) and never the router.
    ``aux["threshold_loss"]`` holds it (training only); ``aux["loss"] = w_threshold *
    threshold_loss``.

    The number of experts per example varies, so ``GateOutput`` rows are padded to the widest row
    (see ``mask``). A row that selects no expert (possible in both modes) has all-zero weights and
    its output is just the residual. ``load`` counts selections; ``importance`` sums gate values.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        k: int,
        w_threshold: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_experts, "n_experts")
        check_k(k, n_experts)
        _check_weight(w_threshold, "w_threshold")
        self.d_model, self.n_experts, self.k = d_model, n_experts, k
        self.w_threshold = float(w_threshold)
        self.w_gate = _normal_linear(d_model, n_experts, init_std)
        self.thresholds = nn.Parameter(torch.full((n_experts,), 1.0 / n_experts))

    def examples_per_expert(self, batch_size: int) -> int:
        """``m = k|X|/n``, floored, at least 1 and at most the batch size."""
        return min(batch_size, max(1, (self.k * batch_size) // self.n_experts))

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        if x.shape[0] == 0:
            raise ValueError("BatchwiseBalancedGate needs a non-empty batch")
        logits = self.w_gate(x)
        scores = torch.softmax(logits, dim=-1)
        threshold_mask = scores.detach() > self.thresholds.detach()
        aux: dict[str, Tensor] = {}
        if self.training:
            selected = batchwise_mask(scores.detach(), self.examples_per_expert(x.shape[0]))
            disagreement = threshold_mask.to(scores.dtype) - selected.to(scores.dtype)
            threshold_loss = (disagreement * (scores.detach() - self.thresholds)).sum()
            aux["threshold_loss"] = threshold_loss
            aux["loss"] = self.w_threshold * threshold_loss
        else:
            selected = threshold_mask
            aux["loss"] = scores.new_zeros(())
        masked = scores * selected.to(scores.dtype)
        total = masked.sum(-1, keepdim=True)
        probs = torch.where(total > 0, masked / total.clamp(min=torch.finfo(scores.dtype).tiny), masked)
        weights, indices, mask = _pack_selection(selected, probs)
        aux["importance"] = probs.sum(0)
        aux["load"] = selected.sum(0).to(scores.dtype)
        aux["threshold_agreement"] = (threshold_mask == selected).float().mean()
        return GateOutput(weights=weights, indices=indices, probs=probs, logits=logits, aux=aux, mask=mask)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_experts={self.n_experts}, k={self.k}, w_threshold={self.w_threshold}"
        )


class ExpertChoiceGate(nn.Module):
    """Expert-choice routing (Zhou et al. 2022): each expert takes its top-C tokens.

    Scores ``S = Softmax(x W_g)`` over experts; every expert picks the ``C`` tokens with the highest
    score for it (sort along the token axis), ``C = switch_capacity(N, E, capacity_factor, minimum)``
    (``capacity_factor`` = average experts per token). Load is exactly ``C`` per expert by
    construction, so there is no balancing loss; a token may get 0..E experts, each weighted by its
    un-renormalised score ``S[token, expert]`` (as in the paper). Token-major ``GateOutput`` rows are
    padded (see ``mask``); the expert-major form is in ``aux["expert_tokens"]`` and
    ``aux["expert_weights"]`` (both ``[E, C]``), which a layer can dispatch directly.

    Not causal: the top-C sort runs over every row of ``x``, so in a causal LM a token's experts
    depend on later tokens of its sequence (a future-token leak, in eval mode too); the LM warns
    when it is selected (``router_type="expert_choice"``, ``moee.moe.gate_registry``).
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        capacity_factor: float = 1.0,
        minimum_capacity: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_experts, "n_experts")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.d_model, self.n_experts = d_model, n_experts
        self.capacity_factor, self.minimum_capacity = float(capacity_factor), int(minimum_capacity)
        self.w_gate = _normal_linear(d_model, n_experts, init_std)

    def capacity(self, tokens: int) -> int:
        return switch_capacity(tokens, self.n_experts, self.capacity_factor, self.minimum_capacity)

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        if x.shape[0] == 0:
            raise ValueError("ExpertChoiceGate needs a non-empty batch")
        logits = self.w_gate(x)
        scores = torch.softmax(logits, dim=-1)
        c = min(self.capacity(x.shape[0]), x.shape[0])
        expert_weights, token_idx = scores.topk(c, dim=0)  # [C, E]
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter(0, token_idx, True)
        probs = scores * selected.to(scores.dtype)
        weights, indices, mask = _pack_selection(selected, probs)
        aux = {
            "loss": scores.new_zeros(()),
            "importance": probs.sum(0),
            "load": selected.sum(0).to(scores.dtype),
            "expert_tokens": token_idx.t().contiguous(),
            "expert_weights": expert_weights.t().contiguous(),
            "capacity": torch.tensor(c),
            "unrouted_tokens": (~selected.any(1)).sum(),
        }
        return GateOutput(weights=weights, indices=indices, probs=probs, logits=logits, aux=aux, mask=mask)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_experts={self.n_experts}, capacity_factor={self.capacity_factor}"


class LossFreeBalancedGate(nn.Module):
    """Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3).

    A per-expert bias ``b`` (a buffer, not a parameter) is added to the scores *for selection only*:
    ``indices = topk(s + b, k)``; the gate weights use the unbiased scores of the selected experts,
    renormalised, ``w_i = s_i / sum_selected s_j`` (for softmax scores this equals the softmax over
    the selected logits). ``score_func`` is ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"``.

    Update rule (DeepSeek-V3 convention; Wang et al. give no step size): after each training step,
    ``b_i += gamma * sign(mean_load - load_i)`` with ``load_i`` the number of selections of expert i
    in that step: underloaded experts are nudged up, overloaded ones down, balanced ones stay.
    With ``auto_update=True`` (default) the update is applied at the end of every training-mode
    forward (one forward per optimiser step, the common case); with ``auto_update=False`` the loads
    accumulate until :meth:`update_bias` is called (e.g. once per step with gradient accumulation). Eval-mode forwards never change the bias. No loss:
    ``aux["loss"]`` is 0; ``aux["bias"]`` is a copy of the bias used for this forward.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        k: int,
        gamma: float = 1e-3,
        score_func: str = "sigmoid",
        auto_update: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        _check_positive_int(d_model, "d_model")
        _check_positive_int(n_experts, "n_experts")
        check_k(k, n_experts)
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")
        if not gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.d_model, self.n_experts, self.k = d_model, n_experts, k
        self.gamma, self.score_func, self.auto_update = float(gamma), score_func, bool(auto_update)
        self.w_gate = _normal_linear(d_model, n_experts, init_std)
        self.register_buffer("bias", torch.zeros(n_experts))
        self.register_buffer("pending_load", torch.zeros(n_experts), persistent=False)

    def scores(self, logits: Tensor) -> Tensor:
        return torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)

    @torch.no_grad()
    def update_bias(self, load: Tensor | None = None) -> None:
        """Apply ``b += gamma * sign(mean(load) - load)`` with the given or accumulated load."""
        if load is None:
            load = self.pending_load
        if load.shape != self.bias.shape:
            raise ValueError(f"load must have shape [{self.n_experts}], got {tuple(load.shape)}")
        load = load.to(self.bias.dtype)
        if load.sum() > 0:
            self.bias.add_(self.gamma * torch.sign(load.mean() - load))
        self.pending_load.zero_()

    def forward(self, x: Tensor) -> GateOutput:
        _check_input(x, self.d_model)
        logits = self.w_gate(x)
        scores = self.scores(logits)
        bias = self.bias.clone()
        indices = (scores.detach() + bias).topk(self.k, dim=-1).indices
        selected_scores = scores.gather(1, indices)
        weights = selected_scores / selected_scores.sum(-1, keepdim=True)
        probs = torch.zeros_like(scores).scatter(1, indices, weights)
        load = torch.bincount(indices.reshape(-1), minlength=self.n_experts).to(scores.dtype)
        if self.training:
            self.pending_load.add_(load.detach().to(self.pending_load.dtype))
            if self.auto_update:
                self.update_bias()
        aux = {"loss": scores.new_zeros(()), "importance": probs.sum(0), "load": load, "bias": bias}
        return GateOutput(weights=weights, indices=indices, probs=probs, logits=logits, aux=aux)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_experts={self.n_experts}, k={self.k}, gamma={self.gamma}, "
            f"score_func={self.score_func!r}, auto_update={self.auto_update}"
        )


def init_unsaved_state(module: nn.Module) -> None:
    """Zero what a gate keeps but does not save (the loss-free gate's pending load).

    transformers' loader leaves a non-persistent buffer as uninitialised memory for the model's
    ``_init_weights`` to fill; a pending load of garbage would move the first training step's
    selection bias at random (two loads of one model then trained differently). ``moee_lm`` calls
    this from its ``_init_weights``; an upcycled model, whose gates the dense model's own
    ``_init_weights`` covers, from its ``initialize_weights``.
    """
    if isinstance(module, LossFreeBalancedGate):
        with torch.no_grad():
            module.pending_load.zero_()
