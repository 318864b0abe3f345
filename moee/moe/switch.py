"""Switch Transformer top-1 routing with expert capacity (Fedus et al. 2021), in steps 1-8.

Follows the reference mechanics of Mesh-TensorFlow's ``_rand_1_gating``:

1. float32, bias-free router ``logits = x @ W_r``; non-finite logits raise
   ``ValueError("router logits overflowed float32")``; ``probabilities = softmax(logits)``.
2. ``expert_index = argmax`` (ties go to the first expert); the gate is the selected probability,
   **not** renormalised, so top-1 routing still trains the router through it.
3. ``capacity = max(minimum, min(T, int(T * capacity_factor / E)))``; slot positions come from an
   exclusive cumsum over tokens, so earlier tokens win the slots.
4. ``accepted = positions < capacity``; ``f = mean(one_hot(expert_index))`` counted *before*
   filtering (no gradient).
5. ``dispatch [T, E, C]`` (bool, one slot per accepted token, at most one token per slot) and
   ``expert_inputs = einsum("tec,td->ecd")``.
6. bias-free ReLU experts ``W1 [E, D, H]``, ``W2 [E, H, D]``; non-finite outputs raise
   ``ValueError("expert outputs overflowed float32")``.
7. ``combine = dispatch * gate``; ``output = x + einsum("tec,ecd->td")``: overflow tokens keep their
   input unchanged; a non-finite result raises ``ValueError("residual output overflowed float32")``.
8. ``aux = alpha * E * sum_i f_i * P_i`` with ``P = mean(probabilities)`` and ``alpha = 0.01``.

The dense ``[T, E, C]`` dispatch/combine tensors are what capacity-limited routing needs; the
general sparse layer (``moee.moe.layer``) does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moee.moe.gates import GateOutput, switch_capacity
from moee.moe.losses import switch_aux_loss

__all__ = [
    "switch_capacity",
    "SwitchRouting",
    "switch_route",
    "SwitchRouter",
    "SwitchFFN",
    "switch_ffn_reference",
]

DEFAULT_ALPHA = 0.01


@dataclass
class SwitchRouting:
    """Every intermediate of one Switch routing decision (steps 1-5 and 8)."""

    logits: Tensor  # [T, E] float32
    probabilities: Tensor  # [T, E]
    expert_index: Tensor  # [T] long, argmax (first on ties)
    gate: Tensor  # [T] selected probability, not renormalised
    capacity: int
    positions: Tensor  # [T] long, zero-based slot from the exclusive cumsum
    accepted: Tensor  # [T] bool, positions < capacity
    fractions: Tensor  # [E] f_i, before capacity, no grad
    mean_probabilities: Tensor  # [E] P_i
    dispatch: Tensor  # [T, E, C] bool
    combine: Tensor  # [T, E, C] float32, dispatch * gate
    aux_loss: Tensor  # alpha * E * sum f_i P_i

    @property
    def overflow(self) -> Tensor:
        return ~self.accepted


def switch_route(
    logits: Tensor, capacity_factor: float, minimum_capacity: int = 1, alpha: float = DEFAULT_ALPHA
) -> SwitchRouting:
    """Steps 1 (from logits on), 2-5 and 8: top-1 choice, capacity, slots, dispatch/combine, aux loss."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if not torch.isfinite(logits).all():
        raise ValueError("router logits overflowed float32")
    tokens, experts = logits.shape
    probabilities = logits.softmax(-1)
    expert_index = probabilities.argmax(-1)  # torch returns the first maximal index on ties
    gate = probabilities.gather(1, expert_index[:, None]).squeeze(1)
    chosen = F.one_hot(expert_index, experts)  # [T, E] int64

    capacity = switch_capacity(tokens, experts, capacity_factor, minimum_capacity)
    exclusive_counts = chosen.cumsum(0) - chosen
    positions = (exclusive_counts * chosen).sum(-1)
    accepted = positions < capacity
    fractions = chosen.float().mean(0)

    token_ids = accepted.nonzero(as_tuple=True)[0]
    dispatch = torch.zeros(tokens, experts, capacity, dtype=torch.bool, device=logits.device)
    dispatch[token_ids, expert_index[accepted], positions[accepted]] = True
    combine = dispatch.float() * gate[:, None, None]
    aux_loss = switch_aux_loss(probabilities, expert_index, alpha)
    return SwitchRouting(
        logits=logits,
        probabilities=probabilities,
        expert_index=expert_index,
        gate=gate,
        capacity=capacity,
        positions=positions,
        accepted=accepted,
        fractions=fractions,
        mean_probabilities=probabilities.mean(0),
        dispatch=dispatch,
        combine=combine,
        aux_loss=aux_loss,
    )


