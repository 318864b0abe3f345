"""Streaming and sharded (multi-process / multi-GPU) embedding of large corpora.

One process (``world == 1``) streams the input in chunks and appends each chunk's vectors
to the output file, so neither the texts nor the embeddings must fit in memory.

Sharded runs split the input into ``world`` contiguous shares (:func:`moee.io.split_input`):
byte ranges of a .txt / .jsonl file aligned to line starts, or row-group ranges of a .parquet
file. Process ``rank`` reads only its share (it seeks to it: the bytes before are never read) and
embeds it. Rank and world come from ``--shard-rank`` /
``--num-shards`` or from the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables that
``accelerate launch``, ``torchrun`` and most cluster launchers set; no process group is
needed, processes coordinate through files only:

- ``DIR/manifest.json``: input (path, size, format), field, world size and every setting that
  changes the numbers. A rerun with different ones is refused instead of mixing shards. The merge
  adds ``shards``: each shard's content hash, as merged.
- ``DIR/shard-RRRRR-of-WWWWW.npy`` (+ ``.npy.json`` with ``rows = {part, count}``: the share
  ``[start, stop)`` and its number of rows, ``data_sha256`` and the digest of its own texts,
  ``texts_sha256``): written under a temporary name unique to its process while holding the
  shard's lock (a second process of the same rank is refused) and committed with its sidecar when
  complete, so after a crash a rerun of the same command skips every complete shard (after
  re-reading its share: a share whose texts changed, reordered or edited rows, is a different run).
  A shard whose size or content hash does not match its sidecar (flipped
  bytes, truncation) is not complete: the rerun recomputes it and the merge refuses it by name.
- ``DIR/embeddings.npy`` (+ sidecar): the merge, rows in input order; rank 0 writes it once
  every shard is complete (or run ``moee embed --merge DIR --out OUT.npy``; an ``OUT`` folder gets
  Parquet files instead, as ``--engine ray`` writes them). The merge reads the input once, in one
  process, to check each shard's texts and record the whole input's ``texts_sha256``; shards that
  disagree with the input texts or with each other on the model weights are not merged.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moee.io import (
    EmbeddingWriter,
    InputPart,
    TextsDigest,
    batched,
    check_embeddings_file,
    commit_with_sidecar,
    file_sha256,
    input_format,
    npy_data_offset,
    npy_shape,
    output_lock,
    read_metadata,
    read_part_texts,
    read_texts,
    run_metadata,
    sidecar_metadata,
    sidecar_path,
    split_input,
    temporary_path,
    write_json_atomic,
)

EncodeFn = Callable[[list[str]], np.ndarray]
MANIFEST = "manifest.json"
MERGED = "embeddings.npy"
MANIFEST_FORMAT = "moee-shards/3"
_MERGE_RECORD = "shards"  # manifest key the merge adds; not part of a run's identity


@dataclass(frozen=True)
class ShardInfo:
    """This process' place in a sharded run."""

    rank: int
    world: int
    local_rank: int

    @property
    def name(self) -> str:
        return shard_name(self.rank, self.world)


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def shard_info(rank: int | None = None, world: int | None = None) -> ShardInfo:
    """Rank and world size from the arguments, else from the launcher's environment."""
    world = world if world is not None else (_env_int("WORLD_SIZE") or 1)
    rank = rank if rank is not None else (_env_int("RANK") or 0)
    if world < 1:
        raise ValueError(f"number of shards must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"shard rank must be in [0, {world}), got {rank}")
    local_rank = _env_int("LOCAL_RANK")
    return ShardInfo(rank=rank, world=world, local_rank=rank if local_rank is None else local_rank)


def default_device(info: ShardInfo) -> str | None:
    """One GPU per local process when GPUs are visible; ``None`` lets the embedder choose."""
    if info.world == 1:
        return None
    import torch

    if torch.cuda.is_available():
        return f"cuda:{info.local_rank % torch.cuda.device_count()}"
    return "cpu"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}"


def own_part(path: str | Path, info: ShardInfo) -> InputPart:
    """This process' share of the input (:func:`moee.io.split_input`), found without reading it."""
    return split_input(path, info.world)[info.rank]


def read_own_texts(path: str | Path, info: ShardInfo, field: str | None) -> Iterator[str]:
    """The texts of this process' share, in order (one process: the whole input, errors naming lines)."""
    if info.world == 1:
        return read_texts(path, field=field)
    return read_part_texts(own_part(path, info), field=field)


