"""Driving the model for the specialization report and assembling ``report.json``.

``build_report`` streams a corpus through ``MoEEmbedder.iter_token_routes`` in chunks, decides
which experts count as selected (the router's own choice where the capture returns it) and the
top-k, and feeds ``accumulator.SpecializationAccumulator``; it fills the sections that need the
texts or other models (the token view, the saturation, the comparison); ``write_report`` writes
the JSON (its sections in registry order) and the HTML page of ``html.render_html``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moee.analysis.specialization import sections as registry
from moee.analysis.specialization.accumulator import BaselineDraws, SpecializationAccumulator
from moee.analysis.specialization.html import render_html
from moee.analysis.specialization.sections import ablation, router_swap, steering
from moee.analysis.specialization.sections.token_view import TokenView
from moee.analysis.specialization.statistics import _overlap
from moee.capture.architectures import TOP_K_KEYS
from moee.io import FolderOutput, batched

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "TOP_K_ATTRIBUTES",
    "REPORT_SECTIONS",
    "SELECTION_RETURNED",
    "SELECTION_CAPTURE_DERIVED",
    "model_top_k",
    "read_corpus",
    "selection_scorers",
    "build_report",
    "ReportOptions",
    "write_report",
    "lm_head",
    "routing_overlap",
    "checkpoint_step",
    "load_embedder",
    "saturation_section",
    "same_tokenization",
    "compare_section",
]

logger = logging.getLogger("moee.analysis.specialization")

#: Config attributes that hold the number of experts each token is routed to, in lookup order.
#: The config keys that name top-k: the capture's one list.
TOP_K_ATTRIBUTES = TOP_K_KEYS

#: Every top-level section of the report JSON, in its order (the section registry's ids).
REPORT_SECTIONS = tuple(s.id for s in registry.SECTIONS)

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


def check_corpus(
    path: str | Path,
    *,
    text_field: str | None = None,
    domain_field: str | None = None,
    max_texts: int | None = None,
) -> int:
    """Read the corpus through once before any model is loaded: every row by :func:`read_corpus`'s
    rules, and at least one text (of the first ``max_texts``) with something to route. Returns
    the number of texts the report will use (also the progress bar's total)."""
    n = routable = 0
    for text, _ in read_corpus(path, text_field=text_field, domain_field=domain_field):
        if max_texts is not None and n >= max_texts:
            break
        n += 1
        routable += bool(text.strip())
    if routable == 0:
        first = f"the first {n} texts" if max_texts is not None else f"all {n} texts"
        raise ValueError(f"corpus {path}: {first} are empty (or only whitespace); there is nothing to route")
    return n


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


def lm_head(model: nn.Module, backbone: nn.Module) -> nn.Module | None:
    """The module that turns the backbone's ``last_hidden_state`` into LM logits, or ``None``.

    It is the backbone's one sibling module with parameters (``lm_head`` of Llama-style LMs,
    ``cls`` of BERT LM heads), accepted only when it holds the model's output embedding, so a
    classifier head or a vision tower is never taken for it.
    """
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None:
        return None
    for parent in model.modules():
        children = list(parent.children())
        if not any(c is backbone for c in children):
            continue
        heads = [c for c in children if c is not backbone and next(c.parameters(), None) is not None]
        if len(heads) == 1 and any(m is out for m in heads[0].modules()):
            return heads[0]
        return None
    return None


#: Logits per slice when the report applies the LM head for the predicted next tokens.
PREDICTION_LOGITS = 1 << 22


class _Predictions:
    """The model's argmax next token at every position, from the forward that the routes come
    from: a hook on the backbone applies the LM head to its ``last_hidden_state`` (the model is
    never run twice). ``available`` is False (with ``reason``) when no LM head is recognised."""

    def __init__(self, embedder):
        self.backbone = getattr(embedder, "_backbone", None)
        self.head = lm_head(embedder.model, self.backbone) if self.backbone is not None else None
        self.available = self.head is not None
        out = embedder.model.get_output_embeddings() if self.available else None
        width = getattr(getattr(out, "weight", None), "shape", (0,))[0] or 1
        # positions per slice of the head: its logits stay near PREDICTION_LOGITS (never the whole
        # batch's [B, T, V], the largest tensor of a forward with a big vocabulary)
        self.rows = max(1, PREDICTION_LOGITS // int(width))
        self.reason = None if self.available else "no LM head recognised beside the backbone"
        self.batch: np.ndarray | None = None
        self._handle = None

    def __enter__(self) -> _Predictions:
        if self.available:
            self._handle = self.backbone.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args, output) -> None:
        self.batch = None
        if not self.available:
            return
        import torch

        try:
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            flat = hidden.reshape(-1, hidden.shape[-1])
            best = [
                self.head(flat[i : i + self.rows]).argmax(dim=-1) for i in range(0, flat.shape[0], self.rows)
            ]
            self.batch = torch.cat(best).reshape(hidden.shape[:-1]).cpu().numpy()
        except (AttributeError, TypeError, RuntimeError, IndexError) as exc:
            # a head that does not take the backbone's output: no predictions, the routes still count
            self.available, self.reason = False, f"the LM head failed on the backbone output: {exc}"

    def for_text(self, index: int, n_tokens: int, batch_size: int) -> np.ndarray | None:
        """The predictions of text ``index`` of the current ``iter_token_routes`` batch (left-padded
        rows, in order)."""
        if self.batch is None:
            return None
        row = self.batch[index % batch_size]
        return row[row.size - n_tokens :] if n_tokens else row[:0]


def _resolve_top_k(embedder, top_k: int | None) -> tuple[int, str]:
    """The k counted and where it came from: the argument, else the routers' own k (named after the
    config when it agrees), else the config's."""
    n_experts = int(embedder.n_experts)
    router_ks = {getattr(spec, "top_k", None) for spec in getattr(embedder, "routers", [])}
    router_k = router_ks.pop() if len(router_ks) == 1 else None
    if top_k is None and isinstance(router_k, int) and 1 <= router_k <= n_experts:
        top_k, source = model_top_k(embedder.model.config, n_experts, warn=False)
        if (top_k, source[:7]) != (router_k, "config."):
            top_k, source = router_k, "router"
        return top_k, source
    if top_k is None:
        return model_top_k(embedder.model.config, n_experts)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an int in [1, {n_experts}], got {top_k!r}")
    return top_k, "argument"


def vocab_size(embedder) -> int | None:
    """The number of token ids the report can meet: the largest of the config's ``vocab_size``
    (the LM head's width, which can exceed the tokenizer's) and the tokenizer's length; ``None``
    when neither is known (the token tables then grow as types arrive)."""
    config = getattr(embedder.model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = [getattr(text_config, "vocab_size", None)]
    tokenizer = getattr(embedder, "tokenizer", None)
    if tokenizer is not None:
        try:
            sizes.append(len(tokenizer))
        except TypeError:
            pass
    sizes = [int(n) for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return max(sizes) if sizes else None


def _records(corpus, max_texts: int | None) -> Iterator[tuple[str, str | None]]:
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


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``), once per batch.

    Length-sorted batches each need slightly larger activations than the ones just freed, so the
    heap keeps growing instead of reusing them: without this the process's memory creeps up with
    the corpus (measured on minilm-moe: +300 MB of free heap over 1M tokens, and still
    +230 MB with one release per 512-text chunk) although nothing the report holds does. A no-op
    without glibc.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _iter_routes(
    embedder,
    records: Iterable[tuple[str, str | None]],
    selector: SpecializationAccumulator,
    *,
    batch_size: int,
    chunk_size: int,
    predictions: _Predictions | None = None,
) -> Iterator[dict]:
    """Per text (in chunks of ``chunk_size``, length-sorted inside a chunk so batches carry little
    padding): its corpus index, domain, token ids, dense router probabilities ``[T, L, E]``, the
    experts counted ``[T, L, k]`` (the router's own choice where the capture returns it, else the
    top k of its selection scores), where they came from per layer, and the model's predicted
    next tokens (``None`` without ``predictions``). The one routing loop of the report,
    the saturation and the comparison."""
    n_layers, top_k = selector.n_layers, selector.top_k
    scorers = selection_scorers(embedder)
    score = "softmax" if scorers is None else "logits"
    derived = [
        "re-derived: top-k of the router scores + selection bias"
        if scorers
        else "re-derived: top-k of the router softmax"
    ] * n_layers
    offset = 0
    for chunk in batched(records, chunk_size):
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i][0]))
        texts = [chunk[i][0] for i in order]
        for routes in embedder.iter_token_routes(texts, prompt=None, score=score, batch_size=batch_size):
            row = order[int(routes.index)]
            values = np.asarray(routes.probs, dtype=np.float64)
            rank = values
            if scorers is not None:  # values are logits: probabilities and biased selection scores
                rank = np.stack([f(values[:, i]) for i, f in enumerate(scorers)], axis=1)
                values = _softmax(values)
            selected, sources = _router_choice(routes, top_k, n_layers)
            ids = np.asarray(routes.input_ids)
            sel = selector.selection(values, rank, selected)
            yield {
                "index": offset + row,
                "domain": chunk[row][1],
                "ids": ids,
                "probs": values,
                "selected": sel,
                "sources": sources or derived,
                "predicted": None
                if predictions is None
                else predictions.for_text(int(routes.index), ids.size, batch_size),
            }
            done = int(routes.index) + 1
            if done % batch_size == 0 or done == len(texts):  # the batch is consumed
                release_free_heap()
        offset += len(chunk)


