"""Expert-specialization accumulators on hand-made routes, and report assembly without a model."""

import html
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from moee.analysis.specialization import (
    REPORT_SECTIONS,
    SELECTION_RETURNED,
    BaselineDraws,
    ReportOptions,
    SpecializationAccumulator,
    build_report,
    model_top_k,
    read_corpus,
    render_html,
)

# two texts, L=2 MoE layers, E=3 experts, k=1
TEXT0_IDS = np.array([5, 6, 5])
TEXT0 = np.array(
    [
        [[0.7, 0.2, 0.1], [0.2, 0.2, 0.6]],  # first choices: L0 e0, L1 e2
        [[0.1, 0.8, 0.1], [0.25, 0.25, 0.5]],  # L0 e1, L1 e2
        [[0.6, 0.3, 0.1], [0.6, 0.2, 0.2]],  # L0 e0, L1 e0
    ]
)
TEXT1_IDS = np.array([6])
TEXT1 = np.array([[[0.2, 0.5, 0.3], [0.3, 0.4, 0.3]]])  # L0 e1, L1 e1


def decode(ids):
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def hand_made():
    acc = SpecializationAccumulator(2, 3, 1, n_contexts=2, context_window=1)
    acc.update(TEXT0_IDS, TEXT0, text_index=0, domain="a")
    acc.update(TEXT1_IDS, TEXT1, text_index=1, domain="b")
    return acc, acc.result(decode, min_token_count=1)


def test_load_importance_and_balance(hand_made):
    acc, rep = hand_made
    np.testing.assert_array_equal(acc.load, [[2, 2, 0], [1, 1, 2]])
    np.testing.assert_allclose(acc.importance[0], [1.6, 1.8, 0.6])
    layer0 = rep["layers"][0]
    assert layer0["max_over_mean_load"] == pytest.approx(2 / (4 / 3))
    assert layer0["cv_load"] == pytest.approx(np.std([2, 2, 0]) / np.mean([2, 2, 0]))
    assert layer0["cv_importance"] == pytest.approx(np.std([1.6, 1.8, 0.6]) / np.mean([1.6, 1.8, 0.6]))
    assert layer0["dead_experts"] == 1
    p = np.concatenate([TEXT0, TEXT1])[:, 0]
    assert layer0["routing_entropy"] == pytest.approx(float(-(p * np.log(p)).sum(1).mean()))
    assert rep["summary"]["n_tokens"] == 4 and rep["summary"]["n_texts"] == 2


def test_repetition_and_layer_agreement(hand_made):
    _, rep = hand_made
    assert rep["repetition"]["n_adjacent_pairs"] == 2  # only inside a text
    rates = [r["rate"] for r in rep["repetition"]["by_layer"]]
    assert rates == [0.0, 0.5]
    # each text's first choices shuffled over its own positions: text 0 (L0 e0 e1 e0, L1 e2 e2 e0)
    # has 2 adjacent pairs, each equal with probability 2*1 / (3*2), so 2/3 expected; text 1 none
    baselines = [r["baseline"] for r in rep["repetition"]["by_layer"]]
    assert baselines == pytest.approx([(2 / 3) / 2, (2 / 3) / 2])
    pair = rep["layer_agreement"]["pairs"][0]
    assert pair["layers"] == [0, 1]
    assert pair["matched_agreement"] == pytest.approx(0.5)  # joint (0,2),(1,2),(0,0),(1,1)
    assert 0 <= pair["nmi"] <= 1


def test_domain_and_vocabulary_specialization(hand_made):
    _, rep = hand_made
    doms = rep["domains"]
    assert doms["available"] and "uniform" not in doms
    assert doms["domains"]["a"]["n_tokens"] == 3
    np.testing.assert_allclose(doms["domains"]["a"]["fraction"][0], [2 / 3, 1 / 3, 0], atol=1e-6)
    np.testing.assert_allclose(doms["domains"]["b"]["fraction"][0], [0, 1, 0])
    assert doms["domains"]["a"]["max_fraction_by_layer"] == pytest.approx([2 / 3, 2 / 3], abs=1e-6)
    # the labels shuffled across the two texts: each domain gets text 0 (L0 max fraction 2/3) or
    # text 1 (one token: 1), the two domains always different ones
    a, b = (np.asarray(doms["domains"][d]["baseline_by_layer"]) for d in "ab")
    assert np.all((a >= 2 / 3 - 1e-9) & (a <= 1)) and a[0] + b[0] == pytest.approx(2 / 3 + 1)
    assert doms["exact"] is True and doms["sampled_texts"] == 2
    voc = rep["vocabulary"]["by_layer"]
    assert voc[0]["weighted_max_ratio"] == pytest.approx(1.0)  # w5 -> e0 twice, w6 -> e1 twice
    assert voc[1]["weighted_max_ratio"] == pytest.approx((2 * 0.5 + 2 * 0.5) / 4)
    expert0 = rep["experts"][0][0]
    assert expert0["top_tokens"][0] == {"token": "w5", "token_id": 5, "count": 2, "share_of_token": 1.0}


