#!/usr/bin/env bash
# Installs the harness and runs its tests: everything that can run on this machine (on a CPU: the
# references, torch-native, linear-torch, interpreted Triton and every wrapper); GPU-only tests skip with
# their reason. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
# worksteal: a worker left idle takes tests queued on the other (the suite's tail holds tests of 10-30 s); the
# README's test command, 2 workers on this 2-core machine: 412 s against 423-432 s with xdist's default.
exec .venv/bin/python -m pytest -n "${HARNESS_WORKERS:-2}" --dist worksteal "$@"
