"""EmbeddingConfig and the method registry: one validated configuration, its persisted forms unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mteb
import numpy as np
import pytest

from moee.capture.recorder import POOLINGS as RECORDER_POOLINGS
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed.config import AUTO_ALPHA, EmbeddingConfig, config_label
from moee.embed.embedder import MoEEmbedder
from moee.embed.methods import METHOD_REGISTRY, METHODS, POOLINGS, output_dim
from moee.evaluation.adapter import MoEEMTEBEncoder, experiment_kwargs
from moee.evaluation.runner import EvalSettings, _moee_encoder
from moee.evaluation.tables import METHOD_LABELS, System

#: The result folders of ``moee evaluate``'s default grid (4 methods x 2 prompts), as the code
#: before EmbeddingConfig named them: renaming one would orphan the committed evaluation cache.
DEFAULT_GRID_FOLDERS = {
    "alpha_auto__method_moee_sum__pooling_last__prompt_none__score_{score}",
    "alpha_auto__method_moee_sum__pooling_last__prompt_prompteol__score_{score}",
    "method_hs__pooling_last__prompt_none__score_{score}",
    "method_hs__pooling_last__prompt_prompteol__score_{score}",
    "method_moee_concat__pooling_last__prompt_none__score_{score}",
    "method_moee_concat__pooling_last__prompt_prompteol__score_{score}",
    "method_rw__pooling_last__prompt_none__score_{score}",
    "method_rw__pooling_last__prompt_prompteol__score_{score}",
}


def _old_experiment_kwargs(method, pooling, prompt, score, alpha):
    """What the adapter recorded before EmbeddingConfig (copied here as the reference)."""
    kwargs = {"method": method, "pooling": pooling, "prompt": "none" if prompt is None else prompt}
    kwargs["score"] = score
    if method == "moee_sum":
        kwargs["alpha"] = alpha
    return kwargs


@pytest.mark.parametrize("score", ["native", "softmax"])
def test_the_evaluation_grid_keeps_its_result_folder_names(tmp_path, score):
    # the grid of eval/run_offline.sh (alpha auto, two prompts), on a model without a saved configuration
    settings = EvalSettings(prompts=[None, "prompteol"], config={"score": score, "alpha": "auto"})
    fake = SimpleNamespace(name_or_path="default-model", hidden_size=6, n_moe_layers=2, n_experts=4)
    cache = mteb.ResultCache(tmp_path)
    folders, old_folders = set(), set()
    for prompt in settings.prompts:
        for method in settings.methods:
            encoder = _moee_encoder(fake, "cfaf9dc3f17e", settings.cell_config(method, prompt), None)
            path = cache.get_task_result_path("lee_sts", encoder.mteb_model_meta)
            folders.add(path.parent.name)
            alpha = "auto" if method == "moee_sum" else 1.0
            old = _old_experiment_kwargs(method, "last", prompt, score, alpha)
            assert encoder.mteb_model_meta.experiment_kwargs == old
            assert list(encoder.mteb_model_meta.experiment_kwargs) == list(old)  # key order too
            meta = mteb.models.ModelMeta.create_empty(
                {"name": "moee/default-model", "revision": "cfaf9dc3f17e", "experiment_kwargs": old}
            )
            old_folders.add(cache.get_task_result_path("lee_sts", meta).parent.name)
    assert folders == old_folders == {f.format(score=score) for f in DEFAULT_GRID_FOLDERS}


def test_config_dict_forms_are_the_persisted_ones():
    config = EmbeddingConfig(method="rw", prompt="prompteol", alpha=2)
    assert config.to_dict() == {
        "method": "rw",
        "pooling": "last",
        "prompt": "prompteol",
        "prompt_template": config.prompt_template,
        "score": "native",
        "alpha": 2.0,
        "normalize": True,
    }
    assert list(config.to_dict()) == [
        "method",
        "pooling",
        "prompt",
        "prompt_template",
        "score",
        "alpha",
        "normalize",
    ]
    assert config.experiment_kwargs() == {
        "method": "rw",
        "pooling": "last",
        "prompt": "prompteol",
        "score": "native",
    }
    assert experiment_kwargs("moee_sum", "mean", None, "softmax", "auto") == {
        "method": "moee_sum",
        "pooling": "mean",
        "prompt": "none",
        "score": "softmax",
        "alpha": "auto",
    }
    for form in (config.to_dict(), {**config.to_dict(), "model": "m", "model_dtype": None}):
        assert EmbeddingConfig.from_dict(form) == config
    sum_config = EmbeddingConfig(alpha="auto")
    assert EmbeddingConfig.from_dict(sum_config.experiment_kwargs()) == sum_config
    assert EmbeddingConfig.from_dict({**config.to_dict(), "normalize": None}).normalize is True


def test_config_is_frozen_and_checked():
    config = EmbeddingConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "hs"
    for bad, error, match in [
        ({"method": "cls"}, ValueError, "unknown method 'cls'"),
        ({"pooling": "tokens"}, ValueError, "unknown pooling 'tokens'"),
        ({"score": "probs"}, ValueError, "unknown score 'probs'"),
        ({"prompt": "promptEOL"}, ValueError, "unknown prompt"),
        ({"alpha": -1}, ValueError, "alpha must be >= 0"),
        ({"alpha": "best"}, ValueError, "alpha must be a number >= 0 or 'auto'"),
        ({"alpha": True}, TypeError, "alpha must be a real number"),
    ]:
        with pytest.raises(error, match=match):
            EmbeddingConfig(**bad)
    with pytest.raises(ValueError, match="unknown method"):
        config.replace(method="cls")
    with pytest.raises(ValueError, match="alpha='auto' is chosen per task"):
        EmbeddingConfig(alpha=AUTO_ALPHA).numeric_alpha()


def test_the_registry_is_the_one_source_of_widths_alpha_and_labels():
    assert METHODS == tuple(METHOD_REGISTRY) == ("hs", "rw", "moee_concat", "moee_sum")
    assert [m for m in METHODS if METHOD_REGISTRY[m].uses_alpha] == ["moee_sum"]
    assert METHOD_LABELS == {"hs": "HS", "rw": "RW", "moee_concat": "MoEE concat", "moee_sum": "MoEE sum"}
    for method in METHODS:
        assert EmbeddingConfig(method=method).width(6, 3, 4) == output_dim(method, 6, 3, 4)
    fake = SimpleNamespace(name_or_path="m", hidden_size=6, n_moe_layers=3, n_experts=4)
    for method in METHODS:
        assert MoEEMTEBEncoder(fake, "r", config={"method": method}).mteb_model_meta.embed_dim == output_dim(
            method, 6, 3, 4
        )
    assert RECORDER_POOLINGS == (*POOLINGS, "tokens")


@pytest.mark.parametrize(
    ("kwargs", "label"),
    [
        ({"method": "moee_sum", "prompt": "prompteol", "alpha": "auto"}, "MoEE sum + PromptEOL (alpha=auto)"),
        ({"method": "hs"}, "HS"),
        ({"method": "rw", "pooling": "mean", "score": "softmax"}, "RW (pooling=mean, score=softmax)"),
        ({"method": "moee_concat", "prompt": "Q: {text}"}, "MoEE concat + prompt Q: {text}"),
    ],
)
def test_labels_match_the_result_tables(kwargs, label):
    config = EmbeddingConfig(**kwargs)
    assert config.label == label
    system = System("m", "r", tuple(sorted(config.experiment_kwargs().items())))
    assert system.label() == label
    assert config_label({"method": "future_method", "alpha": 3}) == "future_method"


@pytest.fixture(scope="module")
def embedder():
    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer(), name_or_path="tiny")


def test_encode_takes_a_config_or_its_keywords(embedder):
    texts = ["the cat sat on the mat", "rain at night", ""]
    config = EmbeddingConfig(
        method="moee_sum", pooling="mean", prompt="prompteol", alpha=0.5, normalize=False
    )
    by_config = embedder.encode(texts, config=config)
    by_keywords = embedder.encode(
        texts, method="moee_sum", pooling="mean", prompt="prompteol", alpha=0.5, normalize=False
    )
    np.testing.assert_array_equal(by_config, by_keywords)
    assert embedder.encode([], config=config.replace(method="rw")).shape == (0, embedder.output_dim("rw"))
    with pytest.raises(TypeError, match="pass method inside config"):
        embedder.encode(texts, method="hs", config=config)
    with pytest.raises(ValueError, match="alpha='auto'"):
        embedder.encode(texts, config=EmbeddingConfig(alpha="auto"))


def test_extra_cells_are_resolved_beside_the_grid():
    """`extra_cells` adds whole configurations (the paper's beside the model's own) to the methods x
    prompts grid, each resolved by the same rule; repeats are dropped, a cell without a method is refused."""
    from moee.embed.config import PAPER_FIELDS

    own = EmbeddingConfig(pooling="mean")
    settings = EvalSettings(
        methods=["hs", "moee_sum"],
        config={"alpha": "auto"},
        extra_cells=[{**PAPER_FIELDS, "alpha": "auto"}, {"method": "hs"}],
    )
    cells = settings.cells(own)
    assert [(c.method, c.pooling, c.prompt, c.score) for c in cells] == [
        ("hs", "mean", None, "native"),
        ("moee_sum", "mean", None, "native"),
        ("moee_sum", "last", "prompteol", "softmax"),
    ]
    assert cells[1].alpha == cells[2].alpha == "auto"
    with pytest.raises(TypeError, match="with a method"):
        EvalSettings(extra_cells=[{"pooling": "last"}]).cells(own)
