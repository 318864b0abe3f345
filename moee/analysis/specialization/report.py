"""Driving the model for the specialization report and assembling ``report.json``.

``build_report`` streams a corpus through ``MoEEmbedder.iter_token_routes`` in chunks, decides
which experts count as selected (the router's own choice where the capture returns it) and the
top-k, and feeds ``statistics.SpecializationAccumulator``; ``write_report`` writes the JSON and
the HTML page of ``html.render_html``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from moee.analysis.specialization.html import render_html
from moee.analysis.specialization.statistics import SpecializationAccumulator
from moee.capture.architectures import TOP_K_KEYS
from moee.io import batched

__all__ = [
    "TOP_K_ATTRIBUTES",
    "REPORT_SECTIONS",
    "SELECTION_RETURNED",
    "SELECTION_CAPTURE_DERIVED",
    "model_top_k",
    "read_corpus",
    "selection_scorers",
    "build_report",
    "write_report",
]

logger = logging.getLogger("moee.analysis.specialization")

#: Config attributes that hold the number of experts each token is routed to, in lookup order.
#: The config keys that name top-k: the capture's one list.
TOP_K_ATTRIBUTES = TOP_K_KEYS

#: Every top-level section of the report JSON (and of the HTML page).
REPORT_SECTIONS = (
    "meta",
    "summary",
    "baselines",
    "layers",
    "experts",
    "domains",
    "vocabulary",
    "coactivation",
    "repetition",
    "layer_agreement",
)

_FALLBACK_TOP_K = 1


def model_top_k(config, n_experts: int | None = None, *, warn: bool = True) -> tuple[int, str]:
    """The model's top-k and where it came from.

    Looks up ``TOP_K_ATTRIBUTES`` on the config (and its ``text_config`` for multimodal wrappers).
    When none is set, falls back to k = 1 (first choice only, the one statistic every router has)
    with a warning (unless ``warn=False``); pass ``top_k`` explicitly to override. ``build_report``
    prefers the routers' own k (``RouterSpec.top_k``) where the config has none or disagrees.
    """
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for name in TOP_K_ATTRIBUTES:
            value = getattr(cfg, name, None)
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1:
                if n_experts is not None and value > n_experts:
                    continue
                return int(value), f"config.{name}"
    if warn:
        logger.warning("no top-k attribute on the model config; using k=%d (pass --top-k)", _FALLBACK_TOP_K)
    return _FALLBACK_TOP_K, "fallback"


def read_corpus(
    path: str | Path, *, text_field: str | None = None, domain_field: str | None = None
) -> Iterator[tuple[str, str | None]]:
    """Stream ``(text, domain)`` rows of a corpus file with ``moee.io.read_texts`` (its rules: .txt
    one text a line, .jsonl/.parquet a field, bad rows are errors naming the line, none skipped).

    The domain is a second string field of the same records, read in lockstep.
    """
    from moee.io import read_texts

    texts = read_texts(path, field=text_field)
    if domain_field is None:
        return ((t, None) for t in texts)
    if Path(path).suffix.lower() == ".txt":
        raise ValueError("--domain-field needs a .jsonl or .parquet corpus (a .txt line has no fields)")
    return zip(texts, read_texts(path, field=domain_field))


def selection_scorers(embedder) -> list[Callable[[np.ndarray], np.ndarray]] | None:
    """Per MoE layer, a function from router logits ``[T, E]`` to the scores the router ranks for
    its top-k, or ``None`` when every layer ranks by its logits (softmax, plain top-k).

    Two selection-only biases are recognised: our ``LossFreeBalancedGate`` (``scores(logits) + bias``)
    and transformers' DeepSeek-V3-style ``e_score_correction_bias`` (native scores + bias). Without
    this, "load" would count the top-k of the softmax, which such routers never use.
    """
    import torch

    from moee.capture.registry import RULES

    scorers: list[Callable[[np.ndarray], np.ndarray] | None] = []
    for spec in getattr(embedder, "routers", []):
        router = spec.router if spec.router is not None else spec.module
        scorer = None
        for module in router.modules():
            if hasattr(module, "scores") and isinstance(getattr(module, "bias", None), torch.Tensor):
                gate = module

                def scorer(logits, gate=gate):
                    with torch.no_grad():
                        s = gate.scores(torch.from_numpy(logits).float()) + gate.bias.detach().cpu().float()
                    return s.numpy()

                break
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                native = RULES[spec.rule].native

                def scorer(logits, bias=bias, native=native, router=router):
                    with torch.no_grad():
                        s = native(torch.from_numpy(logits).float(), router) + bias.detach().cpu().float()
                    return s.numpy()

                break
        scorers.append(scorer)
    if not any(scorers):
        return None
    return [f if f is not None else (lambda logits: logits) for f in scorers]


#: ``summary.selection`` for the experts a router returned itself / re-derived by the capture.
SELECTION_RETURNED = "returned by the router (its own top-k indices)"
SELECTION_CAPTURE_DERIVED = (
    "re-derived by the capture: top-k of the router's selection scores (it returns none)"
)


def _router_choice(routes, top_k: int, n_layers: int) -> tuple[np.ndarray | None, list[str] | None]:
    """The experts the capture recorded for this text ``[T, L, k]`` and, per layer, where they came
    from; ``(None, None)`` when it recorded none or they cannot be counted with ``top_k`` (another
    k, or layers with different k)."""
    chosen = getattr(routes, "selection", None)
    if chosen is None:
        return None, None
    chosen = np.asarray(chosen)
    if chosen.ndim != 3 or chosen.shape[1:] != (n_layers, top_k) or (chosen < 0).any():
        return None, None
    returned = getattr(routes, "selection_returned", None) or [False] * n_layers
    return chosen, [SELECTION_RETURNED if r else SELECTION_CAPTURE_DERIVED for r in returned]


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode


def build_report(
    embedder,
    corpus: Iterable[tuple[str, str | None]] | Iterable[str],
    *,
    top_k: int | None = None,
    batch_size: int = 16,
    chunk_size: int = 512,
    max_texts: int | None = None,
    n_contexts: int = 5,
    context_window: int = 6,
    min_token_count: int = 5,
    permutations: int = 10,
    seed: int = 0,
    baseline_sample: int | None = None,
    progress: bool = True,
    total: int | None = None,
) -> dict:
    """Route a corpus through ``embedder`` (a ``MoEEmbedder``) token by token and build the report dict.

    ``corpus`` yields texts or ``(text, domain)`` pairs; it is consumed in chunks of ``chunk_size``
    texts, each streamed through ``iter_token_routes`` (raw text, no prompt, dense softmax), so
    neither the corpus nor its routes are ever held whole in memory.
    """
    n_layers, n_experts = int(embedder.n_moe_layers), int(embedder.n_experts)
    router_ks = {getattr(spec, "top_k", None) for spec in getattr(embedder, "routers", [])}
    router_k = router_ks.pop() if len(router_ks) == 1 else None
    if top_k is None and isinstance(router_k, int) and 1 <= router_k <= n_experts:
        # what the routers themselves select (RouterSpec.top_k), named after the config when it agrees
        top_k, source = model_top_k(embedder.model.config, n_experts, warn=False)
        if (top_k, source[:7]) != (router_k, "config."):
            top_k, source = router_k, "router"
    elif top_k is None:
        top_k, source = model_top_k(embedder.model.config, n_experts)
    else:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be an int in [1, {n_experts}], got {top_k!r}")
        source = "argument"
    acc = SpecializationAccumulator(
        n_layers,
        n_experts,
        top_k,
        n_contexts=n_contexts,
        context_window=context_window,
        permutations=permutations,
        seed=seed,
        baseline_sample=baseline_sample,
    )
    scorers = selection_scorers(embedder)

    def records() -> Iterator[tuple[str, str | None]]:
        for i, item in enumerate(corpus):
            if max_texts is not None and i >= max_texts:
                return
            if isinstance(item, str):
                yield item, None
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                yield item
            else:
                raise TypeError(
                    f"corpus item {i} must be a str or a (text, domain) tuple, got {type(item).__name__}"
                )

    bar = None
    if progress:
        from tqdm.auto import tqdm

        expected = total if max_texts is None else min(total or max_texts, max_texts)
        bar = tqdm(total=expected, unit="text", desc="routing")
    derived = (
        "re-derived: top-k of the router scores + selection bias"
        if scorers
        else "re-derived: top-k of the router softmax"
    )
    layer_sources: list[set[str]] = [set() for _ in range(n_layers)]
    offset = 0
    for chunk in batched(records(), chunk_size):
        # length-sorted inside the chunk so batches carry little padding; indices map back
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i][0]))
        texts = [chunk[i][0] for i in order]
        score = "softmax" if scorers is None else "logits"
        for routes in embedder.iter_token_routes(texts, prompt=None, score=score, batch_size=batch_size):
            row = order[int(routes.index)]
            values = np.asarray(routes.probs, dtype=np.float64)
            selection = None
            if scorers is not None:  # values are logits: probabilities and biased selection scores
                selection = np.stack([f(values[:, i]) for i, f in enumerate(scorers)], axis=1)
                values = _softmax(values)
            selected, sources = _router_choice(routes, top_k, n_layers)
            if selected is not None:
                selection = None
            for layer, name in enumerate(sources or [derived] * n_layers):
                layer_sources[layer].add(name)
            acc.update(
                np.asarray(routes.input_ids),
                values,
                text_index=offset + row,
                domain=chunk[row][1],
                selection=selection,
                selected=selected,
            )
            if bar is not None:
                bar.update(1)
        offset += len(chunk)
    if bar is not None:
        bar.close()
    if offset == 0:
        raise ValueError("the corpus holds no texts")
    report = acc.result(_decoder(embedder.tokenizer), min_token_count=min_token_count)
    report["summary"]["top_k_source"] = source
    by_layer = [" / ".join(sorted(s)) for s in layer_sources]
    report["summary"]["selection_by_layer"] = by_layer
    report["summary"]["selection"] = (
        by_layer[0]
        if len(set(by_layer)) == 1
        else "; ".join(f"L{i}: {name}" for i, name in enumerate(by_layer))
    )
    report["summary"]["model"] = str(getattr(embedder, "name_or_path", type(embedder.model).__name__))
    return report


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json`` and the self-contained ``report.html`` into ``out_dir``."""
    from moee.io import write_json_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = [s for s in REPORT_SECTIONS if s not in report]
    if missing:
        raise ValueError(f"report is missing sections: {missing}")
    json_path, html_path = out / "report.json", out / "report.html"
    write_json_atomic(json_path, report)
    html_path.write_text(render_html(report), encoding="utf-8")
    return {"json": json_path, "html": html_path}
