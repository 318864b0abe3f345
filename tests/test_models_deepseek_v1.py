"""DeepSeekMoE v1 (``model_type="deepseek"``) loads natively: config and weight mapping, routers, refusals.

The checkpoints are written here by hand in the original layout (the original ``config.json`` field
names, the hub's ``auto_map`` pointing at custom code that is not there, safetensors with the
original weight names), without the original modeling code. The full forward is checked against
the original code by ``scripts/compare_deepseek_v1.py`` (needs transformers 4.45, not run in CI).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moee import MoEEmbedder
from moee.capture import find_routers, router_report
from moee.capture.tiny import tiny_tokenizer

HIDDEN, HEADS, VOCAB = 32, 4, 64

# deepseek-moe-16b's config.json, shrunk (same fields, including the training-only ones).
BASE_CONFIG = {
    "architectures": ["DeepseekForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekConfig",
        "AutoModel": "modeling_deepseek.DeepseekModel",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
    },
    "model_type": "deepseek",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 2,
    "eos_token_id": 3,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 48,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 8,
    "moe_layer_freq": 1,
    "n_routed_experts": 6,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": HEADS,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": HEADS,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.36.0",
    "use_cache": True,
    "vocab_size": VOCAB,
}


def _is_moe(cfg: dict, i: int) -> bool:
    return (
        cfg["n_routed_experts"] is not None
        and i >= cfg["first_k_dense_replace"]
        and i % cfg["moe_layer_freq"] == 0
    )


def original_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the original checkpoint's names and shapes."""
    gen = torch.Generator().manual_seed(seed)
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }

    def mlp(prefix: str, width: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (width, h)
        shapes[f"{prefix}.up_proj.weight"] = (width, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, width)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.self_attn.q_proj.weight": (h, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, h),
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
            }
        )
        if cfg["attention_bias"]:
            for name, n in (("q", h), ("k", kv), ("v", kv), ("o", h)):
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (n,)
        if _is_moe(cfg, i):
            shapes[f"{p}.mlp.gate.weight"] = (cfg["n_routed_experts"], h)
            for e in range(cfg["n_routed_experts"]):
                mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
            if cfg["n_shared_experts"] is not None:
                mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("mlp.gate.weight"):
            out[name] = 0.5 * noise
        else:
            out[name] = 0.1 * noise
    return out


def write_checkpoint(path: Path, **changes) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = {**BASE_CONFIG, **changes}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = original_weights(cfg)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer().save_pretrained(path)
    return cfg, weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("deepseek_v1")
    cfg, weights = write_checkpoint(path)
    return path, cfg, weights


@pytest.fixture(scope="module")
def embedder(checkpoint) -> MoEEmbedder:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emb = MoEEmbedder.from_pretrained(checkpoint[0], device="cpu")
    assert not [w for w in caught if "pattern" in str(w.message)], (
        "routers came from the name-pattern fallback"
    )
    return emb


def test_loads_natively_with_every_original_weight(checkpoint, embedder):
    from transformers import AutoModelForCausalLM

    from moee.models.deepseek_v1 import DeepseekV1Config, DeepseekV1ForCausalLM

    path, cfg, weights = checkpoint
    assert isinstance(embedder.model, DeepseekV1ForCausalLM)  # auto_map ignored without remote code
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    config = model.config
    assert isinstance(config, DeepseekV1Config)
    assert config.rope_parameters == {"rope_theta": 10000, "rope_type": "default"}
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (6, 2, 2)
    assert (config.first_k_dense_replace, config.moe_layer_freq, config.norm_topk_prob) == (1, 1, False)
    assert config.head_dim == HIDDEN // HEADS and config.tie_word_embeddings is False