def test_top_contexts_keep_the_strongest_positions(hand_made):
    _, rep = hand_made
    ctx = rep["experts"][0][0]["top_contexts"]  # L0 e0: probs 0.7 (pos 0), 0.6 (pos 2), 0.2, 0.1
    assert [c["prob"] for c in ctx] == pytest.approx([0.7, 0.6])
    # the tokenizer's own spacing is kept: the neighbour's leading space belongs to it
    assert ctx[0] == {"prob": pytest.approx(0.7), "text_index": 0, "left": "", "token": "w5", "right": " w6"}
    assert ctx[1]["left"] == "w6" and ctx[1]["right"] == ""
    ctx = rep["experts"][1][1]["top_contexts"]  # L1 e1: 0.4 from text 1 beats 0.25 / 0.2
    assert ctx[0]["text_index"] == 1 and ctx[0]["prob"] == pytest.approx(0.4)


def test_coactivation_with_top2():
    acc = SpecializationAccumulator(1, 3, 2)
    probs = np.array([[[0.5, 0.4, 0.1]], [[0.45, 0.45, 0.1]], [[0.5, 0.1, 0.4]]])
    acc.update(np.array([1, 2, 3]), probs, text_index=0)
    np.testing.assert_array_equal(acc.tallies["coactivation"].counts[0], [[3, 2, 1], [2, 2, 0], [1, 0, 1]])
    rep = acc.result(decode, min_token_count=1)
    mat = np.asarray(rep["coactivation"]["matrices"]["0"])
    assert mat[0, 1] == pytest.approx(2 / 3, abs=1e-4) and mat[1, 0] == pytest.approx(1.0)
    assert rep["coactivation"]["uniform"] == pytest.approx(1 / 2)
    assert rep["coactivation"]["by_layer"][0]["top_pairs"][0] == {"i": 1, "j": 0, "ratio": 1.0, "n_i": 2}


def test_update_rejects_bad_routes():
    acc = SpecializationAccumulator(2, 3, 1)
    with pytest.raises(ValueError, match=r"\[T, 2, 3\]"):
        acc.update(np.array([1]), np.ones((1, 3, 3)) / 3, text_index=0)
    with pytest.raises(ValueError, match="tokens"):
        acc.update(np.array([1, 2]), np.ones((1, 2, 3)) / 3, text_index=0)
    with pytest.raises(ValueError, match="NaN"):
        acc.update(np.array([1]), np.full((1, 2, 3), np.nan), text_index=0)
    with pytest.raises(ValueError, match="top_k"):
        SpecializationAccumulator(2, 3, 4)
    with pytest.raises(ValueError, match="no tokens"):
        SpecializationAccumulator(2, 3, 1).result(decode)


def test_model_top_k_reads_config_and_falls_back(caplog):
    assert model_top_k(SimpleNamespace(num_experts_per_tok=8)) == (8, "config.num_experts_per_tok")
    assert model_top_k(SimpleNamespace(moe_top_k=2)) == (2, "config.moe_top_k")
    nested = SimpleNamespace(text_config=SimpleNamespace(num_experts_per_tok=4))
    assert model_top_k(nested) == (4, "config.num_experts_per_tok")
    with caplog.at_level(logging.WARNING):
        assert model_top_k(SimpleNamespace(hidden_size=3)) == (1, "fallback")
    assert "top-k" in caplog.text


class FakeEmbedder:
    """Random routes with a token-dependent preference; enough to exercise streaming and rendering."""

    def __init__(self, layers=3, experts=6, k=2):
        self.n_moe_layers, self.n_experts = layers, experts
        self.model = SimpleNamespace(config=SimpleNamespace(num_experts_per_tok=k))
        self.tokenizer = SimpleNamespace(decode=lambda ids, **_: decode(ids))
        self.name_or_path = "fake"

    def iter_token_routes(self, texts, *, prompt=None, score="softmax", batch_size=16):
        assert prompt is None and score == "softmax"
        for i, text in enumerate(texts):
            ids = np.array([int(w[1:]) for w in text.split()])
            rng = np.random.default_rng(int(ids.sum()))
            logits = rng.normal(size=(len(ids), self.n_moe_layers, self.n_experts))
            logits += 3 * (ids[:, None, None] % self.n_experts == np.arange(self.n_experts))
            p = np.exp(logits)
            yield SimpleNamespace(
                index=i, input_ids=ids, probs=(p / p.sum(-1, keepdims=True)).astype(np.float32)
            )


