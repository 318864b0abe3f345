"""Router-collapse simulator: how much balancing pull it takes to stop the collapse, and how fast
it collapses for each n (larger n collapses faster; small n needs less pull).

    python analysis/run_simulator_sweep.py [--out analysis/simulator]

Blend weight w from 0 (balancing off) to 1 (on) for n in {4, 8, 12, 16}, 10 seeds each, 200 steps,
the documented defaults otherwise; writes blend_sweep.json and blend_sweep.png. Also the first step
from which the cumulative max/mean stays above the red 2.2x line with balancing off, per n and seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from moee.analysis.simulator import RED_ABOVE, SimulatorConfig, blend_sweep, plot_blend_sweep, simulate
from moee.io import run_metadata, write_json_atomic

BLENDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 0.9, 1.0)
NS = (4, 8, 12, 16)
SEEDS = tuple(range(10))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="analysis/simulator")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep = blend_sweep(BLENDS, ns=NS, seeds=SEEDS)
    first_red = {}
    for n in NS:
        steps = []
        for s in SEEDS:
            curve = simulate(SimulatorConfig(n=n, seed=s)).max_over_mean
            below = np.flatnonzero(curve <= RED_ABOVE)  # stays above the line after the last dip
            last_below = int(below[-1]) + 1 if below.size else 0
            steps.append(last_below + 1 if last_below < len(curve) else None)
        first_red[str(n)] = steps
    sweep["step_from_which_max_over_mean_stays_above_red_line_balancing_off"] = first_red
    write_json_atomic(out / "blend_sweep.json", {"meta": run_metadata(["python", *sys.argv]), **sweep})
    plot_blend_sweep(sweep, out / "blend_sweep.png")
    print("median final max/mean (rows n, columns w):")
    print("n   " + " ".join(f"{w:>5g}" for w in BLENDS))
    for n, med in zip(NS, sweep["median"]):
        print(f"{n:<3} " + " ".join(f"{v:5.2f}" for v in med))
    print("step from which max/mean stays > 2.2x (balancing off):", first_red)
    return 0


if __name__ == "__main__":
    sys.exit(main())
