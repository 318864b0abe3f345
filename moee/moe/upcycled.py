"""The upcycled MoE model: a dense Hugging Face model whose FFNs were turned into MoE FFNs.

`MoEEUpcycledConfig` (``model_type="moee_upcycled"``) stores the dense model's own config as
``text_config`` plus the MoE settings; `MoEEUpcycledModel` / `MoEEUpcycledForCausalLM` rebuild the
dense architecture from that config (the family's transformers class, no remote code) and replace
each layer's FFN with an `UpcycledMoEFFN` (a `MoEERouter` + experts holding slices or copies of the
FFN's weights). Everything else (embeddings, attention, norms, LM head) is the dense model's code.

Where the FFN lives and how it is built differs per family; :data:`FAMILIES` is the one rule table
(Llama-style SwiGLU ``gate/up/down``, GPT-2 ``c_fc/c_proj`` Conv1D with biases, BERT
``intermediate.dense`` + ``output.dense`` whose LayerNorm and residual stay outside the experts).

The router is any gate of `moee.moe.gate_registry.GATES` (``router_type`` and the ``router_*``
fields of `moee.moe.gate_registry.RouterFields`, the same names as the from-scratch LM), wrapped in
a `MoEERouter` and declared in ``_can_record_outputs["router_logits"]`` (like `moee.moe.lm`), so
`moee.capture.find_routers` finds one router per MoE layer without a special case, and
``output_router_logits=True`` returns each MoE layer's router logits ``[tokens, num_experts]`` as
``router_logits``, as transformers' MoE models do. Importing this module registers the config with
`AutoConfig` and the models with `AutoModel` / `AutoModelForCausalLM` (decoder families only);
``import moee`` arranges that (`moee.models.register_models`).

How experts are combined (see docs/UPCYCLING.md):

* ``split``: each expert holds a disjoint slice of the FFN's neurons; the selected experts are
  **summed** (weight exactly 1 each; the gate value enters only through a straight-through term
  ``g - g.detach()``, so the router still gets a gradient). Summing is what makes top-k = all
  experts equal to the dense FFN: a weighted average of partial FFNs would not be.
* ``copy``: every expert is a full copy of the FFN and the selected experts are averaged with the
  renormalised top-k softmax weights (they sum to 1), so any routing reproduces the dense FFN.
* ``lora``: a mixture of low-rank experts. Every expert is the whole FFN with its own rank-r
  adapter on the down projection, ``E_e(x) = (W_down + B_e A_e) h(x)`` with ``h(x) = act(x W_gate)
  * (x W_up)``; the selected experts are averaged with the renormalised top-k weights. Since the
  weights sum to 1 this is ``W_down h + sum_j w_j B_j A_j h``: the dense FFN runs once per token
  (stored once, as the shared expert) and only the small adapters are routed. With ``B = 0`` (the
  start) the model is exactly the dense one; training the adapters and routers changes only a few
  MB, which is what a shipped delta holds.

The FFN's output bias (GPT-2 ``c_proj.bias``, BERT ``output.dense.bias``) is added once, outside
the experts, in both modes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.configuration_utils import SubConfigSpec
from transformers.utils.output_capturing import OutputRecorder

from moee.moe.gate_registry import RouterFields, build_gate, gate_spec, load_router_weight, resolve_router
from moee.moe.gates import init_unsaved_state
from moee.moe.layer import MoEERouter, dispatch_combine, routing_stats
from moee.moe.lm import MoEECausalLMOutput
from moee.upcycle_settings import MODES  # the upcycling modes, declared with the settings

__all__ = [
    "FAMILIES",
    "MODES",
    "DenseFFN",
    "FamilyRule",
    "LoRAExperts",
    "MoEEUpcycledConfig",
    "MoEEUpcycledForCausalLM",
    "MoEEUpcycledModel",
    "UpcycledExperts",
    "UpcycledMoEFFN",
    "dense_ffn_width",
    "family_rule",
    "is_causal",
    "moe_layers",
]


# The router logits of the forward running in this context: a list while a caller asked for
# ``output_router_logits``, else None (a context variable, so concurrent forwards never mix).
_ROUTER_LOGITS: ContextVar[list[torch.Tensor] | None] = ContextVar(
    "moee_upcycled_router_logits", default=None
)


# --------------------------------------------------------------------------------------------
# Per-family rules: where the FFN lives and what it computes
# --------------------------------------------------------------------------------------------


@dataclass
class DenseFFN:
    """A dense FFN in one layout: ``down(act(x A^T + a) [* (x U^T + u)]) + b``.

    ``w_act [d_ff, d]`` are the rows that feed the activation (SwiGLU ``gate_proj``, GPT-2 ``c_fc``,
    BERT ``intermediate.dense``); ``w_up [d_ff, d]`` the linear half of a gated FFN (``None``
    otherwise); ``w_down [d, d_ff]``. Biases are ``None`` when the module has none.
    """

    w_act: torch.Tensor
    w_down: torch.Tensor
    act: nn.Module
    w_up: torch.Tensor | None = None
    b_act: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    dropout: nn.Module | None = None

    @property
    def d_ff(self) -> int:
        return int(self.w_act.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.w_act.shape[1])

    @property
    def gated(self) -> bool:
        return self.w_up is not None


def _bias(linear: nn.Module) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def _read_swiglu(layer: nn.Module) -> DenseFFN:
    mlp = layer.mlp
    return DenseFFN(
        w_act=mlp.gate_proj.weight.detach(),
        w_up=mlp.up_proj.weight.detach(),
        w_down=mlp.down_proj.weight.detach(),
        b_act=_bias(mlp.gate_proj),
        b_up=_bias(mlp.up_proj),
        b_down=_bias(mlp.down_proj),
        act=mlp.act_fn,
    )


def _read_gpt2(layer: nn.Module) -> DenseFFN:
    mlp = layer.mlp  # Conv1D weights are [in, out]
    return DenseFFN(
        w_act=mlp.c_fc.weight.detach().t(),
        w_down=mlp.c_proj.weight.detach().t(),
        b_act=_bias(mlp.c_fc),
        b_down=_bias(mlp.c_proj),
        act=mlp.act,
        dropout=mlp.dropout,
    )


def _read_bert(layer: nn.Module) -> DenseFFN:
    return DenseFFN(
        w_act=layer.intermediate.dense.weight.detach(),
        w_down=layer.output.dense.weight.detach(),
        b_act=_bias(layer.intermediate.dense),
        b_down=_bias(layer.output.dense),
        act=layer.intermediate.intermediate_act_fn,
    )


def _install_mlp(layer: nn.Module, moe: nn.Module) -> None:
    layer.mlp = moe


def _install_bert(layer: nn.Module, moe: nn.Module) -> None:
    # BertOutput computes LayerNorm(dropout(dense(h)) + residual): the experts replace
    # intermediate + output.dense, the dropout, residual and LayerNorm stay where they are.
    layer.intermediate = moe
    layer.output.dense = nn.Identity()


@dataclass(frozen=True)
class FamilyRule:
    """How to find, read and replace the FFN of one model family.

    ``decoder``: the dense checkpoint is a causal LM (``AutoModelForCausalLM``), else an encoder
    (``AutoModel``). ``layers``: attribute path from the base model to its layer list. ``read``
    turns a layer's FFN into a `DenseFFN`; ``install`` puts the MoE FFN in its place.
    """

    decoder: bool
    layers: str
    read: Callable[[nn.Module], DenseFFN]
    install: Callable[[nn.Module, nn.Module], None]


_SWIGLU = FamilyRule(decoder=True, layers="layers", read=_read_swiglu, install=_install_mlp)
_BERT = FamilyRule(decoder=False, layers="encoder.layer", read=_read_bert, install=_install_bert)

#: transformers ``model_type`` -> rule. Every entry is exercised by ``tests/test_moe_upcycle.py``.
FAMILIES: dict[str, FamilyRule] = {
    "llama": _SWIGLU,
    "mistral": _SWIGLU,
    "qwen2": _SWIGLU,
    "qwen3": _SWIGLU,
    "gpt2": FamilyRule(decoder=True, layers="h", read=_read_gpt2, install=_install_mlp),
    "bert": _BERT,
    "roberta": _BERT,
}


def family_rule(model_type: str | None) -> FamilyRule:
    """The rule of ``model_type``; a ``ValueError`` naming the supported types otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"upcycling does not support model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def moe_layers(base: nn.Module, rule: FamilyRule) -> nn.ModuleList:
    """The layer list of ``base`` (the family's base model, e.g. ``LlamaModel``)."""
    return operator.attrgetter(rule.layers)(base)


