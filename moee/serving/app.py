"""The HTTP server behind ``moee serve``: OpenAI-compatible embeddings, token routing, metrics.

Endpoints (shapes in ``moee.serving.protocol``): ``POST /v1/embeddings``, ``POST /v1/routing``,
``GET /v1/models`` (the served model, its weights digest and configuration), ``GET /health``,
``GET /metrics`` (Prometheus).

Limits: at most ``max_concurrent_requests`` requests are admitted at once (a further one gets
429); a request with more than ``max_inputs_per_request`` inputs gets 413, an input over
``max_tokens_per_input`` tokens gets 400 naming the limit, unless the request says
``"truncate": true`` (the text is cut at that many tokens); without that limit a text is cut to the
model's maximum length exactly as ``encode`` cuts it. A client that
disconnects has its waiting rows dropped. The server drains on SIGTERM: uvicorn stops accepting,
in-flight requests finish, then the batcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
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

from moee.embed.config import EmbeddingConfig
from moee.serving.batcher import DynamicBatcher
from moee.serving.protocol import (
    ApiError,
    EmbeddingsRequest,
    encode_vector,
    error_body,
    parse_embeddings_request,
    parse_json,
    parse_routing_request,
)

__all__ = ["ServerSettings", "EmbeddingService", "create_app", "serve_in_thread", "served_model_name"]

ENDPOINTS = ("/v1/embeddings", "/v1/routing", "/v1/models", "/health", "/metrics")
#: How often a waiting request checks whether its client is still there.
DISCONNECT_POLL_S = 0.05


@dataclass(frozen=True)
class ServerSettings:
    """The server's limits and batching knobs (``moee serve`` flags of the same names)."""

    max_batch_tokens: int = 16384
    max_concurrent_requests: int = 512
    max_inputs_per_request: int = 2048
    max_tokens_per_input: int | None = None  # None: no limit; cut to the model's maximum like encode
    batch_wait_ms: float = 2.0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_concurrent_requests", "max_inputs_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} (--{name.replace('_', '-')}) must be a positive integer, got {value!r}"
                )
        if self.max_tokens_per_input is not None and self.max_tokens_per_input < 1:
            raise ValueError(
                "max_tokens_per_input (--max-tokens-per-input) must be a positive integer, "
                f"got {self.max_tokens_per_input!r}"
            )
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms (--batch-wait-ms) must be >= 0, got {self.batch_wait_ms!r}")


def served_model_name(embedder: Any) -> str:
    """The ``model`` id clients send: the folder or Hub name (``moee-default`` for the bundled model)."""
    from moee.embed.embedder import DEFAULT_MODEL_DIR

    name = str(embedder.name_or_path)
    local = Path(name)
    if local.exists() and local.resolve() == DEFAULT_MODEL_DIR.resolve():
        return "moee-default"
    return local.name if local.is_dir() else name


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

    # ------------------------------------------------------------------ requests
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, str(self.embedder.name_or_path)):
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_id!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def config_for(self, given: dict[str, Any], prompt_name: str | None) -> EmbeddingConfig:
        """The configuration of a request: its fields, else the model's (``resolve_config``)."""
        given = dict(given)
        if prompt_name is not None:
            if "prompt" in given:
                raise ApiError(400, "give 'prompt' or 'prompt_name', not both", param="prompt_name")
            try:
                given["prompt"] = self.embedder.named_prompt(prompt_name)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="prompt_name") from None
        own = self.embedder.default_config
        if "reference" in given and given["reference"] != own.reference:
            raise ApiError(
                400,
                "'reference' names a file on the server: a request may only give the model's own "
                f"({own.reference!r}); leave it out",
                param="reference",
            )
        try:
            config = self.embedder.resolve_config(**given)
            config.numeric_alpha()
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"embedding configuration: {exc}", param=_field_of(exc, given)) from None
        from moee.commands.embed import check_config_fits_model

        try:
            check_config_fits_model(self.embedder, config)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
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

    def check_count(self, texts: list[str]) -> None:
        limit = self.settings.max_inputs_per_request
        if len(texts) > limit:
            raise ApiError(
                413,
                f"{len(texts)} inputs exceed the limit of {limit} inputs per request "
                "(--max-inputs-per-request); split the request",
                param="input",
                code="too_many_inputs",
            )

    def prepare(
        self, texts: list[str], config: EmbeddingConfig, truncate: bool
    ) -> tuple[list[str], list[int]]:
        """The texts (cut at ``max_tokens_per_input`` tokens when ``truncate``; else an input over it
        is a 400 naming the limit) and their forward lengths. Runs on the counting copy of the
        tokenizer, under its own lock (a fast tokenizer's settings are shared state), so it never
        waits for a forward."""
        limit = self.max_tokens_per_input
        counter = self.counter
        if limit is None:
            return list(texts), counter.token_lengths(texts, config)
        with counter._lock:
            enc = counter.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=truncate)
        out = list(texts)
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) <= limit:
                continue
            if not truncate:
                raise ApiError(
                    400,
                    f"input[{i}] has {len(ids)} tokens, over the limit of {limit} tokens per input "
                    '(--max-tokens-per-input); shorten it or send "truncate": true',
                    param="input",
                    code="input_too_long",
                )
            out[i] = texts[i][: enc["offset_mapping"][i][limit - 1][1]]
        return out, counter.token_lengths(out, config)

    def routing(
        self, texts: list[str], given: dict[str, Any], prompt_name: str | None, dense: bool, top_k: int
    ) -> dict:
        """Token-level routes of ``texts`` (``moee.serving.protocol`` documents the shape)."""
        config = self.config_for(given, prompt_name)
        if config.is_ensemble:
            raise ApiError(
                400,
                "routing runs one prompt; the configuration's prompt is an ensemble: give 'prompt'",
                param="prompt",
            )
        emb = self.embedder
        data = []
        for route in emb.iter_token_routes(texts, prompt=config.prompt, score=config.score):
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
                "index": route.index,
                "tokens": emb.tokenizer.convert_ids_to_tokens(route.input_ids.tolist()),
                "token_ids": route.input_ids.tolist(),
                "layers": layers,
            }
            if dense:
                item["dense"] = probs.tolist()
            data.append(item)
        return {
            "object": "list",
            "model": self.model_id,
            "n_experts": emb.n_experts,
            "layers": list(emb.layers),
            "score": config.score,
            "prompt": config.prompt_template,
            "data": data,
        }

    def model_card(self) -> dict[str, Any]:
        emb = self.embedder
        config = emb.default_config
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "moee",
            "moee": {
                "name_or_path": str(emb.name_or_path),
                "weights_digest": self.weights_digest,
                "config": config.to_dict(),
                "dimensions": emb.config_dim(config),
                "prompts": {k: list(v) if isinstance(v, tuple) else v for k, v in emb.prompts.items()},
                "moe_layers": emb.n_moe_layers,
                "n_experts": emb.n_experts,
                "hidden_size": emb.hidden_size,
                "max_tokens_per_input": self.max_tokens_per_input,
                "max_length": int(emb.max_length),
                "max_inputs_per_request": self.settings.max_inputs_per_request,
            },
        }


