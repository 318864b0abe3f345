"""The bundled model gives bit-identical outputs across changes to how its gates are built.

``tests/fixtures/bundled_model_outputs.safetensors`` was written by :func:`bundled_outputs` from the
code before upcycled models took their gates from ``moee.moe.gate_registry`` (their config's old
``router_type`` names are migrated on load): embeddings, pooled routing scores, a slice of the LM
logits and every router's logits, computed on one CPU thread (the summation order, hence the last
bit, depends on the thread count). The comparison is exact on the torch build and processor the
fixture records (kernel family, model and feature flags), and within 1e-5 elsewhere (other
processors round differently in the last bit, about 1e-7 on the embeddings). Regenerate it only
when the bundled model itself changes:
``python -c "import tests.test_bundled_model_outputs as t; t.write_fixture()"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "bundled_model_outputs.safetensors"
TEXTS = [
    "A cat sat on the mat.",
    "Stock markets fell sharply on Monday after the report.",
    "Quantum entanglement links two particles.",
]


def build() -> dict[str, str]:
    """The torch build and processor outputs are bit-reproducible on.

    The kernel family alone (``AVX512``) is not enough: two processors of one family (with different
    AVX-512 extensions) round differently in the last bit, so the processor's model and feature flags
    are recorded too.
    """
    from moee.provenance import cpu_flags_digest, cpu_model

    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "cpu_flags_sha256": cpu_flags_digest(),
    }


def bundled_outputs(emb) -> dict[str, torch.Tensor]:
    """What the fixture holds, computed with ``emb`` (the bundled model on the CPU, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _outputs(emb)
    finally:
        torch.set_num_threads(threads)


def _outputs(emb) -> dict[str, torch.Tensor]:
    out = {}
    for method in ("hs", "rw", "moee_sum"):
        vectors = emb.encode(TEXTS, method=method, pooling="mean", prompt=None, score="native", alpha=1.0)
        out[f"encode_{method}"] = torch.from_numpy(vectors)
    out["trace_rw_mean"] = torch.from_numpy(emb.trace(TEXTS, pooling="mean").rw)
    batch = emb.tokenizer(TEXTS[1], return_tensors="pt")
    logs: list[torch.Tensor] = []
    hooks = [
        f.router.register_forward_hook(lambda mod, args, o: logs.append(o[0].detach().clone()))
        for f in emb.model.moe_ffns()
    ]
    try:
        with torch.no_grad():
            result = emb.model(**batch)
    finally:
        for h in hooks:
            h.remove()
    out["logits_text1_every16"] = result.logits[0, :, ::16].float().contiguous()
    out["router_logits_text1"] = torch.stack(logs).float().contiguous()
    out["input_ids_text1"] = batch["input_ids"][0].contiguous()
    return out


def _embedder():
    import moee

    return moee.MoEEmbedder.from_pretrained("minilm-moe", device="cpu")  # the fixture is this model's


def write_fixture() -> None:
    from safetensors.torch import save_file

    FIXTURE.parent.mkdir(exist_ok=True)
    save_file(bundled_outputs(_embedder()), str(FIXTURE), metadata={"texts": "\n".join(TEXTS), **build()})


@pytest.fixture(scope="module")
def bundled():
    return _embedder()


def _fixture() -> tuple[dict[str, torch.Tensor], bool]:
    """The fixture's tensors, and whether this torch build and CPU should reproduce them bit for bit."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(FIXTURE), "pt") as f:
        meta = f.metadata()
    same = {k: meta.get(k) for k in build()} == build()
    return load_file(str(FIXTURE)), same


def _check(got: torch.Tensor, expected: torch.Tensor, exact: bool, name: str) -> None:
    if exact:
        assert torch.equal(got, expected), name
    else:
        assert got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=1e-5), name


def test_bundled_model_outputs_are_bit_identical(bundled):
    expected, exact = _fixture()
    got = bundled_outputs(bundled)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        _check(got[name], value, exact, name)


def test_bundled_config_keeps_its_saved_router_type_loading(bundled):
    # the saved config.json says router_type "loss_free" with softmax scores (no router_score_func key)
    gate = bundled.model.moe_ffns()[0].router.gate
    assert type(gate).__name__ == "LossFreeBalancedGate"
    assert gate.score_func == "softmax"


def test_bundled_model_returns_its_router_logits(bundled):
    fixture, exact = _fixture()
    expected = fixture["router_logits_text1"]  # [layers, tokens, experts], recorded by hooks
    batch = bundled.tokenizer(TEXTS[1], return_tensors="pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = bundled.model(**batch, output_router_logits=True)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == bundled.n_moe_layers
    assert all(r.shape == (batch["input_ids"].numel(), bundled.n_experts) for r in out.router_logits)
    _check(torch.stack(out.router_logits).float(), expected, exact, "router_logits")
