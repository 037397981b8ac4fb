#!/usr/bin/env bash
# The nightly sweep (plain shell: works outside CI too). Spends HARNESS_BUDGET (default 30m) searching the
# whole matrix under the nightly profile, one process per group of rows that share their batches; a crash or
# hang is a finding of the row whose case was running, and the sweep goes on. HARNESS_SHARD=I/N searches one
# shard of the rows. The Hypothesis example database is the folder HARNESS_DB (default .hypothesis/nightly):
# CI restores it before and saves it after, so a failure found one night is replayed first the next. --resume
# continues a sweep stopped in the same output folder. Installs the harness with its gpu extra first unless
# HARNESS_NO_INSTALL=1. Extra arguments go to the sweep. Exit status 1 if anything was found.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "${HARNESS_NO_INSTALL:-0}" != "1" ]; then
  "$PY" -m pip install -e '.[gpu]'
fi
mkdir -p "${HARNESS_DB:-.hypothesis/nightly}"  # Hypothesis writes it only when something fails; CI caches it
out=${HARNESS_OUT:-harness-out/nightly}
args=(--budget "${HARNESS_BUDGET:-30m}" --profile nightly --out "$out" --db "${HARNESS_DB:-.hypothesis/nightly}")
if [ -f "$out/sweep.json" ]; then
  args+=(--resume)  # a sweep stopped in this folder goes on (--resume refuses a folder with no sweep in it)
fi
if [ -n "${HARNESS_SHARD:-}" ]; then
  args+=(--shard "$HARNESS_SHARD")
fi
exec "$PY" -m harness sweep "${args[@]}" "$@"
