"""What each expert selects: per expert its load, the token ids it selects most often, its most
specialised tokens (``N_k(x, E) / N_x``, from the shared token tables) and the contexts with the
highest router probability for it, like the expert contexts of Shazeer et al. 2017 (Table 9)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from moee.analysis.specialization.markup import Page, _figure, _subplots, _table, _tok, esc
from moee.analysis.specialization.sections.base import Results, Section, Shape, TextRoutes


class _Contexts:
    """The ``n_contexts`` positions with the highest router probability per layer and expert:
    ``best_prob / best_text / best_pos [M, L, E]`` and their token windows ``best_ctx [M, L, E, 2W+1]``
    (``-1`` past a text's ends)."""

    def __init__(self, shape: Shape):
        self.n_layers, self.n_experts = shape.n_layers, shape.n_experts
        self.n_contexts, self.context_window = shape.n_contexts, shape.context_window
        L, E, width = shape.n_layers, shape.n_experts, 2 * shape.context_window + 1
        self.best_prob = np.full((self.n_contexts, L, E), -np.inf)
        self.best_text = np.full((self.n_contexts, L, E), -1, dtype=np.int64)
        self.best_pos = np.full((self.n_contexts, L, E), -1, dtype=np.int64)
        self.best_ctx = np.full((self.n_contexts, L, E, width), -1, dtype=np.int64)

    def update(self, text: TextRoutes) -> None:
        self._update_contexts(text.ids, text.probs, text.index)

    def _update_contexts(self, ids: np.ndarray, p: np.ndarray, text_index: int) -> None:
        M, W = self.n_contexts, self.context_window
        T = p.shape[0]
        if T > M:
            pos = np.argpartition(-p, M - 1, axis=0)[:M]  # [M, L, E]
        else:
            pos = np.broadcast_to(np.arange(T)[:, None, None], (T, self.n_layers, self.n_experts))
        cand_prob = np.take_along_axis(p, pos, axis=0)
        padded = np.concatenate([np.full(W, -1), ids, np.full(W, -1)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * W + 1)  # [T, 2W+1]
        cand_ctx = windows[pos]  # [m, L, E, 2W+1]
        all_prob = np.concatenate([self.best_prob, cand_prob], axis=0)
        all_text = np.concatenate(
            [self.best_text, np.full(cand_prob.shape, text_index, dtype=np.int64)], axis=0
        )
        all_pos = np.concatenate([self.best_pos, pos], axis=0)
        all_ctx = np.concatenate([self.best_ctx, cand_ctx], axis=0)
        # highest probability first; ties go to the earlier text and position, so the result
        # does not depend on the order in which texts arrive
        order = np.lexsort((all_pos, all_text, -all_prob), axis=0)[:M]
        self.best_prob = np.take_along_axis(all_prob, order, axis=0)
        self.best_text = np.take_along_axis(all_text, order, axis=0)
        self.best_pos = np.take_along_axis(all_pos, order, axis=0)
        self.best_ctx = np.take_along_axis(all_ctx, order[..., None], axis=0)


def context_pieces(
    decode: Callable[[Sequence[int]], str], left: list[int], token: int, right: list[int]
) -> tuple[str, str, str]:
    """A context window as the tokenizer writes it, cut into the text before the routed token, the
    token and the text after: the window is decoded whole and cut where the decodings of its
    prefixes end, so the spaces the tokenizer puts between tokens (WordPiece, SentencePiece's
    leading marks, byte-level BPE) stay where they belong (the token's leading space goes with the
    token). Where a prefix's decoding is no prefix of the whole (a character cut by a byte-level
    token), the three parts are decoded apart and joined with the space a tokenizer that writes
    words apart would put."""
    whole = decode([*left, token, *right])
    before = decode(left) if left else ""
    through = decode([*left, token])
    if through.startswith(before) and whole.startswith(through):
        return before, through[len(before) :], whole[len(through) :]
    parts = [before, decode([token]), decode(right) if right else ""]
    for i in (1, 2):
        if parts[i - 1] and parts[i] and not parts[i - 1][-1].isspace() and not parts[i][0].isspace():
            parts[i] = " " + parts[i]
    return parts[0], parts[1], parts[2]


def _experts(acc, decode, n_top: int, min_count: int) -> list[list[dict]]:
    tally = acc.tallies["experts"]
    L, E, W = acc.n_layers, acc.n_experts, tally.context_window
    ids, n_x, counts = acc.token_table("input")
    out: list[list[dict]] = []
    for layer in range(L):
        row = []
        for e in range(E):
            c = counts[:, layer, e]
            hit = np.flatnonzero(c)
            frequent = hit[np.argsort(-c[hit], kind="stable")[:n_top]]  # ties: lower token id
            top = [
                {
                    "token": decode([int(ids[i])]),
                    "token_id": int(ids[i]),
                    "count": int(c[i]),
                    "share_of_token": float(c[i] / n_x[i]),
                }
                for i in frequent
            ]
            ok = hit[n_x[hit] >= min_count]
            ratio = c[ok] / n_x[ok]
            spec = [
                {"token": decode([int(ids[ok[i]])]), "ratio": float(ratio[i]), "n_x": int(n_x[ok[i]])}
                for i in np.lexsort((-c[ok], -ratio))[:n_top]  # highest ratio, then most frequent
            ]
            contexts = []
            for m in range(tally.n_contexts):
                if not np.isfinite(tally.best_prob[m, layer, e]):
                    continue
                ctx = tally.best_ctx[m, layer, e]
                left = [int(i) for i in ctx[:W] if i >= 0]
                right = [int(i) for i in ctx[W + 1 :] if i >= 0]
                before, token, after = context_pieces(decode, left, int(ctx[W]), right)
                contexts.append(
                    {
                        "prob": float(tally.best_prob[m, layer, e]),
                        "text_index": int(tally.best_text[m, layer, e]),
                        "left": before,
                        "token": token,
                        "right": after,
                    }
                )
            row.append(
                {
                    "expert": e,
                    "load": int(acc.load[layer, e]),
                    "top_tokens": top,
                    "specialized_tokens": spec,
                    "top_contexts": contexts,
                }
            )
        out.append(row)
    return out


def _result(results: Results) -> list[list[dict]]:
    opts = results.options
    return _experts(results.acc, results.decode, opts.n_top_tokens, opts.min_token_count)


def _render(report: dict, page: Page) -> str:
    L = report["summary"]["n_layers"]
    show = page.layers_to_show(L)
    parts = [
        f"<p class='lead'>Layers shown: {esc(str(show))} (every layer is in report.json). Contexts are "
        "the positions with the highest router probability for the expert, as the tokenizer writes "
        "them; the routed token is highlighted.</p>"
    ]
    conc = np.asarray(
        [
            [
                (ex["top_tokens"][0]["count"] / ex["load"]) if ex["load"] and ex["top_tokens"] else np.nan
                for ex in row
            ]
            for row in report["experts"]
        ],
        dtype=float,
    )
    fig, ax = _subplots(figsize=(min(12, 2 + conc.shape[1] * 0.15), 0.8 + conc.shape[0] * 0.3))
    im = ax.imshow(conc, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax, label="top token's share of load")
    parts.append(
        _figure(
            fig,
            "token concentration of each expert",
            "How much of each expert's load is its single most frequent token (1 = a one-token expert).",
        )
    )
    for layer in show:
        rows = []
        for ex in report["experts"][layer]:
            toks = ", ".join(f"{_tok(t['token'])} {t['count']}" for t in ex["top_tokens"][:6])
            spec = ", ".join(f"{_tok(t['token'])} {t['ratio']:.2f}" for t in ex["specialized_tokens"][:5])
            ctx = "<br>".join(
                f"<span class='ctx'>{esc(c['left'])}<b>{esc(c['token'])}</b>{esc(c['right'])}</span> "
                f"({c['prob']:.2f})"
                for c in ex["top_contexts"][:3]
            )
            rows.append([ex["expert"], ex["load"], toks, spec, ctx])
        parts.append(f"<h3>MoE layer {layer}</h3>")
        parts.append(
            _table(
                [
                    "expert",
                    "load",
                    "top tokens (count)",
                    "most specialised tokens N_k(x,E)/N_x",
                    "strongest contexts (prob)",
                ],
                rows,
            )
        )
    return "".join(parts)


SECTION = Section("experts", "What each expert selects", result=_result, render=_render, tally=_Contexts)
