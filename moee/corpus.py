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
from typing import Any

from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.validation import check_texts
from moee.io import run_metadata, texts_digest, write_embeddings

__all__ = ["make_encoder", "run_facts", "save_corpus"]


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
