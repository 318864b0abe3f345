"""Per-token routing as a table, for notebooks: a ``pyarrow.Table`` (``.to_pandas()``) and Parquet.

One row per token of every text (``MoEEmbedder.iter_token_routes``): the prompt and score left out
come from the model's saved configuration, else the library default, as for every other entry point
(``moee.embed.config.resolve_config``):

``text_id`` (the text's position in the input, or the ``ids`` given), ``position`` (0-based token
position), ``token_id``, ``token`` (the tokenizer's piece), then per MoE layer ``i``:
``layer{i}_experts`` (the router's own selection, list of int, -1 pads a layer with a smaller k)
and ``layer{i}_weights`` (the ``score`` of each selected expert: by default the architecture's
native scores, before any top-k renormalisation), and with ``dense=True`` ``layer{i}_probs``
(the dense scores over all experts). The schema metadata records the layer (router) names.

Rows are built one batch of texts at a time straight from the routes' arrays
(:func:`iter_routing_batches`), so :func:`write_routing_parquet` streams a corpus of any size with
memory bounded by one row group (:data:`ROW_GROUP_ROWS` rows, about 0.3 KB each without
``dense``); :func:`routing_table` holds the Arrow rows of all its texts. The Parquet file is
written through a temporary name and committed with a sealed JSON sidecar (``NAME.parquet.json``,
``moee.io.commit_with_sidecar``): what the rows were computed with (``config``: prompt and score,
``model``, ``weights_digest`` when given), the texts' digest, the row count and the file's
SHA-256; the Parquet footer carries the same settings (``moee.routes``). :func:`read_routing_parquet`
checks both before it returns the rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moee.embed.config import MODEL_DEFAULT

if TYPE_CHECKING:
    from moee.analysis.settings import RoutesSettings

__all__ = [
    "ROUTES_FORMAT",
    "ROW_GROUP_ROWS",
    "export_routes",
    "iter_routing_batches",
    "read_routing_parquet",
    "routing_schema",
    "routing_table",
    "write_routing_parquet",
]

#: The sidecar format of a routes Parquet file.
ROUTES_FORMAT = "moee-routes/1"
#: The Parquet footer key holding the settings the rows were computed with (JSON).
FOOTER_KEY = "moee.routes"
#: Rows buffered before a row group is written: the writer's memory bound.
ROW_GROUP_ROWS = 65536


def routing_schema(embedder: Any, *, dense: bool = False, id_type: Any = None) -> Any:
    """The Arrow schema of the rows of ``embedder`` (``id_type``: of ``text_id``, default int64),
    its metadata the layer names and the number of experts."""
    import pyarrow as pa

    columns = [
        ("text_id", id_type or pa.int64()),
        ("position", pa.int32()),
        ("token_id", pa.int64()),
        ("token", pa.string()),
    ]
    for i in range(len(embedder.routers)):
        columns += [
            (f"layer{i}_experts", pa.list_(pa.int16())),
            (f"layer{i}_weights", pa.list_(pa.float32())),
        ]
        if dense:
            columns.append((f"layer{i}_probs", pa.list_(pa.float32())))
    meta = {
        "moee.layers": json.dumps([r.name for r in embedder.routers]),
        "moee.n_experts": str(embedder.n_experts),
    }
    return pa.schema(columns, metadata=meta)


def _lists(values: np.ndarray, kind: Any) -> Any:
    """``[rows, width]`` as an Arrow list column of ``kind`` (one list of ``width`` a row)."""
    import pyarrow as pa

    rows, width = values.shape
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), kind))


def _batch(embedder: Any, routes: list[Any], ids: list[Any], schema: Any, dense: bool) -> Any:
    """One record batch of the routes of a non-empty batch of texts (``ids``: their text ids)."""
    import pyarrow as pa

    if any(r.selection is None for r in routes):
        raise ValueError("a router of this model neither returns its selection nor declares its k")
    lengths = [len(r.input_ids) for r in routes]
    token_ids = np.concatenate([r.input_ids for r in routes])
    probs = np.concatenate([r.probs for r in routes])
    chosen_all = np.concatenate([r.selection for r in routes])
    text_ids = [text_id for text_id, n in zip(ids, lengths) for _ in range(n)]
    arrays = [
        pa.array(text_ids, schema.field("text_id").type),
        pa.array(np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])),
        pa.array(token_ids.astype(np.int64)),
        pa.array(embedder.tokenizer.convert_ids_to_tokens(token_ids.tolist()), pa.string()),
    ]
    for i in range(len(embedder.routers)):
        chosen = chosen_all[:, i]
        safe = np.where(chosen >= 0, chosen, 0)
        picked = np.take_along_axis(probs[:, i], safe, axis=-1)
        arrays.append(_lists(chosen.astype(np.int16), pa.int16()))
        arrays.append(_lists(np.where(chosen >= 0, picked, np.nan).astype(np.float32), pa.float32()))
        if dense:
            arrays.append(_lists(probs[:, i], pa.float32()))
    return pa.record_batch(arrays, schema=schema)


def iter_routing_batches(
    embedder: Any,
    texts: Iterable[str],
    *,
    ids: Sequence[Any] | None = None,
    dense: bool = False,
    prompt: Any = MODEL_DEFAULT,
    score: Any = MODEL_DEFAULT,
    batch_size: int = 16,
    schema: Any = None,
) -> Iterator[Any]:
    """The rows of ``texts`` (any iterable, read lazily), one ``pyarrow.RecordBatch`` per
    ``batch_size`` texts, of ``schema`` (default :func:`routing_schema`); ``prompt`` and ``score``
    left out come from the model's configuration (``MoEEmbedder.iter_token_routes``)."""
    schema = schema if schema is not None else routing_schema(embedder, dense=dense)
    kwargs: dict[str, Any] = {"prompt": prompt, "score": score, "batch_size": batch_size}
    stream = iter(texts)
    start = 0
    while chunk := list(islice(stream, batch_size)):
        routes = list(embedder.iter_token_routes(chunk, **kwargs))
        chunk_ids = list(range(start, start + len(chunk)) if ids is None else ids[start : start + len(chunk)])
        if len(chunk_ids) != len(chunk):
            raise ValueError(f"ids has {len(ids)} entries for more texts")
        yield _batch(embedder, routes, chunk_ids, schema, dense)
        start += len(chunk)


