"""`moee fit-reference`: per-dimension mean and std of HS and RW on a reference corpus.

    moee fit-reference corpus.txt --out refs/bundled-prompteol --prompt prompteol
    moee embed queries.txt --out q.npy --prompt prompteol --reference refs/bundled-prompteol.safetensors
    moee fit-reference corpus.jsonl --save-to-model my-model/   # the model's own statistics, used by default

Writes ``OUT.safetensors`` (the statistics) and ``OUT.json`` (model weights hash, the feature
configuration, number of texts, moee version); ``--reference`` of `embed` / `evaluate` then z-scores
every text with these fixed statistics instead of batch statistics (``moee.embed.reference``). The
configuration flags are `embed`'s: the reference only fits that model under those features
(pooling, prompt, score, recipe, layers); another one is refused when it is used. A flag left out
comes from the model's saved configuration, else the library default, as for `moee embed`.

Every input is checked before the model loads (the corpus read, at least two texts, ``--out``
writable and, without ``--overwrite``, not an existing reference), the layer choice right after;
the pair is written under temporary names and committed together while this run holds the
output's lock. Embeddings made with a reference record its digest (``reference_sha256``), so a
re-fit under the same path is refused by `moee search` instead of silently mixing statistics.
"""

from __future__ import annotations

import argparse
import sys

from moee.embed.settings import FIT_REFERENCE_NOT_FLAGS as NOT_FLAGS
from moee.embed.settings import MODEL_REFERENCE, FitReferenceSettings

__all__ = ["MODEL_REFERENCE", "NOT_FLAGS", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit-reference",
        help="fit per-dimension HS/RW statistics on a corpus (for --reference)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, FitReferenceSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.corpus import run_fit_reference

    settings = settings_of(FitReferenceSettings, args)  # every flag checked here, before any work
    fitted = run_fit_reference(settings)
    path = fitted.path
    print(
        f"moee fit-reference: {fitted.n_texts} texts -> {path} (+ {path.with_suffix('.json').name})",
        file=sys.stderr,
    )
    if fitted.model_config is not None:
        print(
            f"moee fit-reference: {fitted.model_config} now standardises {settings.config.label} with it "
            "(a flag that changes the pooling, prompt, score, recipe or HS layer leaves vectors unstandardised)",
            file=sys.stderr,
        )
    print(path)
    return 0
