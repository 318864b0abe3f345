"""The gate registry: every router of ``moee.moe.gates`` / ``moee.moe.switch`` the LM can select.

``MoEEConfig.router_type`` (``moee.moe.lm``) names one entry of :data:`GATES`. An entry
(:class:`GateSpec`) checks the config fields it reads, so a bad value is an error naming the
field; builds the gate from them (plus ``hidden_size``, ``num_experts``, ``num_experts_per_tok``
and ``initializer_range``); says how the LM initialises each router parameter; and, where a
token's experts depend on later tokens of its sequence even in eval mode, carries the warning the
LM gives when the gate is selected for causal language modelling. Entries read the config by
attribute only, so this module needs torch, not transformers.

The same registry serves the from-scratch LM (``moee.moe.lm.MoEEConfig``) and upcycled models
(``moee.moe.upcycled.MoEEUpcycledConfig``, ``moee upcycle --router``): both configs take their
``router_*`` fields from :class:`RouterFields`, so a gate reads the same keys with the same names
in either. Adding a gate is one :func:`register` call plus its fields in :class:`RouterFields`;
``lm.py``, ``upcycled.py``, the trainer, ``moee train`` and ``moee upcycle`` pick it up
(``docs/ARCHITECTURE.md`` has an example, ``moee/moe/README_TRAINING.md`` lists the keys).
Names a saved config may still carry from before the registries were one are in
:data:`ALIASES` and are rewritten on load (:func:`resolve_router`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moee.moe.gates import (
    BatchwiseBalancedGate,
    ExpertChoiceGate,
    HierarchicalGate,
    Hierarchy,
    LossFreeBalancedGate,
    NoisyTopKGate,
    SoftmaxGate,
)
from moee.moe.switch import DEFAULT_ALPHA, SwitchRouter

__all__ = [
    "ALIASES",
    "GATES",
    "CausalLeakWarning",
    "GateAlias",
    "GateSpec",
    "RouterFields",
    "build_gate",
    "check_router_options",
    "gate_spec",
    "load_router_weight",
    "parse_router_option",
    "register",
    "resolve_router",
    "router_option_types",
]

DEFAULT_SWITCH_CAPACITY_FACTOR = 1.25


@dataclass(kw_only=True)
class RouterFields:
    """The ``router_*`` config fields every gate of :data:`GATES` reads, with the LM's defaults.

    A base of both ``MoEEConfig`` and ``MoEEUpcycledConfig`` (transformers configs are
    dataclasses, so these become fields of each); a config class may override a default
    (upcycled models default to a deterministic router without balancing losses). A new gate's
    keys go here.
    """

    router_type: str = "noisy_top_k"
    router_noisy: bool = True
    router_bias_gamma: float = 1e-3
    router_score_func: str = "sigmoid"
    router_w_importance: float = 0.1
    router_w_load: float = 0.1
    router_n_groups: int | None = None
    router_k_primary: int = 2
    router_w_threshold: float = 1.0
    router_capacity_factor: float | None = None
    router_min_capacity: int = 1
    router_switch_alpha: float = DEFAULT_ALPHA


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def router_option_types() -> dict[str, tuple[type, bool]]:
    """Each ``router_*`` field of :class:`RouterFields` but ``router_type`` (chosen by name
    elsewhere) -> ``(its type, whether null is allowed)``, read from the field declarations, so a
    new field is typed where it is declared."""
    import typing

    types = {}
    for name, hint in typing.get_type_hints(RouterFields).items():
        if name == "router_type":
            continue
        args = typing.get_args(hint)
        base = next(a for a in args if a is not type(None)) if args else hint
        types[name] = (base, type(None) in args)
    return types


def _accepted(kind: type, optional: bool) -> str:
    text = {
        bool: "true or false (also 1/0, yes/no)",
        int: "an integer",
        float: "a finite number",
        str: "a string",
    }[kind]
    return text + (", or null" if optional else "")


def parse_router_option(key: str, text: str, *, what: str = "router option") -> Any:
    """The value of the ``router_*`` field ``key`` written as ``text`` (``moee upcycle
    --router-option KEY=VALUE``), parsed by the field's declared type: a bool from true/false,
    1/0 or yes/no only (``bool("maybe")`` would be True), an int, a finite float, a string, and
    ``null`` / ``none`` for a field that may be unset. Anything else is a ``ValueError`` naming the
    option (``what``: how, e.g. the flag) and what it accepts, so no string or NaN reaches a saved
    config."""
    types = router_option_types()
    if key not in types:
        raise ValueError(f"unknown {what} {key}; known: {', '.join(types)}")
    kind, optional = types[key]
    word = text.strip()
    if optional and word.lower() in ("null", "none"):
        return None
    value: Any = None
    if kind is bool and word.lower() in _TRUE + _FALSE:
        value = word.lower() in _TRUE
    elif kind is int:
        try:
            value = int(word)
        except ValueError:
            pass
    elif kind is float:
        try:
            value = float(word)
        except ValueError:
            pass
        value = value if value is not None and math.isfinite(value) else None
    elif kind is str:
        value = text
    if value is None:
        raise ValueError(f"{what} {key}={text!r}: {key} takes {_accepted(kind, optional)}")
    return value


def check_router_options(options: dict[str, Any]) -> None:
    """``ValueError`` naming the first value of ``options`` (known ``router_*`` fields -> Python
    values) whose type is not the field's (:func:`router_option_types`): a bool that is not
    ``True``/``False``, a non-finite or non-numeric float, an int that is a bool or a float, a
    non-string string, ``None`` for a field that must be set."""
    types = router_option_types()
    for key, value in options.items():
        if key not in types:
            continue
        kind, optional = types[key]
        if value is None:
            ok = optional
        elif kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(f"router option {key} must be {_accepted(kind, optional)}, got {value!r}")


class CausalLeakWarning(UserWarning):
    """The selected gate lets a token's output depend on later tokens of its sequence."""


