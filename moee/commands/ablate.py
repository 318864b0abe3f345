"""`moee ablate`: causal tests of experts through routing hooks (`moee.analysis.expert_importance`).

By default, expert importance: for each expert of each MoE layer (or ``--layers`` / ``--experts``)
the change in next-token loss (nats/token) when it is disabled, overall and per ``--domain-field``,
beside the load-matched null (each token loses, with probability the expert's load, one of its k
selected experts drawn uniformly), the Spearman correlation of importance with load, and the
super experts (largest output |activation| at least ``--super-ratio`` times the median expert's)
with the loss effect of disabling them. ``--mode reselect`` (default) masks the expert's logit
before the router's top-k (the router chooses another); ``--mode zero`` zeroes its weight after
the selection (``--renormalize``: the token's other weights keep its total).

``--swap-from CKPT``: instead, the loss change per MoE layer (and for all layers) when that layer's
router comes from CKPT (same architecture), beside the null of the layer's own router with its
expert order permuted (``--null-draws`` seeded derangements: same loads, assignment gone) and the
share of that cost the donor's router avoids (``recovered``). ``--steer L:E=BIAS ...``: instead, the
change in the next-token distribution (mean KL, nats), in the embedding (cosine to the unsteered
one, the model's own embedding configuration) and in the experts' selection rates when those router
logits are biased, beside the same biases on ``--null-draws`` random sets of other experts of the
same layers. ``moee report --router-swap DIR`` / ``--steering DIR`` show them.

Writes into ``--out``: ``importance.json`` + ``experts.csv`` + ``README.md`` (a reading generated
from the JSON, with the command), or ``swap.json`` + ``swap.csv`` + ``README.md``, or
``steering.json`` + ``README.md``. The corpus is read
lazily up to ``--max-tokens`` tokens (chunks of ``--seq-len``); memory is one batch plus O(tokens).

Every flag is checked before the first forward pass: a repeated layer, expert or steered expert,
an ``--experts`` pair outside ``--layers``, a non-finite ``--steer`` bias, a layer or expert the
model lacks. A non-empty ``--out`` needs ``--overwrite``, which removes the previous run's files
(of any of the three analyses) and keeps a user's other files; an ``--out`` that is, holds or lies
inside ``--model``, ``--corpus`` or ``--swap-from`` is refused. The files are staged beside
``--out`` and committed when complete.
"""

from __future__ import annotations

import argparse

from moee.analysis.settings import AblateSettings

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="expert importance / router swap / steering effect: causal tests through routing hooks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, AblateSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.ablate import _fmt, run_ablation
    from moee.cli_options import settings_of

    settings = settings_of(AblateSettings, args)  # every flag checked here, before the model loads
    kind, result, target = run_ablation(settings, command=command_line(args))
    if kind == "swap":
        for row in result["swaps"]:
            print(
                f"router of layer {row['layer']} from donor: {row['delta']:+.4f} nats/token"
                + (f" (permuted-router null {row['null']:+.4f})" if "null" in row else "")
            )
    elif kind == "steering":
        null = result["null"]
        print(
            f"KL(next token) {result['kl_next_token']:.4f} nats; embedding cosine "
            f"{result['embedding_cosine']['mean']:.4f}"
            + (
                f"; random experts: KL {null['kl_next_token']['mean']:.4f}, "
                f"cosine {null['embedding_cosine_mean']['mean']:.4f}"
                if null
                else ""
            )
        )
    else:
        corr = result["spearman_importance_load"]["pooled"]
        print(
            f"{len(result['experts'])} experts; Spearman(importance, load) = {_fmt(corr, 3)}; wrote {target}"
        )
    return 0
