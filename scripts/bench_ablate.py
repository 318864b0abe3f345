"""Benchmark (BENCHMARKS.md): the cost of `moee ablate` per expert, against a plain forward pass.

Every disabled expert costs one forward pass over the corpus and its load-matched null one more; the
baseline (per-token losses, loads and the super-expert activation scores) is paid once. This times,
side by side in one process over the same batches: a plain forward with the loss (``plain``), one
expert disabled by re-selection (``reselect``) and by zeroing (``zero``), the load-matched null
(``null``), and the baseline pass; then the cost of a whole run follows (``L * E`` experts).

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_ablate.py              # minilm-moe
    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_ablate.py --model tiny --tokens 512  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

from moee.benchmarking import paired_ratio, time_interleaved, write_result

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="minilm-moe", help="model name or path (default: minilm-moe); 'tiny': a tiny OLMoE"
    )
    parser.add_argument("--corpus", default=str(ROOT / "moee/assets/default-model/heldout.jsonl"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)

    from moee.analysis.expert_importance import baseline, build_corpus, intervention_loss, read_corpus
    from moee.capture.interventions import disable_experts, drop_assignments
    from moee.capture.registry import find_routers
    from moee.embed.embedder import MoEEmbedder

    if args.model == "tiny":
        from moee.capture.tiny import tiny_model, tiny_tokenizer

        model, tokenizer, label = (
            tiny_model("olmoe", n_layers=2),
            tiny_tokenizer(),
            "tiny OLMoE (2 x 8, top-2)",
        )
    else:
        emb = MoEEmbedder.from_pretrained(args.model)
        model, tokenizer, label = emb.model, emb.tokenizer, args.model
    corpus = build_corpus(
        read_corpus(args.corpus, domain_field="source" if args.model != "tiny" else None),
        tokenizer,
        max_tokens=args.tokens,
    )
    specs = find_routers(model)
    t0, c0 = time.perf_counter(), time.process_time()
    base = baseline(model, corpus, batch_size=args.batch_size, routers=specs)
    baseline_s, baseline_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    layer, expert = 0, int(base.load[0].argmax())
    rate = float(base.load[layer, expert])
    run = partial(intervention_loss, model, corpus, batch_size=args.batch_size)
    variants = {
        "plain": lambda: run(None),
        "reselect": lambda: run(partial(disable_experts, model, [(layer, expert)], routers=specs)),
        "zero": lambda: run(partial(disable_experts, model, [(layer, expert)], mode="zero", routers=specs)),
        "null": lambda: run(partial(drop_assignments, model, layer, rate, routers=specs)),
    }
    cpu: dict[str, list[float]] = {name: [] for name in variants}

    def on_cpu(name: str, fn):
        def call():
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)

        return call

    times = time_interleaved({k: on_cpu(k, f) for k, f in variants.items()}, repeats=args.reps, warmup=1)
    cpu = {k: v[1:] for k, v in cpu.items()}  # the warm-up call is not timed by wall either
    median = {k: statistics.median(v) for k, v in times.items()}
    median_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    n_experts = sum(s.n_experts for s in specs)
    per_expert = median["reselect"] + median["null"]
    per_expert_cpu = median_cpu["reselect"] + median_cpu["null"]
    payload = {
        "model": label,
        "n_moe_layers": len(specs),
        "n_experts": n_experts,
        "tokens": len(base.losses),
        "batch_size": args.batch_size,
        "seconds": times,
        "median_s": median,
        "ratio_to_plain": {k: paired_ratio(times[k], times["plain"]) for k in ("reselect", "zero", "null")},
        "baseline_s": baseline_s,
        "per_expert_s": per_expert,
        "full_run_estimate_s": baseline_s + n_experts * per_expert,
        # one thread: CPU seconds are what the run costs on an idle core, whatever the machine's load
        "cpu_seconds": cpu,
        "median_cpu_s": median_cpu,
        "baseline_cpu_s": baseline_cpu_s,
        "per_expert_cpu_s": per_expert_cpu,
        "full_run_estimate_cpu_s": baseline_cpu_s + n_experts * per_expert_cpu,
    }
    path = write_result("ablate", payload, args.out)
    print(
        f"{label}: {per_expert_cpu:.2f} CPU s / {per_expert:.2f} wall s per expert (with its null) on {len(base.losses)} tokens; "
        f"all {n_experts} experts ~{payload['full_run_estimate_s']:.0f} s; wrote {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
