#!/usr/bin/env bash
# Installs the harness and runs its tests: everything that can run on this machine (on a CPU: the
# references, torch-native, linear-torch, interpreted Triton and every wrapper); GPU-only tests skip with
# their reason. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python -m pytest -n "${HARNESS_WORKERS:-2}" "$@"
