"""`moee serve` against hostile and careless clients, on 127.0.0.1 with real clients (the official
openai client among them): what one request may cost, client mistakes as 400s naming the field,
disconnects and slow connections, the API key, routing off by default, no local path in a response."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import _get, _metric, _post, _texts, _wait  # noqa: E402

from moee.embed.config import EmbeddingConfig  # noqa: E402
from moee.embed.embedder import MoEEmbedder  # noqa: E402
from moee.serving.app import create_app, serve_in_thread  # noqa: E402
from moee.serving.client import ServerClient  # noqa: E402
from moee.serving.protocol import CONFIG_TYPES, MAX_NUMBER  # noqa: E402
from moee.serving.settings import ServerSettings  # noqa: E402

openai = pytest.importorskip("openai")
MODEL = "tiny-olmoe0"  # the served id: the folder name of conftest's tiny_model_dir


@pytest.fixture(scope="module")
def embedder(tiny_model_dir) -> MoEEmbedder:
    return MoEEmbedder.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(embedder):
    """A server with the default settings (routing off, no key)."""
    with serve_in_thread(create_app(embedder, ServerSettings())) as url:
        yield url


def _client(url: str, key: str = "unused", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=30, **kwargs)


class _Records(logging.Handler):
    """The records of uvicorn's log (attach after the server starts: its logging setup resets
    the log's handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        logging.getLogger("uvicorn.error").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        logging.getLogger("uvicorn.error").removeHandler(self)
        super().close()

    def lines(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]

    def errors(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= logging.ERROR or r.exc_info]


def _raw(url: str, data: bytes, *, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (raises on the socket timeout)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


# ---------------------------------------------------------------------------- what a request costs
def test_default_limits_bound_what_one_request_costs() -> None:
    s = ServerSettings()
    assert s.max_chars_per_input == 100_000
    assert s.max_tokens_per_request == 300_000
    assert s.max_request_bytes == 16 * 2**20
    assert s.max_dense_routing_values == 1_000_000
    assert (s.idle_timeout_s, s.request_timeout_s, s.max_connections) == (5.0, 30.0, 1024)
    assert not s.enable_routing and s.api_key is None
    with pytest.raises(ValueError, match=r"--max-chars-per-input\) must be a positive integer"):
        ServerSettings(max_chars_per_input=0)
    with pytest.raises(ValueError, match=r"--request-timeout-s\) must be a finite number"):
        ServerSettings(request_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="api_key"):
        ServerSettings(api_key="")


def test_an_input_over_the_default_character_limit_is_413_naming_the_flag(server) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        _client(server, max_retries=0).embeddings.create(input=["ok", "a" * 100_001], model=MODEL)
    err = caught.value
    assert err.status_code == 413
    assert "input[1] has 100,001 characters" in err.message and "--max-chars-per-input" in err.message


def test_request_budgets_are_413_naming_their_flags(embedder) -> None:
    settings = ServerSettings(max_tokens_per_request=50, max_request_bytes=5000, enable_routing=True)
    with serve_in_thread(create_app(embedder, settings)) as url:
        client = _client(url, max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:  # 40 inputs of several tokens each
            client.embeddings.create(input=_texts(40, seed=5), model=MODEL)
        assert caught.value.status_code == 413
        assert "tokens per request (moee serve --max-tokens-per-request raises it)" in caught.value.message
        assert "in their first 40" not in caught.value.message  # counted as it tokenizes
        status, doc = _post(url + "/v1/embeddings", {"input": ["word " * 1200]})
        assert status == 413 and "--max-request-bytes" in doc["error"]["message"], doc
        # the token budget holds for routing too, counted with the routing prompt
        status, doc = _post(url + "/v1/routing", {"input": _texts(40, seed=5)})
        assert status == 413 and "--max-tokens-per-request" in doc["error"]["message"], doc
        assert client.embeddings.create(input=["fits"], model=MODEL).data  # the server keeps serving


def test_a_dense_routing_answer_over_its_bound_is_413_naming_the_flag(embedder) -> None:
    per_token = len(embedder.layers) * embedder.n_experts
    settings = ServerSettings(enable_routing=True, max_dense_routing_values=per_token * 5)
    with serve_in_thread(create_app(embedder, settings)) as url:
        status, doc = _post(url + "/v1/routing", {"input": ["the cat sat on the red mat"], "dense": True})
        assert status == 413 and doc["error"]["param"] == "dense"
        assert "--max-dense-routing-values" in doc["error"]["message"]
        assert _post(url + "/v1/routing", {"input": ["the cat sat on the red mat"]})[0] == 200
        assert _post(url + "/v1/routing", {"input": ["a cat"], "dense": True})[0] == 200


# ---------------------------------------------------------------------------- client mistakes: 400
BIG_INT = b"9" * 5000


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b'{"input": ["ok", "a \\ud800 b"]}', "input", "input[1] contains a lone surrogate"),
        (b'{"input": "a", "prompt": "Q: {text} \\udfff"}', "prompt", "prompt contains a lone surrogate"),
        (b'{"input": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "x", "nests deeper"),
        (b'{"input": "a", "rw_layers": {"0": ' + b"[" * 40 + b"]" * 40 + b"}}", "rw_layers", "nests deeper"),
        (b'{"input": "a", "dimensions": ' + BIG_INT + b"}", "dimensions", "5000-digit integer"),
        (
            b'{"input": "a", "method": "rw", "rw_layers": {"0": 1e308, "1": 1}}',
            "rw_layers",
            'rw_layers["0"] is 1e+308',
        ),
        (b'{"input": "a", "alpha": NaN}', "alpha", "alpha is NaN, which is not JSON"),
        (b'{"input": "a", "alpha": -Infinity}', "alpha", "alpha is -Infinity"),
        (b'{"input": "a", "alpha": 1e400}', "alpha", "alpha is 1e400"),
        (b'{"input": "a", "hs_layer": 10000000000000000000000}', "hs_layer", "23-digit integer"),
        (b'{"input": "a", "dimensions": true}', "dimensions", "'dimensions' must be an integer"),
        (b'{"input": "a", "recipe": [1]}', "recipe", "'recipe' must be a string or null, got a list"),
        (b'{"input": "a", "model": 5}', "model", "'model' must be a string"),
        (b'{"input": "a", "user": {}}', "user", "'user' must be a string"),
        (b'{"input": "a", "truncate": "yes"}', "truncate", "'truncate' must be true or false"),
        (b'{"input": "a", "\\ud800": 1}', None, "lone surrogate"),
    ],
)
def test_client_mistakes_are_400_naming_the_field(server, raw, param, words) -> None:
    status, doc = _post(server + "/v1/embeddings", None, raw=raw)
    assert status == 400, doc
    assert doc["error"]["param"] == param and words in doc["error"]["message"], doc


