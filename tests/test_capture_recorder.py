"""RoutingRecorder: pooling inside hooks, padding sides, memory, hook removal, the pattern fallback."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from moee.capture import RoutingRecorder, find_routers, find_routers_by_pattern
from moee.capture.oracle import padded_batch
from moee.capture.recorder import DEFAULT_SCORE, _first_tensor, _projection
from moee.capture.registry import RouterSpec, apply_score, selection_bias
from moee.capture.tiny import tiny_model


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _run(model, batch, **kwargs):
    with RoutingRecorder(model, **kwargs) as rec, torch.no_grad():
        rec.set_batch(batch["attention_mask"])
        model(**batch, use_cache=False)
        return rec


def test_hooks_removed_after_normal_exit(tiny_olmoe):
    before = _hook_count(tiny_olmoe)
    rec = _run(tiny_olmoe, padded_batch([4, 2], 100, "left"))
    assert not rec.active and _hook_count(tiny_olmoe) == before
    assert rec.pooled_rw().shape == (2, 2, 8)


def test_hooks_removed_when_forward_raises(tiny_olmoe):
    before = _hook_count(tiny_olmoe)
    router = find_routers(tiny_olmoe)[1].module

    def boom(*_):
        raise RuntimeError("boom inside the forward")

    handle = router.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with RoutingRecorder(tiny_olmoe) as rec, torch.no_grad():
                assert _hook_count(tiny_olmoe) > before + 1
                batch = padded_batch([3], 100, "left")
                rec.set_batch(batch["attention_mask"])
                tiny_olmoe(**batch)
    finally:
        handle.remove()
    assert _hook_count(tiny_olmoe) == before


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_left_and_right_padding_agree(tiny_olmoe, pooling):
    lengths = [6, 2, 4]
    left = _run(tiny_olmoe, padded_batch(lengths, 100, "left", seed=3), pooling=pooling)
    right = _run(tiny_olmoe, padded_batch(lengths, 100, "right", seed=3), pooling=pooling)
    assert torch.allclose(left.pooled_rw(), right.pooled_rw(), atol=1e-5)
    assert torch.allclose(left.pooled_hs(), right.pooled_hs(), atol=1e-5)


def test_tokens_pooling_agrees_with_last_and_mean(tiny_olmoe):
    batch = padded_batch([5, 3], 100, "left", seed=1)
    tokens = _run(tiny_olmoe, batch, pooling="tokens").token_rw()  # [B, T, L, E]
    last = _run(tiny_olmoe, batch, pooling="last").pooled_rw()
    mean = _run(tiny_olmoe, batch, pooling="mean").pooled_rw()
    assert tokens.shape == (2, 5, 2, 8)
    assert torch.allclose(tokens[:, -1], last, atol=1e-6)  # left padding: last real token is the last column
    assert torch.allclose(tokens[1, 2:].mean(dim=0), mean[1], atol=1e-6)
    assert torch.allclose(tokens[0].mean(dim=0), mean[0], atol=1e-6)


def test_scores(tiny_olmoe):
    batch = padded_batch([4, 6], 100, "left", seed=2)
    logits = _run(tiny_olmoe, batch, score="logits").pooled_rw()
    soft = _run(tiny_olmoe, batch, score="softmax").pooled_rw()
    native = _run(tiny_olmoe, batch, score="native").pooled_rw()
    assert torch.allclose(torch.softmax(logits, dim=-1), soft, atol=1e-6)
    assert torch.allclose(soft, native)  # OLMoE's native rule is softmax
    assert torch.allclose(soft.sum(-1), torch.ones(2, 2), atol=1e-5)


def test_hidden_state_is_the_final_norm_output(tiny_olmoe):
    batch = padded_batch([5, 3], 100, "right", seed=4)
    rec = _run(tiny_olmoe, batch, hs_layers=True)
    with torch.no_grad():
        out = tiny_olmoe(**batch, output_hidden_states=True, use_cache=False)
    last = torch.stack([out.hidden_states[-1][0, 4], out.hidden_states[-1][1, 2]])
    assert torch.allclose(rec.pooled_hs(), last, atol=1e-6)
    per_layer = rec.pooled_hs_all_layers()
    assert per_layer.shape == (2, 2, 64)
    # decoder layer outputs are hidden_states[1:] (the last one before the final norm)
    layer0 = torch.stack([out.hidden_states[1][0, 4], out.hidden_states[1][1, 2]])
    assert torch.allclose(per_layer[:, 0], layer0, atol=1e-6)


def test_kept_memory_does_not_grow_with_length(tiny_olmoe):
    sizes = []
    for length in (8, 64, 256):
        rec = _run(tiny_olmoe, padded_batch([length, length // 2], 100, "left"), hs_layers=True)
        sizes.append(rec.kept_bytes())
    assert sizes[0] == sizes[1] == sizes[2] == 4 * 2 * (2 * 8 + 64 + 2 * 64)


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_set_batch_is_required_and_validated(tiny_olmoe):
    with RoutingRecorder(tiny_olmoe) as rec:
        with pytest.raises(
            RuntimeError, match=_exact("call recorder.set_batch(attention_mask) before the forward pass")
        ):
            with torch.no_grad():
                tiny_olmoe(torch.randint(4, 100, (1, 3)))
        with pytest.raises(
            ValueError,
            match=_exact("every sequence needs at least one real token (attention_mask row of zeros)"),
        ):
            rec.set_batch(torch.tensor([[1, 1], [0, 0]]))
        with pytest.raises(ValueError, match=_exact("attention_mask must be a [batch, seq_len] tensor")):
            rec.set_batch(torch.ones(3))
    with pytest.raises(
        ValueError, match=_exact("unknown pooling 'max'; expected one of: last, mean, tokens")
    ):
        RoutingRecorder(tiny_olmoe, pooling="max")
    with pytest.raises(
        ValueError, match=_exact("unknown score 'probs'; expected one of: native, softmax, selection, logits")
    ):
        RoutingRecorder(tiny_olmoe, score="probs")
    with pytest.raises(ValueError, match=_exact("no MoE router found in OlmoeForCausalLM")):
        RoutingRecorder(tiny_olmoe, routers=[])
    flat = nn.ModuleDict({"moe": _CustomMoE()})  # a router but no decoder-layer stack
    with pytest.raises(
        ValueError, match=_exact("cannot find the decoder layers of ModuleDict for hs_layers=True")
    ):
        RoutingRecorder(flat, routers=find_routers_by_pattern(flat), hs_layers=True)


def test_results_before_forward_raise(tiny_olmoe):
    with RoutingRecorder(tiny_olmoe) as rec:
        rec.set_batch(torch.ones(1, 2, dtype=torch.long))
        names = [r.name for r in find_routers(tiny_olmoe)]
        with pytest.raises(
            RuntimeError,
            match=_exact(
                f"no routing was recorded for 2 router(s) ({names[0]} ...): "
                "run the forward pass inside the `with` block after set_batch()"
            ),
        ):
            rec.pooled_rw()
        with pytest.raises(RuntimeError, match=_exact('token_rw() needs pooling="tokens"')):
            rec.token_rw()
        with pytest.raises(
            RuntimeError,
            match=_exact("no hidden state recorded: run the forward pass inside the `with` block"),
        ):
            rec.pooled_hs()
        with pytest.raises(
            RuntimeError, match=_exact("pooled_hs_all_layers() needs RoutingRecorder(..., hs_layers=True)")
        ):
            rec.pooled_hs_all_layers()
    with RoutingRecorder(tiny_olmoe, hs_layers=True) as rec:
        rec.set_batch(torch.ones(1, 2, dtype=torch.long))
        with pytest.raises(
            RuntimeError,
            match=_exact("no per-layer hidden states recorded: run the forward pass inside the `with` block"),
        ):
            rec.pooled_hs_all_layers()
    rec = _run(tiny_olmoe, padded_batch([3], 100, "left"), pooling="tokens")
    with pytest.raises(RuntimeError, match=_exact('pooling="tokens" records token routes; use token_rw()')):
        rec.pooled_rw()


def test_recorder_attributes_and_given_routers(tiny_olmoe):
    routers = find_routers(tiny_olmoe)
    rec = RoutingRecorder(tiny_olmoe, routers[1:])
    assert rec.model is tiny_olmoe and rec.layers == [routers[1].name] and rec.score == DEFAULT_SCORE
    assert not rec.hs_layers
    before = _hook_count(tiny_olmoe)
    with rec:
        assert (
            _hook_count(tiny_olmoe) == before + 2
        )  # one router + the final hidden state; no layer hooks by default
        rec.set_batch(torch.ones(2, 3, dtype=torch.long))
        with torch.no_grad():
            tiny_olmoe(torch.randint(4, 100, (2, 3)), use_cache=False)
    assert rec.pooled_rw().shape == (2, 1, 8)
    assert rec.kept_bytes() == 4 * 2 * (8 + 64)


# ------------------------------------------------------------------ pattern fallback
class _Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d, 2 * d)
        self.down_proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


class _CustomMoE(nn.Module):
    """deepseek-moe style custom block: `gate` returns (indices, weights, aux), not logits."""

    class Gate(nn.Module):
        def __init__(self, d: int, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n, d))

        def forward(self, x):
            scores = torch.softmax(x.reshape(-1, x.shape[-1]) @ self.weight.T, dim=-1)
            weights, idx = scores.topk(2, dim=-1)
            return idx, weights, None

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.gate = self.Gate(d, n)
        self.experts = nn.ModuleList(_Expert(d) for _ in range(n))
        self.shared_expert_gate = nn.Linear(d, 1)
        self.shared_expert = _Expert(d)

    def forward(self, x):
        idx, weights, _ = self.gate(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.zeros_like(flat)
        for slot in range(idx.shape[1]):
            for e, expert in enumerate(self.experts):
                rows = idx[:, slot] == e
                if rows.any():
                    out[rows] += weights[rows, slot, None] * expert(flat[rows])
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (out + shared).reshape(x.shape)


class _CustomLM(nn.Module):
    def __init__(self, d: int = 16, moe: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(
            [_CustomMoE(d) if moe else _Expert(d), _CustomMoE(d) if moe else _Expert(d)]
        )

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_pattern_fallback_finds_custom_routers_and_skips_shared_gate():
    torch.manual_seed(0)
    model = _CustomLM()
    routers = find_routers_by_pattern(model)
    assert [r.name for r in routers] == ["layers.0.gate", "layers.1.gate"]
    assert all(r.n_experts == 4 and r.from_input for r in routers)
    with pytest.warns(UserWarning, match="pattern-based finder"):
        assert [r.name for r in find_routers(model)] == ["layers.0.gate", "layers.1.gate"]
    # The recomputed logits reproduce the custom gate's own scores.
    ids = torch.randint(0, 50, (2, 5))
    with pytest.warns(UserWarning):
        rec = RoutingRecorder(model, pooling="last")
    seen = {}
    handle = model.layers[1].gate.register_forward_hook(lambda m, a, out: seen.update(x=a[0]))
    try:
        with rec, torch.no_grad():
            rec.set_batch(torch.ones(2, 5, dtype=torch.long))
            model(ids)
    finally:
        handle.remove()
    expected = torch.softmax(seen["x"][:, -1] @ model.layers[1].gate.weight.T, dim=-1)
    assert torch.allclose(rec.pooled_rw()[:, 1], expected, atol=1e-6)


def test_model_without_routers_raises():
    with pytest.raises(ValueError, match="no MoE router found in _CustomLM"):
        find_routers(_CustomLM(moe=False))


class _FusedExperts(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, d, 2 * d))
        self.down_proj = nn.Parameter(torch.randn(n, 2 * d, d))


class _FusedBlock(nn.Module):
    def __init__(self, d: int = 8, n: int = 6) -> None:
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = _FusedExperts(d, n)
        self.gate = nn.Linear(d, n + 1)  # wrong width: not a router of these experts


def test_pattern_fallback_accepts_fused_3d_expert_weights():
    model = nn.Sequential(_FusedBlock(), _FusedBlock())
    assert [(r.name, r.n_experts) for r in find_routers_by_pattern(model)] == [
        ("0.router", 6),
        ("1.router", 6),
    ]


# ------------------------------------------------------------------ the router's own selection
def test_token_selection_is_the_routers_own_choice(tiny_olmoe):
    batch = padded_batch([5, 3], 100, "left", seed=6)
    seen = {}
    routers = find_routers(tiny_olmoe)
    handles = [
        r.router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
        for i, r in enumerate(routers)
    ]
    try:
        rec = _run(tiny_olmoe, batch, pooling="tokens")
    finally:
        for handle in handles:
            handle.remove()
    selection = rec.token_selection()
    assert selection.shape == (2, 5, 2, 2) and selection.dtype == torch.long
    assert rec.selection_returned == [True, True]
    for i in range(2):
        assert torch.equal(selection[:, :, i], seen[i].reshape(2, 5, 2))
    # without any returned selection, the top-k of the selection score stands in
    rec._returned = [None, None]
    assert rec.selection_returned == [False, False]
    derived = rec.token_selection()
    real = batch["attention_mask"].bool()
    assert torch.equal(derived.sort(-1).values[real], selection.sort(-1).values[real])


def test_token_selection_needs_tokens_pooling(tiny_olmoe):
    rec = _run(tiny_olmoe, padded_batch([3], 100, "left"))
    with pytest.raises(RuntimeError, match=_exact('token_selection() needs pooling="tokens"')):
        rec.token_selection()


def test_token_selection_of_routers_without_a_returned_choice():
    """Pattern-found routers: re-derived from the selection score when k is known, else None."""
    torch.manual_seed(0)
    model = _CustomLM()
    with pytest.warns(UserWarning):
        routers = find_routers(model)
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    with RoutingRecorder(model, routers, pooling="tokens") as rec, torch.no_grad():
        rec.set_batch(mask)
        model(ids)
    assert rec.selection_returned == [False, False]
    assert rec.token_selection() is None  # the custom gate declares no k
    for r in routers:
        r.top_k = 2
    seen = {}
    handle = model.layers[0].gate.register_forward_hook(lambda m, a, out: seen.update(idx=out[0]))
    try:
        with RoutingRecorder(model, routers, pooling="tokens") as rec, torch.no_grad():
            rec.set_batch(mask)
            model(ids)
    finally:
        handle.remove()
    selection = rec.token_selection()
    assert selection.shape == (2, 5, 2, 2)
    assert torch.equal(selection[:, :, 0].reshape(10, 2).sort(-1).values, seen["idx"].sort(-1).values)
    routers[1].top_k = 1  # a layer with a smaller k is padded with -1
    with RoutingRecorder(model, routers, pooling="tokens") as rec, torch.no_grad():
        rec.set_batch(mask)
        model(ids)
    mixed = rec.token_selection()
    assert torch.equal(mixed[:, :, 0], selection[:, :, 0])
    assert torch.equal(mixed[:, :, 1, 0], selection[:, :, 1, 0]) and bool((mixed[:, :, 1, 1] == -1).all())


# ------------------------------------------------------------------ scores that need the router or its bias
@pytest.fixture(scope="module")
def deepseek_v3():
    """Group-limited sigmoid router with a (randomised) selection-only correction bias."""
    model = tiny_model("deepseek_v3", n_layers=3)
    gen = torch.Generator().manual_seed(0)
    for spec in find_routers(model):
        spec.router.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)
    return model


def _router_calls(model):
    """Each router's output and its selection-only bias, from hooks independent of the recorder."""
    seen = {}
    handles = [
        r.router.register_forward_hook(
            lambda m, a, kw, out, i=i: seen.__setitem__(i, (out, selection_bias(m, a, kw))), with_kwargs=True
        )
        for i, r in enumerate(find_routers(model))
    ]
    return seen, handles


