"""``moee quickstart``: the whole pipeline on the bundled default model, offline, in about 90 s on 2 cores.

1. loads the model and the mini variants of the offline suite (one task per family, ``--tasks
   mini``);
2. embeds every text of those tasks under two configurations: **the model's own** (its saved
   ``moee_embedding.json``, else the library defaults; the default model's: mean pooling, no prompt),
   resolved by the rule every command follows (``moee.embed.config.resolve_config``), and **the
   paper's** (MoEE sum, PromptEOL, last token, softmax RW). One forward pass per text and
   configuration serves every method; a sample of the texts is written as HS, RW, MoEE concat and
   MoEE sum embeddings (``embeddings/<method>.npy`` + JSON sidecars, which record the configuration);
3. scores the four methods under the model's configuration, the paper's configuration and the dense
   baseline all-MiniLM-L6-v2 with mteb (MoEE sum with the label-free alpha; every text is embedded
   once per model, the vectors of step 2 are reused) and prints the table;
4. writes the expert-specialization report of the sample (``moee.analysis.specialization``), with
   the task of each text as its domain;
5. prints where every output went and how long each step took.

The mini tasks are small (seeded subsets: a smoke test of the whole pipeline, not a benchmark):
the full suite is ``moee evaluate --tasks offline`` (``eval/run_offline.sh``).
"""

from __future__ import annotations

import argparse

from moee.evaluation.settings import QuickstartSettings

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quickstart",
        help="offline demo: embed, evaluate the model's and the paper's configuration beside the "
        "baseline, report (about 90 s on 2 CPU cores)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, QuickstartSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.evaluation.quickstart import run_quickstart

    result = run_quickstart(settings_of(QuickstartSettings, args))  # every flag checked here
    print()
    timing = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in result["steps"].items())
    print(f"quickstart finished in {result['seconds']:.0f}s ({timing}). Outputs:")
    for label, path in result["outputs"].items():
        print(f"  {label:32s} {path}")
    return 0