# ----------------------------------------------------------------------------------------
# streaming embedding
# ----------------------------------------------------------------------------------------
class _Counter:
    """Counts and hashes the rows of this process' share (its ``texts_sha256``, checked by the merge
    and on resume)."""

    def __init__(self, items: Iterable[str]) -> None:
        self.items = items
        self.digest = TextsDigest()

    @property
    def count(self) -> int:
        return self.digest.count

    def __iter__(self) -> Iterator[str]:
        return self.digest.wrap(self.items)


class _PerTextBar:
    """The run's progress bar as the encoder sees it: an ensemble of ``passes`` prompts reports
    each text once per prompt, the bar counts it once."""

    def __init__(self, bar: Any, passes: int) -> None:
        self.bar, self.passes, self._pending = bar, max(1, passes), 0

    def update(self, n: int = 1) -> None:
        self._pending += n
        whole, self._pending = divmod(self._pending, self.passes)
        if whole:
            self.bar.update(whole)


def embed_stream(
    encode: EncodeFn,
    texts: Iterable[str],
    out_path: str | Path,
    metadata: dict[str, Any] | Callable[[int], dict[str, Any]],
    *,
    chunk_size: int = 4096,
    progress: bool | None = None,
    total: int | None = None,
    overwrite: bool = True,
) -> Path:
    """Embed ``texts`` chunk by chunk into ``out_path`` (.npy + sidecar), in order.

    ``metadata`` may be a callable taking the number of rows written; it is called after the
    input is exhausted, so it can record facts known only then. The progress bar counts texts
    (of ``total``, with an ETA): an encoder with a ``progress`` attribute (``moee embed``'s) is given
    the bar and moves it per batch, any other moves it per chunk. ``overwrite=False`` refuses an
    existing ``out_path`` (:class:`moee.io.EmbeddingWriter`).
    """
    from tqdm.auto import tqdm

    writer = EmbeddingWriter(out_path, overwrite=overwrite)
    try:
        disable = None if progress is None else not progress
        with tqdm(desc="embedding", unit="text", total=total, disable=disable) as bar:
            if hasattr(encode, "progress"):
                encode.progress = bar
            for chunk in batched(texts, chunk_size):
                vectors = encode(chunk)
                if len(vectors) != len(chunk):
                    raise ValueError(f"encoder returned {len(vectors)} rows for {len(chunk)} texts")
                writer.write(vectors)
                bar.update(writer.rows - bar.n)  # exact after every chunk, however the encoder moved it
        meta = metadata(writer.rows) if callable(metadata) else metadata
    except BaseException:
        writer.abort()
        raise
    return writer.close(meta)


# ----------------------------------------------------------------------------------------
# sharded runs
# ----------------------------------------------------------------------------------------
def input_fingerprint(path: str | Path) -> dict[str, Any]:
    """Identify an input file without reading its rows (resolved path, size, format): every process
    computes it, so it must not cost a read of the input. Content is checked per share: each shard
    records its texts' digest, checked on resume and by the merge's one read of the input."""
    path = Path(path).resolve()
    return {"path": str(path), "size": path.stat().st_size, "format": input_format(path)}


def _check_or_write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    path = out_dir / MANIFEST
    if path.is_file():
        try:
            existing = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); delete {out_dir} and rerun") from None
        existing = {k: v for k, v in existing.items() if k != _MERGE_RECORD}
        if existing != manifest:
            diff = sorted(k for k in set(existing) | set(manifest) if existing.get(k) != manifest.get(k))
            raise ValueError(
                f"{out_dir} holds shards of a different run ({', '.join(diff)} differ); "
                "use a new output directory or delete the old one"
            )
        return
    write_json_atomic(path, manifest)  # every rank writes the same content; last rename wins


def shard_problem(out_dir: str | Path, rank: int, world: int, *, verify: bool = True) -> str | None:
    """Why shard ``rank`` is not usable (``None`` when it is complete and intact).

    Checks that the .npy and its sidecar exist and agree on the rows and the file size; with
    ``verify`` also the content hash (one read of the shard), which catches flipped bytes.
    """
    npy = Path(out_dir) / f"{shard_name(rank, world)}.npy"
    if not npy.is_file():
        return f"{npy} is missing"
    if not sidecar_path(npy).is_file():
        return f"{npy} has no sidecar (unfinished)"
    try:
        meta = read_metadata(npy)
        if meta.get("complete") is not True or npy_shape(npy)[0] != meta["rows"]["count"]:
            return f"{npy} is incomplete: its sidecar does not describe its rows"
        check_embeddings_file(npy, meta, content=verify)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return str(exc)
    return None