WEIRD = ([], {}, "x", "", 1, -1, 0, 1.5, True, False, None, [[1]], [1, "a"], {"a": 1}, {"0": "w"})
WEIRD += (MAX_NUMBER, -MAX_NUMBER, [MAX_NUMBER, MAX_NUMBER], "0:1e308", "a:b", "1,", "{text}", "none")


@pytest.mark.parametrize("field", sorted(CONFIG_TYPES))
def test_no_value_of_any_configuration_field_is_a_server_error(server, field) -> None:
    """Every configuration field (a new one too: the list comes from EmbeddingConfig) with values
    of every JSON type and odd ranges: a 200 or a 4xx naming the field, never a 5xx."""
    for value in WEIRD:
        for endpoint in ("/v1/embeddings",):
            status, doc = _post(server + endpoint, {"input": ["a red cat"], field: value})
            assert status < 500, (field, value, doc)
            if status >= 400:
                assert doc["error"]["param"] in (field, None) and field in doc["error"]["message"], (
                    field,
                    value,
                    doc,
                )


def test_routing_mistakes_are_400_naming_the_field(embedder) -> None:
    with serve_in_thread(create_app(embedder, ServerSettings(enable_routing=True))) as url:
        for body, param in [
            ({"input": "a", "prompt_name": [1]}, "prompt_name"),
            ({"input": "a", "top_k": True}, "top_k"),
            ({"input": "a", "top_k": 10**30}, "top_k"),
            ({"input": "a", "score": 3}, "score"),
            ({"input": "a", "model": ["x"]}, "model"),
            ({"input": "a", "dense": 1}, "dense"),
        ]:
            status, doc = _post(url + "/v1/routing", body)
            assert status == 400 and doc["error"]["param"] == param, (body, doc)


def test_the_openai_client_gets_a_400_once_not_a_retried_500(server) -> None:
    before = _metric(server, 'moee_requests_total{endpoint="/v1/embeddings"')
    client = _client(server, max_retries=2)
    deep: list = []
    for _ in range(40):
        deep = [deep]
    for extra in ({"rw_layers": {"0": 1e308}, "method": "rw"}, {"alpha": 1e300}, {"hs_layer": deep}):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(input=["a red cat"], model=MODEL, extra_body=extra)
    assert _metric(server, 'moee_requests_total{endpoint="/v1/embeddings"') - before == 3  # no retries


