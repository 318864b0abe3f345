"""Gate registry: every gate is selectable by `MoEEConfig.router_type`, trains with `moee train`,
saves and reloads through the Auto classes; the import graph has no loop; the existing router
paths (the bundled loss-free model above all) compute exactly what they computed before."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_moe_lm import tiny_config
from test_moe_trainer import corpus, tiny_cfg  # noqa: F401  (corpus is a fixture)
from transformers import AutoModelForCausalLM

from moee.moe.gate_registry import GATES, CausalLeakWarning, GateSpec, gate_spec
from moee.moe.gates import BatchwiseBalancedGate
from moee.moe.lm import MoEEConfig, MoEEForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent

# per gate: the model keys that make the tiny trainer config (4 experts, k = 2) valid for it
GATE_MODEL_KEYS: dict[str, dict] = {
    "noisy_top_k": {},
    "loss_free": {"router_type": "loss_free"},
    "hierarchical": {"router_type": "hierarchical", "router_n_groups": 2, "router_k_primary": 1},
    "strictly_balanced": {"router_type": "strictly_balanced"},
    "switch": {"router_type": "switch", "num_experts_per_tok": 1},
    "expert_choice": {"router_type": "expert_choice"},
    "softmax": {"router_type": "softmax", "num_experts_per_tok": 4},
}


def test_every_gate_is_registered_with_documented_config_keys():
    assert set(GATES) == set(GATE_MODEL_KEYS) and len(GATES) == 7
    readme = (ROOT / "moee" / "moe" / "README_TRAINING.md").read_text()
    for name, spec in GATES.items():
        assert isinstance(spec, GateSpec) and spec.name == name and spec.summary
        assert f"`{name}`" in readme, f"README_TRAINING.md does not list router_type {name!r}"
        for key, meaning in spec.config_keys.items():
            assert hasattr(MoEEConfig, key) and meaning, key
            assert f"`{key}`" in readme, f"README_TRAINING.md does not document {key}"
    assert "future" in GATES["expert_choice"].summary.lower()
    assert "future" in (GATES["expert_choice"].future_tokens or "")
    assert [n for n, s in GATES.items() if s.future_tokens] == ["expert_choice"]


# ----------------------------------------------------------------------------- import graph


def _moee_imports(path: Path) -> set[str]:
    """Every `moee.*` module `path` imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("moee"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moee"):
            found.add(node.module)
    return found


def test_moe_modules_import_each_other_without_a_loop():
    package = ROOT / "moee" / "moe"
    graph = {
        f"moee.moe.{p.stem}": {m for m in _moee_imports(p) if m.startswith("moee.moe.")}
        for p in package.glob("*.py")
        if p.stem != "__init__"
    }

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return [*path, nxt]
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))
        return None

    loops = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not loops, f"import loops: {loops}"
    assert "moee.moe.switch" not in graph["moee.moe.gates"]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["moee.moe.gates", "moee.moe.switch", "moee.moe.gate_registry"])
def test_each_gate_module_imports_alone(module):
    code = f"import {module}, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------- unchanged paths


@pytest.mark.parametrize(
    ("overrides", "params_sum", "loss", "aux_loss"),
    [
        ({}, 110.56824942347566, 4.181289196014404, 0.05004477873444557),
        ({"router_noisy": False}, 110.85239279870848, 4.232100486755371, 0.10246396064758301),
        ({"router_type": "loss_free"}, 110.85239279870848, 4.12963342666626, 0.0),
        (
            {"router_type": "loss_free", "router_score_func": "softmax"},
            110.85239279870848,
            4.129636764526367,
            0.0,
        ),
    ],
)
def test_existing_router_types_initialise_and_compute_as_before(overrides, params_sum, loss, aux_loss):
    """Same seed -> the same weights (init order and RNG draws unchanged) and the same training loss."""
    torch.manual_seed(0)
    model = MoEEForCausalLM(tiny_config(**overrides)).train()
    assert sum(v.double().sum().item() for v in model.state_dict().values()) == pytest.approx(
        params_sum, rel=1e-9
    )
    torch.manual_seed(5)
    ids = torch.randint(2, 64, (2, 9))
    out = model(input_ids=ids, labels=ids)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    assert out.aux_loss.item() == pytest.approx(aux_loss, rel=1e-4, abs=1e-9)


