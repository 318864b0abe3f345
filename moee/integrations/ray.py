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
``--id-field`` column, ``text``, the Parquet inputs' other columns, ``embedding``: one type per
column, fixed before Ray starts by :func:`input_schema`) plus the sidecar ``_embeddings.json``
(:func:`moee.io.write_parquet_sidecar`), in a staging folder committed when complete
(:func:`moee.io.commit_folder`: ``overwrite`` replaces the previous embeddings' files and keeps a
user's other files; an output that is, holds or lies inside an input is refused).
Rows keep their input order (Ray Data's ``preserve_order``), and readers sort by ``row``.
A failed actor is restarted and its batch retried by Ray (``max_restarts`` / ``max_task_retries``),
so rows are neither lost nor duplicated; a failed job is rerun from the start. A local cluster
the driver starts (:func:`start_ray`) ends with it, even when the driver is killed.
"""

from __future__ import annotations

import glob
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moee.io import (
    EMBEDDING_COLUMN,
    ROW_COLUMN,
    TEXT_COLUMN,
    InputPart,
    check_text_value,
    input_format,
    read_part_records,
    split_input,
)

if TYPE_CHECKING:
    from moee.embed.settings import EmbedSettings

__all__ = ["MoEEmbedBatches", "embed_files", "input_files", "input_schema", "model_facts", "start_ray"]

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

    ``model``: a name or path (``None``: the default model); ``load``: :class:`moee.loading.LoadOptions`
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
        from moee.embed.config import check_config_fits_model
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
    path, weights digest, the vectors' width and, loaded in 4 bit, how much of it is
    (``quantization``; also refuses a configuration it cannot embed)."""
    from moee.corpus import run_facts
    from moee.provenance import quantization_record

    embedder = MoEEmbedBatches(model, load=load, **config).embedder
    resolved = embedder.resolve_config(**config)
    quantized = quantization_record()
    return {
        **run_facts(embedder, 0),
        "dim": embedder.config_dim(resolved),
        **({"quantization": quantized} if quantized else {}),
    }


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
    """The read tasks: every file's shares with the input row index of their first row and their
    number of rows (line counts of the text shares are taken by parallel Ray tasks, the only pass
    before embedding)."""
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
            dict(
                path=part.path,
                fmt=part.fmt,
                start=part.start,
                stop=part.stop,
                first_row=first,
                row=row,
                rows=rows,
            )
        )
        row += rows
    return plan


def _read_parts(batch: dict[str, Any], field: str, id_field: str | None, schema: Any) -> Any:
    """The rows of the planned shares in ``batch`` as a table of ``schema`` (:func:`input_schema`):
    ``row``, the id column, ``text``, the carried columns (null where a file lacks one)."""
    import pyarrow as pa

    id_type = schema.field(id_field).type if id_field else None
    values: dict[str, list[Any]] = {name: [] for name in schema.names}
    carried = [name for name in schema.names if name not in (ROW_COLUMN, TEXT_COLUMN, id_field)]
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
        own = [field, *([id_field] if id_field else [])]
        for where, record in read_part_records(part, own + (carried if part.fmt == "parquet" else [])):
            where = f"{where} (input row {row})"
            if part.fmt == "jsonl" and field not in record:
                keys = ", ".join(map(repr, record)) or "none"
                raise ValueError(f"{where}: no field {field!r} (keys: {keys}); choose one with --field")
            values[TEXT_COLUMN].append(check_text_value(record.get(field), field, where))
            if id_field:
                value = record.get(id_field)
                if value is None:
                    raise ValueError(f"{where}: no value in the --id-field column {id_field!r}")
                if part.fmt != "parquet" and _value_type(value, where) != id_type:  # a footer types Parquet's
                    raise TypeError(
                        f"{where}: the --id-field column {id_field!r} holds {value!r} "
                        f"({_value_type(value, where)}), the input's ids are {id_type}; give every row "
                        "an id of one type"
                    )
                values[id_field].append(value)
            for name in carried:  # Parquet's columns only: a JSON field has no fixed type
                values[name].append(record.get(name) if part.fmt == "parquet" else None)
            values[ROW_COLUMN].append(row)
            row += 1
    return pa.Table.from_pydict(values, schema=schema)


def _normal_type(kind: Any) -> Any:
    """The type a column's Python values rebuild into (:func:`_read_parts` rebuilds ids from them):
    integers of any width as int64, floats as float64, large and dictionary strings as string."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_integer(kind):
        return pa.int64()
    if pa.types.is_floating(kind):
        return pa.float64()
    return pa.string() if pa.types.is_large_string(kind) else kind


def _value_type(value: Any, where: str) -> Any:
    """The (normal) Arrow type of one JSON value, e.g. an id; one Arrow cannot hold is named."""
    import pyarrow as pa

    try:
        return _normal_type(pa.scalar(value).type)
    except (pa.ArrowException, OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: cannot store {value!r} in a Parquet column ({exc})") from None


def _first_record(path: Path, columns: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The first row of a text input (``None`` when it has none), read without the rest."""
    rows = read_part_records(split_input(path, 1)[0], columns)
    try:
        return next(rows, None)
    finally:
        rows.close()


def _ids_of(kind: Any, path: Path, first: Any) -> str:
    return f"{path} holds {kind} ids" + ("" if first is None else f" (first: {first!r})")


def input_schema(files: list[Path], field: str, id_field: str | None) -> Any:
    """The output's columns besides the embedding, one type each, fixed before Ray starts so every
    block of the output agrees: ``row``, the ``--id-field`` column, ``text``, then every other
    column of the Parquet inputs (JSON has no schema: a field's type can change from row to row,
    so .jsonl fields beyond these are not carried; an input column named ``row``, ``text`` or
    ``embedding`` gives way to the output's own).

    Refused here, naming the file and the column: a Parquet input without the text or id column,
    a non-string text column, ``--id-field`` with .txt inputs, and files whose ids differ in type
    (from the Parquet footers and each text file's first row; a later row of another type is
    named as it is read). A carried column whose types in two files cannot be unified is left out,
    with a warning."""
    import warnings

    import pyarrow as pa
    import pyarrow.parquet as pq

    id_type: tuple[Any, Path, Any] | None = None  # (type, file, first id or None for a footer)
    carried: dict[str, list[tuple[Any, Path]]] = {}
    for f in files:
        fmt = input_format(f)
        if fmt == "parquet":
            schema = pq.ParquetFile(f).schema_arrow
            for name in [field] + ([id_field] if id_field else []):
                if name not in schema.names:
                    raise ValueError(f"{f}: no column {name!r} (columns: {', '.join(schema.names)})")
            kind = schema.field(field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise TypeError(f"{f}: column {field!r} must hold strings, it has type {kind}")
            for column in schema:
                if column.name not in (field, id_field, ROW_COLUMN, TEXT_COLUMN, EMBEDDING_COLUMN):
                    carried.setdefault(column.name, []).append((column.type, f))
            if not id_field:
                continue
            found = (_normal_type(schema.field(id_field).type), f, None)
        elif not id_field:
            continue
        elif fmt == "txt":
            raise ValueError(
                f"{f}: --id-field applies to .jsonl and .parquet inputs; a .txt line has no id "
                "(the output's row column is its line's index)"
            )
        else:
            first = _first_record(f, [id_field])
            if first is None:
                continue  # an empty file: no ids
            where, record = first
            if record.get(id_field) is None:
                raise ValueError(f"{where}: no value in the --id-field column {id_field!r}")
            found = (_value_type(record[id_field], where), f, record[id_field])
        if id_type is None:
            id_type = found
        elif found[0] != id_type[0]:
            raise TypeError(
                f"{found[1]}: the --id-field column {id_field!r} differs in type between the input "
                f"files: {_ids_of(*found)}, {_ids_of(*id_type)}; give every file ids of one type"
            )
    fields = [pa.field(ROW_COLUMN, pa.int64())]
    if id_field:
        fields.append(pa.field(id_field, id_type[0] if id_type else pa.string()))
    fields.append(pa.field(TEXT_COLUMN, pa.string()))
    for name, kinds in carried.items():
        try:
            fields.append(
                pa.unify_schemas(
                    [pa.schema([(name, k)]) for k, _ in kinds], promote_options="permissive"
                ).field(name)
            )
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            seen = "; ".join(f"{path}: {kind}" for kind, path in kinds)
            warnings.warn(
                f"input column {name!r} is not carried into the output: its types differ between the "
                f"files ({seen})",
                stacklevel=2,
            )
    return pa.schema(fields)


def start_ray(address: str | None = None) -> None:
    """Join the cluster at ``address`` (``None``: ``RAY_ADDRESS`` or a running local one), unless
    this process already did; with no cluster to join, start a local one that ends with this
    process.

    Ray ties the head processes it starts to the driver (the kernel kills them with it), but its
    agents then wait a minute on the dead GCS before they exit; so a cluster started here gets a
    watchdog process (:func:`watch_cluster`) that kills all of it as soon as the driver is gone,
    even by SIGKILL."""
    import subprocess
    import sys

    import psutil
    import ray

    if ray.is_initialized():
        return
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    started = [child.pid for child in me.children() if child.pid not in before]
    if not started:  # joined a cluster that lives on its own
        return
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
        f"from moee.integrations.ray import watch_cluster; watch_cluster({os.getpid()}, {started!r})"
    )
    subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the terminal is the driver's to handle
    )


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_cluster(driver: int, roots: list[int], poll: float = 0.5) -> None:
    """The watchdog of a local cluster, run in a process of its own by :func:`start_ray`: follow
    ``roots`` (the processes ``ray.init`` started) and every process they start while ``driver``,
    the watchdog's parent, lives; once the driver is gone, kill every one still running. Ends by
    itself when the cluster shuts down first."""
    import psutil

    tracked: set[Any] = set()  # psutil processes (pid and start time: a reused pid is not taken)
    while os.getppid() == driver:
        for pid in roots:
            try:
                root = psutil.Process(pid)
                tracked.update([root, *root.children(recursive=True)])
            except psutil.Error:
                continue
        if tracked and not any(_alive(p) for p in tracked):
            return
        time.sleep(poll)
    left = [p for p in tracked if _alive(p)]
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=5)


