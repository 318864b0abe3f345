"""Top-k selection helpers and load-balancing losses for the from-scratch MoE.

Everything here is a pure tensor function so gates, the layer, the simulator and the tests
share one implementation of each formula (Shazeer et al. 2017; Fedus et al. 2021; Zoph et al. 2022):

* ``keep_top_k``: Shazeer's KeepTopK, non-top-k entries set to a literal ``-inf`` so the
  following softmax gives exact zeros (a finite mask value would leak ``exp(m) > 0``).
* ``cv_squared``: squared coefficient of variation with the *population* std (ddof=0); this
  is the convention that gives the worked toy value ``CV^2([25, 10, 1]) = 0.6806``.
* ``kth_excluding`` / ``prob_in_top_k``: the smooth load estimator
  ``P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_std_i)``.
* ``importance_loss`` / ``load_loss``: ``CV(Importance)^2`` and ``CV(Load)^2``.
* ``switch_aux_loss``: ``alpha * E * sum_i f_i * P_i`` with ``f`` counted before capacity.
* ``router_z_loss``: mean squared log-sum-exp of the router logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "keep_top_k",
    "cv_squared",
    "kth_excluding",
    "prob_in_top_k",
    "importance_loss",
    "load_loss",
    "switch_aux_loss",
    "router_z_loss",
]


def check_k(k: int, n: int, name: str = "k") -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name} must be an int, got {type(k).__name__}")
    if not 1 <= k <= n:
        raise ValueError(f"{name} must be in [1, {n}] (the number of experts), got {k}")


def keep_top_k(v: Tensor, k: int) -> Tensor:
    """KeepTopK(v, k) along the last axis: keep the k largest values, set the rest to ``-inf``.

    Ties are broken by ``torch.topk`` (a fixed, deterministic order on CPU). The kept values are
    the originals, so gradients flow to them; the ``-inf`` entries get no gradient.
    """
    return keep_top_k_with_indices(v, k)[0]


def keep_top_k_with_indices(v: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`keep_top_k` plus the kept indices ``[..., k]`` in decreasing order of value."""
    if not v.is_floating_point():
        raise TypeError(f"keep_top_k needs a floating-point tensor (it writes -inf), got {v.dtype}")
    check_k(k, v.shape[-1])
    top_vals, top_idx = v.topk(k, dim=-1)
    if k == v.shape[-1]:
        return v, top_idx
    return torch.full_like(v, float("-inf")).scatter(-1, top_idx, top_vals), top_idx


def cv_squared(v: Tensor, eps: float = 1e-10) -> Tensor:
    """Squared coefficient of variation ``var(v) / mean(v)^2`` with the population variance (ddof=0).

    The papers never state the std convention; ddof=0 is the one that matches the worked toy
    value (CV^2([25,10,1]) = 98/144 = 0.6806; ddof=1 would give 1.0208). ``eps`` keeps an all-zero
    vector finite. A vector with fewer than two entries has no spread and returns 0.
    """
    if v.dim() != 1:
        raise ValueError(f"cv_squared expects a 1-D vector, got shape {tuple(v.shape)}")
    if v.dtype != torch.float64:
        v = v.float()
    if v.numel() < 2:
        return v.new_zeros(())
    return v.var(unbiased=False) / (v.mean() ** 2 + eps)


def kth_excluding(h: Tensor, k: int) -> Tensor:
    """``kth_excluding(H, k, i)`` for every i at once: the k-th largest of H over all entries but i.

    Vectorised with the k-th and (k+1)-th largest values of H: removing an entry that is itself
    in the top k promotes the (k+1)-th value to k-th place; removing any other entry leaves the
    k-th value unchanged. Membership uses the indices ``topk`` returns, so ties are consistent.
    When ``k == E`` nothing is left to compete with (only E-1 others), so the threshold is ``-inf``.
    """
    n = h.shape[-1]
    check_k(k, n)
    if k == n:
        return torch.full_like(h, float("-inf"))
    top_vals, top_idx = h.topk(k + 1, dim=-1)
    kth = top_vals[..., k - 1 : k]
    k_plus_1th = top_vals[..., k : k + 1]
    in_top = torch.zeros_like(h, dtype=torch.bool).scatter(-1, top_idx[..., :k], True)
    return torch.where(in_top, k_plus_1th, kth)


def prob_in_top_k(clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int) -> Tensor:
    """Shazeer's smooth load estimator ``P(x, i)``, shape like the logits.

    ``P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_std_i)``: the probability that expert
    i stays in the top k when only its own noise is redrawn (the others' noisy logits held fixed).
    It is differentiable in the clean logits and the noise std, unlike the hard selection count.
    """
    if clean_logits.shape != noisy_logits.shape or clean_logits.shape != noise_std.shape:
        raise ValueError(
            "clean_logits, noisy_logits and noise_std must have the same shape, got "
            f"{tuple(clean_logits.shape)}, {tuple(noisy_logits.shape)}, {tuple(noise_std.shape)}"
        )
    threshold = kth_excluding(noisy_logits, k)
    # softplus can underflow to exactly 0 for very negative inputs; keep the ratio defined there
    safe_std = noise_std.clamp_min(torch.finfo(noise_std.dtype).tiny)
    return torch.special.ndtr((clean_logits - threshold) / safe_std)


def importance_loss(gates: Tensor) -> Tensor:
    """``CV(Importance(X))^2`` where ``Importance(X) = sum_x G(x)`` (gates ``[N, E]``); unweighted."""
    if gates.dim() != 2:
        raise ValueError(f"importance_loss expects gates [N, E], got shape {tuple(gates.shape)}")
    return cv_squared(gates.sum(0))


def load_loss(load: Tensor) -> Tensor:
    """``CV(Load(X))^2`` for a per-expert load vector ``[E]`` (smooth estimate or counts); unweighted."""
    return cv_squared(load)


def switch_aux_loss(probs: Tensor, expert_index: Tensor, alpha: float = 0.01) -> Tensor:
    """Switch Transformer balancing loss ``alpha * E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of tokens whose top-1 choice is expert i, counted *before* capacity
    filtering (overflowed tokens still count) and carrying no gradient; ``P_i`` is the mean router
    probability, through which the gradient flows. Uniform routing gives exactly ``alpha``.
    """
    if probs.dim() != 2:
        raise ValueError(f"switch_aux_loss expects probs [T, E], got shape {tuple(probs.shape)}")
    if expert_index.shape != probs.shape[:1]:
        raise ValueError(f"expert_index must have shape [{probs.shape[0]}], got {tuple(expert_index.shape)}")
    n_experts = probs.shape[1]
    fractions = torch.nn.functional.one_hot(expert_index, n_experts).to(probs.dtype).mean(0)
    return alpha * n_experts * (fractions.detach() * probs.mean(0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean_x logsumexp(logits(x))^2``: keeps router logits small (ST-MoE)."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"router_z_loss expects logits [..., E], got shape {tuple(logits.shape)}")
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
