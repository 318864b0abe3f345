"""Training-free embedding recipes beyond the paper: one registry, shared by HS, RW and MoEE alike.

A *recipe* changes what the model reads and which positions are pooled; every method (``hs``,
``rw``, ``moee_concat``, ``moee_sum``) then works on the pooled HS and RW as usual, row by row, so a
recipe never introduces batch statistics. The entries of :data:`RECIPES` (``docs/RECIPES.md``):

- ``None`` (``plain``): the text (or its prompt) once, every real token pooled.
- ``echo`` (Springer et al. 2024, "Repetition improves language model embeddings"): the text is
  given twice, ``Rewrite the sentence: <text>, rewritten sentence: <text>``, and only the second
  copy is pooled (last token or mean), so every pooled token has seen the whole text. With a
  prompt, the second copy is the prompted text; without one, both copies are the text exactly as
  given (no full stop, no quote rewriting). A long text is cut inside both copies alike
  (``moee.embed.prompts.fit_prompts``), so the second copy always survives whole.
- ``token_prepending`` (Fu et al. 2025, "Token Prepending: A Training-Free Approach for Eliciting
  Better Sentence Embeddings from LLMs"): one placeholder token is put right before the text; in
  the early decoder layers (:func:`token_prepending_layers`) forward pre-hooks replace the
  placeholder's input state by the previous layer's last-token state, so earlier text tokens can
  attend to a summary of the whole sentence. The placeholder is never pooled.

Beside the recipe, :class:`moee.embed.config.EmbeddingConfig` carries the other options of this
module: prompt ensembles (:data:`PROMPT_SETS`, MetaEOL-style, Lei et al. 2024), the HS layer
(:func:`parse_hs_layer`, :func:`select_hs`) and the RW layers or per-layer weights
(:func:`parse_rw_layers`, :func:`select_rw`); reference standardisation is ``moee.embed.reference``.

Nothing here imports torch at module level (the configuration imports this module).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from moee.embed.methods import combine
from moee.embed.prompts import PLACEHOLDER, STABILITY_PROMPTS, fit_prompts, render_prompt

__all__ = [
    "ECHO_PREFIX",
    "PROMPT_SETS",
    "RECIPES",
    "RECIPE_NAMES",
    "Recipe",
    "TokenPrepending",
    "Tokenized",
    "combine_ensemble",
    "combine_features",
    "parse_hs_layer",
    "parse_rw_layers",
    "recipe_spec",
    "resolve_rw_layers",
    "rw_layer_indices",
    "select_hs",
    "select_rw",
    "token_prepending_layers",
    "weigh_rw",
]

#: The first copy of the text in echo embeddings (Springer et al. 2024's wording); the second copy,
#: the one pooled, follows it: the text itself, or the text rendered with the prompt.
ECHO_PREFIX = "Rewrite the sentence: {text}, rewritten sentence: "

#: Named prompt ensembles: ``prompt="stability"`` is the paper's nine stability prompts, averaged.
PROMPT_SETS: dict[str, tuple[str, ...]] = {"stability": tuple(STABILITY_PROMPTS)}


@dataclass(frozen=True)
class Tokenized:
    """One text's ids and what the recipe pools: positions ``pool_from ..`` (end of the sequence),
    except ``placeholder`` (token prepending's inserted token, never pooled)."""

    ids: list[int]
    pool_from: int = 0
    placeholder: int | None = None


# ---------------------------------------------------------------------------- tokenization helpers
def _offsets(
    tokenizer: Any, strings: list[str], recipe: str
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Ids, and per id its character span (``(0, 0)`` for special tokens), of ``strings``."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"recipe {recipe!r} needs a fast tokenizer (character offsets) to find the text's tokens; "
            f"{type(tokenizer).__name__} has none"
        )
    enc = tokenizer(
        strings,
        add_special_tokens=True,
        truncation=False,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
        verbose=False,
    )
    out = []
    for ids, spans, special in zip(
        enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"], strict=True
    ):
        spans = [(0, 0) if s else (int(a), int(b)) for (a, b), s in zip(spans, special, strict=True)]
        out.append((list(ids), spans))
    return out


def _first_token_after(spans: list[tuple[int, int]], char: int) -> int:
    """Index of the first non-special token that ends after character ``char`` (its first text
    token, also when a byte-level tokenizer glues the preceding space to it); ``len`` if none."""
    for i, (a, b) in enumerate(spans):
        if b > a and b > char:
            return i
    return len(spans)


def _tokenize_plain(
    emb: Any, texts: Sequence[str], template: str | None
) -> tuple[list[Tokenized], list[int]]:
    ids, cut, _ = fit_prompts(emb.tokenizer, texts, template, emb.max_length, side=emb.truncation_side)
    return [Tokenized(seq or list(emb.empty_ids)) for seq in ids], cut


def _tokenize_echo(emb: Any, texts: Sequence[str], template: str | None) -> tuple[list[Tokenized], list[int]]:
    full = ECHO_PREFIX + (template or PLACEHOLDER)
    prepare = template is not None  # without a prompt both copies are the text exactly as given
    ids, cut, kept = fit_prompts(
        emb.tokenizer, texts, full, emb.max_length, side=emb.truncation_side, prepare=prepare
    )
    if not ids:
        return [], cut
    rendered = [render_prompt(t, full, prepare=prepare) for t in kept]
    starts = [len(render_prompt(t, ECHO_PREFIX, prepare=prepare)) for t in kept]
    out = []
    for seq, (again, spans), start in zip(
        ids, _offsets(emb.tokenizer, rendered, "echo"), starts, strict=True
    ):
        if again != seq:  # the same string tokenized twice: a tokenizer that is not deterministic
            raise RuntimeError("the tokenizer gave different ids for the same echo text")
        out.append(Tokenized(seq, pool_from=min(_first_token_after(spans, start), len(seq) - 1)))
    return out, cut


def placeholder_id(tokenizer: Any) -> int:
    """The token token prepending inserts: the tokenizer's BOS (a token every model has seen as a
    sequence-level slot), else EOS, else the pad token. Its own embedding only feeds layer 0: from
    layer 1 on its state is the previous layer's last-token state."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("token_prepending needs a BOS, EOS or pad token to use as the placeholder")


def _tokenize_tp(emb: Any, texts: Sequence[str], template: str | None) -> tuple[list[Tokenized], list[int]]:
    if emb.max_length < 2:
        raise ValueError("token_prepending needs max_length >= 2 (one position goes to the placeholder)")
    ids, cut, kept = fit_prompts(emb.tokenizer, texts, template, emb.max_length - 1, side=emb.truncation_side)
    if not ids:
        return [], cut
    rendered = [render_prompt(t, template) for t in kept]
    char = template.index(PLACEHOLDER) if template is not None else 0
    token = placeholder_id(emb.tokenizer)
    out = []
    for seq, (again, spans) in zip(ids, _offsets(emb.tokenizer, rendered, "token_prepending"), strict=True):
        if again != seq:
            raise RuntimeError("the tokenizer gave different ids for the same text")
        if not seq:
            seq, spans = list(emb.empty_ids), [(0, 0)] * len(emb.empty_ids)
        at = _first_token_after(spans, char)
        out.append(Tokenized([*seq[:at], token, *seq[at:]], placeholder=at))
    return out, cut


# ---------------------------------------------------------------------------- token prepending hooks
def token_prepending_layers(n_layers: int) -> list[int]:
    """The decoder layers whose input placeholder state is replaced: layers 1 .. max(1, L // 4).

    Why these: layer 0's input is the token embedding, there is no previous layer's state to
    prepend; Fu et al. 2025 find the gain comes from the early layers and fades or turns into a loss
    when the replacement continues into the later ones, where the last token's state has turned
    into a next-token prediction. The first quarter of the stack (at least one layer) follows
    that finding for any depth: 8 of 32 layers, 2 of minilm-moe's 8, 1 of a 2-layer model.
    """
    if n_layers < 2:
        raise ValueError(f"token_prepending needs at least 2 decoder layers, the model has {n_layers}")
    return list(range(1, 1 + max(1, n_layers // 4)))


class TokenPrepending:
    """Forward pre-hooks on decoder layers that set the placeholder's input state to the last token's.

    ``layers`` (decoder-layer indices) defaults to :func:`token_prepending_layers`; ``layers=()``
    installs nothing (the placeholder stays an ordinary token). Before each forward call
    :meth:`set_batch` with the placeholder's and the last real token's position per row. The
    decoder layers come from the model's own declaration (``moee.capture.registry._decoder_layers``:
    the ``hidden_states`` recorder transformers models declare, else ``layers.<i>`` / ``h.<i>`` /
    ``blocks.<i>`` by name); a model where none are found is refused by name.
    """

    def __init__(self, model: Any, layers: Sequence[int] | None = None) -> None:
        from moee.capture.registry import _decoder_layers

        decoder = [m for _, m in _decoder_layers(model)]
        if not decoder:
            raise ValueError(f"token_prepending cannot find the decoder layers of {type(model).__name__}")
        chosen = token_prepending_layers(len(decoder)) if layers is None else list(layers)
        bad = [i for i in chosen if not (isinstance(i, int) and 1 <= i < len(decoder))]
        if bad:
            raise ValueError(f"token_prepending layers must be in 1..{len(decoder) - 1}, got {bad}")
        self.layers = chosen
        self._modules = [decoder[i] for i in chosen]
        self._handles: list[Any] = []
        self._rows: Any = None

    def set_batch(self, placeholder: Any, last: Any) -> None:
        """Declare the next forward's placeholder and last-token positions (``[B]`` long tensors)."""
        self._rows = (placeholder.long(), last.long())

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        import torch

        if self._rows is None:
            raise RuntimeError("call TokenPrepending.set_batch() before the forward pass")
        positional = bool(args) and isinstance(args[0], torch.Tensor)
        hidden = args[0] if positional else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:  # [B, T, (streams,) d]
            raise RuntimeError(f"{type(module).__name__}: expected [batch, seq, ..., hidden] input states")
        placeholder, last = (t.to(hidden.device) for t in self._rows)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        new = hidden.clone()
        new[rows, placeholder] = hidden[rows, last]
        if positional:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    def __enter__(self) -> TokenPrepending:
        try:
            for module in self._modules:
                self._handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._handles:
            self._handles.pop().remove()


# ---------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Recipe:
    """Everything moee knows about one recipe, so that adding one is one registry entry.

    ``tokenize(embedder, texts, template) -> (list[Tokenized], cut)`` builds the model input and
    the pooled positions; ``hooks(model) -> context manager`` (or ``None``) changes the forward;
    ``cost`` says what it does to the number of tokens (documented, and what the benchmark times).
    """

    name: str
    label: str
    citation: str
    cost: str
    tokenize: Callable[[Any, Sequence[str], str | None], tuple[list[Tokenized], list[int]]]
    hooks: Callable[[Any], AbstractContextManager] | None = None


#: The recipes, by ``EmbeddingConfig.recipe`` (``None`` = plain).
RECIPES: dict[str | None, Recipe] = {
    r.name if r.name != "plain" else None: r
    for r in (
        Recipe(
            "plain",
            "plain",
            "the paper (Jiang et al. 2023's PromptEOL with a prompt)",
            "1x tokens",
            _tokenize_plain,
        ),
        Recipe(
            "echo",
            "echo",
            'Springer et al. 2024, "Repetition improves language model embeddings"',
            "about 2x tokens (the text twice)",
            _tokenize_echo,
        ),
        Recipe(
            "token_prepending",
            "token prepending",
            'Fu et al. 2025, "Token Prepending: A Training-Free Approach for Eliciting Better Sentence '
            'Embeddings from LLMs"',
            "1 token more per text",
            _tokenize_tp,
            hooks=TokenPrepending,
        ),
    )
}
#: Every value ``recipe=`` accepts besides ``None``.
RECIPE_NAMES: tuple[str, ...] = tuple(k for k in RECIPES if k is not None)


def recipe_spec(recipe: str | None) -> Recipe:
    """The registry entry of ``recipe`` (``ValueError`` listing the recipes if unknown)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; expected None or one of: {', '.join(RECIPE_NAMES)}")
    return RECIPES[recipe]


def recipe_hooks(recipe: str | None, model: Any) -> AbstractContextManager:
    """The recipe's forward hooks on ``model`` (a no-op context for recipes without hooks)."""
    spec = recipe_spec(recipe)
    return spec.hooks(model) if spec.hooks is not None else nullcontext()


# ---------------------------------------------------------------------------- layer choice
def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def parse_hs_layer(value: Any) -> int | tuple[int, int] | None:
    """``None`` (the final-norm output), a decoder-layer index (negative counts from the end) or a
    half-open range ``(start, stop)`` averaged; also accepts ``range(a, b)``, ``[a, b]`` and the
    CLI forms ``"4"`` / ``"2:6"``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            if ":" in text:
                a, b = text.split(":")
                return parse_hs_layer((int(a), int(b)))
            return int(text)
        except ValueError:
            raise ValueError(f"hs_layer must be an int or START:STOP, got {value!r}") from None
    if isinstance(value, range):
        if value.step != 1:
            raise ValueError(f"hs_layer range must have step 1, got {value!r}")
        value = (value.start, value.stop)
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"hs_layer range must be (start, stop), got {value!r}")
        start, stop = (_int("hs_layer", v) for v in value)
        if (start >= 0) == (stop >= 0) and stop <= start:
            raise ValueError(f"hs_layer range {start}:{stop} is empty")
        return (start, stop)
    return _int("hs_layer", value)


def _resolve_layer_range(hs_layer: int | tuple[int, int], n_layers: int) -> list[int]:
    if isinstance(hs_layer, int):
        if not -n_layers <= hs_layer < n_layers:
            raise ValueError(
                f"hs_layer {hs_layer} is out of range for a model with {n_layers} decoder layers"
            )
        return [hs_layer % n_layers]
    start, stop = hs_layer
    chosen = list(range(n_layers))[start:stop]
    if not chosen or not (-n_layers <= start <= n_layers and -n_layers <= stop <= n_layers):
        raise ValueError(f"hs_layer range {start}:{stop} is out of range for {n_layers} decoder layers")
    return chosen


def select_hs(hs_all_layers: np.ndarray, hs_layer: int | tuple[int, int]) -> np.ndarray:
    """``[n, n_layers, d] -> [n, d]``: one decoder layer's output, or the mean over a range."""
    layers = _resolve_layer_range(hs_layer, hs_all_layers.shape[1])
    return hs_all_layers[:, layers].astype(np.float64).mean(axis=1).astype(np.float32)


def parse_rw_layers(value: Any) -> tuple[int, ...] | tuple[tuple[int, float], ...] | None:
    """``None`` (every MoE layer), MoE-layer indices (``[0, 2]``, ``"0,2"``) or per-layer weights
    (``{0: 0.5, 3: 2.0}``, ``[(0, 0.5), (3, 2.0)]``, ``"0:0.5,3:2"``); returns sorted indices, or
    sorted ``(index, weight)`` pairs. Indices may be negative (counted from the last MoE layer)."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
        try:
            if any(":" in v for v in items):
                value = {int(k): float(w) for k, w in (v.split(":") for v in items)}
            else:
                value = [int(v) for v in items]
        except ValueError:
            raise ValueError(f"rw_layers must be 'I,J,..' or 'I:W,J:W,..', got {value!r}") from None
    if isinstance(value, Mapping):
        value = list(value.items())
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"rw_layers must name at least one MoE layer, got {value!r}")
    if all(isinstance(v, (list, tuple)) for v in value):
        pairs = []
        for item in value:
            if len(item) != 2:
                raise ValueError(f"rw_layers weights must be (index, weight) pairs, got {item!r}")
            index, weight = _int("rw_layers index", item[0]), item[1]
            if (
                isinstance(weight, bool)
                or not isinstance(weight, Real)
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ValueError(
                    f"rw_layers weight of layer {index} must be a finite number >= 0, got {weight!r}"
                )
            pairs.append((index, float(weight)))
        indices = [i for i, _ in pairs]
        if len(set(indices)) != len(indices):
            raise ValueError(f"rw_layers names a layer twice: {indices}")
        if not any(w > 0 for _, w in pairs):
            raise ValueError("rw_layers weights are all 0: no routing would be left")
        return tuple(sorted(pairs))
    indices = [_int("rw_layers index", v) for v in value]
    if len(set(indices)) != len(indices):
        raise ValueError(f"rw_layers names a layer twice: {indices}")
    return tuple(sorted(indices))


def select_rw(
    rw: np.ndarray, rw_layers: tuple[int, ...] | tuple[tuple[int, float], ...], *, weighted: bool = True
) -> np.ndarray:
    """``[n, L, E] -> [n, L', E]``: the named MoE layers, in model order, each multiplied by its weight
    (``weighted=False``: the layers only; a reference standardises those, then :func:`weigh_rw` applies
    the weights, so z-scoring cannot undo them)."""
    resolved = resolve_rw_layers(rw_layers, rw.shape[1])
    out = rw[:, [i for i, _ in resolved]].astype(np.float32, copy=True)
    return weigh_rw(out, rw_layers, rw.shape[1]) if weighted else out


def resolve_rw_layers(
    rw_layers: tuple[int, ...] | tuple[tuple[int, float], ...], n_layers: int
) -> list[tuple[int, float]]:
    """``(index, weight)`` per named MoE layer, indices made non-negative and sorted (model order)."""
    pairs = [(p, 1.0) if isinstance(p, int) else p for p in rw_layers]
    resolved = []
    for index, weight in pairs:
        if not -n_layers <= index < n_layers:
            raise ValueError(
                f"rw_layers index {index} is out of range for a model with {n_layers} MoE layers"
            )
        resolved.append((index % n_layers, weight))
    if len({i for i, _ in resolved}) != len(resolved):
        raise ValueError(
            f"rw_layers names a layer twice once negative indices are resolved: {list(rw_layers)}"
        )
    return sorted(resolved)


def weigh_rw(
    selected: np.ndarray, rw_layers: tuple[int, ...] | tuple[tuple[int, float], ...], n_layers: int
) -> np.ndarray:
    """``[n, L', E]`` layers chosen by ``rw_layers`` from ``n_layers`` (model order) times their
    weights (a copy when any weight is not 1)."""
    weights = [w for _, w in resolve_rw_layers(rw_layers, n_layers)]
    if len(weights) != selected.shape[1]:
        raise ValueError(f"rw_layers names {len(weights)} layers, the features hold {selected.shape[1]}")
    if all(w == 1.0 for w in weights):
        return selected
    return selected * np.asarray(weights, dtype=np.float32)[None, :, None]


def rw_layer_indices(rw_layers: Any) -> list[int] | None:
    """The MoE layers ``rw_layers`` names, without weights: what a reference's statistics depend on
    (the weights apply after standardisation)."""
    if rw_layers is None:
        return None
    return [p if isinstance(p, int) else p[0] for p in rw_layers]


def rw_layer_count(rw_layers: Sequence[Any] | None, n_layers: int) -> int:
    """How many MoE layers RW keeps under ``rw_layers``."""
    return n_layers if rw_layers is None else len(rw_layers)


# ---------------------------------------------------------------------------- ensembles
def combine_features(
    hs: np.ndarray, rw: np.ndarray, method: str, *, alpha: float = 1.0, normalize: bool = True
) -> np.ndarray:
    """Vectors from per-prompt features ``hs [n, P, d]`` / ``rw [n, P, L, E]``: ``combine`` per
    prompt, then :func:`combine_ensemble` (for ``P = 1`` exactly ``combine``)."""
    vectors = [
        combine(hs[:, p], rw[:, p], method, alpha=alpha, normalize=normalize) for p in range(hs.shape[1])
    ]
    return combine_ensemble(vectors, normalize)


def combine_ensemble(vectors: Sequence[np.ndarray], normalize: bool) -> np.ndarray:
    """The ensemble of one text under several prompts: the mean of the single-prompt vectors (each
    already built by ``combine``), L2-normalised again when ``normalize`` (a zero row stays zero)."""
    if len(vectors) == 1:
        return vectors[0]
    mean = np.mean(np.stack([v.astype(np.float64) for v in vectors]), axis=0)
    if normalize:
        norms = np.linalg.norm(mean, axis=1, keepdims=True)
        mean = np.divide(mean, norms, out=np.zeros_like(mean), where=norms > 0)
    return np.ascontiguousarray(mean, dtype=np.float32)
