"""The oracle check behind ``supported_architectures()``: hooks vs the model's own router outputs.

For one architecture, a tiny random model runs **one** forward on a padded batch with both the
recorder's hooks and transformers' ``output_router_logits=True``. For every router, the
distribution the recorder pooled inside its hook must equal the one computed independently
here from the model's own ``router_logits`` output (rows of the last real token, or the masked
mean over real tokens), for each score in ``SCORES`` and both padding sides. The number of
captured layers must equal the number of router outputs the model returns (dense layers skipped),
and dense + MoE layers must add up to the decoder depth. Finally the scoring rules are checked
independently against what every MoE block actually dispatches (:func:`_check_dispatch`): the
recorded selection and the top-k of the ``selection`` score are the experts the block runs, and the
weights it gives them are proportional to the native scores, for every architecture (none skipped).

Shared by ``tests/test_capture_architectures.py`` and ``scripts/support_table.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moee.capture.architectures import ROUTER_CLASSES
from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import SCORES, apply_score, find_routers, router_report, selection_bias
from moee.capture.tiny import tiny_model

__all__ = ["OracleResult", "check_architecture", "check_model", "padded_batch"]

#: Router classes whose output holds probabilities rather than logits.
_OUTPUT_IS_PROBS = tuple(name for name, rc in ROUTER_CLASSES.items() if rc.logits_child is not None)


@dataclass
class OracleResult:
    model_type: str
    model_class: str
    router_class: str
    rule: str
    n_layers: int
    moe_layers: int
    dense_layers: list[int]
    attention_routers: int
    hash_routers: int
    n_experts: int
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    native_weight_spread: float | None = None
    selection_agreement: float | None = None
    #: share of tokens whose top-k differs from the dispatch only by a tie at the dtype's rounding
    selection_ties: float | None = None
    selection_returned: bool | None = None

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff.values()) if self.max_abs_diff else float("nan")


def padded_batch(lengths: list[int], vocab_size: int, side: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids (avoiding ids 0-3) padded on ``side`` with explicit position ids."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        seq = torch.randint(4, vocab_size, (n,), generator=gen)
        span = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, span] = seq
        mask[row, span] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def _reference(values: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool ``[B, T, E]`` with plain Python loops (deliberately not the recorder's code)."""
    rows = []
    for b in range(values.shape[0]):
        real = [t for t in range(values.shape[1]) if bool(mask[b, t])]
        rows.append(values[b, real[-1]] if pooling == "last" else values[b, real].mean(dim=0))
    return torch.stack(rows)


#: Router classes whose block weights each selected expert by a learned per-expert factor on top of
#: the routing scores (Gemma-4: ``top_k_weights * per_expert_scale[top_k_index]``); divided out.
_PER_EXPERT_SCALE = {name: rc.per_expert_scale for name, rc in ROUTER_CLASSES.items() if rc.per_expert_scale}


def _block_of(model: torch.nn.Module, spec) -> torch.nn.Module | None:
    """The MoE block holding ``spec``'s router: the nearest ancestor with an ``experts`` child."""
    modules = dict(model.named_modules())
    parts = spec.name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        block = modules.get(".".join(parts[:cut]))
        if block is not None and isinstance(getattr(block, "experts", None), torch.nn.Module):
            return block
    return None


def _dispatch_from_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(indices [N, k], weights [N, k])`` passed to an experts module, if its call carries them."""
    values = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    index = next((v for v in values if not v.is_floating_point() and v.dim() == 2), None)
    if index is None:
        return None
    weights = next((v for v in values if v.is_floating_point() and v.shape == index.shape), None)
    return (index, weights) if weights is not None else None


def _dispatch_from_router(router: torch.nn.Module, out) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the two blocks whose experts get no index tensor, the dispatch as the block uses it, decoded
    here independently of :func:`moee.capture.registry.read_selection`: Llama-4 multiplies each
    expert's input by the router's scattered scores (the selected experts are where they are
    nonzero); JetMoE scatters each expert's output to the tokens ``batch_index`` lists."""
    name = type(router).__name__
    if name == "Llama4Router":
        scores = out[0]
        chosen = scores > 0
        k = int(chosen.sum(dim=-1).max())
        index = torch.where(chosen, torch.arange(scores.shape[-1]).expand_as(scores), scores.shape[-1])
        index = index.sort(dim=-1).values[:, :k]
        return index, scores.gather(-1, index.clamp(max=scores.shape[-1] - 1))
    if name == "JetMoeTopKGating":
        _, batch_index, gates, expert_size, logits = out
        n_tokens = logits.shape[0]
        k = batch_index.numel() // n_tokens
        experts = torch.repeat_interleave(torch.arange(len(expert_size)), torch.as_tensor(expert_size))
        order = batch_index.argsort(stable=True)  # each token's k assignments, in expert order
        return experts[order].reshape(n_tokens, k), gates[order].reshape(n_tokens, k)
    return None


