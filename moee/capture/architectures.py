"""What capture knows about each MoE architecture, in one declarative table, and the scoring it implies.

Everything architecture-specific that router capture needs lives here: the scoring rule of each
``model_type`` (:data:`ARCHITECTURES`), the router classes that need special reading
(:data:`ROUTER_CLASSES`: probabilities instead of logits, where the selection is in the output,
hash routing, zero-filled groups, per-expert scales), where a selection-only bias lives
(:data:`SELECTION_BIAS_ATTRIBUTES`, :data:`SELECTION_BIAS_ARGUMENTS`) and the config keys that
hold top-k and the expert count (:data:`TOP_K_KEYS`, :data:`EXPERT_COUNT_KEYS`).
:mod:`moee.capture.registry` only discovers routers; it, the oracle, the tiny-model builder and
the analyses read these tables. Adding an architecture is one :data:`ARCHITECTURES` entry (plus
an ``_OVERRIDES`` entry in :mod:`moee.capture.tiny` if its tiny config needs one); the oracle test
picks it up from :func:`moee.capture.registry.supported_architectures`.

The hooks of :class:`moee.capture.recorder.RoutingRecorder` read the **raw router logits** over all
experts (before any top-k) and turn them into a dense distribution with a scoring rule:

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from moee.capture.vocabulary import DEFAULT_SCORE, SCORES

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_SCORE",
    "EXPERT_COUNT_KEYS",
    "MODEL_TYPE_RULES",
    "ROUTER_CLASSES",
    "ROUTER_EXPERT_COUNT_ATTRIBUTES",
    "RULES",
    "SCORES",
    "SELECTION_BIAS_ARGUMENTS",
    "SELECTION_BIAS_ATTRIBUTES",
    "SELECTION_FORMATS",
    "TOP_K_KEYS",
    "UNSUPPORTED",
    "INFERRED",
    "Architecture",
    "RouterClass",
    "ScoringRule",
    "SelectionSource",
    "apply_score",
    "read_selection",
    "rule_for_model_type",
    "selection_bias",
    "selection_scores",
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


# --------------------------------------------------------------------------------------------
# The architecture table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """One transformers ``model_type``: its scoring rule (a key of :data:`RULES`, read from its
    router's ``forward``) and what the support table notes about it."""

    rule: str
    notes: str = ""


#: Every architecture (transformers ``model_type``) that passes the oracle test in
#: ``tests/test_capture_architectures.py``.
#: Multimodal wrappers (``gemma4``, ``llama4``, ``qwen3_5_moe``, ``qwen4_exp``, ``dots3_note``) use
#: the rule of their text model (``gemma4_text`` ...); only the text models are tested and listed.
ARCHITECTURES: dict[str, Architecture] = {
    # softmax over all experts, top-k of the probabilities
    "olmoe": Architecture("softmax"),
    "flex_olmo": Architecture("softmax"),
    "qwen2_moe": Architecture("softmax"),
    "qwen3_moe": Architecture("softmax"),
    "qwen3_next": Architecture("softmax"),
    "qwen3_5_moe_text": Architecture("softmax"),
    "qwen4_exp_text": Architecture("softmax"),
    "mixtral": Architecture("softmax"),
    "minimax": Architecture("softmax"),
    "mellum": Architecture("softmax"),
    "lara_mini": Architecture("softmax"),
    "deepseek_v2": Architecture("softmax"),
    "deepseek": Architecture(
        "softmax",
        "DeepSeekMoE v1 (deepseek-moe-16b), native in `moee.models.deepseek_v1` (no remote code; checked against the original code by `scripts/compare_deepseek_v1.sh`); shared experts are not routers",
    ),  # DeepSeekMoE v1, native in moee.models.deepseek_v1
    "hunyuan_v1_moe": Architecture("softmax"),
    "jamba": Architecture("softmax"),
    "dbrx": Architecture("softmax", "router returns logits only; its block takes the top-k of the softmax"),
    "gemma4_text": Architecture(
        "softmax",
        "router outputs probabilities; logits read from its `proj` Linear",
    ),
    "zaya": Architecture("softmax", "9 columns per layer: 8 experts + the skip expert the router can choose"),
    "moee_lm": Architecture("softmax", "this project's own MoE LM (`moee.moe.lm`), no special case"),
    "moee_upcycled": Architecture(
        "softmax_bias",
        "this project's upcycled dense models (`moee.moe.upcycled`, both shipped models); the router names "
        "its gate's rule; checked in copy mode (split mode sums the selected experts, the scores only select)",
    ),
    # softmax for scores, a statistics / correction bias for the selection only
    "ernie4_5_moe": Architecture("softmax_bias"),
    "longcat_flash": Architecture("softmax_bias", "includes zero (identity) experts when configured"),
    # top-k on the logits, softmax over the k selected
    "granitemoe": Architecture("topk_softmax"),
    "granitemoe_swa": Architecture("topk_softmax"),
    "granitemoeshared": Architecture("topk_softmax"),
    "granitemoehybrid": Architecture("topk_softmax"),
    "gpt_oss": Architecture("topk_softmax"),
    "aria_text": Architecture("topk_softmax"),
    "jetmoe": Architecture(
        "topk_softmax",
        "attention routers (mixture of attention heads) found too; excluded from RW by default",
    ),
    "cohere2_moe": Architecture("topk_softmax"),
    # sigmoid scores (+ selection-only correction bias, DeepSeek-V3 style)
    "deepseek_v3": Architecture("sigmoid_bias"),
    "deepseek_v32": Architecture("sigmoid_bias"),
    "sarvam_mla": Architecture("sigmoid_bias"),
    "glm4_moe": Architecture("sigmoid_bias"),
    "glm4_moe_lite": Architecture("sigmoid_bias"),
    "glm_moe_dsa": Architecture("sigmoid_bias"),
    "sarvam_moe": Architecture("sigmoid_bias"),
    "dots1": Architecture("sigmoid_bias"),
    "dots3_note_text": Architecture("sigmoid_bias"),
    "kimi_linear": Architecture("sigmoid_bias"),
    "exaone_moe": Architecture("sigmoid_bias"),
    "solar_open": Architecture("sigmoid_bias"),
    "nemotron_h": Architecture("sigmoid_bias"),
    "mimo_v2_flash": Architecture("sigmoid_bias"),
    "hy_v3": Architecture("sigmoid_bias"),
    "hy_v4": Architecture("sigmoid_bias"),
    "axk1": Architecture("sigmoid_bias"),
    "axk2": Architecture("sigmoid_bias"),
    "bailing_hybrid": Architecture("sigmoid_bias"),
    "beam": Architecture("sigmoid_bias"),
    "afmoe": Architecture("sigmoid_bias"),
    "minimax_m2": Architecture("sigmoid_bias"),
    "minimax_m3_vl_text": Architecture("sigmoid_bias"),
    "lfm2_moe": Architecture("sigmoid_bias"),
    "laguna": Architecture("sigmoid_bias"),
    "kolibri1": Architecture(
        "sigmoid_logit_bias",
        "the correction bias is added to the logits (not the sigmoid) for the selection",
    ),
    "inkling_text": Architecture(
        "sigmoid_bias",
        "routed experts only (the shared experts' gate columns are not routing)",
    ),
    "flint": Architecture("sigmoid"),
    "llama4_text": Architecture("sigmoid", "sigmoid of the top-k logits; dense form: sigmoid of all logits"),
    # other activations
    "deepseek_v4": Architecture(
        "sqrt_softplus",
        "hash-routed layers (token-id table) excluded by default; sqrt-softplus scores",
    ),
    "inkling2_text": Architecture("sqrt_softplus"),
    "inkling2_loop_text": Architecture("sqrt_softplus"),
    "phimoe": Architecture("sparsemixer", "native = dense first stage of sparsemixer"),
}

#: The scoring rule of every architecture in :data:`ARCHITECTURES` (model_type -> rule name).
MODEL_TYPE_RULES: dict[str, str] = {name: arch.rule for name, arch in ARCHITECTURES.items()}

#: Architectures that declare routers but are refused, with the reason.
_NOT_YET_CHECKED = (
    "added to transformers (5.25) after moee's last oracle check: its router's scoring rule is not yet "
    "verified against the model's own output_router_logits, so moee refuses it rather than embed with "
    "an unchecked rule"
)

UNSUPPORTED: dict[str, str] = {
    "ergo": _NOT_YET_CHECKED,
    "kolibri1_1": _NOT_YET_CHECKED,
    "minicpm5_moe": _NOT_YET_CHECKED,
    "param2moe": _NOT_YET_CHECKED,
    "doge": (
        "Doge's product-key router reshapes the logits of all tokens of the batch together, so a "
        "text's routing depends on the other texts in its batch; per-text embeddings are impossible"
    ),
}

#: ``RouterClass.selection_format`` for routers whose selection follows from the declared output:
#: the common tuple when the logits are output 0, none otherwise.
INFERRED = "inferred"


@dataclass(frozen=True)
class RouterClass:
    """What a router class needs beyond its declared ``router_logits`` output.

    ``logits_child``: the declared output holds probabilities, not logits, so the hook goes on this
    child Linear, which produces the logits. ``selection_format``: where the output holds the
    router's own top-k choice (see :data:`SELECTION_FORMATS`). ``hash_routed``: experts are chosen
    from a token-id table (DeepSeek-V4's first layers). ``zero_filled_groups``: group-limited
    routing fills dropped experts with 0, not -inf. ``per_expert_scale``: the block multiplies each
    selected expert's weight by this learned per-expert parameter of the router.
    """

    logits_child: str | None = None
    selection_format: str | None = INFERRED
    hash_routed: bool = False
    zero_filled_groups: bool = False
    per_expert_scale: str | None = None
    notes: str = ""


#: Router classes (by class name) that capture reads differently from the common case.
ROUTER_CLASSES: dict[str, RouterClass] = {
    "Gemma4TextRouter": RouterClass(
        logits_child="proj",
        per_expert_scale="per_expert_scale",
        notes="outputs probabilities; the block weights experts by top_k_weights * per_expert_scale",
    ),
    "DbrxRouter": RouterClass(selection_format=None, notes="returns logits only; its block does the top-k"),
    "Llama4Router": RouterClass(
        selection_format="scattered", notes="returns (scores [N, E], logits), nonzero at the selection"
    ),
    "JetMoeTopKGating": RouterClass(
        selection_format="grouped",
        notes="returns (index_sorted_experts, batch_index, batch_gates, expert_size, logits)",
    ),
    "ZayaRouter": RouterClass(
        selection_format="skip_masked", notes="the skip expert comes back as index 0 with weight 0"
    ),
    "DeepseekV4HashRouter": RouterClass(hash_routed=True, notes="not declared by the model; logits at 0"),
    "AXK2TopkRouter": RouterClass(zero_filled_groups=True),
    "DeepseekV2TopkRouter": RouterClass(zero_filled_groups=True),
}

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
    name: rc.selection_format for name, rc in ROUTER_CLASSES.items() if rc.selection_format != INFERRED
}

