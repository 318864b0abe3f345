"""Dynamic batching for the server: concurrent requests share length-sorted forwards.

Every embedding depends only on its own text (``moee.embed.embedder``: row-wise pooling, left
padding with positions counting real tokens), so the rows of many requests can be run in one
forward and each request still gets exactly what ``encode`` of its texts alone returns.

How a step runs: the scheduler takes the feature configuration (:meth:`EmbeddingConfig.feature_key`:
what the forward depends on) of the oldest waiting row, takes every waiting row of that
configuration, sorts them by token length (longest first) and cuts them into batches whose padded
size ``rows x longest`` stays within ``max_batch_tokens``, at the cuts that minimise padding plus
a per-forward overhead (:func:`cut_batches`). Requests whose configurations differ
only in ``method`` / ``alpha`` / ``normalize`` share forwards; each request combines its own rows.
Forwards run one at a time on one worker thread (the model's lock serialises them anyway), so the
event loop stays free to accept, refuse (429) and cancel requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moee.embed.config import EmbeddingConfig
from moee.embed.recipes import combine_features

__all__ = ["FORWARD_OVERHEAD_TOKENS", "Job", "DynamicBatcher", "cut_batches"]


@dataclass(eq=False)
class Job:
    """One request's texts under one configuration; rows are filled as their batches finish."""

    config: EmbeddingConfig
    texts: list[str]
    lengths: list[int]
    future: asyncio.Future
    hs: list[np.ndarray | None] = field(default_factory=list)
    rw: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.hs = [None] * len(self.texts)
        self.rw = [None] * len(self.texts)
        self.remaining = len(self.texts)

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))


@dataclass(eq=False)
class _Row:
    job: Job
    index: int

    @property
    def length(self) -> int:
        return self.job.lengths[self.index]

    @property
    def text(self) -> str:
        return self.job.texts[self.index]


#: What one forward costs beyond its tokens, in padded-token equivalents: hook and launch overhead
#: (on minilm-moe on CPU, a forward costs about 34 ms + 0.43 ms per padded token: ~78 tokens).
FORWARD_OVERHEAD_TOKENS = 64
#: More distinct lengths than this are bucketed (5% apart) before the cut is optimised.
_MAX_GROUPS = 256


