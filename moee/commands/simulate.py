"""`moee simulate`: the router-collapse simulator (``moee/analysis/simulator.py``).

Writes, for balancing off and/or on (and an optional blend weight), an animated GIF of the
cumulative-load histogram, the final histograms side by side, the max/mean curve and
``simulation.json`` (every run's loads and summary, constants, versions, command).
"""

from __future__ import annotations

import argparse

from moee.analysis.simulator import N_RANGE, SimulatorConfig

_DEFAULTS = SimulatorConfig()


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="router collapse simulator: cumulative-load frames with balancing off and on",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--n",
        type=int,
        default=_DEFAULTS.n,
        help=f"experts, {N_RANGE[0]}..{N_RANGE[1]} (default %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, default=_DEFAULTS.steps, help="batches of 40 tokens (default %(default)s)"
    )
    p.add_argument(
        "--balancing", choices=("off", "on", "both"), default="both", help="which runs (default %(default)s)"
    )
    p.add_argument(
        "--blend",
        type=float,
        default=None,
        metavar="W",
        help="also run with strength <- (1-W)*off_rule + W*on_rule, W in [0, 1]",
    )
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="RNG seed (default %(default)s)")
    p.add_argument(
        "--jitter", type=float, default=_DEFAULTS.jitter_std, help="score jitter std (default %(default)s)"
    )
    p.add_argument(
        "--frame-every", type=int, default=5, help="one GIF frame every N steps (default %(default)s)"
    )
    p.add_argument("--no-gif", action="store_true", help="write only the PNGs and the JSON")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.simulator import run_showcase

    blends = {"off": [0.0], "on": [1.0], "both": [0.0, 1.0]}[args.balancing]
    if args.blend is not None:
        if not 0.0 <= args.blend <= 1.0:
            raise ValueError(f"--blend must be in [0, 1], got {args.blend}")
        if args.blend not in blends:
            blends.append(float(args.blend))
    payload = run_showcase(
        args.out,
        blends=blends,
        frame_every=args.frame_every,
        gif=not args.no_gif,
        n=args.n,
        steps=args.steps,
        seed=args.seed,
        jitter_std=args.jitter,
        command=command_line(args),
    )
    for slug, run_ in payload["runs"].items():
        print(
            f"{slug:>10}: final max/mean cumulative load {run_['final_max_over_mean']:.2f} "
            f"({run_['n_red']} red, {run_['n_dim']} dim of {args.n})"
        )
    print(f"wrote {', '.join(payload['files'].values())} and simulation.json to {args.out}")
    return 0
