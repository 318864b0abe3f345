"""The server's JSON protocol: request parsing (every mistake a 4xx naming the field and the fix)
and response shapes. Every body is strict JSON checked before any field is read
(:func:`check_values`: nesting, number range, ``NaN`` / ``Infinity``, lone surrogates), and each
field has its JSON types (the configuration fields' from ``EmbeddingConfig``'s annotations,
:data:`CONFIG_TYPES`), so no client mistake reaches the model as a 500.

``POST /v1/embeddings`` takes the OpenAI schema (``input``, ``model``, ``encoding_format``
``float`` | ``base64`` (little-endian float32, the official client's default), ``dimensions``,
``user``) plus moee's extension fields: any field of :class:`moee.embed.config.EmbeddingConfig`
(``method``, ``pooling``, ``prompt``, ``score``, ``alpha``, ``normalize``, ``recipe``, ``hs_layer``,
``rw_layers``; ``reference`` only as the model's own), ``prompt_name`` (a named prompt of the
model's configuration) and ``truncate`` (cut inputs over the per-input token limit instead of
refusing them). Fields left out come from the model's configuration, resolved as ``encode``
resolves them (:func:`moee.embed.config.resolve_config`); the response's ``moee_config`` is the
configuration used (``EmbeddingConfig.to_dict()``).

``POST /v1/routing`` (served only by ``moee serve --enable-routing``) takes ``input``, ``model``, ``prompt``, ``prompt_name``, ``score``, ``dense``
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
import math
import re
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from moee.embed.config import EmbeddingConfig

__all__ = [
    "ApiError",
    "EmbeddingsRequest",
    "RoutingRequest",
    "CONFIG_FIELDS",
    "CONFIG_TYPES",
    "MAX_DEPTH",
    "MAX_NUMBER",
    "check_values",
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


#: The deepest nesting a request body may have (the deepest field, ``rw_layers`` as a list of
#: ``[layer, weight]`` pairs, has 3 levels).
MAX_DEPTH = 16
#: The largest magnitude of a number in a request: no field takes more (layer indices, widths,
#: ``top_k``, weights, ``alpha``), and the bound keeps every product of them finite.
MAX_NUMBER = 1_000_000


@dataclass(frozen=True)
class _Unfit:
    """A JSON number the parser keeps as its text, for :func:`check_values` to refuse by field:
    ``NaN`` / ``Infinity`` (not JSON), a float beyond float range, an integer too long to convert."""

    text: str


def _parse_int(text: str) -> int | _Unfit:
    return int(text) if len(text) <= 20 else _Unfit(text)


def _parse_float(text: str) -> float | _Unfit:
    value = float(text)
    return value if math.isfinite(value) else _Unfit(text)


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object whose every value passes :func:`check_values` (400
    naming the field otherwise): strict JSON, whatever a client sends."""
    try:
        doc = json.loads(body, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_Unfit)
    except RecursionError:
        field = _deep_field(body)
        raise ApiError(
            400,
            f"{_quoted(field) if field else 'the request body'} {_TOO_DEEP}",
            param=field,
            code="invalid_json",
        ) from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8 (UnicodeDecodeError)
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(doc).__name__}")
    check_values(doc)
    return doc


_TOO_DEEP = f"nests deeper than any field of this API (at most {MAX_DEPTH} levels)"
_NUMBERS = f"numbers in a request are at most {MAX_NUMBER:,} in magnitude"


def _quoted(name: str) -> str:
    """A field name as messages show it (escaped: a message must encode as UTF-8)."""
    return json.dumps(name)[1:-1]


def _problem(value: Any, depth: int) -> str | None:
    """What is wrong with one JSON value whatever its field (``None``: nothing)."""
    if depth > MAX_DEPTH:
        return _TOO_DEEP
    if isinstance(value, _Unfit):
        if value.text.lstrip("-") in ("NaN", "Infinity"):
            return f"is {value.text}, which is not JSON; give a finite number ({_NUMBERS})"
        digits = len(value.text.lstrip("-"))
        shown = f"a {digits}-digit integer" if digits > 20 else value.text
        return f"is {shown}; {_NUMBERS}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        return f"is {value:g}; {_NUMBERS}"
    if isinstance(value, str) and not value.isascii() and not _is_unicode(value):
        return "contains a lone surrogate (a half of a UTF-16 pair): it is not Unicode text; send UTF-8 text"
    return None


def check_values(doc: dict[str, Any]) -> None:
    """Refuse, naming the field and where in it, any value no field of this API takes: nesting
    over :data:`MAX_DEPTH`, a number that is not finite or beyond :data:`MAX_NUMBER` (``NaN``,
    ``Infinity``, ``1e400``, ``1e308``, a 5,000-digit integer), a string or key that is not
    Unicode text (a lone surrogate, which no tokenizer or UTF-8 encoder takes). Runs before any
    field is read, so no such value reaches the model (or an error message) to become a 500."""
    stack: list[tuple[str, str, Any, int]] = [(key, _quoted(key), value, 1) for key, value in doc.items()]
    stack += [(key, f"the field name {json.dumps(key)}", key, 1) for key in doc]
    while stack:
        field, where, value, depth = stack.pop()
        problem = _problem(value, depth)
        if problem is not None:
            raise ApiError(400, f"{where} {problem}", param=field if _is_unicode(field) else None)
        if isinstance(value, dict):
            stack.extend((field, f"{where}[{json.dumps(k)}]", v, depth + 1) for k, v in value.items())
            stack.extend((field, f"{where} key {json.dumps(k)}", k, depth + 1) for k in value)
        elif isinstance(value, list):
            stack.extend((field, f"{where}[{i}]", v, depth + 1) for i, v in enumerate(value))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _deep_field(body: bytes) -> str | None:
    """The top-level field whose value nests too deeply for the JSON parser (only read when it
    failed): the last string at depth 1 before a bracket opens there is that bracket's key."""
    depth, key = 0, None
    for match in _TOKEN.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                return key
        elif token in (b"]", b"}"):
            depth -= 1
        elif depth == 1:
            try:
                key = json.loads(token)
            except ValueError:
                key = None
    return None


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