def _progress(progress: bool, total: int | None, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="text", desc=desc, disable=not progress)


def _sections_filled_later() -> dict[str, dict]:
    """The sections a routing pass cannot fill, marked unavailable: the saturation (from
    ``--checkpoints``, :func:`saturation_section`) and the causal sections (filled by ``moee report``
    from ``moee ablate`` results)."""
    sections = {"saturation": {"available": False, "reason": "no checkpoints given (--checkpoints)"}}
    for section in (ablation, router_swap, steering):
        sections[section.SECTION.id] = dict(section.UNAVAILABLE)
    return sections


def _selection_summary(layer_sources: list[set[str]]) -> dict[str, object]:
    """Where each layer's counted experts came from (the router's own choice or a re-derivation), and
    one line for them all (per layer only where the layers differ)."""
    by_layer = [" / ".join(sorted(s)) for s in layer_sources]
    return {
        "selection_by_layer": by_layer,
        "selection": by_layer[0]
        if len(set(by_layer)) == 1
        else "; ".join(f"L{i}: {name}" for i, name in enumerate(by_layer)),
    }


@dataclass(frozen=True)
class ReportOptions:
    """What the report counts and keeps, whatever the corpus: ``top_k`` experts counted per token
    (``None``: the model's), ``n_contexts`` top contexts of ``context_window`` tokens per expert,
    tokens seen at least ``min_token_count`` times in the per-token tables (at most
    ``max_token_types`` rows; ``None``: as many as fit in ``TOKEN_TABLE_BYTES``), the permutation
    baselines' ``draws`` (:class:`BaselineDraws`) and the token view's first ``token_view_texts``
    texts (at most ``token_view_tokens`` tokens in all). Checked where they are used."""

    top_k: int | None = None
    n_contexts: int = 5
    context_window: int = 6
    min_token_count: int = 5
    draws: BaselineDraws = BaselineDraws()
    max_token_types: int | None = None
    token_view_texts: int = 8
    token_view_tokens: int = 256


