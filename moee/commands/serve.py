"""`moee serve`: an OpenAI-compatible embeddings server that also serves token routing.

    moee serve --port 8080                      # the default model on 127.0.0.1:8080
    MOEE_API_KEY=secret moee serve --host 0.0.0.0 --model allenai/OLMoE-1B-7B-0924 --device cuda

Then any OpenAI client embeds with it (``base_url="http://127.0.0.1:8080/v1"``, ``api_key`` the
server's key if it has one); the body's extension fields (``method``, ``pooling``, ``prompt``, ...)
choose the embedding configuration, the model's own is the default. Endpoints: ``POST
/v1/embeddings``, ``POST /v1/routing`` (only with --enable-routing: routes reveal the text),
``GET /v1/models``, ``GET /health`` (open without the key, for probes), ``GET /metrics``
(``moee.serving``). Every limit below answers with an error naming the flag that raises it.
SIGTERM (or Ctrl-C) drains: in-flight requests finish, then the process exits 0.
"""

from __future__ import annotations

import argparse

from moee.serving.settings import ServeSettings

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve embeddings (OpenAI-compatible) and routing over HTTP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    add_field_arguments(p, ServeSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moee.cli_options import settings_of
    from moee.serving.app import serve

    serve(settings_of(ServeSettings, args))  # every flag checked here, before the model loads
    return 0
