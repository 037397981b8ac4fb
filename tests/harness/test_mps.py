"""harness/mps.py: the MPS daemon a GPU sweep's (and the benchmark's) workers share, driven through a stand-in control
program; what a search does under MPS: a CUDA error replayed alone outside it, a worker waiting for the daemon."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def test_a_process_is_an_mps_client_where_the_daemons_control_pipe_is(tmp_path, monkeypatch):
    from search.outcome import mps_client

    monkeypatch.setenv(PIPE, str(tmp_path))
    assert not mps_client()  # no daemon there: CUDA runs without MPS
    (tmp_path / "control").touch()
    assert mps_client()


def test_under_mps_a_cuda_error_is_replayed_alone_outside_mps_before_it_is_reported(tmp_path, monkeypatch):
    """Another worker's GPU fault reaches every MPS client: a case that failed with a CUDA error is a finding only if
    it fails alone too; one that passes alone is counted as mps-fault and its case kept."""
    import search.search_row as sr
    from properties.verdict import Verdict
    from search.outcome import ADAPTER_ERROR, MPS_FAULT, RowOutcome

    monkeypatch.setattr(sr, "TAINTED", {})
    monkeypatch.setenv(PIPE, str(tmp_path))
    (tmp_path / "control").touch()  # a daemon's pipe: this process is its client

    def failed(reason: str, kind: str | None = None) -> RowOutcome:
        case = tmp_path / "cases" / "row.json"
        case.parent.mkdir(exist_ok=True)
        case.write_text("{}")
        return RowOutcome("row", "sglang.triton", "decode", "outputs", ok=False, case_file=case, finding_kind=kind,
                          failure=Verdict("outputs", False, reason))

    fault = "crashed: AcceleratorError: CUDA error: an illegal memory access was encountered"
    result = failed(fault)
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 1)  # its own fault: it fails alone too
    assert not result.ok and result.case_file is not None and not result.passed_alone
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
    assert (tmp_path / "passed-alone" / "row.json.alone.log").read_text() == "verdict: ok"  # its evidence with it
    assert "1 CUDA error(s) under MPS that passed alone" in result.summary()
    # raised where the harness's code synchronized next: an adapter error by the frame rule, replayed all the same
    result = failed("crashed: RuntimeError: CUDA error: unspecified launch failure", ADAPTER_ERROR)
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
    assert result.ok and result.passed_alone == {MPS_FAULT: 1}
    # It fails alone, but otherwise than with that CUDA error: a finding of its own, said so
    result = failed(fault)

    def fails_otherwise(case):
        sr.alone_log(case).write_text("verdict:     outputs: FAILED: relative L2 error 0.3\n")
        return 1
    sr.confirm_alone(result, "cuda", tmp_path, replay=fails_otherwise)
    assert not result.ok and Path(result.case_file).is_file() and sr.alone_log(result.case_file).is_file()
    assert result.failure.reason.endswith("[alone, outside MPS, it failed otherwise: outputs: FAILED: relative L2 "
                                          "error 0.3]")
    result = failed("outputs: relative L2 error 0.3 out of bounds")  # no CUDA error: a finding as it is
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
    assert not result.ok
    (tmp_path / "control").unlink()  # no MPS: a CUDA error is this process's own
    result = failed(fault)
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
    assert not result.ok


def test_a_replay_alone_runs_outside_mps(tmp_path, monkeypatch):
    import search.search_row as sr

    seen = {}

    def run(argv, **kwargs):
        pipe = kwargs["env"][PIPE]
        seen["pipe"], seen["empty"], seen["argv"] = pipe, os.listdir(pipe) == [], argv
        kwargs["stdout"].write("verdict:     outputs: ok\n")
        return subprocess.CompletedProcess(argv, 0)
    monkeypatch.setenv(PIPE, str(tmp_path))
    monkeypatch.setattr(sr.subprocess, "run", run)
    assert sr.replay_alone(tmp_path / "case.json") == 0
    assert seen["pipe"] != str(tmp_path) and seen["empty"]  # a folder without a daemon: CUDA runs without MPS
    assert "--mutant" not in seen["argv"]
    assert "verdict:     outputs: ok\n(exit status 0)" in (tmp_path / "case.json.alone.log").read_text()  # kept
    monkeypatch.setattr(sr, "REPLAY_MUTANT", "decode_illegal_address_past_page_table")  # a mutant sweep's worker
    sr.replay_alone(tmp_path / "case.json")
    assert seen["argv"][-2:] == ["--mutant", "decode_illegal_address_past_page_table"]


def test_a_worker_waits_until_the_mps_daemon_takes_clients_again(tmp_path, monkeypatch):
    """After a fault the daemon refuses new clients until its old ones have all exited; a refused CUDA context stays
    refused in torch's process, so a worker probes in a child first, saying so each time."""
    from harness.sweep_worker import await_mps_daemon

    monkeypatch.setenv(PIPE, str(tmp_path))
    events = []
    assert await_mps_daemon(lambda **e: events.append(e), probe="raise SystemExit(1)") and events == []  # no MPS
    (tmp_path / "control").touch()
    tries = tmp_path / "tries"
    probe = (f"import pathlib, sys; p = pathlib.Path({str(tries)!r}); p.write_text(p.read_text() + 'x' if p.exists() "
             f"else 'x'); sys.exit(0 if len(p.read_text()) >= 3 else 'MPS server is not ready')")
    assert await_mps_daemon(lambda **e: events.append(e), timeout_s=60, probe=probe)
    assert [e["event"] for e in events] == ["awaiting-mps"] * 2 and events[0]["said"] == "MPS server is not ready"
    events.clear()
    assert not await_mps_daemon(lambda **e: events.append(e), timeout_s=0, probe="raise SystemExit(1)")
    assert len(events) == 1


def test_a_worker_waits_for_the_daemon_before_it_asks_cuda_for_its_rows(tmp_path, monkeypatch):
    """The matrix asks CUDA whether the device is usable: asked while the daemon refused clients, it held none of the
    group's rows, and every worker started then failed (harness-out/gpu107.sh: StopIteration before its first
    row)."""
    import harness.sweep_worker as sw
    import search.matrix

    order = []

    class Stop(Exception):
        pass

    def matrix_rows(*args, **kwargs):
        order.append("matrix")
        raise Stop
    monkeypatch.setattr(sw, "await_mps_daemon", lambda emit: order.append("await") or True)
    monkeypatch.setattr(sw, "cuda_usable", lambda: order.append("usable") or True)
    monkeypatch.setattr(search.matrix, "matrix_rows", matrix_rows)
    task = {"device": "cuda", "profile": "ci", "events": str(tmp_path / "events.jsonl"), "parent": None,
            "units": [{"unit": "g", "compositions": ["torch_native"], "members": ["r"], "rows": []}]}
    with pytest.raises(Stop):
        sw.run_task(task)
    assert order == ["await", "usable", "matrix"]


def test_a_worker_the_daemon_refuses_after_its_probe_goes_on_in_a_fresh_process(tmp_path, monkeypatch):
    import harness.sweep_worker as sw

    monkeypatch.setenv(PIPE, str(tmp_path))
    (tmp_path / "control").touch()
    monkeypatch.setattr(sw, "await_mps_daemon", lambda emit: True)
    monkeypatch.setattr(sw, "cuda_usable", lambda: False)
    task = {"device": "cuda", "profile": "ci", "events": str(tmp_path / "events.jsonl"), "parent": None, "units": []}
    assert sw.run_task(task) == sw.EXIT_CONTEXT_POISONED
    assert '"event": "mps-refused"' in (tmp_path / "events.jsonl").read_text()


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
