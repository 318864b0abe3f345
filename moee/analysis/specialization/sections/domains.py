"""Domain specialization (OLMoE paper, section 5): the fraction of domain D's tokens routed to
each expert, ``N_k(E, D) / N_D``, its maximum over experts per layer, and the Jensen-Shannon
divergence of the domains' load distributions, each beside the domain labels shuffled across
texts (texts keep their tokens and routes; a domain of n_D texts takes n_D random texts).

The null keeps the text grouping: tokens of one text share far more than their domain (topic,
names, format), so shuffling single tokens against the labels would credit the domain with what
any grouping into texts gives, and a router that depends on the text alone would score several
times its baseline. The texts' expert counts come from a bounded sample of texts
(``DOMAIN_TEXT_BYTES``), the whole corpus when it fits (then the permutation is exact)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _fmt, _grid, _nan, _subplots, _table, esc
from moee.analysis.specialization.sections.base import Draw, Results, Section, Shape, TextRoutes
from moee.analysis.specialization.statistics import _entropy, _mix64

#: Bound on the memory of the sample of texts behind the domain baselines (bytes).
DOMAIN_TEXT_BYTES = 1 << 24

#: At most this many texts in that sample, at least ``_MIN_TEXTS``.
_MAX_TEXTS, _MIN_TEXTS = 1 << 16, 64

#: Texts per block when a draw sums the sampled texts' counts (bounds the temporaries).
_TEXT_BLOCK = 4096


class _Domains:
    """Per domain label, its token and text counts and its expert counts ``[L, E]``; and a uniform
    sample of at most ``capacity`` labelled texts with their expert counts ``[L, E]`` and token
    counts (bottom-k by a fixed hash of the text index, so independent of arrival order),
    allocated at the first labelled text. The null needs no sampled text's own label: it deals
    the texts out to the domains afresh."""

    def __init__(self, shape: Shape):
        self.n_layers, self.n_experts = shape.n_layers, shape.n_experts
        self.tokens: dict[str, int] = {}
        self.texts: dict[str, int] = {}
        self.load: dict[str, np.ndarray] = {}
        per_text = 4 * shape.n_layers * shape.n_experts + 16
        self.capacity = max(_MIN_TEXTS, min(_MAX_TEXTS, DOMAIN_TEXT_BYTES // per_text))
        self.n_sampled = 0
        self.text_counts = np.zeros((0, shape.n_layers, shape.n_experts), dtype=np.int32)
        self.text_tokens = np.zeros(0, dtype=np.int64)
        self.text_priority = np.zeros(0, dtype=np.uint64)

    def update(self, text: TextRoutes) -> None:
        domain = text.domain
        if domain is None:
            return
        self.tokens[domain] = self.tokens.get(domain, 0) + text.ids.size
        self.texts[domain] = self.texts.get(domain, 0) + 1
        if domain not in self.load:
            self.load[domain] = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        self.load[domain] += text.counts
        if not self.text_priority.size:
            self.text_counts = np.zeros((self.capacity, self.n_layers, self.n_experts), dtype=np.int32)
            self.text_tokens = np.zeros(self.capacity, dtype=np.int64)
            self.text_priority = np.zeros(self.capacity, dtype=np.uint64)
        with np.errstate(over="ignore"):
            priority = _mix64(np.uint64(text.index) + np.uint64(0x632BE59BD9B4E019))
        if self.n_sampled < self.capacity:
            slot = self.n_sampled
            self.n_sampled += 1
        else:
            slot = int(self.text_priority.argmax())
            if priority >= self.text_priority[slot]:
                return
        self.text_priority[slot] = priority
        self.text_counts[slot] = text.counts
        self.text_tokens[slot] = text.ids.size

    def draw(self, names: list[str], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One draw of the null: the domains' expert counts ``[D, L, E]`` and token counts ``[D]``
        when domain ``names[d]`` takes as many random sampled texts as it has texts (a permutation
        of the sample when it holds every text, draws with replacement otherwise)."""
        S = self.n_sampled
        n_texts = np.array([self.texts[d] for d in names], dtype=np.int64)
        total = int(n_texts.sum())
        order = np.argsort(self.text_priority[:S], kind="stable")  # a fixed order of the sample
        picks = order[rng.permutation(S)] if total <= S else order[rng.integers(0, S, total)]
        ends = np.cumsum(n_texts)
        counts = np.zeros((len(names), self.n_layers, self.n_experts), dtype=np.int64)
        tokens = np.zeros(len(names), dtype=np.int64)
        for d, (t0, t1) in enumerate(zip(ends - n_texts, ends)):
            for b0 in range(t0, t1, _TEXT_BLOCK):
                rows = picks[b0 : min(t1, b0 + _TEXT_BLOCK)]
                counts[d] += self.text_counts[rows].sum(axis=0)
                tokens[d] += self.text_tokens[rows].sum()
        return counts, tokens