# ---------------------------------------------------------------------------- disconnects, connections
def _slow_routes(embedder, monkeypatch, seconds: float) -> list[int]:
    """Make each routed text take ``seconds`` (a large model's forward); returns the list that
    counts the texts routed."""
    routed: list[int] = []
    original = embedder.iter_token_routes

    def slow(texts, **kwargs):
        for route in original(texts, **kwargs):
            time.sleep(seconds)
            routed.append(1)
            yield route

    monkeypatch.setattr(embedder, "iter_token_routes", slow)
    return routed


@pytest.mark.slow
def test_a_long_routing_request_does_not_hold_embeddings_up(embedder, monkeypatch) -> None:
    routed = _slow_routes(embedder, monkeypatch, 0.1)
    texts = _texts(40, seed=6)
    settings = ServerSettings(enable_routing=True, max_routing_batch_tokens=64)
    with serve_in_thread(create_app(embedder, settings)) as url:
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(doc=_post(url + "/v1/routing", {"input": texts})), daemon=True
        )
        start = time.monotonic()
        thread.start()
        _wait(lambda: len(routed) > 0)
        t0 = time.monotonic()
        assert _client(url, max_retries=0).embeddings.create(input=["cat"], model=MODEL).data
        waited, routed_by_then = time.monotonic() - t0, len(routed)
        thread.join(timeout=60)
        total = time.monotonic() - start
    status, doc = result["doc"]
    assert status == 200 and [item["index"] for item in doc["data"]] == list(range(40))
    expected = list(embedder.iter_token_routes(texts))
    assert all(item["token_ids"] == r.input_ids.tolist() for item, r in zip(doc["data"], expected))
    assert routed_by_then < 40, "the embedding waited for the whole routing request"
    assert waited < total / 2, (waited, total)


def test_routing_stops_when_its_client_disconnects_and_logs_one_line(embedder, monkeypatch) -> None:
    routed = _slow_routes(embedder, monkeypatch, 0.05)
    settings = ServerSettings(enable_routing=True, max_routing_batch_tokens=64)
    app = create_app(embedder, settings)
    with serve_in_thread(app, log_level="info") as url:
        records = _Records()
        try:
            body = json.dumps({"input": _texts(60, seed=7)}).encode()
            head = f"POST /v1/routing HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            sock = _raw(url, head.encode() + body)
            _wait(lambda: len(routed) > 0)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            _wait(lambda: _metric(url, "moee_cancelled_texts_total") > 0)
            stopped_at = len(routed)
            time.sleep(1.0)  # a forward more would have routed texts by now
            assert len(routed) == stopped_at < 30
            assert records.lines("the client went away; the routing of its")
            assert not records.errors()
        finally:
            records.close()


def test_a_client_that_drops_mid_body_is_one_info_line_not_a_traceback(server, embedder) -> None:
    with serve_in_thread(create_app(embedder, ServerSettings()), log_level="info") as url:
        records = _Records()
        try:
            head = b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
            sock = _raw(url, head + b'{"input": ')
            time.sleep(0.2)
            sock.close()
            _wait(lambda: records.lines("went away before its request arrived whole"))
            assert not records.errors()
        finally:
            records.close()