def _field_of(exc: Exception, given: dict[str, Any]) -> str | None:
    text = str(exc)
    return next((k for k in given if k in text), None)


class _Disconnected(Exception):
    pass


def create_app(embedder: Any, settings: ServerSettings | None = None) -> Any:
    """The ASGI app serving ``embedder`` (run it with uvicorn; ``moee serve`` does); its ``state``
    holds the ``service``, ``batcher`` and ``metrics``."""
    settings = settings or ServerSettings()
    service = EmbeddingService(embedder, settings)
    metrics = _Metrics()
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
    admitted = {"n": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()  # after uvicorn has drained the in-flight requests

    app = FastAPI(
        title="moee", summary="MoE embeddings (OpenAI-compatible) and token routing", lifespan=lifespan
    )
    app.state.service, app.state.batcher, app.state.metrics = service, batcher, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)

    @contextlib.contextmanager
    def admission():
        if admitted["n"] >= settings.max_concurrent_requests:
            raise ApiError(
                429,
                f"the server is at its limit of {settings.max_concurrent_requests} concurrent requests "
                "(--max-concurrent-requests); retry later",
                code="queue_full",
            )
        admitted["n"] += 1
        try:
            yield
        finally:
            admitted["n"] -= 1

    async def wait_for(request: Request, job) -> np.ndarray:
        while True:
            done, _ = await asyncio.wait({job.future}, timeout=DISCONNECT_POLL_S)
            if done:
                return job.future.result()
            if await request.is_disconnected():
                before = batcher.cancelled_rows
                batcher.cancel(job)
                metrics.cancelled.inc(batcher.cancelled_rows - before)
                raise _Disconnected

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req: EmbeddingsRequest = parse_embeddings_request(parse_json(await request.body()))
        service.check_model(req.model)
        service.check_count(req.texts)
        config = service.config_for(req.config, req.prompt_name)
        service.check_dimensions(req.dimensions, config)
        with admission():
            texts, lengths = await asyncio.to_thread(service.prepare, req.texts, config, req.truncate)
            job = batcher.submit(texts, lengths, config)
            try:
                vectors = await wait_for(request, job)
            except _Disconnected:
                return Response(status_code=499)  # nobody reads it; counted as a client abort
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
                "moee_config": config.to_dict(),
            }
        )

    @app.post("/v1/routing")
    async def routing(request: Request) -> JSONResponse:
        req = parse_routing_request(parse_json(await request.body()))
        service.check_model(req.model)
        service.check_count(req.texts)
        service.config_for(req.config, req.prompt_name)  # a bad configuration is a 400 before any work
        with admission():
            texts, _ = await asyncio.to_thread(service.prepare, req.texts, EmbeddingConfig(), False)
            result = await batcher.run_exclusive(
                lambda: service.routing(texts, req.config, req.prompt_name, req.dense, req.top_k)
            )
        return JSONResponse(result)

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

    return _Observed(app, metrics)


class _Observed:
    """ASGI wrapper counting requests, error codes and latency per endpoint (it wraps ``send`` only,
    so disconnect detection inside the app is untouched)."""

    def __init__(self, app: FastAPI, metrics: _Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.state = app.state

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


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Run ``app`` with uvicorn on a background thread (port 0: a free one) and yield its base URL
    (``http://host:port``); stops it, draining, on exit. For tests, benchmarks and notebooks."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
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