def build_report(
    embedder,
    corpus: Iterable[tuple[str, str | None]] | Iterable[str],
    *,
    options: ReportOptions | None = None,
    batch_size: int = 16,
    chunk_size: int = 512,
    max_texts: int | None = None,
    progress: bool = True,
    total: int | None = None,
) -> dict:
    """Route a corpus through ``embedder`` (a ``MoEEmbedder``) token by token and build the report
    dict with ``options`` (default: ``ReportOptions()``).

    ``corpus`` yields texts or ``(text, domain)`` pairs (the first ``max_texts``; ``total``: how
    many it holds, for the progress bar); it is consumed in chunks of ``chunk_size`` texts, each
    streamed through ``iter_token_routes`` (raw text, no prompt, dense softmax, ``batch_size`` texts
    per forward), so neither the corpus nor its routes are ever held whole in memory. The model's
    predicted next tokens come from the same forward (a hook applies its LM head). ``saturation`` is
    left unavailable here (see :func:`saturation_section`).
    """
    o = options if options is not None else ReportOptions()
    n_layers, n_experts = int(embedder.n_moe_layers), int(embedder.n_experts)
    top_k, source = _resolve_top_k(embedder, o.top_k)
    acc = SpecializationAccumulator(
        n_layers,
        n_experts,
        top_k,
        draws=o.draws,
        n_contexts=o.n_contexts,
        context_window=o.context_window,
        vocab_size=vocab_size(embedder),
        max_token_types=o.max_token_types,
    )
    view = TokenView(o.token_view_texts, o.token_view_tokens)
    layer_sources: list[set[str]] = [set() for _ in range(n_layers)]
    expected = total if max_texts is None else min(total or max_texts, max_texts)
    with _Predictions(embedder) as predictions, _progress(progress, expected, "routing") as bar:
        for item in _iter_routes(
            embedder,
            _records(corpus, max_texts),
            acc,
            batch_size=batch_size,
            chunk_size=chunk_size,
            predictions=predictions,
        ):
            for layer, name in enumerate(item["sources"]):
                layer_sources[layer].add(name)
            acc.update(
                item["ids"],
                item["probs"],
                text_index=item["index"],
                domain=item["domain"],
                selected=item["selected"],
                predicted=item["predicted"],
            )
            view.add(item)
            bar.update(1)
    if acc.n_texts == 0:
        raise ValueError("the corpus holds no texts")
    decode = _decoder(embedder.tokenizer)
    report = acc.result(decode, min_token_count=o.min_token_count, progress=progress)
    if not predictions.available:
        report["token_specialization"]["by_key"]["predicted"]["reason"] = predictions.reason
    report.update(_sections_filled_later())
    report["token_view"] = view.result(decode)
    report["summary"]["top_k_source"] = source
    report["summary"]["state_bytes"] = acc.state_bytes()
    report["summary"].update(_selection_summary(layer_sources))
    from moee.provenance import model_label

    report["summary"]["model"] = model_label(getattr(embedder, "name_or_path", type(embedder.model).__name__))
    return report


