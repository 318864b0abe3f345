"""Benchmark 9 (BENCHMARKS.md): `moee serve` throughput and latency on loopback.

Goal: at concurrency 32, texts/s >= 3x one-request-at-a-time serving (concurrency 1) and >= 0.85x
offline ``encode`` of the same texts (``batch_size=32``, one process, no HTTP).

Every request embeds one text of a length mix (``moee.benchmarking.length_mix_texts``: glosses to
news articles, random order) with the bundled model; clients are threads of this process holding
one keep-alive connection each, the server (``moee.serving.app.serve_in_thread``) runs in the same
process, so client, HTTP and JSON costs are all counted against the server. Also measured: the
same server with batching off (``max_batch_tokens=1``: one text per forward) at concurrency 32.
Each variant runs ``--reps`` times in rotating order; figures are medians. Every response is
checked against ``encode`` of its text (max abs difference reported).

Where the concurrency-32 time goes: the batched server's forwards are timed on its forward thread
(the rest of the wall time, the forward thread was idle between forwards), and after each
concurrency-32 repetition the same forwards are replayed with no HTTP load: the difference is what
sharing the process with the event loop and the client threads (the GIL and the two cores) costs
the forwards; the replay against offline ``encode`` is what the server's batches cost or save.

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_serve.py
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moee.benchmarking import length_mix_texts, write_result
from moee.embed.embedder import MoEEmbedder
from moee.serving.app import ServerSettings, create_app, serve_in_thread

#: One client's way of embedding a text: ``embed(text) -> vector``, open while its context lasts.
Connect = Callable[[str], contextlib.AbstractContextManager[Callable[[str], np.ndarray]]]


@contextlib.contextmanager
def http_connection(url: str) -> Iterator[Callable[[str], np.ndarray]]:
    """One keep-alive ``http.client`` connection posting float JSON (the least client cost)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def embed(text: str) -> np.ndarray:
        body = json.dumps({"input": [text], "encoding_format": "float"})
        conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        response = conn.getresponse()
        doc = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"{response.status} {doc}")
        return np.asarray(doc["data"][0]["embedding"], np.float32)

    try:
        yield embed
    finally:
        conn.close()


