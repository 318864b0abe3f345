"""The ``lora`` upcycling mode (a mixture of low-rank experts on the shared dense FFN) on tiny Llama
models: it starts as the dense model, computes ``W_down h + sum_j w_j B_j A_j h`` with the
renormalised top-k weights, its routing matters once the adapters are trained (disabling an expert
or permuting a router changes the logits and costs loss), it saves and loads, and the trainer's
``optim.trainable = "routed"`` trains only routers and adapters."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_moe_upcycle import IDS, dense_model

import moee.moe.upcycle as up
from moee.moe.delta import routed_parameter_ids
from moee.moe.layer import dispatch_combine
from moee.moe.trainer import TRAINABLE, load_config
from moee.moe.upcycled import (
    DenseFFN,
    LoRAExperts,
    MoEEUpcycledConfig,
    MoEEUpcycledForCausalLM,
    UpcycledMoEFFN,
)


def lora(n_experts=4, top_k=2, rank=3, balance=False, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        return up.upcycle(
            dense_model("llama"),
            n_experts=n_experts,
            top_k=top_k,
            mode="lora",
            lora_rank=rank,
            balance_router=balance,
            **kwargs,
        )


def train_adapters(model, seed=0, scale=0.5):
    """Give every adapter a non-zero B (as training does), seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ffn in model.moe_ffns():
            b = ffn.experts.lora_b
            b.copy_(torch.randn(b.shape, generator=gen) * scale)


def logits(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_an_untrained_lora_model_computes_the_dense_model_exactly():
    dense = dense_model("llama")
    want = logits(dense)
    model = lora()
    assert isinstance(model, MoEEUpcycledForCausalLM)
    assert model.config.upcycle_mode == "lora" and model.config.expert_lora_rank == 3
    # B = 0: every adapter adds exactly zero; what is left is float rounding of the fused gate/up
    assert (logits(model) - want).abs().max() < 1e-5
    train_adapters(model)
    assert (logits(model) - want).abs().max() > 1e-2


def test_the_lora_ffn_is_the_shared_ffn_plus_the_weighted_adapters_of_the_selected_experts():
    model = lora()
    train_adapters(model)
    ffn = model.moe_ffns()[0]
    x = torch.randn(7, ffn.experts.d_model, generator=torch.Generator().manual_seed(1))
    _, weights, indices, _ = ffn.router(x)
    assert torch.allclose(weights.sum(-1), torch.ones(7))  # renormalised over the top-k
    h = ffn.shared.hidden(0, x)
    want = torch.stack(
        [
            sum(
                weights[n, j] * (h[n] @ (ffn.shared.w_out[0] + ffn.experts.lora_a[e] @ ffn.experts.lora_b[e]))
                for j, e in enumerate(indices[n].tolist())
            )
            for n in range(7)
        ]
    )
    assert torch.allclose(ffn(x), want, atol=1e-5)


def test_dispatch_combine_maps_the_adapter_input_width_to_the_model_width():
    experts = LoRAExperts(3, d_hidden=10, d_model=4, rank=2)
    with torch.no_grad():
        experts.lora_a.normal_()
        experts.lora_b.normal_()
    h = torch.randn(5, 10)
    indices = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.full((5, 2), 0.5)
    out = dispatch_combine(h, weights, indices, experts)
    assert out.shape == (5, 4)
    want = torch.stack(
        [sum(0.5 * experts.expert_forward(e, h[n : n + 1])[0] for e in indices[n].tolist()) for n in range(5)]
    )
    assert torch.allclose(out, want, atol=1e-6)


def _lm_loss(model, ids=IDS):
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).lm_loss)


