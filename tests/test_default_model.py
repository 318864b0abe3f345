"""The bundled default model (moee/assets/default-model): what its card promises, checked offline."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moee.embed.embedder import DEFAULT_MODEL_DIR as DEFAULT_MODEL

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL / "model.safetensors").exists(), reason="bundled model not exported"
)


@pytest.fixture(scope="module")
def bundled():
    import moee.moe.upcycled  # noqa: F401  (registers moee_upcycled)

    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL).eval(), AutoTokenizer.from_pretrained(
        DEFAULT_MODEL
    )


def test_bundled_model_is_a_causal_moe_lm_of_the_promised_size(bundled):
    model, tok = bundled
    cfg = model.config
    assert cfg.model_type == "moee_upcycled" and cfg.text_config.is_decoder
    ffns = model.moe_ffns()
    assert len(ffns) >= 8 and cfg.num_experts >= 32
    assert sum(f.stat().st_size for f in DEFAULT_MODEL.glob("*.safetensors")) <= 50e6
    assert model.dtype == torch.float32  # stored float16, declared float32: computes in float32
    # causal: a later token never changes an earlier position
    ids = tok(["The king spoke to the river."], return_tensors="pt").input_ids
    assert tok.convert_ids_to_tokens(ids[0])[0] == tok.bos_token and ids[0, -1] != tok.eos_token_id
    changed = ids.clone()
    changed[0, -1] = tok.convert_tokens_to_ids("the")
    with torch.no_grad():
        a = model.base_model(input_ids=ids).last_hidden_state
        b = model.base_model(input_ids=changed).last_hidden_state
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-5) and not torch.allclose(a[:, -1], b[:, -1])


def test_capture_finds_every_moe_layer_of_the_bundled_model(bundled):
    from moee.capture.registry import find_routers

    model, _ = bundled
    routers = find_routers(model)
    assert len(routers) == len(model.moe_ffns())
    assert all(r.n_experts == model.config.num_experts and r.logits_index == 0 for r in routers)


def test_bundled_model_ships_its_heldout_sample_and_card_figures():
    rows = [json.loads(line) for line in (DEFAULT_MODEL / "heldout.jsonl").read_text().splitlines()]
    assert rows and all(isinstance(r["text"], str) and r["text"] for r in rows)
    assert (DEFAULT_MODEL / "heldout.jsonl").stat().st_size <= 1_000_000
    metrics = json.loads((DEFAULT_MODEL / "metrics.json").read_text())
    held = metrics["heldout"]
    assert held["loss"] < held["unigram_loss"]  # it predicts text better than a unigram
    assert held["max_over_mean_load_worst"] <= 1.5
    assert all(layer["max_over_mean_load"] <= 1.5 for layer in held["layers"])