def routing_overlap(
    reference,
    others: Sequence,
    corpus: Iterable[tuple[str, str | None]] | Iterable[str],
    *,
    top_k: int,
    max_tokens: int = 65536,
    batch_size: int = 16,
    progress: bool = True,
) -> list[dict]:
    """For each model of ``others`` (a ``MoEEmbedder`` or a function returning one, called one at a
    time so at most two models are loaded), the per-layer overlap of its selection with
    ``reference``'s on the same tokens: the share of tokens with the same first choice (top-1) and
    the mean ``|S ∩ S_ref| / k`` (top-k), beside their exact expectation with its routes shuffled
    against the tokens (``*_permutation``; ``reference_*_permutation``: the reference against
    itself, what the final checkpoint's own 1.0 is compared with).

    The tokens are those of the first texts of ``corpus``, up to ``max_tokens`` (texts are taken
    until they hold ``4 * max_tokens`` characters; the reference's selections are kept for them,
    so memory is bounded by ``max_tokens``, not by the corpus)."""

    def load(m):
        return m if hasattr(m, "iter_token_routes") else m()

    texts, chars = [], 0
    for text, domain in _records(corpus, None):
        if chars >= 4 * max_tokens:
            break
        texts.append((text, domain))
        chars += len(text)

    def routed(embedder, desc):
        L, E = int(embedder.n_moe_layers), int(embedder.n_experts)
        selector = SpecializationAccumulator(L, E, top_k, draws=BaselineDraws(permutations=1))
        rows, left = [], max_tokens
        with _progress(progress, len(texts), desc) as bar:
            for item in _iter_routes(embedder, iter(texts), selector, batch_size=batch_size, chunk_size=512):
                first = selector.first_choices(item["probs"], item["selected"])
                rows.append((item["index"], item["ids"], item["selected"], first))
                bar.update(1)
        rows.sort(key=lambda r: r[0])
        cut = []
        for _index, ids, sel, first in rows:  # the same tokens for every model: the cap in corpus order
            if left <= 0:
                break
            T = min(left, ids.size)
            left -= T
            cut.append((ids[:T], sel[:T], first[:T]))
        return (L, E), cut

    shape, ref = routed(load(reference), "routing (reference)")
    ref_sel = np.concatenate([r[1] for r in ref])
    ref_first = np.concatenate([r[2] for r in ref])
    _, _, self_top1, self_topk = _overlap(ref_sel, ref_sel, ref_first, ref_first)
    results = []
    for i, other in enumerate(others):
        other_shape, rows = routed(load(other), f"routing ({i + 1}/{len(others)})")
        reason = None
        if other_shape != shape:
            reason = f"layers x experts {other_shape} differ from the reference's {shape}"
        elif len(rows) != len(ref) or any(
            a[0].size != b[0].size or (a[0] != b[0]).any() for a, b in zip(ref, rows)
        ):
            reason = "the two models tokenise the corpus differently"
        if reason is not None:
            results.append({"available": False, "reason": reason})
            continue
        top1, topk, top1_null, topk_null = _overlap(
            ref_sel, np.concatenate([r[1] for r in rows]), ref_first, np.concatenate([r[2] for r in rows])
        )
        results.append(
            {
                "available": True,
                "reason": None,
                "n_texts": len(ref),
                "n_tokens": int(ref_sel.shape[0]),
                "n_experts": shape[1],
                "top1": top1.tolist(),
                "topk": topk.tolist(),
                "top1_permutation": top1_null.tolist(),
                "topk_permutation": topk_null.tolist(),
                "reference_top1_permutation": self_top1.tolist(),
                "reference_topk_permutation": self_topk.tolist(),
            }
        )
    return results