@pytest.mark.parametrize("pooling", ["last", "mean", "tokens"])
@pytest.mark.parametrize("score", ["selection", "native"])
def test_selection_score_uses_the_router_and_its_bias(deepseek_v3, pooling, score):
    batch = padded_batch([5, 3], 100, "left", seed=7)
    seen, handles = _router_calls(deepseek_v3)
    try:
        rec = _run(deepseek_v3, batch, pooling=pooling, score=score)
    finally:
        for handle in handles:
            handle.remove()
    routers = find_routers(deepseek_v3)
    mask = batch["attention_mask"].bool()
    for i, spec in enumerate(routers):
        logits, bias = seen[i][0][0].float().reshape(2, 5, 8), seen[i][1]
        assert bias is not None and bool(bias.abs().sum() > 0)
        expected = apply_score(logits, score, spec.rule, spec.router, bias)
        if pooling == "tokens":
            got = rec.token_rw()[:, :, i]
            assert torch.allclose(got, expected, atol=1e-6)
            # the re-derived choice (top-k of selection) is the router's own one
            derived = rec._derived[i].sort(-1).values[mask]
            assert torch.equal(derived, seen[i][0][2].reshape(2, 5, 2).sort(-1).values[mask])
        elif pooling == "last":
            assert torch.allclose(rec.pooled_rw()[:, i], expected[:, -1], atol=1e-6)
        else:
            means = torch.stack([expected[0].mean(0), expected[1, 2:].mean(0)])
            assert torch.allclose(rec.pooled_rw()[:, i], means, atol=1e-6)
    if score == "selection":  # the bias and the group limits change the scores
        assert not torch.allclose(expected, apply_score(logits, "native", spec.rule, spec.router), atol=1e-3)