#: JSON types by the Python type names of field annotations (``float`` takes an integer too).
_JSON_OF = {"str": (str,), "None": (type(None),), "float": (int, float), "int": (int,), "bool": (bool,)}
_JSON_OF.update(tuple=(list,), list=(list,), dict=(dict,))
_JSON_NAMES = {
    str: "a string",
    type(None): "null",
    int: "an integer",
    float: "a number",
    bool: "true or false",
}
_JSON_NAMES.update({list: "a list", dict: "an object"})
#: Request forms a configuration field takes beyond its annotation's (``rw_layers`` as
#: ``{"layer": weight}``; the command line's text forms ``"2:4"``, ``"0:1.0,3:0.5"``).
_REQUEST_FORMS: dict[str, tuple[type, ...]] = {"rw_layers": (dict, str), "hs_layer": (str,)}


def _json_types(annotation: str) -> tuple[type, ...]:
    """The JSON types of an annotation such as ``"int | tuple[int, int] | None"`` (its top-level
    union members; element types are the configuration's own check)."""
    while "[" in annotation:  # the element types go, innermost first
        annotation = re.sub(r"\[[^\[\]]*\]", "", annotation)
    members = annotation.split("|")
    return tuple(t for m in members for t in _JSON_OF[m.strip()])


#: Each configuration field's JSON types, from ``EmbeddingConfig``'s annotations: a new field is
#: type-checked without an entry here.
CONFIG_TYPES = {
    f.name: _json_types(str(f.type)) + _REQUEST_FORMS.get(f.name, ()) for f in fields(EmbeddingConfig)
}


def _typed(doc: dict[str, Any], name: str, types: tuple[type, ...], default: Any = None) -> Any:
    """``doc[name]`` (``default`` when absent), refused with a 400 naming the field unless it is
    one of the JSON ``types`` (``true`` is not a number here, though Python's bool is an int)."""
    value = doc.get(name, default)
    if value is None and name not in doc:
        return value
    kind = bool if isinstance(value, bool) else type(value)
    if kind not in types:
        shown = [t for t in types if not (t is int and float in types)]  # a number covers an integer
        wanted = " or ".join(dict.fromkeys(_JSON_NAMES[t] for t in shown))
        raise ApiError(
            400, f"'{name}' must be {wanted}, got {_JSON_NAMES.get(kind, kind.__name__)}", param=name
        )
    return value


def _bool(doc: dict[str, Any], name: str, default: bool) -> bool:
    return _typed(doc, name, (bool,), default)


def _optional_str(doc: dict[str, Any], name: str) -> str | None:
    return _typed(doc, name, (str, type(None)))


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


def _config_fields(doc: dict[str, Any], names: tuple[str, ...] = CONFIG_FIELDS) -> dict[str, Any]:
    """The configuration fields ``doc`` gives, each of its JSON types (:data:`CONFIG_TYPES`), in
    the forms ``EmbeddingConfig`` takes (lists as tuples, ``rw_layers`` keys as layer indices)."""
    given = {k: _typed(doc, k, CONFIG_TYPES[k]) for k in names if k in doc}
    for name in ("prompt", "hs_layer"):
        if isinstance(given.get(name), list):
            given[name] = tuple(given[name])
    rw = given.get("rw_layers")
    if isinstance(rw, dict):
        try:
            given["rw_layers"] = {int(k): v for k, v in rw.items()}
        except ValueError:
            raise ApiError(
                400, "'rw_layers' keys must be layer indices, e.g. {\"0\": 1.0}", param="rw_layers"
            ) from None
    elif isinstance(rw, list):
        given["rw_layers"] = tuple(tuple(v) if isinstance(v, list) else v for v in rw)
    return given


def parse_embeddings_request(doc: dict[str, Any]) -> EmbeddingsRequest:
    _unknown(doc, _EMBED_FIELDS)
    texts, _ = _inputs(doc)
    fmt = _typed(doc, "encoding_format", (str,), "float")
    if fmt not in ("float", "base64"):
        raise ApiError(
            400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format"
        )
    dims = _typed(doc, "dimensions", (int, type(None)))
    if dims is not None and dims < 1:
        raise ApiError(400, f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    _optional_str(doc, "user")
    return EmbeddingsRequest(
        texts=texts,
        model=_optional_str(doc, "model"),
        encoding_format=fmt,
        dimensions=dims,
        config=_config_fields(doc),
        prompt_name=_optional_str(doc, "prompt_name"),
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
    top_k = _typed(doc, "top_k", (int,), 2)
    if top_k < 1:
        raise ApiError(400, f"'top_k' must be a positive integer, got {top_k!r}", param="top_k")
    config = _config_fields(doc, ("prompt", "score"))
    if isinstance(config.get("prompt"), tuple):
        raise ApiError(400, "routing runs one prompt: give one name or template, not a list", param="prompt")
    _optional_str(doc, "user")
    return RoutingRequest(
        texts=texts,
        model=_optional_str(doc, "model"),
        config=config,
        prompt_name=_optional_str(doc, "prompt_name"),
        dense=_bool(doc, "dense", False),
        top_k=top_k,
    )


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as the response carries it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
