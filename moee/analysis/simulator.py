"""A router-collapse simulator: the rich-get-richer dynamics of Shazeer et al. (2017, Section 4) in miniature.

Each step routes a fresh batch of ``TOKENS_PER_STEP = 40`` synthetic tokens through ``n`` experts
that carry a scalar *strength* (all start at 1.0, the neutral value the balancing rule pulls to):

* token affinity: every token gets a topic placed uniformly at random on a ring of experts; an
  expert's affinity falls off with its ring distance ``d`` to the topic as a Gaussian bell
  ``exp(-d^2 / (2 * ring_width^2))`` (distance in expert slots), plus Gaussian jitter
  ``N(0, jitter_std^2)``;
* boost: ``score += log(strength) * 1.1`` (``BOOST``);
* selection: top-1, the argmax of the score; an expert's *load* is the number of tokens whose
  argmax it is, and ``mean`` is that step's mean load, ``40 / n``;
* balancing off: ``strength <- strength * (1 + 0.18 * (load / mean - 1))``, clamped to ``floor``;
* balancing on: the whole update is replaced by ``strength <- strength * 0.5 + 0.5``;
* blend ``w`` in [0, 1] (interpolating the two rules, as the loss weights do): ``strength <- (1 - w) * off_rule +
  w * on_rule``, then clamped; ``w = 0`` is exactly "off", ``w = 1`` exactly "on";
* colours of the cumulative-load histogram: red above ``2.2 x`` mean, dim below ``0.4 x`` mean,
  teal otherwise; a dashed line marks the mean cumulative load.

Free choices, fixed here (and in ``SimulatorConfig`` defaults): n = 8 (inside the
supported 4..16 range; it collapses within ~100 steps yet leaves room to see it happen), top-1
argmax selection, jitter std 0.15, Gaussian ring falloff of width 1 expert slot, floor 0.05
(``log(0.05) * 1.1 = -3.3``, far below any affinity, so a floored expert is starved without the
strength ever hitting zero), 200 steps, seed 0. The boost term is applied in every mode: it only
matters for "off", but with balancing on strength stays exactly 1 (``1 * 0.5 + 0.5``), so
``log(1) = 0`` and the term vanishes by itself, and applying it always keeps the blend a true
interpolation. A ceiling of 1e300 only keeps the strength a finite float in very long runs (a
strength that large already out-scores any affinity by hundreds, so the dynamics are unchanged).

Everything is a pure function of the config (``numpy.random.default_rng(seed)``), so the same seed
always gives the same run. ``moee simulate`` runs :func:`run_simulation` with the frozen
:class:`SimulateSettings`, whose fields carry its flags (``moee.cli_options``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moee.analysis.settings import _check_ints, flag_of

__all__ = [
    "TOKENS_PER_STEP",
    "BOOST",
    "GROWTH",
    "RED_ABOVE",
    "DIM_BELOW",
    "N_RANGE",
    "SimulatorConfig",
    "SimulationResult",
    "SimulateSettings",
    "simulate",
    "bar_colours",
    "render_gif",
    "plot_final",
    "plot_max_over_mean",
    "run_showcase",
    "run_simulation",
    "blend_sweep",
    "plot_blend_sweep",
]

TOKENS_PER_STEP = 40
BOOST = 1.1
GROWTH = 0.18
RED_ABOVE = 2.2
DIM_BELOW = 0.4
N_RANGE = (4, 16)
_CEILING = 1e300

TEAL = "#1f9e89"
RED = "#d62728"
DIM = "#c8c8c8"


@dataclass(frozen=True)
class SimulatorConfig:
    """One simulator run; defaults are the documented choices (module docstring)."""

    n: int = 8
    steps: int = 200
    blend: float = 0.0
    seed: int = 0
    jitter_std: float = 0.15
    ring_width: float = 1.0
    floor: float = 0.05

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise TypeError(f"n must be an int, got {type(self.n).__name__}")
        if not N_RANGE[0] <= self.n <= N_RANGE[1]:
            raise ValueError(f"n must be in [{N_RANGE[0]}, {N_RANGE[1]}] (the supported range), got {self.n}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not 0.0 <= float(self.blend) <= 1.0:
            raise ValueError(f"blend must be in [0, 1] (0 = balancing off, 1 = on), got {self.blend}")
        if self.jitter_std < 0:
            raise ValueError(f"jitter_std must be >= 0, got {self.jitter_std}")
        if self.ring_width <= 0:
            raise ValueError(f"ring_width must be > 0, got {self.ring_width}")
        if not 0.0 < self.floor < 1.0:
            raise ValueError(f"floor must be in (0, 1), got {self.floor}")


@dataclass
class SimulationResult:
    """Per-step state of a run: ``loads`` and ``strengths`` are ``[steps, n]`` (after each step)."""

    config: SimulatorConfig
    loads: np.ndarray
    strengths: np.ndarray

    @property
    def cumulative(self) -> np.ndarray:
        """Running total of tokens per expert, ``[steps, n]``: what the histogram shows."""
        return np.cumsum(self.loads, axis=0)

    @property
    def max_over_mean(self) -> np.ndarray:
        """``max / mean`` of the cumulative load after each step, ``[steps]``."""
        cum = self.cumulative
        return cum.max(axis=1) / cum.mean(axis=1)

    def summary(self) -> dict:
        cum = self.cumulative[-1]
        mean = cum.mean()
        return {
            "config": asdict(self.config),
            "final_cumulative_load": cum.astype(int).tolist(),
            "final_max_over_mean": float(cum.max() / mean),
            "final_cv": float(cum.std() / mean),
            "n_red": int((cum > RED_ABOVE * mean).sum()),
            "n_dim": int((cum < DIM_BELOW * mean).sum()),
            "final_strength": [float(s) for s in self.strengths[-1]],
            "max_over_mean_by_step": [round(float(v), 4) for v in self.max_over_mean],
        }


def _ring_affinity(topics: np.ndarray, n: int, width: float) -> np.ndarray:
    """Gaussian bell of ring distance between each token's topic ``[T]`` and each expert: ``[T, n]``."""
    diff = np.abs(topics[:, None] - np.arange(n)[None, :])
    dist = np.minimum(diff, n - diff)
    return np.exp(-(dist**2) / (2.0 * width**2))


