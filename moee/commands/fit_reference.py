"""`moee fit-reference`: per-dimension mean and std of HS and RW on a reference corpus.

    moee fit-reference corpus.txt --out refs/bundled-prompteol --prompt prompteol
    moee embed queries.txt --out q.npy --prompt prompteol --reference refs/bundled-prompteol.safetensors

Writes ``OUT.safetensors`` (the statistics) and ``OUT.json`` (model weights hash, the feature
configuration, number of texts, moee version); ``--reference`` of `embed` / `evaluate` then z-scores
every text with these fixed statistics instead of batch statistics (``moee.embed.reference``). The
configuration flags are `embed`'s: the reference only fits that model under those features
(pooling, prompt, score, recipe, layers); another one is refused when it is used.
"""

from __future__ import annotations

import argparse
import sys

from moee.commands.embed import RECIPE_FLAGS, _given, _prompt_arg, add_recipe_arguments, load_from_args
from moee.embed.methods import POOLINGS, SCORES
from moee.embed.validation import check_positive_int
from moee.loading import add_loading_arguments


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
    p.add_argument("--pooling", choices=POOLINGS, default=None, help="token pooling (default: last)")
    p.add_argument("--score", choices=SCORES, default=None, help="routing scores (default: native)")
    p.add_argument(
        "--prompt",
        type=_prompt_arg,
        default=argparse.SUPPRESS,
        help="as for `moee embed` (a comma list is an ensemble; its prompts share one set of statistics)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    add_recipe_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.embed.config import EmbeddingConfig
    from moee.embed.embedder import default_config
    from moee.io import read_texts

    batch_size = check_positive_int("--batch-size", args.batch_size)
    if _given(args, ("reference",)):
        raise ValueError("--reference makes no sense here: fit-reference writes one (--out)")
    base = EmbeddingConfig.paper() if args.paper else default_config(args.model)
    config = base.replace(**_given(args, ("pooling", "prompt", "score", *RECIPE_FLAGS)))
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
