"""Finding the routers of a Mixture-of-Experts model (discovery only; scoring is in ``architectures``).

Routers are found from what the model itself declares, not from module names:
transformers 5 lists, for every MoE model, the module class whose output holds the router
logits in ``PreTrainedModel._can_record_outputs["router_logits"]`` (an ``OutputRecorder``
with the class and the index of the logits in its output, sometimes narrowed by a
``layer_name``). Matching the name "gate" instead would also hit ``shared_expert_gate``,
gated-MLP projections and attention gates.

Every router found becomes a :class:`RouterSpec`; the hooks of
:class:`moee.capture.recorder.RoutingRecorder` read its raw router logits and score them with
the architecture's rule. Everything known per architecture (scoring rules, router classes read
differently, selection formats, where a selection-only bias lives, top-k and expert-count keys)
is in :mod:`moee.capture.architectures`; it is re-exported here.

Deliberate choices (also in the support table, docs/support_table.md):

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
from dataclasses import dataclass, field

import torch
from torch import nn

from moee.capture.architectures import (
    DEFAULT_SCORE,
    MODEL_TYPE_RULES,
    ROUTER_EXPERT_COUNT_ATTRIBUTES,
    RULES,
    SCORES,
    SELECTION_FORMATS,
    TOP_K_KEYS,
    UNSUPPORTED,
    ScoringRule,
    _router_class,
    apply_score,
    read_selection,
    rule_for_model_type,
    selection_bias,
    selection_scores,
)

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
    for attr in ROUTER_EXPERT_COUNT_ATTRIBUTES:
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


def _top_k(router: nn.Module, model: nn.Module) -> int | None:
    """How many experts ``router`` selects per token: its own attribute, else the (text) config's
    (DBRX keeps it in ``ffn_config``, Gemma-4 in the router's ``config``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    for holder in (router, getattr(router, "config", None), text, getattr(text, "ffn_config", None)):
        for name in TOP_K_KEYS:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _kind(name: str, router: nn.Module) -> str:
    if _router_class(router).hash_routed:
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
        elif _router_class(module).hash_routed:  # not declared by the model: its own choice
            hooked, logits_index = module, 0
        else:
            continue
        cls_name = type(module).__name__
        selection_format = SELECTION_FORMATS.get(cls_name, "tuple" if logits_index == 0 else None)
        child = _router_class(module).logits_child  # its output holds probabilities
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
