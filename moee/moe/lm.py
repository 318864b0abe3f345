"""A small decoder-only MoE language model as a Hugging Face `PreTrainedModel`.

Pre-norm (RMSNorm) blocks with RoPE causal self-attention (torch SDPA) and a sparse MoE
feed-forward (`moee.moe.layer.MoELayer`) per layer, optionally dense FFNs in the first
layers, a final `model.norm` and an LM head tied to the token embedding.

To the outside it is an ordinary transformers MoE model: `model.model.layers[i].mlp.gate`
is a router whose forward returns a tuple with the clean router logits at index 0, declared
in `_can_record_outputs["router_logits"]` exactly like OLMoE, so `output_router_logits=True`
and hook-based router capture work without a special case. Importing this module registers
`model_type="moee_lm"` with `AutoConfig` / `AutoModel` / `AutoModelForCausalLM`, so
`AutoModelForCausalLM.from_pretrained(path)` works offline (safetensors, no remote code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from moee.moe.gate_registry import GATES, RouterFields, build_gate, gate_spec, resolve_router
from moee.moe.gates import init_unsaved_state
from moee.moe.layer import Experts, MoEERouter, MoELayer

__all__ = ["MoEEConfig", "MoEEModel", "MoEEForCausalLM", "MoEERouter", "MoEEPreTrainedModel"]


ROUTER_TYPES = tuple(GATES)


class MoEEConfig(PreTrainedConfig, RouterFields):
    """Configuration of `MoEEForCausalLM`.

    `router_type` selects the gate of every MoE layer from the registry
    `moee.moe.gate_registry.GATES` (one entry per gate; each lists the `router_*` fields it
    reads, which come from `moee.moe.gate_registry.RouterFields`, and moee/moe/README_TRAINING.md
    tabulates them): `"noisy_top_k"` (default) is
    Shazeer's noisy top-k gate (`router_noisy`) with importance and load losses weighted by
    `router_w_importance` / `router_w_load` (the paper's LM setting is 0.1 / 0.1); `"loss_free"`
    is the auxiliary-loss-free bias balancing (bias step `router_bias_gamma`, no loss) over
    `router_score_func` scores ("sigmoid" as in DeepSeek-V3, or "softmax"); `"hierarchical"`
    (`router_n_groups`, `router_k_primary`), `"strictly_balanced"` (`router_w_threshold`; eval
    mode selects with the learned thresholds), `"switch"` (top-1 with capacity,
    `router_capacity_factor`, `router_min_capacity`, `router_switch_alpha`), `"expert_choice"`
    (`router_capacity_factor`, `router_min_capacity`; it looks at later tokens when it picks the
    tokens of each expert, which a causal LM must not, so building such a model gives a
    `CausalLeakWarning`) and `"softmax"` (dense). `moe_intermediate_size` is the hidden width of
    one (fine-grained) expert; the first `first_k_dense_replace` layers use a dense FFN of width
    `intermediate_size`. `embedding_multiplier` scales the token embeddings entering the residual
    stream (Gemma uses sqrt(hidden_size)); with the small tied-embedding init it keeps token
    identity, not the attention average, dominant in the router inputs at the start of training,
    which stops every token from choosing the same experts.
    """

    model_type = "moee_lm"
    attribute_map = {"num_local_experts": "num_experts"}

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    embedding_multiplier: float = 1.0
    initializer_range: float = 0.02
    hidden_act: str = "swiglu"
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 64
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    intermediate_size: int = 512
    output_router_logits: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("the attention head dimension must be even for RoPE")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        resolve_router(self)
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace must be in [0, {self.num_hidden_layers}]")
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def moe_layer_indices(self) -> list[int]:
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))


@dataclass
class MoEEModelOutput(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` plus each MoE layer's aux dict (balancing loss and routing statistics)."""

    moe_aux: tuple[dict[str, torch.Tensor], ...] | None = None


@dataclass
class MoEECausalLMOutput(MoeCausalLMOutputWithPast):
    """`loss = lm_loss + aux_loss`; `aux_loss` is the sum of the gates' balancing losses."""

    lm_loss: torch.Tensor | None = None
    moe_aux: tuple[dict[str, torch.Tensor], ...] | None = None


class MoEERMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[B, T, head_dim]` for rotary embeddings (computed on the fly: no buffer to load)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class MoEEAttention(nn.Module):
    """Causal multi-head self-attention with RoPE via `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, config: MoEEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MoEEDenseMLP(nn.Module):
    """Dense FFN for the first `first_k_dense_replace` layers (same expert blueprint, one expert, weight 1)."""

    def __init__(self, config: MoEEConfig):
        super().__init__()
        self.ffn = Experts(1, config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        shape = x.shape
        return self.ffn.expert_forward(0, x.reshape(-1, shape[-1])).reshape(shape), {}


class MoEEDecoderLayer(nn.Module):
    def __init__(self, config: MoEEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = MoEERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MoEEAttention(config, layer_idx)
        self.post_attention_layernorm = MoEERMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_idx < config.first_k_dense_replace:
            self.mlp: nn.Module = MoEEDenseMLP(config)
        else:
            self.mlp = MoELayer(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                n_shared_experts=config.num_shared_experts,
                d_shared=config.shared_expert_intermediate_size,
                activation=config.hidden_act,
                gate=build_gate(config),
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn_mask: torch.Tensor | None,
        token_mask: torch.Tensor | None,
        cache: Cache | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos_sin, attn_mask, cache)
        mlp_out, aux = self.mlp(self.post_attention_layernorm(h), token_mask=token_mask)
        return h + mlp_out, aux


class MoEEPreTrainedModel(PreTrainedModel):
    config_class = MoEEConfig
    config: MoEEConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoEEDecoderLayer"]
    _supports_sdpa = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MoEERouter, index=0),
        "hidden_states": MoEEDecoderLayer,
    }

    def _init_weights(self, module: nn.Module) -> None:
        init_unsaved_state(module)
        std = self.config.initializer_range
        if getattr(module, "_moee_router_part", False):
            # transformers applies this to leaves first, so router parts are matched by a tag.
            spec = gate_spec(self.config.router_type)
            for name, p in module.named_parameters(recurse=False):
                # each gate's entry says how (moee.moe.gate_registry.GateSpec.parameter_init): zero
                # with exploration noise (Shazeer et al. 2017, Appendix A), random where nothing else
                # breaks the ties of a zero router, constants such as the strict gate's thresholds
                kind, value = spec.parameter_init(name, self.config)
                if kind == "zeros":
                    init.zeros_(p)
                elif kind == "constant":
                    init.constant_(p, value)
                else:
                    init.normal_(p, mean=0.0, std=value)
        elif isinstance(module, Experts):
            init.normal_(module.w_in, mean=0.0, std=std)
            init.normal_(module.w_out, mean=0.0, std=std)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MoEERMSNorm):
            init.ones_(module.weight)


