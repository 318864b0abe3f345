"""Streaming text readers and embedding files with JSON sidecars.

Readers yield texts lazily, so a corpus of millions of rows never has to fit in memory:

- ``.txt``: one text per line, split on ``\\n`` only (a trailing ``\\r`` is removed, so CRLF
  files work; other Unicode line separators stay inside the text). Row ``i`` is line ``i+1``.
  **Blank lines are kept as empty texts**, so rows stay aligned with line numbers (the
  embedder embeds an empty text deliberately); a file without any line is an error.
- ``.jsonl`` / ``.ndjson``: one JSON object per line, the text in ``field`` (default
  ``"text"``). A blank line, a line that is not an object, a missing field or a non-str value
  is an error naming the line: there is no record to keep, and skipping it would shift rows.
- ``.parquet``: the string column ``field``, read batch by batch with pyarrow; a null is an
  error naming the row.

Embedding files are plain ``.npy`` (float32 ``[n, dim]``, loaded with ``allow_pickle=False``)
plus ``<name>.npy.json`` describing how they were made: model, method, pooling, prompt,
score, alpha, the model's dtype (``model_dtype``) and the array's (``array_dtype``), shape,
the SHA-256 of the array data (``data_sha256``) and the run record of ``moee.provenance``
(library versions, command line, timestamp, git revision).
``EmbeddingWriter`` appends rows as they are computed and writes the final ``.npy`` header on
close, so output size is not bounded by memory either.

The sidecar also records what the rows depend on, so a reader can check them: the texts
(``texts_sha256``, :class:`TextsDigest`, over the texts as read, in order), the model's weights
(``weights_digest``) and a reference's statistics (``reference_sha256``); its own content is covered
by ``sidecar_sha256`` (:func:`seal`, the SHA-256 of its canonical JSON without that key), so an
edited setting is refused on read. A sidecar of the previous format (``moee-embeddings/2``, before
these digests) is still read, with a warning that it cannot be checked.

The pair is committed together (:func:`commit_with_sidecar`, also used for saved indexes and
references): rows go to a temporary name unique to the writer (:func:`temporary_path`), the
sidecar is written under another, the old sidecar removed, then the array and the sidecar renamed
into place, all while holding the output's lock (:func:`output_lock`: one writer per output at a
time, across processes; POSIX ``flock``, released by the kernel when a process dies). A crash at
any point leaves either the old pair, or an array without a sidecar (an error on read), or hidden
``.NAME.PID.XXXX.partial`` files, never new rows described by old settings; ``read_embeddings``
checks the content hash, so a corrupted or swapped array is an error too.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import struct
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the run record and file hashes live in moee.provenance; importable from here as before
from moee.provenance import file_sha256, package_versions, run_record

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_FIELD = "text"
SIDECAR_FORMAT = "moee-embeddings/3"
#: Embeddings sidecar formats still read, with a warning: they carry no content digest.
LEGACY_SIDECAR_FORMATS = ("moee-embeddings/2",)
#: The key of a sidecar's digest of its own content (:func:`seal`).
SEAL_KEY = "sidecar_sha256"


# ----------------------------------------------------------------------------------------
# reading texts
# ----------------------------------------------------------------------------------------
def check_input_file(path: str | Path, what: str) -> Path:
    """``path`` if it is an existing file; a directory or a missing path is an error saying which."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a directory, not a {path.suffix or 'regular'} file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def input_format(path: str | Path) -> str:
    """``"txt"``, ``"jsonl"`` or ``"parquet"`` from the file suffix, else ``ValueError``."""
    suffix = Path(path).suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "txt"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    supported = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise ValueError(
        f"unsupported input file type {suffix or '(none)'!r} for {path}; expected one of: {supported}"
    )


def read_texts(path: str | Path, *, field: str | None = None) -> Iterator[str]:
    """Yield the texts of ``path`` in file order, lazily (see the module doc for the rules).

    ``field`` names the JSON key / parquet column (default ``"text"``); it is an error for
    ``.txt`` files, where it would be ignored.
    """
    path = Path(path)
    fmt = input_format(path)
    check_input_file(path, "input file")
    if fmt == "txt":
        if field is not None:
            raise ValueError(f"--field/field applies to .jsonl and .parquet inputs, not {path.name}")
        return _read_txt(path)
    if fmt == "jsonl":
        return _read_jsonl(path, field or DEFAULT_FIELD)
    return _read_parquet(path, field or DEFAULT_FIELD)


def _read_txt(path: Path) -> Iterator[str]:
    n = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):  # binary iteration splits on b"\n" only
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if line.endswith(b"\r"):
                line = line[:-1]
            try:
                yield line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if n == 0:
        raise ValueError(f"{path} is empty: no texts to read")


