"""Token specialization by input, next and predicted token (OLMoE paper, section 5): for expert e
and token type t, ``N(t, e) / N_t``, the fraction of t's occurrences whose top-k holds e; per
expert the mean over its most specialised types, per layer the token-weighted maximum, each beside
the routes shuffled against the tokens of the key (read from the shared token tables)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _nan, _subplots, _table, _tok, esc
from moee.analysis.specialization.sections.base import Draw, Results, Section
from moee.analysis.specialization.statistics import TOKEN_KEYS, _permuted_group_counts

#: Token types per block when the observed token statistics are reduced (bounds their temporaries).
_ROW_BLOCK = 4096


def _token_specialization_stats(
    groups: Iterator[tuple[int, int, np.ndarray]], sizes: np.ndarray, n_top: int
) -> tuple[np.ndarray, np.ndarray]:
    """From blocks of per-token-type expert counts ``[g, L, E]`` (types of ``sizes`` occurrences):
    the token-weighted mean of ``max_E N(t, E) / N_t`` per layer ``[L]`` and each expert's
    specialization (mean of its ``n_top`` highest ``N(t, E) / N_t``) ``[L, E]``."""
    weighted, best = None, None
    for g0, g1, counts in groups:
        frac = counts / sizes[g0:g1, None, None]
        w = (frac.max(axis=2) * sizes[g0:g1, None]).sum(axis=0)
        m = min(n_top, frac.shape[0])
        top = -np.partition(-frac, m - 1, axis=0)[:m]
        if best is None:
            weighted, best = w, top
        else:
            weighted = weighted + w
            both = np.concatenate([best, top], axis=0)
            m = min(n_top, both.shape[0])
            best = -np.partition(-both, m - 1, axis=0)[:m]
    if best is None:
        raise ValueError("no token types to count")
    return weighted / sizes.sum(), best.sum(axis=0) / n_top


def counted_routes(draw: Draw, column: int, counted: np.ndarray) -> np.ndarray:
    """The sampled routes whose token under key ``column`` (of ``TOKEN_KEYS``) is one of the
    ``counted`` ids; the whole sample when it holds none of them (a sample far smaller than the
    corpus) or carries no tokens."""
    if draw.sample_tokens is None:
        return draw.sample
    keep = np.isin(draw.sample_tokens[:, column], counted)
    return draw.sample[keep] if keep.any() else draw.sample


def _baseline(draw: Draw) -> dict:
    """Per ``TOKEN_KEYS`` key, ``(weighted max fraction [L], expert specialization [L, E])`` when
    each token type seen ``min_token_count`` times takes as many random routes as it has
    occurrences (mean over the draws); ``None`` for a key without such types.

    The routes are drawn from the sampled tokens the statistic counts (types seen
    ``min_token_count`` times) only: the rare types it leaves out route differently (a model
    spreads them more), and drawing their routes would lower the baseline of the counted ones."""
    acc, rng, opts = draw.acc, draw.rng, draw.options
    token_spec = {}
    for column, key in enumerate(TOKEN_KEYS):
        sizes = acc.token_tables.sizes(key, opts.min_token_count)
        if not sizes.size:
            token_spec[key] = None
            continue
        routes = counted_routes(draw, column, acc.token_tables.counted_ids(key, opts.min_token_count))
        runs = []
        for _ in range(acc.permutations):
            groups = _permuted_group_counts(sizes, routes, acc.n_experts, rng)
            runs.append(_token_specialization_stats(groups, sizes, opts.n_specialization_tokens))
            draw.step()
        token_spec[key] = (
            np.mean([r[0] for r in runs], axis=0),
            np.mean([r[1] for r in runs], axis=0),
        )
    return token_spec


def _by_key(acc, decode, base: dict, min_count: int, n_top: int) -> dict:
    """Token specialization by each ``TOKEN_KEYS`` key (OLMoE paper, section 5): for expert e
    and token t, ``N(t, e) / N_t``, the fraction of t's occurrences routed to e; per expert the
    mean over its ``n_top`` most specialised types (missing ones count 0); per layer the
    token-weighted mean of ``max_e N(t, e) / N_t``."""
    L, E, k = acc.n_layers, acc.n_experts, acc.top_k
    random = k / E
    by_key = {}
    for key, description in TOKEN_KEYS.items():
        entry = {
            "available": acc.token_tables.tokens[key] > 0,
            "reason": None,
            "description": description,
            "n_tokens": int(acc.token_tables.tokens[key]),
            "untracked_tokens": int(acc.token_tables.untracked[key]),
        }
        if not entry["available"]:
            entry["reason"] = (
                "no LM logits were given (the model has no recognised LM head)"
                if key == "predicted"
                else "no positions to count"
            )
        ids, n_t, counts = acc.token_table(key, min_count)
        blocks = ((g, g + _ROW_BLOCK, counts[g : g + _ROW_BLOCK]) for g in range(0, ids.size, _ROW_BLOCK))
        observed = _token_specialization_stats(blocks, n_t, n_top) if ids.size else None
        null = base.get(key)
        experts, layers = [], []
        for layer in range(L):
            row = []
            for e in range(E):
                c = counts[:, layer, e]
                hit = np.flatnonzero(c)
                frac = c[hit] / np.maximum(n_t[hit], 1)
                best = np.lexsort((-c[hit], -frac))[:n_top]  # most specialised, then most frequent
                row.append(
                    {
                        "expert": e,
                        "specialization": float(observed[1][layer, e]) if observed else None,
                        "specialization_baseline": float(null[1][layer, e]) if null else None,
                        "top": [
                            {
                                "token": decode([int(ids[hit[i]])]),
                                "token_id": int(ids[hit[i]]),
                                "fraction": round(float(frac[i]), 6),
                                "count": int(c[hit[i]]),
                                "n_t": int(n_t[hit[i]]),
                            }
                            for i in best
                        ],
                    }
                )
            experts.append(row)
            layers.append(
                {
                    "layer": layer,
                    "weighted_max_fraction": float(observed[0][layer]) if observed else None,
                    "weighted_max_fraction_baseline": float(null[0][layer]) if null else None,
                    "mean_expert_specialization": float(observed[1][layer].mean()) if observed else None,
                    "mean_expert_specialization_baseline": float(null[1][layer].mean()) if null else None,
                    "random_baseline": random,
                }
            )
        by_key[key] = {**entry, "by_layer": layers, "experts": experts}
    return {
        "keys": list(TOKEN_KEYS),
        "min_token_count": int(min_count),
        "n_top": int(n_top),
        "random_baseline": random,
        "n_token_types": int(acc.token_tables.n_types),
        "max_token_types": int(acc.token_tables.max_types),
        "by_key": by_key,
    }


def _result(results: Results) -> dict:
    opts = results.options
    return _by_key(
        results.acc,
        results.decode,
        results.baselines["token_specialization"],
        opts.min_token_count,
        opts.n_specialization_tokens,
    )


def _render(report: dict, page: Page) -> str:
    ts = report["token_specialization"]
    keys = [k for k in ts["keys"] if ts["by_key"][k].get("available")]
    missing = [k for k in ts["keys"] if not ts["by_key"][k].get("available")]
    s = report["summary"]
    L = s["n_layers"]
    parts = [
        "<p class='lead'>For each token type t (seen at least "
        f"{esc(str(ts.get('min_token_count')))} times), the fraction of its occurrences whose top-k "
        "contains expert e, N(t,e)/N_t, keyed three ways: the input token, the true next token and the "
        "model's predicted next token (OLMoE paper, section 5). Per layer: the token-weighted mean of "
        "max<sub>e</sub> N(t,e)/N_t, and the mean over experts of the expert's specialisation (mean "
        f"N(t,e)/N_t over its {esc(str(ts.get('n_top')))} top tokens), each beside the permutation "
        f"baseline (routes shuffled against the keys) and random routing k/E = {_fmt(ts.get('random_baseline'))}.</p>"
    ]
    for k in missing:
        parts.append(
            f"<p class='missing'>{esc(k)}: not available ({esc(str(ts['by_key'][k].get('reason') or ''))}).</p>"
        )
    untracked = {k: ts["by_key"][k].get("untracked_tokens") or 0 for k in keys}
    if any(untracked.values()):
        parts.append(
            f"<p class='missing'>The token tables hold {esc(str(ts.get('max_token_types')))} token types "
            "(the memory cap); tokens of types seen after they filled are not counted here: "
            + ", ".join(f"{esc(k)} {n:,} of {ts['by_key'][k]['n_tokens']:,}" for k, n in untracked.items())
            + ".</p>"
        )
    if not keys:
        return "".join(parts)
    fig, ax = _subplots(1, 2, figsize=(11, 3.4))
    colors = dict(zip(ts["keys"], ("#1f77b4", "#d62728", "#2ca02c")))
    for a, stat in zip(ax, ("weighted_max_fraction", "mean_expert_specialization")):
        for k in keys:
            rows = ts["by_key"][k]["by_layer"]
            xs = [r["layer"] for r in rows]
            a.plot(xs, _nan(r[stat] for r in rows), marker="o", color=colors.get(k), label=k)
            a.plot(
                xs, _nan(r[f"{stat}_baseline"] for r in rows), linestyle="--", color=colors.get(k), alpha=0.7
            )
        if ts.get("random_baseline") is not None:
            a.axhline(ts["random_baseline"], color="gray", linestyle=":", label="random k/E")
        a.set_xlabel("MoE layer")
        a.set_title(stat.replace("_", " ") + " (dashed: permutation)", fontsize=9)
        a.legend(fontsize=7)
    headers = ["layer"]
    for k in keys:
        headers += [f"{k}: max frac / perm", f"{k}: expert spec / perm"]
    rows = []
    for layer in range(L):
        row = [layer]
        for k in keys:
            r = ts["by_key"][k]["by_layer"][layer]
            row += [
                f"{_fmt(r['weighted_max_fraction'])} / {_fmt(r['weighted_max_fraction_baseline'])}",
                f"{_fmt(r['mean_expert_specialization'])} / {_fmt(r['mean_expert_specialization_baseline'])}",
            ]
        rows.append(row)
    parts.append(_table(headers, rows))
    parts.append(
        _figure(fig, "token specialization", "Token specialisation by input, next and predicted token.")
    )
    for layer in page.layers_to_show(L):
        parts.append(f"<h3>MoE layer {layer}: each expert's most specialised tokens</h3>")
        detail = []
        for e in range(s["n_experts"]):
            row = [e]
            for k in keys:
                ex = ts["by_key"][k]["experts"][layer][e]
                top = ", ".join(f"{_tok(t['token'])} {t['fraction']:.2f}" for t in ex["top"][:5])
                row.append(f"{_fmt(ex['specialization'])} ({_fmt(ex['specialization_baseline'])}): {top}")
            detail.append(row)
        parts.append(_table(["expert", *[f"{k}: spec (perm): top tokens N(t,e)/N_t" for k in keys]], detail))
    return "".join(parts)


SECTION = Section(
    "token_specialization",
    "Token specialisation: input, next and predicted token",
    result=_result,
    render=_render,
    baseline=_baseline,
    baseline_steps=lambda acc: acc.permutations * len(TOKEN_KEYS),
    draw_order=0,
    null="routes of the counted tokens (types seen >= min_token_count times) shuffled against "
    "the token of each key (input, next, predicted); random routing k/E beside it",
)