def simulate(config: SimulatorConfig | None = None, **overrides) -> SimulationResult:
    """Run the showcase dynamics; ``simulate(n=16, blend=1.0)`` is shorthand for a config."""
    if config is None:
        config = SimulatorConfig(**overrides)
    elif overrides:
        config = SimulatorConfig(**{**asdict(config), **overrides})
    rng = np.random.default_rng(config.seed)
    n, w = config.n, float(config.blend)
    strength = np.ones(n)
    mean_load = TOKENS_PER_STEP / n
    loads = np.zeros((config.steps, n), dtype=np.int64)
    strengths = np.zeros((config.steps, n))
    for step in range(config.steps):
        topics = rng.uniform(0.0, n, size=TOKENS_PER_STEP)
        scores = _ring_affinity(topics, n, config.ring_width)
        scores = scores + rng.normal(0.0, config.jitter_std, size=scores.shape)
        scores = scores + BOOST * np.log(strength)[None, :]
        load = np.bincount(scores.argmax(axis=1), minlength=n)
        off_rule = strength * (1.0 + GROWTH * (load / mean_load - 1.0))
        on_rule = strength * 0.5 + 0.5
        strength = np.clip((1.0 - w) * off_rule + w * on_rule, config.floor, _CEILING)
        loads[step] = load
        strengths[step] = strength
    return SimulationResult(config=config, loads=loads, strengths=strengths)


def bar_colours(cumulative: np.ndarray) -> list[str]:
    """Colour code for one histogram: red > 2.2x mean, dim < 0.4x mean, teal otherwise."""
    mean = float(np.mean(cumulative))
    out = []
    for value in cumulative:
        if mean > 0 and value > RED_ABOVE * mean:
            out.append(RED)
        elif mean > 0 and value < DIM_BELOW * mean:
            out.append(DIM)
        else:
            out.append(TEAL)
    return out


def _label(result: SimulationResult) -> str:
    w = result.config.blend
    mode = "balancing off" if w == 0 else "balancing on" if w == 1 else f"blend w={w:g}"
    return f"{mode}, n={result.config.n}, seed={result.config.seed}"


