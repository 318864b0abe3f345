"""VectorIndex: faiss results equal numpy brute force; IVF recall; persistence; bad input."""

import json

import numpy as np
import pytest

from moee.index import VectorIndex, default_nlist, gpu_available
from moee.io import seal


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _brute(base, queries, k, metric="cosine"):
    if metric == "cosine":
        base, queries = _unit(base), _unit(queries)
    sims = queries @ base.T
    ids = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, ids, axis=1), ids


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(2000, 32)).astype(np.float32), rng.normal(size=(50, 32)).astype(np.float32)


@pytest.mark.parametrize("metric", ["cosine", "ip"])
def test_flat_equals_numpy_brute_force(data, metric):
    base, queries = data
    index = VectorIndex.build(base, metric=metric, device="cpu")
    assert len(index) == 2000 and index.dim == 32
    scores, ids = index.search(queries, k=10)
    ref_scores, ref_ids = _brute(base.astype(np.float64), queries.astype(np.float64), 10, metric)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-4, atol=1e-4)
    assert scores.dtype == np.float32 and ids.dtype == np.int64


def _recall(ids, ref):
    return np.mean([len(set(a) & set(b)) / ref.shape[1] for a, b in zip(ids, ref)])


def test_ivf_recall_is_reasonable(data):
    # embeddings have cluster structure (topics); IVF exploits it, isotropic noise has none
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(40, 32))
    base = (centers[rng.integers(0, 40, 4000)] + 0.3 * rng.normal(size=(4000, 32))).astype(np.float32)
    queries = (centers[rng.integers(0, 40, 100)] + 0.3 * rng.normal(size=(100, 32))).astype(np.float32)
    _, ref = _brute(base, queries, 10)
    index = VectorIndex.build(base, kind="ivf", device="cpu")
    assert index.nlist == default_nlist(4000)
    recall = _recall(index.search(queries, k=10)[1], ref)
    assert recall >= 0.9, recall
    index.set_nprobe(1)
    assert _recall(index.search(queries, k=10)[1], ref) < recall
    # probing every cell is exhaustive
    base, queries = data
    full = VectorIndex.build(base, kind="ivf", nlist=8, nprobe=8, device="cpu")
    _, ids = full.search(queries, k=10)
    _, ref = _brute(base, queries, 10)
    np.testing.assert_array_equal(ids, ref)


def test_add_continues_ids(data):
    base, _ = data
    index = VectorIndex(32, device="cpu")
    index.add(base[:100])
    index.add(base[100:300])
    _, ids = index.search(base[[5, 250]], k=1)
    assert ids[:, 0].tolist() == [5, 250]


def test_k_is_clipped_and_validated(data):
    base, queries = data
    index = VectorIndex.build(base[:3], device="cpu")
    scores, ids = index.search(queries[:2], k=10)
    assert ids.shape == (2, 3) and sorted(ids[0].tolist()) == [0, 1, 2]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="k must be >= 1"):
            index.search(queries, k=bad)
    with pytest.raises(TypeError, match="k must be an int"):
        index.search(queries, k=2.5)


def test_zero_vectors_do_not_produce_nan():
    base = np.eye(4, dtype=np.float32)
    base[2] = 0
    scores, ids = VectorIndex.build(base, device="cpu").search(np.ones((1, 4), np.float32), k=4)
    assert np.isfinite(scores).all()


def test_save_load_roundtrip(tmp_path, data):
    base, queries = data
    for kind in ("flat", "ivf"):
        index = VectorIndex.build(base, kind=kind, device="cpu")
        path = index.save(tmp_path / f"{kind}.faiss")
        meta = json.loads((tmp_path / f"{kind}.faiss.json").read_text())
        assert (
            meta["kind"] == kind
            and meta["dim"] == 32
            and meta["count"] == 2000
            and meta["metric"] == "cosine"
        )
        loaded = VectorIndex.load(path, device="cpu")
        assert (loaded.kind, loaded.nprobe, len(loaded)) == (kind, index.nprobe, 2000)
        for a, b in zip(index.search(queries, 5), loaded.search(queries, 5)):
            np.testing.assert_array_equal(a, b)