def shard_is_complete(out_dir: str | Path, rank: int, world: int, *, verify: bool = False) -> bool:
    """True when the shard's .npy and sidecar both exist and agree (``verify``: content hash too)."""
    return shard_problem(out_dir, rank, world, verify=verify) is None


def prepare_shard_dir(
    out_dir: str | Path,
    input_path: str | Path,
    info: ShardInfo,
    settings: dict[str, Any],
    *,
    field: str | None = None,
) -> bool:
    """Create or check ``out_dir``'s manifest; True when this process' shard is already complete.

    A manifest of a different run (other input, field, world size or settings) is an error:
    resuming must never mix shards computed differently.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": MANIFEST_FORMAT,
        "input": input_fingerprint(input_path),
        "field": field,
        "world": info.world,
        "settings": settings,
    }
    _check_or_write_manifest(out_dir, manifest)
    problem = shard_problem(out_dir, info.rank, info.world, verify=True)
    npy = out_dir / f"{info.name}.npy"
    if problem is not None and npy.is_file() and sidecar_path(npy).is_file():
        warnings.warn(f"recomputing {info.name}: {problem}", stacklevel=2)
    if problem is None:  # complete: its share must still hold the texts it was embedded from
        recorded = read_metadata(npy).get("texts_sha256")
        digest = TextsDigest()
        for _ in digest.wrap(read_own_texts(input_path, info, field)):
            pass
        if digest.hexdigest() != recorded:
            raise ValueError(
                f"{out_dir} holds shards of a different run (input differ: the rows of {info.name}'s share "
                f"of {input_path} changed since it was embedded); use a new output directory or delete the old one"
            )
    return problem is None


@dataclass(frozen=True)
class ShardRun:
    """One process' part of a sharded run: the input it reads its share of, the shards' folder,
    its place in the run and what the manifest records (``settings``: everything that changes the
    numbers; ``field``: the JSONL/Parquet text field)."""

    input_path: str | Path
    out_dir: str | Path
    info: ShardInfo
    settings: dict[str, Any]
    field: str | None = None


def embed_shard(
    encode: EncodeFn,
    run: ShardRun,
    *,
    chunk_size: int = 4096,
    metadata: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    progress: bool | None = None,
    total_rows: int | None = None,
) -> Path | None:
    """Embed this process' rows of ``run.input_path`` into ``run.out_dir``; ``None`` if already done.

    ``run.settings`` (everything that changes the numbers) goes into the manifest and every
    sidecar; ``metadata`` adds sidecar-only facts (resolved model path, batch size), or is a
    callable giving them once every row is embedded (e.g. the number of truncated texts).
    Every shard's sidecar records the digest of the whole input's texts (``texts_sha256``).
    ``total_rows``: the input's row count, for the progress bar's total.
    """
    if prepare_shard_dir(run.out_dir, run.input_path, run.info, run.settings, field=run.field):
        return None
    npy = Path(run.out_dir) / f"{run.info.name}.npy"
    with output_lock(npy, "shard"):  # a second process of the same rank is refused, not mixed in
        return _embed_own_rows(encode, run, npy, chunk_size, metadata, progress, total_rows)


def _embed_own_rows(
    encode: EncodeFn,
    run: ShardRun,
    npy: Path,
    chunk_size: int,
    metadata: dict[str, Any] | Callable[[], dict[str, Any]] | None,
    progress: bool | None,
    total_rows: int | None,
) -> Path:
    input_path, info, settings, field = run.input_path, run.info, run.settings, run.field
    sidecar_path(npy).unlink(missing_ok=True)  # a stale sidecar must never describe the new rows
    counter = _Counter(read_own_texts(input_path, info, field))
    part = own_part(input_path, info)
    meta: dict[str, Any] = {**settings, **run_metadata(), "shard": info.name}

    def finish(count: int) -> dict[str, Any]:
        rows = {"part": [part.start, part.stop], "count": count}
        facts = (metadata() if callable(metadata) else metadata) or {}
        return {**meta, **facts, "texts_sha256": counter.digest.hexdigest(), "rows": rows, "complete": True}

    return embed_stream(
        encode, counter, npy, finish, chunk_size=chunk_size, progress=progress, total=total_rows
    )


def wait_for_shards(out_dir: str | Path, world: int, *, timeout: float, poll: float = 2.0) -> None:
    """Block until every shard of ``world`` is complete, or raise ``TimeoutError``."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world) if not shard_is_complete(out_dir, r, world)]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"shards {missing} of {world} in {out_dir} are not complete after {timeout:.0f} s; "
                f"rerun the same command to resume them, then `moee embed --merge {out_dir} --out OUT.npy`"
            )
        time.sleep(poll)


