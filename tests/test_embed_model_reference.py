"""A model's own reference statistics: standardisation as part of its configuration.

The reference goes with the feature configuration it was fitted under (any method, alpha or subset
of its MoE layers), a changed pooling or prompt leaves vectors unstandardised, per-layer RW weights
act after the z-scores, and ``moee fit-reference --save-to-model`` adds statistics to a model folder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.cli import main
from moee.embed.config import MODEL_CONFIG_FILE, EmbeddingConfig, load_model_config
from moee.embed.embedder import MoEEmbedder

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big green tree",
    "music at night",
    "rain on the roof",
    "green fields and a river",
    "the tree by the river",
]
OWN = EmbeddingConfig(method="moee_sum", pooling="mean", score="softmax")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny OLMoE folder whose configuration carries statistics fitted on TEXTS."""
    path = tmp_path_factory.mktemp("model-with-reference")
    emb = MoEEmbedder(tiny_model("olmoe", n_layers=3), tiny_tokenizer(), model_config=OWN)
    emb.save_pretrained(path)
    corpus = path.parent / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    assert main(["fit-reference", str(corpus), "--save-to-model", str(path)]) == 0
    return path


@pytest.mark.slow
def test_save_to_model_makes_the_reference_the_models_default(folder):
    doc = json.loads((folder / MODEL_CONFIG_FILE).read_text())
    assert doc["config"]["reference"] == "reference.safetensors"
    assert doc["config"]["pooling"] == "mean" and doc["config"]["score"] == "softmax"  # the model's own, kept
    emb = MoEEmbedder.from_pretrained(str(folder), device="cpu")
    assert emb.default_config.reference == str(folder / "reference.safetensors")
    plain = emb.encode(TEXTS, reference=None)
    standardised = emb.encode(TEXTS)
    assert not np.allclose(plain, standardised, atol=1e-3)
    np.testing.assert_array_equal(
        standardised, emb.encode(TEXTS, reference=str(folder / "reference.safetensors"))
    )
    # centred statistics: the texts they were fitted on are spread around the origin, not in a cone
    for method in ("hs", "rw", "moee_sum"):
        v = emb.encode(TEXTS, method=method)
        cos = v @ v.T
        off = cos[~np.eye(len(TEXTS), dtype=bool)]
        assert off.mean() < 0.05, method
        u = emb.encode(TEXTS, method=method, reference=None)
        assert (u @ u.T)[~np.eye(len(TEXTS), dtype=bool)].mean() > off.mean() + 0.3, method


def test_the_models_reference_follows_its_feature_configuration(folder):
    emb = MoEEmbedder.from_pretrained(str(folder), device="cpu")
    ref = str(folder / "reference.safetensors")
    assert emb.resolve_config(method="hs", alpha=2.0).reference == ref  # methods and alpha: same features
    assert emb.resolve_config(rw_layers=(0, 2)).reference == ref  # a subset of the layers it was fitted on
    assert emb.resolve_config(pooling="last").reference is None  # other features: unstandardised
    assert emb.resolve_config(prompt="prompteol").reference is None
    np.testing.assert_array_equal(
        emb.encode(TEXTS, pooling="last"), emb.encode(TEXTS, pooling="last", reference=None)
    )
    with pytest.raises(
        ValueError, match="fitted under another configuration"
    ):  # explicit: refused, not dropped
        emb.encode(TEXTS, pooling="last", reference=ref)


def test_a_layer_subset_uses_the_sliced_statistics(folder):
    emb = MoEEmbedder.from_pretrained(str(folder), device="cpu")
    full = emb.encode(TEXTS, method="rw", normalize=False)  # [n, 3 * E] z-scores
    n_experts = emb.n_experts
    sub = emb.encode(TEXTS, method="rw", normalize=False, rw_layers=(0, -1))
    expected = np.concatenate([full[:, :n_experts], full[:, 2 * n_experts :]], axis=1)
    np.testing.assert_allclose(sub, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_per_layer_weights_act_after_standardisation(folder):
    emb = MoEEmbedder.from_pretrained(str(folder), device="cpu")
    n_experts = emb.n_experts
    same = emb.encode(TEXTS, method="rw", normalize=False, rw_layers=(0, 2))
    weighted = emb.encode(TEXTS, method="rw", normalize=False, rw_layers={0: 1.0, 2: 2.0})
    np.testing.assert_allclose(weighted[:, :n_experts], same[:, :n_experts], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(weighted[:, n_experts:], 2.0 * same[:, n_experts:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(
        emb.encode(TEXTS, method="rw", rw_layers={0: 1.0, 2: 2.0}),
        emb.encode(TEXTS, method="rw", rw_layers=(0, 2)),
    )


def test_a_reference_fitted_with_weights_does_not_depend_on_them(tmp_path):
    emb = MoEEmbedder(tiny_model("olmoe", n_layers=3), tiny_tokenizer(), model_config=OWN)
    a = emb.fit_reference(TEXTS, tmp_path / "a", rw_layers={0: 1.0, 2: 3.0})
    b = emb.fit_reference(TEXTS, tmp_path / "b", rw_layers=(0, 2))
    assert a.read_bytes() == b.read_bytes()
    emb.encode(TEXTS, rw_layers={0: 0.5, 2: 1.0}, reference=str(a))  # any weights of those layers


def test_save_to_model_checks_its_inputs(folder, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    assert main(["fit-reference", str(corpus), "--save-to-model", str(tmp_path)]) == 2
    assert "is not a local model folder (it has no config.json)" in capsys.readouterr().err
    assert main(["fit-reference", str(corpus), "--save-to-model", str(folder), "--model", str(tmp_path)]) == 2
    assert f"--save-to-model {folder} and --model {tmp_path} differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --out and --save-to-model: one or the other
        main(["fit-reference", str(corpus), "--save-to-model", str(folder), "--out", str(tmp_path / "r")])
    capsys.readouterr()
    code = main(["fit-reference", str(corpus), "--save-to-model", str(folder)])  # exists: --overwrite
    assert code != 0 and "already exists; pass --overwrite" in capsys.readouterr().err
    assert load_model_config(folder).reference == str(folder / "reference.safetensors")
