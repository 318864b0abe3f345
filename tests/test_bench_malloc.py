"""scripts/bench_malloc.py runs both allocator settings in their own processes and records each
side's page faults, times and peak (a smoke run on minilm-moe, one pair)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_malloc.py"


@pytest.mark.slow
def test_bench_malloc_records_both_sides(tmp_path):
    argv = [sys.executable, str(SCRIPT), "--model", "minilm-moe", "--texts", "8", "--batch-size", "4"]
    argv += ["--passes", "1", "--pairs", "1", "--out", str(tmp_path)]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "malloc.json").read_text())
    assert set(result["runs"]) == {"default", "tuned"} and all(len(v) == 1 for v in result["runs"].values())
    assert result["tuned_env"]["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20)
    assert result["median_ratio_tuned_vs_default"] > 0 and result["minor_faults_per_pass"]["default"] >= 0
    assert result["machine"] and result["versions"]["torch"]


@pytest.mark.parametrize("flag", ["--texts", "--batch-size", "--passes", "--pairs"])
def test_bench_malloc_refuses_a_count_below_one(flag):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), flag, "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and f"{flag} must be at least 1, got 0" in out.stderr