@dataclass(frozen=True)
class _Inputs:
    """The input files and how their rows are read: the text field, the id field, and the columns
    (one type each) that every part yields."""

    files: list[Path]
    field: str
    id_field: str | None
    schema: Any

    @classmethod
    def of(cls, spec: str | Path, field: str | None, id_field: str | None) -> _Inputs:
        """The files of ``spec`` with their schema, read before Ray starts (a bad input is named at once)."""
        field = field or "text"
        files = input_files(spec)
        if any(input_format(f) == "txt" for f in files) and field != "text":
            raise ValueError("--field applies to .jsonl and .parquet inputs, not .txt")
        return cls(files, field, id_field, input_schema(files, field, id_field))


def _check_has_rows(spec: str | Path, files: list[Path], plan: list[dict[str, Any]]) -> None:
    """An input with no rows at all is named here: the staging folder would be named later."""
    if not sum(p["rows"] for p in plan):
        raise ValueError(
            f"{files[0]} is empty: no texts to read"
            if len(files) == 1
            else f"input {spec}: every file is empty ({', '.join(map(str, files[:3]))}"
            f"{', ...' if len(files) > 3 else ''}): no texts to read"
        )


def _actor_resources(num_gpus: float | None) -> dict[str, float]:
    """What each embedding actor reserves: ``num_gpus`` if given, else one GPU where the cluster has
    any; one CPU on a CPU-only cluster."""
    import ray

    gpus = num_gpus if num_gpus is not None else (1.0 if ray.cluster_resources().get("GPU") else 0.0)
    return {"num_gpus": gpus} if gpus else {"num_cpus": 1}


