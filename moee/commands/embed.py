"""`moee embed`: embed a text file (.txt / .jsonl / .parquet) into a .npy with a JSON sidecar.

Single process::

    moee embed corpus.txt --out corpus.npy --method moee_sum --prompt prompteol

Every configuration flag left out comes from the model's saved configuration (its folder's
``moee_embedding.json``; the default model's: mean pooling, no prompt), else the library default;
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

from moee.embed.settings import EmbedSettings

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "embed",
        help="embed a .txt/.jsonl/.parquet file into a .npy (+ JSON sidecar)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, EmbedSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.embed_corpus import run_embed

    return run_embed(settings_of(EmbedSettings, args))  # every flag checked here, before any work
