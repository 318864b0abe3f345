"""MoEEmbedder: HS, RW and MoEE embeddings from one forward pass of a Mixture-of-Experts LM.

What happens in ``encode`` / ``trace``:

1. texts are checked (``moee.embed.validation``) and rendered with the prompt
   (``moee.embed.prompts``);
2. they are tokenized once, **sorted by length** and cut into batches (little padding), each batch
   **left padded** with explicit ``position_ids`` (positions count real tokens only, so a text gets
   the same positions whatever it is batched with);
3. one forward of the backbone (no LM head) under ``torch.inference_mode`` inside a
   :class:`moee.capture.RoutingRecorder`, whose hooks keep only the pooled routing and hidden
   state per text;
4. rows are put back in input order and ``moee.embed.methods.combine`` builds the vectors, row by
   row (no batch statistics): a text gets the same vector in any batch, order, padding or batch size.

Deliberate behaviour:

* **Empty texts** are kept: a text that tokenizes to nothing (e.g. ``""`` with a tokenizer that adds
  no BOS) is encoded as the single token BOS (EOS if there is no BOS, else the pad token), so its
  row is a well-defined, text-independent vector. With a prompt, ``""`` is just the prompt.
* **Long texts** are truncated to the model's maximum length (the smaller of the tokenizer's
  ``model_max_length`` and the config's ``max_position_embeddings``) on the tokenizer's
  ``truncation_side`` (right by default). Only the text is cut, never the prompt template or the
  special tokens (``moee.embed.prompts.tokenize_prompts``), so the pooled last token of a long
  PromptEOL text is still the template's; one warning says how many texts were cut and by how
  many tokens.
* No row is ever dropped or reordered.
* **Threads** may share an embedder (or several embedders of one model): each traced forward holds
  the model's lock (:func:`model_lock`), so concurrent calls run one at a time and return exactly
  the serial results.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import backbone, find_routers
from moee.embed.config import (
    MODEL_DEFAULT,
    EmbeddingConfig,
    load_model_config,
    load_model_prompts,
    normalize_prompts,
    resolve_config,
    save_model_config,
)
from moee.embed.methods import DEFAULT_SCORE, output_dim, similarity
from moee.embed.prompts import resolve_prompt
from moee.embed.recipes import (
    Tokenized,
    combine_features,
    recipe_hooks,
    recipe_spec,
    resolve_rw_layers,
    rw_layer_indices,
    select_hs,
    select_rw,
    weigh_rw,
)
from moee.embed.reference import weights_digest, weights_fingerprint
from moee.embed.validation import check_positive_int, check_texts
from moee.loading import MINILM_MOE_DIR  # re-exported: the folder of the shipped minilm-moe
from moee.models.bundled import resolve_model

if TYPE_CHECKING:
    from moee.loading import LoadOptions

__all__ = ["MoEEmbedder", "RoutingTrace", "TokenRoutes", "MINILM_MOE_DIR", "model_lock"]

logger = logging.getLogger(__name__)

#: Inputs with more texts than this get a progress bar when ``show_progress_bar=None``.
PROGRESS_BAR_MIN_TEXTS = 256

# Upper bound on a believable tokenizer `model_max_length` (tokenizers use 1e30 for "unset").
_UNSET_MAX_LENGTH = 10**6

# One lock per model object, kept beside it (not on it, so the model still deep-copies and pickles).
_MODEL_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The re-entrant lock every traced forward of ``model`` holds.

    Capture hooks sit on the model's shared router modules, so a forward from one thread fires the
    hooks of every recorder installed by another thread: without the lock concurrent calls return
    rows of the wrong texts or fail. Every :class:`MoEEmbedder` of one model shares this lock.
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


@dataclass
class RoutingTrace:
    """Pooled routing and hidden states of ``n`` texts, rows in input order.

    ``rw [n, L, E]`` float32: per MoE layer (model order, names in ``layers``) the dense routing
    scores over all ``E = n_experts`` experts; ``hs [n, hidden]`` float32: the final-norm hidden
    state; ``hs_all_layers [n, n_layers, hidden]`` every decoder layer's output (``hs_layers=True``),
    else ``None``.
    """

    rw: np.ndarray
    hs: np.ndarray
    layers: list[str]
    n_experts: int
    hs_all_layers: np.ndarray | None = None
    pooling: str = "last"
    score: str = DEFAULT_SCORE
    prompt: str | None = None


@dataclass
class TokenRoutes:
    """Token-level routes of one text: ``input_ids [T]`` (real tokens), ``probs [T, L, E]`` float32.

    ``selection [T, L, k]`` int64: the experts each router chose for each token (see
    ``RoutingRecorder.token_selection``; -1 pads layers with a smaller k), ``None`` when a router
    neither returns its choice nor declares its k; ``selection_returned [L]``: per layer, whether
    those are the indices the router itself returned (else re-derived from its selection scores).
    """

    index: int
    input_ids: np.ndarray
    probs: np.ndarray
    selection: np.ndarray | None = None
    selection_returned: list[bool] | None = None


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _text_config(model: nn.Module):
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


class MoEEmbedder:
    """Training-free text embeddings from a Mixture-of-Experts causal LM (HS, RW, MoEE).

    ``MoEEmbedder(model, tokenizer)`` wraps a model already loaded (any transformers MoE model that
    :func:`moee.capture.find_routers` understands; it is put in eval mode, and the tokenizer's padding
    side is set to left); :meth:`from_pretrained` loads one. ``max_length`` defaults to the model's
    maximum length. Raises ``ValueError("no MoE router found in <ModelClass>")`` for a model
    without routers.

    ``model_config`` is the model's own embedding configuration (``moee.embed.config``): by default
    the ``moee_embedding.json`` of the model's local folder (``name_or_path``, else the model's
    ``name_or_path``), ``None`` when it has none. Every keyword ``encode`` / ``trace`` leave out comes
    from it, else from ``EmbeddingConfig()`` (:func:`moee.embed.config.resolve_config`).
    ``prompts`` are the model's named prompts (``encode(prompt_name=...)``, ``encode_query``,
    ``encode_document``): by default the ``prompts`` of that same file.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_length: int | None = None,
        name_or_path: str | None = None,
        model_config: EmbeddingConfig | None = None,
        prompts: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if tokenizer is None or not callable(tokenizer):
            raise TypeError("tokenizer must be a transformers tokenizer (callable)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._lock = model_lock(model)
        self._calls = threading.local()  # per-thread facts about the last call (last_truncation)
        self.routers = find_routers(model)
        sizes = sorted({r.n_experts for r in self.routers})
        if len(sizes) != 1:
            raise ValueError(
                f"{type(model).__name__} has MoE layers with different numbers of experts {sizes}; "
                "RW needs one expert count per layer"
            )
        self.n_experts = sizes[0]
        self.n_moe_layers = len(self.routers)
        self.layers = [r.name for r in self.routers]
        text_config = _text_config(model)
        self.hidden_size = int(text_config.hidden_size)
        self.name_or_path = name_or_path or getattr(model, "name_or_path", None) or type(model).__name__
        self.max_length = (
            check_positive_int("max_length", max_length)
            if max_length is not None
            else self._default_max_length(text_config)
        )
        self._backbone = backbone(model)
        forward = self._backbone.forward
        self._extra_kwargs = {k: False for k in ("use_cache",) if _accepts(forward, k)}
        self._pass_positions = _accepts(forward, "position_ids")
        self._pad_id = self._prepare_pad_token()
        self._empty_ids = self._empty_text_ids()
        if model_config is not None and not isinstance(model_config, EmbeddingConfig):
            raise TypeError(f"model_config must be an EmbeddingConfig, got {type(model_config).__name__}")
        #: The configuration saved with the model (``None``: it has none); see :meth:`resolve_config`.
        self.model_config = (
            model_config
            if model_config is not None
            else load_model_config(self.name_or_path, local_only=True)
        )
        #: Named prompts (name -> prompt), e.g. ``{"query": "query: {text}", "document": None}``.
        self.prompts = (
            normalize_prompts(prompts)
            if prompts is not None
            else load_model_prompts(self.name_or_path, local_only=True)
        )
        self._digest: str | None = None
        #: The weights as loaded: a digest of the weight files only stands while this holds.
        self._loaded_fingerprint = weights_fingerprint(model)
        self._digest_fingerprint: tuple | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path | None = None,
        options: LoadOptions | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        allow_pickle_weights: bool = False,
        tokenizer: str | None = None,
        **hf_kwargs: Any,
    ) -> MoEEmbedder:
        """Load a causal LM and its tokenizer with :func:`moee.loading.load_model`, the loader every
        command uses (``dtype``, ``device_map`` and any other keyword are passed through to
        transformers). ``None`` loads the default model (``moee.models.bundled.DEFAULT_MODEL``); a
        training checkpoint folder (``moee train``'s ``run/step_XXXXXXXX``) loads with the tokenizer its run names, and
        ``tokenizer`` (a directory or Hub id) overrides the model's own. Weights load from
        safetensors only unless ``allow_pickle_weights`` (see :func:`moee.loading.load_causal_lm`).

        ``options`` (a :class:`moee.loading.LoadOptions`, what every CLI command passes) gives the
        device, dtype, device_map (with max_memory and offload_folder), 4-bit, remote-code, pickle and
        tokenizer choices in one object; it cannot be combined with those keywords. The model's
        embedding configuration (``moee_embedding.json``) comes from its folder or Hub repository
        (:func:`moee.embed.config.load_model_config`)."""
        from moee.loading import LoadOptions, load_model, split_revision

        if options is not None:
            given = [
                k
                for k, v in (("device", device), ("dtype", dtype), ("tokenizer", tokenizer))
                if v is not None
            ]
            given += ["trust_remote_code"] if trust_remote_code else []
            given += ["allow_pickle_weights"] if allow_pickle_weights else []
            given += [
                k
                for k in ("device_map", "max_memory", "offload_folder", "quantization_config")
                if k in hf_kwargs
            ]
            if given:
                raise TypeError(f"pass {', '.join(given)} inside options, not beside it")
        else:
            if device is not None and "device_map" in hf_kwargs:
                raise ValueError("pass either device or device_map, not both")
            options = LoadOptions(
                device=None if device is None else str(device),
                trust_remote_code=trust_remote_code,
                allow_pickle_weights=allow_pickle_weights,
                tokenizer=tokenizer,
            )
        name_or_path = str(resolve_model(name_or_path))  # None or a shipped model's name: its folder
        if dtype is not None:
            hf_kwargs["dtype"] = dtype
        loaded = load_model(name_or_path, options, **hf_kwargs)
        name, revision = split_revision(name_or_path)
        hub = {"revision": hf_kwargs.get("revision", revision), "cache_dir": hf_kwargs.get("cache_dir")}
        model_config = load_model_config(
            name, **hub
        )  # the model's own embedding configuration, also from the Hub
        prompts = load_model_prompts(name, **hub)
        return cls(
            loaded.model,
            loaded.tokenizer,
            name_or_path=name_or_path,
            model_config=model_config,
            prompts=prompts,
        )

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the model (safetensors), its tokenizer and its embedding configuration
        (``moee_embedding.json`` with the named prompts, a reference copied beside it) to ``directory``; the folder
        then loads with :meth:`from_pretrained` and embeds exactly like this embedder does with no
        keyword given. Returns the folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        config = self.default_config
        save_model_config(config, directory, prompts=self.prompts)
        if config.reference is not None:
            self._restamp_reference(directory / Path(config.reference).name)
        return directory

    def _restamp_reference(self, copied: Path) -> None:
        """A reference copied by :meth:`save_pretrained` belongs to the saved folder's weights: it is
        checked against this model's (the same tensors), then recorded under the folder's weights hash."""
        import json
        from types import SimpleNamespace

        from moee.embed.reference import load_cached, reference_paths, weights_digest
        from moee.io import seal, write_json_atomic

        config = self.default_config
        self.check_reference(load_cached(config.reference), config)
        sidecar = reference_paths(copied)[1]
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        saved = weights_digest(SimpleNamespace(name_or_path=str(copied.parent)))
        meta["model"] = {**meta.get("model", {}), "revision": saved}
        write_json_atomic(sidecar, seal(meta))  # its content digest covers the new revision

    # ------------------------------------------------------------------ set-up helpers
    def _default_max_length(self, text_config) -> int:
        candidates = [getattr(text_config, "max_position_embeddings", None)]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < _UNSET_MAX_LENGTH:
            candidates.append(tok_max)
        candidates = [int(c) for c in candidates if isinstance(c, int) and c > 0]
        return min(candidates) if candidates else 2048

    def _prepare_pad_token(self) -> int:
        """Left padding; a missing pad token becomes EOS (or UNK, else id 0): padded positions are
        masked, so the choice never changes a vector."""
        tok = self.tokenizer
        if hasattr(tok, "padding_side"):
            tok.padding_side = "left"
        if getattr(tok, "pad_token_id", None) is None:
            for name in ("eos_token", "unk_token"):
                if getattr(tok, name, None) is not None:
                    tok.pad_token = getattr(tok, name)
                    break
        pad = getattr(tok, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _empty_text_ids(self) -> list[int]:
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self.tokenizer, name, None)
            if isinstance(value, int):
                return [value]
        return [self._pad_id]

    @property
    def device(self) -> torch.device:
        """Where input batches go; with a ``device_map`` (offloaded layers sit on ``meta``) that is the
        input embedding's execution device, see :func:`moee.loading.input_device`."""
        from moee.loading import input_device

        return input_device(self.model)

    @property
    def last_truncation(self) -> int:
        """Texts the calling thread's last ``encode``/``trace`` truncated to ``max_length``.

        A count per call: Python shows the same warning only once per place, so callers that embed
        in chunks (``moee embed``) sum this instead of relying on the warnings.
        """
        return getattr(self._calls, "truncated", 0)

    def output_dim(self, method: str) -> int:
        """Width of ``method``'s vectors for this model."""
        return output_dim(method, self.hidden_size, self.n_moe_layers, self.n_experts)

    @property
    def truncation_side(self) -> str:
        """Where a long text is cut: the tokenizer's ``truncation_side`` (right by default)."""
        return "left" if getattr(self.tokenizer, "truncation_side", "right") == "left" else "right"

    @property
    def empty_ids(self) -> list[int]:
        """The ids an empty text becomes (see the module docstring)."""
        return list(self._empty_ids)

    def resolve_config(self, **explicit: Any) -> EmbeddingConfig:
        """The configuration of a call: the keywords given (not :data:`MODEL_DEFAULT`), else the
        model's saved configuration, else ``EmbeddingConfig()`` (:func:`moee.embed.config.resolve_config`)."""
        return resolve_config(self.model_config, **explicit)

    @property
    def default_config(self) -> EmbeddingConfig:
        """What ``encode(texts)`` uses: the model's saved configuration, else ``EmbeddingConfig()``."""
        return self.resolve_config()

    @property
    def weights_digest(self) -> str:
        """Short hash of the weights (``moee.embed.reference.weights_digest``), computed once and
        again only when the weights change in memory (``weights_fingerprint``); weights modified
        after loading are hashed from the live parameters, not from the files they were read from."""
        now = weights_fingerprint(self.model)
        if self._digest is None or now != self._digest_fingerprint:
            self._digest = weights_digest(self, live=now != self._loaded_fingerprint)
            self._digest_fingerprint = now
        return self._digest

    def reference_features(self, config: EmbeddingConfig) -> dict[str, Any]:
        """What a reference records and is checked against besides the weights: the configuration's
        features and this embedder's ``max_length`` (a different cut gives different statistics)."""
        return {**config.feature_dict(), "max_length": self.max_length}

    def check_reference(self, reference: Any, config: EmbeddingConfig) -> None:
        """Refuse ``reference`` (a ``moee.embed.reference.Reference``) unless it was fitted on these
        weights under ``config``'s features and this ``max_length``."""
        reference.check(self.weights_digest, self.reference_features(config), config.reference)

    # ------------------------------------------------------------------ tokenization and batching
    def _tokenize(self, texts: Sequence[str], template: str | None = None) -> list[list[int]]:
        """Ids of ``texts`` rendered with ``template``; a long text is cut inside the template."""
        return [t.ids for t in self._tokenize_recipe(texts, template, None)]

    def _tokenize_recipe(
        self, texts: Sequence[str], template: str | None, recipe: str | None
    ) -> list[Tokenized]:
        """The recipe's ids and pooled positions of ``texts`` (``moee.embed.recipes``); one warning
        counts the texts cut to ``max_length``."""
        if not texts:
            return []
        out, cut = recipe_spec(recipe).tokenize(self, texts, resolve_prompt(template))
        n_long = sum(1 for c in cut if c)
        self._calls.truncated = n_long
        if n_long:
            lost = [c for c in cut if c]
            warnings.warn(
                f"{n_long} of {len(out)} texts were longer than {self.max_length} tokens: their text was "
                f"cut on the {self.truncation_side} by {min(lost)}-{max(lost)} tokens ({sum(lost)} in all), "
                + ("the prompt template kept whole" if template is not None else "special tokens kept"),
                stacklevel=4,
            )
        return out

    @staticmethod
    def _pool_marks(toks: list[Tokenized], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded ``pool_mask [B, width]`` of the recipe's pooled positions, and the
        placeholder's position per row (``None`` when no row has one)."""
        pool = torch.zeros((len(toks), width), dtype=torch.long)
        marks = []
        for row, tok in enumerate(toks):
            pad = width - len(tok.ids)
            pool[row, pad + tok.pool_from :] = 1
            if tok.placeholder is not None:
                pool[row, pad + tok.placeholder] = 0
                marks.append(pad + tok.placeholder)
        placeholder = torch.tensor(marks, dtype=torch.long) if len(marks) == len(toks) else None
        return pool, placeholder

    def _batch_tensors(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        """Left-pad ``seqs`` into input_ids / attention_mask (/ position_ids) on the model device."""
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if self._pass_positions:
            batch["position_ids"] = (mask.cumsum(dim=1) - 1).clamp(min=0)
        device = self.device
        return {k: v.to(device) for k, v in batch.items()}

    def _forward(self, batch: dict[str, torch.Tensor]) -> None:
        self._backbone(**batch, **self._extra_kwargs)

    @staticmethod
    def _progress(total: int, n_texts: int, show: Any, desc: str):
        from tqdm.auto import tqdm

        if show is not None and not isinstance(show, bool) and hasattr(show, "update"):
            return contextlib.nullcontext(show)  # the caller's bar, e.g. one over every chunk of a run
        if show is None:
            show = n_texts > PROGRESS_BAR_MIN_TEXTS
        return tqdm(total=total, disable=not show, desc=desc, unit="text")

    # ------------------------------------------------------------------ public API
    def trace(
        self,
        texts: Sequence[str],
        *,
        pooling: str = MODEL_DEFAULT,
        prompt: str | None = MODEL_DEFAULT,
        score: str = MODEL_DEFAULT,
        hs_layers: bool = False,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        recipe: str | None = MODEL_DEFAULT,
    ) -> RoutingTrace:
        """Pooled routing weights and hidden states of ``texts`` (rows in input order), under one
        prompt and ``recipe`` (``None``, ``"echo"`` or ``"token_prepending"``, ``moee.embed.recipes``).
        A keyword left out comes from the model's configuration (:meth:`resolve_config`); the result
        records the values used. The layer choices and the reference apply later (:meth:`features`)."""
        texts = check_texts(texts)
        config = self.resolve_config(pooling=pooling, prompt=prompt, score=score, recipe=recipe)  # checked
        if config.is_ensemble:
            raise ValueError(
                f"trace runs one prompt; the configuration's prompt is the ensemble {config.prompt_label!r}: "
                "pass prompt= (or use features() for an ensemble)"
            )
        return self._trace(
            texts,
            config,
            config.prompt_template,
            hs_layers=hs_layers,
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
        )

    def _trace(
        self,
        texts: list[str],
        config: EmbeddingConfig,
        template: str | None,
        *,
        hs_layers: bool,
        batch_size: int,
        show_progress_bar: bool | None,
    ) -> RoutingTrace:
        """:meth:`trace` of checked texts under ``config``'s pooling, score and recipe (an
        ``EmbeddingConfig`` is checked when it is built: trusted here) and one of its prompt templates."""
        pooling, score, recipe = config.pooling, config.score, config.recipe
        batch_size = check_positive_int("batch_size", batch_size)
        n = len(texts)
        rw = np.zeros((n, self.n_moe_layers, self.n_experts), dtype=np.float32)
        hs = np.zeros((n, self.hidden_size), dtype=np.float32)
        hs_all = None
        with self._lock:  # a fast tokenizer's settings are shared state too
            self._calls.truncated = 0
            toks = self._tokenize_recipe(texts, template, recipe)
        order = sorted(range(n), key=lambda i: -len(toks[i].ids))  # longest first: memory errors show early
        with (
            self._lock,
            RoutingRecorder(
                self.model, self.routers, pooling=pooling, score=score, hs_layers=hs_layers
            ) as recorder,
            recipe_hooks(recipe, self.model) as hooks,
            torch.inference_mode(),
            self._progress(n, n, show_progress_bar, "moee") as bar,
        ):
            for start in range(0, n, batch_size):
                rows = order[start : start + batch_size]
                chunk = [toks[i] for i in rows]
                batch = self._batch_tensors([t.ids for t in chunk])
                pool, placeholder = self._pool_marks(chunk, batch["input_ids"].shape[1])
                recorder.set_batch(batch["attention_mask"], pool.to(batch["attention_mask"].device))
                if hooks is not None:
                    last = torch.full((len(chunk),), batch["input_ids"].shape[1] - 1, dtype=torch.long)
                    hooks.set_batch(placeholder, last)  # left padding: the last real token is the last column
                self._forward(batch)
                rw[rows] = recorder.pooled_rw().numpy()
                hs[rows] = recorder.pooled_hs().numpy()
                if hs_layers:
                    layer_hs = recorder.pooled_hs_all_layers().numpy()
                    if hs_all is None:
                        hs_all = np.zeros((n, *layer_hs.shape[1:]), dtype=np.float32)
                    hs_all[rows] = layer_hs
                bar.update(len(rows))
        if hs_layers and hs_all is None:
            hs_all = np.zeros((0, 0, self.hidden_size), dtype=np.float32)
        return RoutingTrace(
            rw=rw,
            hs=hs,
            layers=list(self.layers),
            n_experts=self.n_experts,
            hs_all_layers=hs_all,
            pooling=pooling,
            score=score,
            prompt=template,
        )

    def encode(
        self,
        texts: str | Sequence[str],
        *,
        method: str = MODEL_DEFAULT,
        pooling: str = MODEL_DEFAULT,
        prompt: str | Sequence[str] | None = MODEL_DEFAULT,
        alpha: float = MODEL_DEFAULT,
        score: str = MODEL_DEFAULT,
        batch_size: int = 32,
        normalize: bool = MODEL_DEFAULT,
        show_progress_bar: bool | None = None,
        config: EmbeddingConfig | None = None,
        recipe: str | None = MODEL_DEFAULT,
        hs_layer: int | tuple[int, int] | range | None = MODEL_DEFAULT,
        rw_layers: Sequence[int] | dict[int, float] | None = MODEL_DEFAULT,
        reference: str | Path | None = MODEL_DEFAULT,
        prompt_name: str | None = None,
        normalize_embeddings: bool | None = None,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: str | torch.device | None = None,
    ) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """Embed ``texts``: float32 ``[len(texts), dim]``, rows in input order (one ``str``: its
        1-D vector).

        ``method`` is ``hs``, ``rw``, ``moee_concat`` or ``moee_sum`` (see ``moee.embed.methods``);
        ``pooling`` ``last`` or ``mean``; ``score`` ``native`` (the default: the architecture's own
        scoring rule, which for softmax routers is the paper's dense softmax), ``softmax`` (the
        paper's formula for every architecture), ``selection`` or ``logits`` (see
        ``moee.embed.methods.SCORES``); ``prompt`` ``None``, ``"prompteol"``, a stability-prompt name,
        a template with ``{text}``, or a list of them / ``"stability"`` (an ensemble: the mean of the
        single-prompt vectors); ``alpha >= 0`` weighs RW in ``moee_sum``. The recipe options
        (``moee.embed.recipes``, ``docs/RECIPES.md``): ``recipe`` ``None``, ``"echo"`` or
        ``"token_prepending"``; ``hs_layer`` a decoder layer or a range averaged; ``rw_layers`` MoE
        layers or ``{layer: weight}``; ``reference`` a file of :meth:`fit_reference`.

        A keyword left out comes from the model's saved configuration (:attr:`model_config`, its
        folder's ``moee_embedding.json``), else from ``EmbeddingConfig()`` (:meth:`resolve_config`).
        Instead of these keywords, ``config`` may give them as one :class:`EmbeddingConfig`.

        The sentence-transformers keywords: ``prompt_name`` picks a prompt of :attr:`prompts` (it
        replaces the configuration's prompt); ``normalize_embeddings`` is ``normalize``;
        ``convert_to_tensor`` returns a ``torch.Tensor``, ``convert_to_numpy=False`` a list of 1-D
        tensors; ``device`` is where the model runs, so it must be the model's device (load the
        model there: ``from_pretrained(..., device=...)``).
        """
        single = isinstance(texts, str)
        texts = check_texts([texts] if single else texts)
        if normalize_embeddings is not None:
            if normalize is not MODEL_DEFAULT:
                raise TypeError(
                    "pass normalize or normalize_embeddings (its sentence-transformers name), not both"
                )
            normalize = bool(normalize_embeddings)
        self._check_device(device)
        if prompt_name is not None:
            named = self.named_prompt(prompt_name)
            if prompt is not MODEL_DEFAULT:
                raise TypeError(f"pass prompt or prompt_name={prompt_name!r}, not both")
            if config is not None:
                config = config.replace(prompt=named)
            else:
                prompt = named
        config = self._config(
            config,
            method=method,
            pooling=pooling,
            prompt=prompt,
            alpha=alpha,
            score=score,
            normalize=normalize,
            recipe=recipe,
            hs_layer=hs_layer,
            rw_layers=rw_layers,
            reference=reference,
        )
        alpha = config.numeric_alpha()
        if not texts:
            vectors = np.zeros((0, self.config_dim(config)), dtype=np.float32)
        else:
            hs, rw = self.features(texts, config, batch_size=batch_size, show_progress_bar=show_progress_bar)
            vectors = combine_features(hs, rw, config.method, alpha=alpha, normalize=config.normalize)
        if single:
            vectors = vectors[0]
        if convert_to_tensor:
            return torch.from_numpy(vectors).to(self.device)
        if not convert_to_numpy:
            tensors = torch.from_numpy(vectors).to(self.device)
            return tensors if single else list(tensors)
        return vectors

    def _check_device(self, device: str | torch.device | None) -> None:
        if device is None:
            return
        wanted, here = torch.device(device), self.device
        if wanted.type != here.type or (wanted.index is not None and wanted.index != here.index):
            raise ValueError(
                f"device={str(device)!r}: the model is on {here}; moee does not move a loaded model per call, "
                "load it there instead: MoEEmbedder.from_pretrained(..., device=...)"
            )

    def named_prompt(self, name: str) -> str | tuple[str, ...] | None:
        """The prompt :attr:`prompts` names ``name`` (an error lists the names there are)."""
        if name not in self.prompts:
            have = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(
                f"prompt_name={name!r} is not one of the model's prompts ({have}); add it to the "
                "'prompts' of its moee_embedding.json, or set embedder.prompts[name]"
            )
        return self.prompts[name]

    def encode_query(self, texts: str | Sequence[str], **kwargs: Any) -> Any:
        """``encode`` with the model's ``query`` prompt (:attr:`prompts`; without one, the model's
        configured prompt), as sentence-transformers' ``encode_query``."""
        return self._encode_role("query", texts, kwargs)

    def encode_document(self, texts: str | Sequence[str], **kwargs: Any) -> Any:
        """``encode`` with the model's ``document`` prompt (:attr:`prompts`; without one, the
        model's configured prompt), as sentence-transformers' ``encode_document``."""
        return self._encode_role("document", texts, kwargs)

    def _encode_role(self, role: str, texts: Any, kwargs: dict[str, Any]) -> Any:
        if "prompt_name" not in kwargs and "prompt" not in kwargs and role in self.prompts:
            kwargs["prompt_name"] = role
        return self.encode(texts, **kwargs)

    @property
    def similarity_fn_name(self) -> str:
        """How the default configuration's vectors compare (``moee.embed.methods``: cosine for every
        method; MoEE sum is built so that its cosine is the paper's ``cos_h + alpha cos_r``)."""
        return self.default_config.spec.similarity

    def similarity(self, a: Any, b: Any) -> Any:
        """The ``[len(a), len(b)]`` similarity matrix of two embedding sets (or single vectors) under
        :attr:`similarity_fn_name`; numpy in, numpy out; a tensor in, a tensor out."""
        return similarity(a, b, self.similarity_fn_name)

    def token_counter(self) -> MoEEmbedder:
        """A view of this embedder with its own copy of the tokenizer and its own lock: its
        :meth:`token_lengths` (and tokenizer) can run on another thread while this embedder's forwards
        hold the model's lock (a server counts the tokens of new requests during a forward). Only
        for tokenizing: its forwards would not be serialised with this embedder's."""
        import copy

        view = copy.copy(self)
        view.tokenizer = copy.deepcopy(self.tokenizer)
        view._lock = threading.RLock()
        view._calls = threading.local()
        return view

    def token_lengths(self, texts: Sequence[str], config: EmbeddingConfig | None = None) -> list[int]:
        """Tokens each text's forward runs on under ``config`` (its prompt template and recipe
        included, after the cut to ``max_length``; an ensemble: its longest prompt): what a server
        budgets batches with."""
        texts = check_texts(texts)
        config = config if config is not None else self.default_config
        lengths = [0] * len(texts)
        with self._lock:
            for template in config.prompt_templates:
                for i, tok in enumerate(self._tokenize_recipe(texts, template, config.recipe)):
                    lengths[i] = max(lengths[i], len(tok.ids))
        return lengths

    def _config(self, config: EmbeddingConfig | None, **keywords: Any) -> EmbeddingConfig:
        """``config``, or the keywords given resolved against the model's configuration."""
        given = {k: v for k, v in keywords.items() if v is not MODEL_DEFAULT}
        if config is None:
            return self.resolve_config(**given)
        if not isinstance(config, EmbeddingConfig):
            raise TypeError(f"config must be an EmbeddingConfig, got {type(config).__name__}")
        if given:
            raise TypeError(f"pass {', '.join(sorted(given))} inside config, not beside it")
        return config

    def config_dim(self, config: EmbeddingConfig) -> int:
        """Width of ``config``'s vectors for this model."""
        return config.width(self.hidden_size, self.n_moe_layers, self.n_experts)

    def features(
        self,
        texts: Sequence[str],
        config: EmbeddingConfig,
        *,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        standardize: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pooled features a configuration combines: ``hs [n, P, d]`` and ``rw [n, P, L', E]``
        float32, one slice per ensemble prompt (``P = 1`` without an ensemble), after the recipe, the
        layer choice and (``standardize``) the reference's z-scores. One forward pass per prompt."""
        texts = check_texts(texts)
        reference = None
        if standardize and config.reference is not None:
            from moee.embed.reference import load_cached

            reference = load_cached(config.reference)
            self.check_reference(reference, config)
        hs_out, rw_out = [], []
        for template in config.prompt_templates:
            trace = self._trace(
                texts,
                config,
                template,
                hs_layers=config.hs_layer is not None,
                batch_size=batch_size,
                show_progress_bar=show_progress_bar,
            )
            hs = trace.hs if config.hs_layer is None else select_hs(trace.hs_all_layers, config.hs_layer)
            n_layers = trace.rw.shape[1]
            # the named layers (model order); their weights after the z-scores, which would undo them
            layers = (
                None
                if config.rw_layers is None
                else [i for i, _ in resolve_rw_layers(config.rw_layers, n_layers)]
            )
            rw = trace.rw if layers is None else select_rw(trace.rw, config.rw_layers, weighted=False)
            if reference is not None:
                hs, rw = reference.apply(hs, rw, rw_layers=layers)
            if config.rw_layers is not None:
                rw = weigh_rw(rw, config.rw_layers, n_layers)
            hs_out.append(hs)
            rw_out.append(rw)
        return np.stack(hs_out, axis=1), np.stack(rw_out, axis=1)

    def fit_reference(
        self,
        texts: Sequence[str],
        path: str | Path,
        *,
        config: EmbeddingConfig | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        **keywords: Any,
    ) -> Path:
        """Fit per-dimension mean and std of HS and RW on ``texts`` under a configuration (``config``
        or ``encode``'s keywords; its method, alpha and reference do not matter) and write them to
        ``path`` (``.safetensors`` + ``.json``, ``moee.embed.reference``); returns the ``.safetensors``
        path, which ``encode(..., reference=path)`` takes. Ensemble prompts share one set of statistics."""
        from moee import __version__
        from moee.embed.reference import Reference, check_reference_size
        from moee.provenance import model_label

        texts = check_texts(texts)
        check_reference_size(len(texts))  # before any work: a std needs two texts
        config = self._config(config, **keywords).replace(reference=None)
        # the layers' statistics only: weights apply after standardisation, so they do not change them
        unweighted = config.replace(rw_layers=rw_layer_indices(config.rw_layers))
        hs, rw = self.features(texts, unweighted, batch_size=batch_size, show_progress_bar=show_progress_bar)
        prompts = hs.shape[1]
        meta = {
            "model": {"name": model_label(self.name_or_path), "revision": self.weights_digest},
            "features": self.reference_features(config),
            "n_texts": len(texts),
            "n_prompts": prompts,
            "moee_version": __version__,
        }
        flat_hs = hs.reshape(len(texts) * prompts, -1)
        flat_rw = rw.reshape(len(texts) * prompts, -1)
        return Reference.fit(flat_hs, flat_rw, meta).save(path)

    def iter_token_routes(
        self,
        texts: Sequence[str],
        *,
        prompt: str | None = MODEL_DEFAULT,
        score: str = MODEL_DEFAULT,
        batch_size: int = 16,
    ) -> Iterator[TokenRoutes]:
        """Token-level routes, one :class:`TokenRoutes` per text in input order; ``prompt`` and
        ``score`` left out come from the model's configuration (:meth:`resolve_config`).

        Streaming: texts are tokenized and run one batch at a time, so memory is bounded by one
        batch (``[batch, T, L, E]``) whatever the number of texts.
        """
        texts = check_texts(texts)
        config = self.resolve_config(prompt=prompt, score=score)
        if config.is_ensemble:
            raise ValueError("token routes run one prompt; pass prompt= instead of an ensemble")
        score, template = config.score, config.prompt_template  # checked when the config was built
        batch_size = check_positive_int("batch_size", batch_size)
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            with self._lock:
                seqs = self._tokenize(chunk, template)
            batch = self._batch_tensors(seqs)
            # Hooks live for one batch only, so nothing stays installed while the caller holds
            # the generator between items.
            with (
                self._lock,
                RoutingRecorder(self.model, self.routers, pooling="tokens", score=score) as recorder,
                torch.inference_mode(),
            ):
                recorder.set_batch(batch["attention_mask"])
                self._forward(batch)
                routes = recorder.token_rw()
                chosen = recorder.token_selection()
                returned = recorder.selection_returned
            width = routes.shape[1]
            for j, seq in enumerate(seqs):
                yield TokenRoutes(
                    index=start + j,
                    input_ids=np.asarray(seq, dtype=np.int64),
                    probs=np.ascontiguousarray(routes[j, width - len(seq) :].numpy(), dtype=np.float32),
                    selection=None if chosen is None else chosen[j, width - len(seq) :].numpy(),
                    selection_returned=list(returned),
                )

    def __repr__(self) -> str:
        return (
            f"MoEEmbedder({self.name_or_path!r}, moe_layers={self.n_moe_layers}, "
            f"experts={self.n_experts}, hidden={self.hidden_size})"
        )
