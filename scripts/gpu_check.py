"""The prepared check for a lent GPU machine (BENCHMARKS.md): run it through ``scripts/gpu_check.sh``.

Figures, each measured side by side in this one process (CUDA-synchronised timings), on a randomly
initialised OLMoE-1B-7B-sized model in bf16 (its published configuration: hidden 2048, 16 layers,
64 experts of width 1024, top-8, 6.92B parameters, 13.8 GB) over a realistic length mix:

1. ``encode``: throughput (texts/s, real tokens/s) of ``MoEEmbedder.encode``.
2. ``capture_overhead``: ``encode(method="rw")`` vs a plain backbone forward of the very batches
   encode builds (median per-repetition ratio; goal <= 1.03).
3. ``st_batching``: ``encode`` vs sentence-transformers' batching of the same texts (sorted by
   character length, fixed batches, right padding, a plain backbone forward, mean pooling over the
   attention mask): ``encode(method="hs", pooling="mean")`` is the same vector, so its ratio is
   what moee's batching costs or gains; ``encode(method="moee_sum", pooling="mean")`` adds the
   router capture.
4. ``serve``: the server (``moee.serving.app`` under uvicorn on 127.0.0.1, in this process, on the
   same model) queried with the official ``openai`` client by 1, 8 and 32 concurrent clients, one
   text per request: texts/s, p50/p99 latency, and the ratio to offline ``encode`` of the same texts.
5. ``search``: faiss flat/IVF through ``moee.index.VectorIndex`` on the GPU when the faiss GPU build
   is installed (else recorded as skipped), vs exact brute force with a torch matmul on the same
   GPU and vs faiss on the CPU; recall@10 against the exact ranking.
6. ``moe_layer``: forward+backward tokens/s of our ``MoELayer`` vs transformers' OLMoE block and the
   reference per-expert loop (benchmark 4's configuration).

Every section has a time budget (:data:`FULL`): the number of texts is sized from a timed probe and
the repetitions from a timed warm-up, a section whose turn comes after the run's budget is spent is
recorded as skipped, and a section that fails records its traceback without stopping the others.
Every section appears in the result with its figures, ``{"skipped": reason}`` (a missing package
names its ``pip install``) or ``{"error": ...}``. The result is rewritten after each section
(``complete: false`` until the end), so a run stopped by a time limit keeps what it finished.
``--tiny`` swaps in the benchmarks' tiny OLMoE and small budgets so the whole check runs on a CPU.

    bash scripts/gpu_check.sh                               # on the GPU machine (under 8 minutes)
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check  # the CPU dry run of the Python part
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import math
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moee.benchmarking import (  # noqa: E402
    RESULTS_DIR,
    benchmark_tokenizer,
    capture_overhead_variants,
    length_mix_texts,
    paired_ratio,
    summarize,
    time_interleaved,
    write_result,
)

#: The sections of the result, in the order they run (``model`` first: the first four need it).
SECTIONS = ("encode", "capture_overhead", "st_batching", "serve", "search", "moe_layer")
SERVE_CONCURRENCY = (1, 8, 32)
#: What the server section needs besides moee's own dependencies, and how to install it.
SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "openai")
SERVE_INSTALL = "pip install 'moee[serve]' openai"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much work each section does, and the seconds it may take."""

    max_texts: int  # texts of the encode sections at most (fewer when a pass would be slow)
    min_texts: int
    probe_texts: int  # texts of the timed probe that sizes the encode sections
    pass_s: float  # the target seconds of one encode pass over the texts
    batch: int
    max_repeats: int
    serve_max_texts: int
    serve_min_texts: int
    search_n: int
    search_dim: int
    queries: int
    moe_tokens: int
    moe: Mapping[str, int]  # the MoE layer's experts, k, d, expert hidden width
    total_s: float  # the whole run; the bash entry point's hard limit leaves a margin past it
    budgets: Mapping[str, float]  # seconds per section


