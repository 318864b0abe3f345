"""Reference statistics without a model: fitting, the file pair and every refusal of it, which
configurations a reference accepts, its row-wise z-scores (per-layer slices, near-zero stds), the
weights digest's three sources and the load cache. Numbers checked against direct computations."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

import moee.embed.reference as ref
from moee.embed.reference import Reference

FEATURES = {"pooling": "mean", "prompt": None, "score": "native", "rw_layers": None, "max_length": 64}


def _fitted(n=5, d=3, L=2, E=4, seed=0, **meta):
    rng = np.random.default_rng(seed)
    hs, rw = rng.normal(size=(n, d)), rng.random(size=(n, L, E))
    return (
        hs,
        rw,
        Reference.fit(hs, rw, {"model": {"name": "m", "revision": "abc"}, "features": FEATURES, **meta}),
    )


# ----------------------------------------------------------------- fitting
def test_fit_is_the_population_mean_and_std_per_dimension_in_float64():
    hs, rw, r = _fitted()
    np.testing.assert_array_equal(r.hs_mean, hs.mean(0))
    np.testing.assert_array_equal(r.hs_std, hs.std(0, ddof=0))
    np.testing.assert_array_equal(r.rw_mean, rw.reshape(5, -1).mean(0))
    np.testing.assert_array_equal(r.rw_std, rw.reshape(5, -1).std(0))
    assert r.hs_mean.dtype == r.rw_std.dtype == np.float64 and r.rw_mean.shape == (8,)
    assert r.meta["n_texts"] == 5 and r.meta["features"] == FEATURES
    r32 = Reference.fit(hs.astype(np.float32), rw.astype(np.float32), {})
    assert r32.hs_mean.dtype == r32.rw_mean.dtype == r32.rw_std.dtype == np.float64
    np.testing.assert_array_equal(r32.rw_std, rw.astype(np.float32).astype(np.float64).reshape(5, -1).std(0))
    np.testing.assert_array_equal(r32.hs_mean, hs.astype(np.float32).astype(np.float64).mean(0))


def test_fit_needs_two_texts_and_finite_features():
    assert ref.check_reference_size(2) == 2
    with pytest.raises(
        ValueError, match="^a reference needs at least 2 texts to fit a mean and a std, got 1$"
    ):
        Reference.fit(np.zeros((1, 2)), np.zeros((1, 1, 2)), {})
    bad = np.zeros((3, 2))
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match="^the reference corpus gave NaN or inf features$"):
        Reference.fit(np.zeros((3, 2)), bad.reshape(3, 1, 2), {})
    with pytest.raises(ValueError, match="NaN or inf"):
        Reference.fit(np.full((3, 2), np.nan), np.zeros((3, 1, 2)), {})


# ----------------------------------------------------------------- files
def test_paths_of_a_reference_from_either_file_or_its_stem(tmp_path):
    pair = (tmp_path / "r.safetensors", tmp_path / "r.json")
    assert ref.reference_paths(tmp_path / "r") == pair
    assert ref.reference_paths(tmp_path / "r.json") == pair
    assert ref.reference_paths(str(tmp_path / "r.safetensors")) == pair
    assert ref.reference_paths(tmp_path / "r.v2") == (tmp_path / "r.v2.safetensors", tmp_path / "r.v2.json")


def test_save_and_load_round_trip_and_the_sidecar_records_format_version_and_digest(tmp_path):
    _, _, r = _fitted()
    written = r.save(tmp_path / "sub" / "deeper" / "r")  # missing parents are made
    assert written == tmp_path / "sub" / "deeper" / "r.safetensors"
    written = r.save(tmp_path / "sub" / "r")
    meta = json.loads((tmp_path / "sub" / "r.json").read_text())
    data = written.read_bytes()
    assert meta["format"] == "moee-reference" and meta["version"] == 1
    assert meta["sha256"] == hashlib.sha256(data).hexdigest()[:12] == ref.file_digest(written)
    assert meta["n_texts"] == 5 and "sidecar_sha256" in meta
    back = Reference.load(tmp_path / "sub" / "r.json")
    for k in ("hs_mean", "hs_std", "rw_mean", "rw_std"):
        np.testing.assert_array_equal(getattr(back, k), getattr(r, k))
        assert getattr(back, k).dtype == np.float64
    assert back.meta == meta
    again = back.save(tmp_path / "sub" / "r")  # a loaded reference saves with fresh digests
    assert (
        json.loads((tmp_path / "sub" / "r.json").read_text())["sha256"] == meta["sha256"] and again == written
    )


def test_save_refuses_an_existing_reference_without_overwrite(tmp_path):
    _, _, r = _fitted()
    r.save(tmp_path / "r")
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite to replace it"):
        r.save(tmp_path / "r", overwrite=False)
    (tmp_path / "r.safetensors").unlink()
    with pytest.raises(
        FileExistsError, match="already exists; pass --overwrite"
    ):  # the sidecar alone counts too
        r.save(tmp_path / "r", overwrite=False)
    assert not list(tmp_path.glob("*.tmp*")) and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_saved_files_take_the_processes_umask(tmp_path):
    _, _, r = _fitted()
    old = os.umask(0o027)
    try:
        r.save(tmp_path / "r")
    finally:
        os.umask(old)
    assert (tmp_path / "r.safetensors").stat().st_mode & 0o777 == 0o640


def _saved(tmp_path):
    _, _, r = _fitted()
    r.save(tmp_path / "r")
    return tmp_path / "r.safetensors", tmp_path / "r.json"


def _rewrite(sidecar, **changes):
    meta = json.loads(sidecar.read_text())
    meta.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del meta[k]
    meta.pop("sidecar_sha256", None)
    sidecar.write_text(json.dumps(meta))


def test_load_names_each_missing_file(tmp_path):
    tensors, sidecar = _saved(tmp_path)
    sidecar.unlink()
    with pytest.raises(
        FileNotFoundError, match=f"reference file {sidecar} does not exist; write it with moee fit-reference"
    ):
        Reference.load(tensors)
    tensors.unlink()
    with pytest.raises(FileNotFoundError, match=f"reference file {tensors} does not exist"):
        Reference.load(tensors)
    with pytest.raises(
        FileNotFoundError, match=f"reference {tensors} does not exist; write it with moee fit-reference"
    ):
        ref.file_digest(tensors)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "is not a moee reference \\(format 'moee-reference'\\)"),
        ('{"format": "other"}', "is not a moee reference"),
    ],
)
def test_load_refuses_a_sidecar_that_is_no_reference(tmp_path, text, message):
    tensors, sidecar = _saved(tmp_path)
    sidecar.write_text(text)
    with pytest.raises(ValueError, match=message):
        Reference.load(tensors)


def test_load_refuses_another_version_and_statistics_without_or_against_their_digest(tmp_path):
    tensors, sidecar = _saved(tmp_path)
    _rewrite(sidecar, version=2)
    with pytest.raises(ValueError, match="is reference version 2; this moee reads 1$"):
        Reference.load(tensors)
    _rewrite(sidecar, version=1, sha256=None)
    with pytest.raises(
        ValueError, match="has no sha256 of its statistics, so .* cannot be checked; fit the reference again"
    ):
        Reference.load(tensors)
    _rewrite(sidecar, sha256="0" * 12)
    with pytest.warns(
        UserWarning,
        match="written by an older moee without a content digest: its model and configuration cannot be "
        "checked for edits; fit it again to get one$",
    ) as record:
        with pytest.raises(ValueError, match=r"does not match its sidecar .* \(sha256 differs\)$"):
            Reference.load(tensors)
    assert len(record) == 1


def test_load_refuses_an_edited_sealed_sidecar_and_statistics_missing_a_tensor(tmp_path):
    from safetensors.numpy import save_file

    tensors, sidecar = _saved(tmp_path)
    meta = json.loads(sidecar.read_text())
    meta["n_texts"] = 6  # edited after sealing
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=f"^{sidecar} was changed after it was written .*; fit the reference again with moee fit-reference$",
    ):
        Reference.load(tensors)
    save_file({"hs_mean": np.zeros(3), "hs_std": np.ones(3)}, str(tensors))
    _rewrite(sidecar, n_texts=5, sha256=ref.file_digest(tensors))
    with pytest.warns(UserWarning):
        with pytest.raises(ValueError, match=r"lacks \['rw_mean', 'rw_std'\]$"):
            Reference.load(tensors)


# ----------------------------------------------------------------- which configuration
def test_a_reference_accepts_its_own_configuration_and_a_subset_of_layers_of_an_all_layer_fit():
    _, _, r = _fitted()
    assert r.accepts(dict(FEATURES))
    assert r.accepts({**FEATURES, "rw_layers": [0]})
    assert not r.accepts({**FEATURES, "pooling": "last"})
    assert not r.accepts({**FEATURES, "rw_layers": [0], "pooling": "last"})
    some = Reference.fit(np.zeros((2, 1)), np.zeros((2, 1, 1)), {"features": {**FEATURES, "rw_layers": [1]}})
    assert some.accepts({**FEATURES, "rw_layers": [1]})
    assert not some.accepts({**FEATURES, "rw_layers": [0]}) and not some.accepts(dict(FEATURES))
    assert not Reference.fit(np.zeros((2, 1)), np.zeros((2, 1, 1)), {}).accepts(
        {**FEATURES, "rw_layers": [0]}
    )


def test_check_names_the_other_model_or_every_differing_setting():
    _, _, r = _fitted()
    r.check("abc", dict(FEATURES), "R")
    bare = Reference.fit(np.zeros((2, 1)), np.zeros((2, 1, 1)), {})  # no model, no features recorded
    with pytest.raises(
        ValueError, match=r"fitted on model None with weights None, not on this model \(weights abc\)"
    ):
        bare.check("abc", {}, "R")
    with pytest.raises(
        ValueError,
        match=r"^reference R was fitted under another configuration \(pooling: reference None vs now 'mean'\)$",
    ):
        Reference.fit(np.zeros((2, 1)), np.zeros((2, 1, 1)), {"model": {"revision": "abc"}}).check(
            "abc", {"pooling": "mean"}, "R"
        )
    with pytest.raises(
        ValueError,
        match=r"^reference R was fitted on model 'm' with weights abc, not on this model \(weights xyz\); "
        "fit one for this model with moee fit-reference$",
    ):
        r.check("xyz", dict(FEATURES), "R")
    with pytest.raises(
        ValueError,
        match=r"^reference R was fitted under another configuration \(max_length: reference 64 vs now 32, "
        r"pooling: reference 'mean' vs now 'last', recipe: reference None vs now 'echo'\)$",
    ):
        r.check("abc", {**FEATURES, "pooling": "last", "max_length": 32, "recipe": "echo"}, "R")


# ----------------------------------------------------------------- z-scores
def test_apply_z_scores_each_row_alone_and_keeps_shapes_in_float32():
    hs, rw, r = _fitted()
    zh, zr = r.apply(hs, rw)
    assert zh.dtype == zr.dtype == np.float32 and zh.shape == hs.shape and zr.shape == rw.shape
    np.testing.assert_allclose(zh, (hs - hs.mean(0)) / hs.std(0), rtol=1e-6)
    np.testing.assert_allclose(zr, (rw - rw.mean(0)) / rw.std(0), rtol=1e-5)
    one_h, one_r = r.apply(hs[2:3], rw[2:3])  # a text alone gets its corpus vector
    np.testing.assert_array_equal(one_h, zh[2:3])
    np.testing.assert_array_equal(one_r, zr[2:3])


def test_apply_only_centres_dimensions_whose_std_is_below_the_floor():
    hs = np.array([[1.0, 5.0], [3.0, 5.0 + 1e-9]])
    r = Reference.fit(hs, np.array([[[0.0]], [[2.0]]]), {})
    zh, zr = r.apply(np.array([[2.0, 6.0]]), np.array([[[1.0]]]))
    np.testing.assert_allclose(zh, [[0.0, 6.0 - (10 + 1e-9) / 2]], atol=1e-6)  # divided by 1, not by 5e-10
    np.testing.assert_allclose(zr, [[[0.0]]])
    assert ref._safe(np.array([1e-8, 2e-8, 0.0])).tolist() == [1.0, 2e-8, 1.0]


def test_apply_slices_an_all_layer_fit_to_the_layers_the_features_hold():
    hs, rw, r = _fitted(L=3, E=2)
    zh, zr = r.apply(hs, rw[:, [0, 2]], rw_layers=[0, 2])
    full = r.apply(hs, rw)[1]
    np.testing.assert_array_equal(zr, full[:, [0, 2]])
    with pytest.raises(
        ValueError, match="^reference has HS width 3 and RW width 6, the features have 3 and 4$"
    ):
        r.apply(hs, rw[:, [0, 2]])  # a slice without saying which layers
    some = Reference.fit(hs, rw[:, [1]], {"features": {**FEATURES, "rw_layers": [1]}})
    np.testing.assert_array_equal(some.apply(hs, rw[:, [1]], rw_layers=[1])[1], some.apply(hs, rw[:, [1]])[1])
    with pytest.raises(ValueError, match="HS width 3 and RW width 6, the features have 2 and 6"):
        r.apply(hs[:, :2], rw)


# ----------------------------------------------------------------- weights digest and fingerprint
class _Embedder:
    def __init__(self, path=None, model=None):
        self.name_or_path, self.model = path, model


def test_weights_digest_of_a_folder_hashes_its_weight_files_by_name_and_bytes_not_its_reference(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    sha = hashlib.sha256(b"model.safetensors" + b"abc").hexdigest()[:12]
    assert ref.weights_digest(_Embedder(tmp_path)) == sha
    _, _, r = _fitted()
    r.save(tmp_path / "reference")  # a reference inside the folder is no weight
    assert ref.weights_digest(_Embedder(str(tmp_path))) == sha
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "other.safetensors").write_bytes(b"d")  # a .json beside it that is no reference
    assert (
        ref.weights_digest(_Embedder(tmp_path))
        == hashlib.sha256(b"model.safetensors" + b"abc" + b"other.safetensors" + b"d").hexdigest()[:12]
    )


def test_weights_digest_keeps_weights_whose_json_is_no_reference_or_unreadable(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "model.json").write_text("{not json")
    assert (
        ref.weights_digest(_Embedder(tmp_path))
        == hashlib.sha256(b"model.safetensors" + b"abc").hexdigest()[:12]
    )


def test_weights_digest_of_an_object_without_a_path_or_model_weights_is_unknown():
    assert ref.weights_digest(object()) == "unknown"
    assert ref.weights_digest(_Embedder(None, object())) == "unknown"


def test_weights_digest_of_a_bin_only_folder_and_of_live_or_in_memory_weights(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"xy")
    assert (
        ref.weights_digest(_Embedder(tmp_path))
        == hashlib.sha256(b"pytorch_model.bin" + b"xy").hexdigest()[:12]
    )
    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
        lin.bias.fill_(3.0)
    sha = hashlib.sha256()
    for name, t in sorted(lin.state_dict().items()):
        sha.update(name.encode())
        sha.update(t.float().numpy().tobytes())
    assert ref.weights_digest(_Embedder(tmp_path, lin), live=True) == sha.hexdigest()[:12]
    assert ref.weights_digest(_Embedder(None, lin)) == sha.hexdigest()[:12]
    assert ref.weights_digest(_Embedder(None, None)) == "unknown"


def test_weights_digest_of_a_hub_model_is_its_commit_and_of_offloaded_weights_their_shapes():
    lin = torch.nn.Linear(2, 1)
    lin.config = type("C", (), {"_commit_hash": "0123456789abcdef"})()
    assert ref.weights_digest(_Embedder("org/name", lin)) == "0123456789ab"
    assert ref.weights_digest(_Embedder("org/name", lin), live=True) != "0123456789ab"
    meta = torch.nn.Linear(2, 1, device="meta")
    sha = hashlib.sha256()
    for name, t in sorted(meta.state_dict().items()):
        sha.update(name.encode())
        sha.update(f"{tuple(t.shape)}:{t.dtype}".encode())
    assert ref.weights_digest(_Embedder(None, meta)) == sha.hexdigest()[:12]


def test_weights_fingerprint_sees_in_place_writes_not_moves():
    lin = torch.nn.Linear(2, 1)
    before = ref.weights_fingerprint(lin)
    assert [row[0] for row in before] == ["weight", "bias"] and before[0][3:] == (torch.float32, (1, 2))
    assert ref.weights_fingerprint(lin) == before
    with torch.no_grad():
        lin.weight.mul_(2)
    assert ref.weights_fingerprint(lin) != before
    assert ref.weights_fingerprint(object()) == ()
    first = torch.nn.Parameter(lin.weight.detach().clone())
    lin.weight = first
    again = ref.weights_fingerprint(lin)
    lin.weight = torch.nn.Parameter(first.detach().clone())  # another tensor of the same version and shape
    assert lin.weight._version == first._version and ref.weights_fingerprint(lin) != again


# ----------------------------------------------------------------- the cache
def test_load_cached_rereads_a_rewritten_reference_and_reads_a_missing_one_through_load(tmp_path):
    hs, rw, r = _fitted()
    r.save(tmp_path / "r")
    first = ref.load_cached(tmp_path / "r")
    assert ref.load_cached(tmp_path / "r.json") is first
    other = Reference.fit(hs * 2, rw, dict(r.meta))
    other.save(tmp_path / "r")
    os.utime(tmp_path / "r.safetensors", ns=(1, 1))  # another modification time
    second = ref.load_cached(tmp_path / "r")
    assert second is not first
    np.testing.assert_array_equal(second.hs_mean, other.hs_mean)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ref.load_cached(tmp_path / "missing")


def test_load_cached_keys_on_the_path_and_the_sidecars_size(tmp_path):
    """Two references of the same sizes and times at two paths are two entries; a rewrite that
    grows the statistics and the sidecar by the same bytes at the same time is read again."""
    hs, rw, r = _fitted()
    for name in ("a", "b"):
        Reference.fit(hs + (name == "b"), rw, dict(r.meta)).save(tmp_path / name)
        for f in (tmp_path / f"{name}.safetensors", tmp_path / f"{name}.json"):
            os.utime(f, ns=(5, 5))
    a, b = ref.load_cached(tmp_path / "a"), ref.load_cached(tmp_path / "b")
    assert a is not b and not np.array_equal(a.hs_mean, b.hs_mean)
    tensors, sidecar = tmp_path / "a.safetensors", tmp_path / "a.json"
    old = (tensors.stat().st_size, sidecar.stat().st_size)
    wide_hs = np.concatenate([hs, hs[:, :1]], axis=1)  # one more HS dimension: more statistics bytes
    for pad in range(200):
        Reference.fit(wide_hs, rw, {**r.meta, "note": "x" * pad}).save(tmp_path / "a")
        grown = (tensors.stat().st_size - old[0], sidecar.stat().st_size - old[1])
        if grown[0] == grown[1]:
            break
    assert grown[0] == grown[1] > 0
    for f in (tensors, sidecar):
        os.utime(f, ns=(5, 5))
    assert ref.load_cached(tmp_path / "a").hs_mean.shape == (4,)