def assert_same_report(a, b, path="report"):
    """Equal structure and strings; floats equal up to summation order."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_report(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_report(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


CORPUS = [(" ".join(f"t{(i * j + j) % 23}" for j in range(3 + i % 7)), "ab"[i % 2]) for i in range(40)]


def test_report_does_not_depend_on_chunking():
    a = build_report(
        FakeEmbedder(), CORPUS, chunk_size=7, progress=False, options=ReportOptions(min_token_count=1)
    )
    b = build_report(
        FakeEmbedder(), CORPUS, chunk_size=1000, progress=False, options=ReportOptions(min_token_count=1)
    )
    assert_same_report(a, b)
    assert a["summary"]["top_k"] == 2 and a["summary"]["top_k_source"] == "config.num_experts_per_tok"
    ctx_texts = {c["text_index"] for row in a["experts"] for e in row for c in e["top_contexts"]}
    assert max(ctx_texts) >= 7  # global text indices survive chunking
    # a route sample smaller than the corpus is the same sample in any chunking
    kw = dict(progress=False, options=ReportOptions(min_token_count=1, draws=BaselineDraws(3, sample=30)))
    assert_same_report(
        build_report(FakeEmbedder(), CORPUS, chunk_size=7, **kw),
        build_report(FakeEmbedder(), CORPUS, chunk_size=1000, **kw),
    )


def test_report_options_and_errors():
    rep = build_report(
        FakeEmbedder(), [t for t, _ in CORPUS], options=ReportOptions(top_k=1), max_texts=5, progress=False
    )
    assert rep["summary"]["n_texts"] == 5 and rep["summary"]["top_k_source"] == "argument"
    assert rep["domains"]["available"] is False
    with pytest.raises(ValueError, match="top_k"):
        build_report(FakeEmbedder(), CORPUS, options=ReportOptions(top_k=7), progress=False)
    with pytest.raises(ValueError, match="no texts"):
        build_report(FakeEmbedder(), [], progress=False)
    with pytest.raises(TypeError, match="corpus item 0"):
        build_report(FakeEmbedder(), [3], progress=False)


@pytest.mark.slow
def test_render_html_is_self_contained_with_every_section():
    rep = build_report(FakeEmbedder(), CORPUS, progress=False)
    rep["meta"] = {"command": "moee report <test>"}
    page = render_html(rep)
    for section in REPORT_SECTIONS[1:]:
        assert f"id='{section}'" in page
    assert "data:image/png;base64," in page
    assert 'src="http' not in page and "<script src" not in page  # the token view's script is inline
    assert "&lt;test&gt;" in page  # escaped


def test_read_corpus_txt_jsonl_and_domain(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("one\n\nthree\n")
    assert list(read_corpus(txt)) == [("one", None), ("", None), ("three", None)]
    with pytest.raises(ValueError, match="domain"):
        read_corpus(txt, domain_field="d")
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"text": "x", "src": "bible"}\n{"text": "y", "src": "austen"}\n')
    assert list(read_corpus(jl, domain_field="src")) == [("x", "bible"), ("y", "austen")]
    jl.write_text('{"text": "x", "src": "bible"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match="src"):
        list(read_corpus(jl, domain_field="src"))


def test_selection_scores_override_the_probabilities_for_top_k():
    acc = SpecializationAccumulator(1, 3, 1)
    probs = np.array([[[0.6, 0.3, 0.1]], [[0.7, 0.2, 0.1]]])
    # a selection-only bias flips the first token's choice (0.6 < 0.3 + 0.35), not the second's
    bias = np.array([0.0, 0.35, 0.0])
    acc.update(np.array([1, 2]), probs, text_index=0, selection=probs + bias)
    np.testing.assert_array_equal(acc.load[0], [1, 1, 0])
    np.testing.assert_allclose(acc.importance[0], [1.3, 0.5, 0.2])  # importance stays on the probabilities
    with pytest.raises(ValueError, match="selection"):
        acc.update(np.array([1]), probs[:1], text_index=1, selection=probs)


@pytest.mark.slow
def test_report_counts_the_loss_free_gates_biased_selection():
    """With a selection bias that forces expert 0, every token must select it (load share 1/k)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moee.embed.embedder import MoEEmbedder
    from moee.moe.lm import MoEEConfig, MoEEForCausalLM

    texts = ["the cat sat on the mat", "a dog ran up the hill", "old river and quiet mill"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    config = MoEEConfig(
        vocab_size=fast.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=16, router_type="loss_free",
        max_position_embeddings=32, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MoEEForCausalLM(config)
    for name, buf in model.named_buffers():
        if name.endswith("gate.bias"):
            buf.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    embedder = MoEEmbedder(model, fast)
    rep = build_report(embedder, texts, progress=False)
    assert rep["summary"]["selection"] == SELECTION_RETURNED  # the gate returns its own top-k
    for layer in rep["layers"]:
        assert layer["load_fraction"][0] == pytest.approx(1 / 2)  # in every token's top 2
        assert sum(layer["importance_fraction"]) == pytest.approx(1.0, abs=1e-5)


def _exact_sample(acc):
    return acc._sample.routes().shape[0] == acc.n_tokens


def test_vocabulary_baseline_is_the_exact_permutation_expectation():
    """Four tokens w5 w5 w6 w6 routed e0 e0 e1 e1 (L=1, E=2, k=1). Shuffling the four routes over
    the positions (6 equally likely arrangements), w5 gets both copies of one expert in 2 of them
    (max count 2) and one of each in 4 (max 1): E[max] = 4/3 for each type, baseline (4/3 + 4/3)/4."""
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=3000, seed=1))
    probs = np.array([[[0.9, 0.1]], [[0.8, 0.2]], [[0.3, 0.7]], [[0.1, 0.9]]])
    acc.update(np.array([5, 5, 6, 6]), probs, text_index=0)
    rep = acc.result(decode, min_token_count=1)
    voc = rep["vocabulary"]["by_layer"][0]
    assert voc["weighted_max_ratio"] == pytest.approx(1.0)
    assert voc["baseline"] == pytest.approx(2 / 3, abs=0.02)
    assert rep["baselines"]["exact"] is True and rep["baselines"]["permutations"] == 3000
    # types seen fewer than min_token_count times have no statistic and no baseline
    assert acc.result(decode, min_token_count=3)["vocabulary"]["by_layer"][0]["baseline"] is None