def test_trained_routing_matters_disabling_an_expert_or_permuting_a_router_changes_logits():
    model = lora(n_experts=4, top_k=2)
    train_adapters(model)
    base = logits(model)
    # disable expert 0 of layer 0: its selection bias so low that the top-k never picks it
    ffn = model.moe_ffns()[0]
    picked = ffn.router(torch.randn(64, ffn.experts.d_model))[2]
    assert picked.unique().numel() > 2  # top-2 of 4 is a real choice, not all experts
    with torch.no_grad():
        ffn.router.gate.bias[0] = -1e4
    off = logits(model)
    assert not torch.allclose(off, base)
    with torch.no_grad():
        ffn.router.gate.bias[0] = 0.0
        perm = torch.tensor([2, 3, 0, 1])
        ffn.router.gate.w_gate.weight.copy_(ffn.router.gate.w_gate.weight[perm].clone())
    assert not torch.allclose(logits(model), base)


@pytest.mark.parametrize("mode", ["reselect", "zero"])
def test_moee_interventions_reach_the_lora_experts(mode):
    """``disable_experts`` acts on a lora model in both modes: ``zero`` edits the dispatch at the
    adapters' call, which the layer must make as a module call (it called ``dispatch_combine``
    directly, so the hook never fired and zeroing an expert silently changed nothing)."""
    from moee.capture.interventions import disable_experts

    model = lora(n_experts=4, top_k=2)
    train_adapters(model)
    base = logits(model)
    chosen = [(0, e) for e in range(3)] if mode == "zero" else [(0, 0)]
    with disable_experts(model, chosen, mode=mode):
        off = logits(model)
    assert not torch.allclose(off, base)
    assert torch.equal(logits(model), base)  # undone on exit


def test_a_lora_model_saves_and_loads_to_the_same_logits(tmp_path):
    model = lora()
    train_adapters(model)
    want = logits(model)
    up.save_upcycled(model, tmp_path / "m")
    loaded = MoEEUpcycledForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.upcycle_mode == "lora"
    assert torch.equal(logits(loaded), want)


def test_lora_refusals_name_the_argument():
    with pytest.raises(ValueError, match="lora_rank must be a positive int"):
        up.upcycle(dense_model("llama"), n_experts=4, top_k=2, mode="lora", lora_rank=0)
    with pytest.raises(ValueError, match="mode 'lora' needs lora_rank >= 1"):
        config = MoEEUpcycledConfig(
            text_config=dense_model("llama").config.to_dict(),
            num_experts=2,
            num_experts_per_tok=1,
            upcycle_mode="lora",
            expert_lora_rank=2,
            expert_intermediate_size=8,
            router_type="top_k",
        )
        ffn = DenseFFN(
            w_act=torch.zeros(8, 4), w_down=torch.zeros(4, 8), act=torch.nn.SiLU(), w_up=torch.zeros(8, 4)
        )
        UpcycledMoEFFN(config, ffn, torch.nn.Linear(4, 2))


def test_the_adapters_a_are_drawn_from_the_seed_uniform_within_one_over_sqrt_d_ff():
    """LoRA's A: uniform in +-1/sqrt(d_ff), from a generator seeded by ``seed`` alone (the first MoE
    layer's A is the generator's first draw: a centroid router draws nothing from it), whatever the
    caller's global RNG holds; the last layer's A is a later draw, not a copy."""
    import math

    torch.manual_seed(123)  # the caller's state must not matter
    model = lora(seed=5)
    first, last = (ffn.experts.lora_a.detach() for ffn in (model.moe_ffns()[0], model.moe_ffns()[-1]))
    n_experts, d_ff, rank = first.shape
    bound = 1.0 / math.sqrt(d_ff)
    want = (torch.rand(n_experts, d_ff, rank, generator=torch.Generator().manual_seed(5)) * 2 - 1) * bound
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    assert (
        float(first.abs().max()) <= bound
        and float(first.max()) > 0.8 * bound
        and float(first.min()) < -0.8 * bound
    )
    assert not torch.equal(first, last)
    torch.manual_seed(456)
    assert torch.equal(lora(seed=5).moe_ffns()[0].experts.lora_a, first)
    # with a random router the same generator draws the layer's router rows first, then its A
    model = lora(seed=5, router_init="random")
    gen = torch.Generator().manual_seed(5)
    d_model = model.config.text_config.hidden_size
    torch.randn(n_experts, d_model, generator=gen)
    want = (torch.rand(n_experts, d_ff, rank, generator=gen) * 2 - 1) * bound
    torch.testing.assert_close(model.moe_ffns()[0].experts.lora_a.detach(), want, rtol=0, atol=0)


