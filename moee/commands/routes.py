"""`moee routes`: per-token routing of a corpus to a Parquet file (`moee.analysis.routing_export`).

One row per token: ``text_id``, ``position``, ``token_id``, ``token``, and per MoE layer ``i`` the
router's selected experts (``layer{i}_experts``) and their scores (``layer{i}_weights``; with
``--dense`` also ``layer{i}_probs`` over all experts). Read it with ``pandas.read_parquet``, or
checked with ``moee.analysis.routing_export.read_routing_parquet``.

``--prompt`` and ``--score`` left out come from the model's saved configuration (its folder's
``moee_embedding.json``), else the library default: the rule of ``moee embed``, ``trace``,
``iter_token_routes`` and ``POST /v1/routing``. The Parquet footer (``moee.routes``) and the sealed
sidecar ``OUT.json`` record that configuration, the model, its weights digest and the command;
the sidecar also the texts' digest, the row count and the file's SHA-256.

The corpus is streamed a batch of texts at a time and written a row group at a time, so memory
does not grow with the corpus; the file is committed with its sidecar only when complete.
"""

from __future__ import annotations

import argparse
from itertools import islice

#: Configuration fields without a flag here: token routes are per token, before any pooling or
#: combination, under one prompt.
NOT_FLAGS = {
    "method": "token routes come before any method combines HS and RW",
    "pooling": "token routes are per token, not pooled",
    "alpha": "token routes come before any method combines HS and RW",
    "normalize": "token routes are not pooled vectors",
    "recipe": "token routes run the plain forward",
    "hs_layer": "token routes hold no hidden states",
    "rw_layers": "every MoE layer's routes are written",
    "reference": "token routes are not standardised",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "routes",
        help="per-token routing (selected experts, weights, optionally dense) of a corpus to Parquet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_embedding_arguments, add_loading_arguments

    add_loading_arguments(p)
    add_embedding_arguments(p, exclude=NOT_FLAGS, paper=False)
    p.add_argument("--corpus", required=True, help=".txt (one text a line), .jsonl or .parquet file")
    p.add_argument("--field", default=None, help="text field of a .jsonl/.parquet corpus (default: text)")
    p.add_argument("--max-texts", type=int, default=None, help="use only the first N texts")
    p.add_argument("--dense", action="store_true", help="also the dense scores over all experts")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True, help="output .parquet file (its sidecar: OUT.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.routing_export import iter_routing_batches, write_routing_parquet
    from moee.cli_options import embedding_config, load_from_args
    from moee.embed.validation import check_positive_int
    from moee.io import TextsDigest, check_output_path, read_texts, run_metadata

    out = check_output_path(args.out, overwrite=args.overwrite, inputs={"--corpus": args.corpus})
    if args.max_texts is not None and args.max_texts < 1:
        raise ValueError(f"--max-texts must be a positive integer, got {args.max_texts}")
    batch_size = check_positive_int("--batch-size", args.batch_size)
    config = embedding_config(args)  # the flags given, else the model's configuration, else the default
    if config.is_ensemble:
        raise ValueError(
            f"moee routes runs one prompt; the configuration's prompt is the ensemble {config.prompt_label!r}: "
            "give one --prompt"
        )
    sum(1 for _ in islice(read_texts(args.corpus, field=args.field), args.max_texts))  # a bad row: now
    embedder = load_from_args(args)
    settings = {
        **run_metadata(command_line(args)),
        "model": args.model,
        "model_name_or_path": str(embedder.name_or_path),
        "weights_digest": embedder.weights_digest,
        "config": {"prompt": config.to_dict()["prompt"], "score": config.score},
        "dense": args.dense,
        "max_length": embedder.max_length,
        "corpus": str(args.corpus),
        "field": args.field,
    }
    digest = TextsDigest()
    texts = digest.wrap(islice(read_texts(args.corpus, field=args.field), args.max_texts))
    batches = iter_routing_batches(
        embedder, texts, dense=args.dense, prompt=config.prompt, score=config.score, batch_size=batch_size
    )
    write_routing_parquet(batches, out, metadata=settings, overwrite=args.overwrite, texts=digest)
    print(f"{digest.count} texts (prompt {config.prompt_label}, score {config.score}) -> {out}")
    return 0
