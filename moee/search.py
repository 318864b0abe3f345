"""``moee search`` as a library: :class:`SearchSettings` (one field per flag, checked once when
built, naming the flag) and :func:`run_search`, the nearest texts of an embedded corpus for queries.

The queries are embedded with the model and the whole embedding configuration recorded in the
embeddings' sidecar (what ``moee embed`` resolved), so both sides live in the same space; search
therefore takes no configuration flags. Before any work it checks what the sidecar records: its own
content digest, that ``texts`` are the embedded texts (in order), that a reference still holds the
statistics the corpus was embedded with, that a ``load_index`` was built from these embeddings, and,
once the model is loaded, that its weights are the ones the corpus was embedded with; any difference
is an error naming both sides. With ``server`` the queries are embedded by a running ``moee serve``
whose weights digest (``/v1/models``) must be the sidecar's.
"""

from __future__ import annotations

import json
import sys
import unicodedata
import warnings
from dataclasses import dataclass
from dataclasses import field as _field  # a settings field is named `field` (--field)
from pathlib import Path
from typing import IO, Any

from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.validation import check_positive_int
from moee.index import DEVICES, KINDS, VectorIndex
from moee.io import (
    check_output_path,
    is_parquet_embeddings,
    output_lock,
    read_embeddings,
    read_parquet_embeddings,
    read_texts,
    texts_digest,
)
from moee.loading import LoadOptions
from moee.models.bundled import model_field

__all__ = [
    "SearchSettings",
    "check_corpus_texts",
    "check_digest",
    "check_reference",
    "check_weights",
    "corpus_texts",
    "printable",
    "run_search",
    "write_results",
]


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """What ``moee search`` searches (:func:`run_search`): the corpus ``embeddings`` (with its
    ``texts``) for ``query`` and the lines of ``query_file``, with a built or loaded index."""

    embeddings: str = _field(
        metadata={
            "help": "corpus embeddings written by `moee embed`: a .npy, or a Parquet folder (--engine ray)"
        }
    )
    texts: str | None = _field(
        default=None,
        metadata={
            "help": "the corpus file the embeddings were made from (a Parquet folder holds its texts: "
            "optional)"
        },
    )
    field: str | None = _field(
        default=None,
        metadata={"help": "JSON key / parquet column of --texts", "default_text": "as recorded"},
    )
    query: tuple[str, ...] = _field(
        default=(), metadata={"help": "a query text (repeatable)", "action": "append"}
    )
    query_file: str | None = _field(
        default=None, metadata={"help": "more queries, one per line (.txt) or .jsonl/.parquet"}
    )
    k: int = _field(default=5, metadata={"help": "results per query", "type": int, "flag": "-k"})
    index_type: str = _field(
        default="flat",
        metadata={"help": "flat: exact search; ivf: inverted lists (faster, approximate)", "choices": KINDS},
    )
    nlist: int | None = _field(
        default=None,
        metadata={"help": "IVF cells", "type": int, "default_text": "about 4 sqrt(n)"},
    )
    nprobe: int | None = _field(default=None, metadata={"help": "IVF cells searched per query", "type": int})
    save_index: str | None = _field(
        default=None, metadata={"help": "write the built index here (+ .json sidecar)"}
    )
    overwrite: bool = _field(
        default=False, metadata={"help": "replace an existing --save-index (else it is an error)"}
    )
    load_index: str | None = _field(
        default=None,
        metadata={
            "help": "search a saved index instead of building one (it must have been built from --embeddings)"
        },
    )
    index_device: str = _field(
        default="auto",
        metadata={
            "help": "where the index searches: auto (a GPU when faiss sees one), cpu or gpu",
            "choices": DEVICES,
        },
    )
    batch_size: int = _field(default=32, metadata={"help": "query embedding batch size", "type": int})
    json: bool = _field(default=False, metadata={"help": "print one JSON object per query"})
    server: str | None = _field(
        default=None,
        metadata={
            "help": "embed the queries with a running `moee serve` at URL instead of loading the model",
            "metavar": "URL",
        },
    )
    model: str | None = model_field()
    load: LoadOptions = _field(default_factory=LoadOptions, metadata={"embed": LoadOptions})

    def __post_init__(self) -> None:
        object.__setattr__(self, "query", tuple(self.query))
        for flag, value in (("-k", self.k), ("--batch-size", self.batch_size)):
            check_positive_int(flag, value)
        for flag, value in (("--nlist", self.nlist), ("--nprobe", self.nprobe)):
            if value is not None:
                check_positive_int(flag, value)
        if not self.query and not self.query_file:
            raise ValueError("give at least one --query or a --query-file")
        if self.server is not None and self.model is not None:
            raise ValueError("--model and --server exclude each other: the server's model embeds the queries")

    def queries(self) -> list[str]:
        """``query``, then the lines of ``query_file``."""
        queries = list(self.query)
        if self.query_file:
            queries.extend(read_texts(self.query_file))
        if not queries:
            raise ValueError(f"--query-file {self.query_file} holds no query")
        return queries