def _no_check(config: Any) -> None:
    return None


def _never(config: Any) -> bool:
    return False


@dataclass(frozen=True)
class GateSpec:
    """One selectable gate.

    ``config_keys`` maps each ``MoEEConfig`` field the gate reads (beyond the shared
    ``hidden_size`` / ``num_experts`` / ``num_experts_per_tok`` / ``initializer_range``) to what
    it sets. ``check(config)`` raises ``ValueError`` naming the bad field; ``build(config)``
    returns the gate module. Router parameters are initialised to zero when ``zero_init(config)``
    (Shazeer et al. 2017, Appendix A: with exploration noise, or a dense gate, a uniform start is
    right), to the constant ``constant_init[name](config)`` for the named ones, and else from
    ``N(0, initializer_range^2)``. ``future_tokens`` is the leak warning, ``None`` when in eval mode
    every token's selection depends on that token alone. ``load_weight(gate, weight [E, d])`` puts
    an upcycled router's start (cluster centroids, random or zero rows, one per expert) into the
    gate's parameters; ``None``: the gate's ``w_gate`` Linear takes it as is.
    """

    name: str
    summary: str
    config_keys: dict[str, str]
    build: Callable[[Any], nn.Module]
    check: Callable[[Any], None] = _no_check
    zero_init: Callable[[Any], bool] = _never
    constant_init: dict[str, Callable[[Any], float]] = field(default_factory=dict)
    future_tokens: str | None = None
    load_weight: Callable[[nn.Module, torch.Tensor], None] | None = None

    def parameter_init(self, name: str, config: Any) -> tuple[str, float]:
        """How the LM initialises router parameter ``name``: ``("zeros" | "constant" | "normal", value)``."""
        if name in self.constant_init:
            return "constant", float(self.constant_init[name](config))
        if self.zero_init(config):
            return "zeros", 0.0
        return "normal", float(config.initializer_range)

    def warn_if_leaky(self, stacklevel: int = 2) -> None:
        """Give the :class:`CausalLeakWarning` of a gate that looks at later tokens (no-op otherwise)."""
        if self.future_tokens is not None:
            warnings.warn(
                f"router_type {self.name!r} in a causal LM: {self.future_tokens}",
                CausalLeakWarning,
                stacklevel=stacklevel + 1,
            )


GATES: dict[str, GateSpec] = {}