@pytest.mark.slow
def test_layer_agreement_baseline_is_the_exact_permutation_expectation():
    """First choices e0 e0 e1 e1 in both layers (E=2). Pairing layer 1 randomly with layer 0, the
    table is [[a, 2-a], [2-a, a]] with P(a=2) = P(a=0) = 1/6, P(a=1) = 4/6: matched agreement
    1, 1, 1/2 -> 2/3, NMI 1, 1, 0 -> 1/3."""
    acc = SpecializationAccumulator(2, 2, 1, draws=BaselineDraws(permutations=3000, seed=2))
    route = np.array([[[0.9, 0.1]] * 2, [[0.8, 0.2]] * 2, [[0.3, 0.7]] * 2, [[0.1, 0.9]] * 2])
    acc.update(np.array([1, 2, 3, 4]), route, text_index=0)
    pair = acc.result(decode, min_token_count=1)["layer_agreement"]["pairs"][0]
    assert pair["nmi"] == pytest.approx(1.0) and pair["matched_agreement"] == pytest.approx(1.0)
    assert pair["matched_baseline"] == pytest.approx(2 / 3, abs=0.02)
    assert pair["nmi_baseline"] == pytest.approx(1 / 3, abs=0.03)


def _routes_of(router, ids, L, E, rng):
    """Dense probabilities [T, L, E] from per-token logits chosen by ``router``."""
    logits = router(ids, rng)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _stream(router, *, L=3, E=8, k=2, n_texts=120, seed=0, permutations=10, baseline_sample=None):
    rng = np.random.default_rng(seed)
    acc = SpecializationAccumulator(L, E, k, draws=BaselineDraws(permutations, sample=baseline_sample))
    for i in range(n_texts):
        T = int(rng.integers(5, 40))
        ids = (rng.zipf(1.4, T) % 200).astype(np.int64)
        acc.update(ids, _routes_of(router, ids, L, E, rng), text_index=i, domain="abc"[i % 3])
    return acc, acc.result(decode, min_token_count=5)


# expert preferences shared by every token, so loads are uneven and k/E, 1/E are off
PREFERENCE = np.array([1.5, 1.0, 0.6, 0.3, 0.0, -0.3, -0.6, -1.0])


def input_blind(ids, rng):
    return rng.normal(size=(ids.size, 3, 8)) + PREFERENCE


def by_token(ids, rng):
    # each layer maps the token id to its own pair of experts; a little noise keeps the ranking
    layers = [(ids * (2 * layer + 3) + layer) % 8 for layer in range(3)]
    logits = rng.normal(scale=0.05, size=(ids.size, 3, 8))
    for layer, e in enumerate(layers):
        logits[np.arange(ids.size), layer, e] += 6
        logits[np.arange(ids.size), layer, (e + 1 + ids % 7) % 8] += 4
    return logits


def test_a_router_that_ignores_its_input_scores_at_its_baselines():
    acc, rep = _stream(input_blind, permutations=20)
    assert _exact_sample(acc)
    for v in rep["vocabulary"]["by_layer"]:
        assert v["weighted_max_ratio"] == pytest.approx(v["baseline"], rel=0.04)
        assert v["baseline"] > 1.5 * 2 / 8  # the uniform k/E is no baseline of a max over experts
    for d in rep["domains"]["domains"].values():
        for m, b in zip(d["max_fraction_by_layer"], d["baseline_by_layer"]):
            assert m == pytest.approx(b, rel=0.06)
    for pair in rep["layer_agreement"]["pairs"]:
        assert pair["nmi"] == pytest.approx(pair["nmi_baseline"], abs=0.01)
        assert pair["matched_agreement"] == pytest.approx(pair["matched_baseline"], abs=0.03)
        assert pair["matched_baseline"] > 1.3 / 8  # uneven loads and a finite sample: above 1/E
    for r in rep["repetition"]["by_layer"]:
        assert r["rate"] == pytest.approx(r["baseline"], abs=0.03)


