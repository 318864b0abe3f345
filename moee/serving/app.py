"""The HTTP server behind ``moee serve``: OpenAI-compatible embeddings, token routing, metrics.

Endpoints (shapes in ``moee.serving.protocol``): ``POST /v1/embeddings``, ``POST /v1/routing``
(only with ``enable_routing``: a text's routes reveal most of its tokens; else 403 naming the
flag), ``GET /v1/models`` (the served model by its label, its weights digest and configuration; no
local path appears in any response), ``GET /health``, ``GET /metrics`` (Prometheus).

Access: with an ``api_key`` every endpoint but ``/health`` (open for load-balancer probes; it
tells only the model id and queue depth) needs ``Authorization: Bearer <key>`` (compared in
constant time), else 401.

Limits (:class:`moee.serving.settings.ServerSettings`; each refusal names the ``moee serve`` flag
that raises it): at most ``max_concurrent_requests`` requests are admitted at once (a further one
gets 429); a body over ``max_request_bytes``, more than ``max_inputs_per_request`` inputs, an input
over ``max_chars_per_input`` characters, inputs of more than ``max_tokens_per_request`` tokens in
all, or a dense routing answer of more than ``max_dense_routing_values`` floats gets 413; an input
over ``max_tokens_per_input`` tokens gets 400, unless the request says ``"truncate": true`` (the
text is cut at that many tokens); without that limit a text is cut to the model's maximum length
exactly as ``encode`` cuts it. Every value of a request is checked before use
(``protocol.check_values``: 400 naming the field), so no client mistake is a 500.

Connections (:func:`uvicorn_config`): a connection idle for ``idle_timeout_s`` (before its first
request too) is closed, a request that has not arrived whole ``request_timeout_s`` after its first
byte gets 408, and the request of a connection beyond ``max_connections`` gets 503. A client that
disconnects has its waiting rows dropped, and a routing request stops between forwards; either is
one log line. Routing runs in forwards of at most ``max_routing_batch_tokens`` padded tokens that
take turns with the embedding batches on the one forward thread, so a long routing request holds
an embedding up for one such forward at most. The server drains on SIGTERM: uvicorn stops
accepting, in-flight requests finish, then the batcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.requests import ClientDisconnect

from moee.embed.config import EmbeddingConfig
from moee.serving.batcher import DynamicBatcher, cut_batches
from moee.serving.protocol import (
    ApiError,
    EmbeddingsRequest,
    check_values,
    encode_vector,
    error_body,
    parse_embeddings_request,
    parse_json,
    parse_routing_request,
)
from moee.serving.settings import API_KEY_ENV, ServerSettings, ServeSettings, flag_of

__all__ = [
    "ServerSettings",
    "EmbeddingService",
    "create_app",
    "serve",
    "serve_in_thread",
    "served_model_name",
    "uvicorn_config",
]

ENDPOINTS = ("/v1/embeddings", "/v1/routing", "/v1/models", "/health", "/metrics")
#: Endpoints open without the API key (probes): the model id and queue depth, nothing private.
OPEN_ENDPOINTS = ("/health",)
#: Characters of a request's inputs tokenized on the event loop itself (about a millisecond at
#: most); a longer request is tokenized on a worker thread.
INLINE_TOKENIZE_CHARS = 1024
#: Inputs tokenized at a time while a request is counted against ``max_tokens_per_request``: an
#: oversized request is refused after at most this many inputs past its budget.
TOKENIZE_CHUNK = 64
#: Request forms whose checked configuration :meth:`EmbeddingService.config_for` keeps, and the
#: longest form (characters of its ``repr``) it keeps: long prompts are resolved each time.
CONFIG_CACHE_SIZE = 256
CONFIG_CACHE_KEY_CHARS = 2048
#: uvicorn's log: the server's one-line notes (dropped clients, timeouts) go where uvicorn's go.
log = logging.getLogger("uvicorn.error")


def _over(limit: int, unit: str, name: str) -> str:
    """The end of a refusal: the limit, and the flag that raises it."""
    return f"over the server's limit of {limit:,} {unit} (moee serve {flag_of(name)} raises it)"


def served_model_name(embedder: Any) -> str:
    """The ``model`` id clients send: the folder or Hub name (``moee-default`` for the default
    model, a shipped model's name for the others); never a local path."""
    from moee.models.bundled import DEFAULT_MODEL, shipped_name

    name = str(embedder.name_or_path)
    local = Path(name)
    shipped = shipped_name(local) if local.exists() else None
    if shipped is not None:
        return "moee-default" if shipped == DEFAULT_MODEL else shipped
    return local.name if local.is_dir() or local.is_absolute() else name


class _Metrics:
    """The Prometheus series of one server (its own registry: several servers in one process, as
    in the tests, do not share counts)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moee_requests", "HTTP requests by endpoint", ["endpoint"], registry=r)
        self.errors = Counter(
            "moee_request_errors",
            "error responses by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "moee_request_latency_seconds",
            "request latency by endpoint",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.batch_rows = Histogram(
            "moee_batch_size",
            "texts per forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "moee_batch_padded_tokens",
            "padded tokens (rows x longest) per forward",
            buckets=(64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.queue_depth = Gauge("moee_queue_depth", "texts waiting for a forward", registry=r)
        self.pending = Gauge(
            "moee_pending_requests", "embedding requests admitted and not finished", registry=r
        )
        self.tokens = Counter("moee_tokens", "tokens embedded", registry=r)
        self.cancelled = Counter(
            "moee_cancelled_texts", "texts dropped because their client went away", registry=r
        )
        self.tokens_per_second = Gauge(
            "moee_tokens_per_second", "tokens embedded per second, last 10 s", registry=r
        )
        self._recent: deque[tuple[float, int]] = deque()
        self.tokens_per_second.set_function(self._rate)

    def batch(self, rows: int, padded: int, tokens: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.batch_tokens.observe(padded)
        self.tokens.inc(tokens)
        self._recent.append((time.monotonic(), tokens))

    def _rate(self, window: float = 10.0) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        return sum(t for _, t in self._recent) / window


class EmbeddingService:
    """What the endpoints do with the model, without HTTP: configuration, limits, routing."""

    def __init__(self, embedder: Any, settings: ServerSettings) -> None:
        self.embedder = embedder
        self.counter = embedder.token_counter()  # tokenizes new requests while a forward runs
        self.settings = settings
        self.model_id = settings.served_model_name or served_model_name(embedder)
        self.max_tokens_per_input = settings.max_tokens_per_input
        self.weights_digest = embedder.weights_digest
        self.created = int(time.time())
        # this machine's paths a message could carry, longest first, and the labels shown instead
        own = embedder.default_config.reference
        paths = {str(embedder.name_or_path): served_model_name(embedder)}
        if own is not None:
            paths[own] = reference_label(own)
        for path, label in list(paths.items()):
            if Path(path).exists():
                paths[str(Path(path).resolve())] = label
            else:
                del paths[path]  # a Hub id is a label already
        self._paths = sorted(paths.items(), key=lambda item: -len(item[0]))
        self._configs: dict[str, EmbeddingConfig] = {}  # config_for's checked configurations

    # ------------------------------------------------------------------ what responses show
    def public(self, message: str) -> str:
        """``message`` with this machine's model and reference paths replaced by their labels."""
        for path, label in self._paths:
            message = message.replace(path, label)
        return message

    def public_config(self, config: EmbeddingConfig) -> dict[str, Any]:
        """``config.to_dict()`` with the reference by its label (file name), not its path."""
        values = config.to_dict()
        if config.reference is not None:
            values["reference"] = reference_label(config.reference)
        return values

    # ------------------------------------------------------------------ requests
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, str(self.embedder.name_or_path)):
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def check_routing_enabled(self) -> None:
        if not self.settings.enable_routing:
            raise ApiError(
                403,
                "routing is off on this server: token routes reveal most of a text's tokens, so they "
                "are served only when the server is started with --enable-routing (with --api-key, "
                "or bound to 127.0.0.1, so that only you can read them)",
                code="routing_disabled",
            )

    def config_for(self, given: dict[str, Any], prompt_name: str | None) -> EmbeddingConfig:
        """The configuration of a request: its fields, else the model's (``resolve_config``),
        checked against the model and its reference once per request form (the fields given, by
        type and value) and kept (:data:`CONFIG_CACHE_SIZE` forms of at most
        :data:`CONFIG_CACHE_KEY_CHARS` characters): the served model, its configuration and its
        reference are those of the start, as ``GET /v1/models`` reports them (the reference check
        alone fingerprints every weight: it was the largest cost of a request)."""
        key = repr((sorted(given.items()), prompt_name))  # repr tells 1, 1.0 and true apart
        config = self._configs.get(key)
        if config is None:
            config = self._checked_config(given, prompt_name)  # a mistake raises: never kept
            if len(key) <= CONFIG_CACHE_KEY_CHARS:
                while len(self._configs) >= CONFIG_CACHE_SIZE:
                    del self._configs[next(iter(self._configs))]  # the oldest forms go
                self._configs[key] = config
        return config

    def _checked_config(self, given: dict[str, Any], prompt_name: str | None) -> EmbeddingConfig:
        """:meth:`config_for` of a form not seen before: resolved and checked (a 400 naming the
        field)."""
        given = dict(given)
        if prompt_name is not None:
            if "prompt" in given:
                raise ApiError(400, "give 'prompt' or 'prompt_name', not both", param="prompt_name")
            try:
                given["prompt"] = self.embedder.named_prompt(prompt_name)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="prompt_name") from None
        own = self.embedder.default_config
        if "reference" in given:
            if own.reference is not None and given["reference"] == reference_label(own.reference):
                given["reference"] = own.reference  # the model's own, as /v1/models names it
            if given["reference"] != own.reference:
                shown = "it has none" if own.reference is None else repr(reference_label(own.reference))
                raise ApiError(
                    400,
                    "'reference' names a file on the server: a request may only give the model's own "
                    f"({shown}, as GET /v1/models names it); leave it out",
                    param="reference",
                )
        try:
            config = self.embedder.resolve_config(**given)
            config.numeric_alpha()
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"embedding configuration: {exc}", param=_field_of(exc, given)) from None
        # the numbers a field's text form held ("0:1e308") pass the checks the JSON ones did
        check_values({name: value for name, value in config.to_dict().items() if name in given})
        from moee.embed.config import check_config_fits_model

        try:
            check_config_fits_model(self.embedder, config)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_field_of(exc, given)) from None
        return config

    def check_dimensions(self, dimensions: int | None, config: EmbeddingConfig) -> int:
        dim = self.embedder.config_dim(config)
        if dimensions is not None and dimensions != dim:
            raise ApiError(
                400,
                f"dimensions={dimensions} cannot be honoured: this model's {config.method} vectors have {dim} "
                "dimensions and are not trained to be truncated; omit 'dimensions' or pass "
                f"{dim} (another width needs another method, e.g. method='hs' or 'rw')",
                param="dimensions",
            )
        return dim

    def check_inputs(self, texts: list[str]) -> None:
        """Refuse (413) more inputs than ``max_inputs_per_request`` or an input over
        ``max_chars_per_input`` characters, before any is tokenized."""
        limit = self.settings.max_inputs_per_request
        if len(texts) > limit:
            raise ApiError(
                413,
                f"{len(texts):,} inputs are {_over(limit, 'inputs per request', 'max_inputs_per_request')}; "
                "split the request",
                param="input",
                code="too_many_inputs",
            )
        limit = self.settings.max_chars_per_input
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise ApiError(
                    413,
                    f"input[{i}] has {len(text):,} characters, "
                    f"{_over(limit, 'characters per input', 'max_chars_per_input')}; shorten or split it",
                    param="input",
                    code="input_too_long",
                )

    def prepare(
        self, texts: list[str], config: EmbeddingConfig, truncate: bool
    ) -> tuple[list[str], list[int]]:
        """The texts (cut at ``max_tokens_per_input`` tokens when ``truncate``; else an input over it
        is a 400 naming the limit) and their forward lengths; a request over
        ``max_tokens_per_request`` is a 413 once its count passes the budget (tokenized
        :data:`TOKENIZE_CHUNK` inputs at a time, so an oversized request costs little). Runs on the
        counting copy of the tokenizer, under its own lock (a fast tokenizer's settings are shared
        state), so it never waits for a forward."""
        budget = self.settings.max_tokens_per_request
        out: list[str] = []
        lengths: list[int] = []
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            chunk = self._cut(texts[start : start + TOKENIZE_CHUNK], start, truncate)
            out.extend(chunk)
            lengths.extend(self.counter.token_lengths(chunk, config))
            total = sum(lengths)
            if total > budget:
                counted = "" if len(out) == len(texts) else f" in their first {len(out):,} alone"
                raise ApiError(
                    413,
                    f"the inputs have {total:,} tokens{counted}, "
                    f"{_over(budget, 'tokens per request', 'max_tokens_per_request')}; split the request",
                    param="input",
                    code="request_too_large",
                )
        return out, lengths

    def _cut(self, texts: list[str], offset: int, truncate: bool) -> list[str]:
        """``texts`` (input ``offset`` on) under ``max_tokens_per_input``: cut when ``truncate``,
        else a 400 naming the first one over it."""
        limit = self.max_tokens_per_input
        if limit is None:
            return list(texts)
        counter = self.counter
        with counter._lock:
            enc = counter.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=truncate)
        out = list(texts)
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) <= limit:
                continue
            if not truncate:
                raise ApiError(
                    400,
                    f"input[{offset + i}] has {len(ids):,} tokens, "
                    f"{_over(limit, 'tokens per input', 'max_tokens_per_input')}; shorten it or send "
                    '"truncate": true',
                    param="input",
                    code="input_too_long",
                )
            out[i] = texts[i][: enc["offset_mapping"][i][limit - 1][1]]
        return out

    # ------------------------------------------------------------------ routing
    def routing_config(self, given: dict[str, Any], prompt_name: str | None) -> EmbeddingConfig:
        """The configuration a routing request runs under (one prompt: an ensemble is a 400)."""
        config = self.config_for(given, prompt_name)
        if config.is_ensemble:
            raise ApiError(
                400,
                "routing runs one prompt; the configuration's prompt is an ensemble: give 'prompt'",
                param="prompt",
            )
        return config

    def check_dense(self, lengths: list[int], dense: bool) -> None:
        """Refuse (413) a dense answer of more than ``max_dense_routing_values`` floats."""
        if not dense:
            return
        emb = self.embedder
        values = int(sum(lengths)) * len(emb.layers) * int(emb.n_experts)
        limit = self.settings.max_dense_routing_values
        if values > limit:
            raise ApiError(
                413,
                f'"dense": true would answer {values:,} floats ({sum(lengths):,} tokens x '
                f"{len(emb.layers)} MoE layers x {emb.n_experts} experts), "
                f"{_over(limit, 'floats', 'max_dense_routing_values')}; send fewer or shorter inputs, "
                'or leave "dense" out',
                param="dense",
                code="response_too_large",
            )

    def route(
        self, texts: list[str], indices: list[int], config: EmbeddingConfig, dense: bool, top_k: int
    ) -> list[dict[str, Any]]:
        """The routing answer's items of ``texts`` (input ``indices``), in one forward."""
        emb = self.embedder
        items = []
        routes = emb.iter_token_routes(texts, prompt=config.prompt, score=config.score, batch_size=len(texts))
        for index, route in zip(indices, routes):
            probs, chosen = route.probs, route.selection
            layers = []
            for li, name in enumerate(emb.layers):
                if chosen is not None:
                    experts = [[int(e) for e in row if e >= 0] for row in chosen[:, li]]
                    source = (
                        "router" if route.selection_returned and route.selection_returned[li] else "rederived"
                    )
                else:
                    experts = np.argsort(-probs[:, li], axis=-1, kind="stable")[:, :top_k].tolist()
                    source = "top_k"
                weights = [[float(probs[t, li, e]) for e in row] for t, row in enumerate(experts)]
                layers.append({"layer": name, "experts": experts, "weights": weights, "selection": source})
            item = {
                "index": index,
                "tokens": emb.tokenizer.convert_ids_to_tokens(route.input_ids.tolist()),
                "token_ids": route.input_ids.tolist(),
                "layers": layers,
            }
            if dense:
                item["dense"] = probs.tolist()
            items.append(item)
        return items

    def routing_answer(self, config: EmbeddingConfig, items: list[dict[str, Any]]) -> dict[str, Any]:
        emb = self.embedder
        return {
            "object": "list",
            "model": self.model_id,
            "n_experts": emb.n_experts,
            "layers": list(emb.layers),
            "score": config.score,
            "prompt": config.prompt_template,
            "data": items,
        }

    def model_card(self) -> dict[str, Any]:
        emb = self.embedder
        config = emb.default_config
        settings = self.settings
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "moee",
            "moee": {
                "name": served_model_name(emb),  # a label: the Hub id or the folder's name
                "weights_digest": self.weights_digest,
                "config": self.public_config(config),
                "reference_digest": config.reference_digest(),
                "dimensions": emb.config_dim(config),
                "prompts": {k: list(v) if isinstance(v, tuple) else v for k, v in emb.prompts.items()},
                "moe_layers": emb.n_moe_layers,
                "n_experts": emb.n_experts,
                "hidden_size": emb.hidden_size,
                "max_length": int(emb.max_length),
                "routing": settings.enable_routing,
                **{
                    name: getattr(settings, name)
                    for name in (
                        "max_inputs_per_request",
                        "max_chars_per_input",
                        "max_tokens_per_input",
                        "max_tokens_per_request",
                        "max_request_bytes",
                        "max_dense_routing_values",
                    )
                },
            },
        }