@pytest.mark.parametrize("pooling", ["last", "mean", "tokens"])
def test_native_score_reads_the_router(pooling):
    """PhiMoE's native rule reads the router's jitter threshold: the recorder must pass the router."""
    model = tiny_model("phimoe", n_layers=2)
    for spec in find_routers(model):
        spec.router.router_jitter_noise = 0.3
    batch = padded_batch([4, 4], 100, "left", seed=8)
    logits = _run(model, batch, pooling="tokens", score="logits").token_rw()
    rec = _run(model, batch, pooling=pooling, score="native")
    spec = find_routers(model)[0]
    expected = apply_score(logits[:, :, 0], "native", spec.rule, spec.router)
    assert not torch.allclose(expected, apply_score(logits[:, :, 0], "native", spec.rule, None))
    got = rec.token_rw()[:, :, 0] if pooling == "tokens" else rec.pooled_rw()[:, 0]
    want = {"tokens": expected, "last": expected[:, -1], "mean": expected.mean(1)}[pooling]
    assert torch.allclose(got, want, atol=1e-6)


# ------------------------------------------------------------------ logits recomputed from the input
class _TopKOnlyRouter(nn.Module):
    """A router that returns only its top-k values, called with the hidden states as a keyword."""

    def __init__(self, d: int, n: int, key: str) -> None:
        super().__init__()
        # with a bias (the recomputed logits must include it), in float64 (the input must be cast to it)
        self.proj = nn.Linear(d, n).double()
        self.key = key

    def forward(self, **kwargs):
        return self.proj(kwargs[self.key].double()).topk(2, dim=-1)


