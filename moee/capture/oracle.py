"""The oracle check behind ``supported_architectures()``: hooks vs the model's own router outputs.

For one architecture, a tiny random model runs **one** forward on a padded batch with both the
recorder's hooks and transformers' ``output_router_logits=True``. For every router, the
distribution the recorder pooled inside its hook must equal the one computed independently
here from the model's own ``router_logits`` output (rows of the last real token, or the masked
mean over real tokens), for each score (``softmax``, ``native``, ``logits``) and both padding
sides. The number of captured layers must equal the number of router outputs the model returns
(dense layers skipped), and dense + MoE layers must add up to the decoder depth. Finally the native
rule is checked against the router's own top-k weights where the router returns them
(:func:`_check_native_weights`).

Shared by ``tests/test_capture_architectures.py`` and ``scripts/support_table.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import apply_score, find_routers, router_report
from moee.capture.tiny import tiny_model

__all__ = ["OracleResult", "check_architecture", "padded_batch"]

#: Model outputs that hold probabilities rather than logits (router class name).
_OUTPUT_IS_PROBS = ("Gemma4TextRouter",)


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


def _check_native_weights(model: torch.nn.Module, used: list, vocab: int, model_type: str) -> float | None:
    """Independent check of the native rule against the router's own routing weights.

    Routers that return ``(logits, top_k_weights, top_k_index, ...)`` weight their selected experts by
    the native scores, possibly renormalised or scaled: so ``weights / native[index]`` must be the same
    for every selected expert of a token. Returns the worst relative spread, or ``None`` when the
    router's output has no such structure (e.g. DBRX returns logits only, Llama-4 its own pair).
    """
    seen: dict[int, tuple] = {}
    handles = [
        spec.router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out))
        for i, spec in enumerate(used)
    ]
    try:
        with torch.no_grad():
            model(**padded_batch([6, 4], vocab, "left", seed=5), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    worst = None
    for i, spec in enumerate(used):
        out = seen.get(i)
        if not (isinstance(out, tuple) and len(out) >= 3 and spec.logits_index == 0):
            continue
        logits, weights, index = out[0], out[1], out[2]
        if not (
            isinstance(index, torch.Tensor)
            and not index.is_floating_point()
            and weights.shape == index.shape
            and logits.shape[-1] == spec.n_experts
        ):
            continue
        native = apply_score(logits.float().reshape(-1, spec.n_experts), "native", spec.rule, spec.router)
        picked = native.gather(-1, index.reshape(native.shape[0], -1))
        if spec.rule == "sparsemixer":  # the top expert's weight is the native score itself
            diff = float((weights.float().reshape(picked.shape)[:, 0] - picked[:, 0]).abs().max())
            assert diff <= 1e-5, f"{model_type} {spec.name}: sparsemixer weight mismatch ({diff:.2g})"
            worst = diff if worst is None else max(worst, diff)
            continue
        ratio = weights.float().reshape(picked.shape) / picked
        keep = (picked > 1e-6).all(dim=-1) & (weights.float().reshape(picked.shape) > 0).all(dim=-1)
        if not bool(keep.any()):
            continue
        ratio = ratio[keep]
        spread = float(
            ((ratio.max(dim=-1).values - ratio.min(dim=-1).values) / ratio.abs().max(dim=-1).values).max()
        )
        assert spread <= 1e-4, (
            f"{model_type} {spec.name}: native scores disagree with the router's weights ({spread:.2g})"
        )
        worst = spread if worst is None else max(worst, spread)
    return worst


def check_architecture(
    model_type: str, *, lengths: tuple[int, ...] = (7, 3, 5), atol: float = 1e-5, **config_kwargs
) -> OracleResult:
    """Run the oracle check for ``model_type``; raises ``AssertionError`` on any mismatch."""
    model = tiny_model(model_type, **config_kwargs)
    vocab = model.config.get_text_config().vocab_size
    used = find_routers(model)
    declared = [r for r in find_routers(model, include_attention=True) if r.kind != "hash"]
    report = router_report(model)
    diffs: dict[str, float] = {}

    # Which declared router produced which entry of the model's router_logits tuple.
    call_order: list[int] = []
    handles = [
        spec.router.register_forward_hook(lambda *_, i=i: call_order.append(i))
        for i, spec in enumerate(declared)
    ]
    try:
        for side in ("left", "right"):
            batch = padded_batch(list(lengths), vocab, side)
            for pooling in ("last", "mean"):
                for score in ("softmax", "native", "logits"):
                    call_order.clear()
                    with RoutingRecorder(model, used, pooling=pooling, score=score) as rec, torch.no_grad():
                        rec.set_batch(batch["attention_mask"])
                        out = model(**batch, output_router_logits=True, use_cache=False)
                        captured = rec.pooled_rw()
                    ref_outputs = out.router_logits
                    assert len(ref_outputs) == len(call_order), (
                        f"{model_type}: {len(ref_outputs)} router outputs for {len(call_order)} router calls"
                    )
                    by_name = {declared[i].name: ref_outputs[k] for k, i in enumerate(call_order)}
                    assert len(by_name) == len(declared), f"{model_type}: a router ran more than once"
                    assert captured.shape == (len(lengths), len(used), used[0].n_experts), captured.shape
                    for layer, spec in enumerate(used):
                        ref = (
                            by_name[spec.name]
                            .detach()
                            .float()
                            .reshape(len(lengths), batch["input_ids"].shape[1], -1)
                        )
                        if type(spec.router).__name__ in _OUTPUT_IS_PROBS:
                            if score == "logits":  # the model outputs no logits to compare with
                                continue
                            ref_scores = (
                                ref
                                if score == "softmax"
                                else apply_score(ref.log(), score, spec.rule, spec.router)
                            )
                        else:
                            ref_scores = apply_score(ref, score, spec.rule, spec.router)
                        expected = _reference(ref_scores, batch["attention_mask"], pooling)
                        diff = float((captured[:, layer] - expected).abs().max())
                        key = f"{side}/{pooling}/{score}"
                        diffs[key] = max(diffs.get(key, 0.0), diff)
                        assert diff <= atol, f"{model_type} {spec.name} {key}: max abs diff {diff:.3g}"
                        if score == "softmax":
                            sums = captured[:, layer].sum(dim=-1)
                            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), sums
    finally:
        for handle in handles:
            handle.remove()
    moe_layer_ids = {r.layer_index for r in find_routers(model, include_hash=True)}
    assert report["n_layers"] == len(report["dense_layers"]) + len(moe_layer_ids), report
    native_spread = _check_native_weights(model, used, vocab, model_type)
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
    )
