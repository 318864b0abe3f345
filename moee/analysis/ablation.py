"""Load-balancing ablation (Shazeer et al. 2017, Appendix A, Table 6) on our own small MoE language model.

Each row trains the same small ``MoEEForCausalLM`` (Shazeer noisy top-k gates, same seed, same
data order) with ``moee.moe.trainer.train`` and only the two balancing weights changed:
``(w_importance, w_load)`` in ``TABLE6_WEIGHTS``. The final held-out evaluation of the trainer
(``moee.moe.trainer.evaluate``: eval mode, no gate noise) gives the perplexity and, per MoE layer,
``CV(Importance)`` (importance = sum of the sparse gate values ``G(x)``), ``CV(Load)`` (load = top-k
selection counts) and ``max/mean`` load over all held-out tokens; a row reports their mean over
layers and the worst layer's max/mean. The paper measured one MoE layer of MoE-256 after 10 epochs
on 1B words; ours is a few minutes of CPU training, so compare directions, not magnitudes.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path

from moee.io import iter_jsonl

__all__ = [
    "TABLE6_WEIGHTS",
    "SEED_TABLE6",
    "ablation_config",
    "summarize_eval",
    "training_curve",
    "run_ablation",
    "ablation_markdown",
    "plot_ablation",
    "plot_training_curves",
]

#: The rows of Shazeer et al. (2017) Table 6, in its order: (w_importance, w_load).
TABLE6_WEIGHTS: tuple[tuple[float, float], ...] = (
    (0.0, 0.0),
    (0.2, 0.0),
    (0.0, 0.2),
    (0.1, 0.1),
    (0.01, 0.01),
    (1.0, 1.0),
)

#: Shazeer et al. (2017) Table 6 (MoE-256, 1B-Word, 10 epochs): test ppl, CV(Importance), CV(Load), max/mean Load.
SEED_TABLE6: dict[tuple[float, float], dict[str, float]] = {
    (0.0, 0.0): {"ppl": 39.8, "cv_importance": 3.04, "cv_load": 3.01, "max_over_mean_load": 17.80},
    (0.2, 0.0): {"ppl": 35.6, "cv_importance": 0.06, "cv_load": 0.17, "max_over_mean_load": 1.47},
    (0.0, 0.2): {"ppl": 35.7, "cv_importance": 0.22, "cv_load": 0.04, "max_over_mean_load": 1.15},
    (0.1, 0.1): {"ppl": 35.6, "cv_importance": 0.06, "cv_load": 0.05, "max_over_mean_load": 1.14},
    (0.01, 0.01): {"ppl": 35.7, "cv_importance": 0.48, "cv_load": 0.11, "max_over_mean_load": 1.37},
    (1.0, 1.0): {"ppl": 35.7, "cv_importance": 0.03, "cv_load": 0.02, "max_over_mean_load": 1.07},
}


def _check_weights(weights: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for pair in weights:
        if len(pair) != 2:
            raise ValueError(f"each weight pair must be (w_importance, w_load), got {pair!r}")
        wi, wl = float(pair[0]), float(pair[1])
        if wi < 0 or wl < 0:
            raise ValueError(f"balancing weights must be >= 0, got {pair!r}")
        out.append((wi, wl))
    if not out:
        raise ValueError("weights must hold at least one (w_importance, w_load) pair")
    return out


def _slug(wi: float, wl: float) -> str:
    return f"wi{wi:g}_wl{wl:g}"


def ablation_config(base: dict, w_importance: float, w_load: float, run_dir: str | Path) -> dict:
    """The base trainer config with the noisy top-k router, the two weights and its own checkpoint dir."""
    cfg = copy.deepcopy(base)
    model = cfg.setdefault("model", {})
    if model.get("router_type", "noisy_top_k") != "noisy_top_k":
        raise ValueError(
            "the Table 6 ablation needs router_type 'noisy_top_k' (the weights act on its losses)"
        )
    model["router_type"] = "noisy_top_k"
    model["router_w_importance"] = float(w_importance)
    model["router_w_load"] = float(w_load)
    cfg.setdefault("checkpoint", {})["dir"] = str(run_dir)
    return cfg


def summarize_eval(ev: dict) -> dict[str, float]:
    """One table row from a trainer ``evaluate`` result: ppl and layer-averaged balance statistics."""
    layers = ev.get("layers") or []
    if not layers:
        raise ValueError("the evaluation has no MoE layer statistics")
    n = len(layers)
    return {
        "ppl": float(ev["ppl"]),
        "loss": float(ev["loss"]),
        "cv_importance": sum(x["cv_importance"] for x in layers) / n,
        "cv_load": sum(x["cv_load"] for x in layers) / n,
        "max_over_mean_load": sum(x["max_over_mean_load"] for x in layers) / n,
        "max_over_mean_load_worst_layer": max(x["max_over_mean_load"] for x in layers),
        "heldout_tokens": int(ev["tokens"]),
    }


def training_curve(log_path: str | Path, *, every: int = 10, tail: int = 20) -> dict:
    """Per-batch routing statistics during training (with gate noise, as the losses see them),
    from the trainer's ``log.jsonl``: a curve sampled every ``every`` steps and the mean of the
    last ``tail`` steps."""
    records = [record for _, record in iter_jsonl(log_path)]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError(f"{log_path} holds no training steps")
    keys = ("lm_loss", "cv_load_mean", "max_over_mean_load_max")
    sampled = [r for r in train if r["step"] % every == 0 or r is train[-1]]
    last = train[-tail:]
    return {
        "curve": {
            "step": [r["step"] for r in sampled],
            **{k: [round(r[k], 4) for r in sampled] for k in keys},
        },
        f"last{tail}": {k: sum(r[k] for r in last) / len(last) for k in keys},
    }


def run_ablation(
    base_config: dict,
    out_dir: str | Path,
    *,
    weights: Sequence[tuple[float, float]] = TABLE6_WEIGHTS,
    progress: bool = True,
    reuse: bool = True,
) -> list[dict]:
    """Train one model per weight pair and return the table rows (also written as ``rows.jsonl``).

    With ``reuse=True`` a run whose ``result.json`` already exists is read instead of retrained,
    so an interrupted ablation continues where it stopped.
    """
    weights = _check_weights(weights)
    from moee.moe.checkpoint import latest_checkpoint
    from moee.moe.trainer import train

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for wi, wl in weights:
        run_dir = out / "runs" / _slug(wi, wl)
        result_path = run_dir / "result.json"
        if reuse and result_path.is_file():
            row = json.loads(result_path.read_text())
            if "training" not in row and (run_dir / "log.jsonl").is_file():
                row["training"] = training_curve(run_dir / "log.jsonl")
                result_path.write_text(json.dumps(row, indent=2) + "\n")
            rows.append(row)
            continue
        cfg = ablation_config(base_config, wi, wl, run_dir)
        t0 = time.time()
        # an interrupted run continues from its checkpoint; reuse=False retrains it from scratch
        resume = reuse and latest_checkpoint(run_dir) is not None
        result = train(cfg, progress=progress, resume=resume, overwrite=not resume)
        if result.last_eval is None:
            raise ValueError("the ablation config needs data.heldout so every run ends with an evaluation")
        row = {
            "w_importance": wi,
            "w_load": wl,
            **summarize_eval(result.last_eval),
            "per_layer": [
                {k: layer[k] for k in ("cv_importance", "cv_load", "max_over_mean_load")}
                for layer in result.last_eval["layers"]
            ],
            "training": training_curve(run_dir / "log.jsonl"),
            "steps": result.step,
            "train_seconds": round(time.time() - t0, 1),
            "seed": SEED_TABLE6.get((wi, wl)),
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
    return rows


def ablation_markdown(rows: Sequence[dict]) -> str:
    """Our rows next to Shazeer et al. (2017) Table 6 (its four columns last)."""
    lines = [
        "| w_importance | w_load | held-out ppl | CV(Importance) | CV(Load) | max/mean Load (mean / worst layer) "
        "| train CV(Load) | train max/mean | Table 6: ppl | Table 6: CV(Imp) | Table 6: CV(Load) | Table 6: max/mean |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def train_cells(r: dict) -> str:
        t = r.get("training", {}).get("last20")
        return f"{t['cv_load_mean']:.3f} | {t['max_over_mean_load_max']:.2f}" if t else "- | -"

    for r in rows:
        s = SEED_TABLE6.get((r["w_importance"], r["w_load"]))
        seed_cells = (
            f"{s['ppl']:.1f} | {s['cv_importance']:.2f} | {s['cv_load']:.2f} | {s['max_over_mean_load']:.2f}"
            if s
            else "- | - | - | -"
        )
        lines.append(
            f"| {r['w_importance']:g} | {r['w_load']:g} | {r['ppl']:.2f} | {r['cv_importance']:.3f} | "
            f"{r['cv_load']:.3f} | {r['max_over_mean_load']:.2f} / {r['max_over_mean_load_worst_layer']:.2f} | "
            f"{train_cells(r)} | {seed_cells} |"
        )
    return "\n".join(lines) + "\n"


def plot_ablation(rows: Sequence[dict], path: str | Path) -> Path:
    """Bars per weight pair: ours (held-out ppl, CVs, max/mean) beside Table 6's numbers (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"({r['w_importance']:g}, {r['w_load']:g})" for r in rows]
    x = np.arange(len(rows))
    metrics = [("ppl", "perplexity"), ("cv_importance", "CV(Importance)"), ("cv_load", "CV(Load)"),
               ("max_over_mean_load", "max/mean Load")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), dpi=100)
    for ax, (key, title) in zip(axes, metrics):
        ours = [r[key] for r in rows]
        seeds = [SEED_TABLE6.get((r["w_importance"], r["w_load"]), {}).get(key, np.nan) for r in rows]
        ax.bar(x - 0.2, ours, width=0.4, label="ours (small MoE LM)", color="#1f9e89")
        ax.bar(x + 0.2, seeds, width=0.4, label="Shazeer et al. 2017, Table 6 (MoE-256)", color="#999999")
        ax.set_xticks(x, labels, rotation=45, fontsize=7)
        ax.set_title(title, fontsize=9)
        if key != "ppl":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.supxlabel("(w_importance, w_load)", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_training_curves(rows: Sequence[dict], path: str | Path) -> Path:
    """Per-batch max/mean load (worst layer) and LM loss against the training step, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
    for r in rows:
        if "training" not in r:
            continue
        c = r["training"]["curve"]
        label = f"({r['w_importance']:g}, {r['w_load']:g})"
        axes[0].plot(c["step"], c["max_over_mean_load_max"], label=label)
        axes[1].plot(c["step"], c["lm_loss"], label=label)
    axes[0].set_ylabel("max/mean load (worst layer, training batch)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("training LM loss (nats)")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7, title="(w_imp, w_load)", title_fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