def _check_tokens(x: Tensor, d_model: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != d_model:
        raise ValueError(f"input must have shape [T, {d_model}], got {tuple(x.shape)}")


class SwitchRouter(nn.Module):
    """Float32, bias-free top-1 Switch router ``W_r [D, E]`` with capacity (steps 1-5, 8).

    ``route(x)`` returns the full :class:`SwitchRouting`; ``forward(x)`` returns a
    :class:`GateOutput` with ``k = 1``: ``weights`` = gate for accepted tokens and 0 for overflow
    tokens (``mask`` = accepted), ``probs`` the same value scattered at the chosen expert,
    ``logits`` the float32 router logits, and ``aux`` = ``loss`` (the Switch aux loss, already
    weighted by ``alpha``), ``importance`` (sum of probabilities), ``load`` (top-1 counts before
    capacity), ``fractions``, ``dropped_tokens``, ``capacity``, ``positions``.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        capacity_factor: float = 1.25,
        minimum_capacity: int = 1,
        alpha: float = DEFAULT_ALPHA,
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        if d_model < 1 or n_experts < 1:
            raise ValueError(f"d_model and n_experts must be >= 1, got {d_model}, {n_experts}")
        switch_capacity(1, n_experts, capacity_factor, minimum_capacity)  # validates the arguments
        self.d_model, self.n_experts = d_model, n_experts
        self.capacity_factor, self.minimum_capacity, self.alpha = (
            float(capacity_factor),
            minimum_capacity,
            alpha,
        )
        std = init_std if init_std is not None else d_model**-0.5
        self.weight = nn.Parameter(torch.randn(d_model, n_experts) * std)

    def route(self, x: Tensor) -> SwitchRouting:
        _check_tokens(x, self.d_model)
        logits = x.float() @ self.weight.float()
        return switch_route(logits, self.capacity_factor, self.minimum_capacity, self.alpha)

    def forward(self, x: Tensor) -> GateOutput:
        r = self.route(x)
        weights = (r.gate * r.accepted.float())[:, None]
        indices = r.expert_index[:, None]
        probs = torch.zeros_like(r.probabilities).scatter(1, indices, weights)
        aux = {
            "loss": r.aux_loss,
            "importance": r.probabilities.sum(0),
            "load": r.fractions * x.shape[0],
            "fractions": r.fractions,
            "dropped_tokens": (~r.accepted).sum(),
            "capacity": torch.tensor(r.capacity),
            "positions": r.positions,
        }
        return GateOutput(
            weights=weights, indices=indices, probs=probs, logits=r.logits, aux=aux, mask=r.accepted[:, None]
        )


class SwitchFFN(nn.Module):
    """Switch FFN block with its residual: ``y = x + sum_e combine * ReLU-FFN_e(dispatch(x))``.

    ``forward(x [T, D]) -> (y [T, D], aux)``; ``aux`` has ``loss`` (alpha*E*sum f_i P_i),
    ``fractions``, ``accepted``, ``dropped_tokens``, ``capacity``. Padded (unused) slots are
    computed like the reference does; their combine weight is 0.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        capacity_factor: float = 1.25,
        minimum_capacity: int = 1,
        alpha: float = DEFAULT_ALPHA,
    ) -> None:
        super().__init__()
        if d_ff < 1:
            raise ValueError(f"d_ff must be >= 1, got {d_ff}")
        self.router = SwitchRouter(d_model, n_experts, capacity_factor, minimum_capacity, alpha)
        self.w1 = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * d_model**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) * d_ff**-0.5)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        r = self.router.route(x)
        inputs = x.float()
        expert_inputs = torch.einsum("tec,td->ecd", r.dispatch.float(), inputs)
        hidden = torch.einsum("ecd,edh->ech", expert_inputs, self.w1.float()).relu()
        expert_outputs = torch.einsum("ech,ehd->ecd", hidden, self.w2.float())
        if not torch.isfinite(expert_outputs).all():
            raise ValueError("expert outputs overflowed float32")
        branch = torch.einsum("tec,ecd->td", r.combine, expert_outputs)
        output = inputs + branch
        if not torch.isfinite(output).all():
            raise ValueError("residual output overflowed float32")
        aux = {
            "loss": r.aux_loss,
            "fractions": r.fractions,
            "accepted": r.accepted,
            "dropped_tokens": (~r.accepted).sum(),
            "capacity": torch.tensor(r.capacity),
        }
        return output, aux


def switch_ffn_reference(
    x: Tensor,
    router_weight: Tensor,
    w1: Tensor,
    w2: Tensor,
    capacity_factor: float,
    minimum_capacity: int = 1,
) -> Tensor:
    """Per-token loop reference for :class:`SwitchFFN` (tests only: O(T) Python iterations).

    Tokens are visited in order; each goes to its argmax expert if that expert still has a free
    slot, and otherwise keeps its input unchanged.
    """
    tokens, experts = x.shape[0], router_weight.shape[1]
    capacity = switch_capacity(tokens, experts, capacity_factor, minimum_capacity)
    used = [0] * experts
    rows = []
    for t in range(tokens):
        xt = x[t].float()
        p = (xt @ router_weight.float()).softmax(-1)
        e = int(p.argmax())
        if used[e] < capacity:
            used[e] += 1
            rows.append(xt + p[e] * ((xt @ w1[e].float()).relu() @ w2[e].float()))
        else:
            rows.append(xt)
    return torch.stack(rows)
