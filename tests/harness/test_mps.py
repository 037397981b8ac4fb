"""harness/mps.py: the MPS daemon a GPU sweep's (and the benchmark's) workers share, driven through a stand-in control
program; what a search does under MPS: a CUDA error replayed alone outside it, a worker waiting for the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.mps import CONTROL, LOG, PIPE, mps_daemon

# A stand-in nvidia-cuda-mps-control: records each call (its arguments, stdin, the pipe and log folders it was given,
# the devices it sees) and exits with $FAKE_MPS_STATUS (for a quit: $FAKE_MPS_QUIT_STATUS), saying $FAKE_MPS_ERROR on
# stderr; with $FAKE_MPS_LINGER, its -d leaves a process behind holding its output open, as a daemon does
FAKE = """#!/bin/sh
input=""
[ "$1" = "-d" ] || input=$(cat)
devices=${CUDA_VISIBLE_DEVICES-unset}
echo "$* | $input | $CUDA_MPS_PIPE_DIRECTORY | $CUDA_MPS_LOG_DIRECTORY | $devices" >> "$FAKE_MPS_CALLS"
[ -n "$FAKE_MPS_ERROR" ] && echo "$FAKE_MPS_ERROR" >&2
[ "$1" = "-d" ] && [ -n "$FAKE_MPS_LINGER" ] && sleep 5 &
[ "$1" = "-d" ] || exit ${FAKE_MPS_QUIT_STATUS:-0}
exit ${FAKE_MPS_STATUS:-0}
"""


@pytest.fixture
def control(tmp_path, monkeypatch):
    """The stand-in on PATH (alone: no real one can be found); returns the file its calls land in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / CONTROL
    program.write_text(FAKE)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("FAKE_MPS_CALLS", str(tmp_path / "calls"))
    monkeypatch.delenv(PIPE, raising=False)
    monkeypatch.delenv(LOG, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the daemon's folders, one left behind on purpose too
    return tmp_path / "calls"


def calls(path: Path) -> list[list[str]]:
    return [[part.strip() for part in line.split("|")] for line in path.read_text().splitlines()] if path.exists() \
        else []


def test_a_private_daemon_serves_the_processes_started_inside_and_quits_at_the_end(control, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the workers' pins are physical numbers: the daemon sees all
    said = []
    with mps_daemon(True, said.append) as on:
        assert on
        pipe = os.environ[PIPE]
        assert Path(pipe).is_dir() and Path(os.environ[LOG]).is_dir()
        child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{PIPE!r}])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == pipe  # a worker started now is the daemon's client
    assert PIPE not in os.environ and LOG not in os.environ
    assert not Path(pipe).exists()  # its folders are removed
    (start, quit_), = [calls(control)]
    assert start[0] == "-d" and start[2] == pipe and start[4] == "unset"
    assert quit_[0] == "" and quit_[1] == "quit" and quit_[2] == pipe
    assert len(said) == 1 and "started a daemon" in said[0]


def test_the_daemon_quits_when_the_work_inside_raises(control):
    with pytest.raises(KeyboardInterrupt):
        with mps_daemon(True, lambda line: None):
            raise KeyboardInterrupt
    assert [c[1] for c in calls(control)] == ["", "quit"] and PIPE not in os.environ


