"""Reference standardisation: per-dimension mean and std of HS and RW, fitted once on a corpus.

The paper z-scores HS and RW with the statistics of the batch being embedded, so a text's vector
depends on its batch neighbours and a single query cannot be embedded like the corpus. Here the
statistics are fitted once (``MoEEmbedder.fit_reference`` / ``moee fit-reference``) and applied
to every text, row by row: ``z = (x - mean) / std`` per dimension, for HS and RW, before the method
combines them. A text alone gets exactly the vector it gets inside any corpus run.

A reference is two files: ``NAME.safetensors`` (float64 ``hs_mean``, ``hs_std``, ``rw_mean``,
``rw_std``; RW flattened in layer order) and ``NAME.json`` beside it: format and version, the
model (name, weights hash), the feature configuration it was fitted under (pooling, prompt
templates, score, recipe, hs_layer, rw_layers, and the embedder's ``max_length``, which decides
where long texts are cut), the number of texts, the moee version, the
statistics' digest (``sha256``, required) and the sidecar's own content digest
(``sidecar_sha256``, ``moee.io.seal``). Using a reference with another model or another feature
configuration is an error that names the difference; so are statistics or a sidecar changed after
they were written. The pair is written under temporary names and committed together
(``moee.io.commit_with_sidecar``), with the process' normal file mode (umask). No pickle anywhere
(safetensors + JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MIN_TEXTS",
    "REFERENCE_FORMAT",
    "Reference",
    "check_reference_size",
    "file_digest",
    "reference_paths",
    "weights_digest",
    "weights_fingerprint",
]

REFERENCE_FORMAT = "moee-reference"
REFERENCE_VERSION = 1
#: A dimension whose reference std is below this is only centred (divided by 1), never blown up.
MIN_STD = 1e-8
#: The fewest texts a reference is fitted on (a std needs two).
MIN_TEXTS = 2


def check_reference_size(n_texts: int) -> int:
    """``n_texts`` when a reference can be fitted on that many texts, else a ``ValueError`` saying so."""
    if n_texts < MIN_TEXTS:
        raise ValueError(
            f"a reference needs at least {MIN_TEXTS} texts to fit a mean and a std, got {n_texts}"
        )
    return n_texts


def reference_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(``.safetensors``, ``.json``) of a reference given by either file or by its stem."""
    path = Path(path)
    if path.suffix in (".safetensors", ".json"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".safetensors"), path.with_name(path.name + ".json")


def file_digest(path: str | os.PathLike) -> str:
    """Short sha256 of a reference's tensors: what names result folders (not its path)."""
    tensors, _ = reference_paths(path)
    if not tensors.is_file():
        raise FileNotFoundError(f"reference {tensors} does not exist; write it with moee fit-reference")
    sha = hashlib.sha256()
    with tensors.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()[:12]


def weights_fingerprint(model: Any) -> tuple:
    """What changes when a weight is modified in memory, without reading the weights: per
    ``state_dict`` entry its name, tensor identity, autograd version counter (bumped by every
    in-place write: ``load_state_dict``, ``w.mul_(0)`` under ``no_grad``), dtype and shape. Moving
    the model to another device keeps it; a write through ``w.data`` bypasses the version counter
    and is not seen (write through the tensor itself)."""
    if not hasattr(model, "state_dict"):
        return ()
    return tuple(
        (name, id(t), t._version, t.dtype, tuple(t.shape))
        for name, t in model.state_dict(keep_vars=True).items()
        if hasattr(t, "_version")
    )


