"""RoutingRecorder: pooling inside hooks, padding sides, memory, hook removal, the pattern fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moee.capture import RoutingRecorder, find_routers, find_routers_by_pattern
from moee.capture.oracle import padded_batch
from moee.capture.tiny import tiny_model


@pytest.fixture(scope="module")
def olmoe():
    return tiny_model("olmoe", n_layers=2)


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _run(model, batch, **kwargs):
    with RoutingRecorder(model, **kwargs) as rec, torch.no_grad():
        rec.set_batch(batch["attention_mask"])
        model(**batch, use_cache=False)
        return rec


def test_hooks_removed_after_normal_exit(olmoe):
    before = _hook_count(olmoe)
    rec = _run(olmoe, padded_batch([4, 2], 100, "left"))
    assert not rec.active and _hook_count(olmoe) == before
    assert rec.pooled_rw().shape == (2, 2, 8)


def test_hooks_removed_when_forward_raises(olmoe):
    before = _hook_count(olmoe)
    router = find_routers(olmoe)[1].module

    def boom(*_):
        raise RuntimeError("boom inside the forward")

    handle = router.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with RoutingRecorder(olmoe) as rec, torch.no_grad():
                assert _hook_count(olmoe) > before + 1
                batch = padded_batch([3], 100, "left")
                rec.set_batch(batch["attention_mask"])
                olmoe(**batch)
    finally:
        handle.remove()
    assert _hook_count(olmoe) == before


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_left_and_right_padding_agree(olmoe, pooling):
    lengths = [6, 2, 4]
    left = _run(olmoe, padded_batch(lengths, 100, "left", seed=3), pooling=pooling)
    right = _run(olmoe, padded_batch(lengths, 100, "right", seed=3), pooling=pooling)
    assert torch.allclose(left.pooled_rw(), right.pooled_rw(), atol=1e-5)
    assert torch.allclose(left.pooled_hs(), right.pooled_hs(), atol=1e-5)


def test_tokens_pooling_agrees_with_last_and_mean(olmoe):
    batch = padded_batch([5, 3], 100, "left", seed=1)
    tokens = _run(olmoe, batch, pooling="tokens").token_rw()  # [B, T, L, E]
    last = _run(olmoe, batch, pooling="last").pooled_rw()
    mean = _run(olmoe, batch, pooling="mean").pooled_rw()
    assert tokens.shape == (2, 5, 2, 8)
    assert torch.allclose(tokens[:, -1], last, atol=1e-6)  # left padding: last real token is the last column
    assert torch.allclose(tokens[1, 2:].mean(dim=0), mean[1], atol=1e-6)
    assert torch.allclose(tokens[0].mean(dim=0), mean[0], atol=1e-6)


def test_scores(olmoe):
    batch = padded_batch([4, 6], 100, "left", seed=2)
    logits = _run(olmoe, batch, score="logits").pooled_rw()
    soft = _run(olmoe, batch, score="softmax").pooled_rw()
    native = _run(olmoe, batch, score="native").pooled_rw()
    assert torch.allclose(torch.softmax(logits, dim=-1), soft, atol=1e-6)
    assert torch.allclose(soft, native)  # OLMoE's native rule is softmax
    assert torch.allclose(soft.sum(-1), torch.ones(2, 2), atol=1e-5)


def test_hidden_state_is_the_final_norm_output(olmoe):
    batch = padded_batch([5, 3], 100, "right", seed=4)
    rec = _run(olmoe, batch, hs_layers=True)
    with torch.no_grad():
        out = olmoe(**batch, output_hidden_states=True, use_cache=False)
    last = torch.stack([out.hidden_states[-1][0, 4], out.hidden_states[-1][1, 2]])
    assert torch.allclose(rec.pooled_hs(), last, atol=1e-6)
    per_layer = rec.pooled_hs_all_layers()
    assert per_layer.shape == (2, 2, 64)
    # decoder layer outputs are hidden_states[1:] (the last one before the final norm)
    layer0 = torch.stack([out.hidden_states[1][0, 4], out.hidden_states[1][1, 2]])
    assert torch.allclose(per_layer[:, 0], layer0, atol=1e-6)


def test_kept_memory_does_not_grow_with_length(olmoe):
    sizes = []
    for length in (8, 64, 256):
        rec = _run(olmoe, padded_batch([length, length // 2], 100, "left"), hs_layers=True)
        sizes.append(rec.kept_bytes())
    assert sizes[0] == sizes[1] == sizes[2] == 4 * 2 * (2 * 8 + 64 + 2 * 64)


def test_set_batch_is_required_and_validated(olmoe):
    with RoutingRecorder(olmoe) as rec:
        with pytest.raises(RuntimeError, match="set_batch"), torch.no_grad():
            olmoe(torch.randint(4, 100, (1, 3)))
        with pytest.raises(ValueError, match="at least one real token"):
            rec.set_batch(torch.tensor([[1, 1], [0, 0]]))
        with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
            rec.set_batch(torch.ones(3))
    with pytest.raises(ValueError, match="unknown pooling"):
        RoutingRecorder(olmoe, pooling="max")
    with pytest.raises(ValueError, match="unknown score"):
        RoutingRecorder(olmoe, score="probs")


def test_results_before_forward_raise(olmoe):
    with RoutingRecorder(olmoe) as rec:
        rec.set_batch(torch.ones(1, 2, dtype=torch.long))
        with pytest.raises(RuntimeError, match="no routing was recorded"):
            rec.pooled_rw()
        with pytest.raises(RuntimeError, match="token_rw"):
            rec.token_rw()


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
def test_token_selection_is_the_routers_own_choice(olmoe):
    batch = padded_batch([5, 3], 100, "left", seed=6)
    seen = {}
    routers = find_routers(olmoe)
    handles = [
        r.router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
        for i, r in enumerate(routers)
    ]
    try:
        rec = _run(olmoe, batch, pooling="tokens")
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


def test_token_selection_needs_tokens_pooling(olmoe):
    rec = _run(olmoe, padded_batch([3], 100, "left"))
    with pytest.raises(RuntimeError, match='needs pooling="tokens"'):
        rec.token_selection()