def test_a_router_that_routes_by_token_identity_scores_far_above_its_baselines():
    _, rep = _stream(by_token, permutations=5)
    for v in rep["vocabulary"]["by_layer"]:
        assert v["weighted_max_ratio"] == pytest.approx(1.0)
        assert v["baseline"] < 0.8
    for pair in rep["layer_agreement"]["pairs"]:
        assert pair["nmi"] > pair["nmi_baseline"] + 0.3
        assert pair["matched_agreement"] > pair["matched_baseline"] + 0.2


def test_baselines_are_seeded_and_the_sample_is_bounded():
    _, a = _stream(input_blind, n_texts=30, permutations=3, seed=5)
    _, b = _stream(input_blind, n_texts=30, permutations=3, seed=5)
    assert a["vocabulary"] == b["vocabulary"] and a["layer_agreement"] == b["layer_agreement"]
    acc, small = _stream(input_blind, n_texts=30, permutations=3, baseline_sample=64)
    assert acc._sample.routes().shape == (64, 3, 2) and acc.n_tokens > 64
    assert small["baselines"]["exact"] is False and small["baselines"]["sampled_tokens"] == 64
    for v in small["vocabulary"]["by_layer"]:
        assert v["weighted_max_ratio"] == pytest.approx(v["baseline"], rel=0.15)


def test_router_indices_decide_the_selection():
    """The router's own top-k (here a group limit that drops the best expert) is what gets counted."""
    acc = SpecializationAccumulator(1, 4, 2)
    probs = np.array([[[0.4, 0.3, 0.2, 0.1]], [[0.1, 0.2, 0.3, 0.4]]])
    chosen = np.array([[[2, 3]], [[3, 0]]])  # not the top 2 of the probabilities
    acc.update(np.array([1, 2]), probs, text_index=0, selected=chosen)
    np.testing.assert_array_equal(acc.load[0], [1, 0, 1, 2])
    np.testing.assert_array_equal(acc.first[0], [0, 0, 1, 1])  # best-scored of the selected
    np.testing.assert_allclose(acc.importance[0], [0.5, 0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[T, L, k\]"):
        acc.update(np.array([1]), probs[:1], text_index=1, selected=np.array([[[1]]]))
    with pytest.raises(ValueError, match="outside"):
        acc.update(np.array([1]), probs[:1], text_index=1, selected=np.array([[[1, 4]]]))
    with pytest.raises(ValueError, match="twice"):
        acc.update(np.array([1]), probs[:1], text_index=1, selected=np.array([[[1, 1]]]))
    with pytest.raises(ValueError, match="integer"):
        acc.update(np.array([1]), probs[:1], text_index=1, selected=np.array([[[1.0, 2.0]]]))


def _dispatched(model, routers, ids):
    """Per MoE layer, the experts each block actually runs for each token ``[T, k]`` on one text,
    read from the experts module's call (or, where the experts get no index tensor, the router
    output the block uses), by the capture oracle's decoders, not by the recorder's."""
    import torch

    from moee.capture import oracle

    found, handles = {}, []
    for i, spec in enumerate(routers):
        block = oracle._block_of(model, spec)
        if block is not None:

            def on_experts(module, args, kwargs, i=i):
                got = oracle._dispatch_from_call(args, kwargs)
                if got is not None:
                    found.setdefault(i, got[0])

            handles.append(block.experts.register_forward_pre_hook(on_experts, with_kwargs=True))

        def on_router(module, args, out, i=i):
            got = oracle._dispatch_from_router(module, out)
            if got is not None:
                found[i] = got[0]

        handles.append(spec.router.register_forward_hook(on_router))
    x = torch.tensor([ids])
    try:
        with torch.no_grad():
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [found[i].reshape(len(ids), -1).long().numpy() for i in range(len(routers))]


def _architectures():
    from moee.capture.registry import supported_architectures

    return supported_architectures()


@pytest.mark.all_architectures
@pytest.mark.parametrize("model_type", _architectures())
def test_report_counts_the_routers_own_selection(model_type, monkeypatch):
    """On a tiny model of every supported architecture, the experts the report counts for every
    token are the experts the MoE block dispatches (group limits, biases, skip experts included)."""
    from moee.analysis.specialization import SELECTION_CAPTURE_DERIVED
    from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    texts = [
        " ".join(TINY_WORDS[(7 * i + 3 * j) % len(TINY_WORDS)] for j in range(3 + 2 * i)) for i in range(5)
    ]
    embedder = MoEEmbedder(tiny_model(model_type), tiny_tokenizer())
    counted = {}
    update = SpecializationAccumulator.update

    def spy(self, ids, *args, **kwargs):
        update(self, ids, *args, **kwargs)
        counted[kwargs["text_index"]] = (np.asarray(ids).tolist(), np.sort(self.last_selection, axis=2))

    monkeypatch.setattr(SpecializationAccumulator, "update", spy)
    options = ReportOptions(min_token_count=1, draws=BaselineDraws(permutations=1))
    rep = build_report(embedder, texts, batch_size=2, progress=False, options=options)
    assert sorted(counted) == list(range(len(texts)))
    for ids, selection in counted.values():
        truth = _dispatched(embedder.model, embedder.routers, ids)
        for layer, expected in enumerate(truth):
            np.testing.assert_array_equal(
                selection[:, layer], np.sort(expected, axis=1), err_msg=f"layer {layer}"
            )
    sources = rep["summary"]["selection_by_layer"]
    assert set(sources) <= {SELECTION_RETURNED, SELECTION_CAPTURE_DERIVED}
    if model_type == "dbrx":  # its router returns no indices: the report says they are re-derived
        assert set(sources) == {SELECTION_CAPTURE_DERIVED}
    assert html.escape(rep["summary"]["selection"]) in render_html(rep)


# ---------------------------------------------------------------------- statistics helpers, by hand


def test_cv_and_entropy_hand_computed():
    from moee.analysis.specialization import _cv, _entropy

    assert _cv(np.array([0.2, 0.6])) == pytest.approx(0.2 / 0.4)  # population std 0.2, mean 0.4
    assert _cv(np.zeros(3)) == 0.0  # no load at all: 0, not NaN
    assert _entropy(np.array([0, 2, 2])) == pytest.approx(np.log(2))  # empty experts ignored
    assert _entropy(np.array([1, 1])) == pytest.approx(np.log(2))
    assert _entropy(np.array([0.25, 0.75])) == pytest.approx(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)))
    assert _entropy(np.zeros(2)) == 0.0


