#!/usr/bin/env bash
# Installs the harness and runs its tests: everything that can run on this machine (on a CPU: the
# references, torch-native, linear-torch, interpreted Triton and every wrapper); GPU-only tests skip with
# their reason. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
# One worker more than the cores (at most 8; HARNESS_WORKERS to choose): some tests wait on a sleeping child (a
# hang's case timeout, a budget, a signal's delivery), which leaves a core idle under one worker a core. Measured on
# 2 cores (CI's machine): the suite took 580 s with 2 workers, 525 s with 3.
cores=$(nproc 2>/dev/null || echo 2)
workers=$(( cores + 1 > 8 ? 8 : cores + 1 ))
# --dist loadgroup: tests that share a module-scoped setup (test_export.py's two fresh interpreters) go to one worker.
exec .venv/bin/python -m pytest -n "${HARNESS_WORKERS:-$workers}" --dist loadgroup "$@"
