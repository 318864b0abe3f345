"""MoEE language model: HF conventions (Auto classes, router capture, output_router_logits), save/load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moee.moe.layer import MoEERouter
from moee.moe.lm import MoEEConfig, MoEEForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "moee" / "assets" / "default-model"


def tiny_config(**overrides) -> MoEEConfig:
    kwargs = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        intermediate_size=32,
        pad_token_id=1,
        eos_token_id=0,
    )
    kwargs.update(overrides)
    return MoEEConfig(**kwargs)


@pytest.fixture(scope="module")
def tiny_model() -> MoEEForCausalLM:
    torch.manual_seed(0)
    model = MoEEForCausalLM(tiny_config())
    # give the zero-initialised routers some signal so routing is not all ties
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoEERouter):
                m.gate.w_gate.weight.normal_(std=0.5)
    return model.eval()


def test_structure_matches_transformers_moe_conventions(tiny_model):
    layers = tiny_model.model.layers
    assert not hasattr(layers[0].mlp, "gate")  # first_k_dense_replace=1: dense FFN
    for layer in layers[1:]:
        assert isinstance(layer.mlp.gate, MoEERouter)
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight  # tied
    recorder = type(tiny_model)._can_record_outputs["router_logits"]
    assert recorder.target_class is MoEERouter and recorder.index == 0
    assert tiny_model.config.model_type == "moee_lm"


def test_output_router_logits_equal_hooked_router_outputs(tiny_model):
    ids = torch.randint(2, 64, (2, 7))
    captured = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: captured.append(out[0]))
        for m in tiny_model.modules()
        if isinstance(m, MoEERouter)
    ]
    try:
        out = tiny_model(input_ids=ids, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(out.router_logits) == 2 == len(captured)
    for logits, hooked in zip(out.router_logits, captured):
        assert logits.shape == (2 * 7, 8)
        torch.testing.assert_close(logits, hooked)
    assert tiny_model(input_ids=ids).router_logits is None
    hidden = tiny_model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == 3 + 1


def _next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits[b, t])[ids[b, t + 1]] over every position, by hand."""
    terms = []
    for bi in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            row = logits[bi, t].double()
            terms.append(torch.logsumexp(row, 0) - row[ids[bi, t + 1]])
    return torch.stack(terms).mean()


def _cv2(v: torch.Tensor) -> torch.Tensor:
    return ((v - v.mean()) ** 2).mean() / v.mean() ** 2


def test_loss_is_lm_plus_aux_and_backprop_reaches_router():
    torch.manual_seed(1)
    model = MoEEForCausalLM(tiny_config(router_w_importance=0.1, router_w_load=0.3)).train()
    ids = torch.randint(2, 64, (3, 9))
    out = model(input_ids=ids, labels=ids)
    assert out.lm_loss.item() == pytest.approx(_next_token_nll(out.logits, ids).item(), rel=1e-5)
    assert len(out.moe_aux) == 2
    # aux = sum over MoE layers of w_importance CV^2(Importance) + w_load CV^2(Load)
    want = sum(0.1 * _cv2(a["importance"]) + 0.3 * _cv2(a["load_estimate"]) for a in out.moe_aux)
    assert out.aux_loss.item() == pytest.approx(float(want), rel=1e-4) and out.aux_loss.item() > 0
    assert out.loss.item() == pytest.approx(out.lm_loss.item() + float(want), rel=1e-5)
    out.loss.backward()
    assert model.model.layers[1].mlp.gate.gate.w_gate.weight.grad.abs().sum() > 0


def test_left_padding_gives_the_same_logits_and_finite_values(tiny_model):
    ids = torch.randint(2, 64, (1, 6))
    plain = tiny_model(input_ids=ids).logits
    padded_ids = torch.cat([torch.full((1, 3), 1), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    padded = tiny_model(input_ids=padded_ids, attention_mask=mask).logits
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:, 3:], plain, rtol=1e-4, atol=1e-5)


def test_save_load_round_trip_with_auto_classes_offline(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "moee_lm"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MoEEForCausalLM)
    ids = torch.randint(2, 64, (2, 5))
    torch.testing.assert_close(loaded(input_ids=ids).logits, tiny_model(input_ids=ids).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.slow
def test_generate_with_cache_matches_full_forward(tiny_model):
    ids = torch.randint(2, 64, (1, 4))
    gen = tiny_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
    # greedy decoding with the KV cache must agree with argmax of full forwards
    seq = ids
    for _ in range(4):
        nxt = tiny_model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(gen, seq)


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        tiny_config(hidden_size=15)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="router_type"):
        tiny_config(router_type="bogus")


def test_capture_registry_finds_every_moe_layer(tiny_model):
    from moee.capture.registry import find_routers

    routers = find_routers(tiny_model)
    assert [r.name for r in routers] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    assert all(r.n_experts == 8 for r in routers)


def test_loss_free_router_variant_trains_its_bias_without_a_loss():
    torch.manual_seed(2)
    model = MoEEForCausalLM(tiny_config(router_type="loss_free", router_bias_gamma=0.25)).train()
    ids = torch.randint(2, 64, (2, 6))
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss.item() == 0.0
    assert out.loss.item() == pytest.approx(_next_token_nll(out.logits, ids).item(), rel=1e-5)
    # one training forward moved every bias by gamma * sign(mean load - load), from 0
    for aux, layer in zip(out.moe_aux, model.model.layers[1:]):
        load = aux["load"]
        assert load.sum().item() == 2 * 6 * 2  # tokens x k selections
        torch.testing.assert_close(layer.mlp.gate.gate.bias, 0.25 * torch.sign(load.mean() - load))


def test_capture_scores_each_router_variant_with_its_own_rule(tiny_model):
    """Capture reads the rule from the router, so a loss-free (sigmoid + bias) model's native
    scores are sigmoids of the logits while the default noisy top-k model's are a softmax."""
    from moee.capture.registry import apply_score, find_routers

    sigmoid_model = MoEEForCausalLM(tiny_config(router_type="loss_free")).eval()
    assert {r.rule for r in find_routers(tiny_model)} == {"softmax"}
    routers = find_routers(sigmoid_model)
    assert {r.rule for r in routers} == {"sigmoid_bias"}
    logits = torch.randn(3, 8)
    native = apply_score(logits, "native", routers[0].rule, routers[0].router)
    torch.testing.assert_close(native, torch.sigmoid(logits))


def test_noise_free_router_is_randomly_initialised():
    """router_noisy=False has no noise to break the ties of a zero-initialised router."""
    torch.manual_seed(3)
    model = MoEEForCausalLM(tiny_config(router_noisy=False)).train()
    router = model.model.layers[1].mlp.gate
    assert router.gate.w_noise is None
    weight = router.gate.w_gate.weight
    assert torch.count_nonzero(weight) == weight.numel()
    assert weight.std().item() == pytest.approx(model.config.initializer_range, rel=0.2)
    out = model(input_ids=torch.randint(2, 64, (4, 16)), labels=torch.randint(2, 64, (4, 16)))
    load = out.moe_aux[0]["load"]
    assert torch.count_nonzero(load) >= 6  # tokens spread over the experts at step 0
    noisy = MoEEForCausalLM(tiny_config())
    assert torch.count_nonzero(noisy.model.layers[1].mlp.gate.gate.w_gate.weight) == 0
