#!/usr/bin/env bash
# Mutation testing for one source file with mutmut 3 (pip install -e '.[dev]' brings it).
#
#   bash scripts/mutation.sh <source file> [test files...]
#
# Without test files the table below picks them. The run happens in a private copy of the
# repository (a temporary directory, or $MUTATION_WORKDIR), so several files can be mutated at
# the same time from one working tree and nothing is written into it. The report (a summary, then
# every mutant with its status) goes to $MUTATION_REPORT_DIR (default /tmp/moee-mutation-results)
# as <source path with / -> _>.txt.
# Environment: MUTATION_JOBS (parallel mutants, default 2), MUTATION_KEEP=1 keeps the copy,
# MUTATION_ONLY (space-separated mutant-name globs, e.g. '*_TokenTables*': mutate those functions only).
# Inspect one survivor inside the kept copy with `mutmut show <name>`.
set -euo pipefail

# source file -> the test files that exercise it (space-separated)
tests_for() {
  case "$1" in
    moee/moe/gates.py) echo "tests/test_moe_gates.py tests/test_moe_layer.py tests/test_moe_switch.py" ;;
    moee/moe/losses.py) echo "tests/test_moe_losses.py tests/test_moe_gates.py" ;;
    moee/moe/switch.py) echo "tests/test_moe_switch.py" ;;
    moee/moe/layer.py) echo "tests/test_moe_layer.py" ;;
    moee/embed/methods.py) echo "tests/test_embed_methods.py" ;;
    moee/capture/recorder.py) echo "tests/test_capture_recorder.py" ;;
    moee/capture/oracle.py) echo "tests/test_capture_oracle_unit.py" ;;
    moee/embed/recipes.py) echo "tests/test_embed_recipes.py" ;;
    moee/embed/reference.py) echo "tests/test_embed_reference_unit.py" ;;
    moee/analysis/overlap.py) echo "tests/test_analysis_overlap.py" ;;
    moee/analysis/specialization/sections/coactivation.py)
      echo "tests/test_analysis_coactivation.py tests/test_analysis_specialization_nulls.py" ;;
    moee/analysis/specialization/sections/domains.py)
      echo "tests/test_analysis_domains.py tests/test_analysis_specialization_nulls.py" ;;
    moee/analysis/specialization/sections/repetition.py | moee/analysis/specialization/sections/token_specialization.py)
      echo "tests/test_analysis_specialization_nulls.py" ;;
    moee/analysis/specialization/*.py) echo "tests/test_analysis_specialization.py" ;;
    moee/moe/vocab.py) echo "tests/test_moe_vocab.py" ;;
    moee/moe/upcycle.py) echo "tests/test_moe_upcycle_maths.py tests/test_moe_upcycle_unit.py tests/test_moe_upcycle_lora.py tests/test_moe_upcycle.py tests/test_moe_upcycle_start.py tests/test_moe_upcycle_output.py" ;;
    *) return 1 ;;
  esac
}

if [[ $# -lt 1 ]]; then
  echo "usage: bash scripts/mutation.sh <source file> [test files...]" >&2
  exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
source_file="$1"
shift
if [[ ! -f "$source_file" || "$source_file" != *.py ]]; then
  echo "mutation.sh: source file '$source_file' is not a .py file in $repo" >&2
  exit 2
fi
if [[ $# -gt 0 ]]; then
  test_files=("$@")
elif table="$(tests_for "$source_file")"; then
  read -r -a test_files <<<"$table"
else
  echo "mutation.sh: no test files given and none listed for '$source_file' in the table" >&2
  exit 2
fi
for t in "${test_files[@]}"; do
  [[ -f "$t" ]] || { echo "mutation.sh: test file '$t' not found" >&2; exit 2; }
done
command -v mutmut >/dev/null || { echo "mutation.sh: mutmut not found; activate the venv or pip install mutmut" >&2; exit 2; }

work="${MUTATION_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/moee-mutation.XXXXXX")}"
cleanup() { [[ "${MUTATION_KEEP:-0}" == 1 ]] || rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work"
# only the package and the tests travel; mutmut copies them again into $work/mutants
tar -C "$repo" --exclude=__pycache__ -cf - moee tests pyproject.toml | tar -C "$work" -xf -

# mutmut 3 reads [tool.mutmut] from pyproject.toml; the private copy gets one for this run only
{
  echo
  echo "[tool.mutmut]"
  echo 'source_paths = ["moee"]'
  echo "only_mutate = [\"$source_file\"]"
  printf 'pytest_add_cli_args_test_selection = ['
  sep=""
  for t in "${test_files[@]}"; do printf '%s"%s"' "$sep" "$t"; sep=", "; done
  echo "]"
  echo 'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]'
  echo "use_git_change_detection = false"
} >>"$work/pyproject.toml"

report_dir="${MUTATION_REPORT_DIR:-${TMPDIR:-/tmp}/moee-mutation-results}"
mkdir -p "$report_dir"
report="$report_dir/$(echo "$source_file" | tr '/' '_' | sed 's/\.py$//').txt"
start=$(date +%s)
(
  cd "$work"
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
  read -r -a only <<<"${MUTATION_ONLY:-}"
  nice -n 10 mutmut run --max-children "${MUTATION_JOBS:-2}" "${only[@]}" >"$work/run.log" 2>&1 || {
    tail -40 "$work/run.log" >&2
    exit 1
  }
  mutmut results --all true >"$work/results.txt" 2>&1
)
elapsed=$(($(date +%s) - start))

# one line per mutant: "<name>: <status>"
python3 - "$work/results.txt" "$source_file" "$elapsed" "${test_files[*]}" >"$report" <<'PY'
import collections
import sys

path, source, elapsed, tests = sys.argv[1:]
rows = [line.strip() for line in open(path) if ": " in line]
status = collections.Counter(line.rsplit(": ", 1)[1] for line in rows)
total = sum(status.values())
killed = status.get("killed", 0) + status.get("timeout", 0)
print(f"source: {source}")
print(f"tests: {tests}")
print(f"seconds: {elapsed}")
print(f"mutants: {total}")
for name, count in sorted(status.items()):
    print(f"  {name}: {count}")
print(f"killed (incl. timeout): {killed}/{total}")
print()
print("\n".join(sorted(rows)))
PY
sed -n '1,/^$/p' "$report"
echo "full list: $report"
