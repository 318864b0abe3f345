"""The benchmark harness and the pieces of the benchmark scripts that decide what is compared.

Timings are not tested (they are the benchmarks' job); what is tested is that the variants
compared side by side compute the same thing, that ratios are paired correctly, and that the
report is generated from result files only.
"""

from __future__ import annotations

import argparse
import json
import sys
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


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    """``gpu_check.py --tiny`` on whatever device is present: every section runs and is recorded."""
    import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    assert report["encode"]["texts_per_s"] > 0
    assert report["capture_overhead"]["median_ratio_encode_rw_vs_plain"] > 0
    assert max(report["moe_layer"]["max_abs_input_grad_diff_vs_hf"].values()) < 1e-4
    assert "queries_per_s" in report["search"]
