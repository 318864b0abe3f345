#!/usr/bin/env bash
# Reproduce eval/results/offline/: the offline mteb suite (8 tasks from real data) on the bundled
# default model with HS, RW, MoEE concat and MoEE sum, each without a prompt and with PromptEOL,
# the label-free alpha, the dense baseline all-MiniLM-L6-v2, and the alpha sensitivity curve.
# Fully offline, CPU only: about 4 minutes on 2 lightly loaded cores (2.5 min for the 8 MoE
# configurations, 1.5 min for the baseline; much longer while other jobs load the machine).
# Finished (configuration, task) pairs are cached under the output folder, so an interrupted run
# resumes where it stopped.
#
#   eval/run_offline.sh [OUT_DIR]          (default: eval/results/offline)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT="${1:-eval/results/offline}"
exec python -m moee.cli evaluate \
  --tasks offline \
  --methods hs,rw,moee_concat,moee_sum \
  --prompts none,prompteol \
  --alpha auto --alpha-rule spearman \
  --baseline \
  --alpha-sensitivity \
  --out "$OUT"