def is_causal(config: PreTrainedConfig) -> bool:
    """Whether the dense model of ``config`` is a causal LM: a decoder family, or an encoder family
    (BERT, RoBERTa) configured with ``is_decoder=True`` (causal self-attention and an LM head, the
    family's ``...ForCausalLM`` / ``...LMHeadModel`` class)."""
    return family_rule(config.model_type).decoder or bool(getattr(config, "is_decoder", False))


#: config fields holding one entry per layer, reordered with the layers by `reorder_layers`
PER_LAYER_CONFIG_KEYS = ("layer_types", "no_rope_layers")


def reorder_layers(model: PreTrainedModel, order: list[int]) -> PreTrainedModel:
    """Depth up-scaling (Kim et al. 2023, SOLAR): rebuild the layer list of ``model`` as copies of
    its layers in ``order`` (indices may repeat), e.g. ``[0, 1, 2, 3, 2, 3, 4, 5]`` turns 6 layers
    into 8. Each copy gets its own position index for the KV cache; the config's layer count follows.
    Modifies ``model`` in place and returns it."""
    import copy

    rule = family_rule(model.config.model_type)
    layers = moe_layers(model.base_model, rule)
    n = len(layers)
    if not order or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in order):
        raise ValueError(f"layer order must be a non-empty list of layer indices in [0, {n}), got {order!r}")
    new = nn.ModuleList(copy.deepcopy(layers[i]) for i in order)
    for position, layer in enumerate(new):
        for sub in layer.modules():
            if hasattr(sub, "layer_idx"):
                sub.layer_idx = position
    parent, _, name = rule.layers.rpartition(".")
    setattr(operator.attrgetter(parent)(model.base_model) if parent else model.base_model, name, new)
    config = model.config
    for key in PER_LAYER_CONFIG_KEYS:  # each copy keeps its source layer's entry (e.g. attention type)
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"config.{key} has {len(value)} entries for {n} layers; cannot reorder it")
            setattr(config, key, type(value)(value[i] for i in order))
    config.num_hidden_layers = len(order)
    try:  # the saved config must load again: transformers validates per-layer lists against the count
        type(config).from_dict(config.to_dict())
    except Exception as exc:
        raise ValueError(
            f"layer order {order}: the {config.model_type} config does not validate with {len(order)} layers "
            f"({exc})"
        ) from exc
    return model