def test_idle_and_half_sent_connections_are_closed(embedder) -> None:
    settings = ServerSettings(idle_timeout_s=0.5, request_timeout_s=0.5)
    with serve_in_thread(create_app(embedder, settings), log_level="info") as url:
        records = _Records()
        try:
            idle = _raw(url, b"")
            half_headers = _raw(url, b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n")
            head = b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
            half_body = _raw(url, head + b'{"input"')
            start = time.monotonic()
            assert _read_all(idle) == b""  # closed (the socket's 10 s timeout would raise instead)
            for sock in (half_headers, half_body):
                answer = _read_all(sock)
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert b"--request-timeout-s" in answer
            assert time.monotonic() - start < 5
            assert len(records.lines("did not arrive whole within 0.5 s")) == 2
            assert not records.errors()
            assert _post(url + "/v1/embeddings", {"input": "still up"})[0] == 200  # a prompt client is fine
        finally:
            records.close()


def test_connections_beyond_the_limit_get_503_naming_the_flag(embedder) -> None:
    settings = ServerSettings(max_connections=2, idle_timeout_s=30)
    with serve_in_thread(create_app(embedder, settings)) as url:
        held = [_raw(url, b""), _raw(url, b"")]
        time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as caught:
            _client(url, max_retries=0).embeddings.create(input=["x"], model=MODEL)
        assert caught.value.status_code == 503 and "--max-connections" in caught.value.message
        for sock in held:
            sock.close()
        _wait(lambda: _post(url + "/v1/embeddings", {"input": "x"})[0] == 200)


# ---------------------------------------------------------------------------- access
def test_the_api_key_guards_every_endpoint_but_health(embedder, monkeypatch) -> None:
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    with serve_in_thread(create_app(embedder, ServerSettings(api_key="s3cret"))) as url:
        with pytest.raises(openai.AuthenticationError) as caught:
            _client(url, "wrong").embeddings.create(input=["a cat"], model=MODEL)
        assert "not this server's" in caught.value.message and "MOEE_API_KEY" in caught.value.message
        assert compared, "the key was not compared with hmac.compare_digest"
        out = _client(url, "s3cret").embeddings.create(input=["a cat"], model=MODEL)
        np.testing.assert_allclose(out.data[0].embedding, embedder.encode("a cat"), atol=1e-6)
        status, doc = _post(url + "/v1/embeddings", {"input": "a cat"})  # no header at all
        assert status == 401 and "Authorization: Bearer" in doc["error"]["message"]
        for path in ("/v1/models", "/metrics", "/nowhere"):
            with pytest.raises(urllib.error.HTTPError) as http:
                _get(url + path)
            assert http.value.code == 401, path
        assert json.loads(_get(url + "/health"))["status"] == "ok"  # open, for probes
        # moee search --server's client sends the key of MOEE_API_KEY
        with pytest.raises(ValueError, match="answered 401"):
            ServerClient(url).model_card()
        monkeypatch.setenv("MOEE_API_KEY", "s3cret")
        assert ServerClient(url).weights_digest == embedder.weights_digest


def test_routing_is_off_unless_enabled(server) -> None:
    status, doc = _post(server + "/v1/routing", {"input": ["a red cat"]})
    assert status == 403 and "--enable-routing" in doc["error"]["message"], doc


def test_no_response_carries_a_local_path(embedder, tmp_path) -> None:
    ref = embedder.fit_reference(_texts(8, seed=8), tmp_path / "refs" / "ref")
    with_ref = MoEEmbedder(
        embedder.model,
        embedder.tokenizer,
        model_config=EmbeddingConfig(reference=str(ref)),
        name_or_path=embedder.name_or_path,
    )
    folders = (str(Path(embedder.name_or_path).parent), str(tmp_path))
    with serve_in_thread(create_app(with_ref, ServerSettings())) as url:
        answers = [_get(url + "/v1/models")]
        status, doc = _post(url + "/v1/embeddings", {"input": "a cat"})
        assert status == 200 and doc["moee_config"]["reference"] == "ref.safetensors"
        answers.append(json.dumps(doc))
        # the label /v1/models shows is accepted back as the model's own reference
        assert _post(url + "/v1/embeddings", {"input": "a cat", "reference": "ref.safetensors"})[0] == 200
        for body in (
            {"input": "a", "reference": "/etc/passwd"},
            {"input": "a", "method": "hs", "hs_layer": 99},  # the model's out-of-range message
        ):
            status, doc = _post(url + "/v1/embeddings", body)
            assert status == 400
            answers.append(json.dumps(doc))
        card = json.loads(answers[0])["data"][0]["moee"]
        assert (
            card["name"] == Path(embedder.name_or_path).name
            and card["config"]["reference"] == "ref.safetensors"
        )
    for answer in answers:
        for folder in folders:
            assert folder not in answer, answer


def test_binding_beyond_loopback_without_a_key_is_warned_about(monkeypatch) -> None:
    from dataclasses import replace

    from moee.cli import build_parser
    from moee.cli_options import settings_of
    from moee.serving.settings import ServeSettings

    parser = build_parser()

    def settings(*argv: str) -> ServeSettings:
        return settings_of(ServeSettings, parser.parse_args(["serve", *argv]))

    monkeypatch.delenv("MOEE_API_KEY", raising=False)
    open_settings = settings("--enable-routing", "--host", "0.0.0.0")
    warning = open_settings.exposure_warning()
    assert warning and "MOEE_API_KEY" in warning and "127.0.0.1" in warning and "routes" in warning
    for host in ("127.0.0.1", "::1", "localhost"):
        assert replace(open_settings, host=host).exposure_warning() is None
    monkeypatch.setenv("MOEE_API_KEY", "from-env")
    keyed = settings("--max-chars-per-input", "10", "--host", "0.0.0.0")
    assert keyed.server.api_key == "from-env" and keyed.server.max_chars_per_input == 10
    assert keyed.exposure_warning() is None
    assert "from-env" not in repr(keyed)
