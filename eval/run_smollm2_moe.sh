#!/usr/bin/env bash
# Reproduce eval/results/smollm2_moe/: the SmolLM2 MoE (the shipped model `smollm2-moe`) on the
# offline suite beside all-MiniLM-L6-v2 and the dense SmolLM2's hidden state, the figures of its
# model card's target table (moee/assets/smollm2-moe/README.md).
#
#   mean/     the model's own configuration (mean pooling, no prompt, its reference statistics):
#             HS, RW, MoEE concat, MoEE sum (label-free alpha), and the MiniLM baseline
#   paper/    the paper's configuration (--paper: MoEE sum, PromptEOL, last token, softmax scores),
#             with HS and RW under the same prompt and pooling beside it
#   dense/    the dense SmolLM2-135M-Instruct's hidden state under both configurations: the lora upcycle
#             before any training is the dense model exactly (every adapter starts at zero), built by
#             `moee upcycle BASE --out build/smollm2-dense-upcycle --experts 16 --top-k 2 --mode lora
#             --lora-rank 8` (its routers are untrained: only its HS rows are read)
#   isotropy/ the mean pairwise cosine of unrelated texts per method (eval/run_isotropy.py)
#
# Fully offline, CPU only; finished (configuration, task) pairs are cached, so a rerun resumes.
#
#   eval/run_smollm2_moe.sh [STEP...]   (default: mean paper dense isotropy)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PYTHON:-python}
OUT=eval/results/smollm2_moe
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(mean paper dense isotropy)
for step in "${STEPS[@]}"; do
  echo "== $step" >&2
  case "$step" in
    mean)
      $PY -m moee.cli evaluate --model smollm2-moe --tasks offline --methods hs,rw,moee_concat,moee_sum \
        --prompts none --pooling mean --alpha auto --alpha-rule spearman --baseline --out "$OUT/mean"
      # its HS without the reference statistics: the same features as the dense row below
      $PY -m moee.cli evaluate --model smollm2-moe --tasks offline --methods hs --prompts none --pooling mean \
        --reference none --out "$OUT/mean" ;;
    paper)
      $PY -m moee.cli evaluate --model smollm2-moe --tasks offline --paper --methods hs,rw,moee_sum \
        --out "$OUT/paper" ;;
    dense)
      if [ ! -f build/smollm2-dense-upcycle/config.json ]; then
        BASE=$($PY -c "from moee.models.smollm2 import dense_base; print(dense_base())")
        $PY -m moee.cli upcycle "$BASE" --out build/smollm2-dense-upcycle --experts 16 --top-k 2 --mode lora \
          --lora-rank 8
      fi
      $PY -m moee.cli evaluate --model build/smollm2-dense-upcycle --tasks offline --methods hs --prompts none \
        --pooling mean --reference none --out "$OUT/dense"
      $PY -m moee.cli evaluate --model build/smollm2-dense-upcycle --tasks offline --paper --methods hs \
        --out "$OUT/dense" ;;
    isotropy) $PY eval/run_isotropy.py --model smollm2-moe --out "$OUT/isotropy" ;;
    *) echo "run_smollm2_moe.sh: unknown step '$step'" >&2; exit 2 ;;
  esac
done