def routing_table(
    embedder: Any,
    texts: Sequence[str],
    *,
    ids: Sequence[Any] | None = None,
    dense: bool = False,
    prompt: Any = MODEL_DEFAULT,
    score: Any = MODEL_DEFAULT,
    batch_size: int = 16,
) -> Any:
    """The per-token routing of ``texts`` as a ``pyarrow.Table`` (columns in the module docstring);
    ``prompt`` and ``score`` left out come from the model's configuration. For a corpus too large to
    hold, stream :func:`iter_routing_batches` into :func:`write_routing_parquet`."""
    import pyarrow as pa

    if ids is not None and len(ids) != len(texts):
        raise ValueError(f"ids has {len(ids)} entries for {len(texts)} texts")
    id_type = pa.array(list(ids)).type if ids is not None else None
    schema = routing_schema(embedder, dense=dense, id_type=id_type)
    batches = iter_routing_batches(
        embedder,
        texts,
        ids=ids,
        dense=dense,
        prompt=prompt,
        score=score,
        batch_size=batch_size,
        schema=schema,
    )
    return pa.Table.from_batches(list(batches), schema=schema)


def write_routing_parquet(
    rows: Any,
    path: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = True,
    row_group_rows: int | None = None,
    texts: Any = None,
) -> Path:
    """Write routing ``rows`` (a :func:`routing_table`, or the record batches of
    :func:`iter_routing_batches`, streamed) to ``path`` (Parquet, zstd) with its sealed sidecar.

    ``metadata`` (what the rows were computed with: ``config``, ``model``, ``weights_digest``, the
    run record, ...) goes into the footer (``moee.routes``) and the sidecar, which adds the row count,
    the file's SHA-256 and, from ``texts`` (a ``moee.io.TextsDigest`` the texts passed through on
    their way to the rows), their ``texts_sha256`` and count. Batches are buffered up to
    ``row_group_rows`` rows (default :data:`ROW_GROUP_ROWS`), then written as one row group, so
    memory does not grow with the corpus. Under the output's lock, through a temporary name: a
    failed or killed run leaves no ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moee.io import commit_with_sidecar, file_sha256, output_lock, temporary_path

    path = Path(path)
    row_group_rows = row_group_rows or ROW_GROUP_ROWS
    settings = dict(metadata or {})
    batches = iter(rows.to_batches(max_chunksize=row_group_rows) if isinstance(rows, pa.Table) else rows)
    schema = rows.schema if isinstance(rows, pa.Table) else None
    first = next(batches, None)
    if first is None and schema is None:
        raise ValueError("no routing rows to write (no texts)")
    schema = schema if schema is not None else first.schema
    footer = {**(schema.metadata or {}), FOOTER_KEY.encode(): json.dumps(settings, default=str).encode()}
    with output_lock(path):
        if not overwrite and path.exists():
            raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
        partial = temporary_path(path)
        n_rows = 0
        try:
            with pq.ParquetWriter(partial, schema.with_metadata(footer), compression="zstd") as writer:
                held: list[Any] = []
                held_rows = 0
                for batch in chain([first] if first is not None else [], batches):
                    held.append(batch)
                    held_rows += batch.num_rows
                    if held_rows >= row_group_rows:
                        writer.write_table(
                            pa.Table.from_batches(held, schema=schema), row_group_size=held_rows
                        )
                        n_rows += held_rows
                        held, held_rows = [], 0
                if held or n_rows == 0:
                    writer.write_table(pa.Table.from_batches(held, schema=schema))
                    n_rows += held_rows
            sidecar = {
                "format": ROUTES_FORMAT,
                **settings,
                "n_tokens": n_rows,
                **({"n_texts": texts.count, "texts_sha256": texts.hexdigest()} if texts is not None else {}),
                "data_sha256": file_sha256(partial),
            }
            return commit_with_sidecar(partial, path, sidecar, overwrite=overwrite)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


def read_routing_parquet(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """``(rows as a pyarrow.Table, sidecar)`` of a routes Parquet file, refused (naming the file
    and the fix) when its sidecar is missing, edited or of another format, or the file does not
    match the SHA-256 the sidecar records."""
    import pyarrow.parquet as pq

    from moee.io import check_input_file, file_sha256, read_sidecar, sidecar_path

    path = check_input_file(path, "routes file")
    sidecar = sidecar_path(path)
    remedy = "re-run `moee routes` (or write_routing_parquet) to get a checked one"
    meta = read_sidecar(
        sidecar,
        fmt=ROUTES_FORMAT,
        kind="routes",
        missing=f"sidecar {sidecar} is missing, so {path} cannot be checked (written by an older moee or "
        f"by another tool); {remedy}",
        remedy=remedy,
    )
    if file_sha256(path) != meta.get("data_sha256"):
        raise ValueError(
            f"{path} does not match its sidecar {sidecar} (content hash differs): the file was changed "
            f"or replaced; {remedy}"
        )
    return pq.read_table(path), meta


def export_routes(settings: RoutesSettings, *, command: Sequence[str] | None = None) -> tuple[Path, int]:
    """``moee routes``: the corpus's token routes under ``settings`` (checked when built) written
    to ``settings.out`` with its sealed sidecar; ``command`` is recorded (default: ``sys.argv``). Returns
    the file and the number of texts. The output path and the corpus are checked before the model
    loads; the corpus is streamed a batch of texts at a time."""
    from moee.embed.embedder import MoEEmbedder
    from moee.io import TextsDigest, check_output_path, read_texts, run_metadata

    out = check_output_path(settings.out, overwrite=settings.overwrite, inputs={"--corpus": settings.corpus})
    config = settings.config

    def texts() -> Iterator[str]:
        return islice(read_texts(settings.corpus, field=settings.field), settings.max_texts)

    sum(1 for _ in texts())  # a bad row: now, before the model loads
    embedder = MoEEmbedder.from_pretrained(settings.model, settings.load)
    metadata = {
        **run_metadata(list(command) if command is not None else None),
        "model": settings.model,
        "model_name_or_path": str(embedder.name_or_path),
        "weights_digest": embedder.weights_digest,
        "config": {"prompt": config.to_dict()["prompt"], "score": config.score},
        "dense": settings.dense,
        "max_length": embedder.max_length,
        "corpus": str(settings.corpus),
        "field": settings.field,
    }
    digest = TextsDigest()
    batches = iter_routing_batches(
        embedder,
        digest.wrap(texts()),
        dense=settings.dense,
        prompt=config.prompt,
        score=config.score,
        batch_size=settings.batch_size,
    )
    write_routing_parquet(batches, out, metadata=metadata, overwrite=settings.overwrite, texts=digest)
    return out, digest.count