def test_layers_follow_the_original_rule(tmp_path):
    from transformers import AutoModelForCausalLM

    from moee.models.deepseek_v1 import DeepseekV1MoE

    cfg, _ = write_checkpoint(tmp_path, num_hidden_layers=6, moe_layer_freq=2, n_shared_experts=None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    kinds = [isinstance(layer.mlp, DeepseekV1MoE) for layer in model.model.layers]
    assert kinds == [False, False, True, False, True, False]  # i >= 1 and i % 2 == 0
    assert all(
        layer.mlp.shared_experts is None
        for layer in model.model.layers
        if isinstance(layer.mlp, DeepseekV1MoE)
    )
    dense = model.model.layers[0].mlp
    assert dense.gate_proj.out_features == cfg["intermediate_size"]
    assert [r.layer_index for r in find_routers(model)] == [2, 4]
    assert router_report(model)["dense_layers"] == [0, 1, 3, 5]


def test_routers_come_from_the_registry(embedder, checkpoint):
    _, cfg, _ = checkpoint
    routers = find_routers(embedder.model)
    assert [r.name for r in routers] == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert {r.kind for r in routers} == {"mlp"} and {r.rule for r in routers} == {"softmax"}
    assert embedder.n_experts == cfg["n_routed_experts"]  # shared experts are not routed
    report = router_report(embedder.model)
    assert report["model_type"] == "deepseek" and report["dense_layers"] == [0]
    shared = embedder.model.model.layers[1].mlp.shared_experts
    assert shared.gate_proj.out_features == cfg["moe_intermediate_size"] * cfg["n_shared_experts"]


def _original_moe(block, x: torch.Tensor, top_k: int, norm: bool) -> torch.Tensor:
    """The original block's formula, written out densely: softmax over the routed experts, greedy
    top-k weights (renormalised when ``norm``), their experts summed, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(flat @ block.gate.weight.T, dim=-1)
    weights, index = torch.topk(scores, top_k, dim=-1)
    if norm and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    dense = torch.zeros_like(scores).scatter(-1, index, weights)
    out = sum(dense[:, e : e + 1] * expert(flat) for e, expert in enumerate(block.experts))
    if block.shared_experts is not None:
        out = out + block.shared_experts(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("norm", [False, True])
def test_moe_block_computes_the_original_formula(tmp_path, norm):
    from transformers import AutoModelForCausalLM

    cfg, _ = write_checkpoint(tmp_path, norm_topk_prob=norm, num_experts_per_tok=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    block = model.model.layers[2].mlp
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = block(x), _original_moe(block, x, 3, norm)
        _, weights, _ = block.gate(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == norm


@pytest.mark.slow
def test_rw_is_the_softmax_of_the_gate_logits_at_the_last_token(embedder):
    texts = ["the cat sat on the mat", "dog", "a big red house under the tree"]
    trace = embedder.trace(texts, batch_size=3)
    for i, text in enumerate(texts):
        ids = torch.tensor([embedder.tokenizer(text)["input_ids"]])
        with torch.no_grad():
            out = embedder.model(input_ids=ids, output_router_logits=True, use_cache=False)
        want = torch.stack([torch.softmax(logits[-1], -1) for logits in out.router_logits])
        torch.testing.assert_close(torch.from_numpy(trace.rw[i]), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            torch.from_numpy(trace.hs[i]), _final_hidden(embedder, ids), atol=1e-5, rtol=1e-5
        )


def _final_hidden(embedder: MoEEmbedder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return embedder.model.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1]


def test_rope_scaling_maps_to_rope_parameters(tmp_path):
    from transformers import AutoConfig

    write_checkpoint(tmp_path, rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["rope_theta"] == 5000


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"routed_scaling_factor": 16.0}, "routed_scaling_factor"),
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}, "yarn"),
    ],
)
def test_unsupported_config_values_are_refused(tmp_path, change, field):
    write_checkpoint(tmp_path, **change)
    with pytest.raises(ValueError, match=field):
        MoEEmbedder.from_pretrained(tmp_path, device="cpu")


def test_byte_level_tokenizer_declared_as_llama_keeps_its_pre_tokenizer(tmp_path):
    """deepseek-moe-16b's tokenizer_config says LlamaTokenizerFast while its tokenizer.json is byte-level
    BPE; a Llama (Metaspace) pipeline would drop every space, so the loaded tokenizer must encode
    exactly as the tokenizer.json does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    write_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).unlink(missing_ok=True)
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "w"), ("Ġw", "o"), ("h", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab[bos], vocab[eos] = len(vocab), len(vocab) + 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizerFast",
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": bos,
                "eos_token": eos,
                "pad_token": eos,
                "unk_token": None,
                "legacy": True,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
            }
        )
    )
    emb = MoEEmbedder.from_pretrained(tmp_path, device="cpu")
    text = "hello world, two words"
    assert emb.tokenizer(text)["input_ids"] == backend.encode(text).ids
    assert emb.tokenizer.decode(emb.tokenizer(text, add_special_tokens=False)["input_ids"]) == text
