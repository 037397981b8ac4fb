#!/usr/bin/env bash
# The GPU runner's job (plain shell: works outside CI too). Installs the harness with its gpu extra into
# the current Python (${PYTHON:-python}; set HARNESS_NO_INSTALL=1 to use what is installed), compiles the kernels
# the gpu profile needs (harness warmup, in parallel), then runs the tests under the gpu profile and the GPU matrix
# (harness run: groups of rows in several workers). All run; the exit status is non-zero if the tests or the run
# failed. Findings land in harness-out/gpu/ (report.md, report.json, junit.xml, plots, case files).
# It says at the start how long it expects to take: from the last job's times on this machine
# (harness-out/gpu-job-times, kept with the kernel caches), else nothing is known.
# The job keeps to GPU_JOB_MINUTES (default 15) in all: the warmup gets at most two fifths of it (the builds it
# leaves undone happen in the run), the tests take theirs, and the run gets what is left (at least 2 minutes), as a
# budget: every row's first examples before any row's full search (harness run --budget).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "${HARNESS_NO_INSTALL:-0}" != "1" ]; then
  "$PY" -m pip install -e '.[gpu]' || { echo "ci/gpu.sh: installing the harness failed" >&2; exit 1; }
fi
times=harness-out/gpu-job-times
if read -r w t r < "$times" 2>/dev/null; then
  echo "ci/gpu.sh: expected about $(( (w + t + r + 59) / 60 )) min (the last job here: warmup ${w}s, tests ${t}s, run ${r}s)"
else
  echo "ci/gpu.sh: no earlier job on this machine to estimate from (the times land in $times)"
fi
status=0
job=$(( ${GPU_JOB_MINUTES:-15} * 60 ))
t0=$(date +%s)
"$PY" -m harness warmup --profile gpu --budget "$(( job * 2 / 5 ))s" ||
  echo "ci/gpu.sh: the warmup failed; the run compiles what it lacks" >&2
t1=$(date +%s)
# The matrix's rows are the run's to search, within its budget: as tests under the gpu profile they took 249 s for 121
# of ~1500 rows on a cold H100 (harness-out/gpu59.sh, note22), the whole job's time several times over
# Only the tests that reach the GPU (marked `device`, tests/conftest.py): the CPU CI runs the rest on every
# submission, and all of them took ~560-600 s at 16 workers on an H200 (note24), the job's time on its own
"$PY" -m pytest -n auto --profile gpu -m device tests --ignore=tests/test_matrix.py || status=1
t2=$(date +%s)
left=$(( job - (t2 - t0) - 30 ))  # 30 s for the reports after the search
[ "$left" -ge 120 ] || left=120
"$PY" -m harness run --profile gpu --budget "${left}s" --out harness-out/gpu || status=1
t3=$(date +%s)
mkdir -p harness-out && echo "$(( t1 - t0 )) $(( t2 - t1 )) $(( t3 - t2 ))" > "$times"
echo "ci/gpu.sh: warmup $(( t1 - t0 ))s, tests $(( t2 - t1 ))s, run $(( t3 - t2 ))s"
exit "$status"
