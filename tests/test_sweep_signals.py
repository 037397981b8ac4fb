"""A sweep stopped by SIGKILL, SIGTERM or SIGINT loses nothing: its workers die with it, what they found is on
disk and reaches findings.jsonl and the report (at once, or on --resume). One output folder has one writer.
A resume must be of the sweep that is there."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from search.casefile import CaseFile, case_name
from search.matrix import matrix_rows
from search.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ["--backends", "torch_native", "--modes", "extend", "decode", "--properties", "outputs"]
MUTANT = ["--mutant", "sm_scale_wrong"]  # fails torch_native-extend-outputs within its first cases (seed 2)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def sweep_cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "harness", "sweep", "--device", "cpu", "--profile", "ci", "--out", str(out),
            "--workers", "1", *SELECTION, *MUTANT, *args]


def wait_for(what, timeout: float, proc=None, why: str = ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {why}" + (f" (the sweep exited {proc.returncode})" if proc else ""))


def events(out: Path, name: str, **match) -> list[dict]:
    return [e for p in (out / "workers").glob("*.events.jsonl") for e in jsonl(p)
            if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died (nobody reaped it yet)
    except FileNotFoundError:
        return False


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="checks worker processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_sweep_loses_nothing(sig, tmp_path, capsys):
    out = tmp_path / "sweep"
    log = open(tmp_path / "sweep.out", "w")
    proc = subprocess.Popen(sweep_cmd(out, "--budget", "300s", "--seed", "2"), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        # Freeze the sweep once its worker searches the failing row: the worker goes on and finds the failure,
        # which the sweep has not read when the signal comes.
        wait_for(lambda: [e for e in events(out, "start") if "torch_native-extend-outputs" in e["rows"]], 180, proc,
                 "the worker's start")
        os.kill(proc.pid, signal.SIGSTOP)
        done = wait_for(lambda: events(out, "done", row="torch_native-extend-outputs"), 180, None, "the row's end")
        assert not done[0]["result"]["ok"], done
        pids = [p["pid"] for p in jsonl(out / "workers" / "pids.jsonl")]
        assert pids and all(alive(p) for p in pids)

        # One folder, one writer: a second sweep on it is refused, naming the holder.
        assert main(["sweep", "--device", "cpu", "--profile", "ci", "--out", str(out), *SELECTION,
                     "--budget", "10s"]) == 2
        err = one_line_error(capsys)
        assert f"is in use by pid {proc.pid} (" in err and "harness sweep" in err and "started 20" in err

        os.kill(proc.pid, sig)
        os.kill(proc.pid, signal.SIGCONT)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    output = (tmp_path / "sweep.out").read_text()
    wait_for(lambda: not any(alive(p) for p in pids), 10, None, f"the workers {pids} to die")  # none outlives it
    assert any(p.is_file() for p in (out / "examples").rglob("*")), "the failure was not saved in OUT/examples"

    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    else:  # stopped as by Ctrl-C: workers stopped, what they finished recorded, the report and the summary
        assert rc == 130, output
        assert "sweep: 4 rows" in output and "FINDING (failure) torch_native-extend-outputs" in output, output
        assert [f["row"] for f in jsonl(out / "findings.jsonl")].count("torch_native-extend-outputs") == 1
        assert "torch_native-extend-outputs" in (out / "report.md").read_text()

    # The lock died with its holder; --resume sees the finding (adopting it after a SIGKILL), once.
    again = subprocess.run(sweep_cmd(out, "--budget", "2s", "--resume"), cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 1, again.stdout + again.stderr
    # The resumed sweep may go on to find the mutant in the decode row as well; the stopped one's finding is
    # recorded exactly once either way.
    findings = [f for f in jsonl(out / "findings.jsonl") if f["row"] == "torch_native-extend-outputs"]
    assert len(findings) == 1, jsonl(out / "findings.jsonl")
    assert Path(findings[0]["case_file"]).exists()
    assert "FINDING (failure) torch_native-extend-outputs" in again.stdout
    assert "torch_native-extend-outputs" in (out / "report.md").read_text()
    results = [(r["row"], r["round"]) for r in jsonl(out / "results.jsonl")]
    assert results.count(("torch_native-extend-outputs", 0)) == 1
    if sig == signal.SIGKILL:
        assert "adopted" in again.stderr and findings[0].get("adopted")


def fake_failure(out: Path):
    """Run a real search of torch_native-extend-outputs (a stand-in property that fails on 3 tokens or more) into
    ``out``: its case file under cases/, and its result as a worker's ``done`` event reports it."""
    from search.search_row import search_row
    from tests.test_example_db import FailsOnThreeTokens, row_with

    result = search_row(row_with(FailsOnThreeTokens()), PROFILES["ci"], "cpu", max_examples=50, out_dir=out, seed=3)
    assert not result.ok and Path(result.case_file).exists()
    return result


