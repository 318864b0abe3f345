#!/usr/bin/env bash
# Run the benchmarks of BENCHMARKS.md side by side (nice'd, single-threaded) and regenerate BENCHMARKS.md.
#
# Usage: scripts/run_benchmarks.sh [capture] [pipeline] [moe_layer] [training] [search] [recipes] [report] [serve] [ablate] [long_texts] [gpu_smoke]
#        (no argument: all of them). Results: bench/results/*.json and docs/bench_capture.json.
#        BENCHMARKS.md is always rewritten from whatever result files exist.
# Environment: PYTHON (default python), NICE (default 10), OMP_NUM_THREADS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
run() { echo "+ $*" >&2; nice -n "${NICE:-10}" "$PY" "$@"; }

selected=("$@")
[ ${#selected[@]} -eq 0 ] && selected=(capture pipeline moe_layer training search recipes report serve)
for name in "${selected[@]}"; do
  case "$name" in
    capture) run scripts/bench_capture.py --reps 21 ;;
    pipeline)
      run scripts/bench_pipeline.py
      if [ -f moee/assets/default-model/config.json ]; then run scripts/bench_pipeline.py --model default; fi ;;
    moe_layer) run scripts/bench_moe_layer.py --profile ;;
    training) run scripts/bench_training.py --profile ;;
    search)
      run scripts/bench_search.py
      run scripts/bench_search.py --isotropic --nprobe 8 32 128 256 ;;
    recipes) run scripts/bench_recipes.py ;;
    report)  # the bundled model's training corpus: real text, real vocabulary growth
      [ -f build/corpus/train.jsonl ] || run scripts/build_corpus.py
      OMP_NUM_THREADS=2 run scripts/bench_report.py --corpus build/corpus/train.jsonl --tokens 1000000 --reps 1 ;;
    serve) run scripts/bench_serve.py ;;
    ablate) run scripts/bench_ablate.py ;;
    long_texts)  # side by side with the code before the cut was made linear
      rm -rf build/moee-before && mkdir -p build/moee-before
      git archive f7f5ffb~1 moee | tar -x -C build/moee-before
      run scripts/bench_long_texts.py --before build/moee-before ;;
    gpu_smoke)  # the GPU check's CPU dry run: its results and page go to /tmp, never to bench/results
      PYTHON="$PY" nice -n "${NICE:-10}" bash scripts/gpu_check.sh --tiny --out /tmp/gpu_check_tiny ;;
    *) echo "unknown benchmark: $name (capture pipeline moe_layer training search recipes report serve ablate long_texts gpu_smoke)" >&2; exit 2 ;;
  esac
done
"$PY" scripts/write_benchmarks_md.py