def merge_shards(
    out_dir: str | Path,
    out_path: str | Path | None = None,
    *,
    command: list[str] | None = None,
    overwrite: bool = True,
) -> Path:
    """Interleave the shards of ``out_dir`` back into input order in ``out_path`` (under its lock,
    through a temporary name unique to this merge; ``overwrite=False`` refuses an existing one).
    A Parquet folder ``out_path`` that is, holds or lies inside ``out_dir`` or the shards' input is
    refused before any shard is read; ``overwrite`` replaces the previous embeddings' files there
    and keeps a user's other files (`moee.io.commit_folder`)."""
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found: {out_dir} is not a sharded embedding directory")
    manifest = json.loads(manifest_path.read_text())
    if out_path is not None and Path(out_path).suffix != ".npy":  # a folder: refused before any read
        from moee.io import PARQUET_OUTPUT, check_output_folder

        inputs = {"--merge": out_dir, "the shards' input": manifest["input"]["path"]}
        check_output_folder(out_path, overwrite=overwrite, inputs=inputs, output=PARQUET_OUTPUT)
    world = manifest["world"]
    problems = {r: shard_problem(out_dir, r, world, verify=True) for r in range(world)}
    problems = {r: p for r, p in problems.items() if p is not None}
    if problems:
        raise ValueError(
            f"cannot merge {out_dir}: shards {sorted(problems)} of {world} are missing or incomplete ("
            + "; ".join(problems.values())
            + "); rerun the same command to recompute them"
        )
    paths = [out_dir / f"{shard_name(r, world)}.npy" for r in range(world)]
    metas = [read_metadata(p) for p in paths]
    seen = {str(m.get("weights_digest")) for m in metas}
    if len(seen) != 1:  # every shard embedded with the same model, or none is merged
        raise ValueError(
            f"cannot merge {out_dir}: shards disagree on the model weights (weights_digest: {sorted(seen)})"
        )
    input_path = Path(manifest["input"]["path"])
    if not input_path.is_file():
        raise FileNotFoundError(
            f"cannot merge {out_dir}: its input {input_path} is gone (the merge reads it once to check "
            "every shard's texts); restore it"
        )
    parts = [own_part(input_path, ShardInfo(r, world, r)) for r in range(world)]
    for r, (m, part) in enumerate(zip(metas, parts)):
        if m["rows"].get("part") != [part.start, part.stop]:
            raise ValueError(
                f"shard {r} holds the share {m['rows'].get('part')} of the input, expected "
                f"[{part.start}, {part.stop}) of {world} shares"
            )
    n = sum(int(m["rows"]["count"]) for m in metas)
    dims = {npy_shape(p)[1] for p, m in zip(paths, metas) if m["rows"]["count"] > 0}
    if len(dims) != 1:
        raise ValueError(f"shards disagree on the embedding dimension: {sorted(dims)}")
    dim = dims.pop()

    out_path = Path(out_path) if out_path is not None else out_dir / MERGED
    with output_lock(out_path):
        return _merge_into(out_path, out_dir, manifest, paths, metas, (n, dim), overwrite)