def test_nmi_and_matching_of_tables_hand_computed():
    from moee.analysis.specialization import _matched_from_table, _nmi_from_table

    # [[2, 0], [1, 1]] over 4 tokens: MI = sum p_ij log(p_ij / (p_i p_j)); arithmetic-mean entropies
    mi = (
        0.5 * np.log(0.5 / (0.5 * 0.75))
        + 0.25 * np.log(0.25 / (0.5 * 0.75))
        + 0.25 * np.log(0.25 / (0.5 * 0.25))
    )
    h_rows, h_cols = np.log(2), -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    table = np.array([[2.0, 0.0], [1.0, 1.0]])
    assert _nmi_from_table(table) == pytest.approx(mi / ((h_rows + h_cols) / 2))
    # a 2x3 table: the same formula written out cell by cell
    t = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    n, r, c = t.sum(), t.sum(1), t.sum(0)
    mi = sum(t[i, j] / n * np.log(n * t[i, j] / (r[i] * c[j])) for i in range(2) for j in range(3) if t[i, j])
    h = lambda v: -sum(x / n * np.log(x / n) for x in v if x)  # noqa: E731
    assert _nmi_from_table(t) == pytest.approx(mi / ((h(r) + h(c)) / 2))
    assert _nmi_from_table(np.array([[2.0, 0.0], [0.0, 2.0]])) == pytest.approx(1.0)
    assert _nmi_from_table(np.array([[3.0]])) == 1.0  # one expert on each side: identical
    assert _nmi_from_table(np.array([[1.0]])) == 1.0
    assert _nmi_from_table(np.zeros((2, 2))) == 0.0
    # best one-to-one matching: [[3, 2], [2, 0]] -> 2 + 2 of 7 (greedy would take 3 + 0)
    assert _matched_from_table(np.array([[3, 2], [2, 0]])) == pytest.approx(4 / 7)
    assert _matched_from_table(np.array([[1]])) == 1.0
    assert _matched_from_table(np.zeros((2, 2))) == 0.0


def test_group_blocks_by_hand():
    from moee.analysis.specialization import _group_blocks

    ends = np.array([2, 5, 6, 10])  # groups of 2, 3, 1, 4 tokens
    assert list(_group_blocks(ends, 2, 5)) == [(0, 2, 0, 5), (2, 4, 5, 10)]
    assert list(_group_blocks(ends, 10, 5)) == [(0, 2, 0, 5), (2, 4, 5, 10)]
    assert list(_group_blocks(ends, 1, 100)) == [(0, 1, 0, 2), (1, 2, 2, 5), (2, 3, 5, 6), (3, 4, 6, 10)]
    assert list(_group_blocks(np.array([2, 5]), 10, 5)) == [(0, 2, 0, 5)]  # exactly max_tokens fits
    assert list(_group_blocks(np.array([10, 12]), 10, 3)) == [
        (0, 1, 0, 10),
        (1, 2, 10, 12),
    ]  # a long group alone


