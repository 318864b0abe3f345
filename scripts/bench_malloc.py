"""Benchmark (docs/SCALING.md): `encode` on the CPU with glibc's default allocator settings against
settings that keep large blocks in the heap instead of mapping and unmapping them on every batch.

On these machines every encode of the default model takes 0.5-1.1M minor page faults: activations
larger than glibc's mmap threshold are mapped fresh for each batch and returned to the kernel when
freed, and each new mapping is zero-filled page by page. The settings are environment variables read
when a process starts, so each side runs in its own processes, alternating (``--pairs`` pairs), and
the figure is the median of the per-pair ratios of the median pass time; page faults are counted
per pass.

    nice -n 10 python scripts/bench_malloc.py --pairs 4      # writes bench/results/malloc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moee.benchmarking import write_result  # noqa: E402

#: glibc tunables that keep large freed blocks in the heap (the mmap threshold at glibc's maximum,
#: 32 MiB on 64-bit; no trimming below 4 GiB; 256 MiB of padding on each heap growth).
TUNED = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}

#: One side's measurement: argv = model, texts, batch size, passes; prints JSON.
MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    from moee import MoEEmbedder
    from moee.benchmarking import length_mix_texts

    model, n, batch, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    emb = MoEEmbedder.from_pretrained(model)
    texts = [t.replace("\\n", " ") for t in length_mix_texts(n, seed=3)]
    emb.encode(texts[:batch], batch_size=batch, show_progress_bar=False)  # warm-up
    seconds, faults = [], []
    for _ in range(passes):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        emb.encode(texts, batch_size=batch, show_progress_bar=False)
        seconds.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
    print(json.dumps({"seconds": seconds, "minor_faults": faults, "vm_hwm_bytes": peak}))
    """
)


def measure(env: dict[str, str], args: argparse.Namespace) -> dict:
    argv = [
        sys.executable,
        "-c",
        MEASURE,
        args.model,
        str(args.texts),
        str(args.batch_size),
        str(args.passes),
    ]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-moe")
    parser.add_argument("--texts", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--passes", type=int, default=3, help="timed passes per process")
    parser.add_argument("--pairs", type=int, default=4, help="alternating (default, tuned) process pairs")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)
    for flag in ("texts", "batch_size", "passes", "pairs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for key in TUNED:
        base.pop(key, None)
    runs: dict[str, list[dict]] = {"default": [], "tuned": []}
    for i in range(args.pairs):
        order = ("default", "tuned") if i % 2 == 0 else ("tuned", "default")
        for side in order:
            runs[side].append(measure(base if side == "default" else {**base, **TUNED}, args))
    med = {side: [statistics.median(r["seconds"]) for r in rs] for side, rs in runs.items()}
    result = {
        "model": args.model,
        "texts": args.texts,
        "batch_size": args.batch_size,
        "passes": args.passes,
        "pairs": args.pairs,
        "tuned_env": TUNED,
        "torch_threads": os.environ.get("OMP_NUM_THREADS", "default"),
        "median_ratio_tuned_vs_default": statistics.median(
            t / d for t, d in zip(med["tuned"], med["default"])
        ),
        "median_s": {side: statistics.median(v) for side, v in med.items()},
        "minor_faults_per_pass": {
            side: statistics.median(f for r in rs for f in r["minor_faults"]) for side, rs in runs.items()
        },
        "vm_hwm_gb": {side: max(r["vm_hwm_bytes"] for r in rs) / 1e9 for side, rs in runs.items()},
        "runs": runs,
    }
    path = write_result("malloc", result, args.out)
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("median_ratio_tuned_vs_default", "median_s", "minor_faults_per_pass", "vm_hwm_gb")
            }
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
