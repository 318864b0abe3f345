"""The one run record every result writer uses: keys, versions, command, hashes."""

import hashlib
import json
import shlex
import sys

import pytest

from moee import io, provenance
from moee.benchmarking import write_result


def test_run_record_has_the_keys_committed_meta_blocks_use():
    rec = provenance.run_record(["moee", "report", "a b.txt"], extra={"corpus": "x"})
    assert {"versions", "command", "timestamp", "git_revision", "corpus"} <= set(rec)
    assert rec["command"] == "moee report 'a b.txt'"
    assert rec["timestamp"].endswith("+00:00")
    assert "machine" not in rec and "machine" in provenance.run_record([], machine=True)
    assert provenance.run_record("already a string")["command"] == "already a string"
    assert provenance.run_record()["command"] == shlex.join(sys.argv)


def test_io_run_metadata_is_the_run_record():
    assert io.run_metadata is not None and io.file_sha256 is provenance.file_sha256
    assert set(io.run_metadata(["x"])) == set(provenance.run_record(["x"]))


def test_package_versions_missing_and_omitted():
    v = provenance.package_versions(("numpy", "no-such-dist-xyz", "faiss-gpu-cu12-missing"))
    assert v["python"] and v["numpy"] and v["no-such-dist-xyz"] is None
    v = provenance.package_versions(("no-such-dist-xyz",), missing="not installed", omit_missing=())
    assert v["no-such-dist-xyz"] == "not installed"
    assert "absent" not in provenance.package_versions(("absent",), omit_missing=("absent",))


def test_file_sha256_matches_hashlib(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc" * 1000)
    assert provenance.file_sha256(p) == hashlib.sha256(b"abc" * 1000).hexdigest()
    assert provenance.file_sha256(p, offset=3) == hashlib.sha256(b"abc" * 999).hexdigest()


def test_benchmark_results_keep_their_keys(tmp_path):
    path = write_result("t", {"x": 1}, tmp_path)
    record = json.loads(path.read_text())
    assert list(record)[:6] == ["benchmark", "utc", "command", "env", "machine", "versions"]
    assert record["utc"].endswith("Z") and "faiss-gpu-cu12" in record["versions"]


def test_a_result_names_its_model_without_the_machines_folder(tmp_path, monkeypatch):
    from moee.embed.embedder import MINILM_MOE_DIR
    from moee.provenance import model_label

    assert model_label("allenai/OLMoE-1B-7B-0924") == "allenai/OLMoE-1B-7B-0924"  # a Hub id as given
    assert model_label("runs/model") == "runs/model"  # relative: as given
    assert model_label(MINILM_MOE_DIR) == "moee/assets/default-model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert model_label(tmp_path / "models" / "mine") == "models/mine"
    assert model_label("/somewhere/else/model-x") == "/somewhere/else/model-x"  # the user's own: as given


def test_a_result_records_the_reference_without_the_machines_folder(tmp_path, monkeypatch):
    from moee.embed.config import EmbeddingConfig
    from moee.embed.embedder import MINILM_MOE_DIR

    shipped = EmbeddingConfig(reference=str(MINILM_MOE_DIR / "reference.safetensors"))
    assert shipped.to_record()["reference"] == "moee/assets/default-model/reference.safetensors"
    assert shipped.to_dict()["reference"] == shipped.reference  # a sidecar keeps the path it opens
    assert {**shipped.to_record(), "reference": shipped.reference} == shipped.to_dict()
    monkeypatch.chdir(tmp_path)
    mine = EmbeddingConfig(method="rw", reference=str(tmp_path / "refs" / "r.safetensors"))
    assert mine.to_record()["reference"] == "refs/r.safetensors"
    assert "reference" not in EmbeddingConfig().to_record()


@pytest.mark.slow
def test_a_fitted_reference_names_its_model_without_the_machines_folder(tmp_path, monkeypatch):
    from moee.capture.tiny import tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    folder = tmp_path / "models" / "tiny"
    MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer()).save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    emb = MoEEmbedder.from_pretrained(str(folder), device="cpu")
    ref = emb.fit_reference(["one text here", "and another one", "a third"], tmp_path / "ref")
    meta = json.loads(ref.with_suffix(".json").read_text())
    assert meta["model"]["name"] == "models/tiny"


def test_the_processor_is_named_and_its_feature_flags_digested(monkeypatch):
    import moee.provenance as prov

    info = {"model name": "Example CPU 9000", "flags": "sse2 avx512f fpu"}
    monkeypatch.setattr(prov, "_cpuinfo", info.get)
    assert prov.cpu_model() == "Example CPU 9000"
    same_flags_other_order = {**info, "flags": "fpu sse2 avx512f"}
    digest = prov.cpu_flags_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    monkeypatch.setattr(prov, "_cpuinfo", same_flags_other_order.get)
    assert prov.cpu_flags_digest() == digest  # the order of the flags does not matter
    monkeypatch.setattr(prov, "_cpuinfo", {**info, "flags": "sse2 avx512f"}.get)
    assert prov.cpu_flags_digest() != digest  # one flag fewer is another processor