def old_sweep_json(out: Path, **extra) -> None:
    created = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"seed": 1, "profile": "ci", "device": "cpu",
                                                "created": created.isoformat(timespec="seconds"), **extra}))


def test_resume_adopts_what_workers_wrote_and_counts_only_its_own_cases(tmp_path, capsys):
    """A sweep killed before it read its worker's ``done`` event, and one whose worker was killed between writing
    a case file and reporting it: --resume records both findings. Its cases/s counts this session's cases only
    (none here), not the earlier sessions' (review bug 12)."""
    out = tmp_path
    old_sweep_json(out)  # written by a sweep before sweep.json recorded the mutant and the rows: still resumable
    rows = [r.id for r in matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["extend"])[0]]
    assert rows == ["torch_native-extend-outputs", "tbo(torch_native)-extend-outputs"]
    result = fake_failure(out)
    (out / "workers").mkdir()
    (out / "workers" / "s-001--torch_native--r0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "ready"}, {"event": "start", "row": rows[0], "round": 0},
        {"event": "done", "row": rows[0], "round": 0, "result": result.record()}]))
    case = CaseFile.read(result.case_file)
    case.composition = "tbo(torch_native)"
    orphan = case.write(out / "cases" / case_name(case.composition, case.property, "extend", case.spec))
    (out / "results.jsonl").write_text(json.dumps({"row": rows[1], "round": 0, "ok": True, "cases": 100000,
                                                   "seconds": 10.0, "worst_error": None, "bound": None}) + "\n")

    rc = main(["sweep", "--device", "cpu", "--profile", "ci", "--out", str(out), "--resume", "--rounds", "1",
               "--budget", "60s", "--backends", "torch_native", "--modes", "extend", "--properties", "outputs"])
    captured = capsys.readouterr()
    assert rc == 1, captured.out + captured.err
    findings = {f["row"]: f for f in jsonl(out / "findings.jsonl")}
    assert set(findings) == set(rows)
    assert Path(findings[rows[0]]["case_file"]).name == Path(result.case_file).name
    assert Path(findings[rows[1]]["case_file"]).name == orphan.name
    assert "too many tokens" in findings[rows[1]]["reason"]
    assert [(r["row"], r["round"]) for r in jsonl(out / "results.jsonl")] == [(rows[1], 0), (rows[0], 0)]
    report = (out / "report.md").read_text()
    assert rows[0] in report and rows[1] in report
    assert "(0 this session)" in captured.out and "(0.0 cases/s)" in captured.out, captured.out

    # Adopted once: a second resume finds nothing new.
    assert main(["sweep", "--device", "cpu", "--profile", "ci", "--out", str(out), "--resume", "--rounds", "1",
                 "--budget", "60s", "--backends", "torch_native", "--modes", "extend", "--properties", "outputs"]) == 1
    assert len(jsonl(out / "findings.jsonl")) == 2 and len(jsonl(out / "results.jsonl")) == 2


