#!/usr/bin/env bash
# The harness on several SGLang releases, each in its own environment, then one summary table by release.
#
# Usage, from the project root, after ci/setup.sh (it uses .venv's harness to build the environments):
#   bash ci/releases.sh VERSION... [-- HARNESS-RUN-ARGUMENTS]
#   bash ci/releases.sh --build-only VERSION...   (builds the environments and runs nothing: .ci/run builds and runs
#                                                  0.5.10 while the tests run, filling their idle moments)
#   VERSION: a release (0.5.10 or newer), "newest" (the newest on the package index) or the path of an SGLang
#   source checkout (its environment is named after the checkout's commit). Each gets an environment under HARNESS_ENVS (default ~/.cache/attn-harness/envs), built once with
#   ci/install-sglang.sh (the release's own pins), the environments `harness bisect` uses too.
#   The arguments after -- go to `harness run` (default: the main job, `--profile ci` over every SGLang
#   composition that runs on this machine).
# HARNESS_RUN_TIMEOUT (seconds), if set, limits each release's run: past it the run gets SIGTERM (it stops as under
# Ctrl-C and writes its report), SIGKILL 30 s later, and its status is timeout's (124; 137 if it had to be killed).
# Each release's report lands in HARNESS_OUT/VERSION (default harness-out/releases); the table (from each
# report.json: rows, unavailable, cases, findings, adapter errors, known, at risk) is printed at the end and
# written to HARNESS_OUT/summary.md. Exit status: the worst of the runs' (0 every row passed or known, 1 a
# finding, 3 adapter errors only; a release whose environment cannot be built is 2).
#
# CI runs `bash ci/releases.sh 0.5.10 -- --backends sglang.triton sglang.gdn --max-examples 1 --seed 1 ...`: the oldest
# release, with the older metadata contract (capture/replay graph hooks, the backend on the batch, server args in
# a ServerArgs dataclass), so the code behind each older feature cannot rot unseen. The nightly workflow runs
# the oldest, the newest and main.
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
[ "${1:-}" = "--build-only" ] && { build_only=1; shift; }
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#versions[@]} -gt 0 ] || { echo "usage: bash ci/releases.sh [--build-only] VERSION... [-- HARNESS-RUN-ARGUMENTS]" >&2; exit 2; }
run_args=("$@")
[ ${#run_args[@]} -gt 0 ] || run_args=(--profile ci --backends sglang.torch_native sglang.triton sglang.gdn sglang.lightning sglang.short_conv)
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: no .venv: run bash ci/setup.sh first" >&2; exit 2; }
ENVS=${HARNESS_ENVS:-$HOME/.cache/attn-harness/envs}
OUT=${HARNESS_OUT:-harness-out/releases}
mkdir -p "$OUT"
worst=0
reports=()
for v in "${versions[@]}"; do
  if [ "$v" = "newest" ]; then
    v=$("$PY" -c "from harness.bisect import index_releases; print(index_releases()[-1])") || exit 2
  fi
  name=""
  if [ -d "$v" ]; then  # a checkout: a new environment when its commit moves
    name="sglang-checkout-$(git -C "$v" rev-parse --short HEAD)" || exit 2
    v=$(cd "$v" && pwd)
  fi
  env=$("$PY" - "$v" "$ENVS" "$name" <<'EOF'
import sys
from pathlib import Path

from harness.bisect import build_env

print(build_env(sys.argv[1], Path(sys.argv[2]), lambda line: print(line, file=sys.stderr), sys.argv[3] or None))
EOF
  ) || { echo "error: could not build the environment of $v" >&2; worst=2; continue; }
  name=$(basename "$env")
  if [ "$build_only" -eq 1 ]; then echo "== $name: built"; continue; fi
  echo "== $name: harness run ${run_args[*]}"
  status=0
  limit=()  # HARNESS_RUN_TIMEOUT: SIGTERM (the run stops as under Ctrl-C and writes what it checked), SIGKILL 30 s on
  [ -z "${HARNESS_RUN_TIMEOUT:-}" ] || limit=(timeout --kill-after=30 "$HARNESS_RUN_TIMEOUT")
  TRITON_INTERPRET=${TRITON_INTERPRET:-1} "${limit[@]}" "$env/bin/python" -m harness run "${run_args[@]}" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || status=$?
  grep -a -E "^[0-9]+ passed, " "$OUT/$name.log" | tail -n 1 || true
  echo "   exit status $status (log: $OUT/$name.log)"
  if [ ${#limit[@]} -gt 0 ] && { [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; }; then
    echo "   the run ran past HARNESS_RUN_TIMEOUT=${HARNESS_RUN_TIMEOUT}s (a hang?); its log ends:"
    tail -n 20 "$OUT/$name.log" | sed 's/^/   | /'
  fi
  [ -f "$OUT/$name/report.json" ] && reports+=("$OUT/$name")
  if [ "$status" -eq 1 ]; then worst=1; elif [ "$status" -ne 0 ] && [ "$worst" -eq 0 ]; then worst=$status; fi
done
if [ ${#reports[@]} -gt 0 ]; then
  "$PY" -m harness summarize "${reports[@]}" | tee "$OUT/summary.md" | sed -n '1,/^$/p'
  # Under GitHub Actions each run has put its report on the job's page; the table by release goes last.
  if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then cat "$OUT/summary.md" >> "$GITHUB_STEP_SUMMARY"; fi
fi
exit "$worst"
