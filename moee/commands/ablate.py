"""`moee ablate`: causal tests of experts through routing hooks (`moee.analysis.expert_importance`).

By default, expert importance: for each expert of each MoE layer (or ``--layers`` / ``--experts``)
the change in next-token loss (nats/token) when it is disabled, overall and per ``--domain-field``,
beside the load-matched null (each token loses, with probability the expert's load, one of its k
selected experts drawn uniformly), the Spearman correlation of importance with load, and the
super experts (largest output |activation| at least ``--super-ratio`` times the median expert's)
with the loss effect of disabling them. ``--mode reselect`` (default) masks the expert's logit
before the router's top-k (the router chooses another); ``--mode zero`` zeroes its weight after
the selection (``--renormalize``: the token's other weights keep its total).

``--swap-from CKPT``: instead, the loss change per MoE layer (and for all layers) when that layer's
router comes from CKPT (same architecture), beside the null of the layer's own router with its
expert order permuted (``--null-draws`` seeded derangements: same loads, assignment gone) and the
share of that cost the donor's router avoids (``recovered``). ``--steer L:E=BIAS ...``: instead, the
change in the next-token distribution (mean KL, nats), in the embedding (cosine to the unsteered
one, the model's own embedding configuration) and in the experts' selection rates when those router
logits are biased, beside the same biases on ``--null-draws`` random sets of other experts of the
same layers. ``moee report --router-swap DIR`` / ``--steering DIR`` show them.

Writes into ``--out``: ``importance.json`` + ``experts.csv`` + ``README.md`` (a reading generated
from the JSON, with the command), or ``swap.json`` + ``swap.csv`` + ``README.md``, or
``steering.json`` + ``README.md``. The corpus is read
lazily up to ``--max-tokens`` tokens (chunks of ``--seq-len``); memory is one batch plus O(tokens).

Every flag is checked before the first forward pass: a repeated layer, expert or steered expert,
an ``--experts`` pair outside ``--layers``, a non-finite ``--steer`` bias, a layer or expert the
model lacks. A non-empty ``--out`` needs ``--overwrite``, which removes the previous run's files
(of any of the three analyses) and keeps a user's other files; an ``--out`` that is, holds or lies
inside ``--model``, ``--corpus`` or ``--swap-from`` is refused. The files are staged beside
``--out`` and committed when complete.
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import sys
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from moee.io import FolderOutput

OUTPUTS = ("importance.json", "experts.csv", "README.md", "swap.json", "swap.csv", "steering.json")
#: What ``moee ablate`` writes (`moee.io.FolderOutput`), whichever analysis: ``--overwrite`` removes
#: the previous run's files of any kind (and keeps a user's); the JSON result lands last.
ABLATE_OUTPUT = FolderOutput(
    "moee ablate", owned=OUTPUTS, last=("importance.json", "swap.json", "steering.json")
)


class _Expert(tuple):
    """``(layer, expert)`` parsed from ``L:E``; prints as ``L:E`` so the recorded command re-runs."""

    def __str__(self) -> str:
        return f"{self[0]}:{self[1]}"


class _Steer(tuple):
    """``((layer, expert), bias)`` parsed from ``L:E=BIAS``; prints as ``L:E=BIAS``."""

    def __str__(self) -> str:
        return f"{self[0]}={self[1]!r}"


def _pair(text: str) -> tuple[int, int]:
    try:
        layer, expert = text.split(":")
        return _Expert((int(layer), int(expert)))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LAYER:EXPERT (MoE-layer position), got {text!r}"
        ) from None


def _steer(text: str) -> tuple[tuple[int, int], float]:
    try:
        pair, value = text.split("=")
        steer = _Steer((_pair(pair), float(value)))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT=BIAS, got {text!r}") from None
    if not math.isfinite(steer[1]):  # a NaN bias would poison every logit of the layer
        raise argparse.ArgumentTypeError(f"BIAS must be a finite number, got {text!r}")
    return steer


def check_selection(args: argparse.Namespace) -> None:
    """The expert selection flags, checked before the model loads: each of ``--layers``,
    ``--experts`` and ``--steer`` names a layer or expert at most once (a repeat is refused rather
    than merged: it would be measured and written twice, and a second ``--steer`` bias for the same
    expert would silently replace the first; a repeat is more often a typo for another expert), and
    every ``--experts`` pair lies in ``--layers`` when both are given (else the selection is not
    what was asked, or empty)."""
    for flag, items in (
        ("--layers", args.layers),
        ("--experts", args.experts),
        ("--steer", [pair for pair, _ in args.steer or []]),
    ):
        seen: set = set()
        for item in items or []:
            if item in seen:
                shown = item if flag == "--layers" else f"{item[0]}:{item[1]}"
                raise ValueError(f"{flag} names {shown} twice; give each once")
            seen.add(item)
    if args.layers is not None and args.experts is not None:
        outside = [f"{layer}:{expert}" for layer, expert in args.experts if layer not in args.layers]
        if outside:
            raise ValueError(
                f"--experts {' '.join(outside)} lie outside --layers {' '.join(map(str, args.layers))}: "
                "drop them, add their layers, or leave --layers out (--experts alone selects them)"
            )


def check_in_model(args: argparse.Namespace, n_experts: list[int]) -> None:
    """Every layer and expert that ``--layers``, ``--experts`` and ``--steer`` name exists in the
    model (``n_experts``: per MoE layer), checked once it loads, before any forward pass."""
    pairs = [("--experts", p) for p in args.experts or []] + [("--steer", p) for p, _ in args.steer or []]
    layers = [("--layers", layer) for layer in args.layers or []] + [(f, p[0]) for f, p in pairs]
    for flag, layer in layers:
        if not 0 <= layer < len(n_experts):
            raise ValueError(
                f"{flag}: MoE layer {layer} out of range (the model has {len(n_experts)} MoE layers)"
            )
    for flag, (layer, expert) in pairs:
        if not 0 <= expert < n_experts[layer]:
            raise ValueError(
                f"{flag}: expert {expert} out of range in MoE layer {layer} ({n_experts[layer]} experts)"
            )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="expert importance / router swap / steering effect: causal tests through routing hooks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_loading_arguments

    add_loading_arguments(p)
    p.add_argument("--corpus", required=True, help=".txt (one text a line), .jsonl or .parquet file")
    p.add_argument("--field", default=None, help="text field of a .jsonl/.parquet corpus (default: text)")
    p.add_argument("--domain-field", default=None, help="field of a .jsonl corpus holding each text's domain")
    p.add_argument(
        "--layers", type=int, nargs="+", default=None, help="MoE-layer positions to ablate (default: all)"
    )
    p.add_argument("--experts", type=_pair, nargs="+", default=None, metavar="L:E", help="only these experts")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of the corpus used (default: 4096)")
    p.add_argument(
        "--per-domain-tokens",
        type=int,
        default=None,
        help="at most N tokens of each domain (default: no cap)",
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per chunk (default: 128)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--mode", choices=("reselect", "zero"), default="reselect", help="how an expert is disabled"
    )
    p.add_argument("--renormalize", action="store_true", help="--mode zero: the other weights keep the total")
    p.add_argument("--no-null", action="store_true", help="skip the null (half the passes or fewer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the null's draws (default: 0)")
    p.add_argument(
        "--null-draws",
        type=int,
        default=None,
        help="--swap-from / --steer: null draws (permutations / expert sets) per row "
        "(default: expert_importance.NULL_DRAWS, 3)",
    )
    p.add_argument(
        "--super-ratio", type=float, default=10.0, help="super-expert threshold over the median (default: 10)"
    )
    p.add_argument(
        "--swap-from", default=None, metavar="CKPT", help="router swap with this checkpoint instead"
    )
    p.add_argument(
        "--steer", type=_steer, nargs="+", default=None, metavar="L:E=BIAS", help="steering effect instead"
    )
    p.add_argument("--steer-texts", type=int, default=64, help="texts embedded for --steer (default: 64)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    p.set_defaults(func=run)


def _write_csv(path: Path, rows: list[dict[str, Any]], domains: list[str]) -> None:
    flat = []
    for row in rows:
        out = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for key in ("delta_by_domain", "null_by_domain"):
            for d in domains:
                if key in row:
                    out[f"{key.removesuffix('_by_domain')}[{d}]"] = row[key][d]
        flat.append(out)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)


def _fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}" if abs(x) < 100 else f"{x:.3g}"


def importance_markdown(result: dict[str, Any], command: str) -> str:
    """A short reading of ``importance.json``, generated from it."""
    rows = result["experts"]
    corr = result["spearman_importance_load"]
    top = sorted(rows, key=lambda r: -r["delta"])[:10]
    has_null = result["null"] is not None
    lines = [
        "# Expert importance by ablation",
        "",
        "Generated by `moee ablate` from `importance.json` (do not edit). Regenerate with:",
        "",
        "```",
        command,
        "```",
        "",
        f"{len(rows)} experts disabled one at a time (mode `{result['mode']}`) on {result['n_tokens']} predicted tokens "
        f"({', '.join(f'{d}: {n}' for d, n in result['domains'].items())}). Base loss {result['base']['loss']:.4f} nats/token.",
        f"Importance = loss(disabled) - loss(base), nats/token. Null: {result['null'] or 'not run'}.",
        "",
        f"**Spearman(importance, load) = {_fmt(corr['pooled'], 3)}** over all experts"
        + (f"; of importance minus null: {_fmt(corr.get('pooled_excess'), 3)}" if has_null else "")
        + "; per layer: "
        + ", ".join(f"L{k} {_fmt(v, 2)}" for k, v in corr["by_layer"].items())
        + ".",
        "",
        "| rank | layer:expert | load | importance | null | excess | load rank | most affected domain |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in top:
        worst = max(r["delta_by_domain"].items(), key=lambda kv: kv[1])
        lines.append(
            f"| {r['importance_rank']} | {r['layer']}:{r['expert']} | {r['load']:.3f} | {_fmt(r['delta'])} | "
            f"{_fmt(r.get('null'))} | {_fmt(r.get('excess'))} | {r['load_rank']} | {worst[0]} ({_fmt(worst[1])}) |"
        )
    if has_null:
        beyond = sum(1 for r in rows if r["excess"] > 0)
        lines += ["", f"{beyond} of {len(rows)} experts cost more than their load-matched null."]
    sup = result["super_experts"]
    flagged = (
        ", ".join(f"{f['layer']}:{f['expert']} ({f['over_median']:.1f}x)" for f in sup["flagged"]) or "none"
    )
    lines += [
        "",
        f"Super experts (largest output |activation| >= {sup['ratio']:g}x the median expert's "
        f"{sup['median_max_activation']:.3g}): {flagged}.",
    ]
    if sup["delta"] is not None:
        lines.append(f"Disabling them together: {_fmt(sup['delta'])} nats/token.")
    largest = ", ".join(
        f"{f['layer']}:{f['expert']} ({f['over_median']:.1f}x)" for f in sup["largest"] if f["over_median"]
    )
    lines += [f"Largest activations: {largest}.", ""]
    cost = result["cost"]
    lines.append(
        f"Cost: {cost['seconds_per_expert']:.2f} s wall"
        + (f", {cost['cpu_seconds_per_expert']:.2f} s CPU" if "cpu_seconds_per_expert" in cost else "")
        + f" per expert ({cost['passes']} passes, "
        f"{cost['tokens_per_second']:.0f} tokens/s), baseline {cost['baseline_seconds']:.1f} s."
    )
    return "\n".join(lines) + "\n"


def _header(title: str, source: str, command: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"Generated by `moee ablate` from `{source}` (do not edit). Regenerate with:",
        "",
        "```",
        command,
        "```",
        "",
    ]


def swap_markdown(result: dict[str, Any], command: str) -> str:
    """A short reading of ``swap.json``, generated from it."""
    lines = _header("Router swap", "swap.json", command)
    lines += [
        f"Donor: `{result['donor']}` (weights digest `{result.get('donor_digest')}`); the model: "
        f"{result['meta']['model']} (`{result['meta']['weights_digest']}`). {result['n_tokens']} predicted tokens, "
        f"base loss {result['base']['loss']:.4f} nats/token.",
        f"Null: {result['null'] or 'not run'}. recovered = 1 - swap / null, given where the null is above "
        "its noise (positive and more than twice its standard error over the draws); n/a elsewhere.",
        "",
        "| router replaced | swap (nats/token) | null | null sd | recovered |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["swaps"]:
        spread, recovered = r.get("null_std"), r.get("recovered")
        lines.append(
            f"| {r['layer']} | {_fmt(r['delta'])} | {_fmt(r.get('null'))} | "
            f"{'n/a' if spread is None else f'{spread:.4f}'} | "
            f"{'n/a' if recovered is None else f'{recovered:.3f}'} |"
        )
    return "\n".join(lines) + "\n"


def steering_markdown(result: dict[str, Any], command: str) -> str:
    """A short reading of ``steering.json``, generated from it."""
    null = result["null"]
    biases = ", ".join(f"{b['layer']}:{b['expert']} {b['bias']:+g}" for b in result["biases"])
    lines = _header("Expert steering", "steering.json", command)
    lines += [
        f"Router-logit biases {biases}; {result['n_tokens']} tokens for the next-token KL, "
        f"{result['embedding_cosine']['n_texts']} texts embedded. Null: "
        + (null["description"] if null else "not run")
        + ".",
        "",
        "| | KL(unsteered \\|\\| steered), nats | embedding cosine | selection change |",
        "|---|---:|---:|---:|",
        f"| steered experts | {result['kl_next_token']:.4f} | {result['embedding_cosine']['mean']:.4f} | "
        f"{_fmt(result['selection_shift'], 3)} |",
    ]
    if null:
        k, c, s = null["kl_next_token"], null["embedding_cosine_mean"], null["selection_shift"]
        lines.append(
            f"| random experts (mean ± sd) | {k['mean']:.4f} ± {k['std']:.4f} | {c['mean']:.4f} ± {c['std']:.4f} | "
            f"{_fmt(s['mean'], 3)} ± {s['std']:.3f} |"
        )
        lines += [
            "",
            f"The steered experts' KL exceeds {null['kl_exceeds_draws']} of {len(null['draws'])} null draws.",
        ]
    lines += [
        "",
        "Selection rates (share of tokens selecting the expert), before -> after: "
        + ", ".join(
            f"{r['layer']}:{r['expert']} {r['before']:.3f} -> {r['after']:.3f}"
            for r in result["selection_rate"]
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
        print(f"moee ablate: {done}/{total} experts", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.expert_importance import (
        build_corpus,
        expert_importance,
        read_corpus,
        router_swap,
        steering_effect,
    )
    from moee.analysis.specialization.ablate_results import write_result
    from moee.cli_options import load_from_args
    from moee.io import StagedFolder, check_output_folder, run_metadata

    for name in ("max_tokens", "seq_len", "batch_size", "steer_texts", "per_domain_tokens", "null_draws"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}"
            )
    if args.swap_from and args.steer:
        raise ValueError("--swap-from and --steer are two analyses: run them one at a time")
    check_selection(args)
    inputs = {"--model": args.model, "--corpus": args.corpus, "--swap-from": args.swap_from}
    target = check_output_folder(args.out, overwrite=args.overwrite, inputs=inputs, output=ABLATE_OUTPUT)
    embedder = load_from_args(args)
    model = embedder.model
    from moee.capture.registry import find_routers

    specs = find_routers(model)
    check_in_model(args, [s.n_experts for s in specs])
    pairs = read_corpus(args.corpus, field=args.field, domain_field=args.domain_field)  # read lazily
    corpus = build_corpus(
        pairs,
        embedder.tokenizer,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens,
        per_domain_tokens=args.per_domain_tokens,
    )
    command = shlex.join(command_line(args))
    from moee.embed.reference import weights_digest

    meta = {
        **run_metadata(command_line(args)),
        "model": args.model or "bundled default model",
        "weights_digest": weights_digest(embedder),  # what `moee report --ablation` (...) checks
    }
    nulls: dict[str, Any] = {"null": not args.no_null, "seed": args.seed}
    if args.null_draws is not None:
        nulls["null_draws"] = args.null_draws
    if args.swap_from:
        from moee.cli_options import load_options
        from moee.loading import load_model

        donor = load_model(args.swap_from, load_options(args), tokenizer=False).model.eval()
        result = {
            **router_swap(model, donor, corpus, batch_size=args.batch_size, **nulls),
            "donor": args.swap_from,
            "donor_digest": weights_digest(SimpleNamespace(name_or_path=args.swap_from, model=donor)),
            "meta": meta,
        }
        with StagedFolder(target, ABLATE_OUTPUT) as out:
            write_result(out / "swap.json", result)  # sealed: `moee report` refuses an edit
            domains = list(result["base"]["loss_by_domain"])
            _write_csv(out / "swap.csv", result["swaps"], domains)
            (out / "README.md").write_text(swap_markdown(result, command), encoding="utf-8")
        for row in result["swaps"]:
            print(
                f"router of layer {row['layer']} from donor: {row['delta']:+.4f} nats/token"
                + (f" (permuted-router null {row['null']:+.4f})" if "null" in row else "")
            )
        return 0
    if args.steer:
        biases = dict(args.steer)
        rows = read_corpus(args.corpus, field=args.field, domain_field=args.domain_field)
        texts = [t for t, _ in islice(rows, args.steer_texts)]
        result = {
            **steering_effect(
                embedder,
                corpus,
                texts,
                biases,
                batch_size=args.batch_size,
                **nulls,
            ),
            "meta": meta,
        }
        with StagedFolder(target, ABLATE_OUTPUT) as out:
            write_result(out / "steering.json", result)
            (out / "README.md").write_text(steering_markdown(result, command), encoding="utf-8")
        null = result["null"]
        print(
            f"KL(next token) {result['kl_next_token']:.4f} nats; embedding cosine {result['embedding_cosine']['mean']:.4f}"
            + (
                f"; random experts: KL {null['kl_next_token']['mean']:.4f}, "
                f"cosine {null['embedding_cosine_mean']['mean']:.4f}"
                if null
                else ""
            )
        )
        return 0
    experts = args.experts
    if args.layers is not None and experts is None:  # layers and experts were checked above
        experts = [(i, e) for i in args.layers for e in range(specs[i].n_experts)]
    result = expert_importance(
        model,
        corpus,
        experts=experts,
        mode=args.mode,
        renormalize=args.renormalize,
        null=not args.no_null,
        seed=args.seed,
        super_ratio=args.super_ratio,
        batch_size=args.batch_size,
        progress=_progress,
    )
    result["meta"] = meta
    with StagedFolder(target, ABLATE_OUTPUT) as out:
        write_result(out / "importance.json", result)
        _write_csv(out / "experts.csv", result["experts"], list(result["domains"]))
        (out / "README.md").write_text(importance_markdown(result, command), encoding="utf-8")
    corr = result["spearman_importance_load"]["pooled"]
    print(f"{len(result['experts'])} experts; Spearman(importance, load) = {_fmt(corr, 3)}; wrote {target}")
    return 0