def register(spec: GateSpec) -> GateSpec:
    """Add ``spec`` to :data:`GATES` (a second entry under the same name is an error)."""
    if spec.name in GATES:
        raise ValueError(f"a gate named {spec.name!r} is already registered")
    GATES[spec.name] = spec
    return spec


def gate_spec(router_type: str) -> GateSpec:
    """The entry for ``router_type``; an unknown name is a ``ValueError`` listing the known ones."""
    spec = GATES.get(router_type) if isinstance(router_type, str) else None
    if spec is None:
        raise ValueError(f"router_type must be one of {tuple(GATES)}, got {router_type!r}")
    return spec


def build_gate(config: Any) -> nn.Module:
    """Check the config's fields for its ``router_type`` and build that gate."""
    spec = gate_spec(config.router_type)
    spec.check(config)
    return spec.build(config)


@dataclass(frozen=True)
class GateAlias:
    """An old ``router_type`` name: the entry of :data:`GATES` it means and the field values it implied."""

    name: str
    fields: dict[str, Any]


#: Old ``router_type`` names (upcycled models saved before one registry served every model) ->
#: what they mean now: ``top_k`` was the deterministic top-k softmax gate without balancing losses.
ALIASES: dict[str, GateAlias] = {
    "top_k": GateAlias(
        "noisy_top_k", {"router_noisy": False, "router_w_importance": 0.0, "router_w_load": 0.0}
    ),
}


def resolve_router(config: Any) -> GateSpec:
    """Rewrite an old ``router_type`` of ``config`` in place (:data:`ALIASES`), check the fields its
    gate reads, and return the gate's entry. Every config with a ``router_type`` calls this on
    construction, so a saved model with an old name loads as before and saves the new one."""
    alias = ALIASES.get(config.router_type) if isinstance(config.router_type, str) else None
    if alias is not None:
        config.router_type = alias.name
        for key, value in alias.fields.items():
            setattr(config, key, value)
    spec = gate_spec(config.router_type)
    spec.check(config)
    return spec


@torch.no_grad()
def load_router_weight(router_type: str, gate: nn.Module, weight: torch.Tensor) -> None:
    """Start ``gate`` (a ``router_type`` gate) from ``weight [num_experts, hidden]``, one row per
    expert (how ``moee upcycle`` initialises its routers)."""
    spec = gate_spec(router_type)
    if spec.load_weight is not None:
        spec.load_weight(gate, weight)
        return
    target = gate.w_gate.weight
    if weight.shape != target.shape:
        raise ValueError(f"router weight must be {tuple(target.shape)}, got {tuple(weight.shape)}")
    target.copy_(weight)


def _load_hierarchical(gate: nn.Module, weight: torch.Tensor) -> None:
    """Expert ``i * b + j`` is expert ``j`` of group ``i``: each group's secondary gate gets its
    experts' rows, the primary gate the mean row of each group."""
    a, b = gate.n_groups, gate.experts_per_group
    if weight.shape != (a * b, gate.d_model):
        raise ValueError(f"router weight must be {(a * b, gate.d_model)}, got {tuple(weight.shape)}")
    grouped = weight.reshape(a, b, gate.d_model)
    gate.w_gate.weight.copy_(grouped.mean(dim=1))
    gate.w_gate_secondary.copy_(grouped.transpose(1, 2))


def _load_switch(gate: nn.Module, weight: torch.Tensor) -> None:
    if weight.shape[::-1] != gate.weight.shape:
        raise ValueError(f"router weight must be {tuple(gate.weight.shape[::-1])}, got {tuple(weight.shape)}")
    gate.weight.copy_(weight.t())


# ----------------------------------------------------------------------------- field checks


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_weights(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
            f"{name} must be a number >= 0, got {value!r}",
        )


def _capacity_factor(config: Any, default: float) -> float:
    value = config.router_capacity_factor
    return float(default if value is None else value)


def _check_capacity(config: Any) -> None:
    value = config.router_capacity_factor
    _require(
        value is None
        or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        ),
        f"router_capacity_factor must be null or a finite number > 0, got {value!r}",
    )
    minimum = config.router_min_capacity
    _require(_is_int(minimum) and minimum >= 0, f"router_min_capacity must be an int >= 0, got {minimum!r}")