class _KeywordLM(nn.Module):
    def __init__(self, key: str, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, d)
        self.router = _TopKOnlyRouter(d, n, key)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        self.router(**{self.router.key: h, "mask": None})
        return (h, "extra")  # a tuple output: the hidden state is element 0


@pytest.mark.parametrize("key", ["hidden_states", "x", "input", "other"])
def test_logits_recomputed_from_a_keyword_input(key):
    torch.manual_seed(0)
    model = _KeywordLM(key)
    spec = RouterSpec(
        name="router", module=model.router, layer_index=0, n_experts=4, rule="softmax", logits_index=0
    )
    ids = torch.randint(0, 20, (2, 3))
    with RoutingRecorder(model, [spec], pooling="tokens", score="logits") as rec, torch.no_grad():
        rec.set_batch(torch.ones(2, 3, dtype=torch.long))
        model(ids)
    with torch.no_grad():
        h = model.embed(ids)
        expected = model.router.proj(h.double()).float()
    assert torch.allclose(rec.token_rw()[:, :, 0], expected, atol=1e-6)
    assert torch.allclose(rec.pooled_hs(), h[:, -1], atol=1e-6)
    assert rec.selection_returned == [False] and rec.token_selection() is None


def test_first_tensor_prefers_positional_then_named_inputs():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert _first_tensor((a,), {"hidden_states": b}) is a
    assert _first_tensor((), {"other": c, "x": b}) is b
    assert _first_tensor((), {"other": c, "input": b}) is b
    assert _first_tensor((), {"other": c, "hidden_states": b}) is b
    assert _first_tensor(("not a tensor",), {"other": c}) is c
    assert _first_tensor((), {"flag": True}) is None


