"""Oracle test for every architecture ``supported_architectures()`` claims.

For each one a tiny random model (hidden 64, 3 layers with a dense first layer where the
architecture has them, 8 experts, top-2) runs one forward on a left- and a right-padded batch
of three sequences; the distributions pooled inside the hooks must match those computed from
the model's own ``output_router_logits`` (see ``moee.capture.oracle``).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import transformers

from moee.capture import find_routers, router_report, supported_architectures
from moee.capture.oracle import check_architecture
from moee.capture.registry import MODEL_TYPE_RULES, SCORES, SELECTION_FORMATS, UNSUPPORTED
from moee.capture.tiny import tiny_model

ARCHS = supported_architectures()


def test_at_least_thirty_architectures():
    import moee

    assert len(ARCHS) >= 30
    assert ARCHS == sorted(set(ARCHS))
    assert moee.supported_architectures() == ARCHS
    assert {"olmoe", "qwen2_moe", "mixtral", "deepseek_v3", "granitemoe", "phimoe", "moee_lm"} <= set(ARCHS)


@pytest.mark.all_architectures
@pytest.mark.parametrize("model_type", ARCHS)
def test_capture_matches_model_router_outputs(model_type):
    result = check_architecture(model_type)
    assert result.moe_layers >= 1
    assert result.n_layers == result.moe_layers + result.hash_routers + len(result.dense_layers)
    assert result.worst <= 1e-5
    assert set(result.max_abs_diff) == {
        f"{s}/{p}/{c}" for s in ("left", "right") for p in ("last", "mean") for c in SCORES
    } - (
        {f"{s}/{p}/logits" for s in ("left", "right") for p in ("last", "mean")}
        if model_type == "gemma4_text"
        else set()
    )
    # The independent check of the scoring rule ran for every architecture (none skipped) ...
    assert result.native_weight_spread is not None and result.native_weight_spread <= 1e-4
    # ... the top-k of the selection score is the block's dispatch on every real token ...
    assert result.selection_agreement == 1.0
    # ... and the recorded selection is the router's own wherever the router returns one.
    assert result.selection_returned is (SELECTION_FORMATS.get(result.router_class, "tuple") is not None)


def _declaring_model_types() -> set[str]:
    """Every causal-LM model_type of the installed transformers that declares router outputs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = set()
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = getattr(transformers, class_name, None)
        if cls is None:
            continue
        module = importlib.import_module(cls.__module__)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            declared = getattr(obj, "_can_record_outputs", None)
            if isinstance(declared, dict) and "router_logits" in declared:
                found.add(model_type)
                break
    return found


@pytest.mark.slow
def test_registry_covers_every_declaring_architecture():
    """A new transformers MoE architecture must be added to the registry (or refused with a reason)."""
    wrappers = {"gemma4", "llama4", "qwen3_5_moe", "qwen4_exp", "dots3_note"}  # tested via their *_text model
    missing = _declaring_model_types() - set(MODEL_TYPE_RULES) - set(UNSUPPORTED) - wrappers
    assert not missing, f"architectures without a scoring rule: {sorted(missing)}"


def test_dense_layers_are_skipped_and_reported():
    model = tiny_model("qwen2_moe", n_layers=4)  # mlp_only_layers=[0]
    report = router_report(model)
    assert report["dense_layers"] == [0]
    assert [r.layer_index for r in find_routers(model)] == [1, 2, 3]
    model = tiny_model("deepseek_v3", n_layers=3)  # first_k_dense_replace=1
    assert router_report(model)["dense_layers"] == [0]


def test_jetmoe_attention_routers_are_separate():
    model = tiny_model("jetmoe", n_layers=2)
    mlp = find_routers(model)
    both = find_routers(model, include_attention=True)
    assert len(mlp) == 2 and len(both) == 4
    assert all(r.kind == "mlp" and ".mlp." in r.name for r in mlp)
    assert {r.kind for r in both} == {"mlp", "attention"}
    assert len(router_report(model)["attention_routers"]) == 2


def test_deepseek_v4_hash_layers_are_excluded_by_default():
    model = tiny_model("deepseek_v4")  # mlp_layer_types = hash_moe, moe, moe
    default = find_routers(model)
    with_hash = find_routers(model, include_hash=True)
    assert [r.layer_index for r in default] == [1, 2]
    assert [r.kind for r in with_hash] == ["hash", "mlp", "mlp"]
    report = router_report(model)
    assert report["hash_routers"] == [with_hash[0].name]
    assert report["dense_layers"] == []  # a hash-routed layer is MoE, not dense
    assert default[0].rule == "sqrt_softplus"


def test_phimoe_native_score_is_the_sparsemixer_weight():
    """Independent check of the sparsemixer rule: the native score of the top expert equals the
    first routing weight PhiMoE's own router returns."""
    model = tiny_model("phimoe", n_layers=2)
    spec = find_routers(model)[0]
    seen = {}
    handle = spec.module.register_forward_hook(lambda m, a, out: seen.update(logits=out[0], weights=out[1]))
    try:
        with torch.no_grad():
            model(torch.randint(4, 100, (2, 6)))
    finally:
        handle.remove()
    from moee.capture.registry import apply_score

    native = apply_score(seen["logits"].float(), "native", spec.rule, spec.router)
    top = native.gather(-1, seen["logits"].argmax(dim=-1, keepdim=True)).squeeze(-1)
    assert torch.allclose(top, seen["weights"][:, 0].float(), atol=1e-6)
    assert torch.allclose(native.sum(-1), torch.ones(native.shape[0]), atol=1e-5)


def test_unsupported_architecture_is_refused_with_reason():
    model = tiny_model("doge", n_layers=2, n_experts=16)
    with pytest.raises(ValueError, match="doge is not supported"):
        find_routers(model)


def test_cohere2_sigmoid_selection_uses_the_sigmoid_rule():
    result = check_architecture("cohere2_moe", expert_selection_fn="sigmoid")
    assert result.rule == "sigmoid"
    assert result.native_weight_spread is not None and result.native_weight_spread <= 1e-4
