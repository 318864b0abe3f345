"""The benchmark harness and the pieces of the benchmark scripts that decide what is compared.

Timings are not tested (they are the benchmarks' job); what is tested is that the variants
compared side by side compute the same thing, that ratios are paired correctly, and that the
report is generated from result files only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moee.benchmarking import length_mix_texts, paired_ratio, summarize, time_interleaved, write_result

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


def test_time_interleaved_rotates_order_and_pairs_repetitions():
    calls: list[str] = []
    variants = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = time_interleaved(variants, repeats=3, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # rotating start
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved(variants, repeats=0)
    with pytest.raises(ValueError, match="empty"):
        time_interleaved({})


def test_paired_ratio_is_the_median_of_per_repetition_ratios():
    # medians of each side would give 4/2 = 2; the paired figure is median(1, 3, 10) = 3
    assert paired_ratio([2.0, 3.0, 20.0], [2.0, 1.0, 2.0]) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
    assert summarize([1.0, 3.0, 2.0], 10, "texts")["texts_per_s"] == pytest.approx(5.0)


def test_write_result_records_machine_versions_and_command(tmp_path):
    path = write_result("unit", {"figure": 1.5}, tmp_path)
    record = json.loads(path.read_text())
    assert record["figure"] == 1.5 and record["benchmark"] == "unit"
    assert record["machine"]["logical_cpus"] >= 1 and record["machine"]["cpu_model"]
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["moee"]
    assert record["command"]


def test_length_mix_is_real_mixed_length_text_in_a_fixed_order():
    texts = length_mix_texts(200, seed=3)
    assert texts == length_mix_texts(200, seed=3) and texts != length_mix_texts(200, seed=4)
    words = np.array([len(t.split()) for t in texts])
    assert words.min() < 10 and words.max() > 100  # glosses and articles both present


@pytest.mark.slow
def test_seeds_loop_and_our_layer_equal_the_transformers_block():
    from bench_moe_layer import MatmulFloor, SeedsLoopMoE, _Flat, _output, fwd_bwd, make_hf_block, make_ours

    args = argparse.Namespace(d=32, hidden=16, experts=8, k=2, seed=0, tokens=64)
    ref = make_hf_block(args, "eager")
    x = torch.randn(64, 32)
    grad = torch.randn(64, 32)
    hf = _Flat(ref)
    seeds = SeedsLoopMoE(ref.gate.weight, ref.experts.gate_up_proj, ref.experts.down_proj, args.k)
    ours = make_ours(args, ref)
    with torch.no_grad():
        want = _output(hf, x)
        for module in (seeds, ours):
            torch.testing.assert_close(_output(module, x), want, atol=1e-5, rtol=1e-5)
    want_grad = fwd_bwd(hf, x, grad)
    for module in (seeds, ours):
        torch.testing.assert_close(fwd_bwd(module, x, grad), want_grad, atol=1e-5, rtol=1e-5)
    floor = MatmulFloor(64, 32, 16, 8, 2)
    floor()
    assert [tuple(a.shape) for a, _, _ in floor.tensors] == [(64, 32), (8, 16, 32), (8, 16, 16)]


def test_search_baselines_and_faiss_find_the_exact_neighbours():
    from bench_search import exact_ids, make_data, numpy_batched, numpy_per_query, recall_at_k

    from moee.index import VectorIndex

    db, queries = make_data(2000, 50, 32, isotropic=False, seed=1)
    assert np.allclose(np.linalg.norm(db, axis=1), 1.0, atol=1e-5)
    truth = exact_ids(db, queries, 10)
    assert recall_at_k(numpy_batched(db, queries, 10, block=16), truth) == 1.0
    assert recall_at_k(numpy_per_query(db, queries, 10), truth) == 1.0
    flat = VectorIndex.build(db, kind="flat", device="cpu")
    assert recall_at_k(flat.search(queries, 10)[1], truth) >= 0.999
    # recall counts hits, so a wrong answer is caught
    assert recall_at_k(truth[::-1], truth) < 0.2
    assert recall_at_k(np.full_like(truth, -1), truth) == 0.0


def test_training_flop_count_scales_experts_by_k_over_e():
    from bench_training import active_params, gemm_shapes

    from moee.moe.lm import MoEEConfig, MoEEForCausalLM

    cfg = MoEEConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=16,
    )
    model = MoEEForCausalLM(cfg)
    p = active_params(model)
    experts = 2 * 8 * (32 * 2 * 16 + 16 * 32)  # two layers of 8 SwiGLU experts
    assert p["routed_experts_total"] == experts
    assert p["routed_experts_active"] == experts * 2 / 8
    assert p["lm_head"] == 100 * 32
    assert p["active_per_token"] < p["total"]
    shapes = gemm_shapes(model, tokens=64)
    assert (1, 64, 32, 100) in shapes  # the LM head
    assert (8, 16, 32, 32) in shapes  # 64 tokens * k=2 / E=8 rows per expert, d -> 2h


def test_benchmarks_md_is_generated_from_result_files(tmp_path):
    from write_benchmarks_md import render

    empty = render(tmp_path, tmp_path / "missing.json")
    assert "not run" in empty and "bench_search.py" in empty
    result = {
        "benchmark": "search",
        "utc": "2026-01-01T00:00:00Z",
        "command": "python scripts/bench_search.py",
        "machine": {"cpu_model": "Test CPU", "logical_cpus": 2, "platform": "x", "load_average_1m": 1.0},
        "versions": {"torch": "1"},
        "config": {
            "n": 10,
            "dim": 4,
            "queries": 2,
            "per_query_queries": 2,
            "k": 1,
            "nlist": 2,
            "nprobe": 1,
            "data": "d",
            "repeats": 1,
        },
        "recall_at_k": {"faiss_flat": 1.0, "faiss_ivf": 0.5},
        "ivf_sweep": [{"nprobe": 1, "recall_at_k": 0.5, "queries_per_s": 10.0}],
        "seconds_per_query": {"faiss_flat": {"median_s": 0.001}, "faiss_ivf": {"median_s": 0.0005}},
        "ratios": {
            "flat_speedup_vs_numpy_per_query": 7.25,
            "flat_speedup_vs_numpy_batched": 1.5,
            "ivf_speedup_vs_flat": 2.0,
            "ivf_speedup_vs_numpy_batched": 3.0,
        },
        "passed": {"flat_vs_numpy": True, "ivf_recall": False},
    }
    (tmp_path / "search.json").write_text(json.dumps(result))
    text = render(tmp_path, tmp_path / "missing.json")
    assert "Test CPU" in text and "7.25x" in text and "**missed**" in text


def test_serve_section_reads_where_the_concurrency_32_time_goes():
    from write_benchmarks_md import serve_section

    variants = {v: {"texts_per_s": 50.0, "median_s": 5.0, "all_s": [5.0]} for v in ("offline", "c1", "c32")}
    result = {
        "command": "python scripts/bench_serve.py",
        "texts": 256,
        "reps": 3,
        "load_avg_1min_at_start": 5.0,
        "max_abs_diff_vs_encode": 3e-7,
        "variants": variants,
        "c32_vs_c1": 3.1,
        "c32_vs_offline": 0.95,
        "c32_vs_c32_unbatched": 2.5,
        "goal": {"c32_vs_c1": 3.0, "c32_vs_offline": 0.85},
    }
    lines, rows = serve_section(result)
    assert rows[0][3:] == ["3.10x / 0.95x", "met"] and "Where the" not in "\n".join(lines)
    result["c32_breakdown"] = {
        "wall_s": 4.0,
        "offline_s": 3.8,
        "offline_forwards": 8,
        "forward_s": 3.9,
        "idle_s": 0.1,
        "replay_s": 3.5,
        "forwards": 47,
        "rows": 5.4,
    }
    text = "\n".join(serve_section(result)[0])
    assert "47 forwards of 5.4 texts each for 3.90 s and was idle 0.10 s (2%)" in text
    assert "save 0.30 s" in text and "costs the forwards 0.40 s (11%)" in text


#: What each gpu_check section records when it ran (the rest of its figures come with these).
GPU_FIGURES = {
    "encode": ("texts_per_s", "tokens_per_s"),
    "capture_overhead": ("median_ratio_encode_rw_vs_plain",),
    "st_batching": ("speedup_vs_st_style", "min_cosine_st_style_vs_encode_hs_mean"),
    "serve": ("concurrency", "offline_encode"),
    "search": ("queries_per_s",),
    "moe_layer": ("tokens_per_s", "max_abs_input_grad_diff_vs_hf"),
}


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    """``bash scripts/gpu_check.sh --tiny --out DIR`` end to end on whatever device is present, in
    bounded time: every section is in the result with its figures or a skip reason, the server at
    concurrency 1/8/32 included, and BENCHMARKS.md is written to DIR, the committed files untouched."""
    import gpu_check

    root = SCRIPTS.parent
    watched = [root / "BENCHMARKS.md", root / "bench" / "results" / "gpu_check.json"]
    before = [p.read_bytes() if p.is_file() else None for p in watched]
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), "--tiny", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [p.read_bytes() if p.is_file() else None for p in watched] == before
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["benchmark"] == "gpu_check" and report["tiny"] and report["complete"]
    assert report["errors"] == {} and report["versions"]["torch"] and report["machine"]["logical_cpus"]
    assert report["model"]["model_type"] == "olmoe"
    assert set(gpu_check.SECTIONS) == set(GPU_FIGURES)
    for name, keys in GPU_FIGURES.items():
        got = report[name]
        if "skipped" in got:  # only what this machine lacks or a run out of time may be skipped
            assert got["skipped"] and name in report["skipped"], name
            continue
        assert all(key in got for key in keys), (name, sorted(got))
    if "skipped" not in report["serve"]:
        levels = report["serve"]["concurrency"]
        assert sorted(levels) == ["c1", "c32", "c8"]
        for level in levels.values():
            assert level["texts_per_s"] > 0 and 0 < level["p50_ms"] <= level["p99_ms"], level
            assert level["vs_offline_encode"] > 0 and level["max_abs_diff_vs_encode"] < 0.1
    if "skipped" not in report["st_batching"]:
        assert report["st_batching"]["min_cosine_st_style_vs_encode_hs_mean"] > 0.99
    if "skipped" not in report["moe_layer"]:
        assert max(report["moe_layer"]["max_abs_input_grad_diff_vs_hf"].values()) < 1e-4
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## GPU check (`scripts/gpu_check.sh`)" in page and "Dry run (cpu, tiny model" in page
    assert "smoke test, not results" in page and "encode ok" in page


def test_gpu_check_sections_record_their_failure_skip_or_budget_and_the_run_goes_on(tmp_path):
    """A failing section records its error, a missing piece its reason, a spent budget a skip; the
    sections after each still run, and the file is rewritten after every section."""
    import gpu_check

    run = gpu_check.Run(tmp_path, gpu_check.TINY, 60.0, {"tiny": True})
    run.section("encode", lambda budget: 1 / 0)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["encode"]["error"].startswith("ZeroDivision")
    run.section("capture_overhead", lambda budget: {"budget": budget})
    run.section("serve", lambda budget: {}, needs="not installed: openai (pip install openai)")
    run.deadline = time.monotonic() + 0.5  # less than a quarter of st_batching's budget is left
    run.section("st_batching", lambda budget: {"ran": True})
    path = run.write(complete=True)
    report = json.loads(path.read_text())
    assert "ZeroDivisionError" in report["errors"]["encode"]
    assert report["capture_overhead"] == {"budget": gpu_check.TINY.budgets["capture_overhead"]}
    assert report["serve"] == {"skipped": "not installed: openai (pip install openai)"}
    assert "time budget" in report["st_batching"]["skipped"]
    assert set(report["section_seconds"]) == {"encode", "capture_overhead", "serve", "st_batching"}
    assert report["complete"] and report["benchmark"] == "gpu_check" and report["versions"]["torch"]

    def stopped(budget: float) -> dict:
        raise gpu_check.Stopped("signal 15")  # what SIGTERM raises, from the entry point's time limit

    run.deadline = time.monotonic() + 60
    with pytest.raises(gpu_check.Stopped):
        run.section("search", stopped)
    kept = json.loads(path.read_text())  # rewritten on the way out, figures before it kept
    assert kept["stopped"] == "signal 15 during search" and not kept["complete"]
    assert "stopped" in kept["search"]["skipped"] and "budget" in kept["capture_overhead"]


@pytest.mark.slow
def test_gpu_check_builds_olmoe_1b_7b_at_its_published_size():
    """The GPU check's full model is OLMoE-1B-7B's shape (6.92B parameters), not transformers'
    OlmoeConfig defaults (twice the expert width: 13.4B), built here on the meta device."""
    import gpu_check

    model, config = gpu_check.build_model(False, 24331, torch.device("meta"), torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(6.92e9, rel=0.005), params
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (2048, 1024, 16)
    assert (config.num_experts, config.num_experts_per_tok, config.vocab_size) == (64, 8, 50304)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_timed_within_fits_its_repetitions_in_the_budget(monkeypatch):
    import gpu_check

    import moee.benchmarking

    monkeypatch.setattr(moee.benchmarking.gc, "collect", lambda: 0)  # 0.1 s each with torch loaded

    calls: list[str] = []

    def variant(name: str, seconds: float):
        return lambda: (calls.append(name), time.sleep(seconds), name)[-1]

    # a warm-up round of >= 0.1 s leaves <= 0.2 s of 0.3 s: two rounds at most (sleeps only overrun)
    times, repeats, first = gpu_check.timed_within({"a": variant("a", 0.05), "b": variant("b", 0.05)}, 0.3, 9)
    assert first == {"a": "a", "b": "b"}  # the warm-up calls' outputs
    assert 1 <= repeats <= 2 and len(times["a"]) == len(times["b"]) == repeats
    assert len(calls) == 2 * (repeats + 1)
    _, repeats, _ = gpu_check.timed_within({"a": variant("a", 0.05)}, 0.01, 9)
    assert repeats == 1  # at least one timed repetition, even past the budget
    _, repeats, _ = gpu_check.timed_within({"a": variant("a", 0.0)}, 10.0, 2)
    assert repeats == 2  # never more than asked


def test_benchmarks_md_renders_a_gpu_check_result_with_its_figures(tmp_path):
    """A GPU result shows every figure (st batching, serving at 1/8/32, search, MoE layer) and what
    failed or was skipped; a tiny result shows no figures; ``--gpu-check`` writes where --out says."""
    from write_benchmarks_md import main, render

    result = {
        "benchmark": "gpu_check",
        "utc": "2026-01-01T00:00:00Z",
        "command": "python scripts/gpu_check.py --out bench/results --budget-s 360",
        "machine": {"cpu_model": "Test CPU", "logical_cpus": 16, "platform": "x", "gpu": "NVIDIA H200"},
        "versions": {"torch": "2.13.0"},
        "device": "cuda",
        "tiny": False,
        "cuda": {"name": "NVIDIA H200", "memory_gb": 139.8},
        "total_seconds": 301.0,
        "complete": True,
        "errors": {"moe_layer": "Traceback ..."},
        "skipped": {},
        "model": {
            "model_type": "olmoe",
            "hidden_size": 2048,
            "layers": 16,
            "experts": 64,
            "top_k": 8,
            "params_billion": 6.92,
            "dtype": "torch.bfloat16",
        },
        "encode": {
            "texts": 2048,
            "real_tokens": 59960,
            "batch_size": 64,
            "texts_per_s": 812.0,
            "tokens_per_s": 23771.0,
        },
        "capture_overhead": {"goal": "<= 1.03", "median_ratio_encode_rw_vs_plain": 1.021},
        "st_batching": {
            "speedup_vs_st_style": {"encode_hs_mean": 1.37, "encode_moee_sum_mean": 1.31},
            "tokens": {
                "st_style_real": 60000,
                "st_style_padded": 71000,
                "encode_real": 59960,
                "encode_padded": 64000,
            },
            "min_cosine_st_style_vs_encode_hs_mean": 0.9987,
        },
        "serve": {
            "texts": 256,
            "offline_encode": {"batch_size": 32, "texts_per_s": 640.0},
            "concurrency": {
                "c1": {
                    "texts_per_s": 41.5,
                    "p50_ms": 23.1,
                    "p99_ms": 40.2,
                    "vs_offline_encode": 0.066,
                    "max_abs_diff_vs_encode": 0.004,
                },
                "c8": {"error": "RuntimeError: request 3: boom"},
                "c32": {
                    "texts_per_s": 512.3,
                    "p50_ms": 58.0,
                    "p99_ms": 95.5,
                    "vs_offline_encode": 0.8,
                    "max_abs_diff_vs_encode": 0.006,
                },
            },
        },
        "search": {
            "n": 100000,
            "dim": 1024,
            "queries": 1000,
            "k": 10,
            "queries_per_s": {"torch_gpu_bruteforce": 250000.0, "faiss_cpu_flat": 900.0},
            "recall_at_k": {"torch_gpu_bruteforce": 1.0},
            "faiss_gpu_skipped": "faiss GPU build not installed or no GPU visible (pip install 'moee[gpu]')",
        },
        "moe_layer": {"error": "RuntimeError: CUDA error"},
    }
    gpu_json = tmp_path / "gpu.json"
    gpu_json.write_text(json.dumps(result))
    text = render(tmp_path, tmp_path / "missing.json", gpu_json)
    gpu = text[text.index("## GPU check") : text.index("## Large models")]
    assert "On NVIDIA H200: 301 s" in gpu and "6.92B parameters" in gpu
    assert (
        "| encode throughput | 812 texts/s, 23,771 real tokens/s (2048 texts, 59,960 tokens, batch 64) |"
        in gpu
    )
    assert "encode(rw) / plain forward 1.02x" in gpu
    assert "HS mean 1.37x, MoEE (sum) mean 1.31x; padded tokens 64,000 vs 71,000" in gpu
    assert "| 1 | 41.5 | 23.1 | 40.2 | 0.07x |" in gpu and "| 32 | 512.3 | 58.0 | 95.5 | 0.80x |" in gpu
    assert "| 8 | **failed**: `RuntimeError: request 3: boom` |" in gpu and "6.0e-03 of `encode`" in gpu
    assert (
        "torch_gpu_bruteforce 250,000 queries/s (recall 1.000)" in gpu and "faiss GPU: faiss GPU build" in gpu
    )
    assert "moe_layer **failed** (`RuntimeError: CUDA error`)" in gpu and "MoE layer (" not in gpu

    tiny = {**result, "tiny": True, "device": "cpu"}
    gpu_json.write_text(json.dumps(tiny))
    text = render(tmp_path, tmp_path / "missing.json", gpu_json)
    gpu = text[text.index("## GPU check") : text.index("## Large models")]
    assert "No GPU machine was lent" in gpu and "Dry run (cpu, tiny model" in gpu
    assert "texts/s" in gpu and "812" not in gpu  # the section named, its figures not shown

    out = tmp_path / "page.md"
    assert (
        main(
            [
                "--results",
                str(tmp_path),
                "--capture",
                str(tmp_path / "none.json"),
                "--gpu-check",
                str(gpu_json),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "Dry run (cpu, tiny model" in out.read_text()
    with pytest.raises(SystemExit):
        main(["--results", str(tmp_path), "--gpu-check", str(tmp_path / "absent.json"), "--out", str(out)])
