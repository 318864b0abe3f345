"""RoutingRecorder: forward hooks that keep only what the pooling needs.

Usage (what :class:`moee.embed.embedder.MoEEmbedder` does)::

    with RoutingRecorder(model, pooling="last") as rec:      # score=DEFAULT_SCORE ("native")
        rec.set_batch(attention_mask)
        model(input_ids=..., attention_mask=attention_mask)
        rw = rec.pooled_rw()      # [B, n_moe_layers, n_experts] float32
        hs = rec.pooled_hs()      # [B, hidden] float32 (final-norm output)

Why hooks pool: ``output_router_logits=True`` / ``output_hidden_states=True`` keep every layer's
``[B*T, E]`` logits and ``[B, T, d]`` states until the forward returns, so memory grows with the
sequence length. Here each hook reduces its tensor at once to ``[B, E]`` (or ``[B, d]``), so the
recorder's memory is independent of the length (``pooling="tokens"`` is the exception by design:
it exists to give token-level routes).

The router's own choice: with ``pooling="tokens"`` the recorder also keeps each router's selected
experts per token, read from the router's own output where it returns them
(:func:`moee.capture.registry.read_selection`) and re-derived as the top-k of the ``selection``
score only where it returns none (DBRX, pattern-found routers): :meth:`RoutingRecorder.token_selection`
and :attr:`RoutingRecorder.selection_returned`.

Padding: ``set_batch(attention_mask)`` works for left and right padding; "last" is the last position
whose mask is 1, "mean" averages the real positions only (``torch.where``, so NaN produced at padded
positions by fully masked attention rows cannot leak in). Routers may see ``[B*T, d]`` or
``[B, T, d]`` inputs; their logits are reshaped to ``[B, T, E]`` using the batch shape.

Probabilities in place of logits: transformers 5 releases before 5.6.0 returned the softmax
probabilities as ``router_logits`` for several softmax routers (OLMoE, Mixtral, Qwen-MoE, ...), and a
remote or custom router may still do so. A router output whose rows are all non-negative and sum to
1 (:func:`looks_like_probabilities`) is read as probabilities, never softmaxed again: for a
softmax-family rule its log stands in for the logits (the softmax of ``log p`` is ``p``, so every
score but ``"logits"`` is exact and ``"logits"`` is off by a per-token constant); any other rule is
refused with a message, since its logits cannot be recovered from a softmax.

Hooks are removed in ``__exit__``, also when the forward raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from moee.capture.registry import (
    DEFAULT_SCORE,
    SCORES,
    RouterSpec,
    _decoder_layers,
    apply_score,
    backbone,
    find_routers,
    read_selection,
    selection_bias,
    selection_scores,
)
from moee.capture.vocabulary import POOLINGS as EMBEDDING_POOLINGS
from moee.capture.vocabulary import check_choice

__all__ = ["RoutingRecorder", "POOLINGS", "SCORES", "DEFAULT_SCORE", "looks_like_probabilities"]

#: The embedding poolings plus ``"tokens"`` (every token kept, for token-level routes).
POOLINGS = (*EMBEDDING_POOLINGS, "tokens")

#: The scoring rules whose dense scores are a softmax of the logits: a router of one of these that
#: returns probabilities is read through their log (the softmax of ``log p`` is ``p``).
SOFTMAX_RULES = frozenset({"softmax", "topk_softmax", "softmax_bias"})


def looks_like_probabilities(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether router output ``values [..., E]`` (``E >= 2``) is probabilities, not logits: every
    entry >= 0 and every row summing to 1 (tolerance 1e-3, 2e-2 for 16-bit outputs of ``dtype``).
    Logits of a trained or random router essentially never satisfy both on every token."""
    if values.shape[-1] < 2 or values.numel() == 0:
        return False
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3
    v = values.float()
    return bool((v >= 0).all()) and bool(((v.sum(dim=-1) - 1).abs() <= tol).all())


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _projection(module: nn.Module, n_experts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's own ``[n_experts, hidden]`` weight (and bias), to recompute full logits."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == n_experts:
        bias = getattr(module, "bias", None)
        return weight, bias if isinstance(bias, torch.Tensor) else None
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features == n_experts]
    if len(linears) != 1:
        raise RuntimeError(
            f"cannot recompute the logits of {type(module).__name__}: no unique [hidden -> {n_experts}] projection"
        )
    return linears[0].weight, linears[0].bias