def test_projection_finds_the_routers_own_weight_and_bias():
    lin = nn.Linear(6, 4)
    assert _projection(lin, 4) == (lin.weight, lin.bias)
    no_bias = nn.Linear(6, 4, bias=False)
    assert _projection(no_bias, 4) == (no_bias.weight, None)
    flagged = nn.Module()  # a router whose `bias` is a config flag, not a tensor
    flagged.weight, flagged.bias = nn.Parameter(torch.randn(4, 6)), True
    assert _projection(flagged, 4) == (flagged.weight, None)
    wrapper = nn.Sequential(nn.Linear(6, 3), nn.Linear(3, 4))  # the one [.. -> 4] Linear inside
    assert _projection(wrapper, 4) == (wrapper[1].weight, wrapper[1].bias)
    odd = nn.Linear(6, 5)  # its own weight has the wrong width: the search goes inside (and finds nothing)
    with pytest.raises(
        RuntimeError,
        match=_exact("cannot recompute the logits of Linear: no unique [hidden -> 4] projection"),
    ):
        _projection(odd, 4)
    two = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 4))
    with pytest.raises(
        RuntimeError,
        match=_exact("cannot recompute the logits of Sequential: no unique [hidden -> 4] projection"),
    ):
        _projection(two, 4)


def test_wrong_shapes_are_named(tiny_olmoe):
    rec = RoutingRecorder(tiny_olmoe)
    rec.set_batch(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(
        RuntimeError, match=_exact("what: got a tensor of shape (5, 8) for a batch of 2x3 tokens")
    ):
        rec._as_btx(torch.zeros(5, 8), "what")
    with pytest.raises(
        RuntimeError, match=_exact("what: got a tensor of shape (3, 2, 8) for a batch of 2x3 tokens")
    ):
        rec._as_btx(torch.zeros(3, 2, 8), "what")
    assert rec._as_btx(torch.zeros(6, 8), "what").shape == (2, 3, 8)
    assert rec._as_btx(torch.zeros(2, 3, 8), "what").shape == (2, 3, 8)
    assert rec._as_btx(torch.zeros(6), "what").shape == (2, 3, 1)
    with pytest.raises(
        RuntimeError, match=_exact("what: got a tensor of shape (2, 5) for a batch of 2x3 tokens")
    ):
        rec._as_btx(torch.zeros(2, 5), "what")
    with pytest.raises(
        RuntimeError, match=_exact("what: got a tensor of shape (3, 4) for a batch of 2x3 tokens")
    ):
        rec._as_btx(torch.zeros(3, 4), "what")


class _TupleLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return (self.lin(h), "cache")


class _TupleLayersLM(nn.Module):
    """Decoder layers that return tuples, and a final output that is not a tensor at all."""

    def __init__(self, d: int = 8, broken: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, d)
        self.layers = nn.ModuleList([_TupleLayer(d), _TupleLayer(d)])
        self.router = nn.Linear(d, 4)
        self.broken = broken

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)[0]
        self.router(h)
        return ("no tensor",) if self.broken else h


