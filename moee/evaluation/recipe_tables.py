"""The recipe table: every recipe x method from one result cache, beside the paper's configuration
and the dense baseline, with a reading computed from the numbers (nothing typed by hand).

    python -m moee.evaluation.recipe_tables eval/results/recipes      # -> recipes.md, recipes.json

A *variant* is everything of an evaluated configuration but its method and alpha (prompt, pooling,
score and the recipe options of ``moee.embed.recipes``); each variant is one row, each method one
column, each cell the ``Avg`` of ``moee.evaluation.tables`` (Retrieval in its own column block).
The reading compares, per method, every variant with its base: a recipe with the plain variant of
the same prompt, a prompt ensemble (``prompt="stability"``, ``prompt=["prompteol", "meaning"]``)
with single-prompt PromptEOL, both of the same score and pooling; and it says whether MoEE (sum)
beats both HS and RW under any variant.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moee.embed.config import RECIPE_FIELDS, EmbeddingConfig, config_label
from moee.embed.methods import METHOD_REGISTRY, METHODS
from moee.evaluation.tables import build_tables, load_results

__all__ = ["build_recipe_table", "recipe_markdown", "write_recipe_tables"]

#: Settings that make up a variant (a row); the method and alpha make the columns.
VARIANT_KEYS = ("prompt", "pooling", "score", *RECIPE_FIELDS)


def _variant(settings: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, settings[k]) for k in VARIANT_KEYS if settings.get(k) is not None)


def _variant_label(variant: Mapping[str, Any]) -> str:
    """``config_label`` of the variant, without the method's name."""
    label = config_label({"method": "hs", **variant}).removeprefix("HS")
    return label.removeprefix(" + ").strip() if label.startswith(" + ") else ("no prompt" + label).strip()


def _is_plain(variant: Mapping[str, Any]) -> bool:
    return not any(variant.get(k) is not None for k in RECIPE_FIELDS)


def _is_ensemble(prompt: Any) -> bool:
    """Whether a recorded prompt (a name, ``none``, a template, members joined by ``+``) is an
    ensemble of several prompts, read as the configuration reads it back."""
    return prompt is not None and EmbeddingConfig.from_dict({"prompt": prompt}).is_ensemble


def build_recipe_table(doc: Mapping[str, Any], *, paper_score: str = "softmax") -> dict[str, Any]:
    """Rows (variants) x methods of ``Avg`` and ``Retr`` from a ``build_tables`` document, the
    baselines, and the computed reading."""
    rows: dict[tuple, dict[str, Any]] = {}
    baselines = []
    for system in doc["systems"]:
        settings = system["settings"]
        if "method" not in settings:
            baselines.append(
                {"label": system["label"], "avg": system["avg"], "retrieval": system["retrieval"]}
            )
            continue
        key = _variant(settings)
        row = rows.setdefault(
            key, {"variant": dict(key), "label": _variant_label(dict(key)), "avg": {}, "retrieval": {}}
        )
        row["avg"][settings["method"]] = system["avg"]
        row["retrieval"][settings["method"]] = system["retrieval"]
    table = sorted(rows.values(), key=lambda r: (not _is_plain(r["variant"]), r["label"]))
    for row in table:
        v = row["variant"]
        row["paper"] = (
            _is_plain(v)
            and v.get("prompt") == "prompteol"
            and v.get("score") == paper_score
            and v.get("pooling") == "last"
        )
    return {"rows": table, "baselines": baselines, "reading": reading(table)}


