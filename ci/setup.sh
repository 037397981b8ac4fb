#!/usr/bin/env bash
# Creates .venv (if missing) and installs the harness into it. Used by every other script here.
# On a CPU-only machine torch==2.13.0 is the local CPU build; GPU runners bring their own torch
# (set HARNESS_SKIP_TORCH=1 to keep the one installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "${HARNESS_SKIP_TORCH:-0}" != "1" ]; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e '.[redis]'  # redis: sweep --redis, and its test
# The SGLang extra (its real attention backends as sglang.* rows); HARNESS_NO_SGLANG=1 leaves it out, and its
# rows are then listed as unavailable with the install command.
if [ "${HARNESS_NO_SGLANG:-0}" != "1" ]; then
  bash ci/install-sglang.sh
fi
