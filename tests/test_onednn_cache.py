"""bfloat16 on the CPU: memory must not grow with the number of matmul shapes a run meets.

oneDNN keeps a compiled kernel, with buffers, for each of the last 1024 matmul shapes; an MoE run
meets a new shape at every batch length and every expert's share of a batch, so a long bfloat16
run grew by about 1 GB before that cache was full. ``import moee`` caps it (unless the
environment sets it). Each side runs in a fresh process: the cache is set up at the first matmul.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: A process that meets 300 matmul shapes in bfloat16 and prints its RssAnon growth in bytes.
GROWTH = """
import ctypes, gc, sys
if sys.argv[1] == "moee":
    import moee  # noqa: F401
import torch
def anon():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
weight = torch.randn(512, 512, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 512, dtype=torch.bfloat16), weight)  # first-use costs
base = anon()
with torch.inference_mode():
    for m in range(2, 302):
        torch.nn.functional.linear(torch.randn(m * 3, 512, dtype=torch.bfloat16), weight)
print(anon() - base)
"""


def _growth(mode: str, env: dict[str, str]) -> int:
    run = subprocess.run(
        [sys.executable, "-c", GROWTH, mode], capture_output=True, text=True, timeout=300, env=env, check=True
    )
    return int(run.stdout.strip().splitlines()[-1])


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and glibc")
def test_importing_moee_bounds_the_kernel_cache_of_bfloat16_matmuls():
    library_default = _growth("plain", {**_clean_env(), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    if library_default < 60e6:
        pytest.skip(f"this CPU's bfloat16 matmuls keep no per-shape kernels ({library_default / 1e6:.0f} MB)")
    with_moee = _growth("moee", _clean_env())
    assert with_moee < library_default - 40e6, (with_moee, library_default)


def test_a_cache_capacity_the_environment_sets_is_kept():
    code = "import os, moee; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    for env, expected in (
        (_clean_env(), "64"),
        ({**_clean_env(), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}, "7"),
    ):
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert run.stdout.strip() == expected, run.stderr