def test_tuple_layer_outputs_and_a_missing_final_state():
    torch.manual_seed(0)
    model = _TupleLayersLM()
    spec = RouterSpec(
        name="router", module=model.router, layer_index=0, n_experts=4, rule="softmax", logits_index=None
    )
    ids = torch.randint(0, 20, (2, 3))
    with RoutingRecorder(model, [spec], hs_layers=True) as rec, torch.no_grad():
        rec.set_batch(torch.ones(2, 3, dtype=torch.long))
        model(ids)
        first = model.layers[0](model.embed(ids))[0]
    assert torch.allclose(rec.pooled_hs_all_layers()[:, 0], first[:, -1], atol=1e-6)
    broken = _TupleLayersLM(broken=True)
    spec = RouterSpec(
        name="router", module=broken.router, layer_index=0, n_experts=4, rule="softmax", logits_index=None
    )
    with RoutingRecorder(broken, [spec]) as rec, torch.no_grad():
        rec.set_batch(torch.ones(2, 3, dtype=torch.long))
        with pytest.raises(RuntimeError, match=_exact("_TupleLayersLM returned no last_hidden_state tensor")):
            broken(ids)


class _SoftcapRouter(nn.Linear):
    """Declared logits that are not the plain projection (softcapped, as Laguna's), in a tuple."""

    def forward(self, x):
        logits = torch.tanh(super().forward(x) / 2) * 2
        return logits, logits.topk(2, dim=-1).indices


