"""MoEEmbedder public API on a tiny OLMoE: shapes, order, batch invariance, bad input, loading."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from moee.capture import RoutingRecorder
from moee.capture.tiny import tiny_tokenizer
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


def test_attributes(tiny_embedder):
    assert (tiny_embedder.n_moe_layers, tiny_embedder.n_experts, tiny_embedder.hidden_size) == (2, 8, 64)
    assert tiny_embedder.layers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert tiny_embedder.tokenizer.padding_side == "left"
    assert "MoEEmbedder" in repr(tiny_embedder)


@pytest.mark.parametrize(("method", "dim"), [("hs", 64), ("rw", 16), ("moee_concat", 80), ("moee_sum", 80)])
def test_encode_shapes_and_norms(tiny_embedder, method, dim):
    out = tiny_embedder.encode(TEXTS, method=method)
    assert out.shape == (len(TEXTS), dim) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert tiny_embedder.encode([], method=method).shape == (0, dim)


def test_rows_follow_input_order(tiny_embedder):
    forward = tiny_embedder.encode(TEXTS, method="moee_concat")
    backward = tiny_embedder.encode(TEXTS[::-1], method="moee_concat")
    assert np.abs(forward - backward[::-1]).max() <= 1e-5
    one_by_one = np.stack([tiny_embedder.encode([t], method="moee_concat")[0] for t in TEXTS])
    assert np.abs(forward - one_by_one).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("method", ["hs", "rw", "moee_sum"])
def test_batch_invariance(tiny_embedder, method, pooling):
    alone = np.stack([tiny_embedder.encode([t], method=method, pooling=pooling)[0] for t in TEXTS])
    for batch_size in (1, 2, 7):
        batched = tiny_embedder.encode(TEXTS, method=method, pooling=pooling, batch_size=batch_size)
        assert np.abs(batched - alone).max() <= 1e-5, batch_size
    # alone vs in a batch with much longer texts
    longer = ["the cat " * 30, TEXTS[2], "big small red blue green " * 10]
    assert np.abs(tiny_embedder.encode(longer, method=method, pooling=pooling)[1] - alone[2]).max() <= 1e-5


def test_right_padding_gives_the_same_vectors(tiny_embedder):
    """The embedder pads left; a right-padded batch through the recorder gives the same pooling."""
    trace = tiny_embedder.trace(TEXTS[:3])
    seqs = tiny_embedder._tokenize(TEXTS[:3])
    width = max(map(len, seqs))
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with RoutingRecorder(tiny_embedder.model) as rec, torch.inference_mode():
        rec.set_batch(mask)
        tiny_embedder.model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert np.abs(rec.pooled_rw().numpy() - trace.rw).max() <= 1e-5
    assert np.abs(rec.pooled_hs().numpy() - trace.hs).max() <= 1e-5


def test_trace(tiny_embedder):
    trace = tiny_embedder.trace(TEXTS, hs_layers=True, score="softmax")
    assert isinstance(trace, RoutingTrace)
    assert trace.rw.shape == (7, 2, 8) and trace.hs.shape == (7, 64)
    assert trace.hs_all_layers.shape == (7, 2, 64)
    assert trace.layers == tiny_embedder.layers and trace.n_experts == 8
    assert np.allclose(trace.rw.sum(-1), 1.0, atol=1e-5)
    assert tiny_embedder.trace(TEXTS).hs_all_layers is None
    logits = tiny_embedder.trace(TEXTS, score="logits").rw
    assert np.allclose(torch.softmax(torch.from_numpy(logits), -1).numpy(), trace.rw, atol=1e-6)
    empty = tiny_embedder.trace([])
    assert empty.rw.shape == (0, 2, 8) and empty.hs.shape == (0, 64)


def test_rw_embedding_is_the_concatenated_distributions(tiny_embedder):
    trace = tiny_embedder.trace(TEXTS)
    rw = tiny_embedder.encode(TEXTS, method="rw", normalize=False)
    assert np.allclose(rw, trace.rw.reshape(7, 16), atol=1e-6)


def test_moee_sum_identity(tiny_embedder):
    alpha = 0.7
    s = tiny_embedder.encode(TEXTS, method="moee_sum", alpha=alpha)
    h = tiny_embedder.encode(TEXTS, method="hs")
    r = tiny_embedder.encode(TEXTS, method="rw")
    assert np.allclose(s @ s.T, (h @ h.T + alpha * (r @ r.T)) / (1 + alpha), atol=1e-5)


def test_iter_token_routes_matches_trace(tiny_embedder):
    routes = list(tiny_embedder.iter_token_routes(TEXTS, batch_size=3))
    assert [r.index for r in routes] == list(range(7))
    last = tiny_embedder.trace(TEXTS, pooling="last").rw
    mean = tiny_embedder.trace(TEXTS, pooling="mean").rw
    for r in routes:
        assert r.probs.shape == (len(r.input_ids), 2, 8) and r.probs.dtype == np.float32
        assert np.abs(r.probs[-1] - last[r.index]).max() <= 1e-5
        assert np.abs(r.probs.mean(axis=0) - mean[r.index]).max() <= 1e-5
    assert sum(len(m._forward_hooks) for m in tiny_embedder.model.modules()) == 0


def test_empty_text_is_encoded_as_bos(tiny_embedder):
    trace = tiny_embedder.trace(["", "rain"])
    bos = tiny_embedder.trace(["[BOS]"])
    assert np.abs(trace.rw[0] - bos.rw[0]).max() <= 1e-6
    assert np.isfinite(tiny_embedder.encode(["", ""], method="moee_sum")).all()


def test_prompts_change_the_input(tiny_embedder):
    plain = tiny_embedder.encode(TEXTS[:2], method="hs")
    eol = tiny_embedder.encode(TEXTS[:2], method="hs", prompt="prompteol")
    custom = tiny_embedder.encode(TEXTS[:2], method="hs", prompt="the {text} sat")
    assert not np.allclose(plain, eol) and not np.allclose(plain, custom)


def test_truncation_warns_and_keeps_rows(tiny_embedder):
    short = MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, max_length=5)
    with pytest.warns(UserWarning, match="2 of 3 texts were longer than 5 tokens"):
        out = short.encode([TEXTS[0], "rain", TEXTS[4]], method="rw")
    assert out.shape == (3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short.encode(["rain"], method="rw")


def test_progress_bar(tiny_embedder, capsys):
    tiny_embedder.encode(TEXTS[:2], method="rw", show_progress_bar=True)
    assert "moee" in capsys.readouterr().err
    tiny_embedder.encode(TEXTS[:2], method="rw")  # auto: off for short inputs
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"texts": b"bytes, not text"},
            TypeError,
            "list of str",
        ),  # one str is one text (test_embed_st_api.py)
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
def test_bad_input(tiny_embedder, kwargs, error, match):
    kwargs = {"texts": ["ok"], **kwargs}
    with pytest.raises(error, match=match):
        tiny_embedder.encode(kwargs.pop("texts"), **kwargs)


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


def test_from_pretrained_roundtrip(tiny_embedder, tmp_path):
    tiny_embedder.model.save_pretrained(tmp_path)
    tiny_embedder.tokenizer.save_pretrained(tmp_path)
    loaded = MoEEmbedder.from_pretrained(tmp_path, device="cpu", dtype="float32")
    assert loaded.name_or_path == str(tmp_path)
    assert np.abs(loaded.encode(TEXTS) - tiny_embedder.encode(TEXTS)).max() <= 1e-6


def test_from_pretrained_default_missing(monkeypatch, tmp_path):
    import dataclasses

    from moee.models import bundled

    default = bundled.BUNDLED[bundled.DEFAULT_MODEL]
    missing = dataclasses.replace(default, config_dir=tmp_path / "default-model")
    monkeypatch.setitem(bundled.BUNDLED, bundled.DEFAULT_MODEL, missing)
    with pytest.raises(FileNotFoundError, match=f"shipped model '{bundled.DEFAULT_MODEL}' is not installed"):
        MoEEmbedder.from_pretrained()


def test_from_pretrained_device_and_device_map_conflict(tmp_path):
    with pytest.raises(ValueError, match="either device or device_map"):
        MoEEmbedder.from_pretrained(tmp_path, device="cpu", device_map="auto")


def test_bad_max_length(tiny_embedder):
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, max_length=0)
    with pytest.raises(TypeError, match="tokenizer"):
        MoEEmbedder(tiny_embedder.model, None)


@pytest.mark.slow
def test_concurrent_encode_from_threads_equals_serial(tiny_embedder):
    """Threads share the model's routers: every traced forward holds the model's lock, so no thread
    sees another thread's hooks fire (wrong rows) and none raises "router ran twice"."""
    import threading

    other = MoEEmbedder(
        tiny_embedder.model, tiny_embedder.tokenizer
    )  # a second embedder of the same model shares the lock
    jobs = [
        (e, [f"{TEXTS[(i + j) % len(TEXTS)]} {i}" for j in range(3 + i % 4)], method)
        for i, (e, method) in enumerate(
            [(tiny_embedder, "moee_sum"), (other, "rw"), (tiny_embedder, "hs"), (other, "moee_concat")] * 2
        )
    ]
    expected = [e.encode(texts, method=method, batch_size=2) for e, texts, method in jobs]
    expected_routes = [r.probs for r in tiny_embedder.iter_token_routes(TEXTS, batch_size=2)]
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
    assert sum(len(m._forward_hooks) for m in tiny_embedder.model.modules()) == 0


def test_last_truncation_counts_the_texts_each_call_truncated(tiny_embedder):
    short = MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, max_length=5)
    for _ in range(2):  # the same count again: Python would not show the same warning twice
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            short.encode([TEXTS[0], "rain", TEXTS[4]], method="rw")
        assert short.last_truncation == 2
    short.encode(["rain"], method="rw")
    assert short.last_truncation == 0
