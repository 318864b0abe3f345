"""`moee serve` with real clients on 127.0.0.1: the official openai client, concurrent clients
co-batched, every limit, disconnects, routing, metrics, and the SIGTERM drain of the CLI server."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from moee.embed.embedder import MoEEmbedder  # noqa: E402
from moee.serving.app import ServerSettings, create_app, serve_in_thread  # noqa: E402
from moee.serving.batcher import cut_batches  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a cat dog sat on mat red blue fast slow house tree river stone light dark".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 24)))) for _ in range(n)]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir) -> MoEEmbedder:
    return MoEEmbedder.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(embedder):
    """One server for the tests that need no special limits (routing on)."""
    with serve_in_thread(create_app(embedder, ServerSettings(batch_wait_ms=5, enable_routing=True))) as url:
        yield url


def _post(url: str, body, *, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _vectors(doc: dict) -> np.ndarray:
    rows = []
    for item in doc["data"]:
        e = item["embedding"]
        rows.append(
            np.frombuffer(base64.b64decode(e), "<f4") if isinstance(e, str) else np.asarray(e, np.float32)
        )
    return np.stack(rows)


def _metric(url: str, name: str) -> float:
    """The sum of a Prometheus series over its labels (0 when absent)."""
    total = 0.0
    for line in _get(url + "/metrics").splitlines():
        if not line.startswith("#") and line.startswith(name) and ("{" in name or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- the openai client
def test_openai_client_gets_encode_vectors_base64_and_float(server, embedder) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    texts = _texts(5, seed=1)
    expected = embedder.encode(texts)
    default = client.embeddings.create(input=texts, model=Path(embedder.name_or_path).name)  # base64
    floats = client.embeddings.create(
        input=texts, model=Path(embedder.name_or_path).name, encoding_format="float"
    )
    for out in (default, floats):
        got = np.array([d.embedding for d in sorted(out.data, key=lambda d: d.index)], np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-6)
    assert default.usage.prompt_tokens == sum(embedder.token_lengths(texts))
    with pytest.raises(openai.BadRequestError, match="dimensions=3 cannot be honoured"):
        client.embeddings.create(input=texts, model=Path(embedder.name_or_path).name, dimensions=3)


def test_extension_fields_choose_the_configuration(server, embedder) -> None:
    status, doc = _post(
        server + "/v1/embeddings", {"input": "a red cat", "method": "hs", "prompt": "prompteol"}
    )
    assert status == 200
    np.testing.assert_allclose(
        _vectors(doc)[0], embedder.encode("a red cat", method="hs", prompt="prompteol"), atol=1e-6
    )
    assert doc["moee_config"] == embedder.resolve_config(method="hs", prompt="prompteol").to_dict()
    status, doc = _post(
        server + "/v1/embeddings", {"input": ["x"], "dimensions": embedder.hidden_size, "method": "hs"}
    )
    assert status == 200 and len(doc["data"][0]["embedding"]) == embedder.hidden_size


@pytest.mark.parametrize(
    ("body", "raw", "status", "message"),
    [
        ({"input": []}, None, 400, "empty list"),
        ({"input": ["ok", 3]}, None, 400, "input[1] must be a string"),
        ({"input": ["ok"], "method": "nope"}, None, 400, "unknown method 'nope'"),
        (None, b"{not json", 400, "not valid JSON"),
        ({"input": ["ok"], "colour": 1}, None, 400, "unknown field(s) colour"),
        ({"input": ["ok"], "alpha": "auto"}, None, 400, "alpha"),
        ({"input": ["ok"], "encoding_format": "int8"}, None, 400, "encoding_format"),
        ({"input": ["ok"], "model": "gpt-x"}, None, 404, "is not served here"),
        ({"input": ["ok"], "reference": "/etc/passwd"}, None, 400, "names a file on the server"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    server, body, raw, status, message
) -> None:
    got, doc = _post(server + "/v1/embeddings", body, raw=raw)
    assert got == status and message in doc["error"]["message"], doc
    assert _post(server + "/v1/embeddings", {"input": "still up"})[0] == 200


def test_a_request_form_is_resolved_and_checked_once(embedder, monkeypatch) -> None:
    """config_for keeps each request form's checked configuration (the reference check walks every
    weight): a form seen again costs a look-up; 1 and 1.0 are two forms; a mistake is refused every
    time and never kept; the forms kept are bounded in number and length."""
    from moee.serving import app as serving_app
    from moee.serving.protocol import ApiError

    service = serving_app.EmbeddingService(embedder, ServerSettings())
    checked = []
    original = service._checked_config
    monkeypatch.setattr(
        service, "_checked_config", lambda given, name: checked.append(given) or original(given, name)
    )
    first = service.config_for({}, None)
    assert service.config_for({}, None) is first and len(checked) == 1
    assert service.config_for({"method": "rw"}, None) == embedder.resolve_config(method="rw")
    assert service.config_for({"alpha": 1}, None) == service.config_for({"alpha": 1.0}, None)
    assert len(checked) == 4
    for _ in range(2):
        with pytest.raises(ApiError, match="unknown method 'nope'"):
            service.config_for({"method": "nope"}, None)
    assert len(checked) == 6
    long = "x" * serving_app.CONFIG_CACHE_KEY_CHARS + " {text}"
    for _ in range(2):
        assert service.config_for({"prompt": long}, None).prompt == long
    assert len(checked) == 8  # a long form is checked each time, never kept
    monkeypatch.setattr(serving_app, "CONFIG_CACHE_SIZE", 2)
    service.config_for({"method": "hs"}, None)
    assert list(service._configs) == [repr(([("alpha", 1.0)], None)), repr(([("method", "hs")], None))]


def test_short_requests_are_tokenized_on_the_loop_long_or_contended_ones_on_a_thread(
    embedder, monkeypatch
) -> None:
    from moee.serving.app import INLINE_TOKENIZE_CHARS

    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn, *args, **kwargs):
        hops.append(fn.__name__)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    app = create_app(embedder, ServerSettings())
    with serve_in_thread(app) as url:
        assert _post(url + "/v1/embeddings", {"input": ["a short text"]})[0] == 200
        assert hops == []
        long = " ".join(WORDS * (INLINE_TOKENIZE_CHARS // len(" ".join(WORDS)) + 1))
        status, doc = _post(url + "/v1/embeddings", {"input": [long]})
        assert status == 200 and hops == ["prepare"]
        np.testing.assert_allclose(_vectors(doc)[0], embedder.encode(long), atol=1e-6)
        # the counting tokenizer busy (another request being counted): a short request waits for it
        # on a thread, and the loop goes on serving
        lock = app.state.service.counter._lock
        result: dict = {}
        waiting = threading.Thread(
            target=lambda: result.update(r=_post(url + "/v1/embeddings", {"input": ["short"]}))
        )
        with lock:
            waiting.start()
            _wait(lambda: len(hops) == 2)
            assert json.loads(_get(url + "/health"))["status"] == "ok"
            assert not result
        waiting.join(timeout=30)
        status, doc = result["r"]
        assert status == 200
        np.testing.assert_allclose(_vectors(doc)[0], embedder.encode("short"), atol=1e-6)


# ---------------------------------------------------------------------------- dynamic batching
def test_cut_batches_sorts_by_length_under_the_token_budget() -> None:
    lengths = [3, 10, 1, 10, 4, 50]
    batches = cut_batches(lengths, 24)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert batches[0] == [5]  # longer than the budget: alone
    for b in batches:
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
        assert len(b) == 1 or len(b) * lengths[b[0]] <= 24
    # one long text does not make thirty short ones pad to its length; the short ones share a forward
    mixed = cut_batches([256] + [5] * 31, 16384)
    assert sorted(map(len, mixed)) == [1, 31]
    assert len(cut_batches([7] * 40, 16384)) == 1


def test_concurrent_clients_are_co_batched_and_each_gets_its_own_encode(server, embedder) -> None:
    """32 clients x 10 requests, two feature configurations and two methods sharing one: every
    response equals `encode` of its texts alone, none is lost, and forwards held several requests."""
    configs = [{}, {"method": "rw"}, {"prompt": "prompteol"}]
    pool = _texts(64, seed=2)
    expected = {i: embedder.encode(pool, **cfg) for i, cfg in enumerate(configs)}
    batches_before = _metric(server, "moee_batch_size_count")

    def client(c: int) -> int:
        rng = np.random.default_rng(100 + c)
        ok = 0
        for _ in range(10):
            k = int(rng.integers(len(configs)))
            rows = rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)
            status, doc = _post(server + "/v1/embeddings", {"input": [pool[r] for r in rows], **configs[k]})
            assert status == 200, doc
            np.testing.assert_allclose(_vectors(doc), expected[k][rows], atol=1e-6)
            ok += 1
        return ok

    start = time.monotonic()
    with ThreadPoolExecutor(32) as ex:
        assert sum(ex.map(client, range(32))) == 320
    assert time.monotonic() - start < 60
    forwards = _metric(server, "moee_batch_size_count") - batches_before
    rows = _metric(server, "moee_batch_size_sum")
    assert 0 < forwards < 320, "concurrent requests were not merged into shared forwards"
    assert rows >= 320


# ---------------------------------------------------------------------------- limits
def test_limits_on_inputs_and_tokens(embedder) -> None:
    settings = ServerSettings(max_inputs_per_request=3, max_tokens_per_input=4)
    with serve_in_thread(create_app(embedder, settings)) as url:
        status, doc = _post(url + "/v1/embeddings", {"input": ["a"] * 4})
        assert status == 413 and "limit of 3 inputs per request" in doc["error"]["message"]
        long = "the cat sat on the red mat"
        status, doc = _post(url + "/v1/embeddings", {"input": [long]})
        assert (
            status == 400
            and "limit of 4 tokens per input (moee serve --max-tokens-per-input" in doc["error"]["message"]
        )
        status, doc = _post(url + "/v1/embeddings", {"input": [long], "truncate": True})
        assert status == 200
        np.testing.assert_allclose(_vectors(doc)[0], embedder.encode("the cat sat on"), atol=1e-6)


@pytest.mark.slow
def test_a_full_queue_answers_429_and_a_disconnect_drops_queued_work(embedder) -> None:
    settings = ServerSettings(max_concurrent_requests=1, batch_wait_ms=1500)
    with serve_in_thread(create_app(embedder, settings)) as url:
        # a client that goes away while its request waits: its rows never reach a forward
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request(
            "POST",
            "/v1/embeddings",
            json.dumps({"input": ["gone"] * 5}),
            {"content-type": "application/json"},
        )
        _wait(lambda: json.loads(_get(url + "/health"))["pending_requests"] == 1)
        # meanwhile the one admission slot is taken: the next request is refused at once
        status, doc = _post(url + "/v1/embeddings", {"input": ["b"]})
        assert status == 429 and "limit of 1 concurrent requests" in doc["error"]["message"]
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        _wait(lambda: json.loads(_get(url + "/health"))["pending_requests"] == 0)
        assert _metric(url, "moee_cancelled_texts_total") == 5
        time.sleep(1.6)  # the batch window passes: nothing of the dropped request runs
        assert _metric(url, "moee_batch_size_count") == 0
        assert _post(url + "/v1/embeddings", {"input": ["b"]})[0] == 200
        assert _metric(url, 'moee_request_errors_total{code="429"') == 1


# ---------------------------------------------------------------------------- routing, models, metrics
def test_routing_endpoint_returns_the_token_routes(server, embedder) -> None:
    status, doc = _post(server + "/v1/routing", {"input": ["a red cat", "dog"], "dense": True})
    assert status == 200, doc
    routes = list(embedder.iter_token_routes(["a red cat", "dog"]))
    assert doc["layers"] == embedder.layers and doc["n_experts"] == embedder.n_experts
    for item, route in zip(doc["data"], routes):
        assert item["token_ids"] == route.input_ids.tolist()
        assert len(item["tokens"]) == len(item["token_ids"])
        np.testing.assert_allclose(np.array(item["dense"]), route.probs, atol=1e-6)
        for li, layer in enumerate(item["layers"]):
            assert layer["experts"] == [[int(e) for e in row if e >= 0] for row in route.selection[:, li]]
            assert layer["selection"] in ("router", "rederived")
            assert np.allclose(layer["weights"][0], route.probs[0, li, layer["experts"][0]])
    status, doc = _post(server + "/v1/routing", {"input": ["x"], "prompt": ["prompteol", "meaning"]})
    assert status == 400 and "one prompt" in doc["error"]["message"]


def test_models_health_and_metrics(server, embedder) -> None:
    card = json.loads(_get(server + "/v1/models"))["data"][0]
    assert card["id"] == Path(embedder.name_or_path).name
    assert card["moee"]["weights_digest"] == embedder.weights_digest
    assert card["moee"]["dimensions"] == embedder.config_dim(embedder.default_config)
    assert json.loads(_get(server + "/health"))["status"] == "ok"
    _post(server + "/v1/embeddings", {"input": ["count me"]})
    text = _get(server + "/metrics")
    for name in (
        "moee_requests_total",
        "moee_request_errors_total",
        "moee_request_latency_seconds_bucket",
        "moee_batch_size_bucket",
        "moee_queue_depth",
        "moee_tokens_total",
        "moee_tokens_per_second",
    ):
        assert name in text, name
    assert _metric(server, "moee_tokens_per_second") > 0


# ---------------------------------------------------------------------------- the CLI server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_moee_serve_drains_in_flight_requests_on_sigterm(tiny_model_dir, embedder) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "moee.cli", "serve", "--model", tiny_model_dir, "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--batch-wait-ms", "4000", "--log-level", "warning"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150  # importing torch on a loaded machine
        while True:
            try:
                _get(url + "/health")
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "moee serve did not start"
                time.sleep(0.1)
        texts = _texts(3, seed=3)
        results: list = [None] * 3

        def call(i: int) -> None:
            results[i] = _post(url + "/v1/embeddings", {"input": [texts[i]]})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        _wait(lambda: _metric(url, "moee_pending_requests") == 3, timeout=30)  # inside one batch window
        proc.send_signal(signal.SIGTERM)  # while all three wait in the batch window
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for i, (status, doc) in enumerate(results):
        assert status == 200, doc
        np.testing.assert_allclose(_vectors(doc)[0], embedder.encode(texts[i]), atol=1e-6)


# ---------------------------------------------------------------------------- moee search --server
def test_search_embeds_queries_through_the_server_and_checks_its_weights(
    server, embedder, tmp_path, capsys
) -> None:
    from moee.capture.tiny import tiny_model, tiny_tokenizer
    from moee.cli import main
    from moee.corpus import save_corpus

    texts = _texts(12, seed=4)
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    save_corpus(tmp_path / "c.npy", texts, embedder, prompt="prompteol")
    args = ["search", "--embeddings", str(tmp_path / "c.npy"), "--texts", str(tmp_path / "c.txt")]
    args += ["--query", texts[3], "--json", "-k", "3"]
    assert main(args) == 0  # the model loaded here
    local = json.loads(capsys.readouterr().out)
    assert main([*args, "--server", server]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert [h["id"] for h in remote["results"]] == [h["id"] for h in local["results"]]
    assert remote["results"][0]["id"] == 3
    np.testing.assert_allclose(
        [h["score"] for h in remote["results"]], [h["score"] for h in local["results"]], atol=1e-5
    )

    other = MoEEmbedder(tiny_model("olmoe", n_layers=1), tiny_tokenizer(), name_or_path="other")
    save_corpus(tmp_path / "o.npy", texts, other)
    bad = [
        "search",
        "--embeddings",
        str(tmp_path / "o.npy"),
        "--texts",
        str(tmp_path / "c.txt"),
        "--query",
        "x",
    ]
    assert main([*bad, "--server", server]) == 2
    assert "was embedded with weights" in capsys.readouterr().err


def test_bad_server_settings_name_their_flag() -> None:
    with pytest.raises(ValueError, match=r"--max-batch-tokens\) must be a positive integer"):
        ServerSettings(max_batch_tokens=0)
    with pytest.raises(ValueError, match="--max-tokens-per-input"):
        ServerSettings(max_tokens_per_input=0)
