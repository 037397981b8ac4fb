"""``harness run`` survives crashes and hangs as the sweep does, and a failing run ends fast.

A row whose process segfaults or hangs becomes a finding whose case file is the pending case it was running;
the rows after it still run, and the exit status is 1. Shrinking a failure has a time budget, and the first
failing example's case file is written before shrinking starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from batch.spec import ForwardMode
from backends.registry import parse
from properties import PROPERTIES, Property
from properties.verdict import Verdict
from search.casefile import CaseFile
from search.matrix import Row
from search.profiles import PROFILES
from search.search_row import search_row

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_a_segfaulting_row_is_a_finding_and_the_run_goes_on(tmp_path):
    # decode rows crash (SIGSEGV) once a batch spans more than two pages; idle rows never do, and come after.
    out = run_cli("run", "--device", "cpu", "--mutant", "decode_segfault_past_page_table", "--backends",
                  "torch_native", "--isolate", "--properties", "outputs", "--modes", "decode", "idle",
                  "--max-examples", "25", "--out", str(tmp_path), "--db", str(tmp_path / "db"))
    assert out.returncode == 1, out.stdout + out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    status = {r["row"]: r["status"] for r in report["rows"]}
    assert status == {"torch_native-decode-outputs": "crashed", "torch_native-idle-outputs": "passed",
                      "tbo(torch_native)-decode-outputs": "crashed", "tbo(torch_native)-idle-outputs": "passed"}
    crashed = next(r for r in report["rows"] if r["row"] == "torch_native-decode-outputs")
    assert "SIGSEGV" in crashed["failure"] and "forward_decode" in crashed["failure"]
    case = CaseFile.read(crashed["case_file"])  # the pending case it was running, now its case file
    assert case.composition == "torch_native" and case.spec.mode == ForwardMode.DECODE
    assert "SIGSEGV" in case.verdict["reason"]
    assert f"reproduce: python -m harness repro {crashed['case_file']}" in out.stdout
    for row in ("torch_native-idle-outputs", "tbo(torch_native)-idle-outputs"):  # the other group still ran
        assert re.search(rf"^\[\d/4\] {re.escape(row)} \.\.\. ok \(25 cases", out.stdout, re.M), out.stdout
    assert not list((tmp_path / "pending").glob("*.json"))
    assert "2 passed, 2 failed" in out.stdout


def test_a_hanging_row_is_a_finding_after_the_case_timeout(tmp_path):
    start = time.monotonic()
    out = run_cli("run", "--device", "cpu", "--mutant", "extend_hangs_past_two_pages", "--backends",
                  "torch_native", "--properties", "outputs", "--modes", "extend", "idle", "--max-examples", "25",
                  "--case-timeout", "5", "--out", str(tmp_path), "--db", str(tmp_path / "db"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - start < 300
    report = json.loads((tmp_path / "report.json").read_text())
    status = {r["row"]: r["status"] for r in report["rows"]}
    # The mutant crashes its process, so its run is isolated without --isolate.
    assert status["torch_native-extend-outputs"] == "hung" and status["torch_native-idle-outputs"] == "passed"
    hung = next(r for r in report["rows"] if r["row"] == "torch_native-extend-outputs")
    assert "no progress" in hung["failure"] and CaseFile.read(hung["case_file"]).spec.mode == ForwardMode.EXTEND


def _slow_failing_row(calls: list, out_dir: Path, delay: float) -> Row:
    """A row whose property fails on any batch of two or more tokens, slowly (so shrinking takes long), and
    records, on each call after the first failure, whether a case file is already there."""
    base = PROPERTIES["outputs"]

    def check(composition, spec, device):
        calls.append((spec, any((out_dir / "cases").glob("*.json"))))
        time.sleep(delay)
        ok = spec.num_tokens < 2
        return Verdict("slow", ok, "ok" if ok else "too many tokens", 1.0, 0.5, "request 0, token 1, head 0")

    prop = Property("slow", check, "fails on two or more tokens", modes=base.modes)
    return Row(parse("torch_native"), ForwardMode.EXTEND, prop)


def test_shrinking_stops_after_its_budget_and_the_first_failure_is_written_before(tmp_path):
    profile = PROFILES["ci"]
    calls: list = []
    row = _slow_failing_row(calls, tmp_path, 0.3)
    start = time.monotonic()
    result = search_row(row, profile, "cpu", max_examples=50, out_dir=tmp_path, shrink_seconds=1.0)
    elapsed = time.monotonic() - start
    assert not result.ok and result.case_file is not None
    assert result.shrink_seconds is not None and result.shrink_seconds < 3.0, result.shrink_seconds
    assert elapsed < result.first_failure_seconds + 4.0
    # Every call after the first failing one (shrink candidates, the final replay) saw its case file on disk.
    seen = [s for _, s in calls]
    first_failure = next(i for i, (spec, _) in enumerate(calls) if spec.num_tokens >= 2)
    assert not any(seen[:first_failure + 1]) and all(seen[first_failure + 1:])
    files = list((tmp_path / "cases").glob("*.json"))
    assert files == [Path(result.case_file)]  # the shrunk case replaced the first one
    assert CaseFile.read(files[0]).spec == result.spec


def test_shrink_seconds_zero_reports_the_failure_as_found(tmp_path):
    calls: list = []
    row = _slow_failing_row(calls, tmp_path, 0.0)
    result = search_row(row, PROFILES["ci"], "cpu", max_examples=50, out_dir=tmp_path, shrink_seconds=0)
    assert not result.ok and Path(result.case_file).exists()
    first_failing = next(spec for spec, _ in calls if spec.num_tokens >= 2)
    assert result.spec == first_failing  # not shrunk


def test_a_supervisor_sees_only_finished_pending_cases(tmp_path):
    # CaseFile.write renames a `.tmp-*.json` into place: a supervisor that listed it just before the rename must
    # neither stat it (it is gone) nor take it for a reproducer (it may be half written). CI once failed on the
    # FileNotFoundError of exactly that race.
    import os

    from search.casefile import modified, pending_cases
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text("{}")
    new.write_text("{}")
    os.utime(old, (1_000, 1_000))
    (tmp_path / ".tmp-abc.json").write_text("{")
    assert pending_cases(tmp_path) == [old, new]
    assert modified(tmp_path / "gone.json") is None


def test_a_known_bug_that_writes_outside_its_tensors_ends_the_rows_process(tmp_path, monkeypatch):
    # After a match of a ledger entry whose kernels corrupt memory (corrupts_process), the cases after it in the
    # same process could fail anywhere: the row stops and reports a lost process, as after a lost CUDA context.
    import dataclasses

    from search import ledger
    entry = next(e for e in ledger.known_failures() if e.corrupts_process)
    calls: list = []
    row = _slow_failing_row(calls, tmp_path, 0.0)
    monkeypatch.setattr(ledger, "match", lambda *args: entry)
    result = search_row(row, PROFILES["ci"], "cpu", max_examples=50, out_dir=tmp_path, shrink_seconds=0)
    assert result.context_poisoned and result.known == {entry.id: 1}
    assert len([spec for spec, _ in calls if spec.num_tokens >= 2]) == 1  # nothing ran after the match
    harmless = dataclasses.replace(entry, corrupts_process=False)
    monkeypatch.setattr(ledger, "match", lambda *args: harmless)
    calls.clear()
    result = search_row(row, PROFILES["ci"], "cpu", max_examples=50, out_dir=tmp_path, shrink_seconds=0)
    assert not result.context_poisoned and result.known[entry.id] > 1