def _base_row(row: Mapping[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row ``row`` is judged against, of the same score and pooling: for a recipe the plain row
    of the same prompt (else of PromptEOL); for a plain prompt ensemble single-prompt PromptEOL
    (what the ensemble replaces); ``None`` for a plain single prompt (a base itself)."""
    v = row["variant"]

    def plain(prompt: Any) -> dict[str, Any] | None:
        for r in rows:
            w = r["variant"]
            if _is_plain(w) and (w.get("prompt"), w.get("score"), w.get("pooling")) == (
                prompt,
                v.get("score"),
                v.get("pooling"),
            ):
                return r
        return None

    if _is_plain(v):
        return plain("prompteol") if _is_ensemble(v.get("prompt")) else None
    return plain(v.get("prompt")) or plain("prompteol")


def _num(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def reading(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the best variant and every variant's gain over its base (:func:`_base_row`); and
    the variants (if any) where MoEE sum beats both HS and RW."""
    out: dict[str, Any] = {"methods": {}, "moee_sum_beats_both": []}
    bases = [_base_row(row, rows) for row in rows]
    for method in METHODS:
        gains = []
        for row, base in zip(rows, bases, strict=True):
            score, ref = _num(row["avg"].get(method)), _num(base["avg"].get(method)) if base else None
            if score is None or ref is None:
                continue
            gains.append({"variant": row["label"], "gain": round(score - ref, 2), "versus": base["label"]})
        gains.sort(key=lambda g: -g["gain"])
        scored = [
            (r["label"], _num(r["avg"].get(method))) for r in rows if _num(r["avg"].get(method)) is not None
        ]
        best = max(scored, key=lambda x: x[1]) if scored else None
        out["methods"][method] = {
            "best": {"variant": best[0], "avg": round(best[1], 2)} if best else None,
            "helps": [g for g in gains if g["gain"] > 0],
            "hurts": [g for g in gains if g["gain"] < 0],
        }
    for row in rows:
        s, h, r = (_num(row["avg"].get(m)) for m in ("moee_sum", "hs", "rw"))
        if s is not None and h is not None and r is not None and s > max(h, r):
            out["moee_sum_beats_both"].append({"variant": row["label"], "moee_sum": s, "hs": h, "rw": r})
    return out


def _fmt(value: Any) -> str:
    value = _num(value)
    return "–" if value is None else f"{value:.2f}"


def recipe_markdown(table: Mapping[str, Any], *, cap_note: str | None = None) -> str:
    """The markdown of :func:`build_recipe_table`: Avg, then Retrieval, then the reading."""
    labels = [METHOD_REGISTRY[m].label for m in METHODS]
    lines = []
    blocks = [("Avg (CLF, Clust, PairCLF, STS)", "avg"), ("Retrieval (nDCG@10)", "retrieval")]
    for title, field in blocks:
        if all(_num(v) is None for row in table["rows"] for v in row[field].values()):
            continue  # e.g. no retrieval task in the run
        lines += [
            f"### {title}",
            "",
            "| Recipe | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(labels),
        ]
        for row in table["rows"]:
            name = row["label"] + (" **(paper's configuration)**" if row["paper"] else "")
            lines.append(f"| {name} | " + " | ".join(_fmt(row[field].get(m)) for m in METHODS) + " |")
        for base in table["baselines"]:
            lines.append(
                f"| {base['label']} (dense baseline) | "
                + " | ".join([_fmt(base[field])] * len(METHODS))
                + " |"
            )
        lines.append("")
    read = table["reading"]
    lines += ["### Reading (computed from the table)", ""]
    for method in METHODS:
        info = read["methods"][method]
        label = METHOD_REGISTRY[method].label
        helps = ", ".join(f"{g['variant']} (+{g['gain']:.2f} over {g['versus']})" for g in info["helps"][:3])
        hurts = ", ".join(
            f"{g['variant']} ({g['gain']:.2f} vs {g['versus']})" for g in info["hurts"][::-1][:3]
        )
        best = info["best"]
        lines.append(
            f"- **{label}**: best {best['variant']} ({best['avg']:.2f}); "
            + (f"helps: {helps}" if helps else "no recipe beats its base")
            + (f"; hurts most: {hurts}" if hurts else "")
            + "."
            if best
            else f"- **{label}**: no scores."
        )
    beats = read["moee_sum_beats_both"]
    lines.append(
        "- **MoEE sum beats both HS and RW** under: " + ", ".join(b["variant"] for b in beats) + "."
        if beats
        else "- **MoEE sum beats both HS and RW** under no variant."
    )
    if cap_note:
        lines += ["", cap_note]
    return "\n".join(lines) + "\n"


def write_recipe_tables(
    cache_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    tasks: Iterable[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``recipes.md`` and ``recipes.json`` (the table, the reading, ``extra``) into ``out_dir``."""
    out = Path(out_dir if out_dir is not None else cache_dir)
    results = load_results(cache_dir, tasks)
    if not results.scores:
        raise ValueError(f"no results under {cache_dir}")
    doc = build_tables(results)
    table = build_recipe_table(doc)
    table["tasks"] = doc["tasks"]
    if extra:
        table["run"] = dict(extra)
    out.mkdir(parents=True, exist_ok=True)
    note = (extra or {}).get("note")
    (out / "recipes.json").write_text(json.dumps(table, indent=2, default=str) + "\n", encoding="utf-8")
    md = ["## Recipes x methods", "", recipe_markdown(table, cap_note=note)]
    md += ["Task list: " + ", ".join(t["name"] for t in doc["tasks"]) + ".", ""]
    (out / "recipes.md").write_text("\n".join(md), encoding="utf-8")
    return {"json": out / "recipes.json", "markdown": out / "recipes.md"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cache", type=Path, help="the result folder the recipe runs wrote (eval/results/recipes)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where recipes.md/json go (default: the cache folder)"
    )
    parser.add_argument(
        "--note", default=None, help="a line printed under the table (e.g. how texts were capped)"
    )
    parser.add_argument(
        "--runs", type=Path, default=None, help="folder of per-run JSON records to embed in recipes.json"
    )
    args = parser.parse_args(argv)
    extra: dict[str, Any] = {}
    if args.note:
        extra["note"] = args.note
    if args.runs is not None and args.runs.is_dir():
        extra["runs"] = {
            p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(args.runs.glob("*.json"))
        }
    paths = write_recipe_tables(args.cache, args.out or args.cache, extra=extra)
    print(paths["markdown"].read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