def test_a_new_sweep_does_not_adopt_an_older_sweeps_files(tmp_path, capsys):
    """Case files and worker events left by a sweep that was moved aside (older than this sweep) are not this
    sweep's findings."""
    out = tmp_path
    fake_failure(out)
    past = time.time() - 3600
    for p in (out / "cases").glob("*.json"):
        os.utime(p, (past, past))
    rc = main(["sweep", "--device", "cpu", "--profile", "ci", "--out", str(out), "--rounds", "1", "--budget", "1s",
               "--backends", "torch_native", "--modes", "extend", "--properties", "outputs"])
    capsys.readouterr()
    assert rc == 0 and jsonl(out / "findings.jsonl") == []


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_resume_with_nothing_to_resume_says_so(make, tmp_path, capsys):
    out = tmp_path / "out"
    if make == "empty":
        out.mkdir()
    assert main(["sweep", "--device", "cpu", "--profile", "ci", "--resume", "--budget", "10s", "--out", str(out),
                 "--backends", "torch_native"]) == 2
    assert "holds no sweep to resume" in one_line_error(capsys)
    assert out.exists() == (make == "empty")  # nothing created


def test_resume_checks_the_mutant_and_the_rows(tmp_path, capsys):
    rows = [r.id for r in matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["extend", "decode"])[0]]
    old_sweep_json(tmp_path, mutant="sm_scale_wrong", rows=rows, started=time.time(),
                   selection={"backends": ["torch_native"], "properties": ["outputs"], "modes": ["extend", "decode"],
                              "shard": None})
    base = ["sweep", "--device", "cpu", "--profile", "ci", "--resume", "--budget", "10s", "--out", str(tmp_path)]
    assert main([*base, *SELECTION]) == 2
    assert "holds a sweep with mutant sm_scale_wrong; pass --mutant sm_scale_wrong" in one_line_error(capsys)
    assert main([*base, *SELECTION, "--mutant", "kv_written_one_slot_off"]) == 2
    assert "with mutant sm_scale_wrong" in one_line_error(capsys)
    assert main([*base, "--backends", "torch_native", "--properties", "outputs", *MUTANT]) == 2
    err = one_line_error(capsys)
    assert "holds a sweep of other rows" in err and "--backends torch_native --properties outputs --modes extend " \
                                                    "decode" in err
    old_sweep_json(tmp_path, mutant=None, rows=rows)
    assert main([*base, *SELECTION, *MUTANT]) == 2
    assert "holds a sweep without a mutant; drop --mutant" in one_line_error(capsys)


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path, capsys):
    hold = ("import sys, time; from harness.outlock import OutFolderLock; "
            "OutFolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["sweep", "--device", "cpu", "--profile", "ci", "--budget", "10s", "--out", str(tmp_path),
                     "--backends", "torch_native"]) == 2
        err = one_line_error(capsys)
        assert f"--out {tmp_path} is in use by pid {holder.pid} (`python" in err and "time.sleep" in err
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; the kernel drops the lock
        holder.wait()
    from harness.outlock import OutFolderLock

    with OutFolderLock(tmp_path):
        pass


def test_a_case_written_after_the_stop_signal_is_set_aside_not_adopted(tmp_path):
    """A worker's case that failed after the sweep told it to stop may have failed of the stop: numpy turns a
    KeyboardInterrupt raised in an interpreted kernel's __index__ into "TypeError: expected a sequence of
    integers", which a CPU campaign adopted as a finding. Such a file is kept aside, not adopted; one written
    before the stop still is."""
    from harness.sweep import RowState, Sweep

    out = tmp_path
    result = fake_failure(out)
    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], ["outputs"], ["extend"])[0]
    case = CaseFile.read(result.case_file)
    Path(result.case_file).unlink()
    case.composition = "tbo(torch_native)"
    late = case.write(out / "cases" / case_name(case.composition, case.property, "extend", case.spec))

    class Quiet:
        def event(self, text):
            self.text = text

    def sweep(stop_sent):
        s = Sweep([RowState(r) for r in rows], "cpu", "ci", out, time.time() + 60, 1, None, 1, None, None, None,
                  None, Quiet())
        s.stop_sent = stop_sent
        return s

    since = time.time() - 60
    s = sweep(time.time() - 1)  # the file was written after the stop
    assert s.adopt_orphans(since) == 0 and not late.exists() and (out / "interrupted" / late.name).exists()
    assert "after its worker was told to stop" in s.progress.text
    (out / "interrupted" / late.name).replace(late)
    assert sweep(None).adopt_orphans(since) == 1  # no stop sent: adopted as before
    assert [f["row"] for f in jsonl(out / "findings.jsonl")] == ["tbo(torch_native)-extend-outputs"]