def _train_losses(log: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (
            {},
            [
                2.8461496829986572,
                2.831474781036377,
                2.7883100509643555,
                2.7823703289031982,
                2.749124526977539,
                2.77111554145813,
            ],
        ),
        (
            {"router_type": "loss_free", "router_noisy": False},
            [
                2.8456780910491943,
                2.817312479019165,
                2.7848610877990723,
                2.768141269683838,
                2.7460217475891113,
                2.7675161361694336,
            ],
        ),
    ],
)
def test_existing_configs_train_to_the_same_loss_curve(corpus, tmp_path, overrides, want):  # noqa: F811
    from moee.moe.trainer import train

    cfg = tiny_cfg(corpus, tmp_path)
    cfg["model"].update(overrides)
    train(cfg, progress=False)
    assert _train_losses(tmp_path / "log.jsonl") == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("path", ["configs/default_model.json", "analysis/ablation/base_config.json"])
def test_committed_configs_still_build_their_model(path):
    from moee.moe.trainer import load_config

    model_keys = load_config(ROOT / path)["model"]
    config = MoEEConfig(vocab_size=64, **{k: v for k, v in model_keys.items() if k != "vocab_size"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", CausalLeakWarning)
        MoEEForCausalLM(config)


# ----------------------------------------------------------------------------- every gate trains


@pytest.mark.parametrize("router", sorted(GATE_MODEL_KEYS))
def test_moee_train_trains_every_gate_and_the_checkpoint_reloads(corpus, tmp_path, router, capsys):  # noqa: F811
    """`moee train` with each router_type: a few steps, then the checkpoint loads through
    AutoModelForCausalLM (offline, safetensors) and gives the trained model's held-out loss and
    the logits of a strict state-dict load."""
    from moee.cli import main
    from moee.moe.checkpoint import latest_checkpoint
    from moee.moe.trainer import eval_windows, evaluate, load_tokens, tokenize_to_file

    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["model"].update(GATE_MODEL_KEYS[router])
    cfg["schedule"]["max_steps"] = 4
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    assert main(["train", "--config", str(cfg_path), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("future-token leak" in err) == (router == "expert_choice")
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step_00000004"
    losses = _train_losses(tmp_path / "run" / "log.jsonl")
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CausalLeakWarning)
        loaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        direct = MoEEForCausalLM(MoEEConfig.from_pretrained(ckpt))
    assert isinstance(loaded, MoEEForCausalLM) and loaded.config.router_type == router
    result = direct.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # tied head
    direct.eval()
    ids = torch.randint(2, loaded.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, direct(input_ids=ids).logits, rtol=0, atol=0)

    # the reloaded model reproduces the held-out loss the trainer measured on the in-memory model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg["data"]["tokenizer"])
    heldout = eval_windows(
        load_tokens(tokenize_to_file(cfg["data"]["heldout"], tok, cfg["data"]["cache_dir"])), 16, 4
    )
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    final_eval = next(r for r in reversed(logged) if r["kind"] == "eval")
    assert final_eval["step"] == 4
    assert evaluate(loaded, heldout, 4)["loss"] == pytest.approx(final_eval["loss"], rel=1e-6)


# ----------------------------------------------------------------------------- gate-specific behaviour


def test_expert_choice_in_a_causal_lm_warns_about_the_future_token_leak():
    with pytest.warns(CausalLeakWarning, match="future-token leak"):
        MoEEForCausalLM(tiny_config(router_type="expert_choice"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CausalLeakWarning)
        for name, keys in GATE_MODEL_KEYS.items():
            if name != "expert_choice":
                MoEEForCausalLM(tiny_config(**{**keys, **_tiny_k(keys)}))


def _tiny_k(keys: dict) -> dict:
    """The k the tiny LM config (8 experts) needs for a gate whose keys fix k for 4 experts."""
    return {"num_experts_per_tok": 8} if keys.get("router_type") == "softmax" else {}


def test_expert_choice_output_depends_on_later_tokens():
    """The leak the warning names: changing only the last token changes an earlier position's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CausalLeakWarning)
        torch.manual_seed(0)
        leaky = MoEEForCausalLM(tiny_config(router_type="expert_choice")).eval()
    torch.manual_seed(0)
    causal = MoEEForCausalLM(tiny_config(router_type="strictly_balanced")).eval()
    ids = torch.randint(2, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = False
    for last in range(2, 64):
        other = ids.clone()
        other[0, -1] = last
        with torch.no_grad():
            a, b = leaky(input_ids=ids).logits[0, :-1], leaky(input_ids=other).logits[0, :-1]
            torch.testing.assert_close(
                causal(input_ids=ids).logits[0, :-1], causal(input_ids=other).logits[0, :-1]
            )
        changed |= not torch.equal(a, b)
    assert changed


def _strict_gates(model: MoEEForCausalLM) -> list[BatchwiseBalancedGate]:
    return [m for m in model.modules() if isinstance(m, BatchwiseBalancedGate)]


def test_strictly_balanced_lm_uses_its_learned_thresholds_in_eval_mode():
    """Appendix F: M_batchwise in training, M_threshold(x, T) at inference, so an eval-mode
    sequence is routed the same alone and inside any batch, and the thresholds decide it."""
    torch.manual_seed(4)
    model = MoEEForCausalLM(tiny_config(router_type="strictly_balanced"))
    gates = _strict_gates(model)
    assert len(gates) == 2
    for gate in gates:  # initialised to 1/n by the LM's weight init, not overwritten by it
        torch.testing.assert_close(gate.thresholds.detach(), torch.full((8,), 1 / 8))
    g = torch.Generator().manual_seed(2)
    one = torch.randint(2, 64, (1, 10), generator=g)
    batch = torch.cat([one, torch.randint(2, 64, (5, 10), generator=g)])

    model.train()
    train_alone, train_batch = model(input_ids=one).logits[0], model(input_ids=batch).logits[0]
    assert not torch.allclose(train_alone, train_batch)  # the batchwise mask depends on the batch

    model.eval()
    seen: list = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out)) for m in gates]
    try:
        with torch.no_grad():
            eval_alone, eval_batch = model(input_ids=one).logits[0], model(input_ids=batch).logits[0]
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(eval_alone, eval_batch)
    for out, gate in zip(seen, gates * 2):
        scores = torch.softmax(out.logits, -1)
        assert torch.equal(out.probs > 0, scores > gate.thresholds)  # M_threshold(x, T) exactly

    with torch.no_grad():  # the thresholds are what decides: T = 1 admits nothing, T = 0 everything
        for gate in gates:
            gate.thresholds.fill_(1.0)
        nothing = model(input_ids=one)
        assert all(a["load"].sum() == 0 for a in nothing.moe_aux)
        for gate in gates:
            gate.thresholds.fill_(0.0)
        everything = model(input_ids=one)
        assert all(a["load"].sum() == 10 * 8 for a in everything.moe_aux)


def test_strictly_balanced_thresholds_are_trained_by_the_lm_loss():
    torch.manual_seed(5)
    model = MoEEForCausalLM(tiny_config(router_type="strictly_balanced")).train()
    ids = torch.randint(2, 64, (4, 12))
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss.item() != 0.0
    out.loss.backward()
    for gate in _strict_gates(model):
        assert gate.thresholds.grad is not None and gate.thresholds.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router_type": "hierarchical"}, "router_n_groups"),
        ({"router_type": "hierarchical", "router_n_groups": 3}, "router_n_groups"),
        ({"router_type": "hierarchical", "router_n_groups": 2, "router_k_primary": 3}, "router_k_primary"),
        (
            {"router_type": "hierarchical", "router_n_groups": 4, "num_experts_per_tok": 3},
            "num_experts_per_tok=3",
        ),
        ({"router_type": "switch"}, "num_experts_per_tok must be 1"),
        (
            {"router_type": "switch", "num_experts_per_tok": 1, "router_capacity_factor": 0},
            "router_capacity_factor",
        ),
        ({"router_type": "expert_choice", "router_min_capacity": -1}, "router_min_capacity"),
        ({"router_type": "softmax"}, "num_experts_per_tok must equal num_experts"),
        ({"router_type": "strictly_balanced", "router_w_threshold": -1.0}, "router_w_threshold"),
        ({"router_type": "loss_free", "router_score_func": "tanh"}, "router_score_func"),
        ({"router_type": "bogus"}, "router_type must be one of"),
    ],
)
def test_bad_gate_config_is_an_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_gate_settings_reach_the_gates():
    hier = MoEEForCausalLM(tiny_config(router_type="hierarchical", router_n_groups=4, router_k_primary=2))
    gate = hier.model.layers[1].mlp.gate.gate
    assert (gate.n_groups, gate.experts_per_group, gate.k_primary, gate.k_secondary) == (4, 2, 2, 1)
    switch = MoEEForCausalLM(
        tiny_config(router_type="switch", num_experts_per_tok=1, router_switch_alpha=0.5)
    )
    router = switch.model.layers[1].mlp.gate.gate
    assert (router.capacity_factor, router.alpha, router.minimum_capacity) == (1.25, 0.5, 1)
    with pytest.warns(CausalLeakWarning):
        ec = MoEEForCausalLM(tiny_config(router_type="expert_choice", router_min_capacity=3))
    assert ec.model.layers[1].mlp.gate.gate.capacity_factor == 2.0  # num_experts_per_tok
    assert ec.model.layers[1].mlp.gate.gate.minimum_capacity == 3
    assert gate_spec("softmax").parameter_init("weight", tiny_config()) == ("zeros", 0.0)