def _sorted_sets(index: torch.Tensor) -> torch.Tensor:
    return index.sort(dim=-1).values


def selection_agreement(
    scores: torch.Tensor, index: torch.Tensor, rel_tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (rows of ``scores`` [tokens, experts]), whether the top-k of ``scores`` is the
    dispatched set ``index`` [tokens, k], and, where it is not, whether the two sets hold the same k
    values within ``rel_tol`` of the token's largest score: a tie the block broke its own way (in
    bf16 many scores round to the same value), not a different choice."""
    k = index.shape[-1]
    top = scores.topk(k, dim=-1)
    same = (_sorted_sets(top.indices) == _sorted_sets(index)).all(dim=-1)
    chosen = scores.gather(-1, index).sort(dim=-1, descending=True).values
    tol = rel_tol * scores.abs().amax(dim=-1)
    return same, ~same & ((top.values - chosen).abs().amax(dim=-1) <= tol)


def _check_dispatch(
    model: torch.nn.Module, used: list, vocab: int, model_type: str, spread_tol: float = 1e-4
) -> tuple[float, float, float, list[bool]]:
    """Independent checks of the scoring rules against what each MoE block actually dispatches.

    One forward on a padded batch records, per router, the experts and weights the block computes
    with: the ``(indices, weights)`` its experts module is called with, or for Llama-4 and JetMoE
    (whose experts get none) the router output the block uses, decoded by
    :func:`_dispatch_from_router`. Then, on every real token:

    * the selection the recorder keeps (:meth:`RoutingRecorder.token_selection`) is that dispatch;
    * the top-k of the ``selection`` score is that dispatch;
    * the dispatch weights are proportional to the captured native scores of the selected experts
      (``weights / native[index]`` the same for all selected experts of a token, up to
      renormalisation and scaling; PhiMoE: the top expert's weight equals its native score).

    Returns ``(worst relative spread of the native check, fraction of real tokens where the top-k of
    the selection score equals the dispatch, fraction where it differs only by a tie within
    ``spread_tol`` of the token's largest score (bf16 rounding), per router whether the recorded selection is the one the
    router returned)``; raises ``AssertionError`` if any check fails or
    finds nothing to compare.
    """
    batch = padded_batch([6, 4, 5], vocab, "left", seed=5)
    mask = batch["attention_mask"].bool()
    n_rows, width = mask.shape
    dispatch: dict[int, tuple] = {}
    handles = []
    for i, spec in enumerate(used):
        block = _block_of(model, spec)

        def on_experts(module, args, kwargs, i=i):
            found = _dispatch_from_call(args, kwargs)
            if found is not None:
                dispatch.setdefault(i, found)

        def on_router(module, args, out, i=i):
            found = _dispatch_from_router(module, out)
            if found is not None:
                dispatch[i] = found

        if block is not None:
            handles.append(block.experts.register_forward_pre_hook(on_experts, with_kwargs=True))
        handles.append(spec.router.register_forward_hook(on_router))
    try:
        with RoutingRecorder(model, used, pooling="tokens", score="native") as rec, torch.no_grad():
            rec.set_batch(batch["attention_mask"])
            model(**batch, use_cache=False)
        with RoutingRecorder(model, used, pooling="tokens", score="selection") as sel, torch.no_grad():
            sel.set_batch(batch["attention_mask"])
            model(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(dispatch) == list(range(len(used))), f"{model_type}: no dispatch seen for some MoE blocks"
    native, ranked, recorded = rec.token_rw(), sel.token_rw(), rec.token_selection()
    assert recorded is not None, f"{model_type}: no token selection recorded"
    worst, agree, ties = 0.0, [], []
    for i, spec in enumerate(used):
        index, weights = dispatch[i]
        k = index.shape[-1]
        index = index.reshape(n_rows, width, k)[mask].long()
        weights = weights.detach().float().reshape(n_rows, width, k)[mask]
        expected = _sorted_sets(index)
        assert torch.equal(_sorted_sets(recorded[:, :, i, :k][mask]), expected), (
            f"{model_type} {spec.name}: recorded selection differs from the block's dispatch"
        )
        same, tie = selection_agreement(ranked[:, :, i][mask], index, spread_tol)
        agree.append(same.float())
        ties.append(tie.float())
        picked = native[:, :, i][mask].gather(-1, index)
        scale_name = _PER_EXPERT_SCALE.get(type(spec.router).__name__)
        if scale_name is not None:
            weights = weights / getattr(spec.router, scale_name).detach().float()[index]
        if spec.rule == "sparsemixer":  # the top expert's weight is its native score itself
            diff = float((weights[:, 0] - picked[:, 0]).abs().max())
            assert diff <= 1e-5, f"{model_type} {spec.name}: sparsemixer weight mismatch ({diff:.2g})"
            worst = max(worst, diff)
            continue
        keep = (picked > 1e-6).all(dim=-1) & (weights > 0).all(dim=-1)
        assert bool(keep.any()), f"{model_type} {spec.name}: no token with comparable weights"
        ratio = weights[keep] / picked[keep]
        spread = float(
            ((ratio.max(dim=-1).values - ratio.min(dim=-1).values) / ratio.abs().max(dim=-1).values).max()
        )
        assert spread <= spread_tol, (
            f"{model_type} {spec.name}: native scores disagree with the block's weights ({spread:.2g})"
        )
        worst = max(worst, spread)
    agreement, tied = float(torch.cat(agree).mean()), float(torch.cat(ties).mean())
    assert bool((torch.cat(agree) + torch.cat(ties)).all()), (
        f"{model_type}: top-k of the selection score matches on {agreement:.1%} of tokens"
        + (f" and ties on {tied:.1%}" if tied else "")
    )
    return worst, agreement, tied, rec.selection_returned


def check_architecture(
    model_type: str, *, lengths: tuple[int, ...] = (7, 3, 5), atol: float = 1e-5, **config_kwargs
) -> OracleResult:
    """Run the oracle check for ``model_type`` on a tiny random model; raises ``AssertionError`` on
    any mismatch."""
    return check_model(tiny_model(model_type, **config_kwargs), model_type, lengths=lengths, atol=atol)


class _RouterCalls:
    """Which declared router produced which entry of the model's ``router_logits`` tuple, and each
    router's selection-only bias, from its call (forward hooks on every declared router while in
    the ``with``)."""

    def __init__(self, declared: list) -> None:
        self.declared = declared
        self.order: list[int] = []
        self.biases: dict[int, torch.Tensor | None] = {}
        self.index_of = {spec.name: i for i, spec in enumerate(declared)}
        self._handles: list = []

    def __enter__(self) -> _RouterCalls:
        self._handles = [
            spec.router.register_forward_hook(lambda *a, i=i: self._on_call(*a, i), with_kwargs=True)
            for i, spec in enumerate(self.declared)
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_call(self, module, args, kwargs, out, i) -> None:
        self.order.append(i)
        self.biases[i] = selection_bias(module, args, kwargs)

    def bias(self, spec) -> torch.Tensor | None:
        return self.biases[self.index_of[spec.name]]


def _captured_and_outputs(
    model: torch.nn.Module,
    used: list,
    calls: _RouterCalls,
    batch: dict,
    pooling: str,
    score: str,
    model_type: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward with both the recorder's hooks and ``output_router_logits``: the pooled scores the
    recorder captured ``[B, L, E]``, and the model's own router output of each declared router by
    name (each router must have run exactly once)."""
    calls.order.clear()
    with RoutingRecorder(model, used, pooling=pooling, score=score) as rec, torch.no_grad():
        rec.set_batch(batch["attention_mask"])
        out = model(**batch, output_router_logits=True, use_cache=False)
        captured = rec.pooled_rw()
    ref_outputs = out.router_logits
    assert len(ref_outputs) == len(calls.order), (
        f"{model_type}: {len(ref_outputs)} router outputs for {len(calls.order)} router calls"
    )
    by_name = {calls.declared[i].name: ref_outputs[k] for k, i in enumerate(calls.order)}
    assert len(by_name) == len(calls.declared), f"{model_type}: a router ran more than once"
    n_texts = batch["input_ids"].shape[0]
    assert captured.shape == (n_texts, len(used), used[0].n_experts), captured.shape
    return captured, by_name


