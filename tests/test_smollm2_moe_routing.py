"""The shipped SmolLM2 MoE's routing matters: with its trained routers, top-2 of 16 experts per
layer is a real choice, disabling each layer's most used expert changes the logits and costs loss,
and routing every layer by its own router with the experts permuted costs more. Measured on held-out
text the model never trained on (the bundled model's held-out documents)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moee.models.bundled import BUNDLED, resolve_model

HELDOUT = BUNDLED["minilm-moe"].config_dir / "heldout.jsonl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_batch():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(resolve_model("smollm2-moe"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines()]
    rows = [ids[:64] for ids in tokenizer(texts)["input_ids"] if len(ids) >= 64][:8]
    batch = torch.tensor(rows)  # the first 64 tokens of 8 different documents
    assert batch.shape == (8, 64)
    return model, batch


def _loss_and_logits(model, batch) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=batch, labels=batch)
    return float(out.loss), out.logits


def _selections(model, batch) -> list[torch.Tensor]:
    """Every MoE layer's selected experts ``[tokens, top_k]`` on ``batch``."""
    chosen = []
    hooks = [  # a router returns (logits, weights, selected experts, the gate's output)
        ffn.router.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
        for ffn in model.moe_ffns()
    ]
    try:
        _loss_and_logits(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return chosen


def test_top_k_is_a_real_choice_of_the_trained_routers(model_and_batch):
    model, batch = model_and_batch
    assert model.config.num_experts_per_tok == 2 and model.config.num_experts == 16
    chosen = _selections(model, batch)
    assert len(chosen) == 30
    for layer, selected in enumerate(chosen):
        assert selected.shape == (batch.numel(), 2), (layer, selected.shape)  # two experts per token
        used = torch.bincount(selected.reshape(-1), minlength=16)
        assert used.gt(0).sum() >= 14, (layer, used.tolist())  # (measured: all 16 in every layer)
        pairs = {tuple(sorted(p)) for p in selected.tolist()}
        assert len(pairs) >= 32, (layer, len(pairs))  # tokens choose different pairs (measured: >= 83)


def test_disabling_an_expert_or_permuting_the_routers_costs_loss(model_and_batch):
    from moee.capture.interventions import disable_experts, permute_router

    model, batch = model_and_batch
    base, logits = _loss_and_logits(model, batch)
    top = [int(torch.bincount(s.reshape(-1), minlength=16).argmax()) for s in _selections(model, batch)]
    with disable_experts(model, list(enumerate(top))):
        disabled, disabled_logits = _loss_and_logits(model, batch)
    with disable_experts(model, list(enumerate(top)), mode="zero"):
        _, zeroed_logits = _loss_and_logits(model, batch)
    with permute_router(model, seed=0):
        permuted, _ = _loss_and_logits(model, batch)
    assert not torch.allclose(logits, disabled_logits, atol=1e-3)
    assert not torch.allclose(logits, zeroed_logits, atol=1e-3)  # the adapters' dispatch is edited too
    # The experts are rank-8 adapters of one shared FFN, so losing the busiest one (its tokens go to
    # their next choice) costs little, but far above float32's noise on this loss (measured at the
    # shipped step 250: 3.4027 -> 3.4161 disabled, 3.4155 zeroed, 3.6488 with permuted routers).
    assert disabled > base + 5e-3, (base, disabled, permuted)
    assert permuted > base + 0.1, (base, disabled, permuted)
