"""`moee train --config FILE [--resume | --overwrite]`: train the from-scratch MoE language model.

The flags are the fields of `moee.train_settings.TrainSettings`; the config file is read and
checked into a `moee.train_settings.TrainingConfig` (format: moee/moe/README_TRAINING.md);
`model.router_type` picks any gate of `moee.moe.gate_registry.GATES`.
Exit status: 0 done, 2 bad input (a config, checkpoint or log problem, a non-empty run
directory without --overwrite, a config change --resume refuses), 3 a NaN/inf loss, gradient
or weight (nothing non-finite was applied or saved; the message names the last good checkpoint).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from moee.train_settings import TrainSettings

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the from-scratch MoE language model from a JSON config",
        description=__doc__.splitlines()[0],
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, TrainSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.moe.gate_registry import CausalLeakWarning
    from moee.moe.trainer import NonFiniteTrainingError, RunDirectoryNotEmptyError, TrainerWarning, train

    settings = settings_of(TrainSettings, args)  # the flags and the config file checked here

    def show(message: Warning | str, category: type[Warning], *_args, **_kwargs) -> None:
        print(f"moee train: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", TrainerWarning)
            warnings.simplefilter("always", CausalLeakWarning)  # e.g. router_type "expert_choice"
            warnings.showwarning = show
            result = train(
                settings.training,
                resume=settings.resume,
                overwrite=settings.overwrite,
                stop_at_step=settings.stop_at_step,
                progress=settings.progress,
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