# --------------------------------------------------------------------------------------------
# The MoE FFN
# --------------------------------------------------------------------------------------------


class UpcycledExperts(nn.Module):
    """``n_experts`` FFN experts of width ``d_hidden`` with the dense FFN's activation and biases.

    ``w_in [E, d_model, h_in]`` (``h_in = 2 * d_hidden`` when gated: activation half, then linear
    half), ``b_in [E, h_in]`` when the dense first projection had a bias, ``w_out [E, d_hidden,
    d_model]`` (no bias: the output bias is added once by `UpcycledMoEFFN`). Exposes
    ``n_experts`` / ``d_model`` / ``grouped_forward`` so `moee.moe.layer.dispatch_combine` drives it.
    """

    def __init__(
        self, n_experts: int, d_model: int, d_hidden: int, act: nn.Module, *, gated: bool, bias: bool
    ) -> None:
        super().__init__()
        self.n_experts, self.d_model, self.d_hidden, self.gated = n_experts, d_model, d_hidden, gated
        width = 2 * d_hidden if gated else d_hidden
        self.act = act
        self.w_in = nn.Parameter(torch.zeros(n_experts, d_model, width))
        self.b_in = nn.Parameter(torch.zeros(n_experts, width)) if bias else None
        self.w_out = nn.Parameter(torch.zeros(n_experts, d_hidden, d_model))

    def hidden(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s hidden activation ``[n, d_hidden]`` on rows ``x [n, d_model]``."""
        h = x @ self.w_in[e]
        if self.b_in is not None:
            h = h + self.b_in[e]
        if self.gated:
            a, u = h.chunk(2, dim=-1)
            return self.act(a) * u
        return self.act(h)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x [n, d_model]``."""
        return self.hidden(e, x) @ self.w_out[e]

    def grouped_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert on its contiguous slice of ``x_sorted`` (rows sorted by expert)."""
        pieces = [
            self.expert_forward(e, chunk)
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
        """``y_n = sum_j weights[n, j] * E_{indices[n, j]}(x_n)`` over the real slots
        (`moee.moe.layer.dispatch_combine`); called with the dispatch, like transformers' experts."""
        return dispatch_combine(x, weights, indices, self, slot_mask)

    @torch.no_grad()
    def load_neurons(self, dense: DenseFFN, groups: list[torch.Tensor]) -> None:
        """Expert ``e`` gets the neurons ``groups[e]`` (indices into ``d_ff``) of ``dense``."""
        if len(groups) != self.n_experts or any(len(g) != self.d_hidden for g in groups):
            raise ValueError(f"need {self.n_experts} neuron groups of {self.d_hidden} neurons each")
        for e, idx in enumerate(groups):
            w_in = dense.w_act[idx].t()
            if self.gated:
                w_in = torch.cat([w_in, dense.w_up[idx].t()], dim=1)
            self.w_in[e].copy_(w_in)
            self.w_out[e].copy_(dense.w_down[:, idx].t())
            if self.b_in is not None:
                b_act = dense.b_act[idx] if dense.b_act is not None else torch.zeros(len(idx))
                if self.gated:
                    b_up = dense.b_up[idx] if dense.b_up is not None else torch.zeros(len(idx))
                    b_act = torch.cat([b_act, b_up])
                self.b_in[e].copy_(b_act)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}, gated={self.gated}"


