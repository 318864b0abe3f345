"""`moee search`: nearest texts of a corpus for one or more queries.

The corpus embeddings come from `moee embed`; queries are embedded with the model and the whole
embedding configuration recorded in the embeddings' sidecar (what `moee embed` resolved), so both
sides live in the same space; search therefore takes no configuration flags. Before any work it
checks what the sidecar records: its own content digest, that ``--texts`` are the embedded texts
(in order), that a reference still holds the statistics the corpus was embedded with, that a
``--load-index`` was built from these embeddings, and, once the model is loaded, that its weights
are the ones the corpus was embedded with; any difference is an error naming both sides::

    moee embed corpus.txt --out corpus.npy --prompt prompteol
    moee search --embeddings corpus.npy --texts corpus.txt --query "a cat on a mat" -k 5
    moee search --embeddings corpus.npy --texts corpus.txt --query-file queries.txt --index-type ivf \\
        --save-index corpus.faiss            # later: --load-index corpus.faiss
    moee search --embeddings corpus.npy --texts corpus.txt --query "a cat" --server http://127.0.0.1:8080

With ``--server`` the queries are embedded by a running ``moee serve`` instead of a model loaded
here, with the corpus's configuration sent explicitly; the server's weights digest
(``/v1/models``) must be the sidecar's.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
import warnings
from pathlib import Path
from typing import Any

from moee.cli_options import add_loading_arguments, load_from_args, make_encoder
from moee.embed.config import EmbeddingConfig, check_config_fits_model
from moee.embed.validation import check_positive_int
from moee.index import KINDS, VectorIndex
from moee.io import (
    check_output_path,
    is_parquet_embeddings,
    output_lock,
    read_embeddings,
    read_parquet_embeddings,
    read_texts,
    texts_digest,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "search",
        help="search an embedded corpus with text queries (faiss)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--embeddings",
        required=True,
        help="corpus embeddings written by `moee embed`: a .npy, or a Parquet folder (--engine ray)",
    )
    p.add_argument(
        "--texts",
        default=None,
        help="the corpus file the embeddings were made from (a Parquet folder holds its texts: optional)",
    )
    p.add_argument(
        "--field", default=None, help="JSON key / parquet column of --texts (default: as recorded)"
    )
    p.add_argument("--query", action="append", default=[], help="a query text (repeatable)")
    p.add_argument("--query-file", default=None, help="more queries, one per line (.txt) or .jsonl/.parquet")
    p.add_argument("-k", type=int, default=5, help="results per query")
    p.add_argument("--index-type", choices=KINDS, default="flat")
    p.add_argument("--nlist", type=int, default=None, help="IVF cells (default: about 4 sqrt(n))")
    p.add_argument("--nprobe", type=int, default=None, help="IVF cells searched per query")
    p.add_argument("--save-index", default=None, help="write the built index here (+ .json sidecar)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --save-index (else it is an error)"
    )
    p.add_argument(
        "--load-index",
        default=None,
        help="search a saved index instead of building one (it must have been built from --embeddings)",
    )
    p.add_argument("--index-device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--batch-size", type=int, default=32, help="query embedding batch size")
    p.add_argument("--json", action="store_true", help="print one JSON object per query")
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="embed the queries with a running `moee serve` at URL instead of loading the model",
    )
    add_loading_arguments(p)
    p.set_defaults(func=run)


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


def _queries(args: argparse.Namespace) -> list[str]:
    queries = list(args.query)
    if args.query_file:
        queries.extend(read_texts(args.query_file))
    if not queries:
        raise ValueError("give at least one --query or a --query-file")
    return queries


def _recorded_model(meta: dict[str, Any]) -> str | None:
    """The model the corpus was embedded with: its resolved local path when that still exists
    (a relative --model then works from any directory), else the name given to `moee embed`."""
    resolved = meta.get("model_resolved")
    if resolved and Path(resolved).exists():
        return resolved
    return meta.get("model")


def _server_encoder(args: argparse.Namespace, config: EmbeddingConfig, meta: dict[str, Any]):
    """Queries embedded by the server at ``--server``, after checking it serves the corpus's weights."""
    from moee.serving.client import ServerClient

    if args.model is not None:
        raise ValueError("--model and --server exclude each other: the server's model embeds the queries")
    client = ServerClient(args.server)
    card = client.model_card()
    check_digest(
        f"{card['id']} served at {args.server}",
        client.weights_digest,
        meta,
        args.embeddings,
        "(another --server)",
    )
    return lambda texts: client.embed(texts, config)