#: Where a selection-only bias lives on a router, in lookup order: (child attribute or ``None`` for
#: the router itself, tensor attribute).
SELECTION_BIAS_ATTRIBUTES: tuple[tuple[str | None, str], ...] = (
    (None, "selection_bias"),
    (None, "e_score_correction_bias"),
    ("moe_statics", "e_score_correction_bias"),  # ERNIE-4.5
    (None, "balancing_biases"),
)
#: Keyword arguments of a router call that carry the bias when the router does not hold it.
SELECTION_BIAS_ARGUMENTS = ("expert_bias", "e_score_correction_bias")

#: Attributes (of the router, its config, the text config or DBRX's ``ffn_config``) that hold how
#: many experts each token is routed to, in lookup order.
TOP_K_KEYS = (
    "top_k",
    "num_experts_per_tok",  # Mixtral, OLMoE, Qwen-MoE, DeepSeek, gpt-oss, our MoEEConfig
    "num_experts_per_token",
    "moe_top_k",
    "moe_topk",
    "top_k_experts",
    "moe_k",
    "num_selected_experts",
    "router_top_k",
    "experts_per_token",
)
#: Config keys that hold the number of routed experts (what the tiny configs shrink).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: Router attributes that hold the number of logits it emits per token, in lookup order.
ROUTER_EXPERT_COUNT_ATTRIBUTES = ("num_router_classes", "n_routed_experts", "num_experts")


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


_PLAIN = RouterClass()


def _router_class(router: object) -> RouterClass:
    """The :data:`ROUTER_CLASSES` entry of ``router``'s class (the common case if it has none)."""
    return ROUTER_CLASSES.get(type(router).__name__, _PLAIN)


# --------------------------------------------------------------------------------------------
# Scores and selection
# --------------------------------------------------------------------------------------------


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
    if _router_class(router).zero_filled_groups:
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
    for child, name in SELECTION_BIAS_ATTRIBUTES:
        holder = router if child is None else getattr(router, child, None)
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, torch.Tensor):
            return value.reshape(-1)
    if getattr(router, "use_expert_bias", True) is False:  # LFM2-MoE ignores the bias it is passed
        return None
    kwargs = kwargs or {}
    for name in SELECTION_BIAS_ARGUMENTS:
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


def _is_index(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool


class SelectionSource(Protocol):
    """What :func:`read_selection` reads of a router (a :class:`moee.capture.registry.RouterSpec`):
    declared here so that this module does not import the discovery module that imports it."""

    selection_format: str | None
    n_experts: int
    top_k: int | None


def read_selection(spec: SelectionSource, output: object) -> tuple[torch.Tensor, torch.Tensor] | None:
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
