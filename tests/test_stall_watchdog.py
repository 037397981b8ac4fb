"""A row that makes no progress says so every --stall-seconds: in one line while a JIT compiler runs under the
process (a cold FlashInfer build takes minutes; a stack wall there only hides what is happening), else with every
thread's stack (a hang is never silent)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from harness.procs import StallWatchdog, compilers_under


def watched(tmp_path, seconds: float, during, progress=None) -> str:
    log = tmp_path / "stderr.txt"
    with open(log, "w") as f:
        dog = StallWatchdog(seconds, file=f)
        dog.start("torch_native-decode-outputs", progress=progress)
        during()
        dog.stop()
        time.sleep(2 * seconds)  # stopped: nothing more is written
        f.flush()
        size = log.stat().st_size
        time.sleep(2 * seconds)
    assert log.stat().st_size == size
    return log.read_text()


def test_a_stall_without_a_compiler_dumps_every_threads_stack(tmp_path):
    text = watched(tmp_path, 0.2, lambda: time.sleep(0.5))
    assert "torch_native-decode-outputs: no progress for" in text
    assert "Thread" in text and "File " in text  # faulthandler's dump


def test_a_compile_in_progress_is_one_line_naming_the_compiler(tmp_path):
    sleep = shutil.which("sleep")
    if sleep is None:
        pytest.skip("no sleep(1) to stand in for a compiler")
    ninja = tmp_path / "ninja"  # a process whose name is a compiler's, as FlashInfer's build runs one
    shutil.copy(sleep, ninja)
    proc = subprocess.Popen([str(ninja), "5"])
    try:
        time.sleep(0.1)
        if "ninja" not in compilers_under(os.getpid()):
            pytest.skip("no /proc to see child processes in")
        text = watched(tmp_path, 0.2, lambda: time.sleep(0.5))
    finally:
        proc.kill()
        proc.wait()
    assert "torch_native-decode-outputs: still compiling kernels after" in text and "(ninja running)" in text
    assert "File " not in text  # no stack wall


def test_a_row_that_ends_in_time_says_nothing(tmp_path):
    assert watched(tmp_path, 1.0, lambda: time.sleep(0.1)) == ""


def test_a_group_whose_cases_go_on_says_nothing_and_one_that_stops_is_reported(tmp_path):
    # `harness run` watches a group of rows: a long group is not stalled while its pending case file (rewritten
    # before each case) keeps changing; once it stops changing, the stall is reported as before.
    pending = tmp_path / "pending.json"
    pending.write_text("0")

    def cases(n: int) -> None:
        for i in range(n):
            time.sleep(0.1)
            pending.write_text(str(i))
            os.utime(pending, (time.time(), time.time()))  # a new mtime even on a coarse clock

    assert watched(tmp_path, 0.4, lambda: cases(20), progress=pending) == ""
    text = watched(tmp_path, 0.4, lambda: (cases(5), time.sleep(1.2)), progress=pending)
    assert "torch_native-decode-outputs: no progress for" in text


def test_a_closed_watchdog_ends_its_thread_and_a_bad_file_does_not_kill_it(tmp_path):
    import io

    dog = StallWatchdog(0.1, file=io.StringIO())  # no file descriptor: faulthandler cannot dump into it
    dog.start("row")
    time.sleep(0.35)
    assert dog._thread.is_alive()  # it reported the failure to report, and watches on
    dog.close()
    assert not dog._thread.is_alive()
