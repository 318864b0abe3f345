"""Benchmark (BENCHMARKS.md): cost and memory of `moee report` against a plain forward pass.

Goal: the specialization report over >= 1M tokens of the bundled model costs at most 1.5x a plain
forward pass (the causal LM with its logits, what a user without moee runs) over the same tokens,
and its memory is flat in the corpus size.

Both run in this one process, side by side: the same texts (the corpus repeated until it holds
``--tokens`` tokens), the same tokenizer, batch size and length-sorted chunks; ``--reps``
interleaved repetitions (plain, report, plain, report ...), the ratio is the median of the
per-repetition ratios. Memory: peak resident memory above the start of each call (sampled every
20 ms by a thread), for the report at a quarter of the tokens and at all of them: flat means the
two peaks are about equal (the report keeps fixed-size accumulators, never per-token routes).

    nice -n 10 env OMP_NUM_THREADS=2 python scripts/bench_report.py --tokens 1000000 --reps 1
    nice -n 10 env OMP_NUM_THREADS=2 python scripts/bench_report.py --tokens 50000 --reps 3  # quick
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from pathlib import Path

from moee.benchmarking import paired_ratio, write_result

ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    """Resident set size of this process in bytes (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_above_start(fn):
    """``(result, seconds, peak RSS above the start in bytes)`` of ``fn()``."""
    start, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        thread.join()
    return out, seconds, max(0, max(peak[0], _rss()) - start)


def corpus_texts(path: Path | None, n_tokens: int, tokenizer) -> tuple[list[str], int]:
    """Texts of ``path`` (jsonl ``text`` field or .txt lines; default: a built-in paragraph set)
    repeated until they hold ``n_tokens`` tokens; returns the texts and their token count."""
    if path is not None:
        from moee.io import read_texts

        base = list(read_texts(path))
    else:
        base = [
            f"Paragraph {i}: the river ran past the old mill while the market closed early and the "
            f"choir sang; def f{i}(x): return x * {i} # a short function, then more prose about "
            "weather, trade and the long history of the valley." * (1 + i % 4)
            for i in range(64)
        ]
    texts, total = [], 0
    lengths = [len(tokenizer(t)["input_ids"]) for t in base]
    for text, n in itertools.cycle(zip(base, lengths)):
        if total >= n_tokens:
            break
        texts.append(text)
        total += n
    return texts, total


def plain_forward(embedder, texts: list[str], batch_size: int, chunk_size: int = 512) -> int:
    """The causal LM's full forward (logits included) over the report's batches; returns tokens."""
    import torch

    n = 0
    for start in range(0, len(texts), chunk_size):
        chunk = sorted(texts[start : start + chunk_size], key=len)
        for b in range(0, len(chunk), batch_size):
            seqs = embedder._tokenize(chunk[b : b + batch_size], None)
            batch = embedder._batch_tensors(seqs)
            with torch.inference_mode():
                embedder.model(**batch, use_cache=False)
            n += sum(len(s) for s in seqs)
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled default model")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--permutations", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results dir (default: bench/results)")
    parser.add_argument("--name", default="report", help="result file name (default: report)")
    args = parser.parse_args(argv)

    import torch

    from moee.analysis.specialization import build_report
    from moee.embed.embedder import MoEEmbedder

    embedder = MoEEmbedder.from_pretrained(args.model)
    texts, n_tokens = corpus_texts(args.corpus, args.tokens, embedder.tokenizer)
    quarter, _ = corpus_texts(args.corpus, args.tokens // 4, embedder.tokenizer)

    def report(ts):
        return build_report(
            embedder, ts, batch_size=args.batch_size, permutations=args.permutations, progress=True
        )

    plain_forward(embedder, texts[:32], args.batch_size)  # warm-up
    report(texts[:32])
    plain_s, report_s = [], []
    mem_full = None
    for _ in range(args.reps):
        _, s, _ = peak_rss_above_start(lambda: plain_forward(embedder, texts, args.batch_size))
        plain_s.append(s)
        rep, s, mem_full = peak_rss_above_start(lambda: report(texts))
        report_s.append(s)
    _, quarter_s, mem_quarter = peak_rss_above_start(lambda: report(quarter))
    ratio = paired_ratio(report_s, plain_s)
    payload = {
        "goal": {"max_ratio": 1.5, "min_tokens": 1_000_000},
        "model": {
            "name": str(embedder.name_or_path),
            "n_moe_layers": embedder.n_moe_layers,
            "n_experts": embedder.n_experts,
            "top_k": rep["summary"]["top_k"],
        },
        "config": {
            "tokens": n_tokens,
            "texts": len(texts),
            "batch_size": args.batch_size,
            "permutations": args.permutations,
            "reps": args.reps,
            "threads": torch.get_num_threads(),
        },
        "plain_forward_s": plain_s,
        "report_s": report_s,
        "ratio_report_vs_plain": ratio,
        "tokens_per_s": {"plain": n_tokens / min(plain_s), "report": n_tokens / min(report_s)},
        "memory": {
            "quarter_tokens": sum(len(embedder.tokenizer(t)["input_ids"]) for t in quarter),
            "report_quarter_s": quarter_s,
            "peak_rss_above_start_quarter_bytes": mem_quarter,
            "peak_rss_above_start_full_bytes": mem_full,
        },
        "met": bool(ratio <= 1.5 and n_tokens >= 1_000_000),
    }
    path = write_result(args.name, payload, args.out)
    print(
        f"{n_tokens:,} tokens: plain {min(plain_s):.1f}s, report {min(report_s):.1f}s, ratio {ratio:.3f}; "
        f"peak RSS above start {mem_quarter / 2**20:.0f} MiB (1/4) vs {mem_full / 2**20:.0f} MiB (all) -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