def run(args: argparse.Namespace) -> int:
    k = check_positive_int("-k", args.k)
    batch_size = check_positive_int("--batch-size", args.batch_size)
    queries = _queries(args)
    embeddings, meta = read_embeddings(args.embeddings, mmap=True)
    missing = [key for key in ("method", "pooling", "score", "alpha") if meta.get(key) is None]
    if missing:
        raise ValueError(f"sidecar of {args.embeddings} lacks {', '.join(missing)}; re-run `moee embed`")
    # every configuration field the sidecar records, recipe options included (a sidecar without
    # normalize: normalised; without a recipe option: it was not set)
    config = EmbeddingConfig.from_dict(meta)
    # every input is checked before the model loads and before any index is built or written
    field = args.field if args.field is not None else meta.get("field")
    if args.texts is None and not is_parquet_embeddings(args.embeddings):
        raise ValueError(
            f"--texts is required for {args.embeddings}: give the corpus file it was embedded from"
        )
    if args.texts is not None:
        check_corpus_texts(args.texts, meta, field=field, embeddings=args.embeddings)
    check_reference(config, meta, args.embeddings)
    if args.save_index:
        inputs = {"--embeddings": args.embeddings, "--texts": args.texts}  # the index would replace them
        check_output_path(args.save_index, overwrite=args.overwrite, what="--save-index", inputs=inputs)
    source = {"data_sha256": meta.get("data_sha256"), "path": str(Path(args.embeddings).resolve())}
    if args.load_index:
        index = VectorIndex.load(args.load_index, device=args.index_device, nprobe=args.nprobe)
        if (len(index), index.dim) != tuple(embeddings.shape):
            raise ValueError(
                f"index {args.load_index} holds {len(index)} x {index.dim} vectors, "
                f"embeddings {args.embeddings} are {embeddings.shape[0]} x {embeddings.shape[1]}"
            )
        index.check_source(source["data_sha256"], args.embeddings)

    if args.server:
        encode = _server_encoder(args, config, meta)
    else:
        args.model = args.model or _recorded_model(meta)
        embedder = load_from_args(
            args,
            dtype=args.dtype or meta.get("model_dtype"),
            load_in_4bit=args.load_in_4bit or bool(meta.get("load_in_4bit")),
        )
        check_weights(embedder, meta, args.embeddings)
        check_config_fits_model(embedder, config)
        encode = make_encoder(embedder, config, batch_size)
    if not args.load_index:
        index = VectorIndex.build(
            embeddings, kind=args.index_type, nlist=args.nlist, nprobe=args.nprobe, device=args.index_device
        )
    if args.save_index:
        with output_lock(args.save_index, "--save-index"):
            index.save(args.save_index, source=source, overwrite=args.overwrite)
    scores, ids = index.search(encode(queries), k)

    wanted = {int(i) for i in ids.ravel() if i >= 0}
    if args.texts is None:  # the folder's own text column, checked against its texts_sha256 on read
        column = read_parquet_embeddings(args.embeddings)[2]
        texts = {i: column[i] for i in wanted}
    else:
        texts = corpus_texts(args.texts, wanted, field=field, expected_rows=embeddings.shape[0])
    out = sys.stdout
    for query, row_scores, row_ids in zip(queries, scores, ids):
        hits = [
            {"rank": r + 1, "id": int(i), "score": float(s), "text": texts[int(i)]}
            for r, (s, i) in enumerate(zip(row_scores, row_ids))
            if i >= 0
        ]
        if args.json:
            out.write(json.dumps({"query": query, "results": hits}, ensure_ascii=False) + "\n")
        else:
            out.write(f"query: {printable(query)}\n")
            for hit in hits:
                out.write(
                    f"  {hit['rank']:>3}. {hit['score']:.4f}  [{hit['id']}]  {printable(hit['text'])}\n"
                )
    return 0
