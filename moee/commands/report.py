"""`moee report`: expert-specialization report of an MoE model over a corpus.

Routes every token of the corpus through the model (streamed, memory bounded) and writes
``report.json`` and a self-contained ``report.html``: per-layer load balance (CV of importance and
load, max/mean load, routing entropy, load histograms), per-expert top tokens and contexts, domain
and vocabulary specialization, expert co-activation, first-choice repetition and layer-to-layer
agreement, each beside its permutation baseline (the statistic with the routes shuffled against
tokens, domains, positions or the other layer; ``--permutations`` draws, ``--seed``). The experts
counted are the router's own choice wherever the capture returns it (re-derived from its scores
otherwise; the report says which). k defaults to the model's top-k from its config
(``num_experts_per_tok`` or an equivalent; k = 1 with a warning when the config has none).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="expert-specialization report (HTML + JSON) of an MoE model over a corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.loading import add_loading_arguments

    add_loading_arguments(p)
    p.add_argument("--corpus", required=True, help=".txt (one text a line), .jsonl or .parquet file")
    p.add_argument("--field", default=None, help="text field of a .jsonl/.parquet corpus (default: text)")
    p.add_argument("--domain-field", default=None, help="field holding each text's domain label")
    p.add_argument("--top-k", type=int, default=None, help="experts counted per token (default: the model's)")
    p.add_argument("--max-texts", type=int, default=None, help="use only the first N texts")
    p.add_argument(
        "--permutations", type=int, default=10, help="permutation draws per baseline (default: 10)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the permutation baselines (default: 0)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.specialization import build_report, read_corpus, write_report
    from moee.embed.embedder import MoEEmbedder
    from moee.io import run_metadata
    from moee.loading import LoadOptions

    if args.max_texts is not None and args.max_texts < 1:
        raise ValueError(f"--max-texts must be >= 1, got {args.max_texts}")
    corpus = read_corpus(args.corpus, text_field=args.field, domain_field=args.domain_field)
    embedder = MoEEmbedder.from_pretrained(args.model, LoadOptions.from_args(args))
    total = None
    if Path(args.corpus).suffix.lower() in (".txt", ".jsonl", ".ndjson"):  # one text a line: cheap to count
        with open(args.corpus, "rb") as fh:
            total = sum(1 for _ in fh)
    report = build_report(
        embedder,
        corpus,
        top_k=args.top_k,
        batch_size=args.batch_size,
        max_texts=args.max_texts,
        permutations=args.permutations,
        seed=args.seed,
        progress=True,
        total=total,
    )
    report["meta"] = {
        **run_metadata(command_line(args)),
        "corpus": str(args.corpus),
        "domain_field": args.domain_field,
    }
    paths = write_report(report, args.out)
    s = report["summary"]
    print(
        f"{s['n_texts']} texts, {s['n_tokens']} tokens, k={s['top_k']} ({s['top_k_source']}): "
        f"mean CV(load) {s['mean_cv_load']:.3f}, worst max/mean load {s['max_over_mean_load']:.2f}"
    )
    print(f"wrote {paths['html']} and {paths['json']}")
    return 0
