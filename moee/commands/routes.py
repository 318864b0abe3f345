"""`moee routes`: per-token routing of a corpus to a Parquet file (`moee.analysis.routing_export`).

One row per token: ``text_id``, ``position``, ``token_id``, ``token``, and per MoE layer ``i`` the
router's selected experts (``layer{i}_experts``) and their scores (``layer{i}_weights``; with
``--dense`` also ``layer{i}_probs`` over all experts). Read it with ``pandas.read_parquet``, or
checked with ``moee.analysis.routing_export.read_routing_parquet``.

``--prompt`` and ``--score`` left out come from the model's saved configuration (its folder's
``moee_embedding.json``), else the library default: the rule of ``moee embed``, ``trace``,
``iter_token_routes`` and ``POST /v1/routing``. The Parquet footer (``moee.routes``) and the sealed
sidecar ``OUT.json`` record that configuration, the model, its weights digest and the command;
the sidecar also the texts' digest, the row count and the file's SHA-256.

The corpus is streamed a batch of texts at a time and written a row group at a time, so memory
does not grow with the corpus; the file is committed with its sidecar only when complete.
"""

from __future__ import annotations

import argparse

from moee.analysis.settings import ROUTES_NOT_FLAGS as NOT_FLAGS
from moee.analysis.settings import RoutesSettings

__all__ = ["NOT_FLAGS", "register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "routes",
        help="per-token routing (selected experts, weights, optionally dense) of a corpus to Parquet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, RoutesSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.analysis import command_line
    from moee.analysis.routing_export import export_routes
    from moee.cli_options import settings_of

    settings = settings_of(RoutesSettings, args)  # every flag checked here
    out, n_texts = export_routes(settings, command=command_line(args))
    config = settings.config
    print(f"{n_texts} texts (prompt {config.prompt_label}, score {config.score}) -> {out}")
    return 0
