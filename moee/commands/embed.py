"""`moee embed`: embed a text file (.txt / .jsonl / .parquet) into a .npy with a JSON sidecar.

Single process::

    moee embed corpus.txt --out corpus.npy --method moee_sum --prompt prompteol

Every configuration flag left out comes from the model's saved configuration (its folder's
``moee_embedding.json``; the bundled model's: mean pooling, no prompt), else the library default;
the sidecar records the configuration used, and digests of what the rows depend on: the texts
(``texts_sha256``), the model's weights (``weights_digest``) and a reference's statistics
(``reference_sha256``), and of its own content (``sidecar_sha256``); `moee search` checks them.

Every input is checked before the model loads (read once, a sharded process its own share only, which also gives
the progress bar its total), the layer choice right after (against the model's layer counts);
an existing ``--out`` is refused without ``--overwrite``; one run at a time writes an output (a
second run to the same ``--out`` is refused at once), through a temporary name, and commits the
array and its sidecar as a pair.

Sharded over processes or GPUs (each process reads and embeds only its contiguous share of the
input: a byte range of a text file aligned to line starts, or Parquet row groups; see
``moee.shard``); rank 0 merges into ``DIR/embeddings.npy`` when all shards are done, and a
rerun after a crash resumes, skipping complete shards::

    accelerate launch --multi_gpu --num_processes 8 -m moee.cli embed corpus.jsonl --out DIR --sharded
    torchrun --nproc_per_node 2 -m moee.cli embed corpus.txt --out DIR --sharded      # CPU too
    moee embed corpus.txt --out DIR --sharded --shard-rank 3 --num-shards 16          # e.g. SLURM arrays
    moee embed --merge DIR --out corpus.npy
    moee embed --merge DIR --out corpus-parquet/        # Parquet files (row, text, embedding)

On a Ray cluster (the ``moee[ray]`` extra; ``moee.integrations.ray``), INPUT a file, folder or
glob, --out a folder of Parquet files with the sidecar ``_embeddings.json``::

    moee embed --engine ray "corpus/*.jsonl" --out emb/ --concurrency 8 --address auto

(`accelerate launch --multi_gpu` also starts N processes on a machine without GPUs; its
`--cpu` mode starts one process unless given an MPI hostfile, so use torchrun for CPU shards.)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from moee.cli_options import (
    add_embedding_arguments,
    add_loading_arguments,
    embedding_config,
    load_from_args,
    make_encoder,
)
from moee.corpus import run_facts
from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.validation import check_positive_int
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

DEFAULT_CHUNK = 4096


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "embed",
        help="embed a .txt/.jsonl/.parquet file into a .npy (+ JSON sidecar)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "input",
        nargs="?",
        help="texts: .txt (one per line; blank lines are kept as empty texts), .jsonl or .parquet (see --field)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output .npy (or, with --sharded, a directory; with --merge, the merged .npy)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out .npy (without it an existing output is an error)",
    )
    add_loading_arguments(p)
    add_embedding_arguments(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bar (by default a bar of texts done / total is shown on stderr when it is a terminal)",
    )
    p.add_argument("--field", default=None, help="JSON key / parquet column holding the text (default: text)")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK,
        help="texts read and embedded at a time (bounds memory; sorting by length happens within a chunk)",
    )
    engine = p.add_argument_group("Ray (--engine ray; the moee[ray] extra, docs/SCALING.md)")
    engine.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this process (or --sharded processes); ray: an actor pool on a Ray cluster, "
        "INPUT a file, folder or glob of .jsonl/.parquet/.txt, --out a folder of Parquet files",
    )
    engine.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    engine.add_argument("--concurrency", type=int, default=1, help="Ray actors (model copies)")
    engine.add_argument(
        "--num-gpus", type=float, default=None, help="GPUs per Ray actor (default: 1 if the cluster has GPUs)"
    )
    engine.add_argument(
        "--id-field", default=None, help="input column kept beside row and text in the Parquet output"
    )
    shard = p.add_argument_group("sharding (multi-process / multi-GPU)")
    shard.add_argument(
        "--sharded", action="store_true", help="write one shard per process into the --out directory"
    )
    shard.add_argument(
        "--shard-rank", type=int, default=None, help="this process' shard (default: $RANK or 0)"
    )
    shard.add_argument(
        "--num-shards", type=int, default=None, help="number of shards (default: $WORLD_SIZE or 1)"
    )
    shard.add_argument("--no-merge", dest="auto_merge", action="store_false", help="rank 0 does not merge")
    shard.add_argument(
        "--merge-timeout", type=float, default=3600.0, help="seconds rank 0 waits for the other shards"
    )
    shard.add_argument(
        "--merge", metavar="DIR", default=None, help="merge the shards of DIR into --out and exit"
    )
    p.set_defaults(func=run)


def embedding_settings(args: argparse.Namespace, config: EmbeddingConfig) -> dict[str, Any]:
    """Everything that changes the numbers; recorded in sidecars and shard manifests (``config``:
    the resolved configuration, :func:`moee.cli_options.embedding_config`)."""
    settings = {
        "model": args.model,
        **config.to_dict(),
        "model_dtype": args.dtype,  # the weights dtype; the array is always float32 (array_dtype)
        "load_in_4bit": args.load_in_4bit,
    }
    if config.reference is not None:  # its numbers, not its path: a re-fit is another run
        settings["reference_sha256"] = config.reference_digest()
    return settings


def _log(msg: str) -> None:
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

    def report(self, rows: int) -> None:
        if self.truncated:
            _log(
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


def run(args: argparse.Namespace) -> int:
    from moee import shard

    if args.merge is not None:
        if args.input is not None or args.sharded:
            raise ValueError("--merge DIR takes no INPUT and no --sharded; it only merges existing shards")
        if Path(args.out).suffix == ".npy":
            check_output_file(args.out, overwrite=args.overwrite)
        else:  # a folder of Parquet files (row, text, embedding) with its sidecar
            check_output_folder(
                args.out, overwrite=args.overwrite, inputs={"--merge": args.merge}, output=PARQUET_OUTPUT
            )
        out = shard.merge_shards(args.merge, args.out, overwrite=args.overwrite)
        _log(f"merged {args.merge} into {out}")
        return 0
    if args.input is None:
        raise ValueError("INPUT is required (or use --merge DIR)")
    batch_size = check_positive_int("--batch-size", args.batch_size)
    chunk_size = check_positive_int("--chunk-size", args.chunk_size)
    config = embedding_config(args)
    settings = embedding_settings(args, config)
    if args.engine == "ray":
        return _embed_with_ray(args, config, settings, batch_size)
    if args.id_field is not None or args.address is not None:
        raise ValueError("--id-field/--address need --engine ray")
    read_texts(args.input, field=args.field)  # checks the path and field at once

    if not args.sharded:
        if args.shard_rank is not None or args.num_shards is not None:
            raise ValueError("--shard-rank/--num-shards need --sharded")
        if Path(args.out).suffix != ".npy":
            raise ValueError(
                f"--out must be a .npy file (got {args.out}); use --sharded to write a directory"
            )
        check_output_file(args.out, overwrite=args.overwrite, inputs={"INPUT": args.input})
        with output_lock(args.out, "--out"):  # held until the pair is committed: one run per output
            return _embed_one_file(args, config, settings, batch_size, chunk_size)

    info = shard.shard_info(args.shard_rank, args.num_shards)
    out_dir = Path(args.out)
    if out_dir.suffix == ".npy":
        raise ValueError(f"with --sharded, --out is a directory, got {out_dir}")
    check_output_dir(out_dir)
    if shard.prepare_shard_dir(out_dir, args.input, info, settings, field=args.field):
        _log(f"{info.name} is already complete in {out_dir}; skipping it")
    else:
        total = count_texts(args.input, args.field, info)
        device = args.device or (None if args.device_map else shard.default_device(info))
        embedder = load_from_args(args, device=device)
        check_config_fits_model(embedder, config)
        encoder = _CountingEncoder(embedder, config, batch_size)
        facts = run_facts(embedder, batch_size)
        written = shard.embed_shard(
            encoder,
            args.input,
            out_dir,
            info,
            settings,
            field=args.field,
            chunk_size=chunk_size,
            metadata=lambda: {**facts, "truncated_texts": encoder.truncated},
            progress=args.progress,
            total_rows=total,
        )
        encoder.report(int(read_metadata(written)["rows"]["count"]))
        _log(f"wrote {written}")
    if info.rank == 0 and args.auto_merge:
        try:
            shard.wait_for_shards(out_dir, info.world, timeout=args.merge_timeout)
        except TimeoutError as exc:  # this shard is safe on disk; say how to finish
            _log(f"error: {exc}")
            return 1
        out = shard.merge_shards(out_dir)
        _log(f"merged {info.world} shard(s) into {out}")
    return 0


def _embed_with_ray(
    args: argparse.Namespace, config: EmbeddingConfig, settings: dict[str, Any], batch_size: int
) -> int:
    """``--engine ray`` (``moee.integrations.ray.embed_files``): the configuration resolved here is
    passed to the actors in full, so they embed exactly what the sidecar records."""
    from dataclasses import fields

    from moee.cli_options import load_options

    if args.sharded or args.shard_rank is not None or args.num_shards is not None:
        raise ValueError("--engine ray shards by itself; drop --sharded/--shard-rank/--num-shards")
    try:
        from moee.integrations.ray import embed_files
    except ImportError as exc:
        raise ImportError(f"--engine ray needs Ray: pip install 'moee[ray]' ({exc})") from None
    load = {f.name: getattr(load_options(args), f.name) for f in fields(load_options(args))}
    out = embed_files(
        args.input,
        args.out,
        model=args.model,
        config={f.name: getattr(config, f.name) for f in fields(config)},
        load=load,
        settings=settings,
        field=args.field,
        id_field=args.id_field,
        batch_size=batch_size,
        concurrency=check_positive_int("--concurrency", args.concurrency),
        num_gpus=args.num_gpus,
        address=args.address,
        overwrite=args.overwrite,
    )
    shape = tuple(read_parquet_sidecar(out)["shape"])
    _log(f"wrote {out} {shape}")
    return 0


def _embed_one_file(
    args: argparse.Namespace,
    config: EmbeddingConfig,
    settings: dict[str, Any],
    batch_size: int,
    chunk_size: int,
) -> int:
    from moee import shard

    total = count_texts(args.input, args.field)
    embedder = load_from_args(args)
    check_config_fits_model(embedder, config)
    digest = TextsDigest()
    meta = {
        **settings,
        **run_facts(embedder, batch_size),
        "input": str(Path(args.input).resolve()),
        "field": args.field,
        **run_metadata(),
    }
    encoder = _CountingEncoder(embedder, config, batch_size)
    out = shard.embed_stream(
        encoder,
        digest.wrap(read_texts(args.input, field=args.field)),
        args.out,
        lambda rows: {**meta, "texts_sha256": digest.hexdigest(), "truncated_texts": encoder.truncated},
        chunk_size=chunk_size,
        progress=args.progress,
        total=total,
        overwrite=args.overwrite,
    )
    shape = tuple(read_metadata(out)["shape"])
    encoder.report(shape[0])
    _log(f"wrote {out} {shape}")
    return 0