def test_permuted_group_max_edge_cases():
    from moee.analysis.specialization import _permuted_group_max

    rng = np.random.default_rng(0)
    one_route = np.array([[[1, 3]]])  # R=1, L=1, k=2: every token draws experts 1 and 3
    out = _permuted_group_max(np.array([1, 4]), one_route, 4, rng)
    assert out.dtype == np.int64 and out.tolist() == [[1], [4]]
    assert _permuted_group_max(np.array([1]), np.array([[[0, 1]], [[2, 3]]]), 4, rng).tolist() == [[1]]
    assert _permuted_group_max(np.array([3]), np.zeros((0, 1, 2), dtype=np.int16), 4, rng).tolist() == [[0]]
    # many layers x k: the groups span several token blocks, each group still counted whole
    L, k, E = 64, 64, 64
    sample = np.broadcast_to(np.arange(k, dtype=np.int16), (5, L, k))  # every route selects every expert
    sizes = np.array([1500, 5000, 1500])  # the 5000 alone spans three token blocks of 2048
    assert (_permuted_group_max(sizes, sample, E, rng) == sizes[:, None]).all()


def test_random_table_keeps_both_margins():
    from moee.analysis.specialization import _random_table

    rows, cols = np.array([1, 2, 0, 3]), np.array([3, 1, 2])
    for seed in range(5):
        table = _random_table(rows, cols, np.random.default_rng(seed))
        assert table.sum(1).tolist() == rows.tolist() and table.sum(0).tolist() == cols.tolist()


def test_selected_duplicate_message():
    acc = SpecializationAccumulator(1, 4, 2)
    with pytest.raises(ValueError, match="^selected lists the same expert twice for one token$"):
        acc.update(np.array([1]), np.full((1, 1, 4), 0.25), text_index=0, selected=np.array([[[2, 2]]]))


@pytest.mark.slow
def test_layer_agreement_baseline_with_unequal_margins():
    """Layer 0 first choices e0 e0 e0 e1, layer 1 e0 e1 e1 e1. Pairing them at random, the single
    e0 of layer 1 meets an e0 of layer 0 with probability 3/4 (table [[1, 2], [0, 1]], best
    matching 2 of 4) and the e1 otherwise ([[0, 3], [1, 0]], 4 of 4): 3/4 * 1/2 + 1/4 * 1 = 5/8."""
    acc = SpecializationAccumulator(2, 2, 1, draws=BaselineDraws(permutations=3000, seed=4))
    hi, lo = [0.9, 0.1], [0.1, 0.9]
    route = np.array([[hi, hi], [hi, lo], [hi, lo], [lo, lo]])
    acc.update(np.array([1, 2, 3, 4]), route, text_index=0)
    pair = acc.result(decode, min_token_count=1)["layer_agreement"]["pairs"][0]
    assert pair["matched_baseline"] == pytest.approx(5 / 8, abs=0.02)
    # E=3, layer 0 e0 e0 e1 e2, layer 1 e0 e0 e0 e1: layer 1's e1 meets a layer-0 e0 (p 1/2, best
    # matching 2 of 4) or the e1 / e2 (p 1/2, 3 of 4): 5/8 again, while pairing with the margins
    # of layer 0 on both sides would give 3/4
    acc = SpecializationAccumulator(2, 3, 1, draws=BaselineDraws(permutations=3000, seed=4))
    e = np.eye(3) * 0.8 + 0.1
    acc.update(
        np.array([1, 2, 3, 4]),
        np.stack([[e[0], e[0]], [e[0], e[0]], [e[1], e[0]], [e[2], e[1]]]),
        text_index=0,
    )
    pair = acc.result(decode, min_token_count=1)["layer_agreement"]["pairs"][0]
    assert pair["matched_baseline"] == pytest.approx(5 / 8, abs=0.02)


def test_repetition_baseline_for_one_and_two_tokens():
    acc = SpecializationAccumulator(2, 3, 1)
    acc.update(np.array([1]), TEXT1, text_index=0)
    assert acc.baselines()["repetition"] == [0.0, 0.0]  # no pair of tokens at all
    acc = SpecializationAccumulator(2, 3, 1)
    acc.update(np.array([1, 2]), np.concatenate([TEXT1, TEXT1]), text_index=0)
    assert acc.baselines()["repetition"] == [1.0, 1.0]  # the only two tokens share their choice


