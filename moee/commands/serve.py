"""`moee serve`: an OpenAI-compatible embeddings server that also serves token routing.

    moee serve --port 8080                      # the bundled model on 127.0.0.1:8080
    moee serve --model allenai/OLMoE-1B-7B-0924 --device cuda --max-batch-tokens 32768

Then any OpenAI client embeds with it (``base_url="http://127.0.0.1:8080/v1"``); the body's
extension fields (``method``, ``pooling``, ``prompt``, ...) choose the embedding configuration,
the model's own is the default. Endpoints: ``POST /v1/embeddings``, ``POST /v1/routing``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (``moee.serving``). SIGTERM (or Ctrl-C)
drains: in-flight requests finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import signal

from moee.cli_options import add_loading_arguments, load_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve embeddings (OpenAI-compatible) and routing over HTTP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loading_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model's folder name)",
    )
    limits = p.add_argument_group("batching and limits")
    limits.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="padded tokens (rows x longest) per forward"
    )
    limits.add_argument(
        "--max-concurrent-requests", type=int, default=512, help="requests admitted at once; more get 429"
    )
    limits.add_argument(
        "--max-inputs-per-request", type=int, default=2048, help="inputs per request; more get 413"
    )
    limits.add_argument(
        "--max-tokens-per-input",
        type=int,
        default=None,
        help="tokens per input; longer inputs get 400 unless the request sends truncate=true "
        "(default: no limit, a text is cut to the model's maximum length as `encode` cuts it)",
    )
    limits.add_argument(
        "--batch-wait-ms", type=float, default=2.0, help="how long a batch waits for more requests to join it"
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moee.serving.app import ServerSettings, create_app

    settings = ServerSettings(
        max_batch_tokens=args.max_batch_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
        max_inputs_per_request=args.max_inputs_per_request,
        max_tokens_per_input=args.max_tokens_per_input,
        batch_wait_ms=args.batch_wait_ms,
        served_model_name=args.served_model_name,
    )  # checked before the model loads
    embedder = load_from_args(args)
    app = create_app(embedder, settings)
    # uvicorn drains on SIGTERM, then re-raises the signal it caught; a no-op handler makes that
    # re-raise a clean exit 0 (a SIGTERM while the model loads still ends the process at once)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=None)
    return 0