def reference_label(path: str) -> str:
    """How responses name a reference: its file name (the folders are this machine's)."""
    return Path(path).name


def _field_of(exc: Exception, given: dict[str, Any]) -> str | None:
    text = str(exc)
    return next((k for k in given if k in text), None)


class _Disconnected(Exception):
    """The client of a waiting request went away; ``texts``: how many of its texts were dropped."""

    def __init__(self, texts: int) -> None:
        super().__init__(texts)
        self.texts = texts


class _Admission:
    """At most ``limit`` requests admitted at once (``with admission():``); a further one gets 429."""

    def __init__(self, limit: int) -> None:
        self.limit, self.admitted = limit, 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.admitted >= self.limit:
            raise ApiError(
                429,
                f"the server is at its limit of {self.limit} concurrent requests "
                "(--max-concurrent-requests); retry later",
                code="queue_full",
            )
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1


@dataclass(frozen=True)
class _Served:
    """What the endpoints of one app share."""

    service: EmbeddingService
    batcher: DynamicBatcher
    metrics: _Metrics
    admission: _Admission


def _new_batcher(embedder: Any, settings: ServerSettings, metrics: _Metrics) -> DynamicBatcher:
    """The one batcher whose forward thread runs every embedding batch (and the routing forwards),
    reporting its batches and queue depth to ``metrics``."""
    batcher = DynamicBatcher(
        lambda texts, config: embedder.features(
            texts, config, batch_size=len(texts), show_progress_bar=False
        ),
        max_batch_tokens=settings.max_batch_tokens,
        batch_wait_s=settings.batch_wait_ms / 1000.0,
        on_batch=metrics.batch,
        on_depth=metrics.queue_depth.set,
    )
    metrics.pending.set_function(lambda: batcher.pending_requests)
    return batcher