def _generalized_jsd(dists: np.ndarray, weights: np.ndarray) -> float:
    """Jensen-Shannon divergence of distributions ``dists [D, E]`` (rows sum to 1) with mixture
    weights ``weights [D]``: ``H(sum_d w_d p_d) - sum_d w_d H(p_d)`` (nats; 0 iff all equal)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    mix = (w[:, None] * dists).sum(axis=0)
    return float(max(0.0, _entropy(mix) - sum(wd * _entropy(p) for wd, p in zip(w, dists))))


def _domain_jsd(counts: np.ndarray) -> list[float | None]:
    """Per layer, the JSD of the domains' load distributions ``counts [D, L, E]`` weighted by
    the domains' token shares (``None`` with fewer than two domains)."""
    D, L, _ = counts.shape
    if D < 2:
        return [None] * L
    sizes = counts.sum(axis=2)  # [D, L] = N_D * k
    return [_generalized_jsd(counts[:, layer] / sizes[:, layer, None], sizes[:, layer]) for layer in range(L)]


def _baseline(draw: Draw) -> dict:
    """``max_fraction [D, L]`` (domains by name) and ``jsd [L]``, each the mean over the draws of
    the domain labels shuffled across texts (``_Domains.draw``)."""
    acc, rng = draw.acc, draw.rng
    tally = acc.tallies["domains"]
    L, P = acc.n_layers, acc.permutations
    names = sorted(tally.tokens)
    doms = np.zeros((P, len(names), L))
    jsd = np.zeros((P, L))
    for i in range(P):
        if names:
            counts, tokens = tally.draw(names, rng)
            doms[i] = counts.max(axis=2) / np.maximum(tokens, 1)[:, None]
            jsd[i] = _domain_jsd(counts)
        draw.step()
    return {
        "max_fraction": doms.mean(axis=0).tolist(),
        "jsd": jsd.mean(axis=0).tolist() if len(names) > 1 else [None] * L,
    }


def _result(results: Results) -> dict:
    acc, base = results.acc, results.baselines["domains"]
    tally = acc.tallies["domains"]
    L = acc.n_layers
    names = sorted(tally.tokens)
    domains = {
        "available": bool(tally.tokens),
        "names": names,
        "sampled_texts": int(tally.n_sampled),
        "exact": bool(tally.n_sampled == sum(tally.texts.values())),
        "domains": {},
    }
    jsd = _domain_jsd(np.stack([tally.load[d] for d in names])) if names else [None] * L
    domains["specialization_by_layer"] = [
        {"layer": layer, "jsd": j, "jsd_baseline": b} for layer, (j, b) in enumerate(zip(jsd, base["jsd"]))
    ]
    for d, baseline in zip(names, base["max_fraction"]):
        max_fraction = (tally.load[d] / tally.tokens[d]).max(axis=1)
        domains["domains"][d] = {
            "n_tokens": int(tally.tokens[d]),
            "n_texts": int(tally.texts[d]),
            "fraction": (tally.load[d] / tally.tokens[d]).round(6).tolist(),
            "max_fraction_by_layer": max_fraction.round(6).tolist(),
            "baseline_by_layer": [round(b, 6) for b in baseline],
            "lift_over_baseline_by_layer": [
                round(float(m / b), 4) if b > 0 else None for m, b in zip(max_fraction, baseline)
            ],
        }
    return domains


