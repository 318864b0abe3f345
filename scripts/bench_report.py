"""Benchmark (BENCHMARKS.md): cost and memory of `moee report` against a plain forward pass.

Goal: the specialization report over >= 1M tokens of the bundled model costs at most 1.5x a plain
forward pass (the causal LM with its logits, what a user without moee runs) over the same tokens,
and its memory is flat in the corpus size.

Each size runs in a fresh process (so no size inherits another's heap): a quarter of the tokens,
then all of them. In each, the same texts (the corpus read in order, repeated only if it runs
out), the same tokenizer, batch size and length-sorted chunks; the report first, its peak
resident memory above the start of the call measured (the kernel's high-water mark, reset just
before; a 20 ms sampler where that is not allowed), then the plain forward, then ``--reps - 1``
more interleaved pairs; the ratio is the median of the per-pair ratios. Flat means the peak at
all the tokens is within 10% of the peak at a quarter of them. Use a real corpus (the training
corpus of the bundled model, ``python scripts/build_corpus.py``) so the vocabulary grows as it
does in use:

    nice -n 10 env OMP_NUM_THREADS=2 python scripts/bench_report.py --corpus build/corpus/train.jsonl
    nice -n 10 env OMP_NUM_THREADS=2 python scripts/bench_report.py --tokens 50000  # quick, built-in texts
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from moee.benchmarking import paired_ratio, write_result

ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    """Resident set size of this process in bytes (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _high_water_mark() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def peak_rss_above_start(fn):
    """``(result, seconds, peak RSS above the start in bytes, method)`` of ``fn()``."""
    gc.collect()
    kernel = _reset_high_water_mark()
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
    top = max(peak[0], _rss(), _high_water_mark() if kernel else 0)
    return out, seconds, max(0, top - start), "VmHWM" if kernel else "sampled every 20 ms"


def corpus_texts(
    path: Path | None, n_tokens: int, tokenizer, max_length: int | None = None
) -> tuple[list[str], int]:
    """Texts of ``path`` (jsonl ``text`` field or .txt lines; default: a built-in paragraph set)
    in order, repeated only if they run out, until they hold ``n_tokens`` tokens as the model
    routes them; returns the texts and their token count. A document of ``path`` is cut at line
    breaks into pieces of at most ``max_length`` tokens (a single longer line counts
    ``max_length``: the model cuts the rest)."""
    cap = max_length or float("inf")
    if path is not None:
        from moee.io import read_texts

        def base():
            for text in read_texts(path):
                piece, size = [], 0
                for line in (x for x in text.splitlines() if x.strip()):
                    n = len(tokenizer(line, add_special_tokens=False)["input_ids"])
                    if piece and size + n > cap - 2:  # room for the special tokens
                        yield "\n".join(piece)
                        piece, size = [], 0
                    piece.append(line)
                    size += n
                if piece:
                    yield "\n".join(piece)
    else:
        paragraphs = [
            f"Paragraph {i}: the river ran past the old mill while the market closed early and the "
            f"choir sang; def f{i}(x): return x * {i} # a short function, then more prose about "
            "weather, trade and the long history of the valley." * (1 + i % 4)
            for i in range(64)
        ]

        def base():
            return iter(paragraphs)

    texts, total = [], 0
    while total < n_tokens:
        before = total
        for text in base():
            if total >= n_tokens:
                break
            texts.append(text)
            total += min(cap, len(tokenizer(text)["input_ids"]))
        if total == before:
            raise ValueError(f"{path}: no tokens in the corpus")
    return texts, int(total)


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


def measure(args: argparse.Namespace, n_tokens: int) -> dict:
    """One size, in this (fresh) process: the report's memory and time, then the plain forward's."""
    import torch

    from moee.analysis.specialization import build_report
    from moee.embed.embedder import MoEEmbedder

    embedder = MoEEmbedder.from_pretrained(args.model)
    texts, n = corpus_texts(args.corpus, n_tokens, embedder.tokenizer, embedder.max_length)

    def report(ts):
        return build_report(
            embedder, ts, batch_size=args.batch_size, permutations=args.permutations, progress=True
        )

    plain_forward(embedder, texts[:32], args.batch_size)  # warm-up
    report(texts[:32])
    rep, seconds, peak, method = peak_rss_above_start(lambda: report(texts))
    report_s, plain_s = [seconds], []
    for rep_i in range(args.reps):
        t0 = time.perf_counter()
        plain_forward(embedder, texts, args.batch_size)
        plain_s.append(time.perf_counter() - t0)
        if rep_i + 1 < args.reps:
            t0 = time.perf_counter()
            report(texts)
            report_s.append(time.perf_counter() - t0)
    ts = rep["token_specialization"]
    if rep["summary"]["n_tokens"] != n:
        raise RuntimeError(f"the report routed {rep['summary']['n_tokens']} tokens, not the {n} counted")
    return {
        "tokens": n,
        "texts": len(texts),
        "model": {
            "name": str(embedder.name_or_path),
            "n_moe_layers": embedder.n_moe_layers,
            "n_experts": embedder.n_experts,
            "top_k": rep["summary"]["top_k"],
        },
        "threads": torch.get_num_threads(),
        "report_s": report_s,
        "plain_forward_s": plain_s,
        "ratio_report_vs_plain": paired_ratio(report_s, plain_s),
        "peak_rss_above_start_bytes": peak,
        "memory_method": method,
        "token_types": ts["n_token_types"],
        "untracked_tokens": ts["by_key"]["input"]["untracked_tokens"],
    }


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
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # one size, in a process of its own; the JSON is the last line
        print(json.dumps(measure(args, args.child)))
        return 0

    forwarded = list(argv if argv is not None else sys.argv[1:])
    sizes = {}
    for label, n in (("quarter", args.tokens // 4), ("full", args.tokens)):
        done = subprocess.run(
            [sys.executable, __file__, *forwarded, "--child", str(n)],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        sizes[label] = json.loads(done.stdout.strip().splitlines()[-1])
    full, quarter = sizes["full"], sizes["quarter"]
    ratio = full["ratio_report_vs_plain"]
    memory_ratio = full["peak_rss_above_start_bytes"] / max(1, quarter["peak_rss_above_start_bytes"])
    payload = {
        "goal": {"max_ratio": 1.5, "min_tokens": 1_000_000, "max_memory_ratio_full_vs_quarter": 1.1},
        "model": full["model"],
        "config": {
            "tokens": full["tokens"],
            "texts": full["texts"],
            "corpus": str(args.corpus) if args.corpus else "built-in paragraphs",
            "batch_size": args.batch_size,
            "permutations": args.permutations,
            "reps": args.reps,
            "threads": full["threads"],
        },
        "plain_forward_s": full["plain_forward_s"],
        "report_s": full["report_s"],
        "ratio_report_vs_plain": ratio,
        "tokens_per_s": {
            "plain": full["tokens"] / min(full["plain_forward_s"]),
            "report": full["tokens"] / min(full["report_s"]),
        },
        "memory": {
            "method": full["memory_method"],
            "quarter_tokens": quarter["tokens"],
            "peak_rss_above_start_quarter_bytes": quarter["peak_rss_above_start_bytes"],
            "peak_rss_above_start_full_bytes": full["peak_rss_above_start_bytes"],
            "ratio_full_vs_quarter": memory_ratio,
            "token_types": {"quarter": quarter["token_types"], "full": full["token_types"]},
            "untracked_tokens": full["untracked_tokens"],
        },
        "quarter": quarter,
        "met": bool(ratio <= 1.5 and full["tokens"] >= 1_000_000 and memory_ratio <= 1.1),
    }
    path = write_result(args.name, payload, args.out)
    print(
        f"{full['tokens']:,} tokens: plain {min(full['plain_forward_s']):.1f}s, report "
        f"{min(full['report_s']):.1f}s, ratio {ratio:.3f}; peak RSS above start "
        f"{quarter['peak_rss_above_start_bytes'] / 2**20:.0f} MiB (1/4) vs "
        f"{full['peak_rss_above_start_bytes'] / 2**20:.0f} MiB (all), x{memory_ratio:.2f} -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
