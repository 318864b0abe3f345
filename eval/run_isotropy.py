#!/usr/bin/env python
"""The cone figure of docs/RESULTS.md: mean pairwise cosine of unrelated texts, per method.

200 fortunes (a seeded sample of the offline suite's fortunes_classification test split, texts on
ten unrelated topics) embedded by the bundled default model under its own configuration (the model
folder's ``moee_embedding.json``: mean pooling, no prompt, and the reference statistics fitted on
its training corpus), the same without the reference, and the dense baseline all-MiniLM-L6-v2.
Beside it, a default linear probe (scikit-learn's ``LogisticRegression()``, as a user would first
try it) trained on the split's train texts and scored on its test texts: vectors in a narrow cone
make such a probe underfit. Writes eval/results/isotropy/isotropy.{json,md}. CPU, a few minutes.

    python eval/run_isotropy.py [--model DIR] [--n 200] [--out eval/results/isotropy]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("hs", "rw", "moee_concat", "moee_sum")
SPLITS = ROOT / "moee/data/offline/fortunes_classification"


def split(name: str) -> tuple[list[str], list[str]]:
    from moee.io import iter_jsonl

    rows = [row for _, row in iter_jsonl(SPLITS / f"{name}.jsonl")]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def sample(texts: list[str], n: int, seed: int) -> list[str]:
    if n > len(texts):
        raise SystemExit(f"--n {n}: the split has {len(texts)} texts")
    pick = np.random.default_rng(seed).choice(len(texts), size=n, replace=False)
    return [texts[i] for i in sorted(pick)]


def probe_accuracy(train_x: np.ndarray, train_y: list[str], test_x: np.ndarray, test_y: list[str]) -> float:
    """Test accuracy of ``LogisticRegression()`` with scikit-learn's defaults."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = LogisticRegression().fit(train_x, train_y)
    return float(np.mean(model.predict(test_x) == np.asarray(test_y)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="minilm-moe",
        help="model name or folder (default: minilm-moe, whose figures eval/results/isotropy holds)",
    )
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "eval/results/isotropy")
    args = ap.parse_args(argv)

    from moee.analysis.isotropy import pairwise_cosine_stats
    from moee.embed.embedder import MoEEmbedder
    from moee.evaluation.adapter import baseline_revision, load_baseline_encoder
    from moee.provenance import model_label, run_record

    (train_t, train_y), (test_t, test_y) = split("train"), split("test")
    texts = sample(test_t, args.n, args.seed)
    majority = max(test_y.count(y) for y in set(test_y)) / len(test_y)
    emb = MoEEmbedder.from_pretrained(args.model, device="cpu")
    name = "default model" if args.model is None else model_label(args.model)
    variants = [("model configuration", {})]
    if emb.default_config.reference is not None:
        variants.append(("without the reference", {"reference": None}))

    def row(model: str, variant: str, method: str, encode, config: dict | None = None) -> dict:
        stats = pairwise_cosine_stats(encode(texts))
        stats["probe_accuracy"] = probe_accuracy(encode(train_t), train_y, encode(test_t), test_y)
        print(
            f"{variant:24s} {method:12s} {stats['mean']:.3f} +- {stats['std']:.3f} "
            f"probe {stats['probe_accuracy']:.3f}",
            file=sys.stderr,
        )
        return {"model": model, "variant": variant, "method": method, "config": config, **stats}

    rows = []
    for label, change in variants:
        for method in METHODS:
            resolved = emb.resolve_config(method=method, **change)
            rows.append(
                row(
                    name,
                    label,
                    method,
                    lambda t, c=resolved: emb.encode(t, config=c),
                    resolved.to_record(),
                )
            )
    base = load_baseline_encoder("cpu").model
    dense = row(
        "all-MiniLM-L6-v2",
        "dense baseline",
        "dense",
        lambda t: np.asarray(
            base.encode(t, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
        ),
    )
    rows.append(dense)

    args.out.mkdir(parents=True, exist_ok=True)
    record = run_record(
        ["python", "eval/run_isotropy.py", *(argv if argv is not None else sys.argv[1:])],
        extra={
            "texts": {"source": "fortunes_classification test split", "n": args.n, "seed": args.seed},
            "probe": {
                "model": "sklearn LogisticRegression() defaults",
                "train": len(train_t),
                "test": len(test_t),
                "majority_class_accuracy": majority,
            },
            "model": {"name": model_label(emb.name_or_path), "weights_digest": emb.weights_digest},
            "baseline_revision": baseline_revision(),
            "rows": rows,
        },
    )
    (args.out / "isotropy.json").write_text(json.dumps(record, indent=2) + "\n")

    def table(key: str, fmt) -> list[str]:
        lines = ["| model | variant | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
        for label, _ in variants:
            cells = {r["method"]: r for r in rows if r["variant"] == label}
            lines.append(f"| {name} | {label} | " + " | ".join(fmt(cells[m]) for m in METHODS) + " |")
        lines.append(f"| all-MiniLM-L6-v2 | dense baseline | {fmt(dense)} (one vector) | | | |")
        return lines

    lines = [
        "## Mean pairwise cosine of unrelated texts",
        "",
        f"{args.n} fortunes (seeded sample of the fortunes_classification test split); mean +- std over the "
        f"{dense['pairs']:,} pairs of distinct texts. Lower is a wider spread (0: isotropic).",
        "",
        *table("mean", lambda r: f"{r['mean']:.3f} +- {r['std']:.3f}"),
        "",
        "### A default linear probe",
        "",
        f"Test accuracy of scikit-learn's `LogisticRegression()` with its defaults, trained on the {len(train_t)} "
        f"fortunes of the train split, on the {len(test_t)} of the test split (majority class: {majority:.3f}).",
        "",
        *table("probe", lambda r: f"{r['probe_accuracy']:.3f}"),
        "",
        f"Command: `{record['command']}`.",
        "",
    ]
    (args.out / "isotropy.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
