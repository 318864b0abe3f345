"""A small client of a running ``moee serve`` (standard library only): what ``moee search
--server`` embeds its queries with."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from moee.embed.config import EmbeddingConfig
from moee.serving.settings import API_KEY_ENV

__all__ = ["ServerClient", "request_fields"]


def request_fields(config: EmbeddingConfig) -> dict[str, Any]:
    """``config`` as the extension fields of a ``/v1/embeddings`` body (every field explicit, so the
    server's own defaults cannot change the vectors)."""
    fields = config.to_dict()
    fields.pop("prompt_template", None)
    return fields


class ServerClient:
    """``GET /v1/models`` and ``POST /v1/embeddings`` of the server at ``url`` (e.g.
    ``http://127.0.0.1:8080``); every failure is a ``ValueError`` naming the server and its message.
    ``api_key``: the server's key (default: the ``MOEE_API_KEY`` environment variable, as ``moee
    serve`` reads it), sent as ``Authorization: Bearer``."""

    def __init__(self, url: str, *, timeout: float = 120.0, api_key: str | None = None) -> None:
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--server {url!r} must be an http(s) URL, e.g. http://127.0.0.1:8080")
        self.url, self.timeout = url, timeout
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._card: dict[str, Any] | None = None

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"content-type": "application/json"}
        if self._api_key is not None:
            headers["authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise ValueError(f"server {self.url} answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ValueError(
                f"cannot reach the server at {self.url}: {reason} (is `moee serve` running?)"
            ) from None

    def model_card(self) -> dict[str, Any]:
        """The served model (``/v1/models``'s entry: ``id`` and ``moee.weights_digest`` ...)."""
        if self._card is None:
            data = self._call("/v1/models").get("data") or []
            if not data or "moee" not in data[0]:
                raise ValueError(f"{self.url} is not a moee server (its /v1/models names no moee model)")
            self._card = data[0]
        return self._card

    @property
    def weights_digest(self) -> str:
        return self.model_card()["moee"]["weights_digest"]

    def embed(self, texts: Sequence[str], config: EmbeddingConfig) -> np.ndarray:
        """float32 ``[len(texts), dim]`` under exactly ``config``, in requests of at most the
        server's ``max_inputs_per_request`` inputs."""
        card = self.model_card()
        step = int(card["moee"].get("max_inputs_per_request", 2048))
        fields = request_fields(config)
        rows: list[np.ndarray] = []
        for start in range(0, len(texts), step):
            chunk = list(texts[start : start + step])
            doc = self._call(
                "/v1/embeddings",
                {"input": chunk, "model": card["id"], "encoding_format": "base64", **fields},
            )
            for item in sorted(doc["data"], key=lambda d: d["index"]):
                rows.append(np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4"))
        if not rows:
            return np.zeros((0, int(card["moee"]["dimensions"])), np.float32)
        return np.stack(rows).astype(np.float32)