#: On one H200: about 60k real tokens per encode pass, 6 minutes in all at most (the sections' budgets
#: and the model's load); the entry point's hard limit is 30 s past it, its whole run under 8 minutes.
FULL = Sizes(
    max_texts=2048,
    min_texts=256,
    probe_texts=64,
    pass_s=6.0,
    batch=64,
    max_repeats=7,
    serve_max_texts=256,
    serve_min_texts=64,
    search_n=100_000,
    search_dim=1024,
    queries=1000,
    moe_tokens=4096,
    moe={"experts": 64, "k": 8, "d": 256, "hidden": 128},  # benchmark 4's configuration
    total_s=360.0,
    budgets={
        "encode": 40,
        "capture_overhead": 55,
        "st_batching": 55,
        "serve": 70,
        "search": 40,
        "moe_layer": 30,
    },
)
#: The CPU dry run: the tiny OLMoE, a few texts, every section in a few seconds.
TINY = Sizes(
    max_texts=16,
    min_texts=8,
    probe_texts=8,
    pass_s=1.0,
    batch=8,
    max_repeats=1,
    serve_max_texts=32,
    serve_min_texts=32,
    search_n=2_000,
    search_dim=32,
    queries=50,
    moe_tokens=128,
    moe={"experts": 16, "k": 2, "d": 64, "hidden": 32},
    total_s=150.0,
    budgets={
        "encode": 10,
        "capture_overhead": 12,
        "st_batching": 15,
        "serve": 40,
        "search": 8,
        "moe_layer": 12,
    },
)
#: A section is skipped rather than started with less than this share of its budget left.
MIN_BUDGET_SHARE = 0.25


class Skipped(Exception):
    """A section that cannot run here (a package or the GPU build missing); its reason is recorded."""


