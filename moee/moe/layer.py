"""The sparse MoE layer: a gate, experts stored as 3-D weights, and sort-based dispatch.

Dispatch scales with the number of (token, slot) assignments, not with tokens x experts:
the N*k assignments are sorted by expert, each expert runs once on its contiguous slice
(one matmul pair per expert), and the weighted outputs
are scattered back with `index_add_`. There is no Python loop over tokens and no dense
`[tokens, experts, capacity]` tensor. Experts whose slice is empty are skipped, so they
receive exactly zero gradient ("wherever G(x)_i = 0, we need not compute E_i(x)").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moee.moe.gates import NoisyTopKGate

ACTIVATIONS = ("relu", "gelu", "swiglu")

# Set to False to force the per-expert loop (tests compare both paths).
USE_GROUPED_MM = True


def _use_grouped_mm(experts: Experts, x: torch.Tensor) -> bool:
    """torch._grouped_mm (a private op) on CPU for float32; it needs 16-byte aligned row strides."""
    return (
        USE_GROUPED_MM
        and hasattr(torch, "_grouped_mm")
        and x.device.type == "cpu"
        and x.dtype == experts.w_in.dtype == torch.float32
        and experts.d_model % 4 == 0
        and experts.d_hidden % 4 == 0
    )


class MoEERouter(nn.Module):
    """Wraps any gate so the module looks like a transformers MoE router.

    transformers' MoE routers (OLMoE, Qwen-MoE, ...) return a tuple whose element 0 is the
    clean router logits `[N, E]`; `_can_record_outputs["router_logits"]` records that
    element. Wrapping the gate keeps that contract for every gate in `moee.moe.gates`
    (all of which return a `GateOutput`), so router capture needs no special case.

    forward(hidden [.., d]) -> (logits [N, E], weights [N, k], indices [N, k], GateOutput)
    """

    def __init__(self, gate: nn.Module, n_experts: int, k: int):
        super().__init__()
        self.gate = gate
        for sub in gate.modules():
            # lets an owning PreTrainedModel's _init_weights recognise (and keep) router weights
            sub._moee_router_part = True
        self.num_experts = int(n_experts)
        self.top_k = int(k)

    @property
    def scoring_rule(self) -> str:
        """The capture registry's name for how this router scores experts (see
        `moee.capture.registry.RULES`): loss-free gates select on sigmoid/softmax scores shifted
        by a bias that never enters the weights; every other gate here is a softmax router."""
        score_func = getattr(self.gate, "score_func", None)
        if score_func == "sigmoid":
            return "sigmoid_bias"
        if score_func == "softmax":
            return "softmax_bias"
        return "softmax"

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """The loss-free gate's selection-only bias `[E]` (None for other gates): capture adds it to
        the scores to reproduce the router's own top-k (`moee.capture.registry.selection_scores`)."""
        if getattr(self.gate, "score_func", None) is None:
            return None
        bias = getattr(self.gate, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.gate(flat)
        return out.logits, out.weights, out.indices, out


class Experts(nn.Module):
    """`n_experts` independent feed-forward experts stored as 3-D weights.

    `w_in [E, d_model, h]` (`[E, d_model, 2h]` for SwiGLU: gate half then up half) and
    `w_out [E, h, d_model]`; expert `e` computes `act(x @ w_in[e]) @ w_out[e]`. Storing
    the experts as two tensors (instead of a ModuleList of Linear layers) keeps the
    checkpoint compact and lets dispatch index an expert without module overhead.
    """

    def __init__(self, n_experts: int, d_model: int, d_hidden: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if min(n_experts, d_model, d_hidden) <= 0:
            raise ValueError(
                f"n_experts, d_model and d_hidden must be positive, got {n_experts}, {d_model}, {d_hidden}"
            )
        self.n_experts = n_experts
        self.d_model = d_model
        self.d_hidden = d_hidden
        self.activation = activation
        width = 2 * d_hidden if activation == "swiglu" else d_hidden
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, width))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_hidden, d_model))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        """Every expert drawn from the same distribution (same blueprint, same init)."""
        std_in = std if std is not None else 1.0 / math.sqrt(self.d_model)
        std_out = std if std is not None else 1.0 / math.sqrt(self.d_hidden)
        nn.init.normal_(self.w_in, std=std_in)
        nn.init.normal_(self.w_out, std=std_out)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) * u
        if self.activation == "relu":
            return F.relu(h)
        return F.gelu(h)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Run expert `e` on the rows `x [n_e, d_model]` (the per-expert reference path)."""
        return self._activate(x @ self.w_in[e]) @ self.w_out[e]

    def grouped_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run every expert on its contiguous slice of `x_sorted` (rows sorted by expert).

        Uses torch's grouped matmul (one kernel for all experts) when available, else one
        matmul pair per non-empty expert. Both give identical results; empty experts are not
        touched, so their weights get exactly zero gradient.
        """
        if _use_grouped_mm(self, x_sorted):
            offs = torch.tensor(counts, device=x_sorted.device).cumsum(0).to(torch.int32)
            h = self._activate(torch._grouped_mm(x_sorted, self.w_in, offs=offs))
            return torch._grouped_mm(h, self.w_out, offs=offs)
        w_in, w_out = self.w_in.unbind(0), self.w_out.unbind(0)
        pieces = [
            self._activate(chunk @ w_in[e]) @ w_out[e]
            for e, chunk in enumerate(torch.split(x_sorted, counts))
            if counts[e]
        ]
        return torch.cat(pieces) if pieces else x_sorted.new_zeros(0, self.d_model)

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        slot_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Weighted sum of each row's selected experts: `y_n = sum_j weights[n,j] * E_{indices[n,j]}(x_n)`."""
        return dispatch_combine(x, weights, indices, self, slot_mask)


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: Experts,
    slot_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sort (token, slot) pairs by expert, run each expert once on its slice, scatter back.

    x: [N, d]; weights, indices: [N, k]; slot_mask [N, k] (bool, optional) marks the real
    selections of gates that pad a variable number of experts per token (padded slots are
    skipped, not computed). Returns [N, experts.d_model] in x's dtype (experts whose input is not
    the model width, such as the adapters of `moee.moe.upcycled.LoRAExperts`, map d to d_model).
    """
    if x.dim() != 2 or weights.shape != indices.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected x [N, d] and weights/indices [N, k], got {tuple(x.shape)}, "
            f"{tuple(weights.shape)}, {tuple(indices.shape)}"
        )
    n_tokens, k = indices.shape
    flat_expert = indices.reshape(-1)
    flat_weight = weights.reshape(-1)
    flat_token = torch.arange(n_tokens, device=x.device).repeat_interleave(k)
    if slot_mask is not None:
        keep = slot_mask.reshape(-1).bool()
        flat_expert, flat_weight, flat_token = flat_expert[keep], flat_weight[keep], flat_token[keep]
    if flat_expert.numel() and (int(flat_expert.min()) < 0 or int(flat_expert.max()) >= experts.n_experts):
        raise ValueError(f"expert indices must lie in [0, {experts.n_experts}), got out-of-range values")
    order = torch.argsort(flat_expert, stable=True)
    token_of = flat_token.index_select(0, order)
    counts = torch.bincount(flat_expert, minlength=experts.n_experts).tolist()
    x_sorted = x.index_select(0, token_of)
    w_sorted = flat_weight.index_select(0, order).to(x.dtype)
    out = x.new_zeros(x.shape[0], experts.d_model)
    if token_of.numel() == 0:
        return out
    expert_out = experts.grouped_forward(x_sorted, counts) * w_sorted.unsqueeze(-1)
    return out.index_add(0, token_of, expert_out)


class SharedExperts(nn.Module):
    """`n_shared` always-active experts (DeepSeekMoE).

    A sum of n FFNs applied to the same input equals one FFN whose hidden layer is their
    concatenation, so the shared experts are stored as one dense FFN of width n * d_hidden.
    """

    def __init__(self, n_shared: int, d_model: int, d_hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.ffn = Experts(1, d_model, n_shared * d_hidden, activation)
        self.n_shared = n_shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn.expert_forward(0, x)


def _cv(v: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation with the population std (as `cv_squared`); 0 for an all-zero vector."""
    mean = v.mean()
    return torch.where(mean > 0, v.std(unbiased=False) / mean.clamp_min(1e-12), torch.zeros_like(mean))


