#!/usr/bin/env python
"""The cone figure of the README: mean pairwise cosine of unrelated texts, per method.

200 fortunes (a seeded sample of the offline suite's fortunes_classification test split, texts on
ten unrelated topics) embedded by the bundled default model under its own configuration (the model
folder's ``moee_embedding.json``: mean pooling, no prompt, and the reference statistics fitted on
its training corpus), the same without the reference, and the dense baseline all-MiniLM-L6-v2.
Writes eval/results/isotropy/isotropy.{json,md}. CPU, about a minute.

    python eval/run_isotropy.py [--model DIR] [--n 200] [--out eval/results/isotropy]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("hs", "rw", "moee_concat", "moee_sum")


def fortunes(n: int, seed: int) -> list[str]:
    from moee.io import iter_jsonl

    rows = [
        row["text"] for _, row in iter_jsonl(ROOT / "moee/data/offline/fortunes_classification/test.jsonl")
    ]
    if n > len(rows):
        raise SystemExit(f"--n {n}: the split has {len(rows)} texts")
    pick = np.random.default_rng(seed).choice(len(rows), size=n, replace=False)
    return [rows[i] for i in sorted(pick)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "eval/results/isotropy")
    args = ap.parse_args(argv)

    from moee.analysis.isotropy import pairwise_cosine_stats
    from moee.embed.embedder import MoEEmbedder
    from moee.evaluation.adapter import baseline_revision, load_baseline_encoder
    from moee.provenance import run_record

    texts = fortunes(args.n, args.seed)
    emb = MoEEmbedder.from_pretrained(args.model, device="cpu")
    config = emb.default_config
    rows = []
    variants = [("model configuration", {})]
    if config.reference is not None:
        variants.append(("without the reference", {"reference": None}))
    for label, change in variants:
        for method in METHODS:
            resolved = emb.resolve_config(method=method, **change)
            stats = pairwise_cosine_stats(emb.encode(texts, config=resolved))
            rows.append(
                {
                    "model": "default model",
                    "variant": label,
                    "method": method,
                    "config": resolved.to_dict(),
                    **stats,
                }
            )
            print(f"{label:24s} {method:12s} {stats['mean']:.3f} +- {stats['std']:.3f}", file=sys.stderr)
    base = load_baseline_encoder("cpu")
    vectors = base.model.encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
    stats = pairwise_cosine_stats(np.asarray(vectors))
    rows.append({"model": "all-MiniLM-L6-v2", "variant": "dense baseline", "method": "dense", **stats})
    print(
        f"{'all-MiniLM-L6-v2':24s} {'dense':12s} {stats['mean']:.3f} +- {stats['std']:.3f}", file=sys.stderr
    )

    args.out.mkdir(parents=True, exist_ok=True)
    record = run_record(
        ["python", "eval/run_isotropy.py", *(argv if argv is not None else sys.argv[1:])],
        extra={
            "texts": {"source": "fortunes_classification test split", "n": args.n, "seed": args.seed},
            "model": {"name": str(emb.name_or_path), "weights_digest": emb.weights_digest},
            "baseline_revision": baseline_revision(),
            "rows": rows,
        },
    )
    (args.out / "isotropy.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "## Mean pairwise cosine of unrelated texts",
        "",
        f"{args.n} fortunes (seeded sample of the fortunes_classification test split); mean +- std over "
        f"the {rows[0]['pairs']:,} pairs of distinct texts. Lower is a wider spread (0: isotropic).",
        "",
        "| model | variant | " + " | ".join(METHODS) + " |",
        "|---|---|" + "---|" * len(METHODS),
    ]
    for label, _ in variants:
        cells = {r["method"]: r for r in rows if r["variant"] == label}
        lines.append(
            f"| default model | {label} | "
            + " | ".join(f"{cells[m]['mean']:.3f} +- {cells[m]['std']:.3f}" for m in METHODS)
            + " |"
        )
    lines.append(
        f"| all-MiniLM-L6-v2 | dense baseline | {stats['mean']:.3f} +- {stats['std']:.3f} (one vector) |||"
    )
    lines += ["", f"Command: `{record['command']}`.", ""]
    (args.out / "isotropy.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