_STEP = re.compile(r"step[_-]?(\d+)", re.IGNORECASE)


def checkpoint_step(spec: str) -> int | None:
    """The training step of a checkpoint: ``trainer_state.json``'s ``step`` of a moee checkpoint
    directory, else a ``step<N>`` / ``step_<N>`` in its last path part or revision (as in OLMoE's
    ``stepNNNN-tokensNB`` revisions), else ``None``."""
    from moee.loading import split_revision

    path, revision = split_revision(spec)
    state = Path(path) / "trainer_state.json"
    if state.is_file():
        try:
            step = json.loads(state.read_text()).get("step")
        except (OSError, ValueError):
            step = None
        if isinstance(step, int):
            return step
    match = _STEP.search(revision or Path(path).name)
    return int(match.group(1)) if match else None


def load_embedder(spec: str, options=None, *, tokenizer=None):
    """A ``MoEEmbedder`` of a model path, training checkpoint, Hub id or ``name@revision``, loaded by
    :func:`moee.loading.load_model` (its tokenizer: ``options.tokenizer``, the model's own, or the one
    a training checkpoint's run names); ``tokenizer`` (a loaded tokenizer: checkpoints of one run
    share it) when the model has none of these."""
    from moee.embed.embedder import MoEEmbedder
    from moee.loading import load_model

    loaded = load_model(spec, options, fallback_tokenizer=tokenizer)
    return MoEEmbedder(loaded.model, loaded.tokenizer, name_or_path=spec)


