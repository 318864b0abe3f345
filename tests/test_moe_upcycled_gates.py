"""One gate registry for the from-scratch LM and upcycled models.

Every gate of ``moee.moe.gate_registry.GATES`` builds, runs forward and backward, and round-trips
through the Auto classes in an upcycled model and in ``moee_lm``, under the same names and config
keys; ``moee upcycle --router`` offers exactly the registry; old upcycled ``router_type`` names
load as before; upcycled models return ``router_logits`` like transformers' MoE models.
"""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch
from test_moe_upcycle import IDS, VOCAB, dense_model, outputs
from transformers import AutoConfig, AutoModelForCausalLM

from moee.capture.tiny import tiny_tokenizer
from moee.moe.gate_registry import ALIASES, GATES, CausalLeakWarning, RouterFields
from moee.moe.layer import MoEERouter
from moee.moe.lm import MoEEConfig, MoEEForCausalLM
from moee.moe.upcycle import save_upcycled, upcycle
from moee.moe.upcycled import MoEEUpcycledConfig, MoEEUpcycledForCausalLM

N_EXPERTS = 4

# per gate: top-k and the router_* fields that make a 4-expert model valid for it (the same for both models)
GATE_SETTINGS: dict[str, tuple[int, dict]] = {
    "noisy_top_k": (2, {"router_noisy": True}),
    "loss_free": (2, {}),
    "hierarchical": (2, {"router_n_groups": 2, "router_k_primary": 1}),
    "strictly_balanced": (2, {}),
    "switch": (1, {}),
    "expert_choice": (2, {}),
    "softmax": (N_EXPERTS, {}),
}


def test_settings_cover_the_registry_and_both_configs_read_the_same_fields():
    assert set(GATE_SETTINGS) == set(GATES) and len(GATES) == 7
    fields = set(RouterFields.__dataclass_fields__)
    for spec in GATES.values():
        assert set(spec.config_keys) <= fields, spec.name
    for config in (MoEEConfig, MoEEUpcycledConfig):
        assert fields <= set(config.__dataclass_fields__), config.__name__


def _upcycled(name: str, balance_router: bool = True, **extra) -> MoEEUpcycledForCausalLM:
    top_k, options = GATE_SETTINGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CausalLeakWarning)
        return upcycle(
            dense_model("llama"),
            n_experts=N_EXPERTS,
            top_k=top_k,
            mode="split",
            router_type=name,
            router_options={**options, **extra},
            balance_router=balance_router,
        )


def _lm(name: str) -> MoEEForCausalLM:
    top_k, options = GATE_SETTINGS[name]
    config = MoEEConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=N_EXPERTS,
        num_experts_per_tok=top_k,
        moe_intermediate_size=8,
        router_type=name,
        **options,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CausalLeakWarning)
        return MoEEForCausalLM(config)


def _gate_classes(model) -> set[str]:
    return {type(m.gate).__name__ for m in model.modules() if isinstance(m, MoEERouter)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GATES))
@pytest.mark.parametrize("build", [_upcycled, _lm], ids=["upcycled", "moee_lm"])
def test_every_gate_trains_in_both_models_under_one_name(build, name):
    model = build(name).train()
    assert model.config.router_type == name
    assert len(_gate_classes(model)) == 1
    out = model(input_ids=IDS, attention_mask=torch.ones_like(IDS), labels=IDS)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    router_grads = [
        p.grad
        for n, p in model.named_parameters()
        if ".gate." in n and p.requires_grad and p.grad is not None
    ]
    assert router_grads and any(float(g.abs().sum()) > 0 for g in router_grads), name
    assert len(out.moe_aux) == 2


@pytest.mark.slow
def test_each_name_builds_the_same_gate_class_in_both_models():
    for name in GATES:
        assert _gate_classes(_upcycled(name)) == _gate_classes(_lm(name)), name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GATES))
