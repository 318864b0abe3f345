"""MoEEmbedder public API on a tiny OLMoE: shapes, order, batch invariance, bad input, loading."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from moee.capture import RoutingRecorder
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed import embedder as embedder_module
from moee.embed.embedder import MoEEmbedder, RoutingTrace

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big green tree",
    "music",
    "",
    "the quick bird flew over the river at night while the sun sat on the mountain",
    "happy sad happy sad",
    "rain",
]


@pytest.fixture(scope="module")
def emb() -> MoEEmbedder:
    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer())


def test_attributes(emb):
    assert (emb.n_moe_layers, emb.n_experts, emb.hidden_size) == (2, 8, 64)
    assert emb.layers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert emb.tokenizer.padding_side == "left"
    assert "MoEEmbedder" in repr(emb)


@pytest.mark.parametrize(("method", "dim"), [("hs", 64), ("rw", 16), ("moee_concat", 80), ("moee_sum", 80)])
def test_encode_shapes_and_norms(emb, method, dim):
    out = emb.encode(TEXTS, method=method)
    assert out.shape == (len(TEXTS), dim) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert emb.encode([], method=method).shape == (0, dim)


def test_rows_follow_input_order(emb):
    forward = emb.encode(TEXTS, method="moee_concat")
    backward = emb.encode(TEXTS[::-1], method="moee_concat")
    assert np.abs(forward - backward[::-1]).max() <= 1e-5
    one_by_one = np.stack([emb.encode([t], method="moee_concat")[0] for t in TEXTS])
    assert np.abs(forward - one_by_one).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("method", ["hs", "rw", "moee_sum"])
def test_batch_invariance(emb, method, pooling):
    alone = np.stack([emb.encode([t], method=method, pooling=pooling)[0] for t in TEXTS])
    for batch_size in (1, 2, 7):
        batched = emb.encode(TEXTS, method=method, pooling=pooling, batch_size=batch_size)
        assert np.abs(batched - alone).max() <= 1e-5, batch_size
    # alone vs in a batch with much longer texts
    longer = ["the cat " * 30, TEXTS[2], "big small red blue green " * 10]
    assert np.abs(emb.encode(longer, method=method, pooling=pooling)[1] - alone[2]).max() <= 1e-5


def test_right_padding_gives_the_same_vectors(emb):
    """The embedder pads left; a right-padded batch through the recorder gives the same pooling."""
    trace = emb.trace(TEXTS[:3])
    seqs = emb._tokenize(TEXTS[:3])
    width = max(map(len, seqs))
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with RoutingRecorder(emb.model) as rec, torch.inference_mode():
        rec.set_batch(mask)
        emb.model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert np.abs(rec.pooled_rw().numpy() - trace.rw).max() <= 1e-5
    assert np.abs(rec.pooled_hs().numpy() - trace.hs).max() <= 1e-5


def test_trace(emb):
    trace = emb.trace(TEXTS, hs_layers=True, score="softmax")
    assert isinstance(trace, RoutingTrace)
    assert trace.rw.shape == (7, 2, 8) and trace.hs.shape == (7, 64)
    assert trace.hs_all_layers.shape == (7, 2, 64)
    assert trace.layers == emb.layers and trace.n_experts == 8
    assert np.allclose(trace.rw.sum(-1), 1.0, atol=1e-5)
    assert emb.trace(TEXTS).hs_all_layers is None
    logits = emb.trace(TEXTS, score="logits").rw
    assert np.allclose(torch.softmax(torch.from_numpy(logits), -1).numpy(), trace.rw, atol=1e-6)
    empty = emb.trace([])
    assert empty.rw.shape == (0, 2, 8) and empty.hs.shape == (0, 64)


def test_rw_embedding_is_the_concatenated_distributions(emb):
    trace = emb.trace(TEXTS)
    rw = emb.encode(TEXTS, method="rw", normalize=False)
    assert np.allclose(rw, trace.rw.reshape(7, 16), atol=1e-6)


def test_moee_sum_identity(emb):
    alpha = 0.7
    s = emb.encode(TEXTS, method="moee_sum", alpha=alpha)
    h = emb.encode(TEXTS, method="hs")
    r = emb.encode(TEXTS, method="rw")
    assert np.allclose(s @ s.T, (h @ h.T + alpha * (r @ r.T)) / (1 + alpha), atol=1e-5)


def test_iter_token_routes_matches_trace(emb):
    routes = list(emb.iter_token_routes(TEXTS, batch_size=3))
    assert [r.index for r in routes] == list(range(7))
    last = emb.trace(TEXTS, pooling="last").rw
    mean = emb.trace(TEXTS, pooling="mean").rw
    for r in routes:
        assert r.probs.shape == (len(r.input_ids), 2, 8) and r.probs.dtype == np.float32
        assert np.abs(r.probs[-1] - last[r.index]).max() <= 1e-5
        assert np.abs(r.probs.mean(axis=0) - mean[r.index]).max() <= 1e-5
    assert sum(len(m._forward_hooks) for m in emb.model.modules()) == 0


def test_empty_text_is_encoded_as_bos(emb):
    trace = emb.trace(["", "rain"])
    bos = emb.trace(["[BOS]"])
    assert np.abs(trace.rw[0] - bos.rw[0]).max() <= 1e-6
    assert np.isfinite(emb.encode(["", ""], method="moee_sum")).all()


def test_prompts_change_the_input(emb):
    plain = emb.encode(TEXTS[:2], method="hs")
    eol = emb.encode(TEXTS[:2], method="hs", prompt="prompteol")
    custom = emb.encode(TEXTS[:2], method="hs", prompt="the {text} sat")
    assert not np.allclose(plain, eol) and not np.allclose(plain, custom)


def test_truncation_warns_and_keeps_rows(emb):
    short = MoEEmbedder(emb.model, emb.tokenizer, max_length=5)
    with pytest.warns(UserWarning, match="2 of 3 texts were longer than 5 tokens"):
        out = short.encode([TEXTS[0], "rain", TEXTS[4]], method="rw")
    assert out.shape == (3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short.encode(["rain"], method="rw")


def test_progress_bar(emb, capsys):
    emb.encode(TEXTS[:2], method="rw", show_progress_bar=True)
    assert "moee" in capsys.readouterr().err
    emb.encode(TEXTS[:2], method="rw")  # auto: off for short inputs
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"texts": "a single string"}, TypeError, "list of str"),
        ({"texts": None}, TypeError, "texts must be"),
        ({"texts": ["ok", None]}, TypeError, r"texts\[1\] is None"),
        ({"texts": ["ok", 3]}, TypeError, r"texts\[1\] must be a str"),
        ({"method": "avg"}, ValueError, "unknown method 'avg'"),
        ({"pooling": "max"}, ValueError, "unknown pooling 'max'"),
        ({"score": "probs"}, ValueError, "unknown score 'probs'"),
        ({"prompt": "no placeholder"}, ValueError, "unknown prompt"),
        ({"alpha": -0.5}, ValueError, "alpha must be >= 0"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ],
)
def test_bad_input(emb, kwargs, error, match):
    kwargs = {"texts": ["ok"], **kwargs}
    with pytest.raises(error, match=match):
        emb.encode(kwargs.pop("texts"), **kwargs)


def test_model_without_router_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
    )
    with pytest.raises(ValueError, match="no MoE router found in LlamaForCausalLM"):
        MoEEmbedder(AutoModelForCausalLM.from_config(config), tiny_tokenizer())


def test_from_pretrained_roundtrip(emb, tmp_path):
    emb.model.save_pretrained(tmp_path)
    emb.tokenizer.save_pretrained(tmp_path)
    loaded = MoEEmbedder.from_pretrained(tmp_path, device="cpu", dtype="float32")
    assert loaded.name_or_path == str(tmp_path)
    assert np.abs(loaded.encode(TEXTS) - emb.encode(TEXTS)).max() <= 1e-6


def test_from_pretrained_default_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(embedder_module, "DEFAULT_MODEL_DIR", tmp_path / "default-model")
    with pytest.raises(FileNotFoundError, match="default model is not installed"):
        MoEEmbedder.from_pretrained()


def test_from_pretrained_device_and_device_map_conflict(tmp_path):
    with pytest.raises(ValueError, match="either device or device_map"):
        MoEEmbedder.from_pretrained(tmp_path, device="cpu", device_map="auto")


def test_bad_max_length(emb):
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        MoEEmbedder(emb.model, emb.tokenizer, max_length=0)
    with pytest.raises(TypeError, match="tokenizer"):
        MoEEmbedder(emb.model, None)


def test_concurrent_encode_from_threads_equals_serial(emb):
    """Threads share the model's routers: every traced forward holds the model's lock, so no thread
    sees another thread's hooks fire (wrong rows) and none raises "router ran twice"."""
    import threading

    other = MoEEmbedder(emb.model, emb.tokenizer)  # a second embedder of the same model shares the lock
    jobs = [
        (e, [f"{TEXTS[(i + j) % len(TEXTS)]} {i}" for j in range(3 + i % 4)], method)
        for i, (e, method) in enumerate(
            [(emb, "moee_sum"), (other, "rw"), (emb, "hs"), (other, "moee_concat")] * 2
        )
    ]
    expected = [e.encode(texts, method=method, batch_size=2) for e, texts, method in jobs]
    expected_routes = [r.probs for r in emb.iter_token_routes(TEXTS, batch_size=2)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def work(k: int) -> None:
        e, texts, method = jobs[k]
        try:
            barrier.wait()
            out = [e.encode(texts, method=method, batch_size=2) for _ in range(10)]
            out.append([r.probs for r in e.iter_token_routes(TEXTS, batch_size=2)])
            results[k] = out
        except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, out in results.items():
        for got in out[:-1]:
            np.testing.assert_array_equal(got, expected[k])
        for got, want in zip(out[-1], expected_routes, strict=True):
            np.testing.assert_array_equal(got, want)
    assert sum(len(m._forward_hooks) for m in emb.model.modules()) == 0


def test_last_truncation_counts_the_texts_each_call_truncated(emb):
    short = MoEEmbedder(emb.model, emb.tokenizer, max_length=5)
    for _ in range(2):  # the same count again: Python would not show the same warning twice
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            short.encode([TEXTS[0], "rain", TEXTS[4]], method="rw")
        assert short.last_truncation == 2
    short.encode(["rain"], method="rw")
    assert short.last_truncation == 0
