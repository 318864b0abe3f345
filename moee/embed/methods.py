"""Embedding methods: turn pooled hidden states (HS) and routing weights (RW) into vectors.

Every method works row by row: a text's vector depends only on its own HS and RW, never on
the other rows of the batch (the official code z-scores with batch statistics, which makes a
text's embedding depend on its neighbours; we replace that by per-text block scaling).

- ``hs``: ``h``.
- ``rw``: ``r``, the per-layer routing distributions flattened in layer order.
- ``moee_concat``: ``[sqrt(d_h) h/|h| ; sqrt(d_r) r/|r|]``: each block is rescaled as if every
  dimension had unit variance (the per-text analogue of the paper's standardisation), so the
  larger block is not drowned by the smaller one's scale.
- ``moee_sum``: ``[h/|h| ; sqrt(alpha) r/|r|] / sqrt(1 + alpha)``. For two texts,
  ``cos(sum_1, sum_2) = (cos_h + alpha cos_r) / (1 + alpha)``: one vector that ranks pairs
  exactly like the paper's similarity sum ``cos_h + alpha cos_r`` and can be fed to any
  classifier, clusterer or faiss index.

``normalize=True`` L2-normalises the final rows. A zero row stays zero (no NaN).

Each method is one entry of :data:`METHOD_REGISTRY` (its width, whether it uses ``alpha``, its
table label and its combine function); everything else (``combine``, ``output_dim``, the CLI
choices, ``moee.embed.config.EmbeddingConfig``, the result tables) reads that entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moee.capture.vocabulary import DEFAULT_SCORE, POOLINGS, SCORES
from moee.embed.validation import check_alpha, check_choice

#: The pooling and score vocabulary is capture's (``moee.capture.vocabulary``); re-exported here for
#: the embedding API and its callers.
__all__ = [
    "DEFAULT_SCORE",
    "METHOD_REGISTRY",
    "METHODS",
    "POOLINGS",
    "SCORES",
    "Method",
    "SIMILARITIES",
    "combine",
    "method_spec",
    "output_dim",
    "similarity",
]


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """Divide each row by its L2 norm; rows with norm 0 stay 0."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def _as_matrix(name: str, x: np.ndarray | None, ndim: tuple[int, ...]) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name} is required for this method")
    arr = np.asarray(x)
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise TypeError(f"{name} must be a numeric array, got dtype {arr.dtype}")
    if arr.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, got shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False).reshape(arr.shape[0], int(np.prod(arr.shape[1:])))
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        raise ValueError(f"{name} contains NaN or inf (first in row {int(np.flatnonzero(~finite)[0])})")
    return arr


def _moee_concat(h: np.ndarray, r: np.ndarray, alpha: float) -> np.ndarray:
    return np.concatenate([np.sqrt(h.shape[1]) * _unit_rows(h), np.sqrt(r.shape[1]) * _unit_rows(r)], axis=1)


def _moee_sum(h: np.ndarray, r: np.ndarray, alpha: float) -> np.ndarray:
    return np.concatenate([_unit_rows(h), np.sqrt(alpha) * _unit_rows(r)], axis=1) / np.sqrt(1.0 + alpha)


@dataclass(frozen=True)
class Method:
    """Everything moee knows about one embedding method, so that adding one is one registry entry.

    ``width(d_h, d_r)`` is the vector width for hidden size ``d_h`` and ``d_r = layers * experts``;
    ``combine(h, r, alpha)`` maps float64 ``[n, d_h]`` / ``[n, d_r]`` rows (``None`` for an input
    the method does not use) to ``[n, width]``; ``uses_alpha`` says whether ``alpha`` changes the
    vectors (only then is it recorded in result folders and labels); ``similarity`` is how two of its
    vectors compare (a key of :data:`SIMILARITIES`).
    """

    name: str
    label: str
    width: Callable[[int, int], int]
    combine: Callable[[np.ndarray | None, np.ndarray | None, float], np.ndarray]
    uses_hs: bool = True
    uses_rw: bool = True
    uses_alpha: bool = False
    similarity: str = "cosine"


#: The embedding methods, in the order of tables and ``METHODS``.
METHOD_REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("hs", "HS", lambda d_h, d_r: d_h, lambda h, r, alpha: h, uses_rw=False),
        Method("rw", "RW", lambda d_h, d_r: d_r, lambda h, r, alpha: r, uses_hs=False),
        Method("moee_concat", "MoEE concat", lambda d_h, d_r: d_h + d_r, _moee_concat),
        Method("moee_sum", "MoEE sum", lambda d_h, d_r: d_h + d_r, _moee_sum, uses_alpha=True),
    )
}
METHODS = tuple(METHOD_REGISTRY)


def method_spec(method: str) -> Method:
    """The registry entry of ``method`` (``ValueError`` listing the methods if unknown)."""
    return METHOD_REGISTRY[check_choice("method", method, METHODS)]


def combine(
    hs: np.ndarray | None,
    rw: np.ndarray | None,
    method: str,
    alpha: float = 1.0,
    normalize: bool = True,
) -> np.ndarray:
    """Build the embedding matrix of ``method`` from ``hs [n, d_h]`` and ``rw [n, L, E]``.

    ``rw`` may also be given already flattened as ``[n, L*E]``. The input not used by the
    method (``rw`` for ``hs``, ``hs`` for ``rw``) may be ``None``. Arithmetic is float64,
    the result float32 ``[n, dim]``.
    """
    spec = method_spec(method)
    alpha = check_alpha(alpha)
    h = _as_matrix("hs", hs, (2,)) if spec.uses_hs else None
    r = _as_matrix("rw", rw, (2, 3)) if spec.uses_rw else None
    if h is not None and r is not None and h.shape[0] != r.shape[0]:
        raise ValueError(f"hs and rw disagree on the number of rows: {h.shape[0]} vs {r.shape[0]}")

    out = spec.combine(h, r, alpha)
    if normalize:
        out = _unit_rows(out)
    return np.ascontiguousarray(out, dtype=np.float32)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _unit_rows(a) @ _unit_rows(b).T


#: Similarity functions of embedding matrices ``[n, d]``, ``[m, d]`` -> ``[n, m]`` (float64).
SIMILARITIES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "cosine": _cosine,
    "dot": lambda a, b: a @ b.T,
}


def similarity(a, b, name: str = "cosine"):
    """``[len(a), len(b)]`` similarities of two embedding sets (a 1-D vector is a set of one) under
    ``name``; float32 numpy, or a torch tensor when ``a`` is one."""
    fn = SIMILARITIES[check_choice("similarity", name, tuple(SIMILARITIES))]
    as_tensor = hasattr(a, "detach") and hasattr(a, "cpu")
    device = a.device if as_tensor else None
    mats = []
    for name_, x in (("a", a), ("b", b)):
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()
        arr = np.asarray(x, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2:
            raise ValueError(f"{name_} must be a vector or a matrix of embeddings, got shape {arr.shape}")
        mats.append(arr)
    if mats[0].shape[1] != mats[1].shape[1]:
        raise ValueError(f"a and b have different widths: {mats[0].shape[1]} vs {mats[1].shape[1]}")
    out = np.ascontiguousarray(fn(*mats), dtype=np.float32)
    if as_tensor:
        import torch

        return torch.from_numpy(out).to(device)
    return out


def output_dim(method: str, hidden_size: int, n_layers: int, n_experts: int) -> int:
    """Width of ``method``'s vectors, e.g. to pre-allocate or to report in a sidecar."""
    return method_spec(method).width(hidden_size, n_layers * n_experts)