def test_baselines_method_block_and_min_token_count():
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=4, seed=9))
    probs = np.array([[[0.9, 0.1]], [[0.8, 0.2]], [[0.3, 0.7]], [[0.1, 0.9]], [[0.6, 0.4]]])
    acc.update(np.array([5, 5, 6, 6, 7]), probs, text_index=0, domain="d")
    base = acc.baselines()
    assert base == acc.baselines(5)  # the default min_token_count is 5, and the result is seeded
    assert base["vocabulary"] == [None]  # no type seen 5 times
    assert acc.baselines(2)["vocabulary"][0] is not None  # types seen exactly twice count
    acc.update(np.array([7, 7, 7, 7]), probs[:4], text_index=1)  # type 7 now seen exactly 5 times
    assert acc.baselines()["vocabulary"][0] is not None
    assert base["method"] == {
        "kind": "permutation",
        "permutations": 4,
        "seed": 9,
        "sampled_tokens": 5,  # before the second text
        "exact": True,
        "vocabulary": "routes of the counted tokens (types seen >= min_token_count times) shuffled "
        "against those tokens",
        "token_specialization": "routes of the counted tokens (types seen >= min_token_count times) "
        "shuffled against the token of each key (input, next, predicted); random routing k/E beside it",
        "domains": "domain labels shuffled across texts, each text keeping its tokens and routes "
        "(max fraction and JSD)",
        "layer_agreement": "first choices of layer l+1 shuffled against layer l (exact margins)",
        "cross_layer": "top-k sets of layer l+1 shuffled against layer l's within the route sample",
        "repetition": "each text's first choices shuffled against its own positions (exact expectation)",
        "coactivation": "the max over pairs on a null sample of as many tokens: each layer's selected "
        "experts shuffled across tokens (loads kept, k distinct experts a token); (k-1) q_b / (1 - q_a), "
        "independent choice with the observed loads q, is each cell's expectation",
        "saturation": "the checkpoint's routes shuffled against the tokens (exact "
        "expectation: product of the two marginals); random routing 1/E (top-1), k/E (top-k)",
    }


def test_permuted_group_max_with_replacement_draws_every_route():
    from moee.analysis.specialization import _permuted_group_max

    sample = np.array([[[0]], [[1]]])  # two routes: expert 0 or expert 1 (k=1)
    maxima = [
        _permuted_group_max(np.array([200]), sample, 2, np.random.default_rng(s))[0, 0] for s in range(5)
    ]
    assert all(100 <= m < 140 for m in maxima)  # about half each, never all of one


def test_vocabulary_section_by_hand():
    """L=1, E=4, k=1. Type 6: 8 times, always expert 2; types 10..29: twice each, always expert
    id % 4; type 5: three times, experts 1, 1, 3. Ranking score max_ratio * log(1 + N_x)."""
    ids, experts = [6] * 8, [2] * 8
    for t in range(10, 30):
        ids += [t, t]
        experts += [t % 4, t % 4]
    ids += [5, 5, 5]
    experts += [1, 1, 3]
    probs = np.full((len(ids), 1, 4), 0.1)
    probs[np.arange(len(ids)), 0, experts] = 0.7
    acc = SpecializationAccumulator(1, 4, 1, draws=BaselineDraws(permutations=2))
    acc.update(np.array(ids), probs, text_index=0)
    voc = acc.result(decode, min_token_count=2)["vocabulary"]
    (layer,) = voc["by_layer"]
    assert voc["min_token_count"] == 2 and layer["layer"] == 0 and layer["n_token_types"] == 22
    assert layer["weighted_max_ratio"] == pytest.approx((8 + 40 + 2) / 51)
    top = layer["top"]
    assert len(top) == 15
    assert top[0] == {"token": "w6", "expert": 2, "ratio": 1.0, "n_x": 8}
    # the 20 tied types keep their id order (stable sort); type 5 (2/3 * log 4) comes after them
    assert [t["token"] for t in top[1:]] == [f"w{t}" for t in range(10, 24)]
    assert [t["expert"] for t in top[1:]] == [t % 4 for t in range(10, 24)]
    assert all(t["n_x"] == 2 and t["ratio"] == 1.0 for t in top[1:])
    # the last type in id order (29, ratio 1) and the split type get the right best expert
    full = acc.result(decode, min_token_count=3)["vocabulary"]["by_layer"][0]
    assert full["top"] == [
        {"token": "w6", "expert": 2, "ratio": 1.0, "n_x": 8},
        {"token": "w5", "expert": 1, "ratio": pytest.approx(2 / 3), "n_x": 3},
    ]
    # no type qualifies in any layer: an empty entry per layer
    acc = SpecializationAccumulator(2, 3, 1)
    acc.update(TEXT0_IDS, TEXT0, text_index=0)
    empty = acc.result(decode, min_token_count=5)["vocabulary"]["by_layer"]
    assert empty == [
        {"layer": i, "n_token_types": 0, "weighted_max_ratio": None, "top": [], "baseline": None}
        for i in range(2)
    ]
