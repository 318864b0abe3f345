"""The token view: the first texts of the corpus with every token's routes (``TokenView``, fed by
the report driver, which has the texts), embedded in the page as JSON and drawn by the page's
script (``page_assets/token_view.js``).

Escaping: the data travels as JSON inside ``<script type="application/json">`` with ``<``, ``>``
and ``&`` written as ``\\u003c`` etc., so no corpus text (``</script>``, ``<!--``) can end the
block, and the script puts it in the page with ``textContent`` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

from moee.analysis.specialization.markup import TOKEN_VIEW_MAX_VALUES, Page
from moee.analysis.specialization.sections.base import Section

__all__ = ["SECTION", "TokenView", "surface_pieces", "token_view_payload"]

#: Probabilities are embedded as integers ``round(p * scale)``: the bar chart and the top-k
#: labels need three decimals, and integers are a third the size of float text.
_TOKEN_VIEW_SCALE = 1000


def surface_pieces(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> list[str]:
    """Each token as it reads in its text, word boundaries included: piece ``i`` is what decoding
    ``ids[: i + 1]`` adds to decoding ``ids[:i]``. Decoding tokens one by one glues WordPiece
    words together ("thenationalexecutive") and shows a byte-level BPE's markers; the running
    decode gives "the national executive" with every tokenizer. A token that ends inside a
    multi-byte character adds nothing; the token that completes it carries the character.
    Quadratic in the text's length, which the token view caps."""
    pieces, before = [], ""
    for i in range(len(ids)):
        text = decode(ids[: i + 1])
        if text.endswith("\ufffd"):  # an incomplete character: wait for the rest of its bytes
            pieces.append("")
            continue
        if text.startswith(before):
            pieces.append(text[len(before) :])
        else:  # the decoder rewrote what came before (rare cleanup rules): fall back to the token alone
            pieces.append(decode(ids[i : i + 1]))
        before = text
    return pieces


class TokenView:
    """The first ``n_texts`` texts of the corpus (at most ``max_tokens`` tokens in all, each text
    cut to what is left) with every token's routes, for the page's token view: a fixed-size
    sample, whatever the corpus length."""

    def __init__(self, n_texts: int, max_tokens: int, decimals: int = 3):
        self.n_texts, self.max_tokens, self.decimals = int(n_texts), int(max_tokens), int(decimals)
        self._rows: dict[int, dict] = {}

    def add(self, item: dict) -> None:
        if item["index"] < self.n_texts:
            T = min(item["ids"].size, self.max_tokens)
            order = np.argsort(-np.take_along_axis(item["probs"][:T], item["selected"][:T], axis=2), axis=2)
            self._rows[item["index"]] = {
                "domain": item["domain"],
                "ids": item["ids"][:T],
                "probs": item["probs"][:T].astype(np.float32),
                "selected": np.take_along_axis(item["selected"][:T], order, axis=2),
                "predicted": None if item["predicted"] is None else item["predicted"][:T],
            }

    def result(self, decode: Callable[[Sequence[int]], str]) -> dict:
        texts, left = [], self.max_tokens
        for index in sorted(self._rows):
            if left <= 0:
                break
            r = self._rows[index]
            T = min(left, r["ids"].size)
            left -= T
            texts.append(
                {
                    "text_index": index,
                    "domain": r["domain"],
                    "tokens": surface_pieces(decode, [int(i) for i in r["ids"][:T]]),
                    "token_ids": [int(i) for i in r["ids"][:T]],
                    "predicted": None
                    if r["predicted"] is None
                    else [decode([int(i)]) for i in r["predicted"][:T]],
                    "selected": r["selected"][:T].tolist(),
                    "probs": np.round(r["probs"][:T].astype(np.float64), self.decimals).tolist(),
                }
            )
        return {
            "n_texts": len(texts),
            "n_tokens": self.max_tokens - left,
            "max_tokens": self.max_tokens,
            "decimals": self.decimals,
            "texts": texts,
        }


def token_view_payload(report: dict, max_values: int = TOKEN_VIEW_MAX_VALUES) -> dict | None:
    """What the token view embeds: the report's token sample (``report["token_view"]``) as
    ``[text, selected [L][k], dense [L][E] in 1/scale, predicted next token or None]`` per token,
    at most ``max_values`` dense probabilities (whole tokens, in corpus order); ``None`` when the
    report has no token sample."""
    tv = report.get("token_view")
    if not tv or not tv.get("texts"):
        return None
    s = report["summary"]
    L, E, k = int(s["n_layers"]), int(s["n_experts"]), int(s["top_k"])
    budget = max(1, max_values // (L * E))
    texts, used = [], 0
    for i, text in enumerate(tv["texts"]):
        if used >= budget:
            break
        n = min(len(text["tokens"]), budget - used)
        if n == 0:
            continue
        shape = f"selected must be [T, {L}, k] and probs [T, {L}, {E}] for its {len(text['tokens'])} tokens"
        try:
            selected = np.asarray(text["selected"][:n], dtype=np.int64)
            probs = np.asarray(text["probs"][:n], dtype=np.float64)
        except ValueError as err:  # ragged lists
            raise ValueError(f"token_view text {i}: {shape}, got ragged lists ({err})") from None
        if selected.ndim != 3 or selected.shape[:2] != (n, L) or probs.shape != (n, L, E):
            raise ValueError(
                f"token_view text {i}: {shape}, got {list(selected.shape)} and {list(probs.shape)}"
            )
        if (selected < 0).any() or (selected >= E).any():
            raise ValueError(f"token_view text {i}: expert ids outside [0, {E})")
        predicted = text.get("predicted") or [None] * n
        dense = np.rint(probs * _TOKEN_VIEW_SCALE).astype(np.int64).tolist()
        tokens = [
            [str(t), sel, d, None if q is None else str(q)]
            for t, sel, d, q in zip(text["tokens"][:n], selected.tolist(), dense, predicted[:n])
        ]
        label = f"text {text.get('text_index', i)}"
        if text.get("domain") is not None:
            label += f" · {text['domain']}"
        texts.append({"label": label, "tokens": tokens})
        used += n
    return {
        "n_layers": L,
        "n_experts": E,
        "top_k": k,
        "layer": L // 2,
        "scale": _TOKEN_VIEW_SCALE,
        "n_tokens": used,
        "texts": texts,
    }


def _json_for_script(data) -> str:
    """JSON that is safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` survive, so no
    ``</script>`` or ``<!--`` can appear; JSON.parse restores them."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _render(report: dict, page: Page) -> str | None:
    payload = token_view_payload(report, page.token_view_max_values)
    if payload is None:
        return None
    data_id = f"{page.prefix}token-view-data"
    page.data_blocks.append(
        f"<script type='application/json' id='{data_id}'>{_json_for_script(payload)}</script>"
    )
    total = sum(len(t["tokens"]) for t in report["token_view"]["texts"])
    return (
        f"<p class='lead'>{payload['n_tokens']} tokens of the corpus"
        f"{f' (of {total} in report.json)' if total > payload['n_tokens'] else ''}, each coloured by its "
        "first-choice expert in the chosen layer. Hover a token (or click to pin it) to see its dense "
        "routing distribution in every layer, the selected experts coloured, with their top-k; pick an "
        "expert to highlight the tokens whose top-k contains it.</p>"
        f"<div class='token-view' id='{page.prefix}token-view' data-source='{data_id}'>"
        "<noscript>The token view needs JavaScript.</noscript></div>"
    )


SECTION = Section("token_view", "Token view", render=_render)
