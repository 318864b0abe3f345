#!/usr/bin/env bash
# Reproduce eval/results/recipes/: every training-free recipe (docs/RECIPES.md) x every method (HS, RW,
# MoEE concat, MoEE sum) on the offline suite's quick subset, beside the paper's configuration and the
# dense baseline all-MiniLM-L6-v2; writes recipes.md / recipes.json (the table and its computed reading),
# the ordinary tables.md of the same cache, and one run record per variant under runs/.
#
# Texts are capped deterministically by using the quick tasks (seeded subsets: lee_sts, fortunes_clustering,
# fortunes_classification_quick 200/200, bible_pair_classification_quick 300 pairs,
# wordnet_definition_retrieval_quick 100 queries / 400 documents), because the nine-prompt ensemble alone
# costs nine forward passes per text. TASKS=offline runs the full suite instead (about 5x longer).
# Fully offline, CPU only. Finished (configuration, task) pairs are cached, so a rerun resumes.
#
#   eval/run_recipes.sh [OUT_DIR]            (default: eval/results/recipes)
# Environment: MODEL (default: minilm-moe, whose figures eval/results/recipes holds), TASKS (quick), HS_LAYER (the middle decoder layer),
#   HS_RANGE (the middle half), RW_LAYERS (the last half of the MoE layers),
#   REF_CORPUS (build/corpus/heldout.jsonl, the held-out split of the training corpus: never an evaluation
#   text; scripts/build_corpus.py builds it; without it the reference variant is skipped), REF_TEXTS (400).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT="${1:-eval/results/recipes}"
TASKS="${TASKS:-quick}"
MODEL="${MODEL:-minilm-moe}"
MODEL_ARGS=(--model "$MODEL")
PY="${PYTHON:-python}"
mkdir -p "$OUT/runs"

# Layer choices from the model's depth (decoder layers L, MoE layers M): HS_LAYER = L/2, HS_RANGE = L/4:3L/4,
# RW_LAYERS = the last ceil(M/2) MoE layers.
read -r L M < <("$PY" - "${MODEL:-}" <<'PYEOF'
import sys
from moee.embed.embedder import MoEEmbedder
emb = MoEEmbedder.from_pretrained(sys.argv[1] or None, device="cpu")
from moee.capture.registry import _decoder_layers
print(len(_decoder_layers(emb.model)), emb.n_moe_layers)
PYEOF
)
HS_LAYER="${HS_LAYER:-$((L / 2))}"
HS_RANGE="${HS_RANGE:-$((L / 4)):$((3 * L / 4))}"
RW_LAYERS="${RW_LAYERS:-$(seq -s, $((M / 2)) $((M - 1)))}"

run() {  # run NAME [moee evaluate flags...]: one variant, all four methods, its run record kept
  local name="$1"; shift
  echo "+ [$name] moee evaluate $*" >&2
  local start=$SECONDS
  # --pooling last unless the variant says otherwise: the table compares against the paper's pooling,
  # whatever the model's saved configuration is (a later flag of the variant overrides it)
  # --reference none likewise: a model's own reference applies only where a variant names it
  "$PY" -m moee.cli evaluate "${MODEL_ARGS[@]}" --tasks "$TASKS" --methods hs,rw,moee_concat,moee_sum \
    --alpha auto --pooling last --reference none --out "$OUT" "$@"
  "$PY" - "$OUT" "$name" "$((SECONDS - start))" <<'PYEOF'
import json, sys
from pathlib import Path
out, name, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
run = json.loads((out / "tables.json").read_text())["run"]
(out / "runs" / f"{name}.json").write_text(json.dumps({**run, "wall_seconds": seconds}, indent=2) + "\n")
PYEOF
}

run plain --prompts none,prompteol --baseline
run mean --pooling mean --prompts none,prompteol  # what echo's mean pooling is compared with
run paper --paper
# the model's own configuration with its reference statistics (moee_embedding.json), when it has them
MODEL_REF=$("$PY" - "${MODEL:-}" <<'PYEOF'
import sys
from moee.cli_options import model_config_of
config = model_config_of(sys.argv[1] or None)
print(config.reference if config is not None and config.reference else "")
PYEOF
)
if [ -n "$MODEL_REF" ]; then
  run model_reference --pooling mean --prompts none --reference "$MODEL_REF"
fi
run echo --recipe echo --prompts none,prompteol
run echo_mean --recipe echo --pooling mean --prompts none,prompteol
run token_prepending --recipe token_prepending --prompts none,prompteol
run ensemble --prompts stability
run hs_layer --hs-layer="$HS_LAYER" --prompts prompteol
run hs_range --hs-layer="$HS_RANGE" --prompts prompteol
run rw_layers --rw-layers="$RW_LAYERS" --prompts prompteol
REF_CORPUS="${REF_CORPUS:-build/corpus/heldout.jsonl}"
if [ -f "$REF_CORPUS" ]; then
  REF="$OUT/reference-prompteol"
  "$PY" -m moee.cli fit-reference "$REF_CORPUS" --out "$REF" --prompt prompteol --pooling last --max-texts "${REF_TEXTS:-400}" --overwrite \
    "${MODEL_ARGS[@]}"
  run reference --reference "$REF.safetensors" --prompts prompteol
else
  echo "skipping the reference variant: no $REF_CORPUS (scripts/build_corpus.py builds it)" >&2
fi
"$PY" -m moee.evaluation.recipe_tables "$OUT" --runs "$OUT/runs" \
  --note "Tasks: the offline suite's '$TASKS' set (seeded subsets, the texts capped deterministically). HS layer $HS_LAYER, HS range $HS_RANGE, RW layers $RW_LAYERS of a model with $L decoder and $M MoE layers; reference: the first ${REF_TEXTS:-400} texts of $REF_CORPUS under PromptEOL."
