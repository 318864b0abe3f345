"""The mteb encoder takes every configuration keyword, and embeds queries and documents with the
model's named prompts, as ``encode_query`` / ``encode_document`` do."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
from mteb.types import PromptType

from moee.embed.config import EmbeddingConfig
from moee.embed.embedder import MoEEmbedder
from moee.evaluation import get_model
from moee.evaluation.adapter import MoEEMTEBEncoder

TEXTS = ["the cat sat", "a dog", "red house by the river"]
PROMPTS = {"query": "query: {text}", "document": "This sentence: {text} means in one word:"}
TASK = SimpleNamespace(name="SomeRetrieval")


@pytest.mark.slow
@pytest.mark.parametrize(
    "keywords",
    [{"recipe": "echo"}, {"hs_layer": 2}, {"rw_layers": [0, 1]}, {"reference": None}, {"normalize": True}],
    ids=lambda k: next(iter(k)),
)
def test_get_model_takes_the_recipe_options_with_the_default_model(keywords):
    """They went to the model class (``MoEEUpcycledForCausalLM.__init__() got an unexpected keyword
    argument``); they are configuration fields, as ``encode`` takes them."""
    encoder = get_model(None, **keywords)
    name, value = next(iter(keywords.items()))
    expected = EmbeddingConfig(**{name: value})
    assert getattr(encoder.config, name) == getattr(expected, name)
    np.testing.assert_allclose(encoder.embed_texts(TEXTS), encoder.model.encode(TEXTS, **keywords), atol=1e-6)


def test_every_configuration_field_is_a_keyword_of_the_encoder(tiny_embedder):
    """A field added to ``EmbeddingConfig`` later is routed to the configuration too, never to
    ``from_pretrained`` (a loaded embedder refuses loading keywords by name)."""
    values = {"method": "hs", "pooling": "mean", "prompt": "prompteol", "score": "softmax", "alpha": 2.0}
    values |= {"normalize": True, "recipe": "echo", "hs_layer": 1, "rw_layers": [1], "reference": None}
    assert set(values) == {f.name for f in fields(EmbeddingConfig)}
    encoder = get_model(tiny_embedder, **values)
    assert encoder.config == EmbeddingConfig(**values)


def test_normalize_false_is_refused_with_the_way_to_raw_vectors(tiny_embedder):
    with pytest.raises(ValueError, match=r"always L2-normalises.*MoEEmbedder.encode\(normalize=False\)"):
        get_model(tiny_embedder, normalize=False)


def _encode(encoder, prompt_type):
    return encoder.encode(
        [{"text": TEXTS}], task_metadata=TASK, hf_split="test", hf_subset="default", prompt_type=prompt_type
    )


def test_mteb_queries_and_documents_use_the_models_named_prompts(tiny_embedder):
    """mteb names the side it encodes; the query vector was the plain ``encode`` vector."""
    emb = MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, prompts=PROMPTS)
    encoder = MoEEMTEBEncoder(emb, "r")
    query, document, other = (_encode(encoder, t) for t in (PromptType.query, PromptType.document, None))
    np.testing.assert_allclose(query, emb.encode_query(TEXTS), atol=1e-6)
    np.testing.assert_allclose(document, emb.encode_document(TEXTS), atol=1e-6)
    np.testing.assert_allclose(other, emb.encode(TEXTS), atol=1e-6)
    assert not np.allclose(query, other) and not np.allclose(document, other)
    # the named prompts are part of the results' identity (their own cache folder)
    plain = MoEEMTEBEncoder(tiny_embedder, "r")
    assert encoder.mteb_model_meta != plain.mteb_model_meta
    assert encoder.experiment_kwargs() == {
        **plain.experiment_kwargs(),
        "query_prompt": "query: {text}",
        "document_prompt": PROMPTS["document"],
    }


def test_a_prompt_the_caller_chooses_embeds_both_sides(tiny_embedder):
    emb = MoEEmbedder(tiny_embedder.model, tiny_embedder.tokenizer, prompts=PROMPTS)
    for encoder in (
        MoEEMTEBEncoder(emb, "r", config={"prompt": "prompteol"}),
        MoEEMTEBEncoder(emb, "r", config=EmbeddingConfig(prompt="prompteol")),
    ):
        expected = emb.encode(TEXTS, prompt="prompteol")
        for prompt_type in (PromptType.query, PromptType.document, None):
            np.testing.assert_allclose(_encode(encoder, prompt_type), expected, atol=1e-6)
        assert "query_prompt" not in encoder.experiment_kwargs()
