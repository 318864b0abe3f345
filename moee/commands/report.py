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

Also: token specialization by input, ground-truth next and predicted next token (the LM head
applied to the same forward), router entropy and KL to uniform, cross-layer expert pairs, the
domain JSD, co-activation heatmaps and a token view (docs/SPECIALIZATION.md defines each).
``--checkpoints A B C`` adds router saturation: each checkpoint's top-1 / top-k overlap with the
final one's on the same tokens (paths, Hub ids or ``name@revision``; the report is of the final
checkpoint unless ``--model`` is given). ``--ablation DIR`` adds the causal expert importance of a ``moee ablate`` run of this model (its
``--out`` folder or ``importance.json``; the report cannot run the ablation's forward passes):
checked with the other inputs, and refused when it is an ablation of another model. Likewise
``--router-swap DIR`` (a ``moee ablate --swap-from`` result: ``swap.json``) adds the router swap beside
its permuted-router null, and ``--steering DIR [DIR ...]`` (``moee ablate --steer`` results:
``steering.json``, one case each) the steering effect beside its random-expert null.
``--compare MODEL_B`` builds B's report on the same
corpus into the same report.json (``compare``), with the differences and B's selection overlap.

Every input is checked before the first model is routed (the output folder, each model path or
Hub id, the corpus: read through once, and not only empty texts, the ablation, swap and steering files). A
non-empty ``--out`` needs ``--overwrite``, which replaces the report there and keeps a user's other
files; an ``--out`` that is, holds or lies inside an input is refused. Both files are written into
a hidden folder beside it and committed together, so a killed run never leaves a new report.json
beside an old report.html.
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
    from moee.cli_options import add_loading_arguments

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
    p.add_argument(
        "--checkpoints",
        nargs="+",
        default=None,
        metavar="CKPT",
        help="checkpoints of one model (paths, Hub ids or name@revision) for router saturation",
    )
    p.add_argument("--compare", default=None, metavar="MODEL_B", help="a second model or checkpoint")
    p.add_argument(
        "--overlap-tokens",
        type=int,
        default=65536,
        help="tokens (first texts) on which saturation / comparison overlaps are measured (default: 65536)",
    )
    p.add_argument(
        "--ablation",
        default=None,
        metavar="DIR_OR_JSON",
        help="a `moee ablate` result of this model (its --out folder or importance.json) for the "
        "causal expert-importance section",
    )
    p.add_argument(
        "--router-swap",
        default=None,
        metavar="DIR_OR_JSON",
        help="a `moee ablate --swap-from` result of this model (its --out folder or swap.json) for the "
        "router-swap section",
    )
    p.add_argument(
        "--steering",
        nargs="+",
        default=None,
        metavar="DIR_OR_JSON",
        help="`moee ablate --steer` results of this model (--out folders or steering.json), one case each, "
        "for the steering section",
    )
    p.add_argument("--token-view-texts", type=int, default=8, help="texts in the token view (default: 8)")
    p.add_argument(
        "--token-view-tokens", type=int, default=256, help="tokens in the token view in all (default: 256)"
    )
    p.add_argument("--out", required=True, help="output folder (report.json and report.html)")
    p.add_argument("--overwrite", action="store_true", help="replace the report already in --out")
    p.set_defaults(func=run)


def check_model_spec(flag: str, spec: str, *, hub: bool = True) -> None:
    """A model argument that cannot load is refused by flag before any model is routed: a missing
    or non-model local folder, or (``hub``) a Hub id (``name@revision``) whose config cannot be
    fetched (not cached offline). ``--model`` loads first, so its loader's own error comes first
    anyway and it is checked with ``hub=False``."""
    from moee.loading import check_model_source, split_revision

    name, revision = split_revision(spec)
    try:
        check_model_source(name)
    except OSError as exc:
        raise type(exc)(f"{flag} {spec}: {exc}") from None
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{flag} {spec}: {local} holds no config.json, it is not a model folder")
        return
    if not hub:
        return
    from transformers.utils import cached_file

    try:
        cached_file(name, "config.json", revision=revision)
    except OSError as exc:
        raise FileNotFoundError(f"{flag} {spec}: cannot find this model ({exc})") from None


def _inputs(args: argparse.Namespace) -> dict:
    """What the report reads, by flag: ``--out`` may be none of them, hold none, lie inside none."""
    return {
        "--model": args.model,
        "--corpus": args.corpus,
        "--checkpoints": args.checkpoints,
        "--compare": args.compare,
        "--ablation": args.ablation,
        "--router-swap": args.router_swap,
        "--steering": args.steering,
    }


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.specialization import (
        build_report,
        compare_section,
        load_embedder,
        read_corpus,
        routing_overlap,
        saturation_section,
        write_report,
    )
    from moee.analysis.specialization.report import check_corpus, check_report_folder
    from moee.analysis.specialization.sections.ablation import ablation_section, read_ablation
    from moee.analysis.specialization.sections.router_swap import read_swap, router_swap_section
    from moee.analysis.specialization.sections.steering import read_steering, steering_section
    from moee.embed.embedder import MoEEmbedder
    from moee.io import run_metadata
    from moee.loading import LoadOptions

    for name in ("max_texts", "overlap_tokens", "token_view_texts", "token_view_tokens"):
        value = getattr(args, name)
        if value is not None and value < (0 if name.startswith("token_view") else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.checkpoints is not None and len(args.checkpoints) < 2:
        raise ValueError("--checkpoints needs at least two checkpoints (the last one is the final)")
    options = LoadOptions.from_args(args)
    # every input before the first model loads: the output folder, each model, the corpus
    check_report_folder(args.out, overwrite=args.overwrite, inputs=_inputs(args))
    specs = [("--model", args.model)] if args.model is not None else []
    specs += [("--checkpoints", c) for c in args.checkpoints or []]
    specs += [("--compare", args.compare)] if args.compare is not None else []
    for flag, spec in specs:
        check_model_spec(flag, spec, hub=flag != "--model")
    total = check_corpus(
        args.corpus, text_field=args.field, domain_field=args.domain_field, max_texts=args.max_texts
    )
    # each `moee ablate` result: read and checked now, matched to the model once it loads
    causal = {}
    if args.ablation is not None:
        causal["ablation"] = (ablation_section, read_ablation(args.ablation))
    if args.router_swap is not None:
        causal["router_swap"] = (router_swap_section, read_swap(args.router_swap))
    if args.steering is not None:
        causal["steering"] = (steering_section, [read_steering(path) for path in args.steering])

    def corpus():
        return read_corpus(args.corpus, text_field=args.field, domain_field=args.domain_field)

    if args.model is None and args.checkpoints:
        embedder = None  # the final checkpoint's report, loaded once the order is known
    else:
        embedder = MoEEmbedder.from_pretrained(args.model, options)
    tokenizer = embedder.tokenizer if embedder is not None else None

    def load(spec):
        return load_embedder(spec, options, tokenizer=tokenizer)

    settings = dict(
        top_k=args.top_k,
        batch_size=args.batch_size,
        max_texts=args.max_texts,
        permutations=args.permutations,
        seed=args.seed,
        progress=True,
        total=total,
        token_view_texts=args.token_view_texts,
        token_view_tokens=args.token_view_tokens,
    )

    def limited():
        rows = corpus()
        if args.max_texts is None:
            return rows
        import itertools

        return itertools.islice(rows, args.max_texts)

    saturation = None
    if args.checkpoints:
        k = args.top_k
        if k is None:
            probe = embedder or load(args.checkpoints[-1])
            from moee.analysis.specialization.report import _resolve_top_k

            k = _resolve_top_k(probe, None)[0]
        saturation = saturation_section(
            args.checkpoints,
            limited(),
            top_k=k,
            load=load,
            max_tokens=args.overlap_tokens,
            batch_size=args.batch_size,
            progress=True,
            model_tokenizer=tokenizer,
            model_name=args.model,
        )
        if embedder is None:
            embedder = load(saturation["final"])
    parts = {}
    if causal:  # against the report's model before its texts are routed
        from moee.embed.reference import weights_digest

        results = [r for _, given in causal.values() for r in (given if isinstance(given, list) else [given])]
        recorded = any((r.get("meta") or {}).get("weights_digest") is not None for r in results)
        digest = weights_digest(embedder) if recorded else None
        for key, (section, given) in causal.items():
            parts[key] = section(
                given,
                model=args.model if args.model is not None or saturation is None else saturation["final"],
                n_layers=int(embedder.n_moe_layers),
                n_experts=int(embedder.n_experts),
                weights_digest=digest,
            )
    report = build_report(embedder, corpus(), **settings)
    if saturation is not None:
        report["saturation"] = saturation
    report.update(parts)
    report["meta"] = {
        **run_metadata(command_line(args)),
        "corpus": str(args.corpus),
        "domain_field": args.domain_field,
    }
    if saturation is not None:  # which checkpoint series the saturation section describes
        report["meta"]["saturation_source"] = {
            "final": saturation["final"],
            "same_tokenization_as_model": saturation["tokenization"]["same_as_model"],
        }
    if args.compare is not None:
        other = load(args.compare)
        report_b = build_report(other, corpus(), **settings)
        overlap = routing_overlap(
            embedder,
            [other],
            limited(),
            top_k=report["summary"]["top_k"],
            max_tokens=args.overlap_tokens,
            batch_size=args.batch_size,
            progress=True,
        )[0]
        report["compare"] = compare_section(
            report, report_b, overlap, [report["summary"]["model"], args.compare]
        )
    paths = write_report(report, args.out, overwrite=args.overwrite, progress=True, inputs=_inputs(args))
    s = report["summary"]
    print(
        f"{s['n_texts']} texts, {s['n_tokens']} tokens, k={s['top_k']} ({s['top_k_source']}): "
        f"mean CV(load) {s['mean_cv_load']:.3f}, worst max/mean load {s['max_over_mean_load']:.2f}"
    )
    if saturation is not None:
        print(
            "saturation (mean top-k overlap with the final checkpoint): "
            + ", ".join(
                f"{c['name']}: {v:.3f}" for c, v in zip(saturation["checkpoints"], saturation["mean_topk"])
            )
        )
    print(f"wrote {paths['html']} and {paths['json']}")
    return 0
