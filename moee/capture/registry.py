"""Finding the routers of a Mixture-of-Experts model and knowing how each architecture scores experts.

Routers are found from what the model itself declares, not from module names:
transformers 5 lists, for every MoE model, the module class whose output holds the router
logits in ``PreTrainedModel._can_record_outputs["router_logits"]`` (an ``OutputRecorder``
with the class and the index of the logits in its output, sometimes narrowed by a
``layer_name``). Matching the name "gate" instead would also hit ``shared_expert_gate``,
gated-MLP projections and attention gates.

Every router found becomes a :class:`RouterSpec`; the hooks of
:class:`moee.capture.recorder.RoutingRecorder` read the **raw router logits** over all experts
(before any top-k) from it and turn them into a dense distribution with a scoring rule:

``score="native"``    (the default, :data:`DEFAULT_SCORE`) the architecture's own scoring
                      function applied densely to all experts (see :data:`RULES`): the scores the
                      model itself computes and weights its experts by. Sigmoid for DeepSeek-V3-style, Llama-4 and the
                      bundled loss-free routers (a selection-only bias such as
                      ``e_score_correction_bias`` changes *which* experts are chosen, never their
                      scores, so it is not added), sqrt-softplus for DeepSeek-V4, the first-stage
                      masked softmax of PhiMoE's sparsemixer, softmax otherwise (top-k-then-softmax
                      routers renormalise the *same* softmax over the selected experts, so their
                      dense form is the full softmax). For softmax routers it equals ``softmax``.
                      Where a selection-only bias exists, its top-k is *not* the router's choice.
``score="softmax"``   softmax over the logits for every architecture: the paper's dense routing
                      distribution (Li & Zhou 2024, the routing weights g^(l)). For a sigmoid router
                      these are values the model never computes; kept as the paper's explicit option.
``score="selection"`` what the router ranks to choose its top-k, over all experts: the native
                      scores (the logits for Kolibri, whose bias shifts the logits; the softmax for
                      PhiMoE, whose top-2 is that of the logits) plus the selection-only bias, with
                      the experts of groups dropped by group-limited routing (DeepSeek-V2/V3 style)
                      set below every kept expert (0 where the router itself fills 0). Its top-k is
                      exactly the router's own choice (:func:`selection_scores`).
``score="logits"``    the raw logits.

The router's own choice itself (its top-k indices) is read from its output by
:func:`read_selection`, for every router that returns it (see :data:`SELECTION_FORMATS`).

Deliberate choices (also in the README support table):

* Dense (non-MoE) decoder layers have no router and are skipped; :func:`router_report` lists them.
* JetMoE has routers in its attention (mixture of attention heads) as well as in its MLP;
  only MLP routers are used by default (``include_attention=True`` adds the others), because
  the MoEE paper's RW is the feed-forward routing.
* DeepSeek-V4's first layers are **hash routed**: experts are chosen by a frozen token-id
  table, so their gate scores do not decide anything and carry token identity rather than
  context. They are excluded by default (``include_hash=True`` adds their gate scores).
* Doge is not supported: its product-key router reshapes the logits of all tokens of the
  batch together (the modeling file notes it "mixes router logits across tokens"), so a
  text's routing depends on its batch neighbours; ``find_routers`` refuses it.

Custom-code models (``trust_remote_code=True``) declare nothing; for them :func:`find_routers` falls
back to :func:`find_routers_by_pattern`, documented there. DeepSeekMoE v1 (deepseek-moe-16b) is not
one of them: ``moee.models.deepseek_v1`` loads it natively, with declared routers.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from moee.embed.methods import DEFAULT_SCORE, SCORES

__all__ = [
    "DEFAULT_SCORE",
    "RULES",
    "SCORES",
    "SELECTION_FORMATS",
    "MODEL_TYPE_RULES",
    "UNSUPPORTED",
    "RouterSpec",
    "ScoringRule",
    "apply_score",
    "backbone",
    "find_routers",
    "find_routers_by_pattern",
    "router_report",
    "read_selection",
    "rule_for_model_type",
    "selection_bias",
    "selection_scores",
    "supported_architectures",
]


# --------------------------------------------------------------------------------------------
# Scoring rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoringRule:
    """How an architecture turns router logits into expert scores.

    ``native(logits, router)`` maps float32 logits ``[..., E]`` to the dense native scores over
    all ``E`` experts; ``router`` is the declared router module (some rules read a parameter
    from it, e.g. PhiMoE's jitter epsilon). ``choice(logits, router)``, when set, is what the
    router ranks before its selection-only bias is added, if that is not the native scores.
    """

    name: str
    description: str
    native: Callable[[torch.Tensor, nn.Module], torch.Tensor]
    choice: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None


def _softmax(logits: torch.Tensor, router: nn.Module) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def _sigmoid(logits: torch.Tensor, router: nn.Module) -> torch.Tensor:
    return torch.sigmoid(logits)


def _identity(logits: torch.Tensor, router: nn.Module) -> torch.Tensor:
    return logits


def _sqrt_softplus(logits: torch.Tensor, router: nn.Module) -> torch.Tensor:
    # DeepSeek-V4 routers keep their configured activation as `score_fn`; use it when present so
    # a config with another `scoring_func` is honoured.
    score_fn = getattr(router, "score_fn", None)
    if callable(score_fn):
        return score_fn(logits)
    return torch.sqrt(F.softplus(logits))


def _sparsemixer(logits: torch.Tensor, router: nn.Module) -> torch.Tensor:
    """First stage of PhiMoE's sparsemixer, dense: a softmax over the experts whose logit is within
    the relative jitter threshold of the best one (the others get 0). Its value at the top expert
    is exactly the weight PhiMoE gives that expert at inference."""
    eps = float(getattr(router, "router_jitter_noise", 0.01))
    top = logits.max(dim=-1, keepdim=True).values
    factor = logits.abs().clamp(min=top)
    masked = ((top - logits) / factor) > (2 * eps)
    return torch.softmax(logits.masked_fill(masked, float("-inf")), dim=-1)


RULES: dict[str, ScoringRule] = {
    rule.name: rule
    for rule in (
        ScoringRule("softmax", "softmax over all experts, then top-k", _softmax),
        ScoringRule(
            "topk_softmax",
            "top-k on the logits, softmax over the selected; dense form: softmax over all experts",
            _softmax,
        ),
        ScoringRule("sigmoid", "sigmoid per expert", _sigmoid),
        ScoringRule(
            "sigmoid_bias",
            "sigmoid per expert; e_score_correction_bias shifts the selection only (not the scores)",
            _sigmoid,
        ),
        ScoringRule(
            "sigmoid_logit_bias",
            "sigmoid per expert; a correction bias on the logits shifts the selection only",
            _sigmoid,
            choice=_identity,
        ),
        ScoringRule(
            "softmax_bias",
            "softmax over all experts; a correction bias shifts the selection only",
            _softmax,
        ),
        ScoringRule("sqrt_softplus", "sqrt(softplus(logit)) per expert (DeepSeek-V4)", _sqrt_softplus),
        ScoringRule(
            "sparsemixer",
            "PhiMoE sparsemixer: softmax over the experts within the jitter threshold of the best",
            _sparsemixer,
            choice=_softmax,  # eval mode: the best expert, then the best of the rest = top-2 of the logits
        ),
    )
}

#: The scoring rule of every architecture (transformers ``model_type``) that passes the oracle
#: test in ``tests/test_capture_architectures.py``. Read from each router's ``forward``.
#: Multimodal wrappers (``gemma4``, ``llama4``, ``qwen3_5_moe``, ``qwen4_exp``, ``dots3_note``) use
#: the rule of their text model (``gemma4_text`` ...); only the text models are tested and listed.
MODEL_TYPE_RULES: dict[str, str] = {
    # softmax over all experts, top-k of the probabilities
    "olmoe": "softmax",
    "flex_olmo": "softmax",
    "qwen2_moe": "softmax",
    "qwen3_moe": "softmax",
    "qwen3_next": "softmax",
    "qwen3_5_moe_text": "softmax",
    "qwen4_exp_text": "softmax",
    "mixtral": "softmax",
    "minimax": "softmax",
    "mellum": "softmax",
    "lara_mini": "softmax",
    "deepseek_v2": "softmax",
    "deepseek": "softmax",  # DeepSeekMoE v1, native in moee.models.deepseek_v1
    "hunyuan_v1_moe": "softmax",
    "jamba": "softmax",
    "dbrx": "softmax",
    "gemma4_text": "softmax",
    "zaya": "softmax",
    "moee_lm": "softmax",
    # softmax for scores, a statistics / correction bias for the selection only
    "ernie4_5_moe": "softmax_bias",
    "longcat_flash": "softmax_bias",
    # top-k on the logits, softmax over the k selected
    "granitemoe": "topk_softmax",
    "granitemoe_swa": "topk_softmax",
    "granitemoeshared": "topk_softmax",
    "granitemoehybrid": "topk_softmax",
    "gpt_oss": "topk_softmax",
    "aria_text": "topk_softmax",
    "jetmoe": "topk_softmax",
    "cohere2_moe": "topk_softmax",
    # sigmoid scores (+ selection-only correction bias, DeepSeek-V3 style)
    "deepseek_v3": "sigmoid_bias",
    "deepseek_v32": "sigmoid_bias",
    "sarvam_mla": "sigmoid_bias",
    "glm4_moe": "sigmoid_bias",
    "glm4_moe_lite": "sigmoid_bias",
    "glm_moe_dsa": "sigmoid_bias",
    "sarvam_moe": "sigmoid_bias",
    "dots1": "sigmoid_bias",
    "dots3_note_text": "sigmoid_bias",
    "kimi_linear": "sigmoid_bias",
    "exaone_moe": "sigmoid_bias",
    "solar_open": "sigmoid_bias",
    "nemotron_h": "sigmoid_bias",
    "mimo_v2_flash": "sigmoid_bias",
    "hy_v3": "sigmoid_bias",
    "hy_v4": "sigmoid_bias",
    "axk1": "sigmoid_bias",
    "axk2": "sigmoid_bias",
    "bailing_hybrid": "sigmoid_bias",
    "beam": "sigmoid_bias",
    "afmoe": "sigmoid_bias",
    "minimax_m2": "sigmoid_bias",
    "minimax_m3_vl_text": "sigmoid_bias",
    "lfm2_moe": "sigmoid_bias",
    "laguna": "sigmoid_bias",
    "kolibri1": "sigmoid_logit_bias",
    "inkling_text": "sigmoid_bias",
    "flint": "sigmoid",
    "llama4_text": "sigmoid",
    # other activations
    "deepseek_v4": "sqrt_softplus",
    "inkling2_text": "sqrt_softplus",
    "inkling2_loop_text": "sqrt_softplus",
    "phimoe": "sparsemixer",
}

#: Architectures that declare routers but are refused, with the reason.
UNSUPPORTED: dict[str, str] = {
    "doge": (
        "Doge's product-key router reshapes the logits of all tokens of the batch together, so a "
        "text's routing depends on the other texts in its batch; per-text embeddings are impossible"
    ),
}

#: Router classes whose declared output holds probabilities, not logits: the hook goes on the
#: child Linear that produces the logits instead (class name -> attribute of that Linear).
_LOGITS_CHILD: dict[str, str] = {"Gemma4TextRouter": "proj"}

#: Class names of DeepSeek-V4-style hash routers (expert choice from a token-id table).
_HASH_ROUTER_CLASSES = ("DeepseekV4HashRouter",)


def rule_for_model_type(model_type: str | None, router: nn.Module | None = None) -> str:
    """The scoring-rule name of ``model_type``; for an unknown type, inferred from the router.

    Inference (used for custom and future models): a router with an ``e_score_correction_bias``
    is DeepSeek-V3-style sigmoid, one with a ``score_fn`` uses it (sqrt-softplus family),
    anything else is treated as softmax, the most common rule. A router that names its own rule
    (a ``scoring_rule`` attribute that is a key of ``RULES``, as this project's ``MoEERouter``
    does, since its rule depends on the gate it was trained with) is taken at its word.
    """
    declared = getattr(router, "scoring_rule", None)
    if isinstance(declared, str) and declared in RULES:
        return declared
    if model_type in MODEL_TYPE_RULES:
        rule = MODEL_TYPE_RULES[model_type]
        # Cohere2-MoE configs choose softmax or sigmoid over the selected logits.
        if rule == "topk_softmax" and getattr(router, "expert_selection_fn", None) == "sigmoid":
            return "sigmoid"
        return rule
    if router is not None:
        if hasattr(router, "e_score_correction_bias"):
            return "sigmoid_bias"
        if callable(getattr(router, "score_fn", None)):
            return "sqrt_softplus"
    return "softmax"


#: Routers that fill the experts of dropped groups with 0 (not -inf) before their top-k.
_ZERO_FILLED_GROUPS = ("AXK2TopkRouter", "DeepseekV2TopkRouter")


def _group_limited(scores: torch.Tensor, router: nn.Module | None) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2/V3 style): only the experts of the ``topk_group`` best of
    ``num_group`` groups stay eligible. A group's score is its best expert's for DeepSeek-V2's
    ``group_limited_greedy``, the sum of its best two otherwise, as those routers compute it. Dropped
    experts get 0 where the router fills 0, else a value below every kept expert (the router's
    -inf, kept finite so cosine similarities stay defined)."""
    n_group = getattr(router, "num_group", None)
    topk_group = getattr(router, "topk_group", None)
    method = getattr(router, "topk_method", None)
    if not (isinstance(n_group, int) and isinstance(topk_group, int) and topk_group < n_group):
        return scores
    if method not in (None, "group_limited_greedy"):
        return scores
    n_experts = scores.shape[-1]
    grouped = scores.reshape(*scores.shape[:-1], n_group, n_experts // n_group)
    if method == "group_limited_greedy":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, chosen, True)
    keep = keep.unsqueeze(-1).expand(grouped.shape).reshape(scores.shape)
    if type(router).__name__ in _ZERO_FILLED_GROUPS:
        return scores.masked_fill(~keep, 0.0)
    floor = scores.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True) - 1.0
    return torch.where(keep, scores, floor)


