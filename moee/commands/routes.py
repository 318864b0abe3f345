"""`moee routes`: per-token routing of a corpus to a Parquet file (`moee.analysis.routing_export`).

One row per token: ``text_id``, ``position``, ``token_id``, ``token``, and per MoE layer ``i`` the
router's selected experts (``layer{i}_experts``) and their scores (``layer{i}_weights``; with
``--dense`` also ``layer{i}_probs`` over all experts). Read it with ``pandas.read_parquet``.
"""

from __future__ import annotations

import argparse
from itertools import islice
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "routes",
        help="per-token routing (selected experts, weights, optionally dense) of a corpus to Parquet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.loading import add_loading_arguments

    add_loading_arguments(p)
    p.add_argument("--corpus", required=True, help=".txt (one text a line), .jsonl or .parquet file")
    p.add_argument("--field", default=None, help="text field of a .jsonl/.parquet corpus (default: text)")
    p.add_argument("--max-texts", type=int, default=None, help="use only the first N texts")
    p.add_argument("--dense", action="store_true", help="also the dense scores over all experts")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True, help="output .parquet file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis.routing_export import routing_table, write_routing_parquet
    from moee.cli_options import load_from_args
    from moee.io import check_output_path, read_texts

    out = check_output_path(args.out, overwrite=args.overwrite, inputs={"--corpus": args.corpus})
    if args.max_texts is not None and args.max_texts < 1:
        raise ValueError(f"--max-texts must be a positive integer, got {args.max_texts}")
    texts = list(islice(read_texts(args.corpus, field=args.field), args.max_texts))
    embedder = load_from_args(args)
    table = routing_table(embedder, texts, dense=args.dense, batch_size=args.batch_size)
    write_routing_parquet(table, Path(out))
    print(f"{table.num_rows} tokens of {len(texts)} texts -> {out}")
    return 0