def _attention_mask_4d(
    attention_mask: torch.Tensor | None, q_len: int, past: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean SDPA mask `[B, 1, q, kv]` (True = attend), or None when plain causal attention suffices.

    Every query may also attend to itself, so rows of left padding stay finite (a fully masked
    row would give NaN, which would poison batch-level router statistics).
    """
    if attention_mask is None and past == 0:
        return None
    kv_len = past + q_len
    qpos = torch.arange(past, kv_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    allowed = kpos[None, :] <= qpos[:, None]
    if attention_mask is None:
        return allowed[None, None]
    if attention_mask.dim() != 2 or attention_mask.shape[1] != kv_len:
        raise ValueError(
            f"attention_mask must be 2-D [batch, {kv_len}] (past + current tokens), got {tuple(attention_mask.shape)}"
        )
    allowed = allowed[None] & attention_mask[:, None, :].bool()
    allowed = allowed | (kpos[None, :] == qpos[:, None])[None]
    return allowed[:, None]


class MoEEModel(MoEEPreTrainedModel):
    def __init__(self, config: MoEEConfig):
        super().__init__(config)
        if config.moe_layer_indices:
            gate_spec(config.router_type).warn_if_leaky(stacklevel=2)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MoEEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MoEERMSNorm(config.hidden_size, config.rms_norm_eps)
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
    ) -> MoEEModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("specify exactly one of input_ids or inputs_embeds")
        if cache is None and kwargs.get("past_key_values") is not None:
            cache = kwargs["past_key_values"]
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            inputs_embeds = inputs_embeds * self.config.embedding_multiplier
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        b, t, _ = inputs_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                # left padding: real tokens count from 0 (RoPE is relative anyway)
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -t:]
            else:
                position_ids = (
                    torch.arange(past, past + t, device=inputs_embeds.device).unsqueeze(0).expand(b, t)
                )
        attn_mask = _attention_mask_4d(attention_mask, t, past, inputs_embeds.device)
        token_mask = attention_mask[:, -t:].reshape(-1) if attention_mask is not None else None
        cos_sin = rope_cos_sin(
            position_ids, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype
        )
        hidden = inputs_embeds
        moe_aux = []
        for layer in self.layers:
            hidden, aux = layer(hidden, cos_sin, attn_mask, token_mask, cache)
            if aux:
                moe_aux.append(aux)
        hidden = self.norm(hidden)
        return MoEEModelOutput(
            last_hidden_state=hidden, cache=cache if use_cache else None, moe_aux=tuple(moe_aux)
        )


class MoEEForCausalLM(MoEEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MoEEConfig):
        super().__init__(config)
        self.model = MoEEModel(config)
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
    ) -> MoEECausalLMOutput | tuple:
        """Causal LM forward. `labels` are the input ids (shifted inside, -100 ignored)."""
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
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        aux_terms = [a["loss"] for a in outputs.moe_aux]
        aux_loss = torch.stack(aux_terms).sum() if aux_terms else logits.new_zeros(())
        lm_loss = loss = None
        if labels is not None:
            lm_loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
            loss = lm_loss + aux_loss
        out = MoEECausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            lm_loss=lm_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            moe_aux=outputs.moe_aux,
        )
        if return_dict is False:
            return out.to_tuple()
        return out


AutoConfig.register(MoEEConfig.model_type, MoEEConfig, exist_ok=True)
AutoModel.register(MoEEConfig, MoEEModel, exist_ok=True)
AutoModelForCausalLM.register(MoEEConfig, MoEEForCausalLM, exist_ok=True)
