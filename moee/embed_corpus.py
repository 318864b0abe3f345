"""``run_embed(settings)``: the library side of ``moee embed`` (:class:`moee.embed.settings.EmbedSettings`).

One process writes one ``.npy`` and its sidecar; ``sharded`` processes each write their share into a
folder that rank 0 merges (``moee.shard``); ``engine="ray"`` embeds on a Ray cluster into a Parquet
folder (``moee.integrations.ray``); ``merge`` merges an existing shard folder. Every input is checked
before the model loads (the input read once, a sharded process its own share only, which also gives
the progress bar its total), the layer choice right after (against the model's layer counts); an
existing output is refused without ``overwrite``, and one run at a time writes an output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moee.corpus import make_encoder, run_facts
from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.settings import EmbedSettings
from moee.io import (
    PARQUET_OUTPUT,
    TextsDigest,
    check_output_folder,
    check_output_path,
    output_lock,
    probe_writable,
    read_metadata,
    read_parquet_sidecar,
    read_texts,
    run_metadata,
)

__all__ = ["check_output_dir", "check_output_file", "count_texts", "run_embed"]

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"moee embed: {msg}", file=sys.stderr)


class _CountingEncoder:
    """The encoder plus the number of texts it truncated, summed over calls (chunks).

    The embedder warns per call, and Python shows the same warning only once per place, so the
    count of later chunks would be lost; it is read from ``last_truncation`` after every call.
    """

    def __init__(self, embedder: Any, config: EmbeddingConfig, batch_size: int) -> None:
        self.embedder = embedder
        self.encode = make_encoder(embedder, config, batch_size)
        self.passes = len(config.prompt_templates)  # an ensemble embeds each text once per prompt
        self.truncated = 0
        self.progress: Any = None  # the run's bar (``moee.shard.embed_stream``), moved per batch

    def __call__(self, texts: list[str]) -> Any:
        from moee.shard import _PerTextBar

        bar = _PerTextBar(self.progress, self.passes) if self.progress is not None else False
        vectors = self.encode(texts, show_progress_bar=bar)
        self.truncated += int(getattr(self.embedder, "last_truncation", 0) or 0)
        return vectors

    def report(self, rows: int, log: Log) -> None:
        if self.truncated:
            log(
                f"{self.truncated} of {rows} texts were truncated to {self.embedder.max_length} tokens "
                "(recorded in the sidecar as truncated_texts)"
            )


def check_output_file(path: str | Path, *, overwrite: bool, inputs: dict[str, Any] | None = None) -> Path:
    """Refuse an output .npy that could not be written, before any work is done
    (:func:`moee.io.check_output_path`: one of ``inputs``, a directory, an existing file unless
    ``overwrite``, an output another run is writing, a parent that cannot be created or written to)."""
    return check_output_path(path, overwrite=overwrite, what="--out", inputs=inputs)


def check_output_dir(path: str | Path) -> Path:
    """Refuse a shard directory that is a file or cannot be written, before any work is done."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"with --sharded, --out {path} is a file, not a directory")
    probe_writable(path, path / f".probe.{os.getpid()}", f"cannot write to --out {path}")
    return path


def count_texts(path: str | Path, field: str | None, info: Any = None) -> int:
    """Read the input once before any work (a sharded process: only its share, see
    ``moee.shard.read_own_texts``): a bad row is found before the model loads, and the progress
    bar gets its total."""
    from moee import shard

    if info is None:
        return sum(1 for _ in read_texts(path, field=field))
    return sum(1 for _ in shard.read_own_texts(path, info, field))


def _load(settings: EmbedSettings, **changes: Any) -> Any:
    """The model of ``settings`` loaded with its loading options (``changes``: e.g. a shard's device)."""
    from moee.embed.embedder import MoEEmbedder

    return MoEEmbedder.from_pretrained(settings.model, settings.load.replace(**changes))