def _read_dataset(plan: list[dict[str, Any]], inputs: _Inputs) -> Any:
    """The Ray dataset of the planned parts' rows, in input order."""
    import ray
    from ray.data import DataContext

    DataContext.get_current().execution_options.preserve_order = True  # rows stay in input order
    ds = ray.data.from_items(plan, override_num_blocks=max(1, len(plan)))
    # reading is I/O next to the model forward: no CPU reserved, so actors holding every CPU
    # (a CPU-only cluster) never starve the reads that feed them
    return ds.map_batches(
        _read_parts,
        batch_size=1,
        fn_kwargs={"field": inputs.field, "id_field": inputs.id_field, "schema": inputs.schema},
        num_cpus=0,
    )


def _embed_dataset(ds: Any, settings: EmbedSettings, remote: dict[str, float]) -> Any:
    """``ds`` through ``settings.concurrency`` restartable ``MoEEmbedBatches`` actors (a killed
    one's batches are retried, none lost or duplicated), each given the model, its loading options
    and the configuration in full."""
    return ds.map_batches(
        MoEEmbedBatches,
        fn_constructor_kwargs={
            "model": settings.model,
            "load": settings.load.to_dict(),
            "batch_size": settings.batch_size,
            "id_column": settings.id_field,
            **asdict(settings.config),
        },  # fmt: skip
        batch_size=settings.batch_size * 4,
        batch_format="pyarrow",
        concurrency=settings.concurrency,
        max_restarts=-1,
        max_task_retries=-1,
        **remote,
    )


def embed_files(settings: EmbedSettings, *, part_bytes: int | None = None) -> Path:
    """``moee embed --engine ray``: embed every file of ``settings.input`` into the Parquet folder
    ``settings.out`` (see the module doc; ``settings.engine`` is not read); joins the cluster at
    ``settings.address``, else uses the running one or starts a local one. The sidecar records
    ``settings.record()`` (what changes the numbers). ``part_bytes``: the bytes of a text input
    each read task takes (default :data:`PART_BYTES`)."""
    import ray

    from moee.io import PARQUET_OUTPUT, StagedFolder, check_output_folder, run_metadata, write_parquet_sidecar

    s, spec = settings, settings.input
    inputs = _Inputs.of(spec, s.field, s.id_field)
    files = inputs.files
    named = {"INPUT": [spec, *files] if Path(spec).is_dir() else files, "--model": s.model}
    out_dir = check_output_folder(s.out, overwrite=s.overwrite, inputs=named, output=PARQUET_OUTPUT)
    start_ray(s.address)
    plan = plan_parts(files, part_bytes or PART_BYTES)
    _check_has_rows(spec, files, plan)
    remote = _actor_resources(s.num_gpus)
    facts = ray.get(ray.remote(**remote)(model_facts).remote(s.model, s.load.to_dict(), asdict(s.config)))
    ds = _embed_dataset(_read_dataset(plan, inputs), s, remote)
    meta = {
        **s.record(),
        **{k: v for k, v in facts.items() if k != "dim"},
        "input": [str(f.resolve()) for f in files],
        "field": inputs.field,
        "id_field": s.id_field,
        "columns": [*inputs.schema.names, EMBEDDING_COLUMN],
        "engine": "ray",
        **run_metadata(),
    }
    with StagedFolder(out_dir, PARQUET_OUTPUT) as staging:
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
