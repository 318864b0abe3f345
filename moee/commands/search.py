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

from moee.search import SearchSettings

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "search",
        help="search an embedded corpus with text queries (faiss)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, SearchSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.search import run_search, write_results

    settings = settings_of(SearchSettings, args)  # every flag checked here, before any work
    write_results(run_search(settings), as_json=settings.json)
    return 0
