"""Large-model code paths: dtype, device_map and 4-bit options pass through
``MoEEmbedder.from_pretrained``, and capture still works when the layers of one model sit on
different devices (some on the CPU, some offloaded to disk, i.e. on ``meta`` between uses).

A tiny OLMoE is saved to a temporary directory and loaded back the way a user loads a model
too big for one device; every variant must give the rows the plain all-CPU model gives.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moee import MoEEmbedder
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.loading import input_device

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big tree in the rain",
    "blue",
    "",
    "happy music at night in the city by the river",
]
N_LAYERS = 4


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny OLMoE (4 MoE layers) and its tokenizer on disk, plus the all-CPU reference."""
    path = tmp_path_factory.mktemp("tiny-olmoe-large")
    model = tiny_model("olmoe", n_layers=N_LAYERS)
    tokenizer = tiny_tokenizer()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    reference = MoEEmbedder(model, tokenizer)
    expected = {
        "moee_sum": reference.encode(TEXTS),
        "native_rw": reference.encode(TEXTS, method="rw", score="native"),
        "trace": reference.trace(TEXTS, pooling="mean"),
    }
    return path, expected


def _split_map(embed_on: str) -> dict[str, str]:
    """Layers alternate CPU / disk; the embedding (first parameter of the model) goes to ``embed_on``."""
    device_map = {
        "model.embed_tokens": embed_on,
        "model.rotary_emb": "cpu",
        "model.norm": "disk",
        "lm_head": "disk",
    }
    for i in range(N_LAYERS):
        device_map[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
    return device_map


@pytest.mark.slow
@pytest.mark.parametrize("embed_on", ["cpu", "disk"])
def test_capture_with_layers_on_cpu_and_disk_offload(saved_model, tmp_path, embed_on):
    path, expected = saved_model
    embedder = MoEEmbedder.from_pretrained(
        path, device_map=_split_map(embed_on), offload_folder=tmp_path / "off"
    )
    placements = set(embedder.model.hf_device_map.values())
    assert placements == {"cpu", "disk"}
    # the offload really happened: the disk layers hold meta tensors between forwards
    assert embedder.model.model.layers[1].mlp.gate.weight.device.type == "meta"
    assert embedder.model.model.layers[0].mlp.gate.weight.device.type == "cpu"

    np.testing.assert_allclose(embedder.encode(TEXTS), expected["moee_sum"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(
        embedder.encode(TEXTS, method="rw", score="native"), expected["native_rw"], atol=1e-6, rtol=0
    )
    trace = embedder.trace(TEXTS, pooling="mean")
    np.testing.assert_allclose(trace.rw, expected["trace"].rw, atol=1e-6, rtol=0)
    np.testing.assert_allclose(trace.hs, expected["trace"].hs, atol=1e-5, rtol=0)
    assert trace.layers == expected["trace"].layers


def test_device_map_auto_passes_through(saved_model):
    path, expected = saved_model
    embedder = MoEEmbedder.from_pretrained(path, device_map="auto")
    np.testing.assert_allclose(embedder.encode(TEXTS), expected["moee_sum"], atol=1e-6, rtol=0)


def test_device_map_auto_with_a_memory_budget_offloads_and_still_captures(saved_model, tmp_path):
    """What a user with too little memory gets: accelerate itself decides which layers go to disk."""
    path, expected = saved_model
    size = sum(p.numel() * p.element_size() for p in tiny_model("olmoe", n_layers=N_LAYERS).parameters())
    embedder = MoEEmbedder.from_pretrained(
        path, device_map="auto", max_memory={"cpu": size // 2}, offload_folder=tmp_path / "off"
    )
    placements = set(embedder.model.hf_device_map.values())
    assert placements == {"cpu", "disk"}, embedder.model.hf_device_map
    np.testing.assert_allclose(embedder.encode(TEXTS), expected["moee_sum"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_half_precision_dtype_passes_through(saved_model, dtype):
    path, expected = saved_model
    embedder = MoEEmbedder.from_pretrained(path, dtype=dtype, device="cpu")
    want = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert {p.dtype for p in embedder.model.parameters()} == {want}
    out = embedder.encode(TEXTS)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    # same vectors up to half-precision rounding (rows are unit norm, so this is a cosine)
    cosine = (out * expected["moee_sum"]).sum(axis=1)
    assert cosine.min() > 0.99, cosine


def test_device_and_device_map_are_exclusive(saved_model):
    path, _ = saved_model
    with pytest.raises(ValueError, match="device"):
        MoEEmbedder.from_pretrained(path, device="cpu", device_map="auto")


def test_input_device_follows_accelerate_execution_device(saved_model, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = saved_model
    plain = AutoModelForCausalLM.from_pretrained(path)
    assert input_device(plain) == torch.device("cpu")
    offloaded = AutoModelForCausalLM.from_pretrained(
        path, device_map=_split_map("disk"), offload_folder=tmp_path / "off"
    )
    assert next(offloaded.parameters()).device.type == "meta"  # the naive answer would be wrong
    assert input_device(offloaded) == torch.device("cpu")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        input_device("not a model")


def test_input_device_of_a_module_without_parameters():
    assert input_device(nn.Identity()) == torch.device("cpu")


_HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def test_four_bit_without_bitsandbytes_names_the_extra(monkeypatch):
    from moee.loading import four_bit_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"bitsandbytes.*moee\[quant\]"):
        four_bit_config()


@pytest.mark.skipif(
    not (torch.cuda.is_available() and _HAS_BNB), reason="4-bit loading needs CUDA and bitsandbytes"
)
def test_four_bit_loading_on_gpu(saved_model):
    from moee.loading import LoadOptions

    path, expected = saved_model
    embedder = MoEEmbedder.from_pretrained(str(path), LoadOptions(load_in_4bit=True))
    names = {type(m).__name__ for m in embedder.model.modules()}
    assert "Linear4bit" in names
    out = embedder.encode(TEXTS)
    assert np.isfinite(out).all()
    assert (out * expected["moee_sum"]).sum(axis=1).min() > 0.9


def _pickle_only_copy(saved: Path, dest: Path) -> Path:
    """The saved model with its weights as a pickled ``pytorch_model.bin`` only (no safetensors)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(saved, dest)
    torch.save(load_file(dest / "model.safetensors"), dest / "pytorch_model.bin")
    (dest / "model.safetensors").unlink()
    return dest


@pytest.mark.slow
def test_pickle_weights_are_refused_unless_allowed(saved_model, tmp_path, capsys):
    from moee.cli import main

    path, expected = saved_model
    bin_only = _pickle_only_copy(path, tmp_path / "bin-only")
    with pytest.raises(ValueError, match=r"bin-only has no safetensors weights, .*allow_pickle_weights=True"):
        MoEEmbedder.from_pretrained(bin_only, device="cpu")
    emb = MoEEmbedder.from_pretrained(bin_only, device="cpu", allow_pickle_weights=True)
    np.testing.assert_allclose(emb.encode(TEXTS), expected["moee_sum"], atol=1e-6)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    argv = ["embed", str(corpus), "--model", str(bin_only), "--out", str(tmp_path / "e.npy")]
    assert main(argv) == 2
    assert "--allow-bin" in capsys.readouterr().err and not (tmp_path / "e.npy").exists()
    assert main([*argv, "--allow-bin"]) == 0