def _draw_histogram(ax, result: SimulationResult, step: int, ymax: float) -> None:
    cum = result.cumulative[step]
    mean = cum.mean()
    ax.clear()
    ax.bar(np.arange(result.config.n), cum, color=bar_colours(cum), edgecolor="#333333", linewidth=0.4)
    ax.axhline(mean, linestyle="--", color="#333333", linewidth=1.0)
    ax.set_ylim(0, ymax)
    ax.set_xticks(np.arange(result.config.n))
    ax.set_xlabel("expert")
    ax.set_ylabel("cumulative load (tokens)")
    ax.set_title(f"{_label(result)}\nstep {step + 1}: max/mean = {cum.max() / mean:.2f}", fontsize=9)


def render_gif(result: SimulationResult, path: str | Path, *, frame_every: int = 5, fps: int = 12) -> Path:
    """Write the cumulative-load histogram as an animated GIF (one frame every ``frame_every`` steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter

    if frame_every < 1:
        raise ValueError(f"frame_every must be >= 1, got {frame_every}")
    steps = list(range(frame_every - 1, result.config.steps, frame_every))
    if not steps or steps[-1] != result.config.steps - 1:
        steps.append(result.config.steps - 1)
    ymax = float(result.cumulative[-1].max()) * 1.08
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=80)
    fig.subplots_adjust(top=0.82, bottom=0.15)
    anim = FuncAnimation(fig, lambda i: _draw_histogram(ax, result, steps[i], ymax), frames=len(steps))
    path = Path(path)
    anim.save(path, writer=PillowWriter(fps=fps))
    plt.close(fig)
    return path


def plot_final(results: list[SimulationResult], path: str | Path) -> Path:
    """Final cumulative-load histograms of several runs side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), dpi=100, squeeze=False)
    for ax, result in zip(axes[0], results):
        _draw_histogram(ax, result, result.config.steps - 1, float(result.cumulative[-1].max()) * 1.08)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_max_over_mean(results: list[SimulationResult], path: str | Path) -> Path:
    """max/mean cumulative load against step, with the 2.2x red line (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for result in results:
        ax.plot(np.arange(1, result.config.steps + 1), result.max_over_mean, label=_label(result))
    ax.axhline(RED_ABOVE, color=RED, linestyle=":", label=f"red threshold {RED_ABOVE}x mean")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean cumulative load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _slug(result: SimulationResult) -> str:
    w = result.config.blend
    return "off" if w == 0 else "on" if w == 1 else f"blend{w:g}"


def run_showcase(
    out_dir: str | Path,
    *,
    blends: list[float] | tuple[float, ...] = (0.0, 1.0),
    frame_every: int = 5,
    gif: bool = True,
    command: list[str] | None = None,
    **config_kwargs,
) -> dict:
    """Run one simulation per blend weight and write GIFs, PNGs and ``simulation.json`` to ``out_dir``."""
    if not blends:
        raise ValueError("blends must name at least one blend weight")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = [simulate(SimulatorConfig(blend=float(w), **config_kwargs)) for w in blends]
    files = {}
    for result in results:
        slug = _slug(result)
        if gif:
            files[f"{slug}_gif"] = render_gif(
                result, out / f"simulate_{slug}.gif", frame_every=frame_every
            ).name
    files["final_png"] = plot_final(results, out / "simulate_final.png").name
    files["curve_png"] = plot_max_over_mean(results, out / "simulate_max_over_mean.png").name
    from moee.io import run_metadata, write_json_atomic

    payload = {
        "meta": run_metadata(command),
        "constants": {
            "tokens_per_step": TOKENS_PER_STEP,
            "boost": BOOST,
            "growth": GROWTH,
            "red_above": RED_ABOVE,
            "dim_below": DIM_BELOW,
            "n_range": list(N_RANGE),
        },
        "runs": {_slug(r): r.summary() for r in results},
        "files": files,
    }
    write_json_atomic(out / "simulation.json", payload)
    return payload


#: ``--balancing``: which blend weights run (0 = balancing off, 1 = on)
BALANCING = {"off": (0.0,), "on": (1.0,), "both": (0.0, 1.0)}


@dataclass(frozen=True, kw_only=True)
class SimulateSettings:
    """What ``moee simulate`` runs (:func:`run_simulation`): one field per flag, each checked once
    when built, the error naming the flag."""

    n: int = field(
        default=SimulatorConfig.n, metadata={"help": f"experts, {N_RANGE[0]}..{N_RANGE[1]}", "type": int}
    )
    steps: int = field(
        default=SimulatorConfig.steps, metadata={"help": f"batches of {TOKENS_PER_STEP} tokens", "type": int}
    )
    balancing: str = field(default="both", metadata={"help": "which runs", "choices": tuple(BALANCING)})
    blend: float | None = field(
        default=None,
        metadata={
            "help": "also run with strength <- (1-W)*off_rule + W*on_rule, W in [0, 1]",
            "type": float,
            "metavar": "W",
        },
    )
    seed: int = field(default=SimulatorConfig.seed, metadata={"help": "RNG seed", "type": int})
    jitter: float = field(
        default=SimulatorConfig.jitter_std, metadata={"help": "score jitter std", "type": float}
    )
    frame_every: int = field(default=5, metadata={"help": "one GIF frame every N steps", "type": int})
    gif: bool = field(default=True, metadata={"help": "write only the PNGs and the JSON"})
    out: str = field(metadata={"help": "output directory"})

    def __post_init__(self) -> None:
        low, high = N_RANGE
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not low <= self.n <= high:
            raise ValueError(
                f"--n must be an integer in [{low}, {high}] (the supported range), got {self.n!r}"
            )
        _check_ints(self, ("steps", "frame_every"), "{flag} must be a positive integer, got {value!r}")
        _check_ints(self, ("seed",), "{flag} must be an integer >= {least}, got {value!r}", least=0)
        if self.balancing not in BALANCING:
            raise ValueError(f"--balancing must be one of {', '.join(BALANCING)}, got {self.balancing!r}")
        if self.blend is not None and not (_is_real(self.blend) and 0.0 <= self.blend <= 1.0):
            raise ValueError(f"--blend must be in [0, 1], got {self.blend}")
        if not (_is_real(self.jitter) and 0.0 <= self.jitter < math.inf):
            raise ValueError(f"--jitter must be a finite number >= 0, got {self.jitter}")
        if not str(self.out):
            raise ValueError(f"{flag_of('out')} must name an output directory")

    @property
    def blends(self) -> list[float]:
        """The blend weight of each run: ``--balancing``'s, then ``--blend`` when it is another."""
        blends = list(BALANCING[self.balancing])
        if self.blend is not None and self.blend not in blends:
            blends.append(float(self.blend))
        return blends


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_simulation(settings: SimulateSettings, *, command: list[str] | None = None) -> dict:
    """``moee simulate``: one run per blend weight of ``settings`` (:func:`run_showcase`), written
    to ``settings.out``; returns ``simulation.json``'s payload."""
    return run_showcase(
        settings.out,
        blends=settings.blends,
        frame_every=settings.frame_every,
        gif=settings.gif,
        n=settings.n,
        steps=settings.steps,
        seed=settings.seed,
        jitter_std=settings.jitter,
        command=command,
    )


