"""Balancing ablation (Shazeer et al. 2017, Table 6) on our small MoE LM.

    nice -n 19 python analysis/run_ablation.py [--config analysis/ablation/base_config.json] [--out analysis/ablation]

Trains one small MoEEForCausalLM per (w_importance, w_load) row of Table 6 with the project
trainer (same seed, same data order, same steps; only the two weights differ), evaluates it on the
held-out corpus, and writes ablation.json, ablation.md and ablation.png. Runs are cached under
OUT/runs/<row>/result.json (checkpoints there are not committed), so an interrupted ablation resumes.
Needs build/corpus and build/tokenizer (python scripts/build_corpus.py; python scripts/build_tokenizer.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from moee.analysis.ablation import (
    TABLE6_WEIGHTS,
    ablation_markdown,
    plot_ablation,
    plot_training_curves,
    run_ablation,
)
from moee.io import run_metadata, write_json_atomic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="analysis/ablation/base_config.json")
    parser.add_argument("--out", default="analysis/ablation")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's model checkpoints")
    args = parser.parse_args(argv)
    base = json.loads(Path(args.config).read_text())
    out = Path(args.out)
    rows = run_ablation(base, out, weights=TABLE6_WEIGHTS)
    if not args.keep_checkpoints:  # keep result.json (with the training curve), drop weights and logs
        for ckpt in (out / "runs").glob("*/step_*"):
            shutil.rmtree(ckpt, ignore_errors=True)
        for log in (out / "runs").glob("*/log.jsonl"):
            log.unlink()
    meta = {**run_metadata(["python", *sys.argv]), "base_config": base}
    write_json_atomic(out / "ablation.json", {"meta": meta, "rows": rows})
    md = (
        "# Balancing ablation (Shazeer et al. 2017, Table 6) on the small MoE LM\n\n"
        f"Command: `{meta['command']}`; base config `{args.config}` "
        f"({base['model']['num_experts']} experts, top-{base['model']['num_experts_per_tok']}, "
        f"{base['model']['num_hidden_layers']} MoE layers, {base['schedule']['max_steps']} steps of "
        f"{base['optim']['batch_size']}x{base['data']['seq_len']} tokens). Ours: held-out corpus, eval mode; "
        "CV and max/mean are means over MoE layers (worst layer after the slash); `train` columns are per-batch statistics with gate noise (the smooth load estimate the loss sees), averaged over the last 20 steps: CV(Load) is the mean over layers, max/mean the worst layer. Seeds: MoE-256 on 1B-Word, 10 epochs.\n\n"
        + ablation_markdown(rows)
    )
    (out / "ablation.md").write_text(md)
    plot_ablation(rows, out / "ablation.png")
    plot_training_curves(rows, out / "ablation_training.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
