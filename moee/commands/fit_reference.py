"""`moee fit-reference`: per-dimension mean and std of HS and RW on a reference corpus.

    moee fit-reference corpus.txt --out refs/bundled-prompteol --prompt prompteol
    moee embed queries.txt --out q.npy --prompt prompteol --reference refs/bundled-prompteol.safetensors

Writes ``OUT.safetensors`` (the statistics) and ``OUT.json`` (model weights hash, the feature
configuration, number of texts, moee version); ``--reference`` of `embed` / `evaluate` then z-scores
every text with these fixed statistics instead of batch statistics (``moee.embed.reference``). The
configuration flags are `embed`'s: the reference only fits that model under those features
(pooling, prompt, score, recipe, layers); another one is refused when it is used. A flag left out
comes from the model's saved configuration, else the library default, as for `moee embed`.
"""

from __future__ import annotations

import argparse
import sys

from moee.cli_options import add_embedding_arguments, add_loading_arguments, embedding_config, load_from_args
from moee.embed.validation import check_positive_int

#: Configuration fields without a flag here: they do not change the features a reference fits.
NOT_FLAGS = {
    "method": "the statistics are of HS and RW, before any method combines them",
    "alpha": "the statistics are of HS and RW, before any method combines them",
    "normalize": "the statistics are of HS and RW, before any method combines them",
    "reference": "fit-reference writes a reference (--out)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit-reference",
        help="fit per-dimension HS/RW statistics on a corpus (for --reference)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("corpus", help="texts: .txt (one per line), .jsonl or .parquet (see --field)")
    p.add_argument("--out", required=True, help="output path; OUT.safetensors and OUT.json are written")
    p.add_argument("--field", default=None, help="JSON key / parquet column holding the text (default: text)")
    p.add_argument(
        "--max-texts", type=int, default=None, help="use only the first N texts of the corpus (deterministic)"
    )
    add_loading_arguments(p)
    add_embedding_arguments(p, exclude=NOT_FLAGS)
    p.add_argument("--batch-size", type=int, default=32)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.io import read_texts

    batch_size = check_positive_int("--batch-size", args.batch_size)
    config = embedding_config(args, reference=None)
    texts = list(read_texts(args.corpus, field=args.field))
    if args.max_texts is not None:
        texts = texts[: check_positive_int("--max-texts", args.max_texts)]
    embedder = load_from_args(args)
    path = embedder.fit_reference(texts, args.out, config=config, batch_size=batch_size)
    print(
        f"moee fit-reference: {len(texts)} texts -> {path} (+ {path.with_suffix('.json').name})",
        file=sys.stderr,
    )
    print(path)
    return 0
