"""Embedding a corpus from Python into the files ``moee search`` reads (what ``moee embed`` writes):
the float32 ``.npy`` and its sealed sidecar with the configuration, the texts' digest and the
weights digest, so ``moee search --embeddings X.npy --texts corpus.txt`` (or ``--server``) works on it::

    emb = MoEEmbedder.from_pretrained()
    save_corpus("corpus.npy", texts, emb)   # and write the same texts, one per line, to corpus.txt
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.validation import check_texts
from moee.io import run_metadata, texts_digest, write_embeddings

if TYPE_CHECKING:
    from moee.embed.settings import FitReferenceSettings

__all__ = ["FittedReference", "make_encoder", "run_facts", "run_fit_reference", "save_corpus"]


def save_corpus(
    path: str | Path,
    texts: Sequence[str],
    embedder: Any,
    config: EmbeddingConfig | None = None,
    *,
    batch_size: int = 32,
    overwrite: bool = False,
    **keywords: Any,
) -> Path:
    """Embed ``texts`` with ``embedder`` under ``config`` (or ``encode``'s configuration keywords;
    neither: the model's own) and write them to ``path`` with the sidecar ``moee embed`` writes.
    An existing ``path`` is refused unless ``overwrite``. Returns the ``.npy`` path."""
    texts = check_texts(texts)
    config = embedder._config(config, **keywords)
    check_config_fits_model(embedder, config)
    vectors = embedder.encode(texts, config=config, batch_size=batch_size, show_progress_bar=False)
    digest, _ = texts_digest(texts)
    meta = {
        "model": str(embedder.name_or_path),
        **config.to_dict(),
        "model_dtype": None,
        "load_in_4bit": False,
        **({"reference_sha256": config.reference_digest()} if config.reference is not None else {}),
        **run_facts(embedder, batch_size),
        "texts_sha256": digest,
        "truncated_texts": embedder.last_truncation,
        **run_metadata(),
    }
    return write_embeddings(path, vectors, meta, overwrite=overwrite)


def run_facts(embedder: Any, batch_size: int) -> dict[str, Any]:
    """Sidecar-only facts: where the model really came from, a digest of its weights (what
    `moee search` checks the model it loads against), and the batch size used."""
    resolved = str(getattr(embedder, "name_or_path", None))
    if Path(resolved).exists():  # a local model: record an absolute path, usable from any directory
        resolved = str(Path(resolved).resolve())
    return {"model_resolved": resolved, "weights_digest": embedder.weights_digest, "batch_size": batch_size}


def make_encoder(
    embedder: Any, config: EmbeddingConfig | Mapping[str, Any], batch_size: int
) -> Callable[..., Any]:
    """``texts -> float32 [n, dim]`` under a recorded configuration (``moee embed``, ``moee search``;
    a mapping is a sidecar's :meth:`EmbeddingConfig.to_dict` form)."""
    if not isinstance(config, EmbeddingConfig):
        config = EmbeddingConfig.from_dict(config)
    return partial(embedder.encode, config=config, batch_size=batch_size, show_progress_bar=False)


class FittedReference(NamedTuple):
    """What ``moee fit-reference`` wrote: the statistics (``path``, beside it its ``.json``), the
    number of texts fitted on, and the model's configuration file it now belongs to (``--save-to-model``)."""

    path: Path
    n_texts: int
    model_config: Path | None


def run_fit_reference(settings: FitReferenceSettings) -> FittedReference:
    """The library side of ``moee fit-reference``: every input checked before the model loads (the
    outputs writable and, without ``overwrite``, not an existing reference; the corpus read, at
    least two texts), the layer choice right after; the pair is written while this run holds the
    output's lock, and with ``save_to_model`` the model folder's configuration records it."""
    from moee.embed.embedder import MoEEmbedder
    from moee.embed.reference import check_reference_size, reference_paths
    from moee.io import check_output_path, output_lock, read_texts

    tensors, sidecar = reference_paths(settings.target)
    for path in (tensors, sidecar):
        check_output_path(
            path, overwrite=settings.overwrite, what="--out", inputs={"--corpus": settings.corpus}
        )
    texts = list(read_texts(settings.corpus, field=settings.field))
    if settings.max_texts is not None:
        texts = texts[: settings.max_texts]
    check_reference_size(len(texts))
    config = settings.config
    with output_lock(tensors, "--out"):  # held until the pair is committed: one run per reference
        embedder = MoEEmbedder.from_pretrained(settings.model, settings.load)
        check_config_fits_model(embedder, config)
        path = embedder.fit_reference(texts, settings.target, config=config, batch_size=settings.batch_size)
    saved = None
    if settings.model_folder is not None:
        from moee.embed.config import save_model_config

        saved = save_model_config(config.replace(reference=str(path)), settings.model_folder)
    return FittedReference(path, len(texts), saved)
