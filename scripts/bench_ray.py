"""Benchmark 9 (BENCHMARKS.md): the Ray engine vs single-process ``encode``, and the input-reading
cost of a sharded (accelerate / torchrun) process before and after it reads only its share.

Part A, goal >= 0.9x: the same texts on the same cores, end to end (model load included on both
sides): one process with ``--cpus`` torch threads running ``MoEEmbedder.encode``, against a local
Ray cluster of ``--cpus`` CPUs running ``MoEEmbedBatches`` on ``--cpus`` one-thread actors. The
figure is single-process seconds / Ray seconds (Ray start-up itself is reported, not counted: a
cluster is started once per job). Part B: a synthetic JSONL file, one process of ``--world``: the
reading it did before (every process hashed the whole file for the manifest, counted every row,
then streamed every row keeping ``i % world == rank``) vs now (it counts and streams its own byte
range only; the content check is per share), and the time until its first own row.

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_ray.py --texts 1024 --cpus 2 --rows 400000
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from moee.benchmarking import length_mix_texts, write_result


def bench_engine(model: str | None, texts: list[str], cpus: int, batch_size: int, reps: int) -> dict:
    import ray
    import torch

    from moee.embed.embedder import MoEEmbedder
    from moee.integrations.ray import MoEEmbedBatches

    t = time.perf_counter()
    ray.init(num_cpus=cpus, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - t
    ray.data.DataContext.get_current().enable_progress_bars = False
    single, distributed = [], []
    for _ in range(reps):  # interleaved: load drifting over minutes hits both sides alike
        threads = torch.get_num_threads()
        torch.set_num_threads(cpus)
        t = time.perf_counter()
        reference = MoEEmbedder.from_pretrained(model, device="cpu").encode(texts, batch_size=batch_size)
        single.append(time.perf_counter() - t)
        torch.set_num_threads(threads)

        t = time.perf_counter()
        ds = ray.data.from_items(
            [{"id": i, "text": s} for i, s in enumerate(texts)], override_num_blocks=cpus * 4
        )
        out = ds.map_batches(
            MoEEmbedBatches,
            fn_constructor_kwargs={"model": model, "load": {"device": "cpu"}, "batch_size": batch_size},
            concurrency=cpus,
            num_cpus=1,
            batch_size=batch_size * 2,
            batch_format="pyarrow",
        ).to_pandas()
        distributed.append(time.perf_counter() - t)
    got = np.stack(out.sort_values("id")["embedding"].to_numpy())
    ray.shutdown()
    ratio = float(np.median(np.array(single) / np.array(distributed)))
    return {
        "texts": len(texts),
        "cpus": cpus,
        "ray_startup_s": startup,
        "single_process_s": single,
        "ray_s": distributed,
        "ratio_single_over_ray": ratio,
        "max_abs_diff": float(np.abs(got - reference).max()),
    }


def old_reading(path: Path, rank: int, world: int) -> tuple[float, float]:
    """The sharded process' reading before: the manifest's whole-file hash, a full count, a full
    stream keeping its rows; returns (total seconds, seconds until its first own row)."""
    from moee.io import file_sha256, read_texts

    t = time.perf_counter()
    file_sha256(path)
    sum(1 for _ in read_texts(path))
    first = None
    for i, _text in enumerate(read_texts(path)):
        if i % world == rank and first is None:
            first = time.perf_counter() - t
    return time.perf_counter() - t, first


def new_reading(path: Path, rank: int, world: int) -> tuple[float, float]:
    """The same process now: a count and a stream of its own share (``moee.shard.read_own_texts``)."""
    from moee.shard import ShardInfo, read_own_texts

    info = ShardInfo(rank, world, rank)
    t = time.perf_counter()
    sum(1 for _ in read_own_texts(path, info, None))
    first = None
    for _text in read_own_texts(path, info, None):
        if first is None:
            first = time.perf_counter() - t
    return time.perf_counter() - t, first


def bench_reading(rows: int, world: int) -> dict:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        with open(path, "w") as f:
            for i in range(rows):
                f.write(json.dumps({"id": i, "text": "word " * int(rng.integers(5, 40))}) + "\n")
        size = path.stat().st_size
        rank = world - 1  # the last share: before, it also had to get through every other row
        old_total, old_first = old_reading(path, rank, world)
        new_total, new_first = new_reading(path, rank, world)
    return {
        "rows": rows,
        "bytes": size,
        "world": world,
        "rank": rank,
        "before_s": old_total,
        "after_s": new_total,
        "before_first_row_s": old_first,
        "after_first_row_s": new_first,
        "speedup": old_total / new_total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="minilm-moe", help="model (default: minilm-moe, whose figures BENCHMARKS.md holds)"
    )
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rows", type=int, default=400_000, help="rows of the synthetic JSONL (part B)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--only", choices=("engine", "reading"), default=None, help="run one part")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {}
    if args.only in (None, "engine"):
        texts = length_mix_texts(args.texts)
        result["engine"] = bench_engine(args.model, texts, args.cpus, args.batch_size, args.reps)
    if args.only in (None, "reading"):
        result["reading"] = bench_reading(args.rows, args.world)
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('ray' if args.only is None else f'ray_{args.only}', result, args.out_dir)}")


if __name__ == "__main__":
    main()
