"""Per-token routing as a table, for notebooks: a ``pyarrow.Table`` (``.to_pandas()``) and Parquet.

One row per token of every text (``MoEEmbedder.iter_token_routes``: raw text unless a prompt is
given, memory bounded by one batch while reading; the table itself holds every row):

``text_id`` (the text's position in the input, or the ``ids`` given), ``position`` (0-based token
position), ``token_id``, ``token`` (the tokenizer's piece), then per MoE layer ``i``:
``layer{i}_experts`` (the router's own selection, list of int, -1 pads a layer with a smaller k)
and ``layer{i}_weights`` (the ``score`` of each selected expert: by default the architecture's
native scores, before any top-k renormalisation), and with ``dense=True`` ``layer{i}_probs``
(the dense scores over all experts). The schema metadata records the layer (router) names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["routing_table", "write_routing_parquet"]


def routing_table(
    embedder: Any,
    texts: Sequence[str],
    *,
    ids: Sequence[Any] | None = None,
    dense: bool = False,
    prompt: str | None = None,
    score: str | None = None,
    batch_size: int = 16,
) -> Any:
    """The per-token routing of ``texts`` as a ``pyarrow.Table`` (columns in the module docstring)."""
    import pyarrow as pa

    if ids is not None and len(ids) != len(texts):
        raise ValueError(f"ids has {len(ids)} entries for {len(texts)} texts")
    kwargs: dict[str, Any] = {"prompt": prompt, "batch_size": batch_size}
    if score is not None:
        kwargs["score"] = score
    n_layers = len(embedder.routers)
    cols: dict[str, list] = {"text_id": [], "position": [], "token_id": [], "token": []}
    per_layer: dict[str, list] = {}
    for i in range(n_layers):
        per_layer[f"layer{i}_experts"] = []
        per_layer[f"layer{i}_weights"] = []
        if dense:
            per_layer[f"layer{i}_probs"] = []
    tokenizer = embedder.tokenizer
    for routes in embedder.iter_token_routes(list(texts), **kwargs):
        n = len(routes.input_ids)
        text_id = ids[routes.index] if ids is not None else routes.index
        cols["text_id"] += [text_id] * n
        cols["position"] += list(range(n))
        cols["token_id"] += routes.input_ids.tolist()
        cols["token"] += tokenizer.convert_ids_to_tokens(routes.input_ids.tolist())
        if routes.selection is None:
            raise ValueError("a router of this model neither returns its selection nor declares its k")
        for i in range(n_layers):
            chosen = routes.selection[:, i]
            safe = np.where(chosen >= 0, chosen, 0)
            picked = np.take_along_axis(routes.probs[:, i], safe, axis=-1)
            per_layer[f"layer{i}_experts"] += chosen.tolist()
            per_layer[f"layer{i}_weights"] += np.where(chosen >= 0, picked, np.nan).tolist()
            if dense:
                per_layer[f"layer{i}_probs"] += routes.probs[:, i].tolist()
    arrays = {
        "text_id": pa.array(cols["text_id"]),
        "position": pa.array(cols["position"], pa.int32()),
        "token_id": pa.array(cols["token_id"], pa.int64()),
        "token": pa.array(cols["token"], pa.string()),
    }
    for name, values in per_layer.items():
        kind = pa.int16() if name.endswith("_experts") else pa.float32()
        arrays[name] = pa.array(values, pa.list_(kind))
    meta = {
        "moee.layers": json.dumps([r.name for r in embedder.routers]),
        "moee.n_experts": str(embedder.n_experts),
    }
    return pa.table(arrays).replace_schema_metadata(meta)


def write_routing_parquet(table: Any, path: str | Path) -> Path:
    """Write a :func:`routing_table` to ``path`` (Parquet, zstd)."""
    import pyarrow.parquet as pq

    path = Path(path)
    pq.write_table(table, path, compression="zstd")
    return path
