"""`harness run` stopped by SIGTERM (what a CI timeout sends) or Ctrl-C writes the report of the rows that
ended and exits 130; while it runs, its output folder is refused to a second writer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_run_reports_what_ended(sig, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness", "run", "--device", "cpu", "--backends", "torch_native",
           "--properties", "outputs", "cache", "--max-examples", "200", "--out", str(out), "--db", str(tmp_path / "db")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (out / "report.json").exists():  # written when the first row ends
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its first row"
            time.sleep(0.2)
        assert main(["run", "--device", "cpu", "--backends", "torch_native", "--out", str(out)]) == 2
        assert "is in use by pid" in capsys.readouterr().err
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert "interrupted after" in output and "passed," in output, output
    assert (out / "report.md").exists() and "torch_native" in (out / "report.md").read_text()
    assert "@seed" not in output  # Hypothesis's "reproduce this failure" note would mislead after a stop
