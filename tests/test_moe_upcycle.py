"""Upcycling dense checkpoints into MoE models (moee/moe/upcycle.py, moee/moe/upcycled.py).

Tiny random dense models are built here from transformers configs (no downloads). The
equivalence guarantees of docs/UPCYCLING.md are the tests named there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
)

from moee.capture.registry import find_routers
from moee.capture.tiny import tiny_tokenizer
from moee.moe.upcycle import balanced_kmeans, save_upcycled, select_shared_neurons, split_neurons, upcycle
from moee.moe.upcycled import FAMILIES, MoEEUpcycledForCausalLM, MoEEUpcycledModel, family_rule, moe_layers

VOCAB = 48
D_FF = 48
TOL = 1e-5
TEXTS = ["the quick bird flew over the river", "rain", "", "music at night"]


def dense_config(family: str):
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_inner=D_FF,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=2,
            eos_token_id=3,
        )
    if family in ("bert", "roberta"):
        cls = BertConfig if family == "bert" else RobertaConfig
        return cls(
            hidden_size=32, intermediate_size=D_FF, max_position_embeddings=72, pad_token_id=0, **common
        )
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    return cls(
        hidden_size=32,
        intermediate_size=D_FF,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **common,
        **extra,
    )


def dense_model(family: str, seed: int = 0, **overrides):
    config = dense_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if family_rule(family).decoder else AutoModel
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # bigger biases than the zero init, so the bias handling is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") and "norm" not in name.lower():
                p.normal_(std=0.1)
    return model


def outputs(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a causal LM, else the last hidden state."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


IDS = torch.randint(4, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
ALL_FAMILIES = sorted(FAMILIES)


# ------------------------------------------------------------------ equivalence guarantees


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("shared_neurons", [0, 8])
def test_split_with_all_experts_reproduces_dense(family, shared_neurons):
    dense = dense_model(family)
    ref = outputs(dense, IDS)
    moe = upcycle(dense, n_experts=4, top_k=4, mode="split", shared_neurons=shared_neurons)
    assert max_diff(outputs(moe, IDS), ref) <= TOL


@pytest.mark.slow
def test_split_with_central_shared_neurons_and_mlp_biases_reproduces_dense():
    """Llama with ``mlp_bias=True`` (biases on gate, up and down) and the "central" shared selection."""
    dense = dense_model("llama", mlp_bias=True)
    assert dense.model.layers[0].mlp.up_proj.bias is not None
    ref = outputs(dense, IDS)
    for mode, kwargs in (
        ("split", dict(top_k=4, shared_neurons=8, shared_select="central")),
        ("copy", dict(top_k=2)),
    ):
        moe = upcycle(dense_model("llama", mlp_bias=True), n_experts=4, mode=mode, **kwargs)
        assert max_diff(outputs(moe, IDS), ref) <= TOL, mode


def test_shared_neuron_selections_differ():
    dense = dense_model("gpt2")
    ffn = family_rule("gpt2").read(dense.transformer.h[0])
    norm, central = select_shared_neurons(ffn, 8, "norm"), select_shared_neurons(ffn, 8, "central")
    assert len(norm) == len(central) == 8 and not torch.equal(norm, central)
    scores = ffn.w_act.norm(dim=1) * ffn.w_down.norm(dim=0)
    assert scores[norm].min() >= torch.sort(scores).values[-8]  # the 8 largest


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize(("top_k", "shared_copy"), [(1, False), (2, False), (1, True)])
def test_copy_with_any_routing_reproduces_dense(family, top_k, shared_copy):
    dense = dense_model(family)
    ref = outputs(dense, IDS)
    # a strong random router: tokens really are routed to different experts
    moe = upcycle(dense, n_experts=4, top_k=top_k, mode="copy", router_std=1.0, shared_copy=shared_copy)
    assert moe.moe_ffns()[0].router(torch.randn(20, 32))[2].unique().numel() > 1
    assert max_diff(outputs(moe, IDS), ref) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_split_with_fewer_experts_is_sparse(family):
    """With top-k < E a split model computes only part of each FFN: the output must change
    (otherwise the equivalence tests above could pass with routing ignored)."""
    dense = dense_model(family)
    moe = upcycle(dense_model(family), n_experts=4, top_k=1, mode="split")
    assert max_diff(outputs(moe, IDS), outputs(dense, IDS)) > 1e-3


# ------------------------------------------------------------------ the neuron split


def test_split_gives_every_expert_exactly_d_ff_over_e_neurons_and_covers_all():
    dense = dense_model("llama")
    ffn = family_rule("llama").read(moe_layers(dense.base_model, family_rule("llama"))[0])
    shared = select_shared_neurons(ffn, 8)
    groups, centroids = split_neurons(ffn, 4, shared)
    assert [len(g) for g in groups] == [10] * 4
    everything = torch.cat([*groups, shared]).sort().values
    assert torch.equal(everything, torch.arange(D_FF))
    for e, g in enumerate(groups):  # router init "centroid": the mean input row of the expert's neurons
        torch.testing.assert_close(centroids[e], ffn.w_act[g].mean(0))
    moe = upcycle(dense, n_experts=4, top_k=2, mode="split", shared_neurons=8, balance_router=False)
    torch.testing.assert_close(moe.moe_ffns()[0].router.gate.w_gate.weight, centroids)


def test_balanced_kmeans_finds_separated_clusters_with_equal_sizes():
    gen = torch.Generator().manual_seed(0)
    centers = torch.tensor([[10.0, 0.0], [-10.0, 0.0], [0.0, 10.0], [0.0, -10.0]])
    truth = torch.arange(4).repeat_interleave(6)
    points = centers[truth] + 0.1 * torch.randn(24, 2, generator=gen)
    labels, centroids = balanced_kmeans(points, 4, seed=3)
    assert torch.bincount(labels).tolist() == [6] * 4
    # same partition up to relabelling
    assert all(len(set(labels[truth == c].tolist())) == 1 for c in range(4))
    assert torch.equal(labels, balanced_kmeans(points, 4, seed=3)[0])
    # unbalanced data still gives equal sizes
    skewed = torch.cat([torch.zeros(20, 2), torch.ones(4, 2)]) + 0.01 * torch.randn(24, 2, generator=gen)
    assert torch.bincount(balanced_kmeans(skewed, 4)[0]).tolist() == [6] * 4


@pytest.mark.slow
def test_split_router_gets_a_gradient_through_unit_weights():
    moe = upcycle(dense_model("llama"), n_experts=4, top_k=2, mode="split").train()
    out = moe(input_ids=IDS).logits
    out.square().mean().backward()
    grad = moe.moe_ffns()[0].router.gate.w_gate.weight.grad
    assert grad is not None and grad.abs().sum() > 0


# ------------------------------------------------------------------ save / load


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_saved_model_round_trips_through_auto_classes(family, tmp_path):
    moe = upcycle(dense_model(family), n_experts=4, top_k=2, mode="split", shared_neurons=4)
    before = outputs(moe, IDS)
    save_upcycled(moe, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin"))
    assert AutoConfig.from_pretrained(tmp_path).model_type == "moee_upcycled"
    auto = AutoModelForCausalLM if family_rule(family).decoder else AutoModel
    loaded = auto.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MoEEUpcycledForCausalLM if family_rule(family).decoder else MoEEUpcycledModel)
    assert loaded.config.text_config.model_type == family
    assert max_diff(outputs(loaded, IDS), before) == 0.0


@pytest.mark.slow
def test_copy_upcycle_round_trips_and_keeps_tied_embeddings(tmp_path):
    moe = upcycle(dense_model("gpt2"), n_experts=2, top_k=1, mode="copy", shared_copy=True)
    save_upcycled(moe, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.transformer.wte.weight.data_ptr()
    assert max_diff(outputs(loaded, IDS), outputs(moe, IDS)) == 0.0


@pytest.mark.slow
def test_upcycle_from_a_saved_dense_directory(tmp_path):
    dense = dense_model("qwen2")
    dense.save_pretrained(tmp_path / "dense")
    moe = upcycle(tmp_path / "dense", n_experts=3, top_k=3, mode="split")
    assert moe.config.upcycled_from == str(tmp_path / "dense")
    assert max_diff(outputs(moe, IDS), outputs(dense, IDS)) <= TOL


# ------------------------------------------------------------------ capture and embeddings


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_capture_finds_one_router_per_layer_and_encodes(family, tmp_path):
    from moee import MoEEmbedder

    moe = upcycle(dense_model(family), n_experts=4, top_k=2, mode="split")
    save_upcycled(moe, tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    if family_rule(family).decoder:
        emb = MoEEmbedder.from_pretrained(tmp_path, device="cpu")
    else:
        from transformers import AutoTokenizer

        emb = MoEEmbedder(AutoModel.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path))
    routers = find_routers(emb.model)
    assert [r.layer_index for r in routers] == [0, 1]
    # the default loss_free router: softmax scores, its selection bias read beside them
    assert {r.n_experts for r in routers} == {4} and {r.rule for r in routers} == {"softmax_bias"}
    assert emb.n_moe_layers == 2 and emb.n_experts == 4
    for method, dim in (("hs", 32), ("rw", 8), ("moee_sum", 40)):
        vectors = emb.encode(TEXTS, method=method)
        assert vectors.shape == (len(TEXTS), dim)
        assert np.isfinite(vectors).all()


# ------------------------------------------------------------------ errors and the CLI


def test_unsupported_architecture_names_model_type_and_supported_list():
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=D_FF, num_hidden_layers=1, num_attention_heads=4
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"'gpt_neox'.*supported: bert, gpt2, llama"):
        upcycle(model, n_experts=4, top_k=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_experts=5, top_k=1), r"d_ff=48 .*not divisible by n_experts=5"),
        (dict(n_experts=4, top_k=1, shared_neurons=6), r"shared_neurons=6 is not divisible by n_experts=4"),
        (dict(n_experts=4, top_k=5), r"top_k must be an int in \[1, n_experts=4\]"),
        (dict(n_experts=4, top_k=1, mode="merge"), r"mode must be one of"),
        (dict(n_experts=4, top_k=1, mode="copy", router_init="centroid"), r"centroid.*needs mode='split'"),
        (dict(n_experts=4, top_k=1, mode="copy", shared_neurons=4), r"shared_neurons is for mode='split'"),
        (dict(n_experts=4, top_k=1, shared_copy=True), r"shared_copy is for mode='copy'"),
        (dict(n_experts=4, top_k=1, router_init="kmeans"), r"router_init must be one of"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        upcycle(dense_model("llama"), **kwargs)


def test_config_defaults_describe_a_model():
    """``expert_intermediate_size`` defaults from the dense config, so a config alone builds a model."""
    from moee.moe.upcycled import MoEEUpcycledConfig

    assert MoEEUpcycledConfig().expert_intermediate_size == 11008 // 8  # LlamaConfig() defaults
    config = MoEEUpcycledConfig(text_config=dense_config("gpt2"), num_experts=4, shared_intermediate_size=8)
    assert config.expert_intermediate_size == (D_FF - 8) // 4
    copy = MoEEUpcycledConfig(text_config=dense_config("bert"), num_experts=4, upcycle_mode="copy")
    assert copy.expert_intermediate_size == D_FF
    model = AutoModel.from_config(copy)
    assert isinstance(model, MoEEUpcycledModel) and len(model.moe_ffns()) == 2
    with pytest.raises(ValueError, match="model_type 'gpt_neox'"):
        MoEEUpcycledConfig(text_config=GPTNeoXConfig())


@pytest.mark.slow
def test_encoder_upcycle_is_not_a_causal_lm(tmp_path):
    save_upcycled(upcycle(dense_model("bert"), n_experts=2, top_k=1), tmp_path)
    with pytest.raises(ValueError, match="bert is an encoder, not a causal LM: load it with AutoModel"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.slow
def test_cli_upcycle_writes_a_loadable_model(tmp_path, capsys):
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
        "4",
    ]
    assert main(argv + ["--mode", "split", "--shared-neurons", "8", "--router-init", "random"]) == 0
    assert "2 MoE layers x 4 experts" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert loaded.config.shared_intermediate_size == 8 and loaded.config.router_init == "random"
    assert (tmp_path / "moe" / "tokenizer.json").is_file()
    assert max_diff(outputs(loaded, IDS), outputs(dense, IDS)) <= TOL
    assert (
        main(
            [
                "upcycle",
                str(tmp_path / "dense"),
                "--out",
                str(tmp_path / "bad"),
                "--experts",
                "5",
                "--top-k",
                "1",
            ]
        )
        == 2
    )
    assert "not divisible by n_experts=5" in capsys.readouterr().err
    assert main(argv) == 2  # --out is not empty now
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--mode", "copy"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "moe").upcycle_mode == "copy"


@pytest.mark.slow
def test_upcycled_decoder_generates_like_the_dense_model():
    dense = dense_model("llama")
    moe = upcycle(dense_model("llama"), n_experts=4, top_k=4, mode="split")
    prompt = IDS[:1]
    ref = dense.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(moe.generate(prompt, max_new_tokens=5, do_sample=False), ref)