def corpus_texts(path: str | Path, ids: set[int], *, field: str | None, expected_rows: int) -> dict[int, str]:
    """Stream the corpus once, keeping only the texts of ``ids``; checks its row count."""
    found: dict[int, str] = {}
    n = 0
    for n, text in enumerate(read_texts(path, field=field), start=1):
        if n - 1 in ids:
            found[n - 1] = text
    if n != expected_rows:
        raise ValueError(
            f"{path} has {n} texts but the embeddings have {expected_rows} rows: they are not the same corpus"
        )
    return found


def check_corpus_texts(path: str | Path, meta: dict[str, Any], *, field: str | None, embeddings: str) -> None:
    """Refuse ``--texts`` that are not the texts the embeddings were made from, in their order: their
    digest must be the sidecar's ``texts_sha256`` (a sidecar without one: the row count only, and a
    warning); otherwise a hit would print another sentence beside its score."""
    digest, n = texts_digest(read_texts(path, field=field))
    rows = int(meta["shape"][0])
    if n != rows:
        raise ValueError(
            f"{path} has {n} texts but the embeddings have {rows} rows: they are not the same corpus"
        )
    recorded = meta.get("texts_sha256")
    if recorded is None:
        warnings.warn(
            f"the sidecar of {embeddings} records no texts_sha256: only the row count of --texts {path} "
            "can be checked, not its order or content; re-run `moee embed` to record it",
            stacklevel=2,
        )
    elif recorded != digest:
        raise ValueError(
            f"--texts {path} are not the texts {embeddings} was embedded from: same row count, but their "
            f"digest is {digest[:12]}, the sidecar records {recorded[:12]} (reordered or edited rows, or "
            "another --field); give the corpus file the embeddings were made from"
        )


def check_reference(config: EmbeddingConfig, meta: dict[str, Any], embeddings: str) -> None:
    """Refuse a reference whose statistics changed since the corpus was embedded with it (a re-fit
    under the same path): queries would be standardised differently from the corpus."""
    if config.reference is None:
        return
    recorded, now = meta.get("reference_sha256"), config.reference_digest()
    if recorded is None:
        warnings.warn(
            f"the sidecar of {embeddings} records no reference_sha256: reference {config.reference} cannot "
            "be checked against the one the corpus was embedded with; re-run `moee embed` to record it",
            stacklevel=2,
        )
    elif recorded != now:
        raise ValueError(
            f"reference {config.reference} changed since {embeddings} was embedded with it (statistics "
            f"{now}, the sidecar records {recorded}); re-embed the corpus, or restore that reference"
        )


def check_weights(embedder: Any, meta: dict[str, Any], embeddings: str) -> None:
    """Refuse a model whose weights are not the ones the corpus was embedded with (the same path,
    retrained or replaced): queries and corpus would live in different spaces."""
    check_digest(embedder.name_or_path, embedder.weights_digest, meta, embeddings)


def check_digest(
    name: Any, now: str, meta: dict[str, Any], embeddings: str, remedy: str = "(--model)"
) -> None:
    """:func:`check_weights` for a model known by its name and weights digest (a server's)."""
    recorded = meta.get("weights_digest")
    if recorded is None:
        warnings.warn(
            f"the sidecar of {embeddings} records no weights_digest: model {name} cannot be "
            "checked against the one the corpus was embedded with; re-run `moee embed` to record it",
            stacklevel=2,
        )
    elif recorded != now:
        raise ValueError(
            f"model {name} has weights {now}, but {embeddings} was embedded with weights "
            f"{recorded}: the model changed since; re-embed the corpus with it, or use the model it was "
            f"embedded with {remedy}"
        )


_UNSAFE = ("Cc", "Cf", "Zl", "Zp")  # control, format (incl. bidi overrides), line/paragraph separators
_JOINERS = "\u200c\u200d"  # zero-width (non-)joiners: part of emoji and Indic/Persian text, harmless


def printable(text: str) -> str:
    """``text`` safe for a terminal, on one line: control and format characters (escape sequences,
    bell, newlines, bidi overrides) are shown as ``\\xNN`` / ``\\uNNNN`` escapes instead of being
    interpreted. The ``--json`` output keeps the exact text (JSON escapes them itself)."""
    if text.isprintable():
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch) in _UNSAFE and ch not in _JOINERS
        else ch
        for ch in text
    )


def _recorded_model(meta: dict[str, Any]) -> str | None:
    """The model the corpus was embedded with: its resolved local path when that still exists
    (a relative --model then works from any directory), else the name given to `moee embed`."""
    resolved = meta.get("model_resolved")
    if resolved and Path(resolved).exists():
        return resolved
    return meta.get("model")


def _server_encoder(settings: SearchSettings, config: EmbeddingConfig, meta: dict[str, Any]):
    """Queries embedded by the server at ``server``, after checking it serves the corpus's weights."""
    from moee.serving.client import ServerClient

    client = ServerClient(settings.server)
    card = client.model_card()
    check_digest(
        f"{card['id']} served at {settings.server}",
        client.weights_digest,
        meta,
        settings.embeddings,
        "(another --server)",
    )
    return lambda texts: client.embed(texts, config)


