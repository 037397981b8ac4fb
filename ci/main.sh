#!/usr/bin/env bash
# Installs the harness and runs the main job: the whole matrix that can run on this machine, under a
# profile (default: ci on a CPU, gpu on a GPU). Findings land in harness-out/ (case files, report.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
profile=${HARNESS_PROFILE:-$(.venv/bin/python -c 'import torch; print("gpu" if torch.cuda.is_available() else "ci")')}
exec .venv/bin/python -m harness run --profile "$profile" "$@"
