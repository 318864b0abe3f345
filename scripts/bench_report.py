"""Benchmark (BENCHMARKS.md): cost and memory of `moee report` against a plain forward pass.

Goal: the specialization report over >= 1M tokens of the bundled model costs at most 1.5x a plain
forward pass (the causal LM with its logits, what a user without moee runs) over the same tokens,
and its memory is flat in the corpus size.

Each size runs in a fresh process (so no size inherits another's heap): a quarter of the tokens,
then all of them. In each, the same texts (the corpus read in order, repeated only if it runs
out), the same tokenizer, batch size and length-sorted chunks. The report runs first and its
peak resident memory above the start of the call is measured (the kernel's high-water mark,
reset just before; a 20 ms sampler where that is not allowed); at all the tokens the plain
forward follows, then ``--reps - 1`` more interleaved pairs, and the cost ratio is the median of
the per-pair ratios.

Memory is read three ways, at both sizes:
- the bytes of every array the report holds while streaming (``summary.state_bytes``);
- the peak with glibc's default allocator, what a user gets. It also carries where glibc's heap
  happened to leave holes under the forward's activations (its mmap threshold rises with the
  largest freed block, so activations land in the heap and fragment it);
- the peak in a process started with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``):
  every large block is mapped and unmapped on its own, so the peak is what the process holds.
Flat means: the same state at both sizes, and the fixed-threshold peak at all the tokens within
10% of the peak at a quarter of them. Use a real corpus (the training corpus of the bundled
model, ``python scripts/build_corpus.py``) so the vocabulary grows as it does in use:

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
from moee.provenance import model_label

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


#: The allocator setting of the fixed-threshold runs (glibc reads it at process start).
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def measure(args: argparse.Namespace, n_tokens: int, plain: bool = True) -> dict:
    """One size, in this (fresh) process: the report's memory and time, then (``plain``) the
    plain forward's."""
    import torch

    from moee.analysis.specialization import BaselineDraws, ReportOptions, build_report
    from moee.embed.embedder import MoEEmbedder

    embedder = MoEEmbedder.from_pretrained(args.model)
    texts, n = corpus_texts(args.corpus, n_tokens, embedder.tokenizer, embedder.max_length)

    def report(ts):
        options = ReportOptions(draws=BaselineDraws(permutations=args.permutations))
        return build_report(embedder, ts, options=options, batch_size=args.batch_size, progress=True)

    plain_forward(embedder, texts[:32], args.batch_size)  # warm-up
    report(texts[:32])
    rep, seconds, peak, method = peak_rss_above_start(lambda: report(texts))
    report_s, plain_s = [seconds], []
    for rep_i in range(args.reps if plain else 0):
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
            "name": model_label(embedder.name_or_path),
            "n_moe_layers": embedder.n_moe_layers,
            "n_experts": embedder.n_experts,
            "top_k": rep["summary"]["top_k"],
        },
        "threads": torch.get_num_threads(),
        "report_s": report_s,
        "plain_forward_s": plain_s,
        "ratio_report_vs_plain": paired_ratio(report_s, plain_s) if plain_s else None,
        "peak_rss_above_start_bytes": peak,
        "state_bytes": rep["summary"]["state_bytes"],
        "memory_method": method,
        "token_types": ts["n_token_types"],
        "untracked_tokens": ts["by_key"]["input"]["untracked_tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="minilm-moe", help="default: minilm-moe, whose figures BENCHMARKS.md holds"
    )
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--permutations", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results dir (default: bench/results)")
    parser.add_argument("--name", default="report", help="result file name (default: report)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # one size, in a process of its own; the JSON is the last line
        print(json.dumps(measure(args, args.child, plain=not args.child_memory_only)))
        return 0

    forwarded = list(argv if argv is not None else sys.argv[1:])

    def child(n: int, memory_only: bool, env: dict | None = None) -> dict:
        done = subprocess.run(
            [sys.executable, __file__, *forwarded, "--child", str(n)]
            + (["--child-memory-only"] if memory_only else []),
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    quarter_n = args.tokens // 4
    full = child(args.tokens, memory_only=False)
    quarter = child(quarter_n, memory_only=True)
    fixed = {
        "quarter": child(quarter_n, True, FIXED_MMAP_THRESHOLD),
        "full": child(args.tokens, True, FIXED_MMAP_THRESHOLD),
    }
    ratio = full["ratio_report_vs_plain"]

    def peaks(q: dict, f: dict) -> dict:
        a, b = q["peak_rss_above_start_bytes"], f["peak_rss_above_start_bytes"]
        return {"quarter_bytes": a, "full_bytes": b, "ratio_full_vs_quarter": b / max(1, a)}

    default_peaks = peaks(quarter, full)
    fixed_peaks = peaks(fixed["quarter"], fixed["full"])
    state_ratio = full["state_bytes"] / max(1, quarter["state_bytes"])
    memory_met = state_ratio <= 1.01 and fixed_peaks["ratio_full_vs_quarter"] <= 1.1
    payload = {
        "goal": {
            "max_ratio": 1.5,
            "min_tokens": 1_000_000,
            "max_state_ratio_full_vs_quarter": 1.01,
            "max_memory_ratio_full_vs_quarter": 1.1,
        },
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
            "state_bytes": {"quarter": quarter["state_bytes"], "full": full["state_bytes"]},
            "state_ratio_full_vs_quarter": state_ratio,
            "default_allocator": default_peaks,
            "fixed_mmap_threshold": {"env": FIXED_MMAP_THRESHOLD, **fixed_peaks},
            "token_types": {"quarter": quarter["token_types"], "full": full["token_types"]},
            "untracked_tokens": full["untracked_tokens"],
        },
        "runs": {"quarter": quarter, "fixed_mmap_threshold": fixed},
        "met": bool(ratio <= 1.5 and full["tokens"] >= 1_000_000 and memory_met),
    }
    path = write_result(args.name, payload, args.out)
    mib = 2**20
    print(
        f"{full['tokens']:,} tokens: plain {min(full['plain_forward_s']):.1f}s, report "
        f"{min(full['report_s']):.1f}s, ratio {ratio:.3f}; state {quarter['state_bytes'] / mib:.1f} vs "
        f"{full['state_bytes'] / mib:.1f} MiB; peak above start (1/4 vs all) "
        f"{default_peaks['quarter_bytes'] / mib:.0f} vs {default_peaks['full_bytes'] / mib:.0f} MiB, "
        f"fixed mmap threshold {fixed_peaks['quarter_bytes'] / mib:.0f} vs "
        f"{fixed_peaks['full_bytes'] / mib:.0f} MiB (x{fixed_peaks['ratio_full_vs_quarter']:.2f}) -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