#: Texts on which the saturation checkpoints' tokenizer is compared with the model's.
TOKENIZATION_CHECK_TEXTS = 64


def same_tokenization(tokenizer_a, tokenizer_b, texts: Sequence[str]) -> bool:
    """Whether two tokenizers give the same token ids for every one of ``texts`` (the same tokenizer
    object trivially does)."""
    if tokenizer_a is tokenizer_b:
        return True
    return all(tokenizer_a(t)["input_ids"] == tokenizer_b(t)["input_ids"] for t in texts)


def _by_step(checkpoints: Sequence[str]) -> tuple[list[str], list[int | None]]:
    """The checkpoints and their training steps, sorted by step where every step is known (else as
    given): the last is the final one."""
    steps = [checkpoint_step(c) for c in checkpoints]
    order = list(range(len(checkpoints)))
    if all(s is not None for s in steps):
        order.sort(key=lambda i: steps[i])
    return [checkpoints[i] for i in order], [steps[i] for i in order]


def _tokenization(final_tokenizer, model_tokenizer, model_name: str | None, head: Sequence[str]) -> dict:
    """Whether the checkpoints tokenise the first texts (``head``) as the model the report describes
    does; without ``model_tokenizer`` the final checkpoint is that model."""
    if model_tokenizer is None:
        return {"same_as_model": True, "model": model_name, "reason": "the final checkpoint is the model"}
    same = same_tokenization(final_tokenizer, model_tokenizer, head)
    return {
        "same_as_model": same,
        "model": model_name,
        "reason": None
        if same
        else f"the checkpoints tokenise the first {len(head)} texts differently from {model_name}",
    }


def _saturation_curves(
    names: Sequence[str], steps: Sequence[int | None], results: list[dict], top_k: int
) -> dict:
    """The checkpoints with their fraction of training, and per layer each checkpoint's overlap with
    the final one (the final one's own: 1, and its permutation baseline), their means and the
    random baseline."""
    L = len(results[0]["top1"])
    ones = [1.0] * L
    own = {
        "top1": ones,
        "topk": ones,
        "top1_permutation": results[0]["reference_top1_permutation"],
        "topk_permutation": results[0]["reference_topk_permutation"],
    }
    per = [*results, own]
    final_step = steps[-1]
    E = results[0]["n_experts"]
    return {
        "checkpoints": [
            {
                "name": n,
                "step": s,
                "fraction_of_training": round(s / final_step, 6) if s is not None and final_step else None,
            }
            for n, s in zip(names, steps)
        ],
        "by_layer": [
            {
                "layer": layer,
                "top1": [r["top1"][layer] for r in per],
                "topk": [r["topk"][layer] for r in per],
                "top1_permutation": [r["top1_permutation"][layer] for r in per],
                "topk_permutation": [r["topk_permutation"][layer] for r in per],
            }
            for layer in range(L)
        ],
        "mean_top1": [float(np.mean(r["top1"])) for r in per],
        "mean_topk": [float(np.mean(r["topk"])) for r in per],
        "random_baseline": {"top1": 1 / E, "topk": top_k / E},
    }


@dataclass(frozen=True)
class ReportedModel:
    """The model a report describes, as the router-saturation section checks checkpoints against
    it: its ``name`` (recorded) and ``tokenizer`` (``None``: the final checkpoint is that model)."""

    name: str | None
    tokenizer: Any = None


