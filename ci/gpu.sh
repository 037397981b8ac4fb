#!/usr/bin/env bash
# The GPU runner's job (plain shell: works outside CI too). Installs the harness with its gpu extra into
# the current Python (${PYTHON:-python}; set HARNESS_NO_INSTALL=1 to use what is installed), then runs the
# tests under the gpu profile and the GPU matrix. Both always run; the exit status is non-zero if either
# failed. Findings land in harness-out/gpu/ (report.md, report.json, plots, case files).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "${HARNESS_NO_INSTALL:-0}" != "1" ]; then
  "$PY" -m pip install -e '.[gpu]' || { echo "ci/gpu.sh: installing the harness failed" >&2; exit 1; }
fi
status=0
"$PY" -m pytest -n auto --profile gpu tests || status=1
"$PY" -m harness run --profile gpu --out harness-out/gpu || status=1
exit "$status"
