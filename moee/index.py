"""Nearest-neighbour search over embeddings with faiss (flat or IVF, CPU or GPU).

Vectors are L2-normalised before they enter the index and queries before they are searched
(``metric="cosine"``, the default), so faiss' inner product is the cosine similarity that
every MoEE method is built for. ``metric="ip"`` keeps raw inner products.

Ids are row positions in the order vectors were added (0, 1, ...), so they index directly
into the embeddings/texts files. ``save`` writes the faiss index with ``faiss.write_index``
plus a JSON sidecar (``<path>.json``: kind, dim, count, metric, nlist, nprobe, the SHA-256 of
the index file, the ``data_sha256`` of the embeddings it was built from (``source``) and its own
content digest), committed as a pair (``moee.io.commit_with_sidecar``); ``load`` checks both, so a
truncated, corrupted, edited or mismatched pair is reported instead of silently searched, and
:meth:`VectorIndex.check_source` refuses an index built from other embeddings of the same shape.
An index sidecar of the previous format (``moee-index/2``) is read with a warning.

The GPU is used when the GPU build of faiss is installed and a GPU is visible
(``device="auto"``); ``device="cpu"``/``"gpu"`` force a choice.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from moee.embed.validation import check_choice, check_positive_int
from moee.io import check_input_file, commit_with_sidecar, file_sha256, read_sidecar, sidecar_path

KINDS = ("flat", "ivf")
METRICS = ("cosine", "ip")
DEVICES = ("auto", "cpu", "gpu")
#: faiss GPU indexes cannot return more neighbours than this per query.
GPU_MAX_K = 2048
SIDECAR_FORMAT = "moee-index/3"
LEGACY_SIDECAR_FORMATS = ("moee-index/2",)


def gpu_available() -> bool:
    """True when the installed faiss has GPU support and sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def default_nlist(n: int) -> int:
    """IVF cells for ``n`` training vectors: about ``4 sqrt(n)``, with >= 39 points per cell
    (faiss' k-means minimum), at least 1."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def default_nprobe(nlist: int) -> int:
    """Cells visited per query: a quarter of the cells, at least 8 (or all when fewer)."""
    return min(nlist, max(8, nlist // 4))


def _as_vectors(name: str, x: np.ndarray, dim: int | None) -> np.ndarray:
    """Validate a 2-D float matrix and return it as contiguous float32."""
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        hint = " (use x[None, :] for a single vector)" if arr.ndim == 1 else ""
        raise ValueError(f"{name} must be 2-D [n, dim], got shape {arr.shape}{hint}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{name} have dimension {arr.shape[1]}, but the index has dimension {dim}")
    if arr.shape[1] == 0:
        raise ValueError(f"{name} have dimension 0")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        raise ValueError(f"{name} contain NaN or inf (first in row {int(np.flatnonzero(~finite)[0])})")
    return arr


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


class VectorIndex:
    """A faiss index of embeddings searched by cosine (or inner product)."""

    def __init__(
        self,
        dim: int,
        *,
        kind: str = "flat",
        metric: str = "cosine",
        nlist: int | None = None,
        nprobe: int | None = None,
        device: str = "auto",
    ) -> None:
        """An empty index. ``ivf`` needs ``nlist`` here or training data via ``build``/``train``."""
        self.dim = check_positive_int("dim", dim)
        self.kind = check_choice("index kind", kind, KINDS)
        self.metric = check_choice("metric", metric, METRICS)
        check_choice("device", device, DEVICES)
        if device == "gpu" and not gpu_available():
            raise ValueError("device='gpu' but faiss has no GPU support or no GPU is visible")
        self.on_gpu = device == "gpu" or (device == "auto" and gpu_available())
        self.nlist = check_positive_int("nlist", nlist) if nlist is not None else None
        self.nprobe = check_positive_int("nprobe", nprobe) if nprobe is not None else None
        self._index: faiss.Index | None = None
        #: what the index was built from (``{"data_sha256", "path"}`` of its embeddings), when known
        self.source: dict[str, Any] | None = None
        self.path: Path | None = None  # the file it was loaded from
        if kind == "flat":
            self._set_index(faiss.IndexFlatIP(self.dim))
        elif self.nlist is not None:
            self._create_ivf(self.nlist)

    # construction -----------------------------------------------------------------
    def _set_index(self, index: faiss.Index) -> None:
        if self.on_gpu:
            self._gpu_resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self._index = index

    def _create_ivf(self, nlist: int) -> None:
        self.nlist = nlist
        self.nprobe = min(self.nprobe or default_nprobe(nlist), nlist)
        self._set_index(faiss.index_factory(self.dim, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT))
        self._apply_nprobe()

    def set_nprobe(self, nprobe: int) -> None:
        """Trade speed for recall on an IVF index: cells visited per query (clipped to nlist)."""
        if self.kind != "ivf":
            raise ValueError("nprobe applies to IVF indexes only")
        self.nprobe = min(check_positive_int("nprobe", nprobe), self.nlist or nprobe)
        self._apply_nprobe()

    def _apply_nprobe(self) -> None:
        if self.kind == "ivf" and self._index is not None:
            if self.on_gpu:
                self._index.nprobe = self.nprobe
            else:
                faiss.extract_index_ivf(self._index).nprobe = self.nprobe

    @classmethod
    def build(
        cls,
        embeddings: np.ndarray,
        *,
        kind: str = "flat",
        metric: str = "cosine",
        nlist: int | None = None,
        nprobe: int | None = None,
        device: str = "auto",
        chunk_rows: int = 65536,
        seed: int = 0,
    ) -> VectorIndex:
        """Index ``embeddings [n, dim]`` (may be a memory-mapped .npy).

        Rows are normalised and added ``chunk_rows`` at a time, so memory beyond the index
        itself stays bounded. IVF is first trained on at most ``256 * nlist`` rows drawn
        with ``seed`` (faiss' k-means would subsample to that many anyway).
        """
        if not isinstance(embeddings, np.ndarray):
            embeddings = np.asarray(embeddings)
        if embeddings.ndim != 2:
            _as_vectors("embeddings", embeddings, None)  # raises the shape error
        index = cls(embeddings.shape[1], kind=kind, metric=metric, nlist=nlist, nprobe=nprobe, device=device)
        n = embeddings.shape[0]
        if kind == "ivf":
            cells = index.nlist or default_nlist(n)
            sample = n if n <= 256 * cells else 256 * cells
            rows = (
                np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))
                if sample < n
                else slice(None)
            )
            if index._index is None:
                index._create_ivf(cells)
            index.train(embeddings[rows])
        for start in range(0, n, check_positive_int("chunk_rows", chunk_rows)):
            index.add(embeddings[start : start + chunk_rows])
        return index

    def _prepare(self, name: str, x: np.ndarray) -> np.ndarray:
        vectors = _as_vectors(name, x, self.dim)
        return _unit_rows(vectors) if self.metric == "cosine" else vectors

    def train(self, embeddings: np.ndarray) -> None:
        """Train the IVF coarse quantizer (k-means) on representative vectors."""
        if self.kind != "ivf":
            return
        vectors = self._prepare("training vectors", embeddings)
        if len(vectors) == 0:
            raise ValueError("cannot train an IVF index on 0 vectors")
        if self._index is None:
            self._create_ivf(default_nlist(len(vectors)))
        if len(vectors) < self.nlist:
            raise ValueError(
                f"IVF with nlist={self.nlist} needs >= {self.nlist} training vectors, got {len(vectors)}"
            )
        self._index.train(vectors)

    def add(self, embeddings: np.ndarray) -> None:
        """Append vectors; their ids continue from ``len(self)``."""
        vectors = self._prepare("embeddings", embeddings)
        if self._index is None or not self._index.is_trained:
            raise ValueError("the IVF index is not trained: call train() first or use VectorIndex.build()")
        if len(vectors):
            self._index.add(vectors)

    def __len__(self) -> int:
        return 0 if self._index is None else int(self._index.ntotal)

    # search -----------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` neighbours of each query: ``(scores [q, k'], ids [q, k'])``, best first.

        ``k`` is clipped to the number of indexed vectors (``k' = min(k, len(self))``). An IVF
        search that finds fewer than ``k'`` candidates in its probed cells fills the rest
        with id -1 and score -inf.
        """
        k = check_positive_int("k", k)
        if len(self) == 0:
            raise ValueError("the index is empty: add vectors before searching")
        q = self._prepare("queries", queries)
        k = min(k, len(self))
        if self.on_gpu and k > GPU_MAX_K:
            raise ValueError(f"faiss GPU indexes return at most {GPU_MAX_K} neighbours, got k={k}")
        if len(q) == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        scores, ids = self._index.search(q, k)
        scores = np.asarray(scores, dtype=np.float32)
        ids = np.asarray(ids, dtype=np.int64)
        scores[ids < 0] = -np.inf
        return scores, ids

    # persistence ------------------------------------------------------------------
    def save(self, path: str | Path, *, source: dict[str, Any] | None = None, overwrite: bool = True) -> Path:
        """Write the index to ``path`` and its description to ``<path>.json``. ``source``: what it
        was built from (``{"data_sha256": ..., "path": ...}`` of the embeddings file; default
        :attr:`source`), checked by :meth:`check_source` after loading. ``overwrite=False`` refuses
        an existing index."""
        from moee.io import output_lock, temporary_path

        if self._index is None:
            raise ValueError("the IVF index has no cells yet: train it before saving")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        source = source if source is not None else self.source
        cpu_index = faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index
        with output_lock(path):
            if not overwrite and path.exists():
                raise FileExistsError(f"index {path} already exists; pass --overwrite to replace it")
            partial = temporary_path(path)
            try:
                faiss.write_index(cpu_index, str(partial))
                saved = self._commit(partial, path, source, overwrite)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        self.source = source
        return saved

    def _commit(self, partial: Path, path: Path, source: dict[str, Any] | None, overwrite: bool) -> Path:
        meta = {
            "format": SIDECAR_FORMAT,
            "kind": self.kind,
            "dim": self.dim,
            "count": len(self),
            "metric": self.metric,
            "nlist": self.nlist,
            "nprobe": self.nprobe,
            "faiss": faiss.__version__,
            "sha256": file_sha256(partial),
            "source": source,
        }
        return commit_with_sidecar(partial, path, meta, overwrite=overwrite)

    def check_source(self, data_sha256: str | None, embeddings: Any = "the embeddings") -> None:
        """Refuse an index that was not built from embeddings whose data hash is ``data_sha256``
        (another corpus of the same shape would give other neighbours with no sign of it); an index
        saved without a record of its source is searched with a warning."""
        recorded = (self.source or {}).get("data_sha256")
        if recorded is None:
            warnings.warn(
                f"index {self.path or ''} records no source embeddings: it cannot be checked against "
                f"{embeddings}; save it again with moee search --save-index",
                stacklevel=2,
            )
            return
        if recorded != data_sha256:
            built = (self.source or {}).get("path")
            raise ValueError(
                f"index {self.path or ''} was built from other embeddings"
                f"{f' ({built})' if built else ''} than {embeddings} (data_sha256 {recorded[:12]} vs "
                f"{str(data_sha256)[:12]}); rebuild it from {embeddings} (--save-index), or load the one built from them"
            )

    @classmethod
    def load(cls, path: str | Path, *, device: str = "auto", nprobe: int | None = None) -> VectorIndex:
        """Read an index written by ``save`` (both files must exist and agree)."""
        path = check_input_file(path, "index file")
        sidecar = sidecar_path(path)
        meta = read_sidecar(
            sidecar,
            fmt=SIDECAR_FORMAT,
            kind="index",
            missing=f"index sidecar {sidecar} is missing (written by VectorIndex.save)",
            remedy="save the index again",
            legacy=LEGACY_SIDECAR_FORMATS,
            format_hint=lambda found: "; save the index again",
        )
        if file_sha256(path) != meta.get("sha256"):
            raise ValueError(
                f"{path} does not match its sidecar (checksum differs): the index file is corrupted or "
                "was replaced; rebuild it"
            )
        raw = faiss.read_index(str(path))
        if raw.d != meta["dim"] or raw.ntotal != meta["count"]:
            raise ValueError(
                f"{path} holds {raw.ntotal} vectors of dimension {raw.d}, but its sidecar says "
                f"{meta['count']} of dimension {meta['dim']}"
            )
        index = cls(
            meta["dim"],
            kind=meta["kind"],
            metric=meta["metric"],
            nprobe=nprobe or meta.get("nprobe"),
            device=device,
        )
        index.nlist = meta.get("nlist")
        index.source = meta.get("source")
        index.path = path
        index._set_index(raw)
        index._apply_nprobe()
        return index

    def __repr__(self) -> str:
        where = "gpu" if self.on_gpu else "cpu"
        extra = f", nlist={self.nlist}, nprobe={self.nprobe}" if self.kind == "ivf" else ""
        return f"VectorIndex(kind={self.kind!r}, metric={self.metric!r}, dim={self.dim}, count={len(self)}{extra}, {where})"