@contextlib.contextmanager
def openai_connection(
    url: str, model: str | None = None, timeout: float = 120
) -> Iterator[Callable[[str], np.ndarray]]:
    """The official ``openai`` client, as a user queries ``moee serve`` (its default base64
    vectors); ``model`` is the served model's id (``None``: asked of ``GET /v1/models``)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)
    served = model or client.models.list().data[0].id

    def embed(text: str) -> np.ndarray:
        response = client.embeddings.create(model=served, input=[text])
        return np.asarray(response.data[0].embedding, np.float32)

    try:
        yield embed
    finally:
        client.close()


def run_clients(
    url: str,
    texts: list[str],
    concurrency: int,
    deadline: float,
    connect: Connect = http_connection,
) -> tuple[float, list[float], np.ndarray]:
    """Send every text as its own request from ``concurrency`` threads, each holding one
    ``connect(url)`` client; wall seconds, per-request latencies and the vectors in text order."""
    out: list[np.ndarray | None] = [None] * len(texts)
    latencies: list[float] = []
    lock = threading.Lock()
    cursor = iter(range(len(texts)))

    def worker() -> None:
        with connect(url) as embed:
            while time.monotonic() < deadline:
                with lock:
                    i = next(cursor, None)
                if i is None:
                    break
                start = time.perf_counter()
                try:
                    vector = embed(texts[i])
                except Exception as exc:
                    raise RuntimeError(f"request {i}: {exc}") from exc
                elapsed = time.perf_counter() - start
                out[i] = vector
                with lock:
                    latencies.append(elapsed)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - start
    if any(v is None for v in out):
        raise RuntimeError("the time bound ran out before every request was answered; lower --texts")
    return wall, latencies, np.stack(out)


def timed_forwards(app) -> list[tuple[list[str], object, float]]:
    """The list each forward of ``app``'s batcher appends to: its texts, configuration and seconds
    on the forward thread (``clear()`` it to start a count)."""
    batcher = app.state.batcher
    features = batcher._features
    forwards: list[tuple[list[str], object, float]] = []

    def timed(texts: list[str], config):
        start = time.perf_counter()
        out = features(texts, config)
        forwards.append((list(texts), config, time.perf_counter() - start))
        return out

    batcher._features = timed
    return forwards


def replay(emb: MoEEmbedder, forwards: list[tuple[list[str], object, float]]) -> float:
    """Seconds the recorded forwards take again, one after another, with no HTTP load."""
    start = time.perf_counter()
    for texts, config, _ in forwards:
        emb.features(texts, config, batch_size=len(texts), show_progress_bar=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=900, help="bound on the whole run")
    parser.add_argument("--out", default=None, help="results folder (default: bench/results)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.max_seconds
    load = os.getloadavg()[0]

    emb = MoEEmbedder.from_pretrained("minilm-moe")  # the model of BENCHMARKS.md section 9
    texts = length_mix_texts(args.texts, seed=0)
    expected = emb.encode(texts, batch_size=32)
    variants = ["offline", "c1", "c8", "c32", "c32_unbatched"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    lat: dict[str, list[float]] = {v: [] for v in variants}
    max_diff = 0.0
    app = create_app(emb, ServerSettings())
    forwards = timed_forwards(app)
    parts: dict[str, list[float]] = {k: [] for k in ("forward_s", "idle_s", "replay_s", "forwards", "rows")}
    with (
        serve_in_thread(app) as url,
        serve_in_thread(create_app(emb, ServerSettings(max_batch_tokens=1))) as unbatched,
    ):
        run_clients(url, texts[:16], 4, deadline)  # warm-up
        for rep in range(args.reps):
            for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                if v == "offline":
                    start = time.perf_counter()
                    emb.encode(texts, batch_size=32)
                    times[v].append(time.perf_counter() - start)
                    continue
                target = unbatched if v == "c32_unbatched" else url
                concurrency = int(v[1:].split("_")[0])
                forwards.clear()
                wall, latencies, got = run_clients(target, texts, concurrency, deadline)
                max_diff = max(max_diff, float(np.abs(got - expected).max()))
                times[v].append(wall)
                lat[v].extend(latencies)
                if v == "c32":
                    served = sum(seconds for _, _, seconds in forwards)
                    parts["forward_s"].append(served)
                    parts["idle_s"].append(wall - served)
                    parts["replay_s"].append(replay(emb, forwards))
                    parts["forwards"].append(len(forwards))
                    parts["rows"].append(len(texts) / len(forwards))
    rate = {v: args.texts / statistics.median(times[v]) for v in variants}
    rows = {
        v: {
            "texts_per_s": rate[v],
            "median_s": statistics.median(times[v]),
            "all_s": times[v],
            **(
                {
                    "p50_ms": 1000 * float(np.percentile(lat[v], 50)),
                    "p99_ms": 1000 * float(np.percentile(lat[v], 99)),
                }
                if lat[v]
                else {}
            ),
        }
        for v in variants
    }
    payload = {
        "texts": args.texts,
        "reps": args.reps,
        "load_avg_1min_at_start": load,
        "variants": rows,
        "c32_vs_c1": rate["c32"] / rate["c1"],
        "c32_vs_offline": rate["c32"] / rate["offline"],
        "c32_vs_c32_unbatched": rate["c32"] / rate["c32_unbatched"],
        "max_abs_diff_vs_encode": max_diff,
        "c32_breakdown": {
            "wall_s": statistics.median(times["c32"]),
            "offline_s": statistics.median(times["offline"]),
            "offline_forwards": -(-args.texts // 32),
            **{k: statistics.median(v) for k, v in parts.items()},
            "all": parts,
        },
        "goal": {"c32_vs_c1": 3.0, "c32_vs_offline": 0.85},
    }
    path = write_result("serve", payload, args.out)
    print("| variant | texts/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for v in variants:
        r = rows[v]
        print(
            f"| {v} | {r['texts_per_s']:.1f} | {r.get('p50_ms', float('nan')):.1f} | {r.get('p99_ms', float('nan')):.1f} |"
        )
    print(
        f"c32/c1 {payload['c32_vs_c1']:.2f}x  c32/offline {payload['c32_vs_offline']:.2f}x  "
        f"c32/unbatched {payload['c32_vs_c32_unbatched']:.2f}x  max|diff| {max_diff:.2e}  -> {path}"
    )
    b = payload["c32_breakdown"]
    print(
        f"c32 {b['wall_s']:.2f} s = forwards {b['forward_s']:.2f} s ({b['forwards']:.0f} of {b['rows']:.1f} rows; "
        f"replayed without load {b['replay_s']:.2f} s) + idle {b['idle_s']:.2f} s; offline {b['offline_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