def iter_jsonl(
    path: str | os.PathLike | Any, *, skip_blank: bool = True
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every line of a JSONL file: the one JSONL reader of the package.

    ``path`` is a file path or an ``importlib.resources`` traversable (package data). A line that
    is not valid UTF-8 JSON or not an object is a ``ValueError`` naming the file and line; a blank
    line is skipped, or with ``skip_blank=False`` is an error too (input rows stay aligned with lines).
    """
    source = Path(path) if isinstance(path, (str, os.PathLike)) else path
    with source.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                if skip_blank:
                    continue
                raise ValueError(f"{path}:{n}: blank line; every line of a .jsonl file must be a JSON object")
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}:{n}: invalid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
            yield n, record


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    n = 0
    for n, record in iter_jsonl(path, skip_blank=False):
        if field not in record:
            keys = ", ".join(map(repr, record)) or "none"
            raise ValueError(f"{path}:{n}: no field {field!r} (keys: {keys}); choose one with --field")
        value = record[field]
        if not isinstance(value, str):
            raise TypeError(f"{path}:{n}: field {field!r} must be a string, got {type(value).__name__}")
        yield value
    if n == 0:
        raise ValueError(f"{path} is empty: no texts to read")


def _read_parquet(path: Path, field: str, batch_rows: int = 8192) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {', '.join(names)}); choose one with --field"
        )
    col_type = pf.schema_arrow.field(field).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type) or is_view(col_type)):
        raise TypeError(f"{path}: column {field!r} must hold strings, it has type {col_type}")
    if pf.metadata.num_rows == 0:
        raise ValueError(f"{path} is empty: no texts to read")
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
        values = batch.column(0).to_pylist()
        for value in values:
            if value is None:
                raise ValueError(f"{path}: row {row} of column {field!r} is null")
            yield value
            row += 1


@dataclass(frozen=True)
class InputPart:
    """One share of an input file that a worker reads without touching the rest: bytes
    ``[start, stop)`` of a .txt / .jsonl file (each line belongs to the share holding its first
    byte, so shares meet at line starts), or row groups ``[start, stop)`` of a .parquet file
    (``first_row``: its first row's index in the file, known from the footer; ``None`` for lines)."""

    path: str
    fmt: str
    start: int
    stop: int
    first_row: int | None = None


def split_input(path: str | Path, parts: int) -> list[InputPart]:
    """``path`` cut into ``parts`` shares of about equal size, in file order, reading only the
    Parquet footer (a text file is cut by size: no byte of it is read here)."""
    path = check_input_file(path, "input file")
    fmt = input_format(path)
    if parts < 1:
        raise ValueError(f"number of input parts must be >= 1, got {parts}")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        groups = meta.num_row_groups
        firsts = np.concatenate([[0], np.cumsum([meta.row_group(g).num_rows for g in range(groups)])])
        cuts = [groups * k // parts for k in range(parts + 1)]
        return [InputPart(str(path), fmt, a, b, int(firsts[a])) for a, b in zip(cuts, cuts[1:])]
    size = path.stat().st_size
    cuts = [size * k // parts for k in range(parts + 1)]
    return [InputPart(str(path), fmt, a, b) for a, b in zip(cuts, cuts[1:])]


def _line_start(f: Any, offset: int) -> int:
    """The first line start at or after ``offset`` (reads at most the line it falls in)."""
    if offset <= 0:
        return 0
    f.seek(offset - 1)
    f.readline()  # ends at the newline at or after offset - 1
    return f.tell()


def iter_part_lines(part: InputPart) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line without its newline)`` for every line starting in the share."""
    with open(part.path, "rb") as f:
        pos = _line_start(f, part.start)
        stop = _line_start(f, part.stop) if part.stop > pos else pos
        f.seek(pos)
        while pos < stop:
            raw = f.readline()
            if not raw:
                break
            yield pos, raw[:-1] if raw.endswith(b"\n") else raw
            pos += len(raw)


def read_part_records(part: InputPart, columns: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every row of the share, in file order: ``where`` names the row in
    errors (``path@byte N`` / ``path row N``); ``record`` holds ``columns`` (missing ones absent).
    A .txt line is ``{"text": line}``; a bad JSON line is an error naming its byte offset."""
    if part.fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(part.path)
        have = [c for c in columns if c in pf.schema_arrow.names]
        row = part.first_row or 0
        for g in range(part.start, part.stop):
            for record in pf.read_row_group(g, columns=have).to_pylist():
                yield f"{part.path} row {row}", record
                row += 1
        return
    for pos, line in iter_part_lines(part):
        where = f"{part.path}@byte {pos}"
        if part.fmt == "txt":
            line = line[:-1] if line.endswith(b"\r") else line
            try:
                yield where, {DEFAULT_FIELD: line.decode("utf-8")}
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not valid UTF-8 ({exc.reason})") from None
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: invalid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def check_text_value(value: Any, field: str, where: str) -> str:
    """``value`` if it is a string, else an error naming the column and the row."""
    if value is None:
        raise ValueError(f"{where}: column {field!r} is missing or null; every row needs a text")
    if not isinstance(value, str):
        raise TypeError(f"{where}: column {field!r} must be a string, got {type(value).__name__}")
    return value


def read_part_texts(part: InputPart, *, field: str | None = None) -> Iterator[str]:
    """The texts of one share of an input (:func:`split_input`), in order, checked as
    :func:`read_texts` checks them; the other shares' bytes are never read."""
    if part.fmt == "txt" and field is not None:
        raise ValueError(f"--field/field applies to .jsonl and .parquet inputs, not {part.path}")
    field = field or DEFAULT_FIELD
    for where, record in read_part_records(part, [field]):
        if field not in record and part.fmt == "jsonl":
            keys = ", ".join(map(repr, record)) or "none"
            raise ValueError(f"{where}: no field {field!r} (keys: {keys}); choose one with --field")
        yield check_text_value(record.get(field), field, where)


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Group an iterable into lists of ``size`` (the last may be shorter), lazily."""
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class TextsDigest:
    """SHA-256 of a sequence of texts in order (each text's UTF-8 bytes, length-prefixed), computed
    as they stream past: what an embeddings file records as ``texts_sha256`` and ``moee search``
    checks ``--texts`` against. It depends on the texts only, not on the file format or field."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.count = 0

    def update(self, text: str) -> None:
        data = text.encode("utf-8", "surrogatepass")  # never raises; bad text is refused elsewhere
        self._sha.update(len(data).to_bytes(8, "little"))
        self._sha.update(data)
        self.count += 1

    def wrap(self, texts: Iterable[str]) -> Iterator[str]:
        """``texts`` unchanged, each one hashed as it passes."""
        for text in texts:
            self.update(text)
            yield text

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def texts_digest(texts: Iterable[str]) -> tuple[str, int]:
    """``(texts_sha256, count)`` of ``texts`` (:class:`TextsDigest`), streaming."""
    digest = TextsDigest()
    for text in texts:
        digest.update(text)
    return digest.hexdigest(), digest.count


# ----------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------
def sidecar_path(path: str | Path) -> Path:
    """``emb.npy`` -> ``emb.npy.json`` (the same convention as saved faiss indexes)."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def run_metadata(command: list[str] | None = None) -> dict[str, Any]:
    """The run record of ``moee.provenance`` (versions, shell-quoted command line, UTC
    ``timestamp``, git revision) for any result file; ``sys.argv`` by default."""
    return run_record(command)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def content_digest(doc: dict[str, Any], key: str = SEAL_KEY) -> str:
    """SHA-256 of ``doc``'s canonical JSON (sorted keys, no spaces) without its own ``key``."""
    body = json.loads(json.dumps({k: v for k, v in doc.items() if k != key}, default=_json_default))
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    ).hexdigest()


def seal(doc: dict[str, Any], key: str = SEAL_KEY) -> dict[str, Any]:
    """A copy of ``doc`` with its :func:`content_digest` under ``key`` (last), so an edit is detected."""
    body = {k: v for k, v in doc.items() if k != key}
    return {**body, key: content_digest(body, key)}


def check_seal(doc: dict[str, Any], path: str | Path, *, remedy: str, key: str = SEAL_KEY) -> None:
    """``ValueError`` naming ``path`` unless ``doc`` carries its own correct :func:`content_digest`."""
    if key not in doc:
        raise ValueError(f"{path} has no {key} (its content cannot be checked); {remedy}")
    if doc[key] != content_digest(doc, key):
        raise ValueError(
            f"{path} was changed after it was written (its {key} does not match its content); {remedy}"
        )


def temporary_path(path: str | Path, kind: str = "partial") -> Path:
    """A hidden name beside ``path`` unique to this writer (``.NAME.PID.RANDOM.kind``): two writers
    of one output never share a file, and nothing under it can be taken for a finished result."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}")


def _write_json_tmp(path: Path, data: dict[str, Any]) -> Path:
    """``data`` as JSON in a temporary file beside ``path``, flushed to disk; returns the temp path."""
    tmp = temporary_path(path, "tmp")
    with open(tmp, "x") as f:
        f.write(json.dumps(data, indent=2, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> Path:
    """Write JSON via a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    os.replace(_write_json_tmp(path, data), path)
    return path


def npy_data_offset(path: str | Path) -> int:
    """Byte offset where a .npy file's array data starts (after its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            np.lib.format.read_array_header_1_0(f)
        else:
            np.lib.format.read_array_header_2_0(f)
        return f.tell()


class OutputInUseError(FileExistsError):
    """Another writer (this or another process) holds the output's lock."""


try:  # POSIX; elsewhere outputs are not locked, and unique temporary names still keep writers apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_HELD: dict[str, list[Any]] = {}  # lock file -> [fd, depth, owning thread]
_HELD_GUARD = threading.Lock()


def lock_path(path: str | Path) -> Path:
    """The lock file of an output (``.NAME.lock`` beside it; removed when its writer finishes)."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextmanager
def output_lock(path: str | Path, what: str = "") -> Iterator[None]:
    """Hold ``path``'s lock for the block, or raise :class:`OutputInUseError` at once when another
    writer holds it (``what``: how the error names the output, e.g. ``"--out"``). Re-entrant within
    a thread; the kernel releases it when the process dies, so a kill leaves no stale lock."""
    lock = lock_path(path)
    key = os.path.abspath(lock)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None and held[2] != threading.get_ident():
            raise OutputInUseError(f"another thread is writing {what + ' ' if what else ''}{path}")
        if held is None:
            lock.parent.mkdir(parents=True, exist_ok=True)
            held = _HELD[key] = [_acquire(lock, path, what), 0, threading.get_ident()]
        held[1] += 1
    try:
        yield
    finally:
        with _HELD_GUARD:
            held[1] -= 1
            if held[1] == 0:  # the last holder in this thread releases it, whichever came first
                del _HELD[key]
                if held[0] is not None:
                    lock.unlink(missing_ok=True)  # while still locked: a waiting opener sees a new inode
                    os.close(held[0])


def _acquire(lock: Path, path: str | Path, what: str) -> int | None:
    if fcntl is None:  # pragma: no cover
        return None
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise OutputInUseError(
                f"another process{f' (pid {holder})' if holder else ''} is writing {what + ' ' if what else ''}"
                f"{path} (it holds {lock}); wait for it to finish or choose another output"
            ) from None
        try:  # the previous holder may have removed the file between our open and our lock
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def check_output_path(
    path: str | Path, *, overwrite: bool, what: str = "--out", inputs: dict[str, Any] | None = None
) -> Path:
    """Refuse an output file that could not be written, before any work is done.

    One of the command's ``inputs`` (:func:`check_not_an_input`, even with ``overwrite``: the
    output would replace what the command reads), a directory, an existing file (unless
    ``overwrite``), an output another writer holds, and a parent that cannot be created or written
    to are errors naming the path (``what``: the flag); the check writes and removes a probe file.
    """
    path = Path(path)
    check_not_an_input(path, inputs, what=what, folder=False)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a directory; give the path of a file")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{what} {path} already exists; pass --overwrite to replace it")
    probe_writable(path.parent, temporary_path(path, "probe"), f"cannot write {what} {path}")
    with output_lock(path, what):  # fails at once when another run is writing it
        pass
    return path


def probe_writable(directory: Path, probe: Path, message: str) -> None:
    """Create ``directory`` and write and remove ``probe`` in it, so an unwritable output fails
    before any work; ``message`` starts the error."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{message}: {exc.strerror or exc} ({exc.filename or directory})") from None


def commit_with_sidecar(
    partial: str | Path,
    path: str | Path,
    metadata: dict[str, Any],
    *,
    sidecar: str | Path | None = None,
    overwrite: bool = True,
) -> Path:
    """Move a finished ``partial`` file to ``path`` together with its JSON sidecar ``metadata``
    (sealed, :func:`seal`; ``sidecar``: its path, default :func:`sidecar_path`).

    Under the output's lock: sidecar to a temporary file, old sidecar removed, array renamed,
    sidecar renamed. A crash in between leaves an array without a sidecar (refused on read), never
    a stale pairing. ``overwrite=False`` refuses an output that appeared meanwhile (the partial
    file is removed).
    """
    path = Path(path)
    sidecar = Path(sidecar) if sidecar is not None else sidecar_path(path)
    with output_lock(path):
        if not overwrite and (path.exists() or sidecar.exists()):
            Path(partial).unlink(missing_ok=True)
            raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
        tmp = _write_json_tmp(sidecar, seal(metadata))
        try:
            sidecar.unlink(missing_ok=True)
            os.replace(partial, path)
            os.replace(tmp, sidecar)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


# ----------------------------------------------------------------------------------------
# embedding files
# ----------------------------------------------------------------------------------------
_NPY_HEADER_BYTES = 128  # fixed, so the shape can be rewritten in place on close


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """A .npy v1.0 header padded to a fixed size (valid npy: spaces before the newline)."""
    desc = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    text = repr(desc).encode("latin1")
    prefix = b"\x93NUMPY\x01\x00"
    body_len = _NPY_HEADER_BYTES - len(prefix) - 2
    if len(text) + 1 > body_len:
        raise ValueError(f"shape {shape} too large for the .npy header")
    return prefix + struct.pack("<H", body_len) + text + b" " * (body_len - len(text) - 1) + b"\n"


class EmbeddingWriter:
    """Append float32 rows to ``path`` (.npy) as they are computed; ``close`` finalises.

    Rows go to a temporary name unique to this writer (:func:`temporary_path`) and the file is
    committed with its sidecar (see :func:`commit_with_sidecar`) only on a successful ``close``: an
    existing ``path`` with its sidecar is always complete, which is what resuming a crashed sharded
    run relies on. The writer holds the output's lock from creation to ``close`` / ``abort``, so a
    second writer of the same output is refused at once (:class:`OutputInUseError`);
    ``overwrite=False`` refuses an existing output. The data is hashed as it is written, so the
    sidecar's ``data_sha256`` costs no second read.
    """

    def __init__(self, path: str | Path, *, dim: int | None = None, overwrite: bool = True) -> None:
        self.path = Path(path)
        if self.path.suffix != ".npy":
            raise ValueError(f"embeddings are written as .npy; got output path {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.overwrite = overwrite
        self._lock = output_lock(self.path)
        self._lock.__enter__()
        try:
            if not overwrite and self.path.exists():
                raise FileExistsError(f"{self.path} already exists; pass --overwrite to replace it")
            self.partial = temporary_path(self.path)
            self._file = open(self.partial, "xb")
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        self.dim = dim
        self.rows = 0
        self._digest = hashlib.sha256()
        self._file.write(_npy_header((0, dim or 0), np.dtype(np.float32)))

    def write(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"embedding rows must be 2-D [n, dim], got shape {rows.shape}")
        if self.dim is None:
            self.dim = rows.shape[1]
        elif rows.shape[1] != self.dim:
            raise ValueError(f"embedding rows have dimension {rows.shape[1]}, earlier rows had {self.dim}")
        data = np.ascontiguousarray(rows, dtype="<f4").tobytes()
        self._file.write(data)
        self._digest.update(data)
        self.rows += rows.shape[0]

    def close(self, metadata: dict[str, Any] | None = None) -> Path:
        """Fix the header, move the file into place and write the sidecar; returns the path."""
        self._file.seek(0)
        self._file.write(_npy_header((self.rows, self.dim or 0), np.dtype(np.float32)))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        try:
            meta = sidecar_metadata(metadata, (self.rows, self.dim or 0), self._digest.hexdigest())
            return commit_with_sidecar(self.partial, self.path, meta, overwrite=self.overwrite)
        except BaseException:
            self.partial.unlink(missing_ok=True)
            raise
        finally:
            self._release()

    def abort(self) -> None:
        """Discard a partial file (after an error)."""
        if not self._file.closed:
            self._file.close()
        self.partial.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.__exit__(None, None, None)

    def __enter__(self) -> EmbeddingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._file.closed:
            self.close()


def sidecar_metadata(metadata: dict[str, Any] | None, shape: tuple[int, int], sha256: str) -> dict[str, Any]:
    """The sidecar of a float32 array of ``shape`` whose data hashes to ``sha256``.

    ``array_dtype`` is the file's dtype; the model's weights dtype is a separate setting
    (``model_dtype``), so one never overwrites the other.
    """
    given = {k: v for k, v in (metadata or {}).items() if k not in ("format", SEAL_KEY)}
    meta = {"format": SIDECAR_FORMAT, **given}
    if "dtype" in meta:
        raise ValueError("sidecar metadata: use model_dtype for the model's dtype (array_dtype is set here)")
    meta["array_dtype"] = "float32"
    meta["shape"] = list(shape)
    meta["data_sha256"] = sha256
    meta.setdefault("versions", package_versions())
    return meta


def write_embeddings(
    path: str | Path,
    embeddings: np.ndarray,
    metadata: dict[str, Any] | None = None,
    *,
    overwrite: bool = True,
) -> Path:
    """Write a whole matrix (float32) and its sidecar in one call."""
    arr = np.asarray(embeddings)
    if arr.ndim != 2:
        raise ValueError(f"embeddings must be 2-D [n, dim], got shape {arr.shape}")
    writer = EmbeddingWriter(path, dim=arr.shape[1], overwrite=overwrite)
    try:
        writer.write(arr)
    except BaseException:
        writer.abort()
        raise
    return writer.close(metadata)


def read_sidecar(
    sidecar: Path,
    *,
    fmt: str,
    kind: str,
    missing: str,
    remedy: str,
    legacy: tuple[str, ...] = (),
    format_hint: Callable[[Any], str] = lambda found: "",
) -> dict[str, Any]:
    """A JSON sidecar of format ``fmt`` whose own content digest (:func:`check_seal`) is right, or
    an error naming it: ``missing`` when it does not exist, invalid JSON or an edited sidecar with
    ``remedy``, another format with ``format_hint(found format)`` appended (``kind``: what the sidecar
    describes). A ``legacy`` format (written before sidecars were sealed) is read with a warning
    that it cannot be checked. Shared by embeddings files and saved indexes."""
    if not sidecar.is_file():
        raise FileNotFoundError(missing)
    try:
        meta = json.loads(sidecar.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{sidecar} is not valid JSON ({exc}); {remedy}") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found in legacy:
        warnings.warn(
            f"{sidecar} was written by an older moee (format {found}) without content digests: its "
            f"settings, texts and model cannot be checked; {remedy} to get one that can",
            stacklevel=3,
        )
        return meta
    if found != fmt:
        raise ValueError(f"{sidecar} is not a moee {kind} sidecar (format {found!r}){format_hint(found)}")
    check_seal(meta, sidecar, remedy=remedy)
    return meta


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The sidecar of an embeddings file (``FileNotFoundError`` naming it when missing; an edited
    sidecar is an error, one of the previous format a warning)."""
    sidecar = sidecar_path(path)
    return read_sidecar(
        sidecar,
        fmt=SIDECAR_FORMAT,
        kind="embeddings",
        missing=f"sidecar {sidecar} is missing; embeddings files are written by `moee embed`",
        remedy="re-run `moee embed`",
        legacy=LEGACY_SIDECAR_FORMATS,
        format_hint=lambda found: (
            "; it was written by an older moee, re-run `moee embed`" if found == "moee-embeddings/1" else ""
        ),
    )


def check_embeddings_file(path: str | Path, meta: dict[str, Any], *, content: bool = True) -> None:
    """``ValueError`` naming ``path`` unless its size and (``content``) content hash match the
    sidecar ``meta``."""
    path = Path(path)
    shape = [int(x) for x in meta.get("shape", [])]
    if len(shape) != 2:
        raise ValueError(f"sidecar of {path} has no valid shape: {meta.get('shape')!r}")
    try:
        offset = npy_data_offset(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable .npy file ({exc})") from None
    expected_size = offset + shape[0] * shape[1] * 4
    size = path.stat().st_size
    if size != expected_size:
        raise ValueError(
            f"{path} does not match its sidecar: {size} bytes, expected {expected_size} for shape {shape} "
            "(truncated or overwritten)"
        )
    if content and file_sha256(path, offset=offset) != meta.get("data_sha256"):
        raise ValueError(f"{path} does not match its sidecar (content hash differs): the file is corrupted")


def read_embeddings(
    path: str | Path, *, mmap: bool = False, verify: bool = True
) -> tuple[np.ndarray, dict[str, Any]]:
    """Load ``(embeddings, metadata)``; never unpickles, checks the sidecar's shape and (``verify``,
    one extra read of the file) size and content hash. A Parquet embeddings folder (``moee embed
    --engine ray``) reads in input order (:func:`read_parquet_embeddings`)."""
    if is_parquet_embeddings(path):
        arr, meta, _ = read_parquet_embeddings(path, verify=verify)
        return arr, meta
    path = check_input_file(path, "embeddings file")
    meta = read_metadata(path)
    if verify:
        check_embeddings_file(path, meta)
    arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    if list(arr.shape) != list(meta.get("shape", [])):
        raise ValueError(f"{path} has shape {list(arr.shape)} but its sidecar says {meta.get('shape')}")
    return arr, meta


#: The sidecar of a Parquet embeddings folder (``moee embed --engine ray``), inside the folder; the
#: leading underscore makes Parquet readers (pyarrow, Ray, Spark) skip it.
PARQUET_SIDECAR = "_embeddings.json"
#: The columns a Parquet embeddings folder always holds (the ``--id-field`` column is kept too).
ROW_COLUMN, TEXT_COLUMN, EMBEDDING_COLUMN = "row", "text", "embedding"


def is_parquet_embeddings(path: str | Path) -> bool:
    """True for a folder of Parquet embeddings files with their sidecar."""
    return Path(path).is_dir() and (Path(path) / PARQUET_SIDECAR).is_file()


def read_embeddings_table(path: str | Path, columns: list[str] | None = None) -> Any:
    """The rows of a Parquet embeddings folder as one pyarrow Table in input order (sorted by
    ``row``); ``row`` must be exactly ``0 .. n-1`` (no row lost or duplicated), else an error."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    path = Path(path)
    files = sorted(str(p) for p in path.glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .parquet files")
    if columns is not None and ROW_COLUMN not in columns:
        columns = [ROW_COLUMN, *columns]
    table = pads.dataset(files, format="parquet").to_table(columns=columns)
    table = table.take(pc.sort_indices(table, sort_keys=[(ROW_COLUMN, "ascending")]))
    rows = table.column(ROW_COLUMN).to_numpy()
    if not np.array_equal(rows, np.arange(len(rows))):
        seen = np.bincount(rows[(rows >= 0) & (rows < len(rows))], minlength=len(rows))
        raise ValueError(
            f"{path}: the rows are not 0..{len(rows) - 1} exactly once ({int((seen == 0).sum())} missing, "
            f"{int((seen > 1).sum())} duplicated): a partial or mixed output; re-run `moee embed`"
        )
    return table


def _parquet_arrays(table: Any) -> tuple[np.ndarray, list[str]]:
    column = table.column(EMBEDDING_COLUMN).combine_chunks()
    dim = column.type.list_size
    values = column.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(values.reshape(-1, dim), dtype="<f4"), table.column(TEXT_COLUMN).to_pylist()


def write_parquet_sidecar(path: str | Path, metadata: dict[str, Any]) -> Path:
    """Seal the sidecar of the Parquet embeddings folder ``path``: the usual keys plus the shape,
    ``data_sha256`` (of the float32 rows in input order, as a .npy's) and ``texts_sha256`` (of its
    ``text`` column), from one read of the folder."""
    arr, texts = _parquet_arrays(read_embeddings_table(path, [TEXT_COLUMN, EMBEDDING_COLUMN]))
    digest, _ = texts_digest(texts)
    sha = hashlib.sha256(arr.tobytes()).hexdigest()
    meta = sidecar_metadata({**metadata, "storage": "parquet", "texts_sha256": digest}, arr.shape, sha)
    return write_json_atomic(Path(path) / PARQUET_SIDECAR, seal(meta))


def read_parquet_sidecar(path: str | Path) -> dict[str, Any]:
    """The checked sidecar of a Parquet embeddings folder (without reading its rows)."""
    path = Path(path)
    return read_sidecar(
        path / PARQUET_SIDECAR,
        fmt=SIDECAR_FORMAT,
        kind="embeddings",
        missing=f"{path / PARQUET_SIDECAR} is missing; Parquet embeddings are written by `moee embed --engine ray`",
        remedy="re-run `moee embed`",
    )


def read_parquet_embeddings(
    path: str | Path, *, verify: bool = True
) -> tuple[np.ndarray, dict[str, Any], list[str]]:
    """``(embeddings [n, dim] float32 in input order, sidecar, texts)`` of a Parquet embeddings
    folder; ``verify`` checks the shape, data and texts digests against the sidecar."""
    path = Path(path)
    meta = read_parquet_sidecar(path)
    arr, texts = _parquet_arrays(read_embeddings_table(path, [TEXT_COLUMN, EMBEDDING_COLUMN]))
    if list(arr.shape) != list(meta.get("shape", [])):
        raise ValueError(
            f"{path} holds {list(arr.shape)} embeddings but its sidecar says {meta.get('shape')}"
        )
    if verify and hashlib.sha256(arr.tobytes()).hexdigest() != meta.get("data_sha256"):
        raise ValueError(f"{path} does not match its sidecar (content hash differs): the files were changed")
    if verify and texts_digest(texts)[0] != meta.get("texts_sha256"):
        raise ValueError(f"{path}: its text column does not match the sidecar's texts_sha256")
    return arr, meta, texts


def npy_shape(path: str | Path) -> tuple[int, ...]:
    """Shape of a .npy file from its header, without reading the data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, _ = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, _ = np.lib.format.read_array_header_2_0(f)
    return tuple(shape)


__all__ = [
    "EmbeddingWriter",
    "PARQUET_OUTPUT",
    "PARQUET_SIDECAR",
    "is_parquet_embeddings",
    "read_embeddings_table",
    "read_parquet_embeddings",
    "read_parquet_sidecar",
    "write_parquet_sidecar",
    "InputPart",
    "check_text_value",
    "iter_part_lines",
    "read_part_records",
    "read_part_texts",
    "split_input",
    "FolderOutput",
    "OUTPUT_RECORD",
    "StagedFolder",
    "check_not_an_input",
    "check_output_folder",
    "previous_output_files",
    "read_output_record",
    "commit_folder",
    "match_folder_modes",
    "staging_folder",
    "OutputInUseError",
    "TextsDigest",
    "batched",
    "check_embeddings_file",
    "check_input_file",
    "check_output_path",
    "check_seal",
    "commit_with_sidecar",
    "content_digest",
    "lock_path",
    "output_lock",
    "probe_writable",
    "seal",
    "temporary_path",
    "texts_digest",
    "file_sha256",
    "npy_data_offset",
    "sidecar_metadata",
    "input_format",
    "npy_shape",
    "package_versions",
    "read_embeddings",
    "read_metadata",
    "read_texts",
    "run_metadata",
    "sidecar_path",
    "write_embeddings",
    "write_json_atomic",
]


# ----------------------------------------------------------------------------------------
# output folders (upcycled models, reports, ablation results, Parquet embeddings)
# ----------------------------------------------------------------------------------------
#: The record a folder output keeps of the files its command wrote there: what the next
#: ``--overwrite`` of that command removes (and nothing else). Hidden, so listings, Hugging Face
#: loaders and Parquet readers skip it.
OUTPUT_RECORD = ".moee-output.json"
OUTPUT_RECORD_FORMAT = "moee-output/1"


@dataclass(frozen=True)
class FolderOutput:
    """What one command writes as a folder: the ``writer`` recorded in :data:`OUTPUT_RECORD`
    (``"moee upcycle"``), the names its files had before the record existed (``owned``: names or
    glob patterns of the folder's top level, counted only in a folder without a record and, when
    ``marker`` is set, only where that file is; a folder of another kind never loses a file that
    merely matches), and the files a reader opens first (``last``: committed after every other
    file, so an interrupted commit leaves no folder a reader takes for finished)."""

    writer: str
    owned: tuple[str, ...] = ()
    marker: str | None = None
    last: tuple[str, ...] = ()


#: What a Parquet embeddings folder holds (``moee embed --engine ray``, ``moee embed --merge DIR
#: --out FOLDER``): its ``*.parquet`` files are the embeddings' wherever the sidecar is (a reader
#: takes every one of them), and the sidecar lands last.
PARQUET_OUTPUT = FolderOutput(
    "moee embed", owned=("*.parquet", PARQUET_SIDECAR), marker=PARQUET_SIDECAR, last=(PARQUET_SIDECAR,)
)


def _as_paths(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [value]
    return [v for v in value if v is not None]


def check_not_an_input(
    out: str | Path, inputs: dict[str, Any] | None, *, what: str = "--out", folder: bool = True
) -> None:
    """Refuse an output that is one of the command's inputs or, for a folder output, holds one or
    lies inside an input folder: replacing the output would replace or delete what the command
    reads (``moee upcycle dense --out dense --overwrite`` would lose the dense weights).

    ``inputs`` maps how each input is named (``"SRC"``, ``"--corpus"``) to a path, a list of
    paths or ``None``; a name that is no local path (a Hub id) has nothing on disk to lose and is
    skipped. Paths are compared after resolving symbolic links. The error names both paths and
    the fix."""
    out = Path(out).expanduser()
    target = out.resolve()
    for label, value in (inputs or {}).items():
        for given in _as_paths(value):
            path = Path(given).expanduser()
            if not path.exists():
                continue
            real = path.resolve()
            if real == target or (out.exists() and os.path.samefile(out, path)):
                relation = "is"
            elif folder and target in real.parents:
                relation = "holds"
            elif folder and path.is_dir() and real in target.parents:
                relation = "lies inside"
            else:
                continue
            kind = "folder" if folder else "file"
            raise ValueError(
                f"{what} {out} {relation} the input {label} {given}: writing the output there could "
                f"replace or delete what the command reads; give {what} a {kind} that is not an "
                "input, holds none and lies inside none (e.g. a new folder beside it)"
            )


def read_output_record(folder: str | Path) -> dict[str, Any] | None:
    """The :data:`OUTPUT_RECORD` of ``folder`` (``None`` without one), checked: its ``files`` are
    relative paths inside the folder, so a changed record can never point a removal elsewhere."""
    path = Path(folder) / OUTPUT_RECORD
    if not path.is_file():
        return None
    remedy = "remove it; --overwrite then replaces only the files the command knows by name"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); {remedy}") from None
    files = record.get("files") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or record.get("format") != OUTPUT_RECORD_FORMAT
        or not isinstance(record.get("writer"), str)
        or not isinstance(files, list)
    ):
        raise ValueError(f"{path} is not a moee output record (format {OUTPUT_RECORD_FORMAT}); {remedy}")
    for name in files:
        parts = Path(name).parts if isinstance(name, str) else ()
        if not parts or Path(name).is_absolute() or ".." in parts or name == OUTPUT_RECORD:
            raise ValueError(f"{path} lists {name!r}, not a file inside the folder; {remedy}")
    return record


def check_output_folder(
    path: str | Path,
    *,
    overwrite: bool,
    what: str = "--out",
    inputs: dict[str, Any] | None = None,
    output: FolderOutput | None = None,
) -> Path:
    """Refuse an output folder before any work: one that is, holds or lies inside one of
    ``inputs`` (:func:`check_not_an_input`, even with ``overwrite``), an existing file (a folder
    is expected), a non-empty folder without ``overwrite``, a folder holding the output of
    another command than ``output``'s (its files are not this command's to replace), a parent
    that cannot be written."""
    path = Path(path)
    check_not_an_input(path, inputs, what=what)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is a file, not a folder; give a folder path (or remove it)")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{what} {path} exists and is not empty; pass --overwrite to replace it")
    if output is not None and path.is_dir():
        record = read_output_record(path)
        if record is not None and record["writer"] != output.writer:
            raise FileExistsError(
                f"{what} {path} holds the output of `{record['writer']}` ({path / OUTPUT_RECORD}); "
                f"`{output.writer}` does not replace another command's files: choose another folder"
            )
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{path.name}.{os.getpid()}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"cannot write {what} {path}: {exc.strerror or exc} ({exc.filename or parent})"
        ) from None
    return path


def check_rebuildable(out: str | Path, stamp: str) -> None:
    """A cache folder ``out`` may be (re)built: it does not exist, or it is a folder an earlier build
    wrote (it holds ``stamp``). Anything else is a user's folder, never deleted."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and (out / stamp).is_file()):
        raise FileExistsError(
            f"{out} exists and was not built by moee (no {stamp} in it): nothing there is replaced; "
            "choose another folder or remove it yourself"
        )


def build_cache_folder(out: str | Path, stamp: str, fill: Callable[[Path], dict[str, Any]]) -> Path:
    """(Re)build the cache folder ``out``: ``fill(staging)`` writes the files into a fresh hidden
    staging folder and returns the stamp, which is written as ``stamp`` (what `check_rebuildable`
    and a later digest check read); the files get the umask's modes and the folder replaces ``out``
    by rename. Refuses an ``out`` moee did not build; a failed build leaves ``out`` as it was."""
    out = Path(out)
    check_rebuildable(out, stamp)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_path(out)
    try:
        record = fill(staging)
        (staging / stamp).write_text(json.dumps(record, indent=2) + "\n")
        match_folder_modes(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def match_folder_modes(root: str | Path) -> None:
    """Give every file under ``root`` the mode of ``root`` less its execute bits, and every folder
    ``root``'s mode: the modes ``open()`` / ``mkdir()`` give under the user's umask, where a writer
    (safetensors writes 0600) chose a narrower one. ``root`` must have been made by ``mkdir()``."""
    root = Path(root)
    dir_mode = root.stat().st_mode & 0o777
    for sub, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(Path(sub) / name, dir_mode)
        for name in files:
            os.chmod(Path(sub) / name, dir_mode & 0o666)


def staging_folder(target: str | Path) -> Path:
    """A new, empty folder with a unique hidden name beside ``target`` (``.NAME.tmp-XXXXXXXX``),
    made with ``mkdir()`` so it gets the umask's mode; nothing there is ever taken for a result."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        staging = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
        try:
            staging.mkdir()
            return staging
        except FileExistsError:
            continue


def _files_under(root: Path) -> list[str]:
    """Every file (or link) under ``root`` as a sorted relative POSIX path."""
    found = []
    for sub, _, files in os.walk(root):
        found += [(Path(sub) / name).relative_to(root).as_posix() for name in files]
    return sorted(found)


def previous_output_files(target: str | Path, output: FolderOutput) -> list[str]:
    """The files of ``target`` its command's previous run wrote: those its :data:`OUTPUT_RECORD`
    lists, or in a folder without a record (written before records existed) the top-level files
    named by ``output.owned`` (only where ``output.marker`` is, when set). Only these are ever
    removed; every other file stays."""
    target = Path(target)
    record = read_output_record(target)
    if record is not None:
        if record["writer"] != output.writer:
            raise FileExistsError(
                f"{target} holds the output of `{record['writer']}`; `{output.writer}` does not replace it"
            )
        names = record["files"]
    elif output.marker is None or (target / output.marker).is_file():
        names = [p.name for pattern in output.owned for p in target.glob(pattern)]
    else:
        names = []
    return sorted({n for n in names if (target / n).is_file() or (target / n).is_symlink()})


def _write_record(folder: Path, output: FolderOutput, files: list[str], complete: bool) -> None:
    record = {"format": OUTPUT_RECORD_FORMAT, "writer": output.writer, "complete": complete, "files": files}
    write_json_atomic(folder / OUTPUT_RECORD, record)


def commit_folder(staging: str | Path, target: str | Path, output: FolderOutput) -> Path:
    """Move every file of a finished ``staging`` folder into ``target`` (file modes as the umask
    gives), replacing the files the previous run of the same command wrote there and nothing else.

    A new ``target`` is the staging folder renamed (one step: it appears complete or not at all).
    Into an existing folder the files go one by one, under the output's lock: first the record
    (:data:`OUTPUT_RECORD`) is rewritten to list the old and the new files, as not complete; then
    the old run's files (:func:`previous_output_files`) are removed, the new ones renamed in,
    ``output.last`` last, and the record rewritten with the new files. Why not rename the staging
    folder over ``target`` as a whole, carrying the user's files across: that moves files that are
    not the command's, and a crash in between leaves them inside a hidden folder that the next
    cleanup deletes. Per file, a user's file is never moved, and a crash at any point leaves a
    folder without the file a reader opens first (the old one is removed before any new file
    lands, the new one lands last), never old files beside new ones that read as one result; the
    record, written first, lists every file that may be the command's, so the next
    ``--overwrite`` clears them all. A staged file whose place in ``target`` is a folder is an
    error before anything changes.
    """
    import shutil

    staging, target = Path(staging), Path(target)
    new = [name for name in _files_under(staging) if name != OUTPUT_RECORD]
    with output_lock(target):
        if not target.exists():
            _write_record(staging, output, new, complete=True)
            match_folder_modes(staging)
            os.replace(staging, target)
            return target
        if not target.is_dir():
            raise NotADirectoryError(f"{target} is a file, not a folder; it is not replaced")
        match_folder_modes(staging)
        for name in new:  # a folder where a file goes, or a file where a folder goes: refused now
            blocked = [target / a for a in Path(name).parents[:-1] if (target / a).is_file()]
            if (target / name).is_dir() and not (target / name).is_symlink():
                blocked.append(target / name)
            if blocked:
                raise IsADirectoryError(
                    f"cannot write {target / name}: {blocked[0]} is in the way; move it, or choose "
                    "another output folder"
                )
        old = previous_output_files(target, output)
        _write_record(target, output, sorted(set(old) | set(new)), complete=False)
        for name in old:
            (target / name).unlink(missing_ok=True)
            for above in Path(name).parents[:-1]:  # folders the old run made and left empty
                try:
                    (target / above).rmdir()
                except OSError:
                    break
        for name in [n for n in new if n not in output.last] + [n for n in output.last if n in new]:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, target / name)
        _write_record(target, output, new, complete=True)
    shutil.rmtree(staging, ignore_errors=True)
    return target


class StagedFolder:
    """``with StagedFolder(out, output) as tmp:`` write every file of a result folder into ``tmp``;
    on a clean exit its files replace the previous run's in ``out`` (:func:`commit_folder`; a
    user's other files stay), on an error it is deleted. A run killed midway leaves only a hidden
    ``.NAME.tmp-*`` folder, never an ``out`` that looks done."""

    def __init__(self, target: str | Path, output: FolderOutput) -> None:
        self.target = Path(target)
        self.output = output
        self.path: Path | None = None

    def __enter__(self) -> Path:
        self.path = staging_folder(self.target)
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        import shutil

        if exc_type is None:
            commit_folder(self.path, self.target, self.output)
        else:
            shutil.rmtree(self.path, ignore_errors=True)
