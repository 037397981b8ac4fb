"""``harness sweep``: spends its budget, survives crashing rows, shards deterministically, resumes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from search.casefile import CaseFile
from search.matrix import matrix_rows, shard_of, shard_rows
from search.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]
DECODE_OUTPUTS = ["--backends", "torch_native", "--modes", "decode", "--properties", "outputs"]  # 2 rows


def sweep(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "sweep", "--device", "cpu", "--profile", "ci",
                           "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("args, message", [
    (["--budget", "10x"], "--budget '10x' is not a duration"),
    (["--budget", "0s"], "is not a duration"),
    (["--shard", "2/2"], "--shard '2/2': write I/N"),
    (["--shard", "one"], "write I/N"),
    (["--backends", "nosuch"], "unknown backend 'nosuch'"),
    (["--mutant", "nosuch"], "unknown mutant 'nosuch'"),
    (["--workers", "0"], "--workers must be positive"),
    (["--redis", "redis://127.0.0.1:9/0"], "--redis"),  # no redis package, or no server there
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main(["sweep", "--device", "cpu", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_shards_split_rows_by_a_stable_hash():
    rows, _ = matrix_rows("cpu", PROFILES["ci"])
    ids = [r.id for r in rows]
    for n in (2, 3):
        parts = [[r.id for r in shard_rows(rows, (i, n))] for i in range(n)]
        assert sorted(sum(parts, [])) == sorted(ids)  # union is every row, and no row is in two shards
        assert all(parts)
        shuffled = random.Random(n).sample(rows, len(rows))
        assert [sorted(r.id for r in shard_rows(shuffled, (i, n))) for i in range(n)] == [sorted(p) for p in parts]
    assert shard_rows(rows, (0, 1)) == rows
    assert shard_of("torch_native-decode-outputs", 2) in (0, 1)


def test_short_sweep_spends_its_budget_and_writes_the_report(tmp_path):
    start = time.monotonic()
    out = sweep(tmp_path, "--budget", "10s", "--workers", "2", *DECODE_OUTPUTS)
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stdout + out.stderr
    assert elapsed >= 10, "the sweep stopped before its budget was spent"
    for name in ("report.md", "report.json", "pass_fail.png", "worst_error.png", "cases_per_second.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert {r["row"] for r in report["rows"]} == {"torch_native-decode-outputs", "tbo(torch_native)-decode-outputs"}
    assert all(r["status"] == "passed" and r["cases"] > 0 for r in report["rows"])
    assert max(r["rounds"] for r in report["rows"]) >= 2, "rows are searched again while budget remains"
    assert "| torch_native | ok" in (tmp_path / "report.md").read_text()
    assert "ok torch_native-decode-outputs round 1" in out.stderr  # progress, one line per event


def test_crashing_row_is_a_finding_and_the_sweep_goes_on(tmp_path):
    out = sweep(tmp_path, "--budget", "120s", "--rounds", "3", "--workers", "2", "--backends", "torch_native",
                "--modes", "extend", "decode", "--properties", "outputs", "--mutant", "decode_segfault_past_page_table")
    assert out.returncode == 1, out.stdout + out.stderr
    crashes = [f for f in jsonl(tmp_path / "findings.jsonl") if f["row"] == "torch_native-decode-outputs"]
    assert len(crashes) == 1 and crashes[0]["kind"] == "crash" and "SIGSEGV" in crashes[0]["reason"]
    case = CaseFile.read(crashes[0]["case_file"])  # the case that was running when the process died
    assert case.composition == "torch_native" and case.spec.mode.value == "decode"
    assert "SIGSEGV" in case.verdict["reason"]
    assert f"python -m harness repro {crashes[0]['case_file']}" in out.stdout
    rounds = [r for r in jsonl(tmp_path / "results.jsonl") if r["row"] == "torch_native-extend-outputs"]
    assert len(rounds) == 3 and all(r["ok"] for r in rounds)  # the same composition's other row went on
    statuses = {r["row"]: r["status"] for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    assert statuses["torch_native-decode-outputs"] == "crashed"
    assert statuses["torch_native-extend-outputs"] == "passed"


def test_resume_skips_finished_rows_and_keeps_findings(tmp_path, capsys):
    first = sweep(tmp_path, "--budget", "120s", "--rounds", "1", "--workers", "2", *DECODE_OUTPUTS)
    assert first.returncode == 0, first.stdout + first.stderr
    results = jsonl(tmp_path / "results.jsonl")
    assert sorted(r["row"] for r in results) == ["tbo(torch_native)-decode-outputs", "torch_native-decode-outputs"]
    # Interrupted before tbo(torch_native) finished; an earlier finding (of a row outside this selection) stays.
    kept = [r for r in results if r["row"] == "torch_native-decode-outputs"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    for events in (tmp_path / "workers").glob("*.events.jsonl"):  # its worker never finished it either
        lines = [e for e in jsonl(events) if not (e["event"] == "done" and e["row"].startswith("tbo("))]
        events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    finding = {"kind": "failure", "row": "triton-decode-outputs", "composition": "triton", "reason": "earlier"}
    (tmp_path / "findings.jsonl").write_text(json.dumps(finding) + "\n")

    again = sweep(tmp_path, "--budget", "120s", "--rounds", "1", "--workers", "2", "--resume", *DECODE_OUTPUTS)
    assert again.returncode == 1, again.stdout + again.stderr  # the kept finding
    assert "1 row(s) resumed" in again.stderr
    # The group of both rows starts again for the one row left in its first round
    assert "start decode: torch_native, tbo(torch_native) (2 rows) at round 1: 1 row(s)" in again.stderr
    results = jsonl(tmp_path / "results.jsonl")
    assert [r["row"] for r in results] == ["torch_native-decode-outputs", "tbo(torch_native)-decode-outputs"]
    assert jsonl(tmp_path / "findings.jsonl") == [finding]

    assert main(["sweep", "--device", "cpu", "--profile", "dev", "--resume", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a sweep with profile ci" in err and len(err.splitlines()) == 1


def test_first_round_is_small_so_a_short_sweep_reaches_every_row():
    from harness.sweep_worker import round_examples
    from search.profiles import PROFILES

    gpu = PROFILES["gpu"]
    assert round_examples(gpu, 0) == 3 < gpu.max_examples
    assert round_examples(gpu, 1) == round_examples(gpu, 5) == gpu.max_examples
    assert round_examples(PROFILES["ci"], 0) == min(3, PROFILES["ci"].max_examples)


def test_workers_share_the_cores(monkeypatch):
    from harness import sweep

    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(sweep, "visible_gpus", lambda: ["0"])
    assert sweep.default_workers("cuda") == 4  # four cores each
    monkeypatch.setattr(sweep, "visible_gpus", lambda: ["0", "1"])
    assert sweep.default_workers("cuda") == 4  # 16 cores over two GPUs: two workers per GPU, 4 cores each
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 64)
    assert sweep.default_workers("cuda") == 2 * sweep.MAX_WORKERS_PER_GPU



@pytest.fixture
def stalled_sweep(tmp_path):
    """A sweep of one idle worker (a sleeping process) with --case-timeout 10 and --compile-timeout 100."""
    from harness.progress import make_progress
    from harness.sweep import RowState, Sweep, Task
    from search.matrix import matrix_rows
    from search.profiles import PROFILES

    events = tmp_path / "events.jsonl"
    events.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["extend"])[0][:1]
    sw = Sweep([RowState(r) for r in rows], "cpu", "ci", tmp_path, time.time() + 60, 1, case_timeout_s=10.0, seed=0,
               db=None, redis=None, mutant=None, max_rounds=None, progress=make_progress(time.time(), 60),
               compile_timeout_s=100.0)
    unit = sw.unit_of["torch_native-extend-outputs"]
    sw.running[0] = Task([unit], 0, proc, events, tmp_path / "log", last_activity=time.time())
    sw.running[0].current = unit  # in a round (before its first, it has STARTUP_ALLOWANCE_S)
    yield sw, sw.running[0]
    proc.kill()
    proc.wait()


def stall(task, seconds: float, compiling_for: float) -> None:
    """The task made no progress for ``seconds``; the last look was ``compiling_for`` seconds ago."""
    now = time.time()
    task.last_activity = task.grace_anchor = now - seconds
    task.last_watch = now - compiling_for


def test_time_spent_compiling_is_not_a_hang(stalled_sweep, tmp_path):
    """A stalled case is a hang after --case-timeout of its own time; seconds while a worker's JIT compiler ran
    do not count (a cold GPU runner compiles FlashInfer kernels for minutes)."""
    sw, task = stalled_sweep
    sw.compiling = True
    stall(task, 30, compiling_for=25)
    sw.watch(task)  # stalled 30 s, 25 of them compiling: 5 s of its own
    assert 0 in sw.running and 24 < task.grace < 26
    sw.compiling = False
    grace = task.grace
    stall(task, 40, compiling_for=0)
    task.grace = grace
    sw.watch(task)  # 40 s stalled, 25 s compiling: 15 s of its own > 10
    assert 0 not in sw.running and task.proc.poll() is not None
    reason = jsonl(tmp_path / "findings.jsonl")[0]["reason"]
    assert "made no progress for 40s, 25s of it while a JIT compiler ran" in reason


def test_a_worker_compiling_says_so_in_one_line_each_period(stalled_sweep, tmp_path):
    """A cold GPU's first cases wait minutes on FlashInfer's builds: the sweep (and `harness run` in workers) says
    which worker compiles for which group, and for how long, once per period, never with a stack dump."""
    import os
    import shutil

    from harness.procs import compilers_under

    sw, task = stalled_sweep
    sleep = shutil.which("sleep")
    if sleep is None:
        pytest.skip("no sleep(1) to stand in for a compiler")
    ninja = tmp_path / "ninja"
    shutil.copy(sleep, ninja)
    worker = subprocess.Popen([sys.executable, "-c", f"import subprocess; subprocess.run([{str(ninja)!r}, '60'])"],
                              start_new_session=True)  # a worker whose build runs ninja
    lines: list[str] = []
    try:
        for _ in range(50):
            if "ninja" in compilers_under(worker.pid):
                break
            time.sleep(0.1)
        else:
            pytest.skip("no /proc to see processes in")
        task.proc.kill()
        task.proc.wait()
        task.proc = worker
        sw.progress.event = lines.append
        sw.compiling, sw.compile_notice_s, sw.compile_timeout_s = True, 60.0, 1000.0
        for silent in (30, 61, 90, 125):
            stall(task, silent, compiling_for=silent)  # compiling all along: not a hang
            task.grace = 0.0
            sw.watch(task)
    finally:
        os.killpg(worker.pid, 9)
        worker.wait()
    assert len(lines) == 2, lines  # at 61 s and at 125 s
    assert lines[0] == f"worker 0: {sw.groups[task.current].label}: compiling kernels for 61s (ninja)"
    assert "compiling kernels for 125s" in lines[1] and 0 in sw.running
    assert not os.path.exists(tmp_path / "findings.jsonl")


def test_compile_timeout_bounds_the_grace(stalled_sweep):
    sw, task = stalled_sweep
    sw.compiling = True
    stall(task, 101, compiling_for=101)
    sw.watch(task)  # compiling all along, but for longer than --compile-timeout
    assert 0 not in sw.running


@pytest.mark.parametrize("declared_slow", [True, False])
def test_interpreted_kernels_get_a_longer_case_timeout_on_a_cpu(tmp_path, monkeypatch, declared_slow,
                                                               cpu_rows_listed):
    """A nightly-profile case of interpreted Triton over 36k cached keys ran past 120 s in a CPU sweep and was
    reported as a hang, and so did SGLang's Triton decode over 128 requests (125 s), which does not declare
    slow_on_cpu: a composition whose kernels are interpreted there gets the longer default (not on a GPU, and not
    when --case-timeout is given), declared slow or not."""
    import dataclasses

    from backends.registry import Composition, parse
    from harness.procs import SLOW_CPU_CASE_TIMEOUT_S, default_case_timeout
    from harness.sweep import RowState, Sweep
    from search.matrix import matrix_rows
    from search.profiles import profile

    rows, _ = matrix_rows("cpu", profile("ci"), ["torch_native", "triton"])
    states = [RowState(r) for r in rows]
    if not declared_slow:  # as SGLang's Triton backend: interpreted on a CPU, the profile's examples drawn
        real = Composition.support
        monkeypatch.setattr(Composition, "support", lambda self: dataclasses.replace(real(self), slow_on_cpu=None))
        assert not parse("tbo(triton)").support().slow_on_cpu

    class Timeouts:
        """A sweep's case timeout for the group searching a composition's decode outputs row."""

        def __init__(self, device, case_timeout):
            self.sweep = Sweep(states, device, "ci", tmp_path, time.time() + 60, 1, case_timeout_s=case_timeout,
                               seed=0, db=None, redis=None, mutant=None, max_rounds=None, progress=None)

        def __getitem__(self, composition):
            return self.sweep.case_timeout(self.sweep.unit_of[f"{composition}-decode-outputs"])

    assert Timeouts("cpu", None)["triton"] == SLOW_CPU_CASE_TIMEOUT_S > 120
    assert Timeouts("cpu", None)["tbo(triton)"] == SLOW_CPU_CASE_TIMEOUT_S  # wrappers inherit it
    assert Timeouts("cpu", None)["torch_native"] == 120 == default_case_timeout("cpu")
    assert Timeouts("cuda", None)["triton"] == 600
    assert Timeouts("cpu", 30.0)["triton"] == 30.0


def test_at_equal_rounds_the_engines_compositions_start_first(tmp_path):
    """A 46-minute CPU sweep in matrix order never reached an SGLang row: at equal rounds the groups that run an
    engine's classes are launched before the harness's own; fewer rounds still come first."""
    from harness.sweep import RowState, Sweep
    from search.matrix import matrix_rows
    from search.profiles import profile

    rows, skipped = matrix_rows("cpu", profile("ci"), ["torch_native", "sglang.torch_native"])
    states = [RowState(r) for r in rows]
    comps = list(dict.fromkeys(str(r.composition) for r in rows))
    if not any(c.startswith("sglang.") for c in comps):
        pytest.skip(f"SGLang is not installed here: {skipped}")
    sw = Sweep(states, "cpu", "ci", tmp_path, time.time() + 60, 1, case_timeout_s=None, seed=0, db=None,
               redis=None, mutant=None, max_rounds=None, progress=None)
    order = sw.waiting()
    engine = [u for u in order if any("sglang." in str(s.row.composition) for s in sw.members[u])]
    assert order[:len(engine)] == engine and len(engine) < len(order)
    for s in states:  # the engine's rows one round ahead: the harness's own come first
        s.rounds = 1 if "sglang." in str(s.row.composition) else 0
    assert not sw.engine_rows(sw.waiting()[0])
    # After that, the harness's own rows are a control sample: a round of theirs for every CONTROL_EVERY of the
    # engine's (issue 26: the engine's compositions first and most)
    from harness.sweep import CONTROL_EVERY

    for engine_rounds, engine_first in ((1, True), (CONTROL_EVERY, True), (CONTROL_EVERY + 1, False)):
        for s in states:
            s.rounds = engine_rounds if "sglang." in str(s.row.composition) else 1
        assert sw.engine_rows(sw.waiting()[0]) == engine_first, engine_rounds
    # A bundle keeps to its first group's rank: an engine group lagging a round does not take ours along (review)
    for s in states:
        s.rounds = 1 if "sglang." not in str(s.row.composition) else 2
    lagging = next(u for u in sw.groups if sw.engine_rows(u))
    for s in sw.members[lagging]:
        s.rounds = 1
    assert sw.bundle(sw.waiting()) == [lagging]


def test_a_worker_still_starting_gets_the_startup_allowance_not_the_case_timeout(stalled_sweep):
    """Before its first row a worker imports torch and the engine: on a loaded host that took longer than a short
    --case-timeout, and an isolated run ended in a traceback. It is held to STARTUP_ALLOWANCE_S instead."""
    from harness.procs import STARTUP_ALLOWANCE_S

    sw, task = stalled_sweep
    task.current = None
    stall(task, 40, compiling_for=0)
    sw.watch(task)  # 40 s > --case-timeout 10, but it is still starting
    assert 0 in sw.running
    stall(task, STARTUP_ALLOWANCE_S + 1, compiling_for=0)
    sw.compile_timeout_s = 10 * STARTUP_ALLOWANCE_S
    sw.watch(task)
    assert 0 not in sw.running


def test_a_worker_takes_a_fair_share_of_the_groups_waiting_at_its_round(tmp_path):
    """A worker process costs its imports, which one small group's round does not repay: a worker takes several
    groups waiting at the same round (their share for all the workers, at most MAX_BUNDLE), never one a round ahead;
    near a round's end, a free worker does not take every group left while the others stand idle."""
    from harness.sweep import MAX_BUNDLE, RowState, Sweep
    from search.matrix import matrix_rows
    from search.profiles import profile

    rows, _ = matrix_rows("cpu", profile("ci"), ["torch_native", "linear_torch"])
    states = [RowState(r) for r in rows]
    sw = Sweep(states, "cpu", "ci", tmp_path, time.time() + 60, 2, case_timeout_s=None, seed=0, db=None,
               redis=None, mutant=None, max_rounds=None, progress=None)
    waiting = sw.waiting()
    assert len(waiting) > 4
    bundle = sw.bundle(waiting)
    assert bundle == waiting[:min(MAX_BUNDLE, -(-len(waiting) // 2))]
    sw.running = {0: object()}  # one worker busy, three groups left: the free one takes two, not three
    assert len(sw.bundle(waiting[:3])) == 2
    sw.running = {}
    for s in sw.members[waiting[1]]:  # one group a round ahead: the others still go first, and it is not taken along
        s.rounds = 1
    bundle = sw.bundle(sw.waiting())
    assert waiting[1] not in bundle and bundle[0] == waiting[0]


def test_a_worker_dying_between_a_groups_cases_retires_that_group_alone(tmp_path):
    """A worker holding several groups dies while one group's round runs but no case is pending (the harness's own
    error between cases): that group is left alone, not every group of the worker (found by review)."""
    from harness.progress import make_progress
    from harness.sweep import RowState, Sweep, Task
    from search.matrix import matrix_rows
    from search.profiles import PROFILES

    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["extend", "decode"])[0]
    sw = Sweep([RowState(r) for r in rows], "cpu", "ci", tmp_path, time.time() + 60, 1, case_timeout_s=10.0, seed=0,
               db=None, redis=None, mutant=None, max_rounds=None, progress=make_progress(time.time(), 60))
    running, other = list(sw.groups)[:2]
    task = Task([running, other], 0, None, tmp_path / "events.jsonl", tmp_path / "log", last_activity=time.time())
    task.current, task.started_any = running, True
    sw.crashed(task, "crash", "crash: the worker died (exit status 1)")
    assert sw.retired == {running}
    (finding,) = jsonl(tmp_path / "findings.jsonl")
    assert finding["kind"] == "error" and "between cases" in finding["reason"]


def worker_exited(tmp_path, log_text: str, running_rows: int):
    """A one-worker sweep of torch_native decode rows whose worker exited with status 1 and ``log_text`` in its log,
    while the group's pending case named its first row and ``running_rows`` of its rows (the last ones) had not ended.
    Returns the sweep, its rows and the finding."""
    from harness.progress import make_progress
    from harness.sweep import RowState, Sweep, Task
    from search.search_row import row_strategy
    from tests.test_group_search import draws

    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["decode"])[0]
    sw = Sweep([RowState(r) for r in rows], "cpu", "ci", tmp_path, time.time() + 60, 1, case_timeout_s=10.0, seed=0,
               db=None, redis=None, mutant=None, max_rounds=None, progress=make_progress(time.time(), 60))
    unit = sw.unit_of[rows[0].id]
    CaseFile(str(rows[0].composition), "outputs", draws(row_strategy(rows[0], PROFILES["ci"]), 1)[0], "cpu",
             "ci").write(sw.pending_file(unit))
    log = tmp_path / "worker.log"
    log.write_text(log_text)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    task = Task([unit], 0, proc, tmp_path / "events.jsonl", log, last_activity=time.time())
    task.current, task.started_any = unit, True
    task.round_rows = {r.id for r in rows[len(rows) - running_rows:]}
    sw.exited(task, 1)
    (finding,) = jsonl(tmp_path / "findings.jsonl")
    return sw, rows, finding


@pytest.mark.parametrize("last_line, kind", [("TypeError: a bug in the search", "adapter_error"),
                                             ("SystemExit: 1", "crash")])
def test_an_exception_out_of_a_worker_is_the_harness_error(tmp_path, last_line, kind):
    """Property.run turns every exception of a check, the engine's included, into a verdict: a worker that exits with
    a Python exception (status 1) failed in the harness's own code, which is an adapter error, never the engine's
    crash. A SystemExit may be anyone's, and stays a crash."""
    # Hypothesis prints its notes after the exception it re-raises: the reason names the exception, not a note
    log = (f"Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n{last_line}\n"
           f"You can reproduce this test case by temporarily adding @reproduce_failure(...)\n")
    sw, rows, finding = worker_exited(tmp_path, log, running_rows=2)  # every row still in its round
    assert finding["kind"] == kind and finding["row"] == rows[0].id and finding["case_file"]
    if kind == "adapter_error":
        assert last_line in finding["reason"]


def test_a_harness_error_after_a_rows_round_ended_is_not_that_rows(tmp_path):
    """The group's pending case names the last row that ran a case; once that row's round has ended (its line and
    record written), a worker dying of the harness's own error is the group's error, not a second outcome of that row
    (found by review: a row was reported twice, and each relaunch blamed another innocent row)."""
    log = "Traceback (most recent call last):\nRuntimeError: a bug in the group search\n"
    sw, rows, finding = worker_exited(tmp_path, log, running_rows=1)  # rows[0]'s round is over
    unit = sw.unit_of[rows[0].id]
    assert finding["kind"] == "adapter_error" and finding["row"] is None and finding["groups"] == [unit]
    assert "RuntimeError: a bug in the group search" in finding["reason"] and "between cases" in finding["reason"]
    assert sw.by_id[rows[0].id].finding is None and sw.retired == {unit}


def test_a_runs_shrink_budget_is_the_runs_not_each_workers(tmp_path):
    """`harness run` bounds shrinking over the whole run: what rows spent is taken off before the next worker starts
    (found by review: each worker had the run's whole budget, 30 bundles of the ci matrix 30 times it)."""
    import math

    from harness.progress import make_progress
    from harness.sweep import RowState, Sweep

    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["decode", "extend"])[0]
    sw = Sweep([RowState(r) for r in rows], "cpu", "ci", tmp_path, math.inf, 1, case_timeout_s=10.0, seed=0, db=None,
               redis=None, mutant=None, max_rounds=1, progress=make_progress(time.time(), None), is_run=True,
               shrink_seconds=10.0, shrink_total=40.0, on_row=lambda state: None)
    state = sw.by_id[rows[0].id]
    sw.row_done(state, 0, {**state.record(), "cases": 4, "shrink_seconds": 25.0, "ok": True})
    assert sw.shrink_total == 15.0
    sw.launch(0, sw.waiting()[:1])
    try:
        task = json.loads(next((tmp_path / "workers").glob("*.json")).read_text())
    finally:
        sw.kill(sw.running.pop(0))
    assert task["shrink_total"] == 15.0 and task["shrink_seconds"] == 10.0 and task["run"] is True