def test_the_lora_router_centroids_follow_the_seed():
    """The neuron clusters that start a lora router are drawn from ``seed`` (not a fixed one)."""

    def routers(model):
        return [t for ffn in model.moe_ffns() for t in ffn.router.state_dict().values()]

    assert any(not torch.equal(a, b) for a, b in zip(routers(lora(seed=0)), routers(lora(seed=3))))


def test_only_a_lora_model_records_an_adapter_rank():
    """A split or copy model's configuration says it has no adapters (rank 0), whatever lora_rank says."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        for mode in ("split", "copy"):
            model = up.upcycle(
                dense_model("llama"), n_experts=4, top_k=2, mode=mode, lora_rank=5, balance_router=False
            )
            assert model.config.expert_lora_rank == 0, mode
    assert lora(rank=3).config.expert_lora_rank == 3


def test_settings_and_keywords_together_are_refused_naming_the_keywords():
    from moee.upcycle_settings import UpcycleSettings

    settings = UpcycleSettings.from_keywords(n_experts=4, top_k=2)
    with pytest.raises(TypeError, match=r"not both: got n_experts, top_k$"):
        up.upcycle(dense_model("llama"), settings, top_k=2, n_experts=4)


@pytest.mark.slow
def test_the_lora_router_starts_from_the_neuron_cluster_centroids_and_is_balanced():
    model = lora(balance=False)
    assert model.config.router_init == "centroid"
    balanced = lora(balance=True)
    report = balanced.router_load_report
    assert len(report) == len(balanced.moe_ffns())
    assert all(r["dead"] == 0 for r in report)


def test_routed_training_freezes_everything_but_routers_and_adapters():
    model = lora()
    keep = routed_parameter_ids(model)
    names = {n for n, p in model.named_parameters() if id(p) in keep}
    assert names and all(".router." in n or ".experts.lora_" in n for n in names)
    layers = len(model.moe_ffns())
    assert sum(".experts.lora_a" in n for n in names) == layers
    assert sum(".router." in n for n in names) >= layers
    assert not any("shared" in n or "embed" in n or "self_attn" in n for n in names)
    assert TRAINABLE == ("all", "routed")
    base = {"data": {"train": "t.jsonl", "tokenizer": "tok"}, "init": {"from": "m"}}
    assert load_config({**base, "optim": {"trainable": "routed"}})["optim"]["trainable"] == "routed"
    assert load_config(base)["optim"]["trainable"] == "all"
    with pytest.raises(ValueError, match="optim.trainable must be one of"):
        load_config({**base, "optim": {"trainable": "experts"}})


# ---------------------------------------------------------------- shipped as a delta over the base


@pytest.fixture
def base_and_delta(tmp_path):
    """A tiny dense Llama saved as the base, and a trained lora model of it saved as a delta."""
    from moee.models.smollm2 import file_sha256
    from moee.moe.delta import save_delta

    base = tmp_path / "base"
    dense_model("llama").save_pretrained(base)
    from moee.capture.tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        model = up.upcycle(str(base), n_experts=4, top_k=2, mode="lora", lora_rank=3, balance_router=False)
    train_adapters(model)
    with torch.no_grad():
        for ffn in model.moe_ffns():
            ffn.router.gate.bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    delta = save_delta(
        model,
        tmp_path / "delta",
        {"source": "tiny", "weights_sha256": file_sha256(base / "model.safetensors")},
    )
    (delta / "moee_embedding.json").write_text('{"pooling": "mean"}\n')
    return base, delta, model


def test_a_delta_assembles_bit_exactly_into_the_trained_model(base_and_delta, tmp_path):
    from moee.models.smollm2 import file_sha256
    from moee.moe.delta import DELTA_FILE, assemble

    base, delta, model = base_and_delta
    size = (delta / DELTA_FILE).stat().st_size
    dense_size = (base / "model.safetensors").stat().st_size
    assert size < dense_size  # only routers and adapters
    out = assemble(delta, base, tmp_path / "a")
    loaded = MoEEUpcycledForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), logits(model))
    assert (out / "moee_embedding.json").read_text() == '{"pooling": "mean"}\n'
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    again = assemble(delta, base, tmp_path / "b")
    assert file_sha256(again / "model.safetensors") == file_sha256(out / "model.safetensors")
    assert assemble(delta, base, out) == out  # cached: reused while its digest holds


def test_an_assembled_folder_follows_a_changed_companion_file(base_and_delta, tmp_path):
    """The cache is reused only while every file it copied from the delta folder is unchanged: a new
    ``moee_embedding.json`` (or a refitted reference) with the same delta rebuilds it; it was reused
    with the old configuration, so the shipped model would have embedded under stale settings."""
    from moee.moe.delta import assemble

    base, delta, _ = base_and_delta
    out = assemble(delta, base, tmp_path / "a")
    stamp = (out / "moee_assembled.json").stat().st_mtime_ns
    assert assemble(delta, base, out) == out and (out / "moee_assembled.json").stat().st_mtime_ns == stamp
    (delta / "moee_embedding.json").write_text('{"pooling": "last"}\n')
    (delta / "reference.json").write_text("{}\n")
    assemble(delta, base, out)
    assert (out / "moee_embedding.json").read_text() == '{"pooling": "last"}\n'
    assert (out / "reference.json").read_text() == "{}\n"


def test_a_changed_delta_or_another_base_is_refused(base_and_delta, tmp_path):
    import json

    from moee.moe.delta import DELTA_FILE, MANIFEST_FILE, assemble

    base, delta, _ = base_and_delta
    other = tmp_path / "other"
    dense_model("llama", seed=5).save_pretrained(other)
    with pytest.raises(ValueError, match="fits base weights"):
        assemble(delta, other, tmp_path / "x")
    manifest = json.loads((delta / MANIFEST_FILE).read_text())
    manifest["model_sha256"] = "0" * 64
    (delta / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="not bit-exact"):
        assemble(delta, base, tmp_path / "y")
    data = bytearray((delta / DELTA_FILE).read_bytes())
    data[-1] ^= 1
    (delta / DELTA_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="the delta changed after it was written"):
        assemble(delta, base, tmp_path / "z")


def test_assembly_never_replaces_a_folder_it_did_not_build_and_writes_normal_modes(base_and_delta, tmp_path):
    from moee.moe.delta import DELTA_FILE, assemble

    base, delta, _ = base_and_delta
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="was not built by moee"):
        assemble(delta, base, mine)
    assert (mine / "notes.txt").read_text() == "keep"
    out = assemble(delta, base, tmp_path / "built")
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out.stat().st_mode & 0o666)
    assert (delta / DELTA_FILE).stat().st_mode & 0o777 == (delta.stat().st_mode & 0o666)


def test_a_float16_delta_is_half_the_bytes_and_assembles_to_its_rounded_model(base_and_delta, tmp_path):
    from moee.models.smollm2 import file_sha256
    from moee.moe.delta import DELTA_FILE, assemble, build_from_delta, save_delta

    base, delta32, model = base_and_delta
    half = save_delta(
        model,
        tmp_path / "half",
        {"source": "tiny", "weights_sha256": file_sha256(base / "model.safetensors")},
        dtype=torch.float16,
    )
    assert (half / DELTA_FILE).stat().st_size < 0.6 * (delta32 / DELTA_FILE).stat().st_size
    rounded = build_from_delta(half, base)
    assembled = MoEEUpcycledForCausalLM.from_pretrained(assemble(half, base, tmp_path / "h"))
    assert torch.equal(logits(assembled), logits(rounded))
    assert 0 < (logits(rounded) - logits(model)).abs().max() < 1e-2  # rounded, not another model