def _render(report: dict, page: Page) -> str:
    doms = report["domains"]
    if not doms.get("available"):
        return "<p>No domain labels were given (use <code>--domain-field</code> with a .jsonl corpus).</p>"
    L = report["summary"]["n_layers"]
    d = doms["domains"]
    names = list(doms.get("names") or d)
    fig = _lift_heatmaps(report, names)
    parts = [
        "<p class='lead'>max<sub>E</sub> N_k(E,D)/N_D per layer (OLMoE paper, section 5), beside its "
        "baseline: the same statistic with the domain labels shuffled across texts (permutation; each "
        "text keeps its tokens and routes, so what a text's tokens share beyond their domain stays in "
        "the baseline). Cells: statistic / baseline (lift). The heatmaps divide each expert's share of "
        "the domain by its share of the corpus (1 = no preference).</p>",
        _table(
            ["domain", "tokens", *[f"L{i}" for i in range(L)]],
            [
                [
                    esc(n),
                    d[n]["n_tokens"],
                    *[
                        f"{_fmt(m)} / {_fmt(b)} ({_fmt(lift, 2)}x)"
                        for m, b, lift in zip(
                            d[n]["max_fraction_by_layer"],
                            d[n]["baseline_by_layer"],
                            d[n]["lift_over_baseline_by_layer"],
                        )
                    ],
                ]
                for n in names
            ],
        ),
        _figure(
            fig,
            "domain x expert load",
            "Domain x expert load per layer: (N_k(E,D)/N_D) / (N_k(E)/N), 1 = the expert's corpus share.",
        ),
    ]
    spec = doms.get("specialization_by_layer")
    if spec:
        parts.append(_jsd_part(spec))
    return "".join(parts)


def _lift_heatmaps(report: dict, names: list[str]) -> Any:
    """Per layer, each domain's share of each expert over the expert's corpus share, one scale."""
    s = report["summary"]
    L, E, k = s["n_layers"], s["n_experts"], s["top_k"]
    d = report["domains"]["domains"]
    mats = []
    for layer in range(L):
        corpus_share = np.asarray(report["layers"][layer]["load_fraction"]) * k  # N_k(E) / N
        mats.append(
            np.divide(
                np.asarray([d[n]["fraction"][layer] for n in names]),
                corpus_share,
                out=np.zeros((len(names), E)),
                where=corpus_share > 0,
            )
        )
    vmax = max(1.0, float(np.percentile(np.concatenate([m.ravel() for m in mats]), 99)))  # one scale
    cols = min(4, L)
    fig, axes = _grid(L, cols=cols, w=3.6, h=0.8 + 0.26 * len(names))
    for layer, (ax, mat) in enumerate(zip(axes, mats)):
        im = ax.imshow(mat, aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set_yticks(range(len(names)), names if layer % cols == 0 else [], fontsize=7)
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
        if layer >= L - cols:
            ax.set_xlabel("expert", fontsize=7)
    fig.colorbar(im, ax=list(axes), fraction=0.02, pad=0.01, label="share / corpus share")
    return fig


def _jsd_part(spec: list[dict]) -> str:
    """The domain specialisation score per layer beside its permutation baseline: text, table, figure."""
    fig, ax = _subplots(figsize=(5.5, 3))
    xs = [r["layer"] for r in spec]
    ax.plot(xs, _nan(r["jsd"] for r in spec), marker="o", label="JSD of the domains' loads")
    ax.plot(xs, _nan(r["jsd_baseline"] for r in spec), linestyle="--", color="gray", label="permutation")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("nats")
    ax.legend(fontsize=7)
    return (
        "<h3>Domain specialisation score</h3><p>Generalised Jensen-Shannon divergence of the domains' "
        "load distributions over experts (weights: the domains' token shares), beside the same "
        "statistic with the domain labels shuffled across texts.</p>"
        + _table(
            ["layer", "JSD (nats)", "permutation"],
            [[r["layer"], _fmt(r["jsd"], 4), _fmt(r["jsd_baseline"], 4)] for r in spec],
        )
        + _figure(fig, "domain JSD", "Domain specialisation (JSD) per layer beside its permutation baseline.")
    )


SECTION = Section(
    "domains",
    "Domain specialization",
    result=_result,
    render=_render,
    tally=_Domains,
    baseline=_baseline,
    baseline_steps=lambda acc: acc.permutations,
    draw_order=2,
    null="domain labels shuffled across texts, each text keeping its tokens and routes "
    "(max fraction and JSD)",
)
