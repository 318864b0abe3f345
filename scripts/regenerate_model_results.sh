#!/usr/bin/env bash
# Regenerate every committed figure that depends on minilm-moe's weights (the package's small model,
# moee/assets/default-model), in order, after scripts/train_default_model.sh has exported a new one. Each step is the command written next
# to its results; stale caches of the evaluation are removed first (they are keyed by the weights
# digest, so old ones would only sit beside the new).
#
#   scripts/regenerate_model_results.sh [STEP...]   (default: all; steps: isotropy offline recipes
#                                                    routes card overlap stability ablate swap steer report fixture)
# CPU only, about 1.5 hours on 2 shared cores (the report and the recipes take most of it).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PYTHON:-python}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(isotropy offline recipes routes card overlap stability ablate swap steer report fixture)
for step in "${STEPS[@]}"; do
  echo "== $step" >&2
  case "$step" in
    isotropy) $PY eval/run_isotropy.py ;;
    offline)
      rm -rf eval/results/offline/results/moee__default-model eval/results/offline_mean/results/moee__default-model
      bash eval/run_offline.sh ;;
    recipes)
      rm -rf eval/results/recipes/results/moee__default-model eval/results/recipes/runs
      bash eval/run_recipes.sh ;;
    routes)
      $PY scripts/compare_default_model_routes.py \
        --route "from scratch (previous bundled model), last token=eval/results/default_model_routes/from_scratch_tables.json" \
        --route "upcycled all-MiniLM-L6-v2 before training, last token=eval/results/default_model_routes/upcycled_step0_tables.json" \
        --route "upcycled + continued pretraining (bundled), last token=eval/results/offline/tables.json" \
        --route "upcycled + continued pretraining (bundled), mean pooling=eval/results/offline_mean/tables.json" \
        --out eval/results/default_model_routes/routes ;;
    card) $PY scripts/export_default_model.py --card-only --out moee/assets/default-model ;;
    overlap) $PY analysis/run_overlap.py ;;
    stability) $PY analysis/run_stability.py ;;
    report)  # saturation over the model's own training: stage 1's export, then stage 2 (the upcycled start
      # has its own tokenizer: it is the --compare report)
      $PY -m moee.cli report --model moee/assets/default-model --corpus moee/assets/default-model/heldout.jsonl \
        --domain-field source --checkpoints build/default-model-ctx128 build/train_default_ctx256/step_00000350 \
        build/train_default_ctx256/step_00000375 build/train_default_ctx256/step_00000400 \
        --overlap-tokens 16384 --ablation analysis/ablation_experts --router-swap analysis/router_swap \
        --steering analysis/steering/boost analysis/steering/suppress --out analysis/specialization --overwrite
      $PY -m moee.cli report --model minilm-moe --corpus moee/assets/default-model/heldout.jsonl --domain-field source \
        --compare build/upcycled-minilm --overlap-tokens 16384 --out analysis/specialization/compare --overwrite ;;
    ablate)
      $PY -m moee.cli ablate --model minilm-moe --corpus moee/assets/default-model/heldout.jsonl --domain-field source \
        --max-tokens 720 --per-domain-tokens 80 --batch-size 32 --out analysis/ablation_experts --overwrite ;;
    swap)  # each layer's router from stage 1 of the bundled model's training, beside a permuted-router null
      $PY -m moee.cli ablate --model minilm-moe --corpus moee/assets/default-model/heldout.jsonl --domain-field source \
        --max-tokens 720 --per-domain-tokens 80 --batch-size 32 --swap-from build/default-model-ctx128 \
        --out analysis/router_swap --overwrite ;;
    steer)  # the ablation's two most important experts, boosted and suppressed (reading: analysis/README.md)
      top2=$($PY -c 'import json; r = json.load(open("analysis/ablation_experts/importance.json"))
print(" ".join("%d:%d" % (e["layer"], e["expert"]) for e in sorted(r["experts"], key=lambda e: -e["delta"])[:2]))')
      for case in boost=0.5 suppress=-0.5; do
        $PY -m moee.cli ablate --model minilm-moe --corpus moee/assets/default-model/heldout.jsonl --domain-field source \
          --max-tokens 720 --per-domain-tokens 80 --batch-size 32 --steer $(printf "%s=${case#*=} " $top2) \
          --out "analysis/steering/${case%%=*}" --overwrite
      done ;;
    fixture) $PY -c "import tests.test_bundled_model_outputs as t; t.write_fixture()" ;;
    *) echo "regenerate_model_results.sh: unknown step '$step'" >&2; exit 2 ;;
  esac
done
