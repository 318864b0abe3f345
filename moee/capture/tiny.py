"""Tiny randomly initialised MoE models of any supported architecture (tests, benchmarks, docs).

One place that knows how to shrink each transformers MoE config to ``hidden=64``, 2-4 layers,
8 experts, top-2 and a tiny vocabulary, keeping a dense layer where the architecture has them.
No download: configs come from ``AutoConfig.for_model`` and weights from a fixed seed.
Used by ``tests/test_capture_architectures.py``, ``scripts/support_table.py`` and
``scripts/bench_capture.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from moee.capture.architectures import EXPERT_COUNT_KEYS, TOP_K_KEYS

__all__ = ["tiny_config", "tiny_model", "tiny_tokenizer", "TINY_WORDS"]

# Sizes every architecture understands (only the keys a config actually has are set).
_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "dense_intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "ffn_hidden_size": 64,
    "expert_ffn_hidden_size": 32,
    "router_hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_heads": 4,
    "head_dim": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 0,
    "per_layer_config": {},
}
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers")

# Per-architecture adjustments found while making each tiny model run (see the oracle test).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    },
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe", "moe"]},
    "dots3_note_text": {"head_dim": 16},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16},
    "lfm2_moe": {"layer_types": ["full_attention", "conv", "full_attention"]},
    "nemotron_h": {"layers_block_type": ["full_attention", "moe", "mlp", "moe"]},
    "zaya": {"num_experts_per_tok": 1},
    "gemma4_text": {"enable_moe_block": True, "layer_types": ["full_attention"] * 3},
    "jamba": {
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 2,
        "attn_layer_offset": 0,
    },
    "longcat_flash": {"zero_expert_num": 0},
    # copy mode: the block weights its experts by the router's scores (split mode sums them with
    # weight 1, so there is no weighting to check the native scores against)
    "moee_upcycled": {"upcycle_mode": "copy", "shared_intermediate_size": 0, "router_type": "loss_free"},
}

# Model types whose config wraps a dense model's (``text_config``): that model, shrunk the same way.
_TEXT_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "moee_upcycled": ("bert", {"is_decoder": True}),  # as minilm-moe: a causal BERT
}

TINY_WORDS = (
    "the a an cat dog bird sat ran flew on under over mat tree house big small red blue green "
    "quick slow happy sad music science sport food city river mountain rain sun night day"
).split()


def _scaled_list(values: list, n_layers: int) -> list:
    """Shorten a per-layer list to ``n_layers``, keeping one dense layer first when it had any."""
    if not values:
        return values
    dense = [v for v in values if isinstance(v, str) and v in ("dense", "mlp")]
    sparse = [v for v in values if v not in dense]
    if dense and sparse:
        return [dense[0]] + [sparse[0]] * (n_layers - 1)
    return list(values[:n_layers]) + [values[-1]] * max(0, n_layers - len(values))


def tiny_config(
    model_type: str,
    *,
    n_layers: int = 3,
    n_experts: int = 8,
    top_k: int = 2,
    vocab_size: int = 128,
    hidden_size: int = 64,
    **overrides: Any,
):
    """A small config of ``model_type`` (a transformers ``PreTrainedConfig``)."""
    from transformers import AutoConfig

    from moee.models import MODEL_TYPES, register_models

    if model_type in MODEL_TYPES:
        register_models()  # moee_lm, moee_upcycled, deepseek

    defaults = AutoConfig.for_model(model_type).to_dict()
    kwargs: dict[str, Any] = {}
    for key, value in _SIZES.items():
        if key in defaults:
            kwargs[key] = value
    if hidden_size != 64:
        kwargs["hidden_size"] = hidden_size
        for key in (
            "intermediate_size",
            "dense_intermediate_size",
            "intermediate_size_mlp",
            "ffn_hidden_size",
        ):
            if key in kwargs:
                kwargs[key] = hidden_size
    for key in _LAYER_KEYS:
        if key in defaults:
            kwargs[key] = n_layers
    for key in EXPERT_COUNT_KEYS:
        if key in defaults and not isinstance(defaults[key], (list, dict)):
            kwargs[key] = n_experts
    for key in TOP_K_KEYS:
        if key in defaults:
            kwargs[key] = top_k
    if defaults.get("n_group") is not None:
        kwargs["n_group"], kwargs["topk_group"] = 2, 1
    if defaults.get("num_expert_group") is not None:
        kwargs["num_expert_group"], kwargs["topk_group"] = 2, 1
    for key in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        if key in defaults and defaults[key] != 0:
            kwargs[key] = 1
    if defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)  # MLA and MHA-only models
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: rope part = head_dim
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    # a dense first layer where the architecture supports one
    for key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if key in defaults:
            kwargs[key] = 1
    if "moe_layer_end_index" in defaults:
        kwargs["moe_layer_end_index"] = n_layers - 1
    if "mlp_only_layers" in defaults:
        kwargs["mlp_only_layers"] = [0]
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        if isinstance(defaults.get(key), list):
            kwargs[key] = _scaled_list(defaults[key], n_layers)
    if "vocab_size" in defaults:
        kwargs["vocab_size"] = vocab_size
    if "vocab_size_per_layer_input" in defaults:
        kwargs["vocab_size_per_layer_input"] = vocab_size
    kwargs.update(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    if model_type in _TEXT_CONFIGS:
        dense, extra = _TEXT_CONFIGS[model_type]
        kwargs["text_config"] = tiny_config(
            dense, n_layers=n_layers, vocab_size=vocab_size, hidden_size=hidden_size, **extra
        )
    kwargs.update(_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(
    model_type: str, *, seed: int = 0, max_params: int = 20_000_000, **config_kwargs: Any
) -> torch.nn.Module:
    """A tiny ``AutoModelForCausalLM`` of ``model_type`` in eval mode, float32, fixed seed."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **config_kwargs)
    with torch.device("meta"):  # size check first: a config that did not shrink must not allocate GBs
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n_params > max_params:
        raise ValueError(f"tiny {model_type} config still has {n_params:,} parameters (> {max_params:,})")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_tokenizer(words: tuple[str, ...] | list[str] = TINY_WORDS):
    """A word-level fast tokenizer over ``words`` (ids 0-3 are PAD, UNK, BOS, EOS); it adds no BOS,
    like the OLMoE/GPT-NeoX tokenizers, so empty texts exercise the embedder's empty-text rule."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=512,
    )