def _add_error_handlers(app: FastAPI, service: EmbeddingService) -> None:
    """An ``ApiError`` answers its status and message; a client gone before its request arrived
    whole is one log line; any other exception is a 500 that tells the client no local detail."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        body = error_body(exc.status, service.public(exc.message), exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        log.info("%s: the client went away before its request arrived whole; dropped", _client(request))
        return Response(status_code=499)  # nobody reads it; counted as a client abort

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # the traceback goes to the server's log (uvicorn logs it); the client learns no local detail
        message = f"internal error ({type(exc).__name__}); the server's log has the details"
        return JSONResponse(error_body(500, message), status_code=500)


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a checked JSON object, read up to ``limit`` bytes (``max_request_bytes``; 413
    beyond)."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    body = bytearray()
    if size <= limit:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                size = len(body)
                break
    if size > limit or len(body) > limit:
        raise ApiError(
            413,
            f"the request body has {'at least ' if not declared else ''}{size:,} bytes, "
            f"{_over(limit, 'bytes', 'max_request_bytes')}; split the request",
            code="request_too_large",
        )
    return parse_json(bytes(body))


def _dropped(served: _Served, request: Request, what: str, texts: int) -> Response:
    """The answer to a request whose client went away: its dropped texts counted and logged."""
    served.metrics.cancelled.inc(texts)
    log.info("%s: the client went away; %s of its %d texts dropped", _client(request), what, texts)
    return Response(status_code=499)  # nobody reads it; counted as a client abort


async def _wait_for(served: _Served, request: Request, job) -> np.ndarray:
    """The job's vectors; its rows are cancelled if the client goes away meanwhile
    (``_Disconnected``). A watcher awaits the connection's next ASGI message, which for a request
    read whole comes only when its client goes away: a waiting request costs no polling."""
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({job.future, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if job.future.done():
        return job.future.result()
    await gone  # raises the watcher's own error, if that is what ended it
    batcher = served.batcher
    before = batcher.cancelled_rows
    batcher.cancel(job)
    raise _Disconnected(batcher.cancelled_rows - before)


async def _client_gone(request: Request) -> None:
    """Returns when the client of ``request`` (its body read whole) has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _prepare(service: EmbeddingService, req: EmbeddingsRequest, config: EmbeddingConfig):
    """``service.prepare`` of the request's texts: on the event loop itself when they are short
    (:data:`INLINE_TOKENIZE_CHARS`) and the counting tokenizer is free, else on a worker thread,
    so a long request never holds the loop up (a hop to a thread and back costs more than
    tokenizing a sentence)."""
    lock = service.counter._lock
    if sum(map(len, req.texts)) <= INLINE_TOKENIZE_CHARS and lock.acquire(blocking=False):
        try:
            return service.prepare(req.texts, config, req.truncate)
        finally:
            lock.release()
    return await asyncio.to_thread(service.prepare, req.texts, config, req.truncate)