class LoRAExperts(nn.Module):
    """``n_experts`` rank-``rank`` adapters of a down projection: expert ``e`` maps the shared FFN's
    hidden activation ``h [n, d_hidden]`` to ``(h @ lora_a[e]) @ lora_b[e]`` ``[n, d_model]``.

    ``lora_a [E, d_hidden, rank]`` starts random, ``lora_b [E, rank, d_model]`` at zero (LoRA's
    init: the adapted FFN starts as the dense one). Exposes ``n_experts`` / ``d_model`` (the output
    width) / ``grouped_forward`` for `moee.moe.layer.dispatch_combine`.
    """

    def __init__(self, n_experts: int, d_hidden: int, d_model: int, rank: int) -> None:
        super().__init__()
        if min(n_experts, d_hidden, d_model, rank) < 1:
            raise ValueError(
                f"n_experts, d_hidden, d_model and rank must be >= 1, got {n_experts}, {d_hidden}, {d_model}, {rank}"
            )
        self.n_experts, self.d_hidden, self.d_model, self.rank = n_experts, d_hidden, d_model, rank
        self.lora_a = nn.Parameter(torch.zeros(n_experts, d_hidden, rank))
        self.lora_b = nn.Parameter(torch.zeros(n_experts, rank, d_model))

    def expert_forward(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Adapter ``e`` on hidden rows ``h [n, d_hidden]``."""
        return (h @ self.lora_a[e]) @ self.lora_b[e]

    def forward(
        self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``sum_j weights[:, j] * adapter_{indices[:, j]}(h)`` ``[n, d_model]``: a module call, so
        hooks on the experts (``moee.capture.interventions``' dispatch edits) see every dispatch."""
        return dispatch_combine(h, weights, indices, self, mask)

    def grouped_forward(self, h_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every adapter on its contiguous slice of ``h_sorted`` (rows sorted by expert)."""
        pieces = [
            self.expert_forward(e, chunk)
            for e, chunk in enumerate(torch.split(h_sorted, counts))
            if counts[e]
        ]
        return torch.cat(pieces) if pieces else h_sorted.new_zeros(0, self.d_model)

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, d_hidden={self.d_hidden}, d_model={self.d_model}, rank={self.rank}"
        )


class UpcycledMoEFFN(nn.Module):
    """Drop-in replacement of a dense FFN: ``router`` + routed ``experts`` (+ ``shared``) + output bias.

    ``forward(x [..., d]) -> [..., d]``: ``shared_scale * shared(x) + routed(x) * routed_scale + b``.
    ``routed`` sums the selected experts (``split``: weight 1 each, straight-through gate gradient)
    or averages them with the renormalised top-k gate values (``copy``). With a copied shared
    expert (``copy``) both halves are scaled by 1/2 so the output still equals the dense FFN.
    ``gate`` is a gate of `moee.moe.gate_registry.GATES` (``build_gate(config)``) named by
    ``router_type``; gates that select a variable number of experts per token pad their slots,
    and only the real ones are computed.

    Built from the model's ``config`` (experts, widths, mode, router type, LoRA rank), the dense
    ``ffn`` it replaces (width, activation, gating, biases, dropout; its weights are copied by
    `load_dense`, not here) and the ``gate`` (``build_gate(config)``).
    """

    def __init__(self, config: MoEEUpcycledConfig, ffn: DenseFFN, gate: nn.Module) -> None:
        super().__init__()
        d_model, act, gated, dropout = ffn.d_model, ffn.act, ffn.gated, ffn.dropout
        bias_in, bias_out = ffn.b_act is not None or ffn.b_up is not None, ffn.b_down is not None
        n_experts, top_k, mode = config.num_experts, config.num_experts_per_tok, config.upcycle_mode
        expert_width, shared_width = config.expert_intermediate_size, config.shared_intermediate_size
        router_type = config.router_type
        lora_rank = config.expert_lora_rank if mode == "lora" else 0
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if (mode == "lora") != (lora_rank > 0) or (mode == "lora" and shared_width != expert_width):
            raise ValueError(
                "mode 'lora' needs lora_rank >= 1 and the whole FFN as the shared expert "
                f"(got rank {lora_rank}, shared width {shared_width}, FFN width {expert_width}); "
                "other modes take no rank"
            )
        self.mode = mode
        self.router_type = gate_spec(router_type).name
        self.router = MoEERouter(gate, n_experts, top_k)
        #: routing statistics of the last forward (`moee.moe.layer.routing_stats` + ``loss``), read
        #: by `MoEEUpcycledForCausalLM` into ``moe_aux`` for training loops
        self.last_aux: dict[str, torch.Tensor] | None = None
        self.experts = (
            LoRAExperts(n_experts, expert_width, d_model, lora_rank)
            if mode == "lora"
            else UpcycledExperts(n_experts, d_model, expert_width, act, gated=gated, bias=bias_in)
        )
        self.shared = (
            UpcycledExperts(1, d_model, shared_width, act, gated=gated, bias=bias_in)
            if shared_width
            else None
        )
        self.b_out = nn.Parameter(torch.zeros(d_model)) if bias_out else None
        self.dropout = dropout
        # copy + shared copy: average the two full FFNs; split: the shared neurons are simply part of the sum
        self.mix = 0.5 if (mode == "copy" and shared_width) else 1.0

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, mask) -> torch.Tensor:
        """The experts' part of the output (plus the shared expert's), before the output bias."""
        if self.mode == "lora":  # W_down h + sum_j w_j B_j A_j h, the weights summing to 1
            h = self.shared.hidden(0, x)
            return h @ self.shared.w_out[0] + self.experts(h, weights, indices, mask)
        if self.mode == "split":
            weights = weights - weights.detach() + 1.0  # value exactly 1, gradient of the gate
        out = self.experts(x, weights, indices, mask)
        if self.shared is not None:
            out = out + self.shared.expert_forward(0, x)
        return out * self.mix if self.mix != 1.0 else out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, indices, gate_out = self.router(x)
        sink = _ROUTER_LOGITS.get()
        if sink is not None:
            sink.append(logits)
        aux = routing_stats(
            gate_out.probs,
            indices,
            self.router.num_experts,
            None,
            gate_out.mask,
            gate_out.aux.get("clean_indices"),
        )
        loss = gate_out.aux.get("loss")
        aux["loss"] = loss if loss is not None else x.new_zeros(())
        self.last_aux = aux
        out = self._routed(x, weights, indices, gate_out.mask)
        if self.b_out is not None:
            out = out + self.b_out
        if self.dropout is not None:
            out = self.dropout(out)
        return out.reshape(shape)

    @torch.no_grad()
    def load_dense(
        self,
        dense: DenseFFN,
        groups: list[torch.Tensor],
        shared: torch.Tensor | None,
        router_weight: torch.Tensor,
        lora_a: torch.Tensor | None = None,
    ) -> None:
        """Fill the experts from ``dense``: expert ``e`` gets neurons ``groups[e]``, the shared expert
        ``shared``; ``router_weight [E, d]`` (a row per expert) starts the gate
        (`moee.moe.gate_registry.load_router_weight`). In ``lora`` mode ``groups`` is unused, the
        shared expert is the whole FFN, ``lora_a`` starts the adapters' A and B starts at zero."""
        if self.mode == "lora":
            if lora_a is None or tuple(lora_a.shape) != tuple(self.experts.lora_a.shape):
                raise ValueError(f"lora mode needs lora_a of shape {tuple(self.experts.lora_a.shape)}")
            self.experts.lora_a.copy_(lora_a)
            self.experts.lora_b.zero_()
        else:
            self.experts.load_neurons(dense, groups)
        if (shared is None) != (self.shared is None):
            raise ValueError("shared neurons given for a layer without a shared expert, or missing")
        if self.shared is not None:
            self.shared.load_neurons(dense, [shared])
        if self.b_out is not None:
            self.b_out.copy_(dense.b_down)
        load_router_weight(self.router_type, self.router.gate, router_weight)


# --------------------------------------------------------------------------------------------
# Config and models
# --------------------------------------------------------------------------------------------


class MoEEUpcycledConfig(PreTrainedConfig, RouterFields):
    """Config of an upcycled model: the dense model's config (``text_config``) plus the MoE settings.

    ``upcycle_mode``: ``"split"`` (experts hold disjoint neuron slices of width
    ``expert_intermediate_size = (d_ff - shared_intermediate_size) / num_experts``) or ``"copy"``
    (every expert is the whole FFN). ``shared_intermediate_size``: width of the always-on shared
    expert (0: none; in copy mode it is d_ff, a full copy). ``router_type``: a gate of
    `moee.moe.gate_registry.GATES`, with its ``router_*`` fields (`RouterFields`; the same names
    as `moee.moe.lm.MoEEConfig`). Upcycled routers default to no exploration noise, no balancing
    losses and softmax scores for ``loss_free``: the dense model's computation is what is kept.
    An old name (``top_k``) is rewritten on load (`moee.moe.gate_registry.ALIASES`).
    ``router_init`` and ``upcycled_from`` record how the model was built (informational).
    """

    model_type = "moee_upcycled"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    upcycle_mode: str = "split"
    expert_lora_rank: int = 0  # lora mode: the adapters' rank
    expert_intermediate_size: int = 0  # 0: derived from text_config and the mode
    shared_intermediate_size: int = 0
    router_init: str = "random"
    router_noisy: bool = False
    router_w_importance: float = 0.0
    router_w_load: float = 0.0
    router_score_func: str = "softmax"
    upcycled_from: str | None = None
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.upcycle_mode not in MODES:
            raise ValueError(f"upcycle_mode must be one of {MODES}, got {self.upcycle_mode!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        resolve_router(self)
        family_rule(self.text_config.model_type)
        if not self.expert_intermediate_size:  # derive it: the config alone describes the model
            d_ff = dense_ffn_width(self.text_config)
            if self.upcycle_mode in ("copy", "lora"):
                self.expert_intermediate_size = d_ff
            elif (d_ff - self.shared_intermediate_size) % self.num_experts == 0:
                self.expert_intermediate_size = (d_ff - self.shared_intermediate_size) // self.num_experts
        if self.expert_intermediate_size < 1:
            raise ValueError(f"expert_intermediate_size must be >= 1, got {self.expert_intermediate_size}")
        # the dense model's tying decides (it owns the embedding and the LM head)
        self.tie_word_embeddings = bool(getattr(self.text_config, "tie_word_embeddings", False))

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def initializer_range(self) -> float:
        """The dense model's init std (what a gate built without upcycled weights draws from)."""
        return float(getattr(self.text_config, "initializer_range", 0.02))


def dense_ffn_width(config: PreTrainedConfig) -> int:
    """The dense FFN's hidden width ``d_ff`` from its config (GPT-2: ``n_inner`` or ``4 * n_embd``)."""
    if config.model_type == "gpt2":
        return int(config.n_inner or 4 * config.n_embd)
    return int(config.intermediate_size)


def _dense_class(config: PreTrainedConfig, decoder: bool) -> type[PreTrainedModel]:
    """The transformers class of the dense model (causal LM for decoders, base model for encoders)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if decoder else MODEL_MAPPING
    return mapping[type(config)]


class MoEEUpcycledPreTrainedModel(PreTrainedModel):
    """Holds the dense architecture as ``self.model`` with every FFN replaced by an `UpcycledMoEFFN`."""

    config_class = MoEEUpcycledConfig
    config: MoEEUpcycledConfig
    base_model_prefix = "model"
    _can_record_outputs = {"router_logits": OutputRecorder(MoEERouter, index=0)}
    _supports_sdpa = True

    def __init__(self, config: MoEEUpcycledConfig, dense: PreTrainedModel | None = None) -> None:
        super().__init__(config)
        # PreTrainedModel resolves the attention backend on this config only; the setter passes it
        # down to text_config, which the dense layers read
        config._attn_implementation = config._attn_implementation
        rule = family_rule(config.text_config.model_type)
        if dense is None:
            dense = _dense_class(config.text_config, is_causal(config.text_config))(config.text_config)
        self.model = dense
        self._no_split_modules = getattr(dense, "_no_split_modules", None)
        for layer in moe_layers(dense.base_model, rule):
            ffn = rule.read(layer)
            rule.install(layer, UpcycledMoEFFN(config, ffn, build_gate(config)))
        self.post_init()

    @property
    def base_model(self) -> nn.Module:
        """The dense family's base model (``LlamaModel``, ``GPT2Model``, ``BertModel``): its output
        holds ``last_hidden_state``, which is what embedding capture pools."""
        return self.model.base_model

    def moe_ffns(self) -> list[UpcycledMoEFFN]:
        """The MoE FFN of every layer, in layer order."""
        return [m for m in self.modules() if isinstance(m, UpcycledMoEFFN)]

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def _init_weights(self, module: nn.Module) -> None:
        # Weights come from the dense checkpoint (upcycle) or the saved file (from_pretrained);
        # a fresh model from a config keeps the dense class's own init and zero experts.
        return

    def initialize_weights(self) -> None:
        # the gates sit inside the dense model, whose own _init_weights transformers dispatches to
        # for them: what a gate does not save is zeroed here, after it (the loader runs this)
        super().initialize_weights()
        for module in self.modules():
            init_unsaved_state(module)


def _run_recording(model: MoEEUpcycledPreTrainedModel, forward: Callable, args: tuple, kwargs: dict):
    """``forward(*args, **kwargs)`` (``output_router_logits`` taken out of ``kwargs``: the dense
    model has no such option), and the router logits of its MoE layers, in layer order, when
    ``output_router_logits`` (the argument, else the config's) asks for them, else ``None``."""
    wanted = kwargs.pop("output_router_logits", None)
    if wanted is None:
        wanted = model.config.output_router_logits
    if not wanted:
        return forward(*args, **kwargs), None
    sink: list[torch.Tensor] = []
    token = _ROUTER_LOGITS.set(sink)
    try:
        out = forward(*args, **kwargs)
    finally:
        _ROUTER_LOGITS.reset(token)
    return out, tuple(sink)


class MoEEUpcycledModel(MoEEUpcycledPreTrainedModel):
    """`AutoModel` class: the base model's forward (``last_hidden_state``), like ``AutoModel`` of the dense model.

    ``output_router_logits=True`` adds ``router_logits`` (one ``[tokens, num_experts]`` tensor per
    MoE layer) to the base model's output."""

    def forward(self, *args, **kwargs):
        if kwargs.get("return_dict") is False:
            raise ValueError("MoEEUpcycledModel returns a ModelOutput; return_dict=False is not supported")
        out, router_logits = _run_recording(self, self.base_model, args, kwargs)
        if router_logits is not None:
            out["router_logits"] = router_logits
        return out


class MoEEUpcycledForCausalLM(MoEEUpcycledPreTrainedModel, GenerationMixin):
    """`AutoModelForCausalLM` class of upcycled decoders: the dense causal LM's forward (logits)."""

    def __init__(self, config: MoEEUpcycledConfig, dense: PreTrainedModel | None = None) -> None:
        model_type = config.text_config.model_type
        if not is_causal(config.text_config):
            raise ValueError(
                f"an upcycled {model_type} is an encoder, not a causal LM: load it with AutoModel "
                "(or upcycle it with causal=True)"
            )
        gate_spec(config.router_type).warn_if_leaky(stacklevel=2)  # expert choice looks ahead
        super().__init__(config, dense)

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.model.set_output_embeddings(value)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.model.prepare_inputs_for_generation(*args, **kwargs)

    def forward(self, *args, **kwargs) -> MoEECausalLMOutput:
        """The dense causal LM's forward, plus what moee's trainer reads: ``moe_aux`` (each MoE
        layer's routing statistics) and ``aux_loss`` (the gates' balancing losses, added to
        ``loss`` when ``labels`` are given; 0 for gates without one), and with
        ``output_router_logits=True`` (or the config's) ``router_logits``: one ``[tokens,
        num_experts]`` tensor per MoE layer, as transformers' MoE models return them."""
        if kwargs.get("return_dict") is False:
            raise ValueError(
                "MoEEUpcycledForCausalLM returns a ModelOutput; return_dict=False is not supported"
            )
        out, router_logits = _run_recording(self, self.model, args, kwargs)
        moe_aux = tuple(f.last_aux for f in self.moe_ffns() if f.last_aux is not None)
        aux_loss = torch.stack([a["loss"] for a in moe_aux]).sum() if moe_aux else out.logits.new_zeros(())
        lm_loss = out.loss
        return MoEECausalLMOutput(
            loss=None if lm_loss is None else lm_loss + aux_loss,
            aux_loss=aux_loss,
            lm_loss=lm_loss,
            logits=out.logits,
            past_key_values=getattr(out, "past_key_values", None),
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            router_logits=router_logits,
            moe_aux=moe_aux,
        )


AutoConfig.register(MoEEUpcycledConfig.model_type, MoEEUpcycledConfig, exist_ok=True)
AutoModel.register(MoEEUpcycledConfig, MoEEUpcycledModel, exist_ok=True)
AutoModelForCausalLM.register(MoEEUpcycledConfig, MoEEUpcycledForCausalLM, exist_ok=True)