#: a layer whose heaviest expert takes more than this many times the mean load is collapsed
#: (reported by `moee upcycle` and the trainer; the ceiling, every token on the same experts, is
#: experts / top-k)
COLLAPSE_MAX_OVER_MEAN = 2.0


def balance_stats(importance: torch.Tensor, load: torch.Tensor) -> dict[str, torch.Tensor]:
    """CV(importance), CV(load) and max/mean load: Shazeer et al. (2017), Table 6 (0 when empty)."""
    mean_load = load.mean()
    return {
        "cv_importance": _cv(importance),
        "cv_load": _cv(load),
        "max_over_mean_load": torch.where(
            mean_load > 0, load.max() / mean_load.clamp_min(1e-12), torch.zeros_like(mean_load)
        ),
    }


def routing_stats(
    probs: torch.Tensor,
    indices: torch.Tensor,
    n_experts: int,
    token_mask: torch.Tensor | None = None,
    slot_mask: torch.Tensor | None = None,
    clean_indices: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Balance statistics of one routing decision (detached).

    importance = sum of gate values per expert (Shazeer's Importance(X)); load = number of
    real selections per expert (the hard count that decides memory and straggler time; slots
    with ``slot_mask == False`` are not work); their CVs and max(load)/mean(load) are the balance
    columns of Shazeer et al. (2017), Table 6. ``dropped_tokens`` counts the tokens left with no
    real slot at all, so only their residual passes (Switch capacity overflow, or a token no
    expert chose); ``tokens`` is the number of rows counted (``token_mask`` drops padding).

    ``clean_indices [N, k]``: the experts the gate would pick without its training noise. A
    noisy gate spreads its training-time picks however collapsed its logits are, so the load of
    that noise-free decision (``clean_load``, ``clean_cv_load``, ``clean_max_over_mean_load``) is
    what matches the load of evaluation and inference (`noise_free_balance`).
    """
    with torch.no_grad():
        n_rows = indices.shape[0]
        slot_mask = torch.ones_like(indices, dtype=torch.bool) if slot_mask is None else slot_mask.bool()
        if token_mask is not None:
            keep = token_mask.reshape(-1).bool()
            probs, indices, slot_mask = probs[keep], indices[keep], slot_mask[keep]
            n_rows = int(keep.sum())
        importance = probs.float().sum(0)
        load = torch.bincount(indices[slot_mask], minlength=n_experts).float()
        stats = {
            "importance": importance,
            "load": load,
            **balance_stats(importance, load),
            "dropped_tokens": (~slot_mask.any(1)).sum().float(),
            "tokens": torch.tensor(float(n_rows)),
        }
        if clean_indices is not None:
            if token_mask is not None:
                clean_indices = clean_indices[token_mask.reshape(-1).bool()]
            clean = torch.bincount(clean_indices.reshape(-1), minlength=n_experts).float()
            clean_stats = balance_stats(importance, clean)
            stats["clean_load"] = clean
            stats["clean_cv_load"] = clean_stats["cv_load"]
            stats["clean_max_over_mean_load"] = clean_stats["max_over_mean_load"]
        return stats


def noise_free_balance(aux: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
    """``(load [E], cv_load, max_over_mean_load)`` of the noise-free routing decision of one
    layer's `routing_stats`: the ``clean_*`` figures when the gate added training noise, else
    the actual ones (the same statistic in training and evaluation)."""
    if "clean_load" in aux:
        return aux["clean_load"], float(aux["clean_cv_load"]), float(aux["clean_max_over_mean_load"])
    return aux["load"], float(aux["cv_load"]), float(aux["max_over_mean_load"])


class MoELayer(nn.Module):
    """Sparse MoE feed-forward layer: `y = sum_i G(x)_i E_i(x)` (+ shared experts).

    Fine-grained experts (DeepSeekMoE / OLMoE) are simply many experts with a small
    `d_expert`; shared experts are always active and added unweighted. The default gate is
    Shazeer's noisy top-k gate with zero-initialised `W_g` / `W_noise` and no balancing losses;
    for others pass the gate, e.g. `gate=NoisyTopKGate(d_model, n_experts, k, noisy=False)`.

    forward(x [..., d_model], token_mask=None) -> (y [..., d_model], aux) where aux holds
    `loss` (the gate's balancing losses, a differentiable scalar) and the routing statistics
    of `routing_stats` (token_mask excludes padding from the statistics only).
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        n_experts: int,
        k: int = 2,
        *,
        gate: nn.Module | None = None,
        n_shared_experts: int = 0,
        d_shared: int | None = None,
        activation: str = "swiglu",
    ):
        super().__init__()
        if not 1 <= k <= n_experts:
            raise ValueError(f"k must be in [1, n_experts={n_experts}], got {k}")
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {n_shared_experts}")
        if gate is None:
            gate = NoisyTopKGate(d_model, n_experts, k)
        self.d_model = d_model
        self.n_experts = n_experts
        self.k = k
        self.gate = MoEERouter(gate, n_experts, k)
        self.experts = Experts(n_experts, d_model, d_expert, activation)
        self.shared_experts = (
            SharedExperts(n_shared_experts, d_model, d_shared or d_expert, activation)
            if n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, indices, gate_out = self.gate(flat)
        y = self.experts(flat, weights, indices, gate_out.mask)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        aux = routing_stats(
            gate_out.probs,
            indices,
            self.n_experts,
            token_mask,
            gate_out.mask,
            gate_out.aux.get("clean_indices"),
        )
        loss = gate_out.aux.get("loss")
        aux["loss"] = loss if loss is not None else flat.new_zeros(())
        if "load" in gate_out.aux:
            aux["load_estimate"] = gate_out.aux["load"].detach()
        return y.reshape(shape), aux
