"""The embedding configuration travels with the model: ``moee_embedding.json``, one resolution rule
(explicit > the model's saved configuration > library default), ``save_pretrained`` round trips."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed.config import (
    MODEL_CONFIG_FILE,
    MODEL_DEFAULT,
    EmbeddingConfig,
    drop_model_reference,
    load_model_config,
    resolve_config,
    save_model_config,
)
from moee.embed.embedder import MINILM_MOE_DIR, MoEEmbedder
from moee.evaluation.adapter import MoEEMTEBEncoder, TraceCache, get_model

TEXTS = ["the cat sat on the mat", "a dog ran under the big green tree", "music", "", "rain at night"]
OWN = EmbeddingConfig(method="hs", pooling="mean", score="softmax", prompt="prompteol")


@pytest.fixture(scope="module")
def own_embedder() -> MoEEmbedder:
    """A tiny embedder whose model carries its own configuration."""
    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer(), model_config=OWN)


# ---------------------------------------------------------------------------- the rule
def test_resolution_is_explicit_then_model_then_library():
    assert resolve_config() == EmbeddingConfig()
    assert resolve_config(None, pooling="mean") == EmbeddingConfig(pooling="mean")
    assert resolve_config(OWN) == OWN
    assert resolve_config(OWN, pooling="last", prompt=None) == OWN.replace(pooling="last", prompt=None)
    assert resolve_config(OWN, pooling=MODEL_DEFAULT, method=MODEL_DEFAULT) == OWN  # left to the model
    with pytest.raises(TypeError, match="unknown configuration field.*poolin"):
        resolve_config(OWN, poolin="mean")
    with pytest.raises(TypeError, match="model_config must be an EmbeddingConfig"):
        resolve_config({"pooling": "mean"})


@pytest.mark.slow
def test_every_python_entry_point_resolves_against_the_model(own_embedder):
    emb = own_embedder
    assert emb.default_config == OWN
    np.testing.assert_array_equal(emb.encode(TEXTS), emb.encode(TEXTS, config=OWN))
    np.testing.assert_array_equal(  # a keyword given overrides only itself
        emb.encode(TEXTS, pooling="last"), emb.encode(TEXTS, config=OWN.replace(pooling="last"))
    )
    trace = emb.trace(TEXTS)
    assert (trace.pooling, trace.score, trace.prompt) == ("mean", "softmax", OWN.prompt_template)
    explicit = emb.trace(TEXTS, pooling="mean", score="softmax", prompt="prompteol")
    np.testing.assert_array_equal(trace.rw, explicit.rw)
    assert emb.trace(TEXTS, pooling="last").pooling == "last"
    cache = TraceCache(emb)
    assert (cache.pooling, cache.prompt, cache.score) == ("mean", "prompteol", "softmax")
    encoder = MoEEMTEBEncoder(emb, "r")
    assert encoder.config == OWN
    np.testing.assert_allclose(encoder.embed_texts(TEXTS), emb.encode(TEXTS), atol=1e-6)
    assert encoder.mteb_model_meta.experiment_kwargs == OWN.experiment_kwargs()
    assert MoEEMTEBEncoder(emb, "r", config={"method": "rw"}).config == OWN.replace(method="rw")
    with pytest.raises(TypeError, match="pass method inside config"):
        get_model(emb, method="rw", config=OWN)
    with pytest.raises(ValueError, match="trace runs one prompt"):
        MoEEmbedder(
            emb.model, emb.tokenizer, model_config=OWN.replace(prompt=["prompteol", "meaning"])
        ).trace(TEXTS)


def test_a_model_without_a_saved_configuration_gets_the_library_defaults():
    emb = MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer(), name_or_path="org/not-a-folder")
    assert emb.model_config is None and emb.default_config == EmbeddingConfig()
    assert emb.trace(TEXTS[:2]).pooling == "last"


# ---------------------------------------------------------------------------- the file
def test_the_file_round_trips_and_refuses_what_it_cannot_read(tmp_path):
    assert load_model_config(tmp_path) is None  # a folder without one
    path = save_model_config(OWN, tmp_path)
    assert path == tmp_path / MODEL_CONFIG_FILE
    doc = json.loads(path.read_text())
    assert doc["format"] == "moee-embedding-config" and doc["format_version"] == 1
    assert doc["config"] == OWN.to_dict()
    assert load_model_config(tmp_path) == OWN
    for bad, message in [
        ({**doc, "format": "other"}, "not a moee embedding configuration"),
        ({**doc, "format_version": 2}, "format_version 2; this moee reads up to 1"),
        ({**doc, "config": {**doc["config"], "polling": "mean"}}, "unknown configuration field.*polling"),
        ({**doc, "config": {**doc["config"], "pooling": "max"}}, "unknown pooling 'max'"),
        ({**doc, "config": {**doc["config"], "alpha": "auto"}}, "alpha must be a number"),
        ({**doc, "config": {**doc["config"], "reference": "missing.safetensors"}}, "names the reference"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            load_model_config(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="alpha='auto'"):
        save_model_config(EmbeddingConfig(alpha="auto"), tmp_path)


def test_a_hub_repository_is_read_through_the_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_model_config(OWN, repo / "snapshots" / commit)
    assert load_model_config("someone/tiny-moe", cache_dir=tmp_path) == OWN
    assert load_model_config("someone/tiny-moe", cache_dir=tmp_path, local_only=True) is None
    assert load_model_config("someone/other-moe", cache_dir=tmp_path) is None  # not in the repo: none
    with pytest.raises(FileNotFoundError, match="model directory './nowhere' not found"):
        load_model_config("./nowhere")  # a local path, named as one (not as a malformed Hub id)


def test_the_bundled_model_carries_its_configuration():
    # the recipe table's best recipe for every method (eval/results/recipes/recipes.md): mean pooling,
    # standardised with the model's own reference statistics (fitted on its training corpus)
    assert load_model_config(MINILM_MOE_DIR) == EmbeddingConfig(
        pooling="mean", reference=str(MINILM_MOE_DIR / "reference.safetensors")
    )


@pytest.fixture(scope="module")
def bundled() -> MoEEmbedder:
    return MoEEmbedder.from_pretrained("minilm-moe", device="cpu")  # the model shipped whole


@pytest.mark.slow
def test_a_copy_of_the_bundled_folder_behaves_exactly_like_the_original(bundled, tmp_path):
    copy = tmp_path / "somewhere" / "my-model"
    shutil.copytree(MINILM_MOE_DIR, copy)
    other = MoEEmbedder.from_pretrained(copy, device="cpu")
    assert other.model_config == EmbeddingConfig(
        pooling="mean", reference=str(copy / "reference.safetensors")
    )
    assert bundled.model_config.replace(reference=None) == EmbeddingConfig(pooling="mean")
    np.testing.assert_array_equal(other.encode(TEXTS), bundled.encode(TEXTS))
    np.testing.assert_array_equal(other.encode(TEXTS, method="rw"), bundled.encode(TEXTS, method="rw"))
    # the model object alone (transformers keeps where it came from) finds the same configuration
    assert MoEEmbedder(other.model, other.tokenizer).model_config == other.model_config


@pytest.mark.slow
def test_save_pretrained_round_trips_the_bundled_model(bundled, tmp_path):
    out = bundled.save_pretrained(tmp_path / "saved")
    assert (out / MODEL_CONFIG_FILE).is_file() and list(out.glob("*.safetensors"))
    assert not list(out.glob("*.bin"))
    again = MoEEmbedder.from_pretrained(out, device="cpu")
    assert again.default_config == bundled.default_config.replace(
        reference=str(out / "reference.safetensors")
    )
    np.testing.assert_array_equal(again.encode(TEXTS), bundled.encode(TEXTS))
    np.testing.assert_array_equal(
        again.encode(TEXTS, config=EmbeddingConfig.paper()),
        bundled.encode(TEXTS, config=EmbeddingConfig.paper()),
    )


def test_save_pretrained_brings_a_reference_along(own_embedder, tmp_path):
    ref = own_embedder.fit_reference(TEXTS * 2, tmp_path / "fitted" / "ref")
    emb = MoEEmbedder(
        own_embedder.model, own_embedder.tokenizer, model_config=OWN.replace(reference=str(ref))
    )
    out = emb.save_pretrained(tmp_path / "with-ref")
    doc = json.loads((out / MODEL_CONFIG_FILE).read_text())
    assert doc["config"]["reference"] == "ref.safetensors"  # inside the folder, named relative to it
    assert (out / "ref.safetensors").is_file() and (out / "ref.json").is_file()
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    shutil.rmtree(out)
    again = MoEEmbedder.from_pretrained(moved, device="cpu")
    assert again.model_config.reference == str(moved / "ref.safetensors")
    np.testing.assert_allclose(again.encode(TEXTS), emb.encode(TEXTS), atol=1e-5)


def test_a_rewritten_model_drops_its_reference_and_keeps_the_rest(own_embedder, tmp_path):
    """What an export does before it writes new weights into a folder with fitted statistics."""
    ref = own_embedder.fit_reference(TEXTS * 2, tmp_path / "fitted" / "ref")
    folder = tmp_path / "model"
    save_model_config(OWN.replace(reference=str(ref)), folder, prompts={"query": "prompteol"})
    assert drop_model_reference(folder) == "ref.safetensors"
    assert not (folder / "ref.safetensors").exists() and not (folder / "ref.json").exists()
    assert ref.is_file()  # the fitted original is not the folder's to remove
    assert load_model_config(folder) == OWN  # method, pooling, prompt, score kept
    assert json.loads((folder / MODEL_CONFIG_FILE).read_text())["prompts"] == {"query": "prompteol"}
    assert drop_model_reference(folder) is None  # nothing left to drop
    assert drop_model_reference(tmp_path / "no-config") is None
    # a reference named by an absolute path outside the folder: its name goes, its files stay
    doc = json.loads((folder / MODEL_CONFIG_FILE).read_text())
    doc["config"]["reference"] = str(ref)
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(doc))
    assert drop_model_reference(folder) == str(ref)
    assert ref.is_file() and ref.with_suffix(".json").is_file()
    assert load_model_config(folder) == OWN
