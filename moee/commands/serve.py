"""`moee serve`: an OpenAI-compatible embeddings server that also serves token routing.

    moee serve --port 8080                      # the bundled model on 127.0.0.1:8080
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
import ipaddress
import os
import signal
import sys
from dataclasses import fields

from moee.cli_options import add_field_arguments, add_loading_arguments, load_from_args
from moee.serving.settings import API_KEY_ENV, ServerSettings

__all__ = ["register", "run", "exposure_warning", "settings_from_args"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve embeddings (OpenAI-compatible) and routing over HTTP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loading_arguments(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; another address without "
        "an API key is warned about)",
    )
    p.add_argument("--port", type=int, default=8080)
    add_field_arguments(p, ServerSettings, explicit=False)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def exposure_warning(host: str, settings: ServerSettings) -> str | None:
    """What to warn about when ``host`` lets other machines in without an API key, else ``None``."""
    if settings.api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    routing = " and read token routes (which reveal the texts)" if settings.enable_routing else ""
    return (
        f"serving on {host} without an API key: anyone who can reach this port can embed{routing}; "
        f"set {API_KEY_ENV} (or --api-key), or bind --host 127.0.0.1"
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The :class:`ServerSettings` of the flags; the API key from ``--api-key``, else from the
    ``MOEE_API_KEY`` environment variable."""
    values = {f.name: getattr(args, f.name) for f in fields(ServerSettings)}
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServerSettings(**values)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moee.serving.app import create_app, uvicorn_config

    settings = settings_from_args(args)  # checked before the model loads
    warning = exposure_warning(args.host, settings)
    if warning:
        print(f"moee serve: warning: {warning}", file=sys.stderr)
    embedder = load_from_args(args)
    app = create_app(embedder, settings)
    # uvicorn drains on SIGTERM, then re-raises the signal it caught; a no-op handler makes that
    # re-raise a clean exit 0 (a SIGTERM while the model loads still ends the process at once)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level)
    uvicorn.Server(config).run()
    return 0