class _SoftcapLM(nn.Module):
    def __init__(self, d: int = 8, twice: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, d)
        self.router = _SoftcapRouter(d, 4)
        self.twice = twice

    def forward(self, input_ids):
        h = self.embed(input_ids)
        out = self.router(h)
        if self.twice:
            self.router(h)
        return h + out[0].sum(-1, keepdim=True)


@pytest.mark.parametrize("as_tuple", [True, False])
def test_declared_logits_are_read_not_recomputed(as_tuple):
    torch.manual_seed(0)
    model = _SoftcapLM()
    spec = RouterSpec(
        name="router",
        module=model.router,
        layer_index=0,
        n_experts=4,
        rule="softmax",
        logits_index=0 if as_tuple else None,
    )
    if not as_tuple:  # a router returning the bare logits tensor, declared with index 0 (DBRX-like)
        model.router.forward = lambda x, r=model.router: _SoftcapRouter.forward(r, x)[0]
        spec.logits_index = 0
    ids = torch.randint(0, 20, (2, 3))
    with RoutingRecorder(model, [spec], pooling="tokens", score="logits") as rec, torch.no_grad():
        rec.set_batch(torch.ones(2, 3, dtype=torch.long))
        model(ids)
        expected = (
            torch.tanh(nn.functional.linear(model.embed(ids), model.router.weight, model.router.bias) / 2) * 2
        )
    assert torch.allclose(rec.token_rw()[:, :, 0], expected, atol=1e-6)


def test_a_router_running_twice_is_refused():
    model = _SoftcapLM(twice=True)
    spec = RouterSpec(
        name="router", module=model.router, layer_index=0, n_experts=4, rule="softmax", logits_index=0
    )
    with RoutingRecorder(model, [spec]) as rec, torch.no_grad():
        rec.set_batch(torch.ones(1, 3, dtype=torch.long))
        with pytest.raises(
            RuntimeError,
            match=_exact("router router ran twice in one forward pass; call set_batch() before each forward"),
        ):
            model(torch.randint(0, 20, (1, 3)))


class _ToyRouter(nn.Module):
    """Sigmoid router with a selection-only bias passed in by its block (like AFMoE / LFM2-MoE),
    float64 weights, and its top-k returned in ascending expert order (not by score)."""

    def __init__(self, d: int, n: int, bad: str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d, dtype=torch.float64))
        self.bad = bad

    def forward(self, hidden_states, expert_bias=None):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.weight.dtype)
        logits = flat @ self.weight.T
        index = (logits.sigmoid() + expert_bias).topk(2, dim=-1).indices.sort(dim=-1).values
        if self.bad == "logits":
            logits = logits[: hidden_states.shape[0]]  # [B, E]: one row per text, not per token
        if self.bad == "rows":
            logits = logits[:3]
        if self.bad == "selection":
            index = index[:-1]
        return logits, logits.new_ones(index.shape), index


class _Crop(nn.Linear):
    """A decoder layer whose output lost the sequence axis."""

    def forward(self, x):
        return super().forward(x)[:, :1, :3]


class _ToyLM(nn.Module):
    def __init__(self, d: int = 8, n: int = 4, bad: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, d)
        self.layers = nn.ModuleList([_Crop(d, d) if bad == "layer" else nn.Linear(d, d)])
        self.router = _ToyRouter(d, n, bad)
        self.register_buffer("expert_bias", torch.tensor([0.0, 0.6, -0.6, 0.3]))
        self.bad = bad

    def forward(self, input_ids):
        h = self.layers[0](self.embed(input_ids))
        self.router(h, expert_bias=self.expert_bias)
        return h[:1] if self.bad == "final" else h


def _toy_spec(model: _ToyLM) -> RouterSpec:
    return RouterSpec(
        name="router",
        module=model.router,
        layer_index=0,
        n_experts=4,
        rule="sigmoid_bias",
        logits_index=0,
        top_k=2,
        selection_format="tuple",
    )


