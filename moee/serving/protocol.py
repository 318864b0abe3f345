"""The server's JSON protocol: request parsing (every mistake a 4xx naming the field and the fix)
and response shapes.

``POST /v1/embeddings`` takes the OpenAI schema (``input``, ``model``, ``encoding_format``
``float`` | ``base64`` (little-endian float32, the official client's default), ``dimensions``,
``user``) plus moee's extension fields: any field of :class:`moee.embed.config.EmbeddingConfig`
(``method``, ``pooling``, ``prompt``, ``score``, ``alpha``, ``normalize``, ``recipe``, ``hs_layer``,
``rw_layers``; ``reference`` only as the model's own), ``prompt_name`` (a named prompt of the
model's configuration) and ``truncate`` (cut inputs over the per-input token limit instead of
refusing them). Fields left out come from the model's configuration, resolved as ``encode``
resolves them (:func:`moee.embed.config.resolve_config`); the response's ``moee_config`` is the
configuration used (``EmbeddingConfig.to_dict()``).

``POST /v1/routing`` takes ``input``, ``model``, ``prompt``, ``prompt_name``, ``score``, ``dense``
(also return every token's dense distribution over all experts) and answers, per text::

    {"index": 0, "tokens": ["The", " cat"], "token_ids": [464, 3797],
     "layers": [{"layer": "model.layers.0.mlp.gate",
                 "experts": [[3, 7], [1, 3]],            # per token, the selected experts
                 "weights": [[0.41, 0.22], [0.5, 0.1]],  # their scores under `score`
                 "selection": "router"}],               # or "rederived" / "top_k" (see below)
     "dense": [[[...E floats] per layer] per token]}   # only with "dense": true

``selection`` says where the experts come from: the router's own returned choice (``router``),
re-derived from its selection scores (``rederived``), or, for a router that neither returns nor
declares its k, the ``top_k`` highest scores (``top_k``, request field, default 2).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from moee.embed.config import EmbeddingConfig

__all__ = [
    "ApiError",
    "EmbeddingsRequest",
    "RoutingRequest",
    "CONFIG_FIELDS",
    "encode_vector",
    "error_body",
    "parse_json",
    "parse_embeddings_request",
    "parse_routing_request",
]

#: The extension fields that choose the embedding configuration.
CONFIG_FIELDS = tuple(f.name for f in fields(EmbeddingConfig))
_OPENAI_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
_EMBED_FIELDS = frozenset((*_OPENAI_FIELDS, *CONFIG_FIELDS, "prompt_name", "truncate"))
_ROUTING_FIELDS = frozenset(("input", "model", "prompt", "prompt_name", "score", "dense", "top_k", "user"))


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body (``{"error": {"message", "type", "param", "code"}}``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = {429: "rate_limit_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(doc).__name__}")
    return doc


def _inputs(doc: dict[str, Any]) -> tuple[list[str], bool]:
    """``input`` as a list of str and whether it was a single string."""
    if "input" not in doc:
        raise ApiError(400, "'input' is required: a string or a list of strings", param="input")
    value = doc["input"]
    if isinstance(value, str):
        return [value], True
    if not isinstance(value, list):
        raise ApiError(
            400, f"'input' must be a string or a list of strings, got {type(value).__name__}", param="input"
        )
    if not value:
        raise ApiError(400, "'input' is an empty list; give at least one string", param="input")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            hint = (
                " (token-id inputs are not supported: send the text)" if isinstance(item, (int, list)) else ""
            )
            raise ApiError(
                400, f"input[{i}] must be a string, got {type(item).__name__}{hint}", param="input"
            )
    return list(value), False


def _unknown(doc: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ApiError(
            400,
            f"unknown field(s) {', '.join(unknown)}; this endpoint takes {', '.join(sorted(allowed))}",
            param=unknown[0],
        )


def _bool(doc: dict[str, Any], name: str, default: bool) -> bool:
    value = doc.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A parsed ``POST /v1/embeddings`` body (``config``: the explicit configuration fields only)."""

    texts: list[str]
    model: str | None
    encoding_format: str
    dimensions: int | None
    config: dict[str, Any]
    prompt_name: str | None
    truncate: bool


def _config_fields(doc: dict[str, Any]) -> dict[str, Any]:
    given = {k: doc[k] for k in CONFIG_FIELDS if k in doc}
    if isinstance(given.get("prompt"), list):
        given["prompt"] = tuple(given["prompt"])
    if isinstance(given.get("hs_layer"), list):
        given["hs_layer"] = tuple(given["hs_layer"])
    rw = given.get("rw_layers")
    if isinstance(rw, dict):
        try:
            given["rw_layers"] = {int(k): v for k, v in rw.items()}
        except ValueError:
            raise ApiError(400, "'rw_layers' keys must be layer indices", param="rw_layers") from None
    elif isinstance(rw, list):
        given["rw_layers"] = tuple(rw)
    if "normalize" in given and not isinstance(given["normalize"], bool):
        raise ApiError(400, "'normalize' must be true or false", param="normalize")
    return given


def parse_embeddings_request(doc: dict[str, Any]) -> EmbeddingsRequest:
    _unknown(doc, _EMBED_FIELDS)
    texts, _ = _inputs(doc)
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(
            400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format"
        )
    dims = doc.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ApiError(400, f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    name = doc.get("prompt_name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'prompt_name' must be a string", param="prompt_name")
    return EmbeddingsRequest(
        texts=texts,
        model=model,
        encoding_format=fmt,
        dimensions=dims,
        config=_config_fields(doc),
        prompt_name=name,
        truncate=_bool(doc, "truncate", False),
    )


@dataclass(frozen=True)
class RoutingRequest:
    """A parsed ``POST /v1/routing`` body."""

    texts: list[str]
    model: str | None
    config: dict[str, Any]
    prompt_name: str | None
    dense: bool
    top_k: int


def parse_routing_request(doc: dict[str, Any]) -> RoutingRequest:
    _unknown(doc, _ROUTING_FIELDS)
    texts, _ = _inputs(doc)
    top_k = doc.get("top_k", 2)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ApiError(400, f"'top_k' must be a positive integer, got {top_k!r}", param="top_k")
    config = {k: doc[k] for k in ("prompt", "score") if k in doc}
    if isinstance(config.get("prompt"), list):
        raise ApiError(400, "routing runs one prompt: give one name or template, not a list", param="prompt")
    return RoutingRequest(
        texts=texts,
        model=doc.get("model"),
        config=config,
        prompt_name=doc.get("prompt_name"),
        dense=_bool(doc, "dense", False),
        top_k=top_k,
    )


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as the response carries it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