def _check_noisy_top_k(config: Any) -> None:
    _check_weights(config, "router_w_importance", "router_w_load")


def _check_loss_free(config: Any) -> None:
    _require(
        config.router_score_func in ("sigmoid", "softmax"),
        f"router_score_func must be 'sigmoid' or 'softmax', got {config.router_score_func!r}",
    )
    _check_weights(config, "router_bias_gamma")


def _hierarchy(config: Any) -> Hierarchy:
    """The groups and selections of a checked hierarchical config."""
    a, kp = config.router_n_groups, config.router_k_primary
    return Hierarchy(a, config.num_experts // a, kp, config.num_experts_per_tok // kp)


def _check_hierarchical(config: Any) -> None:
    a, e, k, kp = (
        config.router_n_groups,
        config.num_experts,
        config.num_experts_per_tok,
        config.router_k_primary,
    )
    _require(
        _is_int(a) and a >= 1 and e % a == 0,
        f"router_type 'hierarchical' needs router_n_groups, a positive divisor of num_experts={e}, got {a!r}",
    )
    _require(
        _is_int(kp) and 1 <= kp <= a,
        f"router_k_primary must be an int in [1, router_n_groups={a}], got {kp!r}",
    )
    _require(
        k % kp == 0 and k // kp <= e // a,
        f"num_experts_per_tok={k} must be router_k_primary={kp} times a secondary k in "
        f"[1, {e // a}] (the experts per group)",
    )
    _check_noisy_top_k(config)


def _check_strictly_balanced(config: Any) -> None:
    _check_weights(config, "router_w_threshold")


def _check_switch(config: Any) -> None:
    _require(
        config.num_experts_per_tok == 1,
        f"router_type 'switch' routes each token to one expert: num_experts_per_tok must be 1, "
        f"got {config.num_experts_per_tok}",
    )
    _check_capacity(config)
    _check_weights(config, "router_switch_alpha")


def _check_softmax(config: Any) -> None:
    _require(
        config.num_experts_per_tok == config.num_experts,
        f"router_type 'softmax' is the dense gate (every expert runs on every token): "
        f"num_experts_per_tok must equal num_experts={config.num_experts}, got {config.num_experts_per_tok}",
    )
    _check_weights(config, "router_w_importance")


# ----------------------------------------------------------------------------- the entries

_NOISE_KEYS = {
    "router_noisy": "exploration noise StandardNormal * Softplus(x W_noise) in training mode",
    "router_w_importance": "weight of CV^2(Importance) (Shazeer et al. 2017, Sec. 4)",
    "router_w_load": "weight of CV^2(Load), the smooth load estimator (Shazeer et al. 2017, Appendix A)",
}

register(
    GateSpec(
        name="noisy_top_k",
        summary="Shazeer et al. 2017 noisy top-k gate, Softmax(KeepTopK(x W_g + noise, k)) "
        "(router_noisy=false: the plain softmax top-k gate)",
        config_keys=dict(_NOISE_KEYS),
        check=_check_noisy_top_k,
        build=lambda c: NoisyTopKGate(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            noisy=c.router_noisy,
            w_importance=c.router_w_importance,
            w_load=c.router_w_load,
            init_std=c.initializer_range,
        ),
        zero_init=lambda c: bool(c.router_noisy),
    )
)

register(
    GateSpec(
        name="loss_free",
        summary="auxiliary-loss-free balancing (Wang et al. 2024): top-k of scores + a per-expert "
        "selection-only bias, moved by gamma * sign(mean load - load) after every training forward",
        config_keys={
            "router_bias_gamma": "bias step gamma",
            "router_score_func": '"sigmoid" (DeepSeek-V3) or "softmax" scores',
        },
        check=_check_loss_free,
        build=lambda c: LossFreeBalancedGate(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            gamma=c.router_bias_gamma,
            score_func=c.router_score_func,
            init_std=c.initializer_range,
        ),
    )
)

register(
    GateSpec(
        name="hierarchical",
        summary="two-level hierarchical gate (Shazeer et al. 2017, Appendix B): a noisy top-k_primary "
        "gate over groups times a noisy top-k_secondary gate inside each group; "
        "k_secondary = num_experts_per_tok / router_k_primary",
        config_keys={
            "router_n_groups": "number of groups a (required; divides num_experts)",
            "router_k_primary": "groups selected per token",
            **_NOISE_KEYS,
        },
        check=_check_hierarchical,
        build=lambda c: HierarchicalGate(
            c.hidden_size,
            _hierarchy(c),
            noisy=c.router_noisy,
            w_importance=c.router_w_importance,
            w_load=c.router_w_load,
            init_std=c.initializer_range,
        ),
        zero_init=lambda c: bool(c.router_noisy),
        load_weight=_load_hierarchical,
    )
)

register(
    GateSpec(
        name="strictly_balanced",
        summary="strictly balanced gating (Shazeer et al. 2017, Appendix F): in training mode each "
        "expert takes its m = k|X|/n highest-scoring tokens of the batch; in eval mode a token takes "
        "expert i when its score exceeds the learned threshold T_i, so inference needs no batch. "
        "The training-mode batch mask ranks all tokens of the batch, later ones included; eval "
        "(held-out evaluation, generation) uses the per-token thresholds only",
        config_keys={
            "router_w_threshold": "weight of the threshold loss L_batchwise that trains T (T starts at 1/n)",
        },
        check=_check_strictly_balanced,
        build=lambda c: BatchwiseBalancedGate(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            w_threshold=c.router_w_threshold,
            init_std=c.initializer_range,
        ),
        constant_init={"thresholds": lambda c: 1.0 / c.num_experts},
    )
)

register(
    GateSpec(
        name="switch",
        summary="Switch Transformer top-1 routing with expert capacity (Fedus et al. 2021); "
        "num_experts_per_tok must be 1; tokens over capacity keep only their residual, and earlier "
        "tokens of the flattened batch win the slots",
        config_keys={
            "router_capacity_factor": f"capacity factor (null: {DEFAULT_SWITCH_CAPACITY_FACTOR})",
            "router_min_capacity": "minimum slots per expert",
            "router_switch_alpha": "weight alpha of the aux loss alpha * E * sum_i f_i P_i",
        },
        check=_check_switch,
        build=lambda c: SwitchRouter(
            c.hidden_size,
            c.num_experts,
            capacity_factor=_capacity_factor(c, DEFAULT_SWITCH_CAPACITY_FACTOR),
            minimum_capacity=c.router_min_capacity,
            alpha=c.router_switch_alpha,
            init_std=c.initializer_range,
        ),
        load_weight=_load_switch,
    )
)

register(
    GateSpec(
        name="expert_choice",
        summary="expert-choice routing (Zhou et al. 2022): every expert takes its top-C tokens of the "
        "batch, C = capacity_factor * tokens / num_experts. NOT CAUSAL (future-token leak): which experts a token gets "
        "depends on the scores of every other token in the batch, later tokens of its own sequence "
        "included, in training and in eval mode (a CausalLeakWarning says so when the LM is built)",
        config_keys={
            "router_capacity_factor": "average experts per token (null: num_experts_per_tok)",
            "router_min_capacity": "minimum tokens per expert",
        },
        check=_check_capacity,
        build=lambda c: ExpertChoiceGate(
            c.hidden_size,
            c.num_experts,
            capacity_factor=_capacity_factor(c, c.num_experts_per_tok),
            minimum_capacity=c.router_min_capacity,
            init_std=c.initializer_range,
        ),
        future_tokens=(
            "expert choice picks the top tokens per expert over the whole batch, so a token's experts "
            "depend on later tokens of its sequence (future-token leak) in training and in eval mode; "
            "its perplexity is not that of a causal LM, and generation (one token at a time) routes "
            "differently from a full forward"
        ),
    )
)

register(
    GateSpec(
        name="softmax",
        summary="dense softmax gate G_sigma(x) = Softmax(x W_g) (Shazeer et al. 2017, Sec. 2.1): every "
        "expert runs on every token, so num_experts_per_tok must equal num_experts",
        config_keys={"router_w_importance": "weight of CV^2(Importance)"},
        check=_check_softmax,
        build=lambda c: SoftmaxGate(c.hidden_size, c.num_experts, w_importance=c.router_w_importance),
        zero_init=lambda c: True,
    )
)
