"""harness/mps.py: the MPS daemon the benchmark's workers can share, driven through a stand-in control program."""

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