def saturation_section(
    checkpoints: Sequence[str],
    corpus: Iterable[tuple[str, str | None]] | Iterable[str],
    *,
    top_k: int,
    load: Callable[[str], object],
    max_tokens: int = 65536,
    batch_size: int = 16,
    progress: bool = True,
    model: ReportedModel | None = None,
) -> dict:
    """Router saturation over training (OLMoE paper, section 5): per layer, the overlap of each
    checkpoint's top-1 / top-k selection with the final checkpoint's on the same tokens.

    ``checkpoints`` are sorted by training step where every step is known (else taken as given);
    the last is the final one; ``fraction_of_training`` = step / final step. ``model`` is the model
    the report describes: its tokenizer is checked against the final checkpoint's on the first
    texts: ``tokenization.same_as_model`` says whether the checkpoints tokenise the corpus as that
    model does (if not, they are another model's series)."""
    model_tokenizer, model_name = (model.tokenizer, model.name) if model is not None else (None, None)
    if len(checkpoints) < 2:
        raise ValueError(f"--checkpoints needs at least two checkpoints, got {len(checkpoints)}")
    names, steps = _by_step(checkpoints)
    final = names[-1]
    loaded = {}

    def load_final():
        loaded["final"] = load(final)
        return loaded["final"]

    records = _records(corpus, None)
    head = list(itertools.islice(records, TOKENIZATION_CHECK_TEXTS))
    results = routing_overlap(
        load_final,
        [lambda c=c: load(c) for c in names[:-1]],
        itertools.chain(head, records),
        top_k=top_k,
        max_tokens=max_tokens,
        batch_size=batch_size,
        progress=progress,
    )
    bad = [f"{n}: {r['reason']}" for n, r in zip(names, results) if not r["available"]]
    if bad:
        raise ValueError("checkpoints cannot be compared with the final one: " + "; ".join(bad))
    final_tokenizer = None if model_tokenizer is None else loaded["final"].tokenizer
    return {
        "available": True,
        "reason": None,
        "final": final,
        "tokenization": _tokenization(final_tokenizer, model_tokenizer, model_name, [t for t, _ in head]),
        "n_texts": results[0]["n_texts"],
        "n_tokens": results[0]["n_tokens"],
        **_saturation_curves(names, steps, results, top_k),
    }


def _layer_values(report: dict) -> list[dict]:
    """The per-layer numbers the comparison differences (one row per MoE layer)."""
    ts = report["token_specialization"]["by_key"]["input"]["by_layer"]
    jsd = report["domains"].get("specialization_by_layer") or [{}] * len(report["layers"])
    return [
        {
            "cv_load": layer["cv_load"],
            "routing_entropy_normalized": layer["routing_entropy_normalized"],
            "vocabulary_weighted_max_ratio": voc["weighted_max_ratio"],
            "repetition_rate": rep["rate"],
            "token_specialization_input": t["mean_expert_specialization"],
            "domain_jsd": j.get("jsd"),
        }
        for layer, voc, rep, t, j in zip(
            report["layers"], report["vocabulary"]["by_layer"], report["repetition"]["by_layer"], ts, jsd
        )
    ]