class RoutingRecorder:
    """Context manager that records pooled routing distributions and hidden states.

    ``routers`` defaults to :func:`moee.capture.registry.find_routers(model)`. ``pooling`` is
    ``"last"`` (last real token), ``"mean"`` (masked mean over real tokens, of the *scores*, e.g.
    the mean of the per-token softmax) or ``"tokens"`` (keep every token; hidden states are then
    pooled as "last"). ``score`` is one of :data:`SCORES`, by default :data:`DEFAULT_SCORE`
    (``"native"``, the architecture's own scoring rule; see the registry). ``hs_layers=True`` also
    pools every decoder layer's output (for the paper's all-layers HS).
    """

    def __init__(
        self,
        model: nn.Module,
        routers: Sequence[RouterSpec] | None = None,
        *,
        pooling: str = "last",
        score: str = DEFAULT_SCORE,
        hs_layers: bool = False,
    ) -> None:
        check_choice("pooling", pooling, POOLINGS)  # a caller of the recorder itself; the embedder's
        check_choice("score", score, SCORES)  # values come from a checked EmbeddingConfig
        self.model = model
        self.routers = list(routers) if routers is not None else find_routers(model)
        if not self.routers:
            raise ValueError(f"no MoE router found in {type(model).__name__}")
        self.pooling = pooling
        self.score = score
        self.hs_layers = hs_layers
        self.layers = [r.name for r in self.routers]
        self._hs_module = backbone(model)
        self._layer_modules = [m for _, m in _decoder_layers(model)] if hs_layers else []
        if hs_layers and not self._layer_modules:
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__} for hs_layers=True")
        self._handles: list = []
        self._mask: torch.Tensor | None = None
        self._warned: set[str] = set()  # routers already reported as returning probabilities
        self._reset()

    # ---------------------------------------------------------------- context management
    def __enter__(self) -> RoutingRecorder:
        try:
            for i, spec in enumerate(self.routers):
                self._handles.append(
                    spec.module.register_forward_hook(self._router_hook(i, spec), with_kwargs=True)
                )
                if self.pooling == "tokens" and spec.selection_format is not None:
                    self._handles.append(spec.router.register_forward_hook(self._selection_hook(i, spec)))
            self._handles.append(self._hs_module.register_forward_hook(self._final_hook))
            for j, layer in enumerate(self._layer_modules):
                self._handles.append(layer.register_forward_hook(self._layer_hook(j)))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this recorder installed (idempotent)."""
        while self._handles:
            self._handles.pop().remove()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    # ---------------------------------------------------------------- batch state
    def _reset(self) -> None:
        self._rw: list[torch.Tensor | None] = [None] * len(self.routers)
        self._returned: list[torch.Tensor | None] = [None] * len(self.routers)
        self._derived: list[torch.Tensor | None] = [None] * len(self.routers)
        self._hs: torch.Tensor | None = None
        self._hs_layers: list[torch.Tensor | None] = [None] * len(self._layer_modules)

    def set_batch(self, attention_mask: torch.Tensor, pool_mask: torch.Tensor | None = None) -> None:
        """Declare the next forward's ``attention_mask [B, T]`` (1 = real token); clears the last batch.

        ``pool_mask [B, T]`` (default: the attention mask) says which real tokens are pooled: "last"
        is its last 1, "mean" averages its 1s (a recipe such as echo embeddings pools only part of
        the text, see ``moee.embed.recipes``)."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a [batch, seq_len] tensor")
        if pool_mask is not None:
            if not isinstance(pool_mask, torch.Tensor) or pool_mask.shape != attention_mask.shape:
                raise ValueError("pool_mask must be a tensor of the attention mask's shape")
            if bool((pool_mask.bool() & ~attention_mask.bool()).any()):
                raise ValueError("pool_mask marks a padded position (attention_mask 0)")
        if bool((attention_mask.bool().sum(dim=1) == 0).any()):
            raise ValueError("every sequence needs at least one real token (attention_mask row of zeros)")
        mask = (attention_mask if pool_mask is None else pool_mask).bool()
        lengths = mask.sum(dim=1)
        if bool((lengths == 0).any()):
            raise ValueError("every sequence needs at least one pooled token (pool_mask row of zeros)")
        seq_len = mask.shape[1]
        # Index of the last real token: works for left padding, right padding and no padding.
        self._last = (seq_len - 1 - mask.flip(dims=[1]).long().argmax(dim=1)).long()
        self._mask = mask
        self._lengths = lengths.to(torch.float32)
        self._reset()

    def _require_batch(self) -> torch.Tensor:
        if self._mask is None:
            raise RuntimeError("call recorder.set_batch(attention_mask) before the forward pass")
        return self._mask

    # ---------------------------------------------------------------- pooling
    def _pool(self, values: torch.Tensor) -> torch.Tensor:
        """Pool ``[B, T, D]`` float32 values to ``[B, D]`` (tokens pooling pools like "last")."""
        mask = self._mask.to(values.device)
        if self.pooling == "mean":
            kept = torch.where(
                mask.unsqueeze(-1), values, torch.zeros((), dtype=values.dtype, device=values.device)
            )
            return kept.sum(dim=1) / self._lengths.to(values.device).unsqueeze(-1)
        rows = torch.arange(values.shape[0], device=values.device)
        return values[rows, self._last.to(values.device)]

    def _as_btx(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        batch, seq_len = self._mask.shape
        if tensor.numel() % (batch * seq_len) != 0 or (
            tensor.dim() >= 2 and tensor.shape[0] not in (batch, batch * seq_len)
        ):
            raise RuntimeError(
                f"{what}: got a tensor of shape {tuple(tensor.shape)} for a batch of {batch}x{seq_len} tokens"
            )
        return tensor.reshape(batch, seq_len, -1)

    # ---------------------------------------------------------------- hooks
    def _as_logits(self, spec: RouterSpec, out: torch.Tensor) -> torch.Tensor:
        """The router output ``out`` as logits: itself, or, where it holds probabilities (see the
        module docstring), their log for a softmax-family rule; other rules are refused."""
        if not looks_like_probabilities(out, out.dtype):
            return out
        if spec.rule not in SOFTMAX_RULES:
            raise RuntimeError(
                f"router {spec.name} returns probabilities (rows >= 0 summing to 1) where its logits "
                f"are expected, and its scoring rule {spec.rule!r} cannot be recovered from them; "
                "upgrade transformers to >= 5.6.0 (earlier 5.x releases return probabilities as "
                "router_logits) or make the router return its logits"
            )
        if spec.name not in self._warned:
            self._warned.add(spec.name)
            warnings.warn(
                f"router {spec.name} returns probabilities as its logits (transformers < 5.6.0 does "
                "this); they are read as probabilities, not softmaxed again",
                stacklevel=3,
            )
        return torch.log(out.float().clamp(min=torch.finfo(torch.float32).tiny))

    def _router_hook(self, i: int, spec: RouterSpec):
        score, rule, router = self.score, spec.rule, spec.router

        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            self._require_batch()
            with torch.no_grad():
                logits = None
                if not spec.from_input:
                    out = output
                    if isinstance(output, (tuple, list)) and spec.logits_index is not None:
                        out = output[spec.logits_index]
                    if isinstance(out, torch.Tensor) and out.shape[-1] == spec.n_experts:
                        logits = self._as_logits(spec, out)
                if logits is None:  # top-k-only outputs and pattern routers: recompute from the input
                    x = _first_tensor(args, kwargs)
                    weight, bias = _projection(module, spec.n_experts)
                    logits = nn.functional.linear(x.to(weight.dtype), weight, bias)
                logits = self._as_btx(logits.detach().float(), spec.name)
                if logits.shape[-1] != spec.n_experts:
                    raise RuntimeError(
                        f"{spec.name}: expected {spec.n_experts} router logits per token, got {logits.shape[-1]}"
                    )
                if self._rw[i] is not None:
                    raise RuntimeError(
                        f"router {spec.name} ran twice in one forward pass; call set_batch() before each forward"
                    )
                bias = (
                    selection_bias(router, args, kwargs)
                    if score == "selection" or self.pooling == "tokens"
                    else None
                )
                if self.pooling == "tokens":
                    self._rw[i] = apply_score(logits, score, rule, router, bias)
                    if spec.top_k is not None:  # the fallback where the router returns no selection
                        ranked = selection_scores(logits, rule, router, bias)
                        self._derived[i] = ranked.topk(spec.top_k, dim=-1).indices
                elif self.pooling == "last":
                    self._rw[i] = apply_score(self._pool(logits), score, rule, router, bias)
                else:
                    self._rw[i] = self._pool(apply_score(logits, score, rule, router, bias))

        return hook

    def _selection_hook(self, i: int, spec: RouterSpec):
        """Keep the router's own top-k indices ``[B, T, k]`` from its output (tokens pooling)."""

        def hook(module: nn.Module, args: tuple, output) -> None:
            self._require_batch()
            read = read_selection(spec, output)
            if read is not None:
                self._returned[i] = self._as_btx(read[0].detach(), f"{spec.name} selection")

        return hook

    def _final_hook(self, module: nn.Module, args: tuple, output) -> None:
        self._require_batch()
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(hidden, torch.Tensor):
            raise RuntimeError(f"{type(module).__name__} returned no last_hidden_state tensor")
        with torch.no_grad():
            self._hs = self._pool(self._as_btx(hidden.detach().float(), "last_hidden_state"))

    def _layer_hook(self, j: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self._require_batch()
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            with torch.no_grad():
                self._hs_layers[j] = self._pool(self._as_btx(hidden.detach().float(), f"decoder layer {j}"))

        return hook

    # ---------------------------------------------------------------- results
    def _check_complete(self) -> None:
        missing = [self.routers[i].name for i, t in enumerate(self._rw) if t is None]
        if missing:
            raise RuntimeError(
                f"no routing was recorded for {len(missing)} router(s) ({missing[0]} ...): "
                "run the forward pass inside the `with` block after set_batch()"
            )

    def pooled_rw(self) -> torch.Tensor:
        """``[B, n_moe_layers, n_experts]`` float32 on the CPU, layers in model order."""
        if self.pooling == "tokens":
            raise RuntimeError('pooling="tokens" records token routes; use token_rw()')
        self._check_complete()
        return torch.stack([t.cpu() for t in self._rw], dim=1)

    def token_rw(self) -> torch.Tensor:
        """``[B, T, n_moe_layers, n_experts]`` float32 on the CPU (``pooling="tokens"`` only)."""
        if self.pooling != "tokens":
            raise RuntimeError('token_rw() needs pooling="tokens"')
        self._check_complete()
        return torch.stack([t.cpu() for t in self._rw], dim=2)

    @property
    def selection_returned(self) -> list[bool]:
        """Per MoE layer, whether :meth:`token_selection` holds the indices the router itself returned
        (``True``) or the top-k of the ``selection`` score, re-derived because it returned none."""
        return [t is not None for t in self._returned]

    def token_selection(self) -> torch.Tensor | None:
        """``[B, T, n_moe_layers, k]`` long on the CPU: the experts each router selected for each token
        (``pooling="tokens"`` only), in the router's own order. The router's returned indices where it
        returns them (:attr:`selection_returned`), else the top-k of the ``selection`` score; ``None``
        when a router neither returns a selection nor declares its ``k``. Layers with fewer than the
        largest ``k`` are padded with -1. Padded positions hold whatever the router chose for them."""
        if self.pooling != "tokens":
            raise RuntimeError('token_selection() needs pooling="tokens"')
        self._check_complete()
        chosen = [r if r is not None else d for r, d in zip(self._returned, self._derived, strict=True)]
        if any(t is None for t in chosen):
            return None
        width = max(t.shape[-1] for t in chosen)
        padded = [torch.nn.functional.pad(t.cpu().long(), (0, width - t.shape[-1]), value=-1) for t in chosen]
        return torch.stack(padded, dim=2)

    def pooled_hs(self) -> torch.Tensor:
        """``[B, hidden]`` float32 on the CPU: the final-norm hidden state, pooled."""
        if self._hs is None:
            raise RuntimeError("no hidden state recorded: run the forward pass inside the `with` block")
        return self._hs.cpu()

    def pooled_hs_all_layers(self) -> torch.Tensor:
        """``[B, n_layers, hidden]`` float32: each decoder layer's output, pooled (``hs_layers=True``)."""
        if not self.hs_layers:
            raise RuntimeError("pooled_hs_all_layers() needs RoutingRecorder(..., hs_layers=True)")
        if any(t is None for t in self._hs_layers):
            raise RuntimeError(
                "no per-layer hidden states recorded: run the forward pass inside the `with` block"
            )
        return torch.stack([t.cpu() for t in self._hs_layers], dim=1)

    def kept_bytes(self) -> int:
        """Bytes of the tensors the recorder currently keeps (what the capture-memory benchmark reports)."""
        kept = [
            t
            for t in (*self._rw, *self._returned, *self._derived, self._hs, *self._hs_layers)
            if t is not None
        ]
        return sum(t.numel() * t.element_size() for t in kept)
