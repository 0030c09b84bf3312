#!/usr/bin/env bash
# The supported range beyond the pinned pair (`make test` covers torch 2.13 + fbgemm 1.8).
# Each job builds .venv-range-<name>: its torch (and fbgemm, and Lightning) first, then the
# project with `pip install -e .[test]`, which must leave that torch as it is (a user's torch
# is never replaced); then the suite without the slow cases. Prints one timing line a job.
#   RANGE_JOBS="newest newest-nofbgemm oldest" (the default, what CI runs: the newest torch with and without
#   fbgemm, and the oldest supported torch + Lightning)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# name | torch | fbgemm (empty: none) | lightning (empty: the newest the project allows)
JOBS=(
  "newest|2.14.1|fbgemm-gpu-cpu==1.9.0|"
  "newest-nofbgemm|2.14.1||"
  "oldest|2.11.0||2.5.*"
)
WANT="${RANGE_JOBS:-newest newest-nofbgemm oldest}"

summary=()
for job in "${JOBS[@]}"; do
  IFS='|' read -r name torch fbgemm lightning <<<"$job"
  [[ " $WANT " == *" $name "* ]] || continue
  venv=".venv-range-$name"
  py="$venv/bin/python"
  t0=$(date +%s)
  echo "== range job '$name': torch $torch, ${fbgemm:-no fbgemm}, lightning ${lightning:-newest allowed}"
  test -x "$py" || "$PYTHON" -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet "torch==$torch" ${lightning:+"lightning==$lightning"}
  "$py" -m pip uninstall --quiet --yes fbgemm-gpu fbgemm-gpu-cpu 2>/dev/null || true  # a reused venv
  [[ -z "$fbgemm" ]] || "$py" -m pip install --quiet "$fbgemm"
  before=$("$py" -c "import torch; print(torch.__version__)")
  "$py" -m pip install --quiet -e ".[test]"
  after=$("$py" -c "import torch; print(torch.__version__)")
  if [[ "$before" != "$after" ]]; then
    echo "range job '$name': installing the project changed torch $before -> $after" >&2
    exit 1
  fi
  "$py" -c "from lightning_shardrec import _fbgemm; print('range job backend:', _fbgemm.describe())"
  t1=$(date +%s)
  "$py" -m pytest -q -m "not slow" -p no:cacheprovider
  t2=$(date +%s)
  summary+=("$name: torch $after, ${fbgemm:-no fbgemm}, lightning $("$py" -c 'from importlib.metadata import version; print(version("lightning"))'): install $((t1 - t0)) s, tests $((t2 - t1)) s")
done
echo "== range jobs"
printf '%s\n' "${summary[@]}"
