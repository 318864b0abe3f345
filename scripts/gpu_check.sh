#!/usr/bin/env bash
# The one prepared GPU check (BENCHMARKS.md, "GPU check"): run it from the repository root when a
# GPU machine is lent; it finishes in under 8 minutes.
#
#   bash scripts/gpu_check.sh                    # writes bench/results/gpu_check.json, regenerates BENCHMARKS.md
#   bash scripts/gpu_check.sh --tiny --out DIR   # the CPU dry run: tiny model, DIR/gpu_check.json, DIR/BENCHMARKS.md
#
# Options: --tiny (the tiny model and budgets; without --out its results go to a temporary folder,
# never to bench/results), --out DIR (results folder; BENCHMARKS.md is then written to DIR too and
# the committed one is left alone), --budget-s N (seconds for scripts/gpu_check.py; default 360, or
# 150 with --tiny). Environment: PYTHON (default python).
#
# Steps: nvidia-smi's facts (when present); which packages are there (a missing one is named with
# its pip install, and the sections that need it record a skip); scripts/gpu_check.py under a hard
# limit 30 s past its budget (each section has its own budget, records its own failure and never
# stops the others; the result is rewritten after each section, so a stopped run keeps what it
# measured); BENCHMARKS.md from the results. Exit status: gpu_check.py's (0: no section failed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

PY="${PYTHON:-python}"
tiny=0
out=""
budget=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1 ;;
    --out)
      [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a folder" >&2; exit 2; }
      out="$2"; shift ;;
    --budget-s)
      [ $# -ge 2 ] || { echo "gpu_check.sh: --budget-s needs a number of seconds" >&2; exit 2; }
      budget="$2"; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$budget" ] && ! [[ "$budget" =~ ^[0-9]+$ && "$budget" -gt 0 ]]; then
  echo "gpu_check.sh: --budget-s must be a whole number of seconds > 0, got '$budget'" >&2
  exit 2
fi
[ -n "$budget" ] || { [ "$tiny" = 1 ] && budget=150 || budget=360; }
if [ -z "$out" ] && [ "$tiny" = 1 ]; then
  out="${TMPDIR:-/tmp}/moee-gpu-check-tiny"  # a dry run's figures are never committed
fi
results="${out:-bench/results}"
md="${out:+$out/BENCHMARKS.md}"
md="${md:-BENCHMARKS.md}"
mkdir -p "$results"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS

echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), python: $(command -v "$PY" || echo "$PY (not found)")"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,power.limit \
    --format=csv || echo "nvidia-smi failed (exit $?)"
else
  echo "nvidia-smi: not present (no NVIDIA driver here; the check runs on the CPU)"
fi

# what is installed; only a missing torch/transformers/numpy stops the check (nothing could run)
timeout 120 "$PY" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

print(f"python {sys.version.split()[0]}")
needed = {"torch": "torch", "transformers": "transformers", "numpy": "numpy"}
optional = {
    "faiss": ("faiss-gpu-cu12", "faiss-cpu", "pip install 'moee[gpu]' (GPU search)"),
    "fastapi": ("fastapi", "pip install 'moee[serve]' (server)"),
    "uvicorn": ("uvicorn", "pip install 'moee[serve]' (server)"),
    "prometheus_client": ("prometheus-client", "pip install 'moee[serve]' (server)"),
    "openai": ("openai", "pip install openai (the server's client)"),
}


def version(*dists):
    for dist in dists:
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            pass
    return "installed"


missing = [name for name in needed if importlib.util.find_spec(name) is None]
for name in needed:
    print(f"  {name}: {'MISSING' if name in missing else version(name)}")
for name, (*dists, fix) in optional.items():
    found = importlib.util.find_spec(name) is not None
    print(f"  {name}: {version(*dists) if found else 'missing: ' + fix}")
if not missing:
    import torch

    print(f"  torch cuda: {torch.cuda.is_available()} (built for CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        print(f"  device 0: {torch.cuda.get_device_name(0)}")
    if importlib.util.find_spec("faiss") is not None:
        import faiss

        print(f"  faiss GPUs: {faiss.get_num_gpus() if hasattr(faiss, 'get_num_gpus') else 0}")
sys.exit(3 if missing else 0)
EOF
preflight=$?
if [ "$preflight" -ne 0 ]; then
  echo "gpu_check.sh: cannot run (preflight exit $preflight): install what is MISSING above (bash scripts/install.sh)" >&2
  exit 3
fi

args=(--out "$results" --budget-s "$budget")
[ "$tiny" = 1 ] && args+=(--tiny)
echo "== scripts/gpu_check.py ${args[*]} (hard limit $((budget + 30)) s)"
timeout -k 15 "$((budget + 30))" "$PY" scripts/gpu_check.py "${args[@]}"
rc=$?
case "$rc" in
  124 | 137) echo "gpu_check.sh: gpu_check.py was stopped at its hard limit; $results/gpu_check.json keeps the sections it finished" >&2 ;;
esac

if [ -f "$results/gpu_check.json" ]; then
  echo "== $md"
  "$PY" scripts/write_benchmarks_md.py --gpu-check "$results/gpu_check.json" --out "$md" \
    || { echo "gpu_check.sh: writing $md failed" >&2; [ "$rc" -ne 0 ] || rc=1; }
  "$PY" - "$results/gpu_check.json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
sections = ("model", "encode", "capture_overhead", "st_batching", "serve", "search", "moe_layer")
for name in sections:
    got = report.get(name)
    state = "missing" if got is None else got.get("skipped") and f"skipped: {got['skipped']}"
    state = state or (got.get("error") and f"FAILED: {got['error']}") or "ok"
    print(f"  {name:<17} {report.get('section_seconds', {}).get(name, 0):6.1f} s  {state}")
print(f"  complete: {report.get('complete')}, {report.get('total_seconds', 0):.0f} s")
EOF
else
  echo "gpu_check.sh: no $results/gpu_check.json was written" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
echo "== gpu_check.sh: exit $rc after $((SECONDS - started)) s"
exit "$rc"