def _expected(spec, output: torch.Tensor, bias, batch: dict, pooling: str, score: str) -> torch.Tensor | None:
    """What the recorder should have pooled for one router, computed here from the model's own router
    ``output``; ``None`` where the router outputs probabilities and ``score`` asks for logits (the
    model outputs none to compare with)."""
    ref = output.detach().float().reshape(*batch["input_ids"].shape, -1)
    if type(spec.router).__name__ in _OUTPUT_IS_PROBS:
        if score == "logits":
            return None
        ref_scores = (
            ref if score == "softmax" else apply_score(ref.log(), score, spec.rule, spec.router, bias)
        )
    else:
        ref_scores = apply_score(ref, score, spec.rule, spec.router, bias)
    return _reference(ref_scores, batch["attention_mask"], pooling)


def check_model(
    model: torch.nn.Module,
    model_type: str | None = None,
    *,
    lengths: tuple[int, ...] = (7, 3, 5),
    atol: float = 1e-5,
    spread_tol: float = 1e-4,
) -> OracleResult:
    """The oracle check on a loaded ``model`` (any size and dtype: the real-width rehearsal runs it
    in bfloat16, where the block's weights are rounded to 16 bits, so ``spread_tol``, the relative
    spread of the dispatch weights over the native scores, must allow bfloat16's 2**-8)."""
    model_type = model_type or model.config.model_type
    vocab = model.config.get_text_config().vocab_size
    used = find_routers(model)
    declared = [r for r in find_routers(model, include_attention=True) if r.kind != "hash"]
    report = router_report(model)
    diffs: dict[str, float] = {}
    with _RouterCalls(declared) as calls:
        for side in ("left", "right"):
            batch = padded_batch(list(lengths), vocab, side)
            for pooling in ("last", "mean"):
                for score in SCORES:
                    captured, by_name = _captured_and_outputs(
                        model, used, calls, batch, pooling, score, model_type
                    )
                    key = f"{side}/{pooling}/{score}"
                    for layer, spec in enumerate(used):
                        expected = _expected(
                            spec, by_name[spec.name], calls.bias(spec), batch, pooling, score
                        )
                        if expected is None:
                            continue
                        diff = float((captured[:, layer] - expected).abs().max())
                        diffs[key] = max(diffs.get(key, 0.0), diff)
                        assert diff <= atol, f"{model_type} {spec.name} {key}: max abs diff {diff:.3g}"
                        if score == "softmax":
                            sums = captured[:, layer].sum(dim=-1)
                            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), sums
    moe_layer_ids = {r.layer_index for r in find_routers(model, include_hash=True)}
    assert report["n_layers"] == len(report["dense_layers"]) + len(moe_layer_ids), report
    native_spread, selection_agreement, ties, returned = _check_dispatch(
        model, used, vocab, model_type, spread_tol
    )
    return OracleResult(
        model_type=model_type,
        model_class=type(model).__name__,
        router_class=type(used[0].router).__name__,
        rule=used[0].rule,
        n_layers=report["n_layers"],
        moe_layers=len(used),
        dense_layers=report["dense_layers"],
        attention_routers=len(report["attention_routers"]),
        hash_routers=len(report["hash_routers"]),
        n_experts=used[0].n_experts,
        max_abs_diff=diffs,
        native_weight_spread=native_spread,
        selection_agreement=selection_agreement,
        selection_ties=ties,
        selection_returned=all(returned),
    )
