"""`moee simulate`: the router-collapse simulator (``moee/analysis/simulator.py``).

Writes, for balancing off and/or on (and an optional blend weight), an animated GIF of the
cumulative-load histogram, the final histograms side by side, the max/mean curve and
``simulation.json`` (every run's loads and summary, constants, versions, command).
"""

from __future__ import annotations

import argparse

from moee.analysis.simulator import SimulateSettings

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="router collapse simulator: cumulative-load frames with balancing off and on",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, SimulateSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.simulator import run_simulation
    from moee.cli_options import settings_of

    settings = settings_of(SimulateSettings, args)  # every flag checked here
    payload = run_simulation(settings, command=command_line(args))
    for slug, run_ in payload["runs"].items():
        print(
            f"{slug:>10}: final max/mean cumulative load {run_['final_max_over_mean']:.2f} "
            f"({run_['n_red']} red, {run_['n_dim']} dim of {settings.n})"
        )
    print(f"wrote {', '.join(payload['files'].values())} and simulation.json to {settings.out}")
    return 0