async def _embeddings(served: _Served, request: Request) -> Response:
    """``POST /v1/embeddings``: every value checked, then the texts queued on the batcher."""
    service = served.service
    req: EmbeddingsRequest = parse_embeddings_request(
        await _read_json(request, service.settings.max_request_bytes)
    )
    service.check_model(req.model)
    service.check_inputs(req.texts)
    config = service.config_for(req.config, req.prompt_name)
    service.check_dimensions(req.dimensions, config)
    with served.admission():
        texts, lengths = await _prepare(service, req, config)
        job = served.batcher.submit(texts, lengths, config)
        try:
            vectors = await _wait_for(served, request, job)
        except _Disconnected as gone:
            return _dropped(served, request, "the waiting rows", gone.texts)
    tokens = int(sum(lengths))
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "model": service.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "moee_config": service.public_config(config),
        }
    )


async def _routing(served: _Served, request: Request) -> Response:
    """``POST /v1/routing``: every value checked, then forwards taking turns with the embedding
    batches."""
    service = served.service
    service.check_routing_enabled()
    req = parse_routing_request(await _read_json(request, service.settings.max_request_bytes))
    service.check_model(req.model)
    service.check_inputs(req.texts)
    config = service.routing_config(req.config, req.prompt_name)  # a 400 before any work
    with served.admission():
        texts, lengths = await asyncio.to_thread(service.prepare, req.texts, config, False)
        service.check_dense(lengths, req.dense)
        items: list[Any] = [None] * len(texts)
        done = 0
        # forwards of at most max_routing_batch_tokens, each queued behind the embedding
        # batches waiting by then: the forward thread takes turns between them and this request
        for positions in cut_batches(lengths, service.settings.max_routing_batch_tokens):
            if await request.is_disconnected():
                return _dropped(served, request, "the routing", len(texts) - done)
            chunk = [texts[i] for i in positions]
            routed = await served.batcher.run_exclusive(
                functools.partial(service.route, chunk, positions, config, req.dense, req.top_k)
            )
            for i, item in zip(positions, routed):
                items[i] = item
            done += len(positions)
    return JSONResponse(service.routing_answer(config, items))


