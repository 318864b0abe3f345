#!/usr/bin/env bash
# Compare moee's native DeepSeekMoE v1 with the original modeling code (see compare_deepseek_v1.py).
# Step 1 runs the vendored original code under transformers 4.45 in its own virtual environment
# ($DS_VENV, default /tmp/ds-venv, built here once with a CPU torch); step 2 runs moee in the
# current environment (activate the project's venv first). Output: $OUT_DIR/comparison.json, copied to
# docs/deepseek_v1_comparison.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DS_VENV="${DS_VENV:-/tmp/ds-venv}"
OUT_DIR="${OUT_DIR:-/tmp/deepseek-v1-compare}"
TORCH_SPEC="${DS_TORCH:-torch==2.13.0}"

if [ ! -x "$DS_VENV/bin/python" ] || ! "$DS_VENV/bin/python" -c "import transformers, torch, sklearn" 2>/dev/null; then
  python3 -m venv "$DS_VENV"
  # CPU build of torch only (never a CUDA wheel); the original file also imports scikit-learn.
  "$DS_VENV/bin/pip" install -q --index-url https://download.pytorch.org/whl/cpu "$TORCH_SPEC" 2>/dev/null \
    || "$DS_VENV/bin/pip" install -q "$TORCH_SPEC"
  "$DS_VENV/bin/pip" install -q "transformers==4.45.*" safetensors numpy scikit-learn
fi
"$DS_VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'the reference venv must use a CPU torch'"

"$DS_VENV/bin/python" scripts/compare_deepseek_v1.py reference --out "$OUT_DIR"
HF_HUB_OFFLINE=1 python scripts/compare_deepseek_v1.py compare --dir "$OUT_DIR"
cp "$OUT_DIR/comparison.json" docs/deepseek_v1_comparison.json  # the committed record of the measured differences