def blend_sweep(
    blends: list[float] | tuple[float, ...],
    *,
    ns: list[int] | tuple[int, ...] = (8,),
    seeds: list[int] | tuple[int, ...] = tuple(range(5)),
    **config_kwargs,
) -> dict:
    """Final max/mean cumulative load for every (n, blend, seed): how much pull toward 1 it takes
    before collapse stops (the question Shazeer et al. 2017, Table 6, answers for a real model)."""
    if not blends or not ns or not seeds:
        raise ValueError("blends, ns and seeds must each hold at least one value")
    grid = np.array(
        [
            [
                [
                    simulate(SimulatorConfig(n=n, blend=float(w), seed=s, **config_kwargs)).max_over_mean[-1]
                    for s in seeds
                ]
                for w in blends
            ]
            for n in ns
        ]
    )  # [n, blend, seed]
    return {
        "blends": [float(w) for w in blends],
        "ns": list(ns),
        "seeds": list(seeds),
        "final_max_over_mean": grid.round(4).tolist(),
        "median": np.median(grid, axis=2).round(4).tolist(),
        "collapsed_fraction": (grid > RED_ABOVE).mean(axis=2).round(4).tolist(),
    }


def plot_blend_sweep(sweep: dict, path: str | Path) -> Path:
    """Median final max/mean against the blend weight, one line per n (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for n, med in zip(sweep["ns"], sweep["median"]):
        ax.plot(sweep["blends"], med, marker="o", label=f"n={n}")
    ax.axhline(RED_ABOVE, color=RED, linestyle=":", label=f"{RED_ABOVE}x mean")
    ax.set_yscale("log")
    ax.set_xlabel("blend weight w (0 = balancing off, 1 = on)")
    ax.set_ylabel(f"median final max/mean ({len(sweep['seeds'])} seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
