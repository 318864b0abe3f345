"""The settings of ``moee serve``: :class:`ServeSettings` (the model, how to load it, where to
listen, the log level, and the :class:`ServerSettings` the app enforces: limits, access,
connection timeouts), one field per flag (``moee.cli_options`` builds the flags from the fields'
metadata), so the library and the command line share one list of names, defaults and help texts;
each value is checked once when built, naming the flag. Standard library and the loading options
only: the command line's parser imports it without the ``serve`` extra."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field, fields, replace

from moee.loading import LoadOptions
from moee.models.bundled import model_field

__all__ = ["API_KEY_ENV", "LOG_LEVELS", "ServeSettings", "ServerSettings", "exposure_warning", "flag_of"]

#: The environment variable ``moee serve`` reads the API key from when ``--api-key`` is not given
#: (an environment variable does not show in the process list, a command-line argument does).
API_KEY_ENV = "MOEE_API_KEY"


def flag_of(name: str) -> str:
    """The ``moee serve`` flag of a :class:`ServerSettings` field, for messages that name the fix."""
    return "--" + name.replace("_", "-")


def _limit(help_text: str, **extra: object) -> dict[str, object]:
    return {"help": help_text, "type": int, "metavar": "N", "group": "serve-limits", **extra}


def _seconds(help_text: str) -> dict[str, object]:
    return {"help": help_text, "type": float, "metavar": "S", "group": "serve-connections"}


@dataclass(frozen=True)
class ServerSettings:
    """The server's limits, access rules and connection timeouts (``moee serve`` flags of the same
    names). Every default bounds what one request or one client can cost."""

    max_batch_tokens: int = field(
        default=16384, metadata=_limit("padded tokens (rows x longest) per forward")
    )
    max_routing_batch_tokens: int = field(
        default=1024,
        metadata=_limit(
            "padded tokens per routing forward: routing takes turns with the embedding batches, so an "
            "embedding request waits for at most one such forward"
        ),
    )
    max_concurrent_requests: int = field(
        default=512, metadata=_limit("requests admitted at once; more get 429")
    )
    max_inputs_per_request: int = field(default=2048, metadata=_limit("inputs per request; more get 413"))
    max_chars_per_input: int = field(
        default=100_000, metadata=_limit("characters per input; a longer input gets 413")
    )
    max_tokens_per_input: int | None = field(
        default=None,
        metadata=_limit(
            "tokens per input; longer inputs get 400 unless the request sends truncate=true",
            default_text="no limit, a text is cut to the model's maximum length as `encode` cuts it",
        ),
    )
    max_tokens_per_request: int = field(
        default=300_000,
        metadata=_limit("tokens of all inputs of one request, as the forwards count them; more get 413"),
    )
    max_request_bytes: int = field(
        default=16 * 2**20, metadata=_limit("bytes of one request body; a larger body gets 413")
    )
    max_dense_routing_values: int = field(
        default=1_000_000,
        metadata=_limit(
            'floats of a "dense": true routing response (tokens x MoE layers x experts); more get 413'
        ),
    )
    batch_wait_ms: float = field(
        default=2.0,
        metadata={
            "help": "how long a batch waits for more requests to join it",
            "type": float,
            "metavar": "MS",
            "group": "serve-limits",
        },
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
            f"otherwise; the openai client's api_key sends it); prefer the {API_KEY_ENV} environment "
            "variable, which other users cannot read from the process list. The server speaks plain "
            "HTTP: beyond this machine, put a TLS proxy in front so the key is not sent in the clear",
            "metavar": "KEY",
            "default_text": f"${API_KEY_ENV}, else no key",
            "group": "serve-access",
        },
    )
    enable_routing: bool = field(
        default=False,
        metadata={
            "help": "serve POST /v1/routing (off by default: a text's routes reveal most of its tokens)",
            "group": "serve-access",
        },
    )
    max_connections: int = field(
        default=1024,
        metadata={
            "help": "open connections at once; the request of one beyond gets 503",
            "type": int,
            "metavar": "N",
            "group": "serve-connections",
        },
    )
    idle_timeout_s: float = field(
        default=5.0, metadata=_seconds("seconds a connection may stay idle (before or between requests)")
    )
    request_timeout_s: float = field(
        default=30.0,
        metadata=_seconds("seconds a request may take to arrive whole (headers and body); then 408"),
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model id clients send",
            "metavar": "NAME",
            "default_text": "the model's folder name",
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and not (value is None and f.type == "int | None"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"{f.name} ({flag_of(f.name)}) must be a positive integer, got {value!r}"
                    )
            elif f.type == "float":
                least = 0.0 if f.name == "batch_wait_ms" else 1e-3
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{f.name} ({flag_of(f.name)}) must be a finite number, got {value!r}")
                if value < least:
                    raise ValueError(f"{f.name} ({flag_of(f.name)}) must be >= {least:g}, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError(
                f"api_key (--api-key / ${API_KEY_ENV}) must be a non-empty string; leave it unset for no key"
            )


#: ``--log-level`` choices (uvicorn's).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What ``moee serve`` runs (``moee.serving.app.serve``): ``model`` loaded with ``load``,
    served on ``host``:``port`` under ``server``'s limits. The API key is ``--api-key``, else the
    :data:`API_KEY_ENV` environment variable (read when the settings are built)."""

    model: str | None = model_field()
    load: LoadOptions = field(default_factory=LoadOptions, metadata={"embed": LoadOptions})
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address to listen on",
            "default_text": "127.0.0.1, this machine only; another address without an API key is warned about",
        },
    )
    port: int = field(default=8080, metadata={"help": "port to listen on (0: any free port)", "type": int})
    server: ServerSettings = field(default_factory=ServerSettings, metadata={"embed": ServerSettings})
    log_level: str = field(default="info", metadata={"help": "uvicorn's log level", "choices": LOG_LEVELS})

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"--host must be an address or a host name, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be an integer in [0, 65535], got {self.port!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.server.api_key is None and os.environ.get(API_KEY_ENV):
            object.__setattr__(self, "server", replace(self.server, api_key=os.environ[API_KEY_ENV]))

    def exposure_warning(self) -> str | None:
        """:func:`exposure_warning` of these settings."""
        return exposure_warning(self.host, self.server)


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
