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

from moee.analysis.settings import ReportSettings

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="expert-specialization report (HTML + JSON) of an MoE model over a corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, ReportSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.specialization.run import run_report
    from moee.cli_options import settings_of

    settings = settings_of(ReportSettings, args)  # every flag checked here
    report, paths = run_report(settings, command=command_line(args))
    s = report["summary"]
    print(
        f"{s['n_texts']} texts, {s['n_tokens']} tokens, k={s['top_k']} ({s['top_k_source']}): "
        f"mean CV(load) {s['mean_cv_load']:.3f}, worst max/mean load {s['max_over_mean_load']:.2f}"
    )
    if settings.checkpoints:
        saturation = report["saturation"]
        print(
            "saturation (mean top-k overlap with the final checkpoint): "
            + ", ".join(
                f"{c['name']}: {v:.3f}" for c, v in zip(saturation["checkpoints"], saturation["mean_topk"])
            )
        )
    print(f"wrote {paths['html']} and {paths['json']}")
    return 0
