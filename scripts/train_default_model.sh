#!/usr/bin/env bash
# Train the bundled default model and export it into moee/assets/default-model/.
#
#   scripts/train_default_model.sh            # fresh run (needs build/corpus + build/tokenizer:
#                                             #   scripts/build_corpus.py, scripts/build_tokenizer.py)
#   scripts/train_default_model.sh --resume   # continue from the latest checkpoint
#   scripts/train_default_model.sh --overwrite  # fresh run replacing an earlier run in build/train_default
#   scripts/train_default_model.sh --stop-at-step N   # the bundled model: see its README.md for N
#
# The run writes build/train_default/{log.jsonl, step_*/}. The export settles the loss-free
# router biases (weights frozen) and writes the model card, metrics and training curve.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
PY=${PYTHON:-python}
mkdir -p build/train_default
$PY -m moee.cli train --config configs/default_model.json "$@"
EXTRA=()
# log of the earlier noisy-top-k run summarised in the model card, when it is present
if [ -f build/train_default_noisy_abandoned/log.jsonl ]; then
  EXTRA=(--ablation-log build/train_default_noisy_abandoned/log.jsonl)
fi
$PY scripts/export_default_model.py --run build/train_default --config configs/default_model.json \
  --out moee/assets/default-model --calibrate-steps 60 --calibrate-gamma 0.002 "${EXTRA[@]}"
