"""`moee train --config FILE [--resume | --overwrite]`: train the from-scratch MoE language model.

The config format is documented in `moee.moe.trainer` (and moee/moe/README_TRAINING.md);
`model.router_type` picks any gate of `moee.moe.gate_registry.GATES`.
Exit status: 0 done, 2 bad input (a config, checkpoint or log problem, a non-empty run
directory without --overwrite, a config change --resume refuses), 3 a NaN/inf loss, gradient
or weight (nothing non-finite was applied or saved; the message names the last good checkpoint).
"""

from __future__ import annotations

import argparse
import sys
import warnings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the from-scratch MoE language model from a JSON config",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--config", required=True, help="training config (JSON; see moee/moe/README_TRAINING.md)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in checkpoint.dir"
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in a checkpoint.dir that holds an earlier run, deleting its checkpoints and log",
    )
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="checkpoint and stop after this step (schedule unchanged)",
    )
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.moe.gate_registry import CausalLeakWarning
    from moee.moe.trainer import NonFiniteTrainingError, RunDirectoryNotEmptyError, TrainerWarning, train

    def show(message: Warning | str, category: type[Warning], *_args, **_kwargs) -> None:
        print(f"moee train: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", TrainerWarning)
            warnings.simplefilter("always", CausalLeakWarning)  # e.g. router_type "expert_choice"
            warnings.showwarning = show
            result = train(
                args.config,
                resume=args.resume,
                overwrite=args.overwrite,
                stop_at_step=args.stop_at_step,
                progress=not args.no_progress,
            )
    except RunDirectoryNotEmptyError as exc:
        print(f"moee train: error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteTrainingError as exc:
        print(f"moee train: error: {exc}", file=sys.stderr)
        return 3
    where = f", checkpoint {result.checkpoint}" if result.checkpoint else ""
    print(f"stopped at step {result.step}{where}")
    if result.last_eval:
        print(f"held-out loss {result.last_eval['loss']:.4f}, perplexity {result.last_eval['ppl']:.2f}")
    return 0