def test_load_errors(tmp_path, data):
    base, _ = data
    with pytest.raises(FileNotFoundError, match="index file not found"):
        VectorIndex.load(tmp_path / "missing.faiss")
    path = VectorIndex.build(base[:10], device="cpu").save(tmp_path / "x.faiss")
    sidecar = tmp_path / "x.faiss.json"
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**meta, "count": 11}))  # an edit: refused by the content digest
    with pytest.raises(ValueError, match="x.faiss.json was changed after it was written"):
        VectorIndex.load(path)
    sidecar.write_text(json.dumps(seal({**meta, "count": 11})))  # consistent, but not the file's
    with pytest.raises(ValueError, match="sidecar says 11"):
        VectorIndex.load(path)
    sidecar.unlink()
    with pytest.raises(FileNotFoundError, match="sidecar"):
        VectorIndex.load(path)


def test_bad_inputs(data):
    base, queries = data
    index = VectorIndex.build(base, device="cpu")
    with pytest.raises(ValueError, match="dimension 16, but the index has dimension 32"):
        index.search(queries[:, :16])
    with pytest.raises(ValueError, match="2-D"):
        index.search(queries[0])
    with pytest.raises(TypeError, match="float array"):
        index.search(queries.astype(np.int64))
    nan = queries.copy()
    nan[1, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or inf \\(first in row 1\\)"):
        index.search(nan)
    with pytest.raises(ValueError, match="index is empty"):
        VectorIndex(32, device="cpu").search(queries)
    with pytest.raises(ValueError, match="unknown index kind 'hnsw'"):
        VectorIndex(32, kind="hnsw")
    with pytest.raises(ValueError, match="not trained"):
        VectorIndex(32, kind="ivf", nlist=4, device="cpu").add(base)
    with pytest.raises(ValueError, match="needs >= 64 training vectors"):
        VectorIndex.build(base[:10], kind="ivf", nlist=64, device="cpu")


def test_device_selection():
    index = VectorIndex(8)
    assert index.on_gpu == gpu_available()
    if not gpu_available():
        with pytest.raises(ValueError, match="no GPU"):
            VectorIndex(8, device="gpu")


def test_chunked_build_from_memmap(tmp_path, data):
    base, queries = data
    np.save(tmp_path / "e.npy", base)
    mm = np.load(tmp_path / "e.npy", mmap_mode="r")
    chunked = VectorIndex.build(mm, device="cpu", chunk_rows=7)
    whole = VectorIndex.build(base, device="cpu")
    assert len(chunked) == 2000
    for a, b in zip(chunked.search(queries, 5), whole.search(queries, 5)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="cannot train an IVF index on 0 vectors"):
        VectorIndex.build(base[:0], kind="ivf", device="cpu")


def test_a_corrupted_index_file_is_refused(tmp_path, data):
    x, _ = data
    index = VectorIndex.build(x[:50])
    path = index.save(tmp_path / "i.faiss")
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # one flipped byte inside the stored vectors: faiss still reads the file
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"i.faiss does not match its sidecar \(checksum"):
        VectorIndex.load(path)
    (tmp_path / "d.faiss").mkdir()
    with pytest.raises(IsADirectoryError, match="d.faiss is a directory"):
        VectorIndex.load(tmp_path / "d.faiss")


def test_an_index_is_bound_to_the_embeddings_it_was_built_from(tmp_path, data):
    base, _ = data
    index = VectorIndex.build(base[:50], device="cpu")
    path = index.save(tmp_path / "x.faiss", source={"data_sha256": "a" * 64, "path": "/corpus.npy"})
    loaded = VectorIndex.load(path, device="cpu")
    assert loaded.source == {"data_sha256": "a" * 64, "path": "/corpus.npy"}
    loaded.check_source("a" * 64, "corpus.npy")
    with pytest.raises(ValueError, match=r"built from other embeddings \(/corpus.npy\) than other.npy"):
        loaded.check_source("b" * 64, "other.npy")
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        index.save(path, overwrite=False)
    sidecar = tmp_path / "x.faiss.json"  # an index sidecar of the previous format: read, with a warning
    old = {k: v for k, v in json.loads(sidecar.read_text()).items() if k not in ("sidecar_sha256", "source")}
    sidecar.write_text(json.dumps({**old, "format": "moee-index/2"}))
    with pytest.warns(UserWarning, match="older moee"):
        legacy = VectorIndex.load(path, device="cpu")
    with pytest.warns(UserWarning, match="records no source embeddings"):
        legacy.check_source("b" * 64, "other.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.faiss", "x.faiss.json"]
