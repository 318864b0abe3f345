#!/usr/bin/env bash
# Reproduce eval/results/offline/ and eval/results/offline_mean/: the offline mteb suite (8 tasks from
# real data) on minilm-moe (the package's small model) with HS, RW, MoEE concat and MoEE sum, each without a prompt
# and with PromptEOL, the label-free alpha, the dense baseline all-MiniLM-L6-v2 and the alpha
# sensitivity curve, with last-token pooling (the paper's) in offline/ and mean pooling (the bundled
# model's default recipe, eval/results/recipes) in offline_mean/.
# Fully offline, CPU only: about 8 minutes per pooling on 2 shared cores (the 8 MoE configurations;
# the baseline adds 1.5 min; much longer while other jobs load the machine).
# Finished (configuration, task) pairs are cached under the output folder, so an interrupted run
# resumes where it stopped. Every configuration flag is explicit: a flag left out would take the
# model's saved configuration (moee/assets/default-model/moee_embedding.json). Its reference statistics
# apply where a cell has the features they were fitted under (mean pooling, no prompt): those cells are
# the model's own configuration.
#
#   eval/run_offline.sh [OUT_DIR [MEAN_OUT_DIR]]  (default: eval/results/offline, eval/results/offline_mean)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT="${1:-eval/results/offline}"
MEAN_OUT="${2:-eval/results/offline_mean}"
python -m moee.cli evaluate --model minilm-moe \
  --tasks offline \
  --methods hs,rw,moee_concat,moee_sum \
  --prompts none,prompteol \
  --pooling mean \
  --alpha auto --alpha-rule spearman \
  --out "$MEAN_OUT"
exec python -m moee.cli evaluate --model minilm-moe \
  --tasks offline \
  --methods hs,rw,moee_concat,moee_sum \
  --prompts none,prompteol \
  --pooling last \
  --alpha auto --alpha-rule spearman \
  --baseline \
  --alpha-sensitivity \
  --out "$OUT"
