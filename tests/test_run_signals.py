"""`harness run` stopped by SIGTERM (what a CI timeout sends) or Ctrl-C writes the report of the rows that
ended and exits 130; while it runs, its output folder is refused to a second writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.procs import Terminated

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_that_surfaces_as_another_error_is_still_the_stop(sig):
    """Hypothesis, interrupted while it sets a search up, raises an AssertionError from its cleanup instead of
    the KeyboardInterrupt (CI, SIGTERM during a row's start): the run must still read it as the stop."""
    before = signal.getsignal(sig)  # SIG_IGN when the suite was started in the background by a shell without job
    with Terminated() as terminated:  # control (it ignores SIGINT for asynchronous commands), the default otherwise
        with pytest.raises(AssertionError) as raised:
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler raises before this ends
            except KeyboardInterrupt:
                raise AssertionError("state._runner is not None") from None
        assert terminated.is_stop(raised.value)
        assert signal.getsignal(sig) is signal.SIG_IGN  # a second signal while the report is written is ignored
        terminated.wrap_up()  # as run does once it has the stop: the repeats end
    assert signal.getsignal(sig) is before  # and the previous handler is back afterwards
    with Terminated() as terminated:
        assert not terminated.is_stop(AssertionError("a real bug"))  # without a signal, an error is an error


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_swallowed_stop_comes_again_until_it_is_taken(sig):
    """Python drops an exception raised in a garbage-collector callback (Hypothesis has one): a run that met its
    stop there went on to the end with status 0, so the stop repeats until the run takes it."""
    with Terminated() as terminated:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)
            except KeyboardInterrupt:
                pass  # what Python does with it in a gc callback
            time.sleep(5)  # the repeat cuts this short
        assert time.monotonic() - start < 2 * Terminated.AGAIN_S + 1
        terminated.wrap_up()
        time.sleep(2 * Terminated.AGAIN_S)  # taken: no more repeats


@pytest.mark.parametrize("sig, workers", [(signal.SIGTERM, []), (signal.SIGINT, []), (signal.SIGTERM, ["--workers", "1"])],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-workers"])
def test_a_stopped_run_reports_what_ended(sig, workers, tmp_path, capsys):
    """With workers, the stop is taken once: the supervisor's clean-up gives each worker seconds to end and reads what
    it finished (a repeated interrupt cut that short, leaving workers writing into a folder whose lock was gone:
    found by review), and no worker outlives the run."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness", "run", "--device", "cpu", "--backends", "torch_native",
           "--properties", "outputs", "cache", "--max-examples", "20", "--out", str(out), "--db", str(tmp_path / "db"),
           *workers]
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
    if workers:
        import json

        pids = [json.loads(line)["pid"] for line in (out / "workers" / "pids.jsonl").read_text().splitlines()]
        for pid in pids:  # a zombie awaiting its reaper is not running
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", f"worker {pid} lives on"


def test_the_sweep_takes_its_stop_once():
    """The sweep runs no search, and its clean-up gives each worker seconds to end after its SIGINT: a repeated
    interrupt would cut that short and leave workers running. Its Terminated does not repeat."""
    with Terminated(repeat=False) as terminated:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        start = time.monotonic()
        time.sleep(3 * Terminated.AGAIN_S)  # not interrupted
        assert time.monotonic() - start >= 3 * Terminated.AGAIN_S and terminated.stopped == signal.SIGTERM

