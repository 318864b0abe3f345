"""Embedding with Ray Data (the ``moee[ray]`` extra): one model per actor, rows streamed through.

``MoEEmbedBatches`` is a stateful callable for ``Dataset.map_batches``: each actor loads the
model once, then adds the embedding to every batch as fixed-size float32 (or float16) list
columns, keeping every input column (an id above all)::

    import ray
    from moee.integrations.ray import MoEEmbedBatches

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(
        MoEEmbedBatches,
        fn_constructor_kwargs={"model": "allenai/OLMoE-1B-7B-0924", "prompt": "prompteol"},
        concurrency=8, num_gpus=1, batch_size=256, batch_format="pyarrow",
    )
    ds.write_parquet("s3://bucket/embeddings/")

Configuration keywords (``method``, ``pooling``, ``prompt``, ...) resolve exactly as
``MoEEmbedder.encode`` resolves them (:func:`moee.embed.config.resolve_config`: given > the model's
saved configuration > library default). ``features=True`` also adds the HS and RW vectors
(``<output_column>_hs`` / ``_rw``, as ``encode(method="hs"/"rw")`` gives them) from the same forward.

:func:`embed_files` is ``moee embed --engine ray``: input files cut into shares
(:func:`moee.io.split_input`: byte ranges aligned to line starts, Parquet row groups), read by Ray
tasks, embedded by the actor pool, written as Parquet files (``row``: the input row index, the
``--id-field`` column, ``text``, ``embedding``) plus the sidecar ``_embeddings.json``
(:func:`moee.io.write_parquet_sidecar`), in a staging folder renamed into place when complete.
Rows keep their input order (Ray Data's ``preserve_order``), and readers sort by ``row``.
A failed actor is restarted and its batch retried by Ray (``max_restarts`` / ``max_task_retries``),
so rows are neither lost nor duplicated; a failed job is rerun from the start.
"""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from moee.io import InputPart, check_text_value, input_format, read_part_records, split_input

__all__ = ["MoEEmbedBatches", "embed_files", "input_files", "model_facts"]

#: Bytes of a text input each read task takes (Parquet: a row group is the smallest share).
PART_BYTES = 64 << 20
DTYPES = {"float32": np.float32, "float16": np.float16}


def _as_table(batch: Any) -> Any:
    """A pyarrow Table of a Ray batch in any of its formats (pyarrow, pandas, dict of numpy)."""
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return pa.Table.from_pandas(batch, preserve_index=False)
    return pa.table({k: (list(v) if getattr(v, "ndim", 1) > 1 else v) for k, v in dict(batch).items()})


def _fixed_size(vectors: np.ndarray, dtype: Any) -> Any:
    import pyarrow as pa

    vectors = np.ascontiguousarray(vectors, dtype=dtype)
    values = pa.array(vectors.reshape(-1), type=pa.from_numpy_dtype(vectors.dtype))
    return pa.FixedSizeListArray.from_arrays(values, vectors.shape[1])


class MoEEmbedBatches:
    """``Dataset.map_batches`` callable adding embeddings of ``text_column`` (see the module doc).

    ``model``: a name or path (``None``: the bundled model); ``load``: :class:`moee.loading.LoadOptions`
    fields (device, dtype, ...); ``dtype``: the columns' float type; ``id_column``: named in errors;
    every other keyword is an embedding-configuration field.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        text_column: str = "text",
        output_column: str = "embedding",
        features: bool = False,
        dtype: str = "float32",
        batch_size: int = 32,
        id_column: str | None = "id",
        load: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        from moee.commands.embed import check_config_fits_model
        from moee.embed.embedder import MoEEmbedder
        from moee.embed.validation import check_positive_int
        from moee.loading import LoadOptions

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.text_column, self.output_column, self.id_column = text_column, output_column, id_column
        self.features, self.dtype = features, DTYPES[dtype]
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.embedder = MoEEmbedder.from_pretrained(model, LoadOptions(**(load or {})))
        self.config = self.embedder.resolve_config(**config)
        check_config_fits_model(self.embedder, self.config)

    def texts(self, batch: Any) -> list[str]:
        """The batch's texts; a missing column or a non-string value is an error naming it and the row."""
        names = list(batch.column_names if hasattr(batch, "column_names") else batch.keys())
        if self.text_column not in names:
            raise ValueError(
                f"column {self.text_column!r} is not in the input (columns: {', '.join(names)}); "
                "pass text_column= (moee embed: --field)"
            )
        values = _column(batch, self.text_column)
        ids = _column(batch, self.id_column) if self.id_column in names else None
        for i, value in enumerate(values):
            if not isinstance(value, str):
                where = f"row {i} of the batch" + (f" ({self.id_column}={ids[i]!r})" if ids else "")
                check_text_value(value, self.text_column, where)
        return values

    def __call__(self, batch: Any) -> Any:
        """The batch with the embedding columns added: a pyarrow Table (fixed-size list columns) for
        a pyarrow or pandas batch, a dict of numpy arrays (``[n, dim]``) for a numpy batch."""
        from moee.embed.recipes import combine_features

        as_dict = isinstance(batch, dict)
        table = batch if as_dict else _as_table(batch)
        texts, config = self.texts(table), self.config
        if texts:
            hs, rw = self.embedder.features(
                texts, config, batch_size=self.batch_size, show_progress_bar=False
            )
        columns = {self.output_column: config.method}
        if self.features:
            columns.update({f"{self.output_column}_hs": "hs", f"{self.output_column}_rw": "rw"})
        out = dict(table) if as_dict else table
        for name, method in columns.items():
            if texts:
                vectors = combine_features(
                    hs, rw, method, alpha=config.numeric_alpha(), normalize=config.normalize
                )
            else:
                vectors = np.zeros((0, self.embedder.config_dim(config.replace(method=method))), np.float32)
            if as_dict:
                out[name] = np.ascontiguousarray(vectors, dtype=self.dtype)
            else:
                out = out.append_column(name, _fixed_size(vectors, self.dtype))
        return out


