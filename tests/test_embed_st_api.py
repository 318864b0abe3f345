"""The sentence-transformers-shaped API of ``MoEEmbedder``: one string, ``normalize_embeddings``,
tensors, ``device``, named prompts (saved in moee_embedding.json), ``encode_query`` /
``encode_document``, ``similarity``; and ``moee.evaluation.get_model``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moee.embed.config import MODEL_CONFIG_FILE, load_model_prompts, save_model_config
from moee.embed.embedder import MoEEmbedder

PROMPTS = {"query": "query: {text}", "document": None, "pair": ["prompteol", "meaning"]}
TEXTS = ["the cat sat", "a dog", "red house by the river"]


@pytest.fixture(scope="module")
def emb(tiny_embedder) -> MoEEmbedder:
    return MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, prompts=PROMPTS)


def test_one_string_gives_one_vector(emb) -> None:
    one = emb.encode("the cat sat")
    assert one.ndim == 1
    np.testing.assert_array_equal(one, emb.encode(["the cat sat"])[0])


def test_normalize_embeddings_and_tensors(emb) -> None:
    raw = emb.encode(TEXTS, method="hs", normalize_embeddings=False)  # moee_sum rows are unit-length anyway
    np.testing.assert_array_equal(raw, emb.encode(TEXTS, method="hs", normalize=False))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    with pytest.raises(TypeError, match="not both"):
        emb.encode(TEXTS, normalize=True, normalize_embeddings=True)
    tensor = emb.encode(TEXTS, convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (3, emb.config_dim(emb.default_config))
    listed = emb.encode(TEXTS, convert_to_numpy=False)
    assert isinstance(listed, list) and len(listed) == 3 and listed[0].ndim == 1
    assert emb.encode(TEXTS, device="cpu").shape[0] == 3
    with pytest.raises(ValueError, match="the model is on cpu"):
        emb.encode(TEXTS, device="cuda")


@pytest.mark.slow
def test_prompt_name_and_query_document_prompts(emb) -> None:
    np.testing.assert_array_equal(
        emb.encode(TEXTS, prompt_name="query"), emb.encode(TEXTS, prompt="query: {text}")
    )
    np.testing.assert_array_equal(emb.encode_query(TEXTS), emb.encode(TEXTS, prompt="query: {text}"))
    np.testing.assert_array_equal(emb.encode_document(TEXTS), emb.encode(TEXTS, prompt=None))
    np.testing.assert_array_equal(
        emb.encode(TEXTS, prompt_name="pair"), emb.encode(TEXTS, prompt=["prompteol", "meaning"])
    )
    assert not np.allclose(emb.encode_query(TEXTS), emb.encode_document(TEXTS))
    with pytest.raises(
        ValueError, match=r"prompt_name='nope' is not one of the model's prompts \(document, pair, query\)"
    ):
        emb.encode(TEXTS, prompt_name="nope")
    with pytest.raises(TypeError, match="not both"):
        emb.encode(TEXTS, prompt_name="query", prompt="prompteol")


def test_without_named_prompts_query_and_document_use_the_model_prompt(tiny_embedder) -> None:
    np.testing.assert_array_equal(tiny_embedder.encode_query(TEXTS), tiny_embedder.encode(TEXTS))


def test_similarity_is_cosine(emb) -> None:
    a, b = (
        emb.encode(TEXTS, method="hs", normalize=False),
        emb.encode(TEXTS[:2], method="hs", normalize=False),
    )
    sim = emb.similarity(a, b)
    expected = (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (
        b / np.linalg.norm(b, axis=1, keepdims=True)
    ).T
    assert emb.similarity_fn_name == "cosine" and sim.shape == (3, 2)
    np.testing.assert_allclose(sim, expected, atol=1e-6)
    assert isinstance(emb.similarity(torch.from_numpy(a), b), torch.Tensor)
    assert emb.similarity(a[0], a[0]).shape == (1, 1)


def test_save_pretrained_round_trips_prompts(emb, tmp_path) -> None:
    emb.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / MODEL_CONFIG_FILE).read_text())
    assert doc["prompts"] == PROMPTS
    back = MoEEmbedder.from_pretrained(str(tmp_path))
    assert back.prompts == {"query": "query: {text}", "document": None, "pair": ("prompteol", "meaning")}
    np.testing.assert_allclose(back.encode_query(TEXTS), emb.encode_query(TEXTS), atol=1e-6)


def test_bad_prompts_are_refused(emb, tmp_path) -> None:
    with pytest.raises(ValueError, match="prompt 'q'"):
        save_model_config(emb.default_config, tmp_path, prompts={"q": "typo_name"})
    assert load_model_prompts(tmp_path) == {}


@pytest.mark.slow
def test_get_model_is_the_mteb_encoder_of_a_configuration(tiny_embedder) -> None:
    from moee.evaluation import get_model

    encoder = get_model(tiny_embedder, method="hs", pooling="mean")
    assert (encoder.config.method, encoder.config.pooling) == ("hs", "mean")
    np.testing.assert_allclose(
        encoder.embed_texts(TEXTS), tiny_embedder.encode(TEXTS, method="hs", pooling="mean"), atol=1e-6
    )
    with pytest.raises(TypeError, match="already loaded"):
        get_model(tiny_embedder, dtype="float32")