def run_embed(settings: EmbedSettings, *, log: Log = _stderr) -> int:
    """Write what ``settings`` asks for; returns the exit status (1: rank 0 timed out waiting for
    the other shards, which stay safe on disk). ``log`` gets the progress lines."""
    from moee import shard

    if settings.merge is not None:
        if Path(settings.out).suffix == ".npy":
            check_output_file(settings.out, overwrite=settings.overwrite)
        else:  # a folder of Parquet files (row, text, embedding) with its sidecar
            check_output_folder(
                settings.out,
                overwrite=settings.overwrite,
                inputs={"--merge": settings.merge},
                output=PARQUET_OUTPUT,
            )
        out = shard.merge_shards(settings.merge, settings.out, overwrite=settings.overwrite)
        log(f"merged {settings.merge} into {out}")
        return 0
    record = settings.record()
    if settings.engine == "ray":
        return _embed_with_ray(settings, log)
    read_texts(settings.input, field=settings.field)  # checks the path and field at once

    if not settings.sharded:
        check_output_file(settings.out, overwrite=settings.overwrite, inputs={"INPUT": settings.input})
        with output_lock(settings.out, "--out"):  # held until the pair is committed: one run per output
            return _embed_one_file(settings, record, log)

    info = shard.shard_info(settings.shard_rank, settings.num_shards)
    out_dir = Path(settings.out)
    check_output_dir(out_dir)
    run = shard.ShardRun(settings.input, out_dir, info, record, field=settings.field)
    if shard.prepare_shard_dir(out_dir, settings.input, info, record, field=settings.field):
        log(f"{info.name} is already complete in {out_dir}; skipping it")
    else:
        total = count_texts(settings.input, settings.field, info)
        load = settings.load
        device = load.device or (None if load.device_map else shard.default_device(info))
        embedder = _load(settings, device=device)
        check_config_fits_model(embedder, settings.config)
        encoder = _CountingEncoder(embedder, settings.config, settings.batch_size)
        facts = run_facts(embedder, settings.batch_size)
        written = shard.embed_shard(
            encoder,
            run,
            chunk_size=settings.chunk_size,
            metadata=lambda: {**facts, "truncated_texts": encoder.truncated},
            progress=settings.progress,
            total_rows=total,
        )
        encoder.report(int(read_metadata(written)["rows"]["count"]), log)
        log(f"wrote {written}")
    if info.rank == 0 and settings.auto_merge:
        try:
            shard.wait_for_shards(out_dir, info.world, timeout=settings.merge_timeout)
        except TimeoutError as exc:  # this shard is safe on disk; say how to finish
            log(f"error: {exc}")
            return 1
        out = shard.merge_shards(out_dir)
        log(f"merged {info.world} shard(s) into {out}")
    return 0


def _embed_with_ray(settings: EmbedSettings, log: Log) -> int:
    """``engine="ray"`` (``moee.integrations.ray.embed_files``): the configuration resolved here is
    passed to the actors in full, so they embed exactly what the sidecar records."""
    try:
        from moee.integrations.ray import embed_files
    except ImportError as exc:
        raise ImportError(f"--engine ray needs Ray: pip install 'moee[ray]' ({exc})") from None
    out = embed_files(settings)
    shape = tuple(read_parquet_sidecar(out)["shape"])
    log(f"wrote {out} {shape}")
    return 0


def _embed_one_file(settings: EmbedSettings, record: dict[str, Any], log: Log) -> int:
    from moee import shard

    total = count_texts(settings.input, settings.field)
    embedder = _load(settings)
    check_config_fits_model(embedder, settings.config)
    digest = TextsDigest()
    meta = {
        **record,
        **run_facts(embedder, settings.batch_size),
        "input": str(Path(settings.input).resolve()),
        "field": settings.field,
        **run_metadata(),
    }
    encoder = _CountingEncoder(embedder, settings.config, settings.batch_size)
    out = shard.embed_stream(
        encoder,
        digest.wrap(read_texts(settings.input, field=settings.field)),
        settings.out,
        lambda rows: {**meta, "texts_sha256": digest.hexdigest(), "truncated_texts": encoder.truncated},
        chunk_size=settings.chunk_size,
        progress=settings.progress,
        total=total,
        overwrite=settings.overwrite,
    )
    shape = tuple(read_metadata(out)["shape"])
    encoder.report(shape[0], log)
    log(f"wrote {out} {shape}")
    return 0