def _column(batch: Any, name: str) -> list[Any]:
    column = batch[name] if isinstance(batch, dict) else batch.column(name)
    if hasattr(column, "to_pylist"):  # pyarrow
        return column.to_pylist()
    return column.tolist() if hasattr(column, "tolist") else list(column)  # numpy: Python values


def model_facts(model: str | None, load: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What a sidecar records about the model, from one load where the actors run: its resolved
    path, weights digest and the vectors' width (also refuses a configuration it cannot embed)."""
    from moee.commands.embed import _run_facts

    embedder = MoEEmbedBatches(model, load=load, **config).embedder
    resolved = embedder.resolve_config(**config)
    return {**_run_facts(embedder, 0), "dim": embedder.config_dim(resolved)}


def input_files(spec: str | Path) -> list[Path]:
    """The input files of a file, a folder (its .jsonl/.ndjson/.parquet/.txt files) or a glob, sorted."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
    elif path.is_file():
        found = [path]
    else:
        found = sorted(Path(p) for p in glob.glob(str(spec)) if Path(p).is_file())
    if not found:
        raise FileNotFoundError(f"input {spec}: no such file, or no files in the folder / matching the glob")
    for p in found:
        input_format(p)  # an unsupported file type is named before any work
    return found


def _count_lines(part: InputPart) -> int:
    from moee.io import iter_part_lines

    return sum(1 for _ in iter_part_lines(part))


def plan_parts(files: list[Path], part_bytes: int = PART_BYTES) -> list[dict[str, Any]]:
    """The read tasks: every file's shares with the input row index of their first row (line
    counts of the text shares are taken by parallel Ray tasks, the only pass before embedding)."""
    import ray

    parts = [
        part
        for f in files
        for part in split_input(f, max(1, math.ceil(f.stat().st_size / part_bytes)))
        if part.stop > part.start
    ]
    counts_remote = ray.remote(num_cpus=0)(_count_lines)
    pending = {i: counts_remote.remote(p) for i, p in enumerate(parts) if p.fmt != "parquet"}
    counted = dict(zip(pending, ray.get(list(pending.values()))))
    plan, row = [], 0
    for i, part in enumerate(parts):
        if part.fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(part.path).metadata
            rows = sum(meta.row_group(g).num_rows for g in range(part.start, part.stop))
        else:
            rows = counted[i]
        first = -1 if part.first_row is None else part.first_row  # -1: lines (one column type)
        plan.append(
            dict(path=part.path, fmt=part.fmt, start=part.start, stop=part.stop, first_row=first, row=row)
        )
        row += rows
    return plan


def _read_parts(batch: dict[str, Any], field: str, id_field: str | None) -> Any:
    """The rows of the planned shares in ``batch``: ``row``, the id column, ``text``."""
    import pyarrow as pa

    rows, ids, texts = [], [], []
    for i in range(len(batch["path"])):
        first = batch["first_row"][i]
        part = InputPart(
            str(batch["path"][i]),
            str(batch["fmt"][i]),
            int(batch["start"][i]),
            int(batch["stop"][i]),
            None if int(first) < 0 else int(first),
        )
        row = int(batch["row"][i])
        columns = [field] + ([id_field] if id_field else [])
        for where, record in read_part_records(part, columns):
            where = f"{where} (input row {row})"
            if part.fmt == "jsonl" and field not in record:
                keys = ", ".join(map(repr, record)) or "none"
                raise ValueError(f"{where}: no field {field!r} (keys: {keys}); choose one with --field")
            texts.append(check_text_value(record.get(field), field, where))
            if id_field:
                if record.get(id_field) is None:
                    raise ValueError(f"{where}: no value in the --id-field column {id_field!r}")
                ids.append(record[id_field])
            rows.append(row)
            row += 1
    columns = {"row": pa.array(rows, pa.int64())}
    if id_field:
        columns[id_field] = pa.array(ids)
    columns["text"] = pa.array(texts, pa.string())
    return pa.table(columns)


def check_input_columns(files: list[Path], field: str, id_field: str | None) -> None:
    """Refuse, before Ray starts any work, a Parquet input without the columns or with a
    non-string text column (its footer only; text rows are checked as they are read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in files:
        if input_format(f) != "parquet":
            continue
        schema = pq.ParquetFile(f).schema_arrow
        for name in [field] + ([id_field] if id_field else []):
            if name not in schema.names:
                raise ValueError(f"{f}: no column {name!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise TypeError(f"{f}: column {field!r} must hold strings, it has type {kind}")


def embed_files(
    spec: str | Path,
    out_dir: str | Path,
    *,
    model: str | None,
    config: dict[str, Any],
    load: dict[str, Any],
    settings: dict[str, Any],
    field: str | None = None,
    id_field: str | None = None,
    batch_size: int = 32,
    concurrency: int = 1,
    num_gpus: float | None = None,
    address: str | None = None,
    overwrite: bool = False,
    part_bytes: int | None = None,
) -> Path:
    """``moee embed --engine ray``: embed every file of ``spec`` into the Parquet folder ``out_dir``
    (see the module doc); joins the cluster at ``address``, else uses the running one or starts a
    local one. ``settings``: what changes the numbers (recorded in the sidecar)."""
    import ray

    from moee.io import StagedFolder, check_output_folder, run_metadata, write_parquet_sidecar

    field = field or "text"
    files = input_files(spec)
    if any(input_format(f) == "txt" for f in files) and field != "text":
        raise ValueError("--field applies to .jsonl and .parquet inputs, not .txt")
    check_input_columns(files, field, id_field)
    out_dir = check_output_folder(out_dir, overwrite=overwrite)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    gpus = num_gpus if num_gpus is not None else (1.0 if ray.cluster_resources().get("GPU") else 0.0)
    remote = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
    facts = ray.get(ray.remote(**remote)(model_facts).remote(model, load, config))

    from ray.data import DataContext

    DataContext.get_current().execution_options.preserve_order = True  # rows stay in input order
    plan = plan_parts(files, part_bytes or PART_BYTES)
    ds = ray.data.from_items(plan, override_num_blocks=max(1, len(plan)))
    # reading is I/O next to the model forward: no CPU reserved, so actors holding every CPU
    # (a CPU-only cluster) never starve the reads that feed them
    ds = ds.map_batches(
        _read_parts, batch_size=1, fn_kwargs={"field": field, "id_field": id_field}, num_cpus=0
    )
    ds = ds.map_batches(
        MoEEmbedBatches,
        fn_constructor_kwargs={
            "model": model,
            "load": load,
            "batch_size": batch_size,
            "id_column": id_field,
            **config,
        },  # fmt: skip
        batch_size=batch_size * 4,
        batch_format="pyarrow",
        concurrency=concurrency,
        max_restarts=-1,
        max_task_retries=-1,
        **remote,
    )
    meta = {
        **settings,
        **{k: v for k, v in facts.items() if k != "dim"},
        "input": [str(f.resolve()) for f in files],
        "field": field,
        "id_field": id_field,
        "engine": "ray",
        **run_metadata(),
    }
    with StagedFolder(out_dir) as staging:
        try:
            ds.write_parquet(str(staging))
        except Exception as exc:
            raise _input_error(exc) from None
        write_parquet_sidecar(staging, meta)
    return out_dir


def _input_error(exc: BaseException) -> BaseException:
    """The input error (``ValueError`` / ``TypeError`` naming the row) a Ray failure wraps, as raised
    in the task, without Ray's remote traceback; any other failure unchanged."""
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        origin = type(cause).__mro__
        if isinstance(cause, (ValueError, TypeError)) and not any(
            c.__module__.startswith("ray") for c in origin
        ):
            return type(cause)(*cause.args)
        cause = getattr(cause, "cause", None) or cause.__cause__
    # Ray Data re-raises a task's error as UserCodeException, keeping the original only as text
    found = re.search(r"^(ValueError|TypeError): (.+)$", str(exc), re.MULTILINE)
    if found:
        return (ValueError if found.group(1) == "ValueError" else TypeError)(found.group(2))
    return exc