def selection_bias(
    router: nn.Module | None, args: tuple = (), kwargs: dict | None = None
) -> torch.Tensor | None:
    """The selection-only bias ``[E]`` of ``router``, or ``None`` when it has none.

    Looked up where the architectures keep it: a ``selection_bias`` the router declares (this
    project's loss-free gates), ``e_score_correction_bias`` (DeepSeek-V3 style), Ernie's
    ``moe_statics``, Zaya's ``balancing_biases``, or, for routers whose MoE block passes the bias in
    (AFMoE, HY-V3, MiniMax-M2, LFM2-MoE), the router call's second argument (``args`` / ``kwargs``
    of the forward hook).
    """
    holders = (
        (router, "selection_bias"),
        (router, "e_score_correction_bias"),
        (getattr(router, "moe_statics", None), "e_score_correction_bias"),
        (router, "balancing_biases"),
    )
    for holder, name in holders:
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, torch.Tensor):
            return value.reshape(-1)
    if getattr(router, "use_expert_bias", True) is False:  # LFM2-MoE ignores the bias it is passed
        return None
    kwargs = kwargs or {}
    for name in ("expert_bias", "e_score_correction_bias"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name].reshape(-1)
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 1:
        return args[1]
    return None


def selection_scores(
    logits: torch.Tensor, rule: str, router: nn.Module | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the router ranks to choose its top-k, over all experts (``score="selection"``).

    The rule's choice scores (its native scores unless :class:`ScoringRule` says otherwise) plus the
    selection-only ``bias`` (see :func:`selection_bias`), then group limiting (:func:`_group_limited`).
    Its top-k equals the router's own selection on every token of every architecture in
    ``supported_architectures()`` (tested in ``tests/test_capture_architectures.py``).
    """
    scoring = RULES[rule]
    scores = (scoring.choice or scoring.native)(logits, router)
    if bias is not None:
        scores = scores + bias.to(device=scores.device, dtype=scores.dtype)
    return _group_limited(scores, router)


def apply_score(
    logits: torch.Tensor,
    score: str,
    rule: str,
    router: nn.Module | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn float32 router ``logits [..., E]`` into the requested dense scores (see :data:`SCORES`).

    ``bias`` is the router's selection-only bias, used by ``score="selection"`` only.
    """
    if score == "logits":
        return logits
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    if score == "native":
        return RULES[rule].native(logits, router)
    if score == "selection":
        return selection_scores(logits, rule, router, bias)
    raise ValueError(f"unknown score {score!r}; expected one of: {', '.join(SCORES)}")


# --------------------------------------------------------------------------------------------
# The router's own selection
# --------------------------------------------------------------------------------------------

#: Where a router's output holds its own top-k choice, by router class, for the routers whose
#: output is not the common ``(logits, top_k_weights, top_k_index, ...)`` tuple (format
#: ``"tuple"``, the default for every router whose logits are output 0):
#:
#: * ``None``: the router returns no selection (DBRX returns logits only; its block does the top-k),
#:   so the selection is re-derived from :func:`selection_scores`;
#: * ``"scattered"``: Llama-4 returns ``(scores [N, E], logits)``, the scores nonzero only at the
#:   selected experts;
#: * ``"grouped"``: JetMoE returns ``(index_sorted_experts, batch_index, batch_gates,
#:   expert_size, logits)``, the assignments sorted by expert;
#: * ``"skip_masked"``: Zaya returns the tuple, but with its extra skip expert replaced by index 0
#:   with weight 0; the skip index (the last router class) is restored.
SELECTION_FORMATS: dict[str, str | None] = {
    "DbrxRouter": None,
    "Llama4Router": "scattered",
    "JetMoeTopKGating": "grouped",
    "ZayaRouter": "skip_masked",
}


def _is_index(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool


def read_selection(spec: RouterSpec, output: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's own choice from its forward ``output``: ``(indices [N, k] long, weights [N, k])``
    with ``N`` the flattened tokens, or ``None`` when the output does not hold it (format ``None``
    or an output without the expected structure)."""
    fmt = spec.selection_format
    if fmt in ("tuple", "skip_masked"):
        if not (isinstance(output, (tuple, list)) and len(output) >= 3 and _is_index(output[2])):
            return None
        weights, index = output[1], output[2]
        if not (isinstance(weights, torch.Tensor) and weights.shape == index.shape):
            return None
        index = index.reshape(-1, index.shape[-1]).long()
        weights = weights.reshape(index.shape)
        if fmt == "skip_masked":
            index = torch.where(weights == 0, torch.full_like(index, spec.n_experts - 1), index)
        return index, weights
    if fmt == "scattered":
        if not (isinstance(output, (tuple, list)) and isinstance(output[0], torch.Tensor) and spec.top_k):
            return None
        scores = output[0].reshape(-1, output[0].shape[-1])
        weights, index = scores.topk(spec.top_k, dim=-1)
        return index, weights
    if fmt == "grouped":
        if not (isinstance(output, (tuple, list)) and len(output) == 5 and _is_index(output[0])):
            return None
        order, _, gates, expert_size, logits = output
        n_tokens = logits.reshape(-1, logits.shape[-1]).shape[0]
        k = order.numel() // n_tokens
        experts = torch.repeat_interleave(
            torch.arange(len(expert_size), device=order.device),
            torch.as_tensor(expert_size, device=order.device),
        )
        index = torch.empty_like(order).scatter_(0, order, experts)
        weights = torch.empty_like(gates).scatter_(0, order, gates)
        return index.reshape(n_tokens, k).long(), weights.reshape(n_tokens, k)
    return None


# --------------------------------------------------------------------------------------------
# Router discovery
# --------------------------------------------------------------------------------------------


@dataclass
class RouterSpec:
    """One router: what to hook and how to read and score its output.

    ``module`` is hooked; ``logits_index`` is the index of the logits in its output tuple, or
    ``None`` when the output is the logits tensor (a module declared with an index that returns a
    plain tensor, like DBRX's router, is read as that tensor). ``router`` is the declared router module
    (equal to ``module`` except when the hook goes on a child Linear). ``kind`` is ``"mlp"``,
    ``"attention"`` (JetMoE's attention routers), ``"hash"`` (DeepSeek-V4 hash-routed layers) or
    ``"pattern"`` (found by the fallback). ``from_input=True`` makes the hook recompute the logits
    from the module's input and its own ``weight`` (and ``bias``) instead of reading its output;
    the recorder also does this whenever the output at ``logits_index`` is not ``[..., n_experts]``
    (routers that return only top-k values). ``top_k`` is how many experts the router selects per
    token (``None`` if unknown) and ``selection_format`` where the declared router's output holds
    that choice (see :data:`SELECTION_FORMATS`; ``None``: it returns none).
    """

    name: str
    module: nn.Module
    layer_index: int
    n_experts: int
    rule: str
    logits_index: int | None
    kind: str = "mlp"
    router: nn.Module | None = field(default=None, repr=False)
    from_input: bool = False
    top_k: int | None = None
    selection_format: str | None = None

    def __post_init__(self) -> None:
        if self.router is None:
            self.router = self.module


def _model_type(model: nn.Module) -> str | None:
    """The model's ``model_type``; for a multimodal wrapper not in the registry, its text model's."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPE_RULES and callable(getattr(config, "get_text_config", None)):
        text_type = getattr(config.get_text_config(), "model_type", None)
        if text_type in MODEL_TYPE_RULES:
            return text_type
    return model_type


def _declared_specs(model: nn.Module) -> list:
    """All ``router_logits`` recorder specs declared by the model or any PreTrainedModel inside it."""
    from transformers.utils.output_capturing import OutputRecorder

    specs = []
    seen_classes = set()
    for sub in model.modules():
        cls = type(sub)
        if cls in seen_classes:
            continue
        seen_classes.add(cls)
        declared = getattr(cls, "_can_record_outputs", None)
        if not isinstance(declared, dict) or "router_logits" not in declared:
            continue
        entries = declared["router_logits"]
        for entry in entries if isinstance(entries, list) else [entries]:
            if not isinstance(entry, OutputRecorder):  # a bare class or class-name suffix, index 1
                entry = OutputRecorder(
                    target_class=None if isinstance(entry, str) else entry,
                    index=1,
                    class_name=entry if isinstance(entry, str) else None,
                )
            if entry not in specs:
                specs.append(entry)
    return specs


def _matches(spec, name: str, module: nn.Module) -> bool:
    """The same matching rule as transformers' own output capturing (class or name suffix, layer_name)."""
    hit = (spec.target_class is not None and isinstance(module, spec.target_class)) or (
        spec.class_name is not None and name.endswith(spec.class_name)
    )
    if hit and spec.layer_name is not None:
        hit = "." + spec.layer_name.strip(".") + "." in "." + name + "."
    return hit


_INT_PART = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _layer_index(name: str) -> int:
    """The decoder-layer number in a module path (the first integer component), -1 if none."""
    match = _INT_PART.search(name)
    return int(match.group(1)) if match else -1


def _n_experts(router: nn.Module, logits_module: nn.Module) -> int:
    """Number of logits the router emits per token."""
    for attr in ("num_router_classes", "n_routed_experts", "num_experts"):
        value = getattr(router, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    if isinstance(logits_module, nn.Linear):
        return logits_module.out_features
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    if len(linears) == 1:
        return linears[0].out_features
    raise ValueError(f"cannot tell the number of experts of router {type(router).__name__}")


_TOP_K_NAMES = (
    "top_k",
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "top_k_experts",
    "moe_k",
)


def _top_k(router: nn.Module, model: nn.Module) -> int | None:
    """How many experts ``router`` selects per token: its own attribute, else the (text) config's
    (DBRX keeps it in ``ffn_config``, Gemma-4 in the router's ``config``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    for holder in (router, getattr(router, "config", None), text, getattr(text, "ffn_config", None)):
        for name in _TOP_K_NAMES:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _kind(name: str, router: nn.Module) -> str:
    if type(router).__name__ in _HASH_ROUTER_CLASSES:
        return "hash"
    parts = name.split(".")
    in_attention = any("attention" in p or "attn" in p for p in parts)
    in_ffn = any(p in ("mlp", "feed_forward", "ffn", "moe", "block_sparse_moe") for p in parts)
    return "attention" if in_attention and not in_ffn else "mlp"


def _declared_routers(model: nn.Module) -> list[RouterSpec]:
    specs = _declared_specs(model)
    if not specs:
        return []
    model_type = _model_type(model)
    found: list[RouterSpec] = []
    for name, module in model.named_modules():
        spec = next((s for s in specs if _matches(s, name, module)), None)
        if spec is not None:
            hooked, logits_index = module, spec.index
        elif type(module).__name__ in _HASH_ROUTER_CLASSES:  # not declared by the model: its own choice
            hooked, logits_index = module, 0
        else:
            continue
        cls_name = type(module).__name__
        selection_format = SELECTION_FORMATS.get(cls_name, "tuple" if logits_index == 0 else None)
        child = _LOGITS_CHILD.get(cls_name)
        if child is not None:
            hooked, logits_index = getattr(module, child), None
        found.append(
            RouterSpec(
                name=name if hooked is module else f"{name}.{child}",
                module=hooked,
                layer_index=_layer_index(name),
                n_experts=_n_experts(module, hooked),
                rule=rule_for_model_type(model_type, module),
                logits_index=logits_index,
                kind=_kind(name, module),
                router=module,
                top_k=_top_k(module, model),
                selection_format=selection_format,
            )
        )
    return found


# Names of Linear layers that are gates but never expert routers.
_NOT_ROUTERS = re.compile(r"(shared_expert_gate|shared_experts?|gate_proj|gate_up_proj|up_proj|down_proj)$")
_ROUTER_NAMES = ("gate", "router", "wg", "gating", "router_gate", "classifier")


def _has_experts(block: nn.Module, n_experts: int) -> bool:
    """Whether ``block`` holds ``n_experts`` experts: a ModuleList of that length, or 3D weights."""
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts) == n_experts
    if isinstance(experts, nn.Module):
        return any(p.dim() == 3 and p.shape[0] == n_experts for p in experts.parameters(recurse=False))
    return False


def find_routers_by_pattern(model: nn.Module) -> list[RouterSpec]:
    """Fallback finder for models that declare no routers (custom code, older checkpoints).

    A router is a module named one of ``gate``, ``router``, ``wg``, ``gating``, ``router_gate``,
    ``classifier`` whose parent block also holds an ``experts`` ModuleList (or fused 3D expert
    weights) with as many experts as the router has outputs. The router is either an
    ``nn.Linear [hidden -> n_experts]`` or a module with a 2D ``weight [n_experts, hidden]``
    (deepseek-moe's ``MoEGate``); its **input** is re-projected in the hook, so what the custom
    module returns does not matter. ``shared_expert_gate``, ``gate_proj`` and friends never match.
    """
    found: list[RouterSpec] = []
    modules = dict(model.named_modules())
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in _ROUTER_NAMES or _NOT_ROUTERS.search(name):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        n_experts, in_features = int(weight.shape[0]), int(weight.shape[1])
        if n_experts < 2 or (hidden is not None and in_features != hidden):
            continue
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        if parent is None or not _has_experts(parent, n_experts):
            continue
        found.append(
            RouterSpec(
                name=name,
                module=module,
                layer_index=_layer_index(name),
                n_experts=n_experts,
                rule=rule_for_model_type(_model_type(model), module),
                logits_index=None,
                kind="pattern",
                from_input=True,
                top_k=_top_k(module, model),
            )
        )
    return found


def find_routers(
    model: nn.Module, *, include_attention: bool = False, include_hash: bool = False
) -> list[RouterSpec]:
    """Every MoE router of ``model`` in layer order (see the module docstring for what is skipped).

    Raises ``ValueError("no MoE router found in <ModelClass>")`` when there is none, and a
    ``ValueError`` naming the reason for architectures in :data:`UNSUPPORTED`.
    """
    model_type = _model_type(model)
    if model_type in UNSUPPORTED:
        raise ValueError(f"{model_type} is not supported: {UNSUPPORTED[model_type]}")
    routers = _declared_routers(model)
    if not routers:
        routers = find_routers_by_pattern(model)
        if routers:
            warnings.warn(
                f"{type(model).__name__} declares no router outputs; using the pattern-based finder "
                f"({len(routers)} routers: {routers[0].name} ...). Check them with moee.capture.router_report.",
                stacklevel=2,
            )
    routers = [
        r
        for r in routers
        if (r.kind != "attention" or include_attention) and (r.kind != "hash" or include_hash)
    ]
    if not routers:
        raise ValueError(f"no MoE router found in {type(model).__name__}")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    routers.sort(key=lambda r: (r.layer_index, order.get(r.name, math.inf)))
    return routers


def backbone(model: nn.Module) -> nn.Module:
    """The module whose output holds ``last_hidden_state`` (the decoder stack, final norm included).

    ``model.base_model`` for most causal LMs; ``get_decoder()`` or a ``model`` / ``language_model``
    child when ``base_model_prefix`` does not name an attribute (e.g. Llama-4's text model).
    """
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError):
            decoder = None
        if isinstance(decoder, nn.Module) and decoder is not model:
            return decoder
    for name in ("model", "language_model", "transformer"):
        child = getattr(model, name, None)
        if isinstance(child, nn.Module):
            return child
    return model


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers, from the ``hidden_states`` recorder the model declares (else by name)."""
    from transformers.utils.output_capturing import OutputRecorder

    targets = []
    for sub in model.modules():
        declared = getattr(type(sub), "_can_record_outputs", None)
        if isinstance(declared, dict) and "hidden_states" in declared:
            entries = declared["hidden_states"]
            for entry in entries if isinstance(entries, list) else [entries]:
                targets.append(entry if isinstance(entry, OutputRecorder) else OutputRecorder(entry))
    layers = []
    for name, module in model.named_modules():
        if any(isinstance(t.target_class, type) and _matches(t, name, module) for t in targets):
            layers.append((name, module))
    if layers:
        return layers
    pattern = re.compile(r"(?:^|\.)(layers|h|blocks)\.\d+$")
    return [(n, m) for n, m in model.named_modules() if pattern.search(n)]


def router_report(model: nn.Module) -> dict:
    """What capture will use and skip: MoE layers, dense layers, attention and hash routers.

    Returns a dict with ``model_type``, ``rule``, ``n_layers``, ``moe_layers`` (router names in
    use), ``dense_layers`` (indices of decoder layers without an MLP router), ``attention_routers``
    and ``hash_routers`` (names, excluded by default), ``n_experts``.
    """
    all_routers = find_routers(model, include_attention=True, include_hash=True)
    used = [r for r in all_routers if r.kind not in ("attention", "hash")]
    layers = _decoder_layers(model)
    with_router = {r.layer_index for r in all_routers if r.kind != "attention"}
    layer_ids = sorted({_layer_index(n) for n, _ in layers})
    return {
        "model_type": _model_type(model),
        "rule": used[0].rule if used else None,
        "n_layers": len(layer_ids),
        "moe_layers": [r.name for r in used],
        "dense_layers": [i for i in layer_ids if i not in with_router],
        "attention_routers": [r.name for r in all_routers if r.kind == "attention"],
        "hash_routers": [r.name for r in all_routers if r.kind == "hash"],
        "n_experts": sorted({r.n_experts for r in used}),
    }


def supported_architectures() -> list[str]:
    """The transformers ``model_type`` names whose capture passes the oracle test, sorted.

    Each one is exercised by ``tests/test_capture_architectures.py`` on a tiny random model
    (captured distributions against the model's own ``output_router_logits``; the recorded selection,
    the top-k of the ``selection`` score and the native weights against what each MoE block
    dispatches).
    """
    return sorted(MODEL_TYPE_RULES)
