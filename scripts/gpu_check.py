"""One-file check for a lent GPU machine (BENCHMARKS.md): run it, keep the JSON it writes.

Figures, each measured side by side in this one process (CUDA-synchronised timings):

1. ``encode``: bf16 throughput (texts/s, real tokens/s) of ``MoEEmbedder.encode`` on a randomly
   initialised OLMoE-1B-7B-sized model (``AutoConfig.for_model("olmoe")`` defaults: hidden 2048,
   16 layers, 64 experts, top-8, about 7B parameters, 14 GB in bf16) over a realistic length mix.
2. ``capture_overhead``: ``encode(method="rw")`` vs a plain backbone forward of the same batches
   (median per-repetition ratio; goal <= 1.03).
3. ``search``: faiss flat/IVF through ``moee.index.VectorIndex`` on the GPU when the faiss GPU build
   is installed (else recorded as skipped), vs exact brute force with a torch matmul on the same
   GPU and vs faiss on the CPU; recall@10 against the exact ranking.
4. ``moe_layer``: forward+backward tokens/s of our ``MoELayer`` vs transformers' OLMoE block and the
   reference per-expert loop (benchmark 4's configuration) on the GPU, where per-expert kernel
   launches and host synchronisations are what the loop costs.

Runs in well under 5 minutes on one H200. ``--tiny`` swaps in the benchmarks' tiny OLMoE and small sizes
so the whole script can be smoke-tested on a CPU (it runs on whatever device is present).

    python scripts/gpu_check.py --out gpu_check.json           # on the GPU machine
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check.json  # smoke test anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from moee.benchmarking import (  # noqa: E402
    benchmark_tokenizer,
    length_mix_texts,
    machine_info,
    paired_ratio,
    time_interleaved,
    versions,
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(tiny: bool, vocab_size: int, device: torch.device, dtype: torch.dtype):
    """Random OLMoE: the 1B-7B shape (transformers' OlmoeConfig defaults) or the benchmarks' tiny one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if tiny:
        from moee.capture.tiny import tiny_config

        config = tiny_config(
            "olmoe", hidden_size=256, n_layers=4, n_experts=16, top_k=2, vocab_size=vocab_size
        )
    else:
        config = AutoConfig.for_model("olmoe")
        config.vocab_size = max(config.vocab_size, vocab_size)
    config.pad_token_id = 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config


def check_encode(embedder, texts: list[str], batch_size: int, repeats: int) -> dict:
    lengths = [len(s) for s in embedder._tokenize(texts)]
    times = time_interleaved(
        {"encode": lambda: embedder.encode(texts, batch_size=batch_size, show_progress_bar=False)},
        repeats=repeats,
        warmup=1,
        sync=_sync,
    )["encode"]
    med = statistics.median(times)
    out: dict = {
        "texts": len(texts),
        "real_tokens": int(sum(lengths)),
        "batch_size": batch_size,
        "median_s": med,
        "texts_per_s": len(texts) / med,
        "tokens_per_s": sum(lengths) / med,
    }
    if torch.cuda.is_available():
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def check_capture_overhead(embedder, texts: list[str], batch_size: int, repeats: int) -> dict:
    """encode(method="rw") vs a plain backbone forward of the very batches encode builds."""
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

    times = time_interleaved(
        {
            "plain_forward": plain,
            "encode_rw": lambda: embedder.encode(
                texts, method="rw", batch_size=batch_size, show_progress_bar=False
            ),
        },
        repeats=repeats,
        warmup=1,
        sync=_sync,
    )
    return {
        "goal": "<= 1.03",
        "median_ratio_encode_rw_vs_plain": paired_ratio(times["encode_rw"], times["plain_forward"]),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
    }


def check_search(n: int, dim: int, n_queries: int, k: int = 10) -> dict:
    from bench_search import exact_ids, make_data, recall_at_k

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
        out["skipped"] = f"faiss is not installed ({exc}); pip install 'moee[gpu]'"
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
            out["skipped"] = "faiss GPU build not installed or no GPU visible (pip install 'moee[gpu]')"
    if not variants:
        return out
    times = time_interleaved(variants, repeats=5, warmup=1, sync=_sync)
    out["queries_per_s"] = {name: n_queries / statistics.median(ts) for name, ts in times.items()}
    if "faiss_cpu_flat" in times:
        out["speedup_vs_faiss_cpu_flat"] = {
            name: paired_ratio(times["faiss_cpu_flat"], ts)
            for name, ts in times.items()
            if name != "faiss_cpu_flat"
        }
    return out


def check_moe_layer(device: torch.device, tokens: int, repeats: int) -> dict:
    from bench_moe_layer import SeedsLoopMoE, _Flat, fwd_bwd, make_hf_block, make_ours

    args = argparse.Namespace(experts=64, k=8, d=256, hidden=128, tokens=tokens, seed=0)
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
    times = time_interleaved(
        {name: (lambda m=m: fwd_bwd(m, x, grad)) for name, m in variants.items()},
        repeats=repeats,
        warmup=2,
        sync=_sync,
    )
    return {
        "config": {
            "experts": 64,
            "k": 8,
            "d": 256,
            "expert_hidden": 128,
            "tokens": tokens,
            "dtype": "float32",
        },
        "max_abs_input_grad_diff_vs_hf": diffs,
        "tokens_per_s": {name: tokens / statistics.median(ts) for name, ts in times.items()},
        "speedup_of_ours": {
            name: paired_ratio(ts, times["ours"]) for name, ts in times.items() if name != "ours"
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    args = parser.parse_args(argv)

    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    sizes = (
        {
            "texts": 32,
            "batch": 8,
            "repeats": 2,
            "search_n": 2_000,
            "search_dim": 32,
            "queries": 50,
            "moe_tokens": 256,
        }
        if args.tiny
        else {
            "texts": 2048,
            "batch": 64,
            "repeats": 5,
            "search_n": 100_000,
            "search_dim": 1024,
            "queries": 1000,
            "moe_tokens": 4096,
        }
    )
    report: dict = {
        "benchmark": "gpu_check",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": str(device),
        "tiny": args.tiny,
        "sizes": sizes,
        "machine": machine_info(),
        "versions": versions(),
        "errors": {},
    }

    def section(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # keep the other figures; the error is reported and fails the run
            report["errors"][name] = traceback.format_exc()
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f}s", flush=True)

    tokenizer = benchmark_tokenizer()
    texts = length_mix_texts(sizes["texts"], seed=0)
    holder: dict = {}

    def load() -> dict:
        from moee import MoEEmbedder

        model, config = build_model(args.tiny, len(tokenizer), device, dtype)
        holder["embedder"] = MoEEmbedder(model, tokenizer)
        return {
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "experts": config.num_experts,
            "top_k": config.num_experts_per_tok,
            "params_billion": sum(p.numel() for p in model.parameters()) / 1e9,
            "dtype": str(dtype),
            "tokenizer": type(tokenizer).__name__,
        }

    section("model", load)
    if "embedder" in holder:
        section("encode", lambda: check_encode(holder["embedder"], texts, sizes["batch"], sizes["repeats"]))
        section(
            "capture_overhead",
            lambda: check_capture_overhead(holder["embedder"], texts, sizes["batch"], sizes["repeats"]),
        )
        holder.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    section("search", lambda: check_search(sizes["search_n"], sizes["search_dim"], sizes["queries"]))
    section("moe_layer", lambda: check_moe_layer(device, sizes["moe_tokens"], sizes["repeats"]))
    report["total_seconds"] = time.perf_counter() - started

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(report, indent=2, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)) + "\n"
    )
    print(f"wrote {out} in {report['total_seconds']:.0f}s")
    for name, err in report["errors"].items():
        print(f"[gpu_check] {name} FAILED:\n{err}", file=sys.stderr)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
