#!/usr/bin/env bash
# Install moee into the active Python environment (a virtualenv is recommended).
#
#   bash scripts/install.sh          # the package, its runtime dependencies and the dense baseline
#   bash scripts/install.sh --dev    # plus the test tools (pytest, ruff, hypothesis, ...)
#
# An existing torch is never replaced, so a GPU user's CUDA build stays in place. Only when
# `import torch` fails is torch installed first, as $MOEE_TORCH (default torch==2.13.0: the
# CPU build where pip's find-links/index offer it, as on these machines). Safe to rerun.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

extras="[baseline]"  # the main job (moee quickstart) compares against all-MiniLM-L6-v2
for arg in "$@"; do
  case "$arg" in
    --dev) extras="[dev]" ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
TORCH_SPEC="${MOEE_TORCH:-torch==2.13.0}"

if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "install.sh: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
  echo "install.sh: no torch found; installing $TORCH_SPEC"
  "$PYTHON" -m pip install "$TORCH_SPEC"
fi

"$PYTHON" -m pip install -e ".${extras}"
"$PYTHON" -c "import moee, torch; print(f'install.sh: moee {moee.__version__} with torch {torch.__version__}')"
