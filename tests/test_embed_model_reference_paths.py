"""Where a model folder's ``moee_embedding.json`` may point its ``reference``: a relative name stays
inside the folder (one that leaves it is refused, and never deleted by ``drop_model_reference``);
an absolute path is used as it is."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.cli import main
from moee.embed.config import MODEL_CONFIG_FILE, EmbeddingConfig, drop_model_reference, load_model_config
from moee.embed.embedder import MoEEmbedder

TEXTS = ["the cat sat on the mat", "a dog ran under the big green tree", "music at night", "rain on the roof"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny OLMoE folder whose configuration carries statistics fitted on TEXTS."""
    path = tmp_path_factory.mktemp("model") / "model"
    MoEEmbedder(
        tiny_model("olmoe", n_layers=2), tiny_tokenizer(), model_config=EmbeddingConfig()
    ).save_pretrained(path)
    corpus = path.parent / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    assert main(["fit-reference", str(corpus), "--save-to-model", str(path)]) == 0
    return path


def _copy_with_reference(folder, tmp_path, name: str):
    """A copy of ``folder`` whose reference pair lies one level up, named ``name`` in its configuration."""
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    own = json.loads((model / MODEL_CONFIG_FILE).read_text())
    stem = own["config"]["reference"].removesuffix(".safetensors")
    for suffix in (".safetensors", ".json"):
        (model / f"{stem}{suffix}").rename(tmp_path / f"outside{suffix}")
    own["config"]["reference"] = name
    (model / MODEL_CONFIG_FILE).write_text(json.dumps(own))
    return model


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "../outside"])
def test_a_relative_reference_that_leaves_the_model_folder_is_refused(folder, tmp_path, name):
    """It resolved outside the folder and was used; now loading names the field and the fix."""
    model = _copy_with_reference(folder, tmp_path, name)
    message = rf"'reference' is '{name}', which leaves the model folder.*copy the .safetensors.*absolute path"
    with pytest.raises(ValueError, match=message):
        load_model_config(model)
    with pytest.raises(ValueError, match=message):
        MoEEmbedder.from_pretrained(str(model))


def test_an_absolute_reference_is_used_as_it_is(folder, tmp_path):
    model = _copy_with_reference(folder, tmp_path, str(tmp_path / "outside.safetensors"))
    emb = MoEEmbedder.from_pretrained(str(model))
    assert emb.model_config.reference == str(tmp_path / "outside.safetensors")
    original = MoEEmbedder.from_pretrained(str(folder))
    np.testing.assert_allclose(emb.encode(TEXTS), original.encode(TEXTS), atol=1e-6)


def test_a_relative_reference_inside_the_folder_still_resolves(folder, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    own = json.loads((model / MODEL_CONFIG_FILE).read_text())
    (model / "sub").mkdir()
    own["config"]["reference"] = "sub/../" + own["config"]["reference"]
    (model / MODEL_CONFIG_FILE).write_text(json.dumps(own))
    assert load_model_config(model).reference.startswith(str(model))


def test_dropping_a_reference_that_leaves_the_folder_deletes_nothing_outside(folder, tmp_path):
    """``drop_model_reference`` removes the folder's own statistics; it deleted the files a
    ``../`` name pointed at."""
    model = _copy_with_reference(folder, tmp_path, "../outside.safetensors")
    assert drop_model_reference(model) == "../outside.safetensors"
    assert (tmp_path / "outside.safetensors").is_file() and (tmp_path / "outside.json").is_file()
    assert "reference" not in json.loads((model / MODEL_CONFIG_FILE).read_text())["config"]
