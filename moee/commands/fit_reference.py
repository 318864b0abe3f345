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
from pathlib import Path

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
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="output path; OUT.safetensors and OUT.json are written")
    where.add_argument(
        "--save-to-model",
        metavar="DIR",
        help="fit on the model folder DIR (the model, unless --model names the same folder) and make the "
        "statistics part of its configuration: DIR/reference.{safetensors,json}, and DIR/moee_embedding.json "
        "records the configuration fitted under (the model's own, changed by any flag given) with them",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing reference (else it is an error)"
    )
    p.add_argument("--field", default=None, help="JSON key / parquet column holding the text (default: text)")
    p.add_argument(
        "--max-texts", type=int, default=None, help="use only the first N texts of the corpus (deterministic)"
    )
    add_loading_arguments(p)
    add_embedding_arguments(p, exclude=NOT_FLAGS)
    p.add_argument("--batch-size", type=int, default=32)
    p.set_defaults(func=run)


#: The file stem of the statistics ``--save-to-model`` writes into a model folder.
MODEL_REFERENCE = "reference"


def _model_folder(args: argparse.Namespace) -> Path:
    """The folder ``--save-to-model`` names, checked to be a local model folder and the model fitted."""
    folder = Path(args.save_to_model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"moee fit-reference: --save-to-model {args.save_to_model} is not a local model folder "
            "(it has no config.json); save the model there first (MoEEmbedder.save_pretrained)"
        )
    if args.model is None:
        args.model = str(folder)
    elif Path(args.model).expanduser().resolve() != folder:
        raise SystemExit(
            f"moee fit-reference: --save-to-model {args.save_to_model} and --model {args.model} differ; "
            "the statistics belong to the model they are fitted on (leave --model out)"
        )
    return folder


def run(args: argparse.Namespace) -> int:
    from moee.embed.config import check_config_fits_model
    from moee.embed.reference import check_reference_size, reference_paths
    from moee.io import check_output_path, output_lock, read_texts

    batch_size = check_positive_int("--batch-size", args.batch_size)
    model_dir = _model_folder(args) if args.save_to_model is not None else None
    config = embedding_config(args, reference=None)
    max_texts = check_positive_int("--max-texts", args.max_texts) if args.max_texts is not None else None
    out = args.out if model_dir is None else model_dir / MODEL_REFERENCE
    tensors, sidecar = reference_paths(out)
    for path in (tensors, sidecar):
        check_output_path(path, overwrite=args.overwrite, what="--out", inputs={"--corpus": args.corpus})
    texts = list(read_texts(args.corpus, field=args.field))
    if max_texts is not None:
        texts = texts[:max_texts]
    check_reference_size(len(texts))
    with output_lock(tensors, "--out"):  # held until the pair is committed: one run per reference
        embedder = load_from_args(args)
        check_config_fits_model(embedder, config)
        path = embedder.fit_reference(texts, out, config=config, batch_size=batch_size)
    print(
        f"moee fit-reference: {len(texts)} texts -> {path} (+ {path.with_suffix('.json').name})",
        file=sys.stderr,
    )
    if model_dir is not None:
        from moee.embed.config import save_model_config

        saved = save_model_config(config.replace(reference=str(path)), model_dir)
        print(
            f"moee fit-reference: {saved} now standardises {config.label} with it "
            "(a flag that changes the pooling, prompt, score, recipe or HS layer leaves vectors unstandardised)",
            file=sys.stderr,
        )
    print(path)
    return 0