def cut_batches(
    lengths: Sequence[int], max_batch_tokens: int, overhead_tokens: int = FORWARD_OVERHEAD_TOKENS
) -> list[list[int]]:
    """Positions of ``lengths`` sorted longest first and cut into contiguous batches, each with a
    padded size (rows x its longest row) within ``max_batch_tokens`` (a longer row runs alone),
    choosing the cuts that minimise the padded tokens plus ``overhead_tokens`` per forward: one
    long text does not make thirty short ones pad to its length, and short texts still share forwards.
    An exact dynamic programme over runs of equal length (bucketed when there are many)."""
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: -lengths[i])
    sorted_lengths = [max(1, int(lengths[i])) for i in order]
    keys = sorted_lengths
    if len(set(keys)) > _MAX_GROUPS:
        keys = [int(np.log(v) / np.log(1.05)) for v in sorted_lengths]
    starts = [0] + [k for k in range(1, n) if keys[k] != keys[k - 1]]
    bounds = [*starts, n]
    g = len(starts)
    best = [0.0] + [float("inf")] * g
    cut_from = [0] * (g + 1)
    for j in range(1, g + 1):
        for i in range(j):
            longest, rows = sorted_lengths[bounds[i]], bounds[j] - bounds[i]
            cap = max(1, max_batch_tokens // longest)
            cost = best[i] + rows * longest + -(-rows // cap) * overhead_tokens
            if cost < best[j]:
                best[j], cut_from[j] = cost, i
    segments = []
    j = g
    while j > 0:
        segments.append((bounds[cut_from[j]], bounds[j]))
        j = cut_from[j]
    batches: list[list[int]] = []
    for lo, hi in reversed(segments):
        cap = max(1, max_batch_tokens // sorted_lengths[lo])
        batches.extend(order[k : min(k + cap, hi)] for k in range(lo, hi, cap))
    return batches


class DynamicBatcher:
    """Merges the rows of concurrent :meth:`submit` calls into token-budgeted forwards.

    ``features(texts, config) -> (hs, rw)`` runs one batch (``MoEEmbedder.features`` with
    ``batch_size=len(texts)``); ``batch_wait_s`` is how long a step waits for more requests
    before it starts; ``on_batch(rows, padded_tokens, seconds)`` and ``on_depth(rows)`` feed metrics.
    """

    def __init__(
        self,
        features: Callable[[list[str], EmbeddingConfig], tuple[np.ndarray, np.ndarray]],
        *,
        max_batch_tokens: int,
        batch_wait_s: float = 0.0,
        on_batch: Callable[[int, int, int, float], None] | None = None,
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        self._features = features
        self.max_batch_tokens = int(max_batch_tokens)
        self.batch_wait_s = float(batch_wait_s)
        self._on_batch = on_batch or (lambda rows, padded, tokens, seconds: None)
        self._on_depth = on_depth or (lambda rows: None)
        self._rows: deque[_Row] = deque()
        self._jobs: set[Job] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moee-forward")
        self.cancelled_rows = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the scheduler on the running event loop."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def stop(self) -> None:
        """Finish every admitted request, then stop the scheduler and the worker thread."""
        while self._jobs:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the forward thread, between batches (the routing endpoint)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # ------------------------------------------------------------------ requests
    @property
    def pending_requests(self) -> int:
        return len(self._jobs)

    @property
    def queue_depth(self) -> int:
        """Rows waiting for a forward."""
        return len(self._rows)

    def submit(self, texts: list[str], lengths: list[int], config: EmbeddingConfig) -> Job:
        """Queue one request's rows; its ``future`` resolves to the float32 ``[n, dim]`` matrix."""
        job = Job(config, list(texts), list(lengths), asyncio.get_running_loop().create_future())
        self._jobs.add(job)
        self._rows.extend(_Row(job, i) for i in range(len(texts)))
        self._on_depth(len(self._rows))
        assert self._wake is not None, "start() the batcher first"
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a request whose client went away: its waiting rows never reach a forward."""
        if job.cancelled or job not in self._jobs:
            return
        job.cancelled = True
        before = len(self._rows)
        self._rows = deque(r for r in self._rows if r.job is not job)
        self.cancelled_rows += before - len(self._rows)
        self._finish(job)
        self._on_depth(len(self._rows))
        if not job.future.done():
            job.future.cancel()

    def _finish(self, job: Job) -> None:
        self._jobs.discard(job)

    # ------------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.batch_wait_s > 0:
                await asyncio.sleep(self.batch_wait_s)
            while self._rows:
                key = self._rows[0].job.config.feature_key()
                taken = [r for r in self._rows if r.job.config.feature_key() == key]
                self._rows = deque(r for r in self._rows if r.job.config.feature_key() != key)
                self._on_depth(len(self._rows))
                for positions in cut_batches([r.length for r in taken], self.max_batch_tokens):
                    rows = [taken[i] for i in positions if not taken[i].job.cancelled]
                    if rows:
                        await self._run(loop, rows)

    async def _run(self, loop: asyncio.AbstractEventLoop, rows: list[_Row]) -> None:
        texts = [r.text for r in rows]
        config = rows[0].job.config
        start = time.perf_counter()
        try:
            hs, rw = await loop.run_in_executor(self._executor, self._features, texts, config)
        except Exception as exc:  # the batch's requests fail, the server keeps serving
            failed = {r.job for r in rows}
            for job in failed:
                if not job.future.done():
                    job.future.set_exception(exc)
                self._finish(job)
            self._rows = deque(r for r in self._rows if r.job not in failed)
            self._on_depth(len(self._rows))
            return
        seconds = time.perf_counter() - start
        lengths = [r.length for r in rows]
        self._on_batch(len(rows), len(rows) * max(lengths), sum(lengths), seconds)
        for j, row in enumerate(rows):
            job = row.job
            if job.cancelled:
                continue
            job.hs[row.index], job.rw[row.index] = hs[j], rw[j]
            job.remaining -= 1
            if job.remaining == 0:
                self._complete(job)

    def _complete(self, job: Job) -> None:
        self._finish(job)
        if job.future.done():
            return
        try:
            config = job.config
            vectors = combine_features(
                np.stack(job.hs),
                np.stack(job.rw),
                config.method,
                alpha=config.numeric_alpha(),
                normalize=config.normalize,
            )
        except Exception as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(vectors)