def weights_digest(embedder: Any, *, live: bool = False) -> str:
    """A short, stable hash of the weights: the mteb revision, and the model a reference belongs to.

    A local model directory is hashed through its weight files (cheap, and identical for
    every process that loads the same files); an in-memory model, or any model with ``live=True``
    (weights changed after loading, see :func:`weights_fingerprint`), through its parameters.
    """
    sha = hashlib.sha256()
    path = getattr(embedder, "name_or_path", None)
    files: list[Path] = []
    if not live and path and Path(str(path)).is_dir():
        files = [f for f in sorted(Path(str(path)).glob("*.safetensors")) if not _is_reference(f)]
        files = files or sorted(Path(str(path)).glob("*.bin"))
    if files:
        for file in files:
            sha.update(file.name.encode())
            with file.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    sha.update(chunk)
        return sha.hexdigest()[:12]
    model = getattr(embedder, "model", None)
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    if commit and not live:
        return str(commit)[:12]
    if model is not None and hasattr(model, "state_dict"):
        for name, tensor in sorted(model.state_dict().items()):
            sha.update(name.encode())
            if tensor.device.type == "meta":  # offloaded: only its place in the model is known here
                sha.update(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
                continue
            sha.update(tensor.detach().float().cpu().numpy().tobytes())
        return sha.hexdigest()[:12]
    return "unknown"


def _is_reference(tensors: Path) -> bool:
    """Whether a ``.safetensors`` file of a model folder is a reference's statistics (its ``.json``
    sidecar says so), not weights: a folder that carries its reference keeps its weights digest."""
    sidecar = tensors.with_suffix(".json")
    if not sidecar.is_file():
        return False
    try:
        return json.loads(sidecar.read_text(encoding="utf-8")).get("format") == REFERENCE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class Reference:
    """Fitted per-dimension statistics; ``meta`` is the JSON sidecar."""

    hs_mean: np.ndarray
    hs_std: np.ndarray
    rw_mean: np.ndarray
    rw_std: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def fit(cls, hs: np.ndarray, rw: np.ndarray, meta: dict[str, Any]) -> Reference:
        """Statistics of ``hs [n, d]`` and ``rw [n, L, E]`` (float64; population std)."""
        check_reference_size(len(hs))
        h = np.asarray(hs, dtype=np.float64).reshape(hs.shape[0], -1)
        r = np.asarray(rw, dtype=np.float64).reshape(rw.shape[0], -1)
        if not (np.isfinite(h).all() and np.isfinite(r).all()):
            raise ValueError("the reference corpus gave NaN or inf features")
        return cls(h.mean(0), h.std(0), r.mean(0), r.std(0), {"n_texts": int(h.shape[0]), **meta})

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike, *, overwrite: bool = True) -> Path:
        """Write ``NAME.safetensors`` + ``NAME.json`` as a pair; returns the ``.safetensors`` path.
        ``overwrite=False`` refuses an existing reference (either file)."""
        from safetensors.numpy import save as to_bytes

        from moee.io import commit_with_sidecar, output_lock, temporary_path

        tensors, sidecar = reference_paths(path)
        tensors.parent.mkdir(parents=True, exist_ok=True)
        data = to_bytes(
            {k: np.ascontiguousarray(getattr(self, k)) for k in ("hs_mean", "hs_std", "rw_mean", "rw_std")}
        )
        with output_lock(tensors):
            if not overwrite and (tensors.exists() or sidecar.exists()):
                raise FileExistsError(f"reference {tensors} already exists; pass --overwrite to replace it")
            partial = temporary_path(tensors)
            with open(partial, "xb") as fh:  # open(): the process' umask decides the mode
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            meta = {
                "format": REFERENCE_FORMAT,
                "version": REFERENCE_VERSION,
                **{k: v for k, v in self.meta.items() if k not in ("sha256", "sidecar_sha256")},
                "sha256": hashlib.sha256(data).hexdigest()[:12],
            }
            try:
                return commit_with_sidecar(partial, tensors, meta, sidecar=sidecar, overwrite=overwrite)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Reference:
        """Read a reference (``ValueError`` naming what is wrong with it)."""
        from safetensors.numpy import load_file

        tensors, sidecar = reference_paths(path)
        for file in (tensors, sidecar):
            if not file.is_file():
                raise FileNotFoundError(
                    f"reference file {file} does not exist; write it with moee fit-reference"
                )
        try:
            meta = json.loads(sidecar.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"reference sidecar {sidecar} is not valid JSON: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != REFERENCE_FORMAT:
            raise ValueError(f"{sidecar} is not a moee reference (format {REFERENCE_FORMAT!r})")
        if meta.get("version") != REFERENCE_VERSION:
            raise ValueError(
                f"{sidecar} is reference version {meta.get('version')}; this moee reads {REFERENCE_VERSION}"
            )
        if "sha256" not in meta:
            raise ValueError(
                f"reference sidecar {sidecar} has no sha256 of its statistics, so {tensors} cannot be "
                "checked; fit the reference again with moee fit-reference"
            )
        if "sidecar_sha256" in meta:
            from moee.io import check_seal

            check_seal(meta, sidecar, remedy="fit the reference again with moee fit-reference")
        else:
            warnings.warn(
                f"reference sidecar {sidecar} was written by an older moee without a content digest: "
                "its model and configuration cannot be checked for edits; fit it again to get one",
                stacklevel=2,
            )
        if meta["sha256"] != file_digest(tensors):
            raise ValueError(f"{tensors} does not match its sidecar {sidecar} (sha256 differs)")
        data = load_file(str(tensors))
        missing = {"hs_mean", "hs_std", "rw_mean", "rw_std"} - set(data)
        if missing:
            raise ValueError(f"reference {tensors} lacks {sorted(missing)}")
        return cls(
            **{k: data[k].astype(np.float64) for k in ("hs_mean", "hs_std", "rw_mean", "rw_std")}, meta=meta
        )

    # ------------------------------------------------------------------ use
    def accepts(self, features: dict[str, Any]) -> bool:
        """Whether these statistics standardise features of that configuration: the one they were
        fitted under, or a subset of its MoE layers (``rw_layers``) when they were fitted on all."""
        fitted = self.meta.get("features", {})
        if fitted == features:
            return True
        rest = {k: v for k, v in fitted.items() if k != "rw_layers"}
        return (
            fitted.get("rw_layers") is None
            and features.get("rw_layers") is not None
            and rest == {k: v for k, v in features.items() if k != "rw_layers"}
        )

    def check(self, revision: str, features: dict[str, Any], path: Any = "") -> None:
        """Refuse a reference of another model (weights hash) or feature configuration."""
        model = self.meta.get("model", {})
        if model.get("revision") != revision:
            raise ValueError(
                f"reference {path} was fitted on model {model.get('name')!r} with weights {model.get('revision')}, "
                f"not on this model (weights {revision}); fit one for this model with moee fit-reference"
            )
        if not self.accepts(features):
            fitted = self.meta.get("features", {})
            diff = sorted(k for k in set(fitted) | set(features) if fitted.get(k) != features.get(k))
            details = ", ".join(f"{k}: reference {fitted.get(k)!r} vs now {features.get(k)!r}" for k in diff)
            raise ValueError(f"reference {path} was fitted under another configuration ({details})")

    def apply(
        self, hs: np.ndarray, rw: np.ndarray, *, rw_layers: list[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Row-wise z-scores of ``hs [n, d]`` and ``rw [n, L, E]`` (shapes kept, float32).
        ``rw_layers``: the MoE layers (non-negative, model order) ``rw`` holds of a reference fitted on
        every layer, whose statistics are sliced to them."""
        n = hs.shape[0]
        h = hs.reshape(n, -1).astype(np.float64)
        r = rw.reshape(n, -1).astype(np.float64)
        rw_mean, rw_std = self.rw_mean, self.rw_std
        fitted_on_all = self.meta.get("features", {}).get("rw_layers") is None
        if rw_layers is not None and fitted_on_all and rw.ndim == 3 and rw_mean.shape[0] % rw.shape[2] == 0:
            per_layer = (-1, rw.shape[2])
            rw_mean = rw_mean.reshape(per_layer)[rw_layers].reshape(-1)
            rw_std = rw_std.reshape(per_layer)[rw_layers].reshape(-1)
        if h.shape[1] != self.hs_mean.shape[0] or r.shape[1] != rw_mean.shape[0]:
            raise ValueError(
                f"reference has HS width {self.hs_mean.shape[0]} and RW width {rw_mean.shape[0]}, "
                f"the features have {h.shape[1]} and {r.shape[1]}"
            )
        zh = (h - self.hs_mean) / _safe(self.hs_std)
        zr = (r - rw_mean) / _safe(rw_std)
        return zh.astype(np.float32).reshape(hs.shape), zr.astype(np.float32).reshape(rw.shape)


def _safe(std: np.ndarray) -> np.ndarray:
    return np.where(std > MIN_STD, std, 1.0)


_CACHE: dict[tuple[str, int, int], Reference] = {}


def load_cached(path: str | os.PathLike) -> Reference:
    """:meth:`Reference.load`, kept per (path, modification time, size) so every batch does not reread it."""
    tensors, sidecar = reference_paths(path)
    try:
        stat = tensors.stat()
        key = (str(tensors.resolve()), stat.st_mtime_ns, stat.st_size + sidecar.stat().st_size)
    except OSError:
        return Reference.load(path)
    if key not in _CACHE:
        _CACHE[key] = Reference.load(path)
    return _CACHE[key]