def test_bias_passed_by_keyword_and_the_routers_own_order():
    torch.manual_seed(0)
    model = _ToyLM()
    ids = torch.randint(0, 20, (2, 2))
    with (
        RoutingRecorder(model, [_toy_spec(model)], pooling="tokens", score="selection") as rec,
        torch.no_grad(),
    ):
        rec.set_batch(torch.ones(2, 2, dtype=torch.long))
        model(ids)
        logits = model.layers[0](model.embed(ids)).double() @ model.router.weight.T
    assert torch.allclose(rec.token_rw()[:, :, 0], (logits.sigmoid() + model.expert_bias).float(), atol=1e-6)
    expected = (logits.sigmoid() + model.expert_bias).topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(rec.token_selection()[:, :, 0], expected)  # as returned: ascending, not by score


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("logits", "router: expected 4 router logits per token, got 1"),
        ("rows", "router: got a tensor of shape (3, 4) for a batch of 2x4 tokens"),
        ("selection", "router selection: got a tensor of shape (7, 2) for a batch of 2x4 tokens"),
        ("layer", "decoder layer 0: got a tensor of shape (2, 1, 3) for a batch of 2x4 tokens"),
        ("final", "last_hidden_state: got a tensor of shape (1, 4, 8) for a batch of 2x4 tokens"),
    ],
)
def test_wrong_shapes_inside_hooks_name_the_tensor(bad, message):
    torch.manual_seed(0)
    model = _ToyLM(bad=bad)
    with RoutingRecorder(model, [_toy_spec(model)], pooling="tokens", hs_layers=True) as rec, torch.no_grad():
        rec.set_batch(torch.ones(2, 4, dtype=torch.long))
        with pytest.raises(RuntimeError, match=_exact(message)):
            model(torch.randint(0, 20, (2, 4)))


def _return_probabilities(model: nn.Module) -> list:
    """Make every router return its softmax probabilities where its logits belong, as transformers 5
    releases before 5.6.0 did (``router_logits = softmax(router_logits)`` inside the router)."""

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (torch.softmax(output[0].float(), dim=-1).to(output[0].dtype), *output[1:])
        return torch.softmax(output.float(), dim=-1).to(output.dtype)

    return [spec.module.register_forward_hook(hook) for spec in find_routers(model)]


@pytest.mark.parametrize("pooling", ["last", "mean", "tokens"])
@pytest.mark.parametrize("score", ["native", "softmax", "selection"])
def test_a_router_returning_probabilities_is_not_softmaxed_again(tiny_olmoe, pooling, score):
    batch = padded_batch([5, 3], 100, "left", seed=7)
    want = _run(tiny_olmoe, batch, pooling=pooling, score=score)
    handles = _return_probabilities(tiny_olmoe)
    try:
        with pytest.warns(UserWarning, match="returns probabilities as its logits"):
            got = _run(tiny_olmoe, batch, pooling=pooling, score=score)
    finally:
        for h in handles:
            h.remove()
    read = (lambda r: r.token_rw()) if pooling == "tokens" else (lambda r: r.pooled_rw())
    torch.testing.assert_close(read(got), read(want), atol=1e-6, rtol=1e-5)


def test_a_non_softmax_router_returning_probabilities_is_refused():
    model = tiny_model("deepseek_v3", n_layers=2).eval()
    handles = _return_probabilities(model)
    try:
        with pytest.raises(RuntimeError, match="returns probabilities .* upgrade transformers to >= 5.6.0"):
            _run(model, padded_batch([4], 100, "left"))
    finally:
        for h in handles:
            h.remove()


def test_logits_are_not_mistaken_for_probabilities():
    from moee.capture.recorder import looks_like_probabilities

    probs = torch.softmax(torch.randn(3, 4, 8), dim=-1)
    assert looks_like_probabilities(probs)
    assert not looks_like_probabilities(torch.randn(3, 4, 8))
    assert not looks_like_probabilities(probs.abs() * 1.01)  # rows summing to 1.01
    shifted = probs.clone()
    shifted[0, 0, 0] = -1e-3
    assert not looks_like_probabilities(shifted / shifted.sum(-1, keepdim=True))  # one negative entry
    assert not looks_like_probabilities(torch.ones(3, 1))  # one expert: nothing to tell apart
    assert looks_like_probabilities(probs.bfloat16(), torch.bfloat16)