def _model_encoder(settings: SearchSettings, config: EmbeddingConfig, meta: dict[str, Any]):
    """Queries embedded by the model the corpus was embedded with (unless ``model`` names another),
    loaded in its recorded dtype and 4-bit setting unless the loading options give theirs."""
    from moee.corpus import make_encoder
    from moee.embed.embedder import MoEEmbedder

    load = settings.load.replace(
        dtype=settings.load.dtype or meta.get("model_dtype"),
        load_in_4bit=settings.load.load_in_4bit or bool(meta.get("load_in_4bit")),
    )
    embedder = MoEEmbedder.from_pretrained(settings.model or _recorded_model(meta), load)
    check_weights(embedder, meta, settings.embeddings)
    check_config_fits_model(embedder, config)
    return make_encoder(embedder, config, settings.batch_size)


def run_search(settings: SearchSettings) -> list[dict[str, Any]]:
    """The hits of every query: ``{"query", "results": [{"rank", "id", "score", "text"}, ...]}``,
    in query order. Every input is checked before the model loads and before any index is built
    or written."""
    queries = settings.queries()
    embeddings, meta = read_embeddings(settings.embeddings, mmap=True)
    missing = [key for key in ("method", "pooling", "score", "alpha") if meta.get(key) is None]
    if missing:
        raise ValueError(f"sidecar of {settings.embeddings} lacks {', '.join(missing)}; re-run `moee embed`")
    # every configuration field the sidecar records, recipe options included (a sidecar without
    # normalize: normalised; without a recipe option: it was not set)
    config = EmbeddingConfig.from_dict(meta)
    text_field = settings.field if settings.field is not None else meta.get("field")
    if settings.texts is None and not is_parquet_embeddings(settings.embeddings):
        raise ValueError(
            f"--texts is required for {settings.embeddings}: give the corpus file it was embedded from"
        )
    if settings.texts is not None:
        check_corpus_texts(settings.texts, meta, field=text_field, embeddings=settings.embeddings)
    check_reference(config, meta, settings.embeddings)
    if settings.save_index:
        inputs = {
            "--embeddings": settings.embeddings,
            "--texts": settings.texts,
        }  # the index would replace them
        check_output_path(
            settings.save_index, overwrite=settings.overwrite, what="--save-index", inputs=inputs
        )
    source = {"data_sha256": meta.get("data_sha256"), "path": str(Path(settings.embeddings).resolve())}
    if settings.load_index:
        index = VectorIndex.load(settings.load_index, device=settings.index_device, nprobe=settings.nprobe)
        if (len(index), index.dim) != tuple(embeddings.shape):
            raise ValueError(
                f"index {settings.load_index} holds {len(index)} x {index.dim} vectors, "
                f"embeddings {settings.embeddings} are {embeddings.shape[0]} x {embeddings.shape[1]}"
            )
        index.check_source(source["data_sha256"], settings.embeddings)

    encoder = _server_encoder if settings.server else _model_encoder
    encode = encoder(settings, config, meta)
    if not settings.load_index:
        index = VectorIndex.build(
            embeddings,
            kind=settings.index_type,
            nlist=settings.nlist,
            nprobe=settings.nprobe,
            device=settings.index_device,
        )
    if settings.save_index:
        with output_lock(settings.save_index, "--save-index"):
            index.save(settings.save_index, source=source, overwrite=settings.overwrite)
    scores, ids = index.search(encode(queries), settings.k)

    wanted = {int(i) for i in ids.ravel() if i >= 0}
    if settings.texts is None:  # the folder's own text column, checked against its texts_sha256 on read
        column = read_parquet_embeddings(settings.embeddings)[2]
        texts = {i: column[i] for i in wanted}
    else:
        texts = corpus_texts(settings.texts, wanted, field=text_field, expected_rows=embeddings.shape[0])
    return [
        {
            "query": query,
            "results": [
                {"rank": r + 1, "id": int(i), "score": float(s), "text": texts[int(i)]}
                for r, (s, i) in enumerate(zip(row_scores, row_ids))
                if i >= 0
            ],
        }
        for query, row_scores, row_ids in zip(queries, scores, ids)
    ]


def write_results(results: list[dict[str, Any]], *, as_json: bool, out: IO[str] | None = None) -> None:
    """:func:`run_search`'s hits on ``out`` (stdout): one JSON object per query, or text lines made
    safe for a terminal (:func:`printable`)."""
    out = out if out is not None else sys.stdout
    for entry in results:
        if as_json:
            out.write(json.dumps(entry, ensure_ascii=False) + "\n")
            continue
        out.write(f"query: {printable(entry['query'])}\n")
        for hit in entry["results"]:
            out.write(f"  {hit['rank']:>3}. {hit['score']:.4f}  [{hit['id']}]  {printable(hit['text'])}\n")
