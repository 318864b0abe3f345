"""Expert-specialization accumulators on hand-made routes, and report assembly without a model."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from moee.analysis.specialization import (
    REPORT_SECTIONS,
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
    # first-choice marginal of L1 is [1, 1, 2] / 4
    assert rep["repetition"]["by_layer"][1]["marginal_baseline"] == pytest.approx((1 + 1 + 4) / 16)
    pair = rep["layer_agreement"]["pairs"][0]
    assert pair["layers"] == [0, 1]
    assert pair["matched_agreement"] == pytest.approx(0.5)  # joint (0,2),(1,2),(0,0),(1,1)
    assert 0 <= pair["nmi"] <= 1


def test_domain_and_vocabulary_specialization(hand_made):
    _, rep = hand_made
    doms = rep["domains"]
    assert doms["available"] and doms["uniform"] == pytest.approx(1 / 3)
    assert doms["domains"]["a"]["n_tokens"] == 3
    np.testing.assert_allclose(doms["domains"]["a"]["fraction"][0], [2 / 3, 1 / 3, 0], atol=1e-6)
    np.testing.assert_allclose(doms["domains"]["b"]["fraction"][0], [0, 1, 0])
    assert doms["domains"]["a"]["max_lift_by_layer"][0] == pytest.approx((2 / 3) / (1 / 3))
    voc = rep["vocabulary"]["by_layer"]
    assert voc[0]["weighted_max_ratio"] == pytest.approx(1.0)  # w5 -> e0 twice, w6 -> e1 twice
    assert voc[1]["weighted_max_ratio"] == pytest.approx((2 * 0.5 + 2 * 0.5) / 4)
    expert0 = rep["experts"][0][0]
    assert expert0["top_tokens"][0] == {"token": "w5", "token_id": 5, "count": 2, "share_of_token": 1.0}


def test_top_contexts_keep_the_strongest_positions(hand_made):
    _, rep = hand_made
    ctx = rep["experts"][0][0]["top_contexts"]  # L0 e0: probs 0.7 (pos 0), 0.6 (pos 2), 0.2, 0.1
    assert [c["prob"] for c in ctx] == pytest.approx([0.7, 0.6])
    assert ctx[0] == {"prob": pytest.approx(0.7), "text_index": 0, "left": "", "token": "w5", "right": "w6"}
    assert ctx[1]["left"] == "w6" and ctx[1]["right"] == ""
    ctx = rep["experts"][1][1]["top_contexts"]  # L1 e1: 0.4 from text 1 beats 0.25 / 0.2
    assert ctx[0]["text_index"] == 1 and ctx[0]["prob"] == pytest.approx(0.4)


def test_coactivation_with_top2():
    acc = SpecializationAccumulator(1, 3, 2)
    probs = np.array([[[0.5, 0.4, 0.1]], [[0.45, 0.45, 0.1]], [[0.5, 0.1, 0.4]]])
    acc.update(np.array([1, 2, 3]), probs, text_index=0)
    np.testing.assert_array_equal(acc.coactivation[0], [[3, 2, 1], [2, 2, 0], [1, 0, 1]])
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
    a = build_report(FakeEmbedder(), CORPUS, chunk_size=7, progress=False, min_token_count=1)
    b = build_report(FakeEmbedder(), CORPUS, chunk_size=1000, progress=False, min_token_count=1)
    assert_same_report(a, b)
    assert a["summary"]["top_k"] == 2 and a["summary"]["top_k_source"] == "config.num_experts_per_tok"
    ctx_texts = {c["text_index"] for row in a["experts"] for e in row for c in e["top_contexts"]}
    assert max(ctx_texts) >= 7  # global text indices survive chunking


def test_report_options_and_errors():
    rep = build_report(FakeEmbedder(), [t for t, _ in CORPUS], top_k=1, max_texts=5, progress=False)
    assert rep["summary"]["n_texts"] == 5 and rep["summary"]["top_k_source"] == "argument"
    assert rep["domains"]["available"] is False
    with pytest.raises(ValueError, match="top_k"):
        build_report(FakeEmbedder(), CORPUS, top_k=7, progress=False)
    with pytest.raises(ValueError, match="no texts"):
        build_report(FakeEmbedder(), [], progress=False)
    with pytest.raises(TypeError, match="corpus item 0"):
        build_report(FakeEmbedder(), [3], progress=False)


def test_render_html_is_self_contained_with_every_section():
    rep = build_report(FakeEmbedder(), CORPUS, progress=False)
    rep["meta"] = {"command": "moee report <test>"}
    page = render_html(rep)
    for section in REPORT_SECTIONS[1:]:
        assert f"id='{section}'" in page
    assert "data:image/png;base64," in page
    assert 'src="http' not in page and "<script" not in page
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
    assert rep["summary"]["selection"] == "router scores + selection bias"
    for layer in rep["layers"]:
        assert layer["load_fraction"][0] == pytest.approx(1 / 2)  # in every token's top 2
        assert sum(layer["importance_fraction"]) == pytest.approx(1.0, abs=1e-5)
