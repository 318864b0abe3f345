"""Benchmark (BENCHMARKS.md): time and peak memory of embedding one long text with the bundled model.

Each size runs in a fresh process (its own peak RSS, the model included): the text is tokenized
once (the yardstick), cut to the model's length (``moee.embed.prompts.fit_prompts``) and embedded
(``encode``, whose model forward is a fixed cost: the cut text is ``max_length`` tokens whatever the
size). A process that passes ``--limit-gb`` of resident memory stops itself and is reported as such.
``--before DIR`` also measures another source tree of moee, side by side, for example the code
before the cut was made linear:

    git archive f7f5ffb~1 moee | tar -x -C /tmp/moee-before
    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_long_texts.py --before /tmp/moee-before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The program each measurement runs: argv = characters, memory limit in bytes.
MEASURE = textwrap.dedent(
    """
    import json, os, sys, threading, time, warnings

    n, limit = int(sys.argv[1]), int(sys.argv[2])
    start = time.perf_counter()

    def status(field):  # this process's own figures (ru_maxrss would also count, after a fork
        with open("/proc/self/status") as fh:  # and exec, the parent's size at the fork)
            return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) * 1024

    def guard():  # stop rather than swamp the machine (or be killed by the kernel without a word)
        while True:
            rss = status("VmRSS")
            if rss > limit:
                print(json.dumps({"over_limit_bytes": rss, "after_s": time.perf_counter() - start}), flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=guard, daemon=True).start()
    warnings.simplefilter("ignore")
    import moee
    from moee.embed.embedder import MoEEmbedder
    from moee.embed.prompts import fit_prompts

    emb = MoEEmbedder.from_pretrained("minilm-moe")  # the model of BENCHMARKS.md section 12
    emb.encode(["warm up"])  # first-call costs (weights digest, reference) outside the timing
    with open("/proc/self/clear_refs", "w") as fh:  # restart the high-water mark from here, so the
        fh.write("5")  # peak below is the text's, not loading's (Linux 4.0+)
    loaded = status("VmRSS")
    text = ("word " * (n // 5 + 1))[:n]
    t0 = time.perf_counter(); emb.tokenizer(text, verbose=False); tokenize = time.perf_counter() - t0
    t0 = time.perf_counter(); fit_prompts(emb.tokenizer, [text], None, emb.max_length); cut = time.perf_counter() - t0
    t0 = time.perf_counter(); vector = emb.encode([text]); encode = time.perf_counter() - t0
    print(json.dumps({
        "moee": os.path.dirname(os.path.dirname(moee.__file__)), "chars": n, "tokenize_s": tokenize,
        "cut_s": cut, "encode_s": encode, "loaded_rss_bytes": loaded,
        "peak_rss_bytes": status("VmHWM"),
        "dim": int(vector.shape[-1]), "last_truncation": emb.last_truncation,
    }))
    """
)


def measure(
    chars: int, *, limit_bytes: int, source: str | Path | None = None, timeout: float = 600
) -> dict[str, Any]:
    """One measurement in a fresh process (``source``: the moee source tree to import, else this one's)."""
    source = Path(source if source is not None else ROOT).resolve()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    run = subprocess.run(  # -P: the working directory's moee must not shadow the one measured
        [sys.executable, "-P", "-c", MEASURE, str(chars), str(limit_bytes)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the measurement of {chars} characters failed:\n{run.stderr[-3000:]}")
    return {"chars": chars, "returncode": run.returncode, **json.loads(lines[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000, 1_000_000])
    parser.add_argument("--before", type=Path, help="another moee source tree to measure side by side")
    parser.add_argument(
        "--limit-gb", type=float, default=6.0, help="stop a measurement past this resident memory"
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    from moee.benchmarking import write_result

    limit = int(args.limit_gb * 2**30)
    variants = {"after": None, **({"before": args.before} if args.before else {})}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for chars in args.sizes:
        for name, source in variants.items():
            row = measure(chars, limit_bytes=limit, source=source)
            results[name].append(row)
            print(name, json.dumps(row), flush=True)
    path = write_result(
        "long_texts", {"limit_bytes": limit, "sizes": args.sizes, "variants": results}, args.out
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