def compare_section(report_a: dict, report_b: dict, overlap: dict, labels: Sequence[str]) -> dict:
    """``report["compare"]``: model B's report (same corpus, same schema, without ``meta``), B - A
    per layer where both have the same layers x experts x k, and B's selection overlap with A on
    the same tokens (``routing_overlap``; meaningful when expert ids correspond, e.g. two
    checkpoints of one run)."""
    sa, sb = report_a["summary"], report_b["summary"]
    same = all(sa[key] == sb[key] for key in ("n_layers", "n_experts", "top_k"))
    rows = None
    if same:
        rows = []
        for layer, (a, b) in enumerate(zip(_layer_values(report_a), _layer_values(report_b))):
            rows.append(
                {"layer": layer}
                | {key: (b[key] - a[key] if a[key] is not None and b[key] is not None else None) for key in a}
            )
    E, k = sa["n_experts"], sa["top_k"]
    selection = {"available": bool(overlap.get("available")), "reason": overlap.get("reason")}
    if selection["available"]:
        selection["n_tokens"] = overlap["n_tokens"]
        selection["by_layer"] = [
            {
                "layer": layer,
                "top1": overlap["top1"][layer],
                "topk": overlap["topk"][layer],
                "top1_permutation": overlap["top1_permutation"][layer],
                "topk_permutation": overlap["topk_permutation"][layer],
            }
            for layer in range(len(overlap["top1"]))
        ]
        selection["random_baseline"] = {"top1": 1 / E, "topk": k / E}
    return {
        "labels": [str(x) for x in labels],
        "b": {key: value for key, value in report_b.items() if key != "meta"},
        "same_shape": same,
        "differences": {"by_layer": rows},
        "selection_overlap": selection,
    }


def _json_value(value):
    """numpy scalars and arrays as their Python values (``json.dump``'s ``default``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"report value of type {type(value).__name__} is not JSON serialisable")


#: the files of a report folder: all that ``write_report`` replaces there (a user's other files stay)
REPORT_FILES = ("report.json", "report.html")
#: What ``moee report`` writes (`moee.io.FolderOutput`); the page lands last.
REPORT_OUTPUT = FolderOutput("moee report", owned=REPORT_FILES, last=REPORT_FILES)


def check_report_folder(
    out_dir: str | Path, *, overwrite: bool, inputs: dict[str, Any] | None = None
) -> Path:
    """Refuse a report folder before any work: a file, a non-empty folder without ``overwrite``,
    the output of another command, a folder that is, holds or lies inside one of ``inputs`` (name
    -> path: the model, the corpus, ...), a place that cannot be written."""
    from moee.io import check_output_folder

    return check_output_folder(
        out_dir, overwrite=overwrite, what="report folder", inputs=inputs, output=REPORT_OUTPUT
    )


def write_report(
    report: dict,
    out_dir: str | Path,
    *,
    overwrite: bool = True,
    progress: bool = False,
    inputs: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``report.json`` and the self-contained ``report.html`` into the folder ``out_dir``.

    Both files go to a unique hidden folder beside ``out_dir`` first and are committed together
    (`moee.io.StagedFolder`): a run killed midway leaves no ``out_dir`` with a new ``report.json``
    beside an old ``report.html``, and a reader never sees half a file. An existing report is
    replaced (``overwrite=False``: a non-empty folder is refused); a user's other files in the
    folder stay. ``inputs``: what the report was built from (:func:`check_report_folder`).
    ``progress``: the page's sections and the writing reported on stderr.
    """
    import sys

    from moee.io import StagedFolder

    out = check_report_folder(out_dir, overwrite=overwrite, inputs=inputs)
    ids = [s.id for s in registry.SECTIONS]
    missing = [s for s in ids if s not in report]
    if missing:
        raise ValueError(f"report is missing sections: {missing}")
    # the sections in registry order, then anything else the report carries (``compare``)
    report = {**{s: report[s] for s in ids}, **report}
    html = render_html(report, progress=progress)  # before anything is written: a failing page leaves nothing
    if progress:
        print(f"writing {out / 'report.json'} and {out / 'report.html'}", file=sys.stderr, flush=True)
    with StagedFolder(out, REPORT_OUTPUT) as staging:
        # compact: the token view and the per-expert tables are long lists that indentation would
        # spread over one line per number (several times the size)
        with open(staging / "report.json", "w", encoding="utf-8") as fh:
            json.dump(report, fh, separators=(",", ":"), default=_json_value)
        (staging / "report.html").write_text(html, encoding="utf-8")
    return {"json": out / "report.json", "html": out / "report.html"}