def _merged_rows(
    out_dir: Path,
    manifest: dict[str, Any],
    paths: list[Path],
    metas: list[dict[str, Any]],
    digest: TextsDigest,
) -> Iterator[tuple[int, list[str], np.ndarray]]:
    """``(first row, texts, vectors)`` chunks of every shard in input order, from one read of the
    input; a shard whose texts are not its share's rows is an error naming it."""
    world = len(paths)
    field, row = manifest["field"], 0
    for r, (path, meta) in enumerate(zip(paths, metas)):
        shard_digest = TextsDigest()
        texts = shard_digest.wrap(
            digest.wrap(read_own_texts(manifest["input"]["path"], ShardInfo(r, world, r), field))
        )
        vectors = np.load(path, mmap_mode="r", allow_pickle=False) if meta["rows"]["count"] else None
        done = 0
        for chunk in batched(texts, 65536):
            if vectors is None or done + len(chunk) > len(vectors):
                break
            yield row + done, chunk, vectors[done : done + len(chunk)]
            done += len(chunk)
        for _ in texts:  # the rest of the share, if the shard is short: counted for the error
            done += 1
        if done != meta["rows"]["count"] or shard_digest.hexdigest() != meta.get("texts_sha256"):
            raise ValueError(
                f"cannot merge {out_dir}: shards disagree on the input texts ({path.name} holds "
                f"{meta['rows']['count']} rows, its share of {manifest['input']['path']} has {done} rows"
                f"{'' if done != meta['rows']['count'] else ' with other texts'}: the input changed); "
                "rerun the same command to recompute it"
            )
        row += done


def _merge_into(
    out_path: Path,
    out_dir: Path,
    manifest: dict[str, Any],
    paths: list[Path],
    metas: list[dict[str, Any]],
    shape: tuple[int, int],
    overwrite: bool,
) -> Path:
    """Write the merged rows of ``out_dir``'s shards, ``shape`` (rows, dimension) in all, to
    ``out_path`` and record the merge in its manifest."""
    manifest_path, (n, dim) = out_dir / MANIFEST, shape
    world = len(paths)
    if not overwrite and out_path.exists():
        raise FileExistsError(f"{out_path} already exists; pass --overwrite to replace it")
    digest = TextsDigest()
    chunks = _merged_rows(out_dir, manifest, paths, metas, digest)
    record = {p.name: m["data_sha256"] for p, m in zip(paths, metas)}
    per_file = (
        "shard",
        "rows",
        "complete",
        "shape",
        "format",
        "array_dtype",
        "data_sha256",
        "sidecar_sha256",
    )

    def sidecar() -> dict[str, Any]:
        keep = {k: v for k, v in metas[0].items() if k not in per_file}
        if all("truncated_texts" in m for m in metas):
            keep["truncated_texts"] = sum(int(m["truncated_texts"]) for m in metas)
        merged_from = {
            "directory": str(out_dir.resolve()),
            "shards": world,
            "shard_commands": metas[0]["command"],
            "shard_sha256": record,
        }
        return {
            **keep,
            **run_metadata(),
            "input": manifest["input"],
            "field": manifest["field"],
            "texts_sha256": digest.hexdigest(),  # the whole input's, from the merge's one read of it
            "merged_from": merged_from,
        }

    if out_path.suffix != ".npy":  # a folder of Parquet files, as `moee embed --engine ray` writes
        from moee.io import PARQUET_OUTPUT, StagedFolder, write_parquet_sidecar

        with StagedFolder(out_path, PARQUET_OUTPUT) as staging:
            _write_parquet_rows(staging, chunks)
            _record_merge(manifest_path, manifest, record)
            write_parquet_sidecar(staging, sidecar())
        return out_path
    partial = temporary_path(out_path)
    try:
        merged = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, dim))
        for first, _, rows in chunks:
            merged[first : first + len(rows)] = rows
        merged.flush()
        del merged
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _record_merge(manifest_path, manifest, record)
    sha = file_sha256(partial, offset=npy_data_offset(partial))
    return commit_with_sidecar(
        partial, out_path, sidecar_metadata(sidecar(), (n, dim), sha), overwrite=overwrite
    )


def _record_merge(manifest_path: Path, manifest: dict[str, Any], record: dict[str, str]) -> None:
    recorded = json.loads(manifest_path.read_text()).get(_MERGE_RECORD)
    if recorded != record:  # one writer: the merge runs once every shard is complete
        write_json_atomic(manifest_path, {**manifest, _MERGE_RECORD: record})


def _write_parquet_rows(folder: Path, chunks: Iterable[tuple[int, list[str], np.ndarray]]) -> None:
    """One Parquet file per chunk of ``(first row, texts, vectors)``: ``row``, ``text``, ``embedding``
    (fixed-size float32 lists), the layout of a Parquet embeddings folder (``moee.io``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k, (first, texts, rows) in enumerate(chunks):
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        table = pa.table(
            {
                "row": pa.array(np.arange(first, first + len(rows)), pa.int64()),
                "text": pa.array(texts, pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1]),
            }
        )
        pq.write_table(table, folder / f"part-{k:05d}.parquet")