def create_app(embedder: Any, settings: ServerSettings | None = None) -> Any:
    """The ASGI app serving ``embedder`` (run it with uvicorn under :func:`uvicorn_config`; ``moee
    serve`` does); its ``state`` holds the ``service``, ``batcher`` and ``metrics``."""
    settings = settings or ServerSettings()
    service = EmbeddingService(embedder, settings)
    metrics = _Metrics()
    batcher = _new_batcher(embedder, settings, metrics)
    served = _Served(service, batcher, metrics, _Admission(settings.max_concurrent_requests))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()  # after uvicorn has drained the in-flight requests

    app = FastAPI(
        title="moee", summary="MoE embeddings (OpenAI-compatible) and token routing", lifespan=lifespan
    )
    app.state.service, app.state.batcher, app.state.metrics = service, batcher, metrics
    _add_error_handlers(app, service)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _embeddings(served, request)

    @app.post("/v1/routing")
    async def routing(request: Request) -> Response:
        return await _routing(served, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": service.model_id,
            "pending_requests": batcher.pending_requests,
            "queue_depth": batcher.queue_depth,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    inner: Any = app if settings.api_key is None else _KeyCheck(app, settings.api_key)
    return _Observed(inner, metrics, app.state)


def _client(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "a client"


class _KeyCheck:
    """ASGI wrapper: every endpoint but :data:`OPEN_ENDPOINTS` needs ``Authorization: Bearer
    <key>`` (the openai client sends its ``api_key`` so), compared in constant time; else 401."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._key = app, key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_ENDPOINTS:
            header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            scheme, _, token = (header or b"").partition(b" ")
            if header is None or scheme.lower() != b"bearer":
                problem = "this server needs an API key in the header 'Authorization: Bearer <key>'"
            elif not hmac.compare_digest(token.strip(), self._key):
                problem = "the API key sent is not this server's"
            else:
                problem = None
            if problem is not None:
                message = (
                    f"{problem}: use the key the server was started with (--api-key or {API_KEY_ENV}); "
                    f"the openai client sends its api_key so, moee search --server sends {API_KEY_ENV}"
                )
                body = error_body(401, message, code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Observed:
    """ASGI wrapper counting requests, error codes and latency per endpoint (it wraps ``send`` only,
    so disconnect detection inside the app is untouched)."""

    def __init__(self, app: Any, metrics: _Metrics, state: Any) -> None:
        self.app, self.metrics, self.state = app, metrics, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope.get("path", "") if scope.get("path") in ENDPOINTS else "other"
        status = {"code": 500}

        async def observed_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, observed_send)
        finally:
            m = self.metrics
            m.requests.labels(endpoint).inc()
            m.latency.labels(endpoint).observe(time.perf_counter() - start)
            if status["code"] >= 400:
                m.errors.labels(endpoint, str(status["code"])).inc()


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` that serves ``app`` under its settings' connection limits
    (:func:`_bounded_protocol`): an idle connection closes after ``idle_timeout_s`` (before its
    first request too), a request gets ``request_timeout_s`` to arrive whole (then 408), and a
    connection beyond ``max_connections`` gets 503. ``moee serve`` and :func:`serve_in_thread`
    run every server with it."""
    import uvicorn

    settings: ServerSettings = app.state.service.settings
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=_bounded_protocol(settings),
        timeout_keep_alive=settings.idle_timeout_s,
        timeout_graceful_shutdown=None,
    )


def _late_response(timeout: float) -> bytes:
    """The whole 408 answer, as bytes: it is written on the transport itself, since a request that
    has not arrived whole has no ASGI cycle to answer through."""
    late = error_body(
        408,
        f"the request did not arrive whole within {timeout:g} s (moee serve "
        f"{flag_of('request_timeout_s')} raises the limit)",
        code="request_timeout",
    )
    late_body = json.dumps(late).encode("utf-8")
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(late_body)}\r\n\r\n".encode("ascii")
        + late_body
    )


