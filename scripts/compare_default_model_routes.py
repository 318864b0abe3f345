"""The routes tried for the bundled default model, side by side on the offline suite.

    python scripts/compare_default_model_routes.py \
        --route "from scratch (previous bundled model), last token=eval/results/default_model_routes/from_scratch_tables.json" \
        --route "upcycled all-MiniLM-L6-v2 before training, last token=eval/results/default_model_routes/upcycled_step0_tables.json" \
        --route "upcycled + 300 steps (bundled), last token=eval/results/offline/tables.json" \
        --route "upcycled + 300 steps (bundled), mean pooling=eval/results/offline_mean/tables.json" \
        --out eval/results/default_model_routes/routes

The inputs: the previous bundled model's `eval/run_offline.sh` tables (from_scratch_tables.json); the
upcycled model before training (`moee upcycle` output, build/upcycled-minilm), evaluated with
`moee evaluate --model build/upcycled-minilm --tasks offline --methods hs,rw,moee_concat,moee_sum
--prompts none --alpha auto --alpha-rule spearman` (upcycled_step0_tables.json; its PromptEOL rows are
partial and have no average); the bundled model's `eval/run_offline.sh` outputs.

Each --route is LABEL=TABLES_JSON, a `moee evaluate` output (tables.json) of one model on the offline
suite. Writes OUT.json (every number, with each table's run record) and OUT.md: per route and method,
lee_sts, the retrieval family, the family average and the targets of the model card.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: target -> (column, threshold); which methods it applies to
TARGETS = {
    "lee_sts (best MoE method) >= 40": ("lee_sts", 40.0),
    "lee_sts (RW alone) >= 25": ("lee_sts", 25.0),
    "retrieval family >= 40": ("Retrieval", 40.0),
    "family average >= 50": ("Avg", 50.0),
}


def rows_of(tables: dict) -> list[dict]:
    out = []
    for system in tables["systems"]:
        fam = system.get("families", {})
        avg = [fam[f] for f in tables["avg_families"] if fam.get(f) is not None]
        out.append(
            {
                "label": system["label"],
                "model": system["model"],
                "settings": system.get("settings", {}),
                "lee_sts": system["tasks"].get("lee_sts"),
                "Retrieval": fam.get("Retrieval"),
                "Avg": sum(avg) / len(avg) if len(avg) == len(tables["avg_families"]) else None,
                "families": fam,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--route", action="append", required=True, metavar="LABEL=TABLES_JSON")
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args(argv)
    routes = []
    for spec in args.route:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--route must be LABEL=PATH to an existing tables.json, got {spec!r}")
        tables = json.loads(Path(path).read_text())
        routes.append({"route": label, "source": path, "run": tables.get("run"), "rows": rows_of(tables)})

    def fmt(v):
        return "" if v is None else f"{v:.2f}"

    lines = [
        "# Default-model routes on the offline suite",
        "",
        "mteb main scores x 100; Avg = mean of CLF, Clust, PairCLF, STS. Made by "
        "`python scripts/compare_default_model_routes.py` (command in its docstring).",
        "",
        "| route | method | lee_sts | Retrieval | Avg | CLF | Clust | PairCLF |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in routes:
        for row in r["rows"]:
            f = row["families"]
            lines.append(
                f"| {r['route']} | {row['label']} | {fmt(row['lee_sts'])} | {fmt(row['Retrieval'])} | {fmt(row['Avg'])} "
                f"| {fmt(f.get('Classification'))} | {fmt(f.get('Clustering'))} | {fmt(f.get('PairClassification'))} |"
            )
    lines += ["", "## Targets, per route (best method of each kind)", ""]
    lines += ["| route | " + " | ".join(TARGETS) + " |", "|---|" + "---:|" * len(TARGETS)]
    summary = []
    for r in routes:
        moe = [row for row in r["rows"] if "MiniLM" not in row["model"]]
        rw = [row for row in moe if row["settings"].get("method") == "rw"]
        best = {
            "lee_sts (best MoE method) >= 40": max(
                (x["lee_sts"] for x in moe if x["lee_sts"] is not None), default=None
            ),
            "lee_sts (RW alone) >= 25": max(
                (x["lee_sts"] for x in rw if x["lee_sts"] is not None), default=None
            ),
            "retrieval family >= 40": max(
                (x["Retrieval"] for x in moe if x["Retrieval"] is not None), default=None
            ),
            "family average >= 50": max((x["Avg"] for x in moe if x["Avg"] is not None), default=None),
        }
        cells = []
        for name, (_, threshold) in TARGETS.items():
            v = best[name]
            cells.append("" if v is None else f"{v:.2f} {'met' if v >= threshold else 'missed'}")
        lines.append(f"| {r['route']} | " + " | ".join(cells) + " |")
        summary.append({"route": r["route"], "best": best})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"routes": routes, "targets": summary}, indent=2) + "\n")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