class Stopped(BaseException):
    """SIGTERM (the entry point's time limit): stop, keeping the figures already measured."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_within(
    variants: Mapping[str, Callable[[], Any]], budget_s: float, max_repeats: int
) -> tuple[dict[str, list[float]], int, dict[str, Any]]:
    """``time_interleaved`` with as many repetitions (1 to ``max_repeats``) as fit in ``budget_s``
    after one timed warm-up call of each variant; the times, the repetitions run and what each
    variant's warm-up call returned (so a check needs no extra pass for its outputs)."""
    start = time.perf_counter()
    one_round = 0.0
    first: dict[str, Any] = {}
    for name, fn in variants.items():
        _sync()
        t0 = time.perf_counter()
        first[name] = fn()
        _sync()
        one_round += time.perf_counter() - t0
    left = budget_s - (time.perf_counter() - start)
    repeats = max(1, min(max_repeats, int(left // max(one_round, 1e-9))))
    return time_interleaved(variants, repeats=repeats, warmup=0, sync=_sync), repeats, first


def build_model(tiny: bool, vocab_size: int, device: torch.device, dtype: torch.dtype):
    """Random OLMoE: OLMoE-1B-7B's published configuration (``rehearse_real_size.CONFIGS``: 6.92B
    parameters; transformers' ``OlmoeConfig`` defaults have twice its expert width, 13.4B) or the
    benchmarks' tiny one."""
    from transformers import AutoModelForCausalLM

    if tiny:
        from moee.capture.tiny import tiny_config

        config = tiny_config(
            "olmoe", hidden_size=256, n_layers=4, n_experts=16, top_k=2, vocab_size=vocab_size
        )
    else:
        from rehearse_real_size import build_config

        config = build_config("olmoe-1b-7b")
        config.vocab_size = max(config.vocab_size, vocab_size)
    config.pad_token_id = 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config


def check_encode(embedder, pool: list[str], sizes: Sizes, budget_s: float) -> tuple[dict, list[str]]:
    """Throughput of ``encode``; the texts are the first ``n`` of ``pool``, ``n`` sized so one pass
    takes about ``sizes.pass_s`` (from a timed probe after a warm-up call). Returns the texts too."""
    start = time.perf_counter()
    embedder.encode(pool[: max(1, sizes.probe_texts // 8)], batch_size=sizes.batch, show_progress_bar=False)
    probe = pool[: sizes.probe_texts]
    _sync()
    t0 = time.perf_counter()
    embedder.encode(probe, batch_size=sizes.batch, show_progress_bar=False)
    _sync()
    per_text = (time.perf_counter() - t0) / len(probe)
    n = int(min(len(pool), sizes.max_texts, max(sizes.min_texts, sizes.pass_s / max(per_text, 1e-9))))
    texts = pool[:n]
    lengths = [len(s) for s in embedder._tokenize(texts)]
    times, repeats, _ = timed_within(
        {"encode": lambda: embedder.encode(texts, batch_size=sizes.batch, show_progress_bar=False)},
        budget_s - (time.perf_counter() - start),
        sizes.max_repeats,
    )
    med = statistics.median(times["encode"])
    out: dict = {
        "texts": len(texts),
        "real_tokens": int(sum(lengths)),
        "batch_size": sizes.batch,
        "repeats": repeats,
        "probe_s_per_text": per_text,
        "median_s": med,
        "texts_per_s": len(texts) / med,
        "tokens_per_s": sum(lengths) / med,
    }
    if torch.cuda.is_available():
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out, texts


def check_capture_overhead(embedder, texts: list[str], sizes: Sizes, budget_s: float) -> dict:
    """encode(method="rw") vs a plain backbone forward of the very batches encode builds."""
    start = time.perf_counter()
    times, repeats, _ = timed_within(
        capture_overhead_variants(embedder, texts, sizes.batch),
        budget_s - (time.perf_counter() - start),
        sizes.max_repeats,
    )
    return {
        "goal": "<= 1.03",
        "texts": len(texts),
        "repeats": repeats,
        "median_ratio_encode_rw_vs_plain": paired_ratio(times["encode_rw"], times["plain_forward"]),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
    }


def st_style_encode(embedder, texts: list[str], batch_size: int) -> tuple[np.ndarray, int, int]:
    """What sentence-transformers' ``encode`` does with a Transformer + mean Pooling model: texts
    sorted by character length (longest first), fixed batches tokenized with right padding, a plain
    backbone forward, the hidden states averaged over the attention mask; rows back in input order.
    Returns the vectors, real and padded token counts."""
    from moee.capture.registry import backbone

    body = backbone(embedder.model)
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    rows: list[np.ndarray | None] = [None] * len(texts)
    real = padded = 0
    with torch.inference_mode():
        for s in range(0, len(texts), batch_size):
            idx = order[s : s + batch_size]
            enc = embedder.tokenizer(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=embedder.max_length,
                padding_side="right",
                return_tensors="pt",
            ).to(embedder.device)
            hidden = body(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], use_cache=False
            ).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            for i, row in zip(idx, pooled.float().cpu().numpy()):
                rows[i] = row
            real += int(enc["attention_mask"].sum())
            padded += int(enc["attention_mask"].numel())
    return np.stack(rows), real, padded


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def check_st_batching(embedder, texts: list[str], sizes: Sizes, budget_s: float) -> dict:
    """``encode`` vs sentence-transformers-style batching of the same texts and batch size."""
    batch = sizes.batch
    seqs = sorted((len(s) for s in embedder._tokenize(texts)), reverse=True)
    ours_padded = sum(
        len(seqs[s : s + batch]) * seqs[s] for s in range(0, len(seqs), batch)
    )  # encode's length-sorted batches, longest row first
    times, repeats, first = timed_within(
        {
            "st_style_mean": lambda: st_style_encode(embedder, texts, batch),
            "encode_hs_mean": lambda: embedder.encode(
                texts, method="hs", pooling="mean", normalize=False, batch_size=batch, show_progress_bar=False
            ),
            "encode_moee_sum_mean": lambda: embedder.encode(
                texts, method="moee_sum", pooling="mean", batch_size=batch, show_progress_bar=False
            ),
        },
        budget_s,
        sizes.max_repeats,
    )
    st_vectors, st_real, st_padded = first["st_style_mean"]
    return {
        "texts": len(texts),
        "batch_size": batch,
        "repeats": repeats,
        "texts_per_s": {k: len(texts) / statistics.median(v) for k, v in times.items()},
        "speedup_vs_st_style": {
            k: paired_ratio(times["st_style_mean"], v) for k, v in times.items() if k != "st_style_mean"
        },
        "tokens": {
            "st_style_real": st_real,
            "st_style_padded": st_padded,
            "encode_real": int(sum(seqs)),
            "encode_padded": int(ours_padded),
        },
        "min_cosine_st_style_vs_encode_hs_mean": _min_cosine(st_vectors, first["encode_hs_mean"]),
    }


def missing_packages(names: tuple[str, ...]) -> list[str]:
    """The importable names among ``names`` that are not installed."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def check_serve(embedder, texts: list[str], sizes: Sizes, budget_s: float) -> dict:
    """The server on the same model, queried by 1, 8 and 32 concurrent ``openai`` clients."""
    missing = missing_packages(SERVE_PACKAGES)
    if missing:
        raise Skipped(f"not installed: {', '.join(missing)} ({SERVE_INSTALL})")
    from bench_serve import openai_connection, run_clients

    from moee.serving.app import ServerSettings, create_app, serve_in_thread, served_model_name

    deadline = time.monotonic() + budget_s
    connect = functools.partial(openai_connection, model=served_model_name(embedder))
    out: dict[str, Any] = {"client": "openai", "one_text_per_request": True}
    with serve_in_thread(create_app(embedder, ServerSettings())) as url:
        run_clients(url, texts[:8], 4, deadline, connect)  # warm-up: connections, batcher, kernels
        probe_s, _, _ = run_clients(url, texts[:8], 1, deadline, connect)
        # concurrency 1 is the slowest: give it about 40% of what is left
        fit = 0.4 * (deadline - time.monotonic()) / (probe_s / 8)
        n = int(min(len(texts), sizes.serve_max_texts, max(sizes.serve_min_texts, fit)))
        chosen = texts[:n]
        expected = embedder.encode(chosen, batch_size=32, show_progress_bar=False)
        offline = time_interleaved(
            {"offline": lambda: embedder.encode(chosen, batch_size=32, show_progress_bar=False)},
            repeats=2,
            warmup=0,
            sync=_sync,
        )["offline"]
        offline_rate = n / statistics.median(offline)
        out.update(texts=n, probe_s_per_text_c1=probe_s / 8)
        out["offline_encode"] = {"batch_size": 32, **summarize(offline, n, "texts")}
        levels: dict[str, dict] = {}
        for c in SERVE_CONCURRENCY:
            try:
                wall, latencies, got = run_clients(url, chosen, c, deadline, connect)
            except Exception as exc:  # recorded; the next level still runs if time is left
                levels[f"c{c}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            levels[f"c{c}"] = {
                "texts_per_s": n / wall,
                "wall_s": wall,
                "p50_ms": 1000 * float(np.percentile(latencies, 50)),
                "p99_ms": 1000 * float(np.percentile(latencies, 99)),
                "vs_offline_encode": (n / wall) / offline_rate,
                "max_abs_diff_vs_encode": float(np.abs(got - expected).max()),
            }
        out["concurrency"] = levels
    rates = {k: v.get("texts_per_s") for k, v in levels.items()}
    if rates.get("c32") and rates.get("c1"):
        out["c32_vs_c1"] = rates["c32"] / rates["c1"]
    return out


def check_search(sizes: Sizes, budget_s: float, k: int = 10) -> dict:
    from bench_search import exact_ids, make_data, recall_at_k

    start = time.perf_counter()
    n, dim, n_queries = sizes.search_n, sizes.search_dim, sizes.queries
    db, queries = make_data(n, n_queries, dim, isotropic=False)
    truth = exact_ids(db, queries, k)
    out: dict = {"n": n, "dim": dim, "queries": n_queries, "k": k}
    variants = {}
    if torch.cuda.is_available():
        db_t = torch.from_numpy(db).cuda()
        q_t = torch.from_numpy(queries).cuda()
        variants["torch_gpu_bruteforce"] = lambda: (q_t @ db_t.T).topk(k, dim=1).indices.cpu()
        out["recall_at_k"] = {
            "torch_gpu_bruteforce": recall_at_k(variants["torch_gpu_bruteforce"]().numpy(), truth)
        }
    try:
        from moee.index import VectorIndex, gpu_available
    except ImportError as exc:  # the GPU image may lack faiss entirely
        out["faiss_gpu_skipped"] = f"faiss is not installed ({exc}); pip install 'moee[gpu]'"
        gpu_available = None
    if gpu_available is not None:
        cpu_flat = VectorIndex.build(db, kind="flat", device="cpu")
        variants["faiss_cpu_flat"] = lambda: cpu_flat.search(queries, k)
        out["faiss_gpu"] = gpu_available()
        if gpu_available():
            gpu_flat = VectorIndex.build(db, kind="flat", device="gpu")
            gpu_ivf = VectorIndex.build(db, kind="ivf", device="gpu")
            variants["faiss_gpu_flat"] = lambda: gpu_flat.search(queries, k)
            variants["faiss_gpu_ivf"] = lambda: gpu_ivf.search(queries, k)
            out.setdefault("recall_at_k", {}).update(
                faiss_gpu_flat=recall_at_k(gpu_flat.search(queries, k)[1], truth),
                faiss_gpu_ivf=recall_at_k(gpu_ivf.search(queries, k)[1], truth),
                ivf_nlist=gpu_ivf.nlist,
                ivf_nprobe=gpu_ivf.nprobe,
            )
        else:
            out["faiss_gpu_skipped"] = (
                "faiss GPU build not installed or no GPU visible (pip install 'moee[gpu]')"
            )
    if not variants:
        raise Skipped(out.get("faiss_gpu_skipped", "neither faiss nor a GPU is available"))
    times, out["repeats"], _ = timed_within(variants, budget_s - (time.perf_counter() - start), 5)
    out["queries_per_s"] = {name: n_queries / statistics.median(ts) for name, ts in times.items()}
    if "faiss_cpu_flat" in times:
        out["speedup_vs_faiss_cpu_flat"] = {
            name: paired_ratio(times["faiss_cpu_flat"], ts)
            for name, ts in times.items()
            if name != "faiss_cpu_flat"
        }
    return out


def check_moe_layer(device: torch.device, sizes: Sizes, budget_s: float) -> dict:
    from bench_moe_layer import SeedsLoopMoE, _Flat, fwd_bwd, make_hf_block, make_ours

    start = time.perf_counter()
    tokens = sizes.moe_tokens
    args = argparse.Namespace(**sizes.moe, tokens=tokens, seed=0)
    ref = make_hf_block(args, "grouped_mm")
    variants = {
        "ours": make_ours(args, ref).to(device),
        "hf_grouped_mm": _Flat(ref).to(device),
    }
    variants["seeds_loop"] = SeedsLoopMoE(
        ref.gate.weight, ref.experts.gate_up_proj, ref.experts.down_proj, args.k
    )
    variants["seeds_loop"].to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, args.d, generator=gen).to(device)
    grad = torch.randn(tokens, args.d, generator=gen).to(device)
    base = fwd_bwd(variants["hf_grouped_mm"], x, grad)
    diffs = {name: float((fwd_bwd(m, x, grad) - base).abs().max()) for name, m in variants.items()}
    times, repeats, _ = timed_within(
        {name: (lambda m=m: fwd_bwd(m, x, grad)) for name, m in variants.items()},
        budget_s - (time.perf_counter() - start),
        sizes.max_repeats,
    )
    return {
        "config": {
            "experts": args.experts,
            "k": args.k,
            "d": args.d,
            "expert_hidden": args.hidden,
            "tokens": tokens,
            "dtype": "float32",
        },
        "repeats": repeats,
        "max_abs_input_grad_diff_vs_hf": diffs,
        "tokens_per_s": {name: tokens / statistics.median(ts) for name, ts in times.items()},
        "speedup_of_ours": {
            name: paired_ratio(ts, times["ours"]) for name, ts in times.items() if name != "ours"
        },
    }


class Run:
    """The result being built: each section timed within its budget, its outcome recorded, and the
    file rewritten after it."""

    def __init__(self, out_dir: Path, sizes: Sizes, budget_s: float, payload: dict) -> None:
        self.out_dir, self.sizes, self.budget_s = out_dir, sizes, budget_s
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.report = {**payload, "errors": {}, "skipped": {}, "section_seconds": {}, "complete": False}

    def section(self, name: str, fn: Callable[[float], dict], *, needs: str | None = None) -> None:
        """Run ``fn(budget_s)`` as section ``name``; ``needs`` is the reason it cannot run, if any."""
        budget = min(self.sizes.budgets.get(name, math.inf), self.deadline - time.monotonic())
        t0 = time.perf_counter()
        try:
            if needs is not None:
                raise Skipped(needs)
            if budget < MIN_BUDGET_SHARE * self.sizes.budgets.get(name, 0.0) or budget <= 0:
                raise Skipped(f"the run's time budget ({self.budget_s:.0f} s) was spent before this section")
            self.report[name] = fn(budget)
        except Skipped as exc:
            self.report[name] = {"skipped": str(exc)}
            self.report["skipped"][name] = str(exc)
        except Exception as exc:  # keep the other figures; the error is reported and fails the run
            self.report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            self.report["errors"][name] = traceback.format_exc()
        except Stopped as exc:  # the time limit: this section's figures are lost, the others kept
            self.report["stopped"] = f"{exc} during {name}"
            self.report[name] = {"skipped": f"the run was stopped ({exc}) before this section finished"}
            self.report["skipped"][name] = self.report[name]["skipped"]
            raise
        finally:
            seconds = time.perf_counter() - t0
            self.report["section_seconds"][name] = seconds
            outcome = next((kind for kind in ("skipped", "errors") if name in self.report[kind]), "ok")
            print(f"[gpu_check] {name}: {outcome} in {seconds:.1f}s", flush=True)
            self.write()

    def write(self, *, complete: bool = False) -> Path:
        self.report["total_seconds"] = time.monotonic() - self.started
        self.report["complete"] = complete
        return write_result("gpu_check", self.report, self.out_dir)


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (the CPU dry run)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results folder (writes gpu_check.json there)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="seconds for the whole run (default: the sizes' own)"
    )
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    budget_s = sizes.total_s if args.budget_s is None else args.budget_s
    if not budget_s > 0:
        parser.error(f"--budget-s must be > 0 seconds, got {budget_s}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    payload: dict[str, Any] = {
        "device": str(device),
        "tiny": args.tiny,
        "budget_s": budget_s,
        "sizes": dataclasses.asdict(sizes),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        payload["cuda"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gb": round(props.total_memory / 2**30, 1),
            "torch_cuda": torch.version.cuda,
        }
    run = Run(args.out, sizes, budget_s, payload)
    previous = signal.signal(signal.SIGTERM, _stop)
    holder: dict[str, Any] = {}

    def load(_budget: float) -> dict:
        from moee import MoEEmbedder

        tokenizer = benchmark_tokenizer()
        model, config = build_model(args.tiny, len(tokenizer), device, dtype)
        holder["embedder"] = MoEEmbedder(model, tokenizer)
        holder["pool"] = length_mix_texts(max(sizes.max_texts, sizes.serve_max_texts), seed=0)
        return {
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "experts": config.num_experts,
            "top_k": config.num_experts_per_tok,
            "params_billion": sum(p.numel() for p in model.parameters()) / 1e9,
            "dtype": str(dtype),
            "tokenizer": type(tokenizer).__name__,
            "vocab_size": config.vocab_size,
        }

    def encode(budget: float) -> dict:
        figures, holder["texts"] = check_encode(holder["embedder"], holder["pool"], sizes, budget)
        return figures

    def with_texts(check: Callable[..., dict]) -> Callable[[float], dict]:
        """``check`` on the texts ``encode`` sized (its smallest size if it failed)."""
        return lambda budget: check(
            holder["embedder"], holder.get("texts", holder["pool"][: sizes.min_texts]), sizes, budget
        )

    try:
        run.section("model", load)
        no_model = None if "embedder" in holder else "the model did not load (see errors.model)"
        run.section("encode", encode, needs=no_model)
        run.section("capture_overhead", with_texts(check_capture_overhead), needs=no_model)
        run.section("st_batching", with_texts(check_st_batching), needs=no_model)
        run.section(
            "serve",
            lambda budget: check_serve(holder["embedder"], holder["pool"], sizes, budget),
            needs=no_model,
        )
        holder.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        run.section("search", lambda budget: check_search(sizes, budget))
        run.section("moe_layer", lambda budget: check_moe_layer(device, sizes, budget))
        path = run.write(complete=True)
    except Stopped as exc:
        run.report.setdefault("stopped", f"{exc} between sections")
        for name in SECTIONS:
            if name not in run.report:
                run.report["skipped"][name] = f"the run was stopped ({exc}) before this section"
                run.report[name] = {"skipped": run.report["skipped"][name]}
        with contextlib.suppress(Stopped):
            path = run.write()
        print(f"[gpu_check] stopped ({run.report['stopped']}); wrote what was measured", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"[gpu_check] wrote {path} in {run.report['total_seconds']:.0f}s")
    for name, err in run.report["errors"].items():
        print(f"[gpu_check] {name} FAILED:\n{err}", file=sys.stderr)
    return 1 if run.report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