def test_every_gate_round_trips_in_an_upcycled_model(name, tmp_path):
    model = _upcycled(name).eval()
    save_upcycled(model, tmp_path / "moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CausalLeakWarning)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert loaded.config.router_type == name
    assert torch.equal(outputs(loaded, IDS), outputs(model, IDS))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moee_lm", "moee_upcycled"])
def test_a_loaded_loss_free_gate_starts_with_no_pending_load(kind, tmp_path, monkeypatch):
    """The pending load is not saved: the loader's placeholder for it must be zeroed, else the
    first training step moves the selection bias by whatever memory the placeholder held (two
    loads of one model then train differently)."""
    from moee.moe.gates import LossFreeBalancedGate

    if kind == "moee_lm":
        _lm("loss_free").save_pretrained(tmp_path)
    else:
        save_upcycled(_upcycled("loss_free"), tmp_path)
    real = torch.empty_like

    def garbage(t, *args, **kwargs):  # the loader's placeholders, holding uneven memory for certain
        out = real(t, *args, **kwargs)
        return out.copy_(torch.linspace(1e6, -1e6, out.numel()).reshape(out.shape).to(out.dtype))

    monkeypatch.setattr(torch, "empty_like", garbage)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    monkeypatch.undo()
    gates = [m for m in loaded.modules() if isinstance(m, LossFreeBalancedGate)]
    assert len(gates) == 2 and all(torch.equal(g.pending_load, torch.zeros(N_EXPERTS)) for g in gates)


def test_upcycled_router_starts_where_upcycle_puts_it():
    # split + centroid init: the hierarchical gate's groups take their experts' centroids
    flat = _upcycled("loss_free", balance_router=False)
    hier = _upcycled("hierarchical", balance_router=False)
    for a, b in zip(flat.moe_ffns(), hier.moe_ffns(), strict=True):
        rows = a.router.gate.w_gate.weight  # [E, d], the centroids
        gate = b.router.gate
        assert torch.equal(gate.w_gate_secondary, rows.reshape(2, 2, -1).transpose(1, 2))
        assert torch.allclose(gate.w_gate.weight, rows.reshape(2, 2, -1).mean(1))
    switch = _upcycled("switch", balance_router=False)
    for a, b in zip(flat.moe_ffns(), switch.moe_ffns(), strict=True):
        assert torch.equal(b.router.gate.weight, a.router.gate.w_gate.weight.t())


@pytest.mark.slow
def test_expert_choice_in_a_causal_upcycled_model_warns_of_the_leak():
    with pytest.warns(CausalLeakWarning, match="expert_choice"):
        upcycle(dense_model("llama"), n_experts=N_EXPERTS, top_k=2, router_type="expert_choice")


@pytest.mark.slow
def test_cli_router_choices_are_the_registry(tmp_path, capsys):
    from moee.cli import build_parser
    from moee.commands.upcycle import router_options

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["upcycle"]
    router = next(a for a in sub._actions if a.dest == "router")
    assert tuple(router.choices) == tuple(GATES) and router.default == "loss_free"
    assert router_options(
        ["router_n_groups=2", "router_score_func=sigmoid", "router_capacity_factor=null"]
    ) == {
        "router_n_groups": 2,
        "router_score_func": "sigmoid",
        "router_capacity_factor": None,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        router_options(["router_n_groups"])

    from moee.cli import main

    dense = dense_model("llama")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    argv = [
        "upcycle",
        str(tmp_path / "dense"),
        "--out",
        str(tmp_path / "moe"),
        "--experts",
        "4",
        "--top-k",
        "2",
    ]
    assert (
        main(
            argv
            + [
                "--router",
                "hierarchical",
                "--router-option",
                "router_n_groups=2",
                "--router-option",
                "router_k_primary=1",
            ]
        )
        == 0
    )
    config = AutoConfig.from_pretrained(tmp_path / "moe")
    assert (config.router_type, config.router_n_groups, config.router_k_primary) == ("hierarchical", 2, 1)
    assert main(argv + ["--overwrite", "--router", "hierarchical"]) == 2
    assert "router_n_groups" in capsys.readouterr().err  # the registry's check names the missing field
    assert main(argv + ["--overwrite", "--router-option", "router_bogus=1"]) == 2
    assert "unknown router option(s) router_bogus" in capsys.readouterr().err


@pytest.mark.slow
def test_an_old_router_type_name_loads_and_computes_as_before(tmp_path):
    model = _upcycled("noisy_top_k", router_noisy=False, router_w_importance=0.0, router_w_load=0.0).eval()
    save_upcycled(model, tmp_path / "moe")
    path = tmp_path / "moe" / "config.json"
    saved = json.loads(path.read_text())
    for key in ("router_noisy", "router_w_importance", "router_w_load", "router_score_func"):
        saved.pop(key)
    saved["router_type"] = "top_k"  # as upcycled models were saved before one registry served both
    path.write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert "top_k" in ALIASES
    assert (loaded.config.router_type, loaded.config.router_noisy, loaded.config.router_w_load) == (
        "noisy_top_k",
        False,
        0.0,
    )
    assert torch.equal(outputs(loaded, IDS), outputs(model, IDS))
    assert MoEEConfig(router_type="top_k", num_experts=4, num_experts_per_tok=2).router_type == "noisy_top_k"
    with pytest.raises(ValueError, match="router_type must be one of"):
        MoEEUpcycledConfig(text_config=dense_model("llama").config, router_type="nope")


# ------------------------------------------------------------------ output_router_logits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_upcycled_models_return_router_logits_like_transformers_moe_models(family):
    dense = dense_model(family)
    model = upcycle(dense, n_experts=N_EXPERTS, top_k=2, mode="copy").eval()
    routers = [f.router for f in model.moe_ffns()]
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[0])) for r in routers]
    try:
        with torch.no_grad():
            out = model(input_ids=IDS, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == len(routers) == 2
    for logits, hooked in zip(out.router_logits, seen, strict=True):
        assert logits.shape == (IDS.numel(), N_EXPERTS)
        assert torch.equal(logits, hooked)
    with torch.no_grad():
        assert model(input_ids=IDS).router_logits is None  # off unless asked, as in transformers
        model.config.output_router_logits = True
        assert len(model(input_ids=IDS).router_logits) == 2


@pytest.mark.slow
def test_an_upcycled_encoder_returns_router_logits_too():
    model = upcycle(dense_model("bert"), n_experts=N_EXPERTS, top_k=2, mode="copy").eval()
    assert type(model).__name__ == "MoEEUpcycledModel"
    with torch.no_grad():
        out = model(input_ids=IDS, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (IDS.numel(), N_EXPERTS)
    assert "router_logits" not in model(input_ids=IDS)