def test_a_daemon_that_does_not_start_leaves_the_workers_time_slicing_and_says_why(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_STATUS", "1")
    monkeypatch.setenv("FAKE_MPS_ERROR", "An instance of this daemon is already running")
    said = []
    with mps_daemon(True, said.append) as on:
        assert not on and PIPE not in os.environ
    assert len(calls(control)) == 1  # started only: nothing to quit
    assert said == ["MPS: the daemon did not start (An instance of this daemon is already running): the workers "
                    "take turns on the GPU"]


def test_without_the_control_program_the_run_goes_on_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(PIPE, raising=False)
    said = []
    with mps_daemon(True, said.append) as on:
        assert not on and PIPE not in os.environ
    assert said == [f"MPS: asked for, but {CONTROL} is not on PATH: the workers take turns on the GPU"]


def test_a_daemon_the_user_runs_is_used_as_it_is(control, monkeypatch, tmp_path):
    monkeypatch.setenv(PIPE, str(tmp_path / "theirs"))
    said = []
    with mps_daemon(True, said.append) as on:
        assert on and os.environ[PIPE] == str(tmp_path / "theirs")
    assert calls(control) == [] and os.environ[PIPE] == str(tmp_path / "theirs")
    assert said == [f"MPS: the workers are clients of the daemon at {tmp_path / 'theirs'}"]


def test_not_asked_for_nothing_starts(control):
    with mps_daemon(False, pytest.fail) as on:
        assert not on
    assert calls(control) == []


def test_a_daemon_holding_its_output_open_does_not_hold_the_start_up(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_LINGER", "1")
    began = time.monotonic()
    with mps_daemon(True, lambda line: None) as on:
        assert on
    assert time.monotonic() - began < 4  # not the 5 s its lingering child holds the output


def test_a_daemon_that_does_not_quit_keeps_its_pipe_folder_and_says_how_to_stop_it(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_QUIT_STATUS", "1")
    monkeypatch.setenv("FAKE_MPS_ERROR", "clients still attached")
    said = []
    with mps_daemon(True, said.append):
        pipe = os.environ[PIPE]
    assert Path(pipe).is_dir()  # the only way to reach it
    assert said[-1] == (f"MPS: the daemon did not quit (clients still attached); stop it with `echo quit | "
                        f"{PIPE}={pipe} {CONTROL}`")
    assert PIPE not in os.environ


class Events:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def event(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_sweep_asked_for_mps_launches_its_gpu_workers_as_the_daemons_clients(control, monkeypatch, tmp_path,
                                                                               device):
    from harness.sweep import Sweep

    seen = {}

    def supervise(self):  # the workers' environment, as each launch builds it
        seen["env"] = self.worker_env(0)
    monkeypatch.setattr(Sweep, "_supervise", supervise)
    progress = Events()
    Sweep([], device, "ci", tmp_path, time.time() + 60, 2, case_timeout_s=None, seed=0, db=None, redis=None,
          mutant=None, max_rounds=None, progress=progress, gpus=["0"], mps=True).run()
    if device == "cuda":
        assert seen["env"][PIPE] == calls(control)[0][2] and [c[1] for c in calls(control)] == ["", "quit"]
        assert "started a daemon" in progress.lines[0]
    else:
        assert PIPE not in seen["env"] and calls(control) == []
        assert progress.lines == ["MPS: asked for, but the workers run on the CPU: nothing to share"]


@contextlib.contextmanager
def daemon_at(folder: Path, kind: int = socket.SOCK_SEQPACKET):
    """A stand-in MPS daemon for :func:`search.outcome.mps_client`: a socket listening at FOLDER/control (of another
    type than a stream: the H200's daemon refused a stream connection, harness-out/gpu110.sh)."""
    with socket.socket(socket.AF_UNIX, kind) as listening:
        listening.bind(str(folder / "control"))
        listening.listen(8)
        try:
            yield
        finally:
            (folder / "control").unlink()


def test_a_process_is_an_mps_client_where_a_daemon_listens_on_the_control_socket(tmp_path, monkeypatch):
    from search.outcome import mps_client

    monkeypatch.setenv(PIPE, str(tmp_path))
    assert not mps_client()  # no daemon there: CUDA runs without MPS
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
        with daemon_at(tmp_path, kind):
            assert mps_client()
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
        with socket.socket(socket.AF_UNIX, kind) as dead:
            dead.bind(str(tmp_path / "control"))
        assert not mps_client()  # left by a daemon that was killed (its socket closed): nothing listens
        (tmp_path / "control").unlink()
    (tmp_path / "control").write_text("")  # not a socket
    assert not mps_client()


def test_under_mps_a_cuda_error_is_replayed_alone_outside_mps_before_it_is_reported(tmp_path, monkeypatch):
    """Another worker's GPU fault reaches every MPS client: a case that failed with a CUDA error is a finding only if
    it fails alone too; one that passes alone is counted as mps-fault and its case kept."""
    import search.search_row as sr
    from properties.verdict import Verdict
    from search.outcome import ADAPTER_ERROR, MPS_FAULT, RowOutcome

    monkeypatch.setattr(sr, "TAINTED", {})
    monkeypatch.setenv(PIPE, str(tmp_path))

    def failed(reason: str, kind: str | None = None) -> RowOutcome:
        case = tmp_path / "cases" / "row.json"
        case.parent.mkdir(exist_ok=True)
        case.write_text("{}")
        return RowOutcome("row", "sglang.triton", "decode", "outputs", ok=False, case_file=case, finding_kind=kind,
                          failure=Verdict("outputs", False, reason))

    fault = "crashed: AcceleratorError: CUDA error: an illegal memory access was encountered"
    with daemon_at(tmp_path):  # this process is the daemon's client
        result = failed(fault)
        sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 1)  # its own fault: it fails alone too
        assert not result.ok and Path(result.case_file).is_file() and not result.passed_alone
        result = failed(fault)
        in_cases = []

        def passes(case):  # while it is replayed, it is out of cases/ (a stopped sweep adopts what it finds there)
            in_cases.append(any((tmp_path / "cases").iterdir()))
            sr.alone_log(case).write_text("verdict: ok")
            return 0
        sr.confirm_alone(result, "cuda", tmp_path, replay=passes)
        assert in_cases == [False, False]
        assert result.ok and result.context_poisoned and result.case_file is None  # this process is done
        assert result.passed_alone == {MPS_FAULT: 1} and (tmp_path / "passed-alone" / "row.json").is_file()
        assert (tmp_path / "passed-alone" / "row.json.alone.log").read_text() == "verdict: ok"  # its evidence
        assert "1 CUDA error(s) under MPS that passed alone" in result.summary()
        # A refused or lost connection raised where the harness's code asked CUDA next: an adapter error by the frame
        # rule (not an asynchronous device error), replayed all the same
        result = failed("adapter error at engine/materialize.py:88 in materialize: crashed: RuntimeError: CUDA error: "
                        "CUDA-capable device(s) is/are busy or unavailable", ADAPTER_ERROR)
        sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
        assert result.ok and result.passed_alone == {MPS_FAULT: 1}

        # It fails alone, but otherwise than with that CUDA error: reported as the replay failed, with its kind
        def fails_otherwise(said):
            def replay(case):
                sr.alone_log(case).write_text(f"verdict:     {said}\n")
                return 1
            return replay
        result = failed(fault, ADAPTER_ERROR)
        sr.confirm_alone(result, "cuda", tmp_path, replay=fails_otherwise("outputs: FAILED: relative L2 error 0.3"))
        assert not result.ok and Path(result.case_file).is_file() and sr.alone_log(result.case_file).is_file()
        assert result.failure.reason.endswith("[alone, outside MPS, it failed otherwise: outputs: FAILED: relative L2 "
                                              "error 0.3]") and result.finding_kind is None  # the engine's
        result = failed(fault)
        sr.confirm_alone(result, "cuda", tmp_path, replay=fails_otherwise(
            "outputs: FAILED: adapter error at backends/sglang/handover.py:9 in check: crashed: BrokenHandover"))
        assert result.finding_kind == ADAPTER_ERROR  # the harness's own
        result = failed(fault)
        sr.confirm_alone(result, "cuda", tmp_path, replay=fails_otherwise("outputs: ok"))  # repro failed, not it
        assert not result.ok and result.failure.reason == fault
        result = failed("outputs: relative L2 error 0.3 out of bounds")  # no CUDA error: a finding as it is
        sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
        assert not result.ok
    result = failed(fault)  # no MPS: a CUDA error is this process's own
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
    assert not result.ok


def test_an_adapter_error_with_a_cuda_error_under_mps_is_replayed_alone_too(tmp_path, monkeypatch):
    import search.search_row as sr
    from properties.verdict import Verdict
    from search.outcome import ADAPTER_ERROR, MPS_FAULT, RowOutcome

    monkeypatch.setattr(sr, "TAINTED", {})
    monkeypatch.setenv(PIPE, str(tmp_path))
    replays = []
    monkeypatch.setattr(sr, "replay_alone", lambda case: replays.append(case) or 0)
    case = tmp_path / "cases" / "row.json"
    case.parent.mkdir()
    case.write_text("{}")
    result = RowOutcome("row", "sglang.triton", "decode", "outputs", case_file=case)
    verdict = Verdict("outputs", False, "adapter error at engine/materialize.py:88: crashed: RuntimeError: CUDA error: "
                                        "CUDA-capable device(s) is/are busy or unavailable")
    with daemon_at(tmp_path):
        sr.settle(sr.AdapterFailed(), None, None, "cuda", result, [(None, verdict)], tmp_path, 0.0)
    assert len(replays) == sr.REPLAYS_ALONE and result.ok and result.passed_alone == {MPS_FAULT: 1}
    assert result.finding_kind is None and ADAPTER_ERROR != result.finding_kind


def test_a_replay_alone_runs_outside_mps_under_the_mutant_and_says_it_is_alive(tmp_path, monkeypatch):
    import search.search_row as sr
    from harness.mutants.catalogue import MUTANTS

    seen = {}

    class Replay:  # the replay's process: it takes two of ALIVE_EVERY_S
        def __init__(self, argv, **kwargs):
            pipe = kwargs["env"][PIPE]
            seen["pipe"], seen["empty"], seen["argv"] = pipe, os.listdir(pipe) == [], argv
            kwargs["stdout"].write("verdict:     outputs: ok\n")
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits < 3:
                raise subprocess.TimeoutExpired("repro", timeout)
            return 0

        def poll(self):
            return 0 if self.waits >= 3 else None
    monkeypatch.setenv(PIPE, str(tmp_path))
    monkeypatch.setattr(sr.subprocess, "Popen", Replay)
    alive = []
    monkeypatch.setattr(sr, "ALIVE", lambda: alive.append(1))
    assert sr.replay_alone(tmp_path / "case.json") == 0
    assert seen["pipe"] != str(tmp_path) and seen["empty"]  # a folder without a daemon: CUDA runs without MPS
    assert "--mutant" not in seen["argv"] and "--known-passes" in seen["argv"]
    assert len(alive) == 2  # the sweep's worker said so while it waited (no hang against the case's timeout)
    assert "verdict:     outputs: ok\n(exit status 0)" in (tmp_path / "case.json.alone.log").read_text()  # kept
    with MUTANTS["gqa_modulo_mapping"].patch():  # a case replayed alone under a mutant runs under it too
        assert sr.REPLAY_MUTANT == "gqa_modulo_mapping"
        sr.replay_alone(tmp_path / "case.json")
    assert seen["argv"][-2:] == ["--mutant", "gqa_modulo_mapping"] and sr.REPLAY_MUTANT is None


def test_a_worker_waits_until_the_mps_daemon_takes_clients_again(tmp_path, monkeypatch):
    """After a fault the daemon refuses new clients until its old ones have all exited; a refused CUDA context stays
    refused in torch's process, so a worker probes in a child first, saying so each time."""
    from harness.sweep_worker import await_mps_daemon

    monkeypatch.setenv(PIPE, str(tmp_path))
    events = []
    assert await_mps_daemon(lambda **e: events.append(e), probe="raise SystemExit(1)") and events == []  # no MPS
    tries = tmp_path / "tries"
    probe = (f"import pathlib, sys; p = pathlib.Path({str(tries)!r}); p.write_text(p.read_text() + 'x' if p.exists() "
             f"else 'x'); sys.exit(0 if len(p.read_text()) >= 3 else 'MPS server is not ready')")
    with daemon_at(tmp_path):
        assert await_mps_daemon(lambda **e: events.append(e), timeout_s=60, probe=probe)
        assert [e["event"] for e in events] == ["awaiting-mps"] * 2 and events[0]["said"] == "MPS server is not ready"
        events.clear()
        assert not await_mps_daemon(lambda **e: events.append(e), timeout_s=0, probe="raise SystemExit(1)")
        assert len(events) == 1


def run_until_matrix(tmp_path, monkeypatch, usable: bool):
    """``run_task`` of a one-group CUDA task, stopped where it asks the matrix for its rows: what it did in order."""
    import harness.sweep_worker as sw
    import search.matrix

    order = []

    class Stop(Exception):
        pass

    def matrix_rows(*args, **kwargs):
        order.append("matrix")
        raise Stop
    monkeypatch.setattr(sw, "await_mps_daemon", lambda emit: order.append("await") or True)
    monkeypatch.setattr(sw, "cuda_usable", lambda: order.append("usable") or usable)
    monkeypatch.setattr(search.matrix, "matrix_rows", matrix_rows)
    task = {"device": "cuda", "profile": "ci", "events": str(tmp_path / "events.jsonl"), "parent": None,
            "units": [{"unit": "g", "compositions": ["torch_native"], "members": ["r"], "rows": []}]}
    try:
        order.append(sw.run_task(task))
    except Stop:
        pass
    return order


def test_a_worker_waits_for_the_daemon_before_it_asks_cuda_for_its_rows(tmp_path, monkeypatch):
    """The matrix asks CUDA whether the device is usable: asked while the daemon refused clients, it held none of the
    group's rows, and every worker started then failed (harness-out/gpu107.sh: StopIteration before its first
    row)."""
    import harness.sweep_worker as sw

    monkeypatch.setenv(PIPE, str(tmp_path))
    assert run_until_matrix(tmp_path, monkeypatch, True) == ["await", "matrix"]  # no MPS: no context made early
    with daemon_at(tmp_path):
        assert run_until_matrix(tmp_path, monkeypatch, True) == ["await", "usable", "matrix"]
        # refused after its probe: a fresh process waits again
        assert run_until_matrix(tmp_path, monkeypatch, False) == ["await", "usable", sw.EXIT_MPS_REFUSED]
    assert '"event": "mps-refused"' in (tmp_path / "events.jsonl").read_text()


def sweep_for(tmp_path, mps: bool = True):
    from harness.sweep import Sweep

    sweep = Sweep([], "cuda", "ci", tmp_path, time.time() + 60, 2, case_timeout_s=None, seed=0, db=None, redis=None,
                  mutant=None, max_rounds=None, progress=Events(), gpus=["0"], mps=mps)
    sweep.groups = {"g": SimpleNamespace(label="decode: sglang.triton (2 rows)")}
    return sweep


def test_a_sweep_gives_a_group_up_when_the_mps_daemon_keeps_refusing_its_workers(tmp_path):
    from harness.sweep import MPS_REFUSALS_MAX, Task
    from harness.sweep_worker import EXIT_MPS_REFUSED, EXIT_MPS_UNAVAILABLE

    sweep = sweep_for(tmp_path)
    task = lambda: Task(["g"], 0, None, tmp_path / "e", tmp_path / "l", 0.0)  # noqa: E731
    for _ in range(MPS_REFUSALS_MAX):
        sweep.exited(task(), EXIT_MPS_REFUSED)  # each: a fresh process waits again
    assert not (tmp_path / "findings.jsonl").exists() and not sweep.retired
    assert "a fresh process waits for it" in sweep.progress.lines[-1]
    sweep.exited(task(), EXIT_MPS_REFUSED)
    sweep.exited(task(), EXIT_MPS_UNAVAILABLE)
    found = [json.loads(line) for line in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert [f["kind"] for f in found] == ["error", "error"] and sweep.retired == {"g"}
    assert "refused the group's worker 11 times in a row" in found[0]["reason"]
    assert "took no new client" in found[1]["reason"]
    other = sweep_for(tmp_path / "other")  # refusals are counted by group: another group's do not add up
    (tmp_path / "other").mkdir()
    other.groups["h"] = SimpleNamespace(label="extend: sglang.triton (2 rows)")
    for unit in ("g", "h") * MPS_REFUSALS_MAX:
        other.exited(Task([unit], 0, None, tmp_path / "e", tmp_path / "l", 0.0), EXIT_MPS_REFUSED)
    assert not (tmp_path / "other" / "findings.jsonl").exists() and not other.retired


def test_a_gpu_fault_under_mps_that_no_case_reproduced_alone_is_still_reported(tmp_path):
    """Every CUDA error that passed alone is counted as another worker's fault; if none reproduced the fault, the
    fault's own case is among them (a layout-dependent fault need not fail alone): one finding names them."""
    from harness.sweep import RowState
    from search.outcome import MPS_FAULT

    row = SimpleNamespace(id="r", composition="torch_native", mode=SimpleNamespace(value="decode"),
                          property=SimpleNamespace(name="outputs"))

    def result(cases=(), fault_alone=False, failure=None):
        return {"ok": failure is None, "cases": 1, "failure": failure, "fault_alone": fault_alone,
                "passed_alone": {MPS_FAULT: len(cases)} if cases else {},
                "passed_alone_cases": [{"entry": MPS_FAULT, "reason": "CUDA error", "case": c} for c in cases]}
    sweep = sweep_for(tmp_path)
    sweep.record_result(RowState(row), 0, result(["out/passed-alone/a.json"]))
    sweep.record_result(RowState(row), 0, result(["out/passed-alone/b.json"]))
    # a finding that says CUDA error but did not fail alone with one (it failed otherwise) reproduced nothing
    sweep.record_result(RowState(row), 0, result(failure="CUDA error: illegal address [alone, outside MPS, it failed "
                                                         "otherwise: outputs: FAILED: rel L2 0.3]"))
    sweep.unreproduced_fault()
    found, = [json.loads(line) for line in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert found["kind"] == "error" and found["candidates"] == ["out/passed-alone/a.json", "out/passed-alone/b.json"]
    assert "FINDING (error) MPS" in sweep.progress.lines[-1]
    (tmp_path / "again").mkdir()
    again = sweep_for(tmp_path / "again")
    again.record_result(RowState(row), 0, result(["out/passed-alone/a.json"]))
    again.record_result(RowState(row), 0, result(fault_alone=True, failure="CUDA error: illegal address"))
    again.unreproduced_fault()  # the faulting row's case failed alone with the fault: that is the finding
    assert not (tmp_path / "again" / "findings.jsonl").exists()
    # A resumed sweep (a new Sweep over the same folder) reads the earlier session's results, and does not name the
    # same candidates twice
    resumed = sweep_for(tmp_path)
    for line in (tmp_path / "results.jsonl").read_text().splitlines():
        resumed.note_mps(json.loads(line))
    assert resumed.mps_faults == ["out/passed-alone/a.json", "out/passed-alone/b.json"]
    resumed.unreproduced_fault()
    assert len((tmp_path / "findings.jsonl").read_text().splitlines()) == 1


def test_a_replay_alone_stopped_midway_leaves_no_process_behind(tmp_path, monkeypatch):
    import search.search_row as sr

    killed = []

    class Replay:
        pid = 4242

        def __init__(self, argv, **kwargs):
            assert kwargs["start_new_session"]  # its own group: the worker's SIGINT does not reach it, its kill does
            self.done = False

        def poll(self):
            return 0 if self.done else None

        def wait(self, timeout=None):
            if timeout is not None and not self.done:
                raise subprocess.TimeoutExpired("repro", timeout)
            return -9

    def stop():
        raise KeyboardInterrupt  # the sweep stops the worker while it waits on the replay
    monkeypatch.setattr(sr.subprocess, "Popen", Replay)
    monkeypatch.setattr(sr.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(sr, "ALIVE", stop)
    with pytest.raises(KeyboardInterrupt):
        sr.replay_alone(tmp_path / "case.json")
    assert killed == [(4242, signal.SIGKILL)]
    killed.clear()
    monkeypatch.setattr(sr, "ALIVE", None)
    monkeypatch.setattr(sr, "REPLAY_ALONE_SECONDS", 0)  # past its deadline
    assert sr.replay_alone(tmp_path / "case.json") is None and killed == [(4242, signal.SIGKILL)]
    assert "(no end after 0 s)" in (tmp_path / "case.json.alone.log").read_text()


def test_a_case_a_stopped_worker_was_replaying_alone_is_set_aside_not_adopted(tmp_path):
    sweep = sweep_for(tmp_path)
    replaying = tmp_path / "replaying-alone"
    replaying.mkdir()
    (replaying / "c.json").write_text("{}")
    (replaying / "c.json.alone.log").write_text("$ repro")
    assert sweep.adopt_orphans(0.0) == 0
    assert (tmp_path / "interrupted" / "c.json").is_file() and (tmp_path / "interrupted" / "c.json.alone.log").is_file()
    assert "was being replayed alone when its worker stopped" in sweep.progress.lines[-1]


def test_the_report_lists_a_case_that_passed_alone_under_mps_on_one_table_line():
    from harness.report import _report_data, markdown
    from search.outcome import MPS_FAULT, RowOutcome

    row = RowOutcome("sglang.triton-decode-outputs", "sglang.triton", "decode", "outputs", cases=3)
    row.passed_alone = {MPS_FAULT: 1}
    row.passed_alone_cases = [{"entry": MPS_FAULT, "case": "out/passed-alone/c.json",
                               "reason": "outputs: FAILED: CUDA error: an illegal memory access\nSearch for | it"}]
    text = markdown(_report_data([row], [], "cuda", "gpu"), [])
    line, = [l for l in text.splitlines() if l.startswith("| sglang.triton-decode-outputs | `mps-fault`")]
    assert "illegal memory access Search for \\| it" in line and line.endswith("| `out/passed-alone/c.json` |")
