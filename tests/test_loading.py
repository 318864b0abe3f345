"""LoadOptions: one set of loading options, and every command reaching the one loader with them."""

from __future__ import annotations

import importlib.util
import json
import re

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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed (moee[quant])"
)
def test_four_bit_loading_says_and_records_how_much_is_in_four_bit(tiny_model_dir, tmp_path, monkeypatch):
    """bitsandbytes (on the CPU) quantizes nn.Linear layers only: the tiny OLMoE's attention goes to
    4 bit, its fused 3-D experts do not. The warning and every output's provenance give the counts
    (checked against the model's own shapes), for moee embed and for the Ray engine's model facts."""
    from moee import provenance
    from moee.capture.tiny import tiny_model
    from moee.integrations.ray import model_facts
    from moee.io import read_embeddings

    monkeypatch.setattr(provenance, "_QUANTIZED", {})  # this test's loads only, forgotten after it
    shapes = dict(tiny_model("olmoe", n_layers=2).named_parameters())
    total = sum(p.numel() for p in shapes.values())
    linear = sum(
        p.numel()
        for n, p in shapes.items()
        if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
    )
    experts = sum(p.numel() for n, p in shapes.items() if ".experts." in n)
    assert experts > linear > 0  # most of an MoE's weights are its experts
    expected = {
        "quantizer": "bitsandbytes-nf4",
        "params_total": total,
        "params_4bit": linear,
        "share_4bit": round(linear / total, 4),
        "expert_params_not_4bit": experts,
        "expert_dtype": "float32",
    }
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat\na dog ran\n", encoding="utf-8")
    out = tmp_path / "e.npy"
    argv = [
        "embed",
        str(corpus),
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
        "--device",
        "cpu",
        "--load-in-4bit",
    ]
    share = f"{linear / total:.1%} of {tiny_model_dir}'s {total:,} parameters are in 4 bit"
    stay = rf"expert weights \({experts:,} params, {experts / total:.1%}\) stay in float32: bitsandbytes quantizes nn.Linear layers only"
    with pytest.warns(UserWarning, match=re.escape(share) + ".*" + stay):
        assert main(argv) == 0
    vectors, meta = read_embeddings(out)
    assert np.isfinite(vectors).all()
    assert meta["load_in_4bit"] is True and meta["quantization"] == {tiny_model_dir: expected}
    with pytest.warns(UserWarning, match=stay):
        facts = model_facts(tiny_model_dir, {"device": "cpu", "load_in_4bit": True}, {})
    assert facts["quantization"] == {tiny_model_dir: expected}


def test_the_four_bit_flag_claims_no_more_than_bitsandbytes_does():
    from dataclasses import fields

    help_text = next(f for f in fields(LoadOptions) if f.name == "load_in_4bit").metadata["help"]
    assert "as in the paper" not in help_text and "nn.Linear layers only" in help_text
