"""LoadOptions: one set of loading options, and every command reaching the one loader with them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moee.cli import main
from moee.embed.embedder import MoEEmbedder
from moee.io import seal, write_embeddings
from moee.loading import LoadOptions


class _Loaded(Exception):
    """Raised by the patched loader: the command got as far as loading, with these options."""


LOAD_FLAGS = ["--model", "some/model", "--device", "cpu", "--dtype", "bfloat16", "--load-in-4bit"]
LOAD_FLAGS += ["--trust-remote-code", "--allow-bin"]
EXPECTED = LoadOptions(
    device="cpu", dtype="bfloat16", load_in_4bit=True, trust_remote_code=True, allow_pickle_weights=True
)


def _command_argv(name, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat\na dog\n", encoding="utf-8")
    if name == "embed":
        return ["embed", str(corpus), "--out", str(tmp_path / "e.npy")]
    if name == "search":
        meta = {"model": "other", "method": "hs", "pooling": "last", "prompt": None, "score": "native"}
        write_embeddings(tmp_path / "c.npy", np.eye(2, 4, dtype=np.float32), {**meta, "alpha": 1.0})
        return ["search", "--embeddings", str(tmp_path / "c.npy"), "--texts", str(corpus), "--query", "a"]
    if name == "evaluate":
        return ["evaluate", "--tasks", "lee_sts", "--out", str(tmp_path / "eval"), "--prompts", "none"]
    if name == "quickstart":
        return ["quickstart", "--out", str(tmp_path / "qs"), "--no-baseline"]
    return ["report", "--corpus", str(corpus), "--out", str(tmp_path / "report")]


@pytest.mark.parametrize("command", ["embed", "search", "evaluate", "quickstart", "report"])
def test_every_command_reaches_the_one_loader_with_the_same_options(command, tmp_path, monkeypatch):
    import moee.evaluation.runner as runner

    seen = []

    def loader(name, options=None, **kwargs):
        seen.append((name, options, kwargs))
        raise _Loaded

    monkeypatch.setattr(MoEEmbedder, "from_pretrained", loader)
    monkeypatch.setattr(runner, "resolve_tasks", lambda spec: [])  # evaluate: no task data needed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(_Loaded):
        main([*_command_argv(command, tmp_path), *LOAD_FLAGS])
    assert seen == [("some/model", EXPECTED, {})]


def test_search_takes_dtype_and_4bit_from_the_sidecar_unless_given(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        MoEEmbedder, "from_pretrained", lambda name, options=None: seen.append(options) or 1 / 0
    )
    argv = _command_argv("search", tmp_path)
    meta = json.loads((tmp_path / "c.npy.json").read_text(encoding="utf-8"))
    meta.update(model_dtype="float16", load_in_4bit=True)
    (tmp_path / "c.npy.json").write_text(json.dumps(seal(meta)), encoding="utf-8")  # a consistent sidecar
    with pytest.raises(ZeroDivisionError):
        main(argv)
    assert seen == [LoadOptions(dtype="float16", load_in_4bit=True)]


def test_options_reach_load_causal_lm_like_the_keywords(monkeypatch, tmp_path):
    import moee.loading

    calls = []

    def fake_load(name, **kwargs):
        calls.append((name, kwargs))
        raise _Loaded

    monkeypatch.setattr(moee.loading, "load_causal_lm", fake_load)
    import torch

    (tmp_path / "tokenizer_config.json").write_text("{}")  # the folder has a tokenizer: weights load next

    with pytest.raises(_Loaded):
        MoEEmbedder.from_pretrained(
            str(tmp_path), LoadOptions(dtype="bfloat16", device_map="auto", trust_remote_code=True)
        )
    with pytest.raises(_Loaded):
        MoEEmbedder.from_pretrained(
            str(tmp_path), dtype=torch.bfloat16, device_map="auto", trust_remote_code=True
        )
    assert calls[0] == calls[1]
    assert calls[0][1] == {
        "trust_remote_code": True,
        "allow_pickle_weights": False,
        "dtype": torch.bfloat16,
        "device_map": "auto",
    }
    with pytest.raises(TypeError, match="inside options"):
        MoEEmbedder.from_pretrained(str(tmp_path), LoadOptions(), device="cpu")


def test_load_options_are_checked():
    with pytest.raises(ValueError, match="either --device or --device-map"):
        LoadOptions(device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        LoadOptions(dtype="float64")
    assert LoadOptions().hf_kwargs() == {}
    assert LoadOptions(dtype="auto").hf_kwargs() == {"dtype": "auto"}


def test_a_missing_local_model_path_is_named_before_transformers_misreads_it(tmp_path):
    from moee.loading import check_model_source, load_causal_lm

    for missing in (str(tmp_path / "nope"), "./nope", "~/nope-moee-model", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="model directory .* not found"):
            load_causal_lm(missing)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_model_source(weights)
    check_model_source(tmp_path)  # an existing directory passes
    check_model_source("org/name")  # and so do Hub ids (resolved by transformers)
    check_model_source("name")