def _refusal(max_connections: int) -> Callable[..., Any]:
    """The ASGI app that answers a connection beyond ``max_connections``: 503 naming the limit and its
    flag, and the connection closed."""
    full = error_body(
        503,
        f"the server has {_over(max_connections, 'open connections', 'max_connections')}; retry later",
        code="too_many_connections",
    )

    async def refuse(scope, receive, send) -> None:
        await JSONResponse(full, status_code=503, headers={"connection": "close"})(scope, receive, send)

    return refuse


def _bounded_protocol(settings: ServerSettings) -> type:
    """uvicorn's h11 protocol with the bounds it lacks. A new connection that sends nothing is
    closed after the keep-alive timeout, like one idle between requests (uvicorn arms that timer
    only after a response). A request whose headers and body have not all arrived
    ``request_timeout_s`` after its first byte gets 408 and the connection is closed (uvicorn
    waits for ever: a client could hold any number of connections open with half a request). A
    connection beyond ``max_connections`` has its request answered 503 and is closed (uvicorn's
    own limit answers without saying which limit)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = settings.request_timeout_s
    receiving = (h11.IDLE, h11.SEND_BODY)
    late_response = _late_response(timeout)
    refuse = _refusal(settings.max_connections)

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > settings.max_connections:
                self.app = refuse
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Arm the deadline when a request has begun to arrive; disarm it once it has."""
            state = self.conn.their_state
            begun = state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))
            if not begun:
                self._disarm()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state not in receiving:
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            self.logger.info(
                "%s: closed, its request did not arrive whole within %g s (%s)",
                client,
                timeout,
                flag_of("request_timeout_s"),
            )
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(late_response)
            self.transport.close()

    return BoundedH11Protocol


def serve(settings: ServeSettings, *, log: Callable[[str], None] | None = None) -> None:
    """The library side of ``moee serve``: warn (``log``, else stderr) when the host lets other
    machines in without a key, load the model, and serve until SIGTERM or Ctrl-C, which drain:
    in-flight requests finish, then this returns."""
    import signal

    import uvicorn

    from moee.embed.embedder import MoEEmbedder

    warning = settings.exposure_warning()
    if warning:
        (log or _stderr)(f"moee serve: warning: {warning}")
    embedder = MoEEmbedder.from_pretrained(settings.model, settings.load)
    app = create_app(embedder, settings.server)
    # uvicorn drains on SIGTERM, then re-raises the signal it caught; a no-op handler makes that
    # re-raise a clean exit 0 (a SIGTERM while the model loads still ends the process at once)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn_config(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    uvicorn.Server(config).run()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Run ``app`` with uvicorn (:func:`uvicorn_config`) on a background thread (port 0: a free
    one) and yield its base URL (``http://host:port``); stops it, draining, on exit. For tests,
    benchmarks and notebooks."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="moee-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
