"""compiler_running: a compiler under a process is seen, through a shell; one that is not a compiler is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness.procs import compiler_running

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


def _spawn_named(tmp_path, name: str) -> subprocess.Popen:
    """A shell running ``sleep`` under another name (the process takes the name it was started by)."""
    tool = tmp_path / name
    tool.symlink_to(subprocess.check_output(["sh", "-c", "command -v sleep"], text=True).strip())
    proc = subprocess.Popen(["sh", "-c", f"'{tool}' 30; true"])
    for _ in range(100):  # until the shell has started it
        out = subprocess.run(["sh", "-c", f"cat /proc/[0-9]*/comm 2>/dev/null | grep -cx '{name}'"],
                             capture_output=True, text=True).stdout.strip()
        if out not in ("", "0"):
            break
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("name, expected", [("ninja", True), ("cc1plus", True), ("sleepy", False)])
def test_sees_a_compiler_below_a_process(tmp_path, name, expected):
    proc = _spawn_named(tmp_path, name)
    try:
        assert compiler_running([os.getpid()]) is expected
        assert compiler_running([proc.pid]) is expected
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
        proc.kill()
        proc.wait()
    for _ in range(100):  # the killed one may linger a moment before it is reaped
        if not compiler_running([os.getpid()]):
            break
        time.sleep(0.05)
    assert not compiler_running([os.getpid()])


def test_no_roots_no_compiler():
    assert compiler_running([]) is False
    assert compiler_running([sys.maxsize]) is False


def test_a_compiler_of_this_user_elsewhere_counts_machine_wide(tmp_path):
    # A case blocked on a lock that another sweep's build holds (Inductor's ISA check, FlashInfer's builds) has no
    # compiler below it; machine-wide, any compiler of this user stops its clock (harness/procs.py).
    proc = _spawn_named(tmp_path, "cc1plus")
    try:
        assert compiler_running([sys.maxsize]) is False
        assert compiler_running([sys.maxsize], machine_wide=True) is True
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
        proc.kill()
        proc.wait()
