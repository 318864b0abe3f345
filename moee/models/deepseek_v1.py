"""DeepSeekMoE (v1, ``model_type="deepseek"``, e.g. deepseek-moe-16b) as a native transformers 5 model.

Why a class of our own: transformers 5 has no class for DeepSeekMoE v1, and the checkpoints'
custom code (written for transformers 4.x) imports ``transformers.modeling_attn_mask_utils``,
which transformers 5 removed, so ``trust_remote_code=True`` fails on import. No transformers 5
class computes the same function either: ``deepseek_v2``/``v3`` use multi-head latent attention
(with an RMSNorm inside the key/value path), ``qwen2_moe`` puts a sigmoid gate on its shared expert,
GraniteMoE-shared renormalises the top-k weights, which v1 does only when ``norm_topk_prob``.

What DeepSeekMoE v1 is, and what this module builds (the checkpoint's weight names unchanged, so
safetensors load with no renaming):

* Llama attention (``q/k/v/o_proj``, bias = ``attention_bias``, grouped keys/values allowed),
  rotate-half RoPE with ``rope_theta`` and the legacy ``rope_scaling`` (``linear`` / ``dynamic``),
  pre-norm RMSNorm blocks, a final ``model.norm`` and an untied ``lm_head`` by default:
  transformers' own ``LlamaAttention`` / ``LlamaRotaryEmbedding`` / ``LlamaRMSNorm``;
* layer ``i`` is an MoE layer when ``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0``; the others have a dense SwiGLU MLP of width ``intermediate_size``;
* an MoE layer (``mlp``): router ``mlp.gate`` (a bare ``weight [n_routed_experts, hidden]``),
  softmax over all routed experts, greedy top-``num_experts_per_tok`` of the probabilities,
  renormalised over the selected only when ``norm_topk_prob`` (and top-k > 1); the output is
  ``sum_k w_k expert_k(x) + shared_experts(x)``, where ``shared_experts`` is one always-on SwiGLU
  MLP of width ``moe_intermediate_size * n_shared_experts`` with no gate (absent when
  ``n_shared_experts`` is null). No ``routed_scaling_factor`` (that is v2).

The router declares ``_can_record_outputs["router_logits"]`` (its output is
``(logits, top-k weights, top-k indices)``), so ``output_router_logits=True`` and
:func:`moee.capture.find_routers` see exactly the routed-expert gates: dense layers have none and
the shared experts are never routers. Inference only: the training-time sequence auxiliary loss
(``aux_loss_alpha``, ``seq_aux``) is accepted in the config and not computed.

Config values this port does not implement are refused with a ``ValueError`` naming the field
(``scoring_func`` other than softmax, ``topk_method`` other than greedy, group-limited routing,
a ``routed_scaling_factor`` other than 1, multi-head latent attention fields, ``mlp_bias``, a
``head_dim`` other than ``hidden_size // num_attention_heads``, an unknown RoPE type).
``scripts/compare_deepseek_v1.py`` checks the whole forward against the original modeling code.
Importing this module registers ``model_type="deepseek"`` with ``AutoConfig`` / ``AutoModel`` /
``AutoModelForCausalLM``; a checkpoint's ``auto_map`` is then ignored unless
``trust_remote_code=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

__all__ = [
    "DeepseekV1Config",
    "DeepseekV1Experts",
    "DeepseekV1ForCausalLM",
    "DeepseekV1Gate",
    "DeepseekV1MoE",
    "DeepseekV1Model",
    "DeepseekV1PreTrainedModel",
]

# Fields some DeepSeek configs carry (v2 and later) with the only values that mean "as v1"
# (None: the field is absent, as in v1 configs).
_ONLY_V1_VALUE = {
    "topk_method": (None, "greedy"),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "ep_size": (None, 1),
    "q_lora_rank": (None,),
    "kv_lora_rank": (None,),
    "qk_rope_head_dim": (None,),
    "qk_nope_head_dim": (None,),
    "v_head_dim": (None,),
}
_ROPE_TYPES = ("default", "linear", "dynamic")


class DeepseekV1Config(LlamaConfig):
    """Configuration of DeepSeekMoE v1, read from the checkpoint's own ``config.json`` field names.

    The Llama fields keep their meaning (``rope_theta`` / ``rope_scaling`` become transformers 5
    ``rope_parameters``); the MoE fields are the original ones, defaults as in the original
    ``DeepseekConfig``. ``pretraining_tp`` only split the original's matmuls (same function) and is
    accepted as is.
    """

    model_type = "deepseek"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    n_shared_experts: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    output_router_logits: bool = False
    bos_token_id: int | None = 100000
    eos_token_id: int | list[int] | None = 100001

    def __post_init__(self, **kwargs):
        for name, allowed in _ONLY_V1_VALUE.items():
            value = kwargs.get(name, getattr(self, name, None))
            if value not in allowed:
                raise ValueError(
                    f"DeepSeekMoE v1 config field {name}={value!r} is not supported (only {allowed!r}); "
                    "a checkpoint with multi-head latent attention or grouped routing is DeepSeek-V2/V3 "
                    "(model_type deepseek_v2 / deepseek_v3)"
                )
        if self.scoring_func != "softmax":
            raise ValueError(
                f"DeepSeekMoE v1 scoring_func={self.scoring_func!r} is not supported; the original code "
                "implements only 'softmax'"
            )
        if self.mlp_bias:
            raise ValueError("DeepSeekMoE v1 MLPs have no bias; mlp_bias=True is not supported")
        if self.head_dim is not None and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"DeepSeekMoE v1 derives head_dim from hidden_size // num_attention_heads "
                f"({self.hidden_size} // {self.num_attention_heads}); got head_dim={self.head_dim}"
            )
        if self.n_routed_experts is not None:
            if self.num_experts_per_tok is None or not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        super().__post_init__(**kwargs)
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"DeepSeekMoE v1 rope_scaling type {rope_type!r} is not supported (the original code knows "
                "'linear' and 'dynamic')"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """The original rule: routed experts configured, past the dense prefix, every ``moe_layer_freq``."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )


class DeepseekV1MLP(nn.Module):
    """SwiGLU MLP without bias (dense layers, each routed expert, the shared experts)."""

    def __init__(self, config: DeepseekV1Config, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV1Gate(nn.Module):
    """The router: logits over the routed experts, softmax, greedy top-k (renormalised if configured).

    Returns ``(logits [N, E], top-k weights [N, k], top-k indices [N, k])`` for ``N`` flattened
    tokens, computed in the input's dtype like the original ``MoEGate``.
    """

    def __init__(self, config: DeepseekV1Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight)
        scores = logits.softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, topk_weight, topk_idx


class DeepseekV1Experts(nn.ModuleList):
    """The routed experts (children ``0 .. E-1``, the original weight names), called like transformers 5
    expert modules with the router's choice: ``(tokens [N, H], top-k indices [N, k], weights [N, k])``."""

    def __init__(self, config: DeepseekV1Config):
        super().__init__(
            DeepseekV1MLP(config, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        top_k = top_k_index.shape[-1]
        flat_idx = top_k_index.reshape(-1)
        flat_weights = top_k_weights.reshape(-1, 1)
        order = flat_idx.argsort()
        counts = flat_idx.bincount(minlength=len(self)).tolist()
        start = 0
        for expert, count in zip(self, counts):  # one pass per expert that received tokens
            if count:
                picks = order[start : start + count]
                tokens = picks // top_k
                y = expert(hidden_states[tokens]) * flat_weights[picks]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out


class DeepseekV1MoE(nn.Module):
    """Routed experts weighted by the gate plus always-on shared experts (no shared-expert gate)."""

    def __init__(self, config: DeepseekV1Config):
        super().__init__()
        self.experts = DeepseekV1Experts(config)
        self.gate = DeepseekV1Gate(config)
        self.shared_experts = (
            DeepseekV1MLP(config, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts is not None
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        _, topk_weight, topk_idx = self.gate(hidden_states)
        out = self.experts(hidden_states.reshape(-1, shape[-1]), topk_idx, topk_weight).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekV1DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is a dense SwiGLU or a :class:`DeepseekV1MoE` (forward: Llama's)."""

    def __init__(self, config: DeepseekV1Config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = (
            DeepseekV1MoE(config)
            if config.is_moe_layer(layer_idx)
            else DeepseekV1MLP(config, config.intermediate_size)
        )
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV1PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV1Config
    config: DeepseekV1Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV1DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]
    _can_record_outputs = {
        "router_logits": OutputRecorder(DeepseekV1Gate, index=0),
        "hidden_states": DeepseekV1DecoderLayer,
        "attentions": LlamaAttention,
    }

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, DeepseekV1Gate):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


class DeepseekV1Model(DeepseekV1PreTrainedModel):
    def __init__(self, config: DeepseekV1Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            DeepseekV1DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if cache is None and kwargs.get("past_key_values") is not None:
            cache = kwargs.pop("past_key_values")
        kwargs.pop("past_key_values", None)
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (
                torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            )
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class DeepseekV1ForCausalLM(DeepseekV1PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeepseekV1Config):
        super().__init__(config)
        self.model = DeepseekV1Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast | tuple:
        """Causal LM forward (next-token loss when ``labels`` are given; no auxiliary loss)."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        out = MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )
        return out.to_tuple() if return_dict is False else out


AutoConfig.register(DeepseekV1Config.model_type, DeepseekV1Config, exist_ok=True)
AutoModel.register(DeepseekV1Config, DeepseekV1Model, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV1Config, DeepseekV1ForCausalLM, exist_ok=True)
