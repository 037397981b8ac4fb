"""``harness run`` searches groups of rows that share their batches, in this process or in worker processes; either
way a seed draws the same cases, each row is reported on its own, and the run says how long it expects to take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.cli import main
from harness.sweep_worker import FIRST_ROUND_EXAMPLES
from search.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]
# No --max-examples: each row's is the profile's (a sweep's first round has fewer: a run must not)
SELECTION = ["--device", "cpu", "--backends", "torch_native", "--properties", "outputs", "--modes", "decode",
             "extend", "--seed", "11"]
EXAMPLES = PROFILES["ci"].max_examples


def rows_of(out: Path) -> dict:
    return {r["row"]: (r["status"], r["cases"], r["worst_error"])
            for r in json.loads((out / "report.json").read_text())["rows"]}


def test_workers_check_the_cases_this_process_checks(tmp_path, capsys):
    assert main(["run", *SELECTION, "--out", str(tmp_path / "here"), "--db", str(tmp_path / "db1")]) == 0
    here = capsys.readouterr().out
    assert "in this process, seed 11" in here
    out = subprocess.run([sys.executable, "-m", "harness", "run", *SELECTION, "--workers", "2", "--out",
                          str(tmp_path / "workers"), "--db", str(tmp_path / "db2")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "in 2 worker process(es), seed 11" in out.stdout
    in_process, in_workers = rows_of(tmp_path / "here"), rows_of(tmp_path / "workers")
    assert len(in_process) == 4 and in_process == in_workers  # the same cases, the same worst errors
    assert EXAMPLES != FIRST_ROUND_EXAMPLES
    assert all(status == "passed" and cases == EXAMPLES for status, cases, _ in in_process.values())
    for row in in_process:  # each row has its own line, in the order rows end
        assert f"] {row} ... ok ({EXAMPLES} cases" in out.stdout
    report = json.loads((tmp_path / "workers" / "report.json").read_text())
    assert report["run"]["workers"] == 2 and report["run"]["seed"] == 11


def test_a_run_estimates_its_time_from_the_last_run_in_its_folder(tmp_path, capsys):
    out = ["--out", str(tmp_path), "--db", str(tmp_path / "db")]
    assert main(["run", *SELECTION, *out]) == 0
    assert f"no finished run in {tmp_path} to estimate from" in capsys.readouterr().out
    assert main(["run", *SELECTION, *out]) == 0
    printed = capsys.readouterr().out
    assert "expected about" in printed and "the last run here checked 4 rows in" in printed
    assert "with this process" in printed


def test_a_run_in_workers_refuses_a_sweeps_folder(tmp_path, capsys):
    (tmp_path / "sweep.json").write_text("{}")
    assert main(["run", *SELECTION, "--workers", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds a sweep" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "sweep.json").read_text() == "{}"


BREAK_DECODE_GROUPS = '''
import os
if os.environ.get("HARNESS_TEST_BREAK_DECODE_GROUPS"):
    import search.group as g
    strategy = g.Group.strategy

    def broken(self):
        if "decode" in self.id:
            raise RuntimeError("injected: the group search broke")
        return strategy(self)

    g.Group.strategy = broken
'''


def check_broken_decode_groups(out: Path, printed: str) -> None:
    rows = {r["row"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert len(rows) == 4 and (out / "report.md").exists() and (out / "junit.xml").exists()
    for name, r in rows.items():
        if "decode" in name:
            assert r["status"] == "adapter error" and "injected: the group search broke" in r["failure"], r
            assert f"] {name} ... FAILED" in printed
        else:
            assert r["status"] == "passed", r
    assert len(set(rows)) == 4 and printed.count(" ... ") == 4  # one line a row, none twice


def test_a_harness_error_in_a_group_is_its_rows_adapter_error_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """The harness's own code raising out of a group's search is an adapter error of the rows it left unsearched (exit
    status 3, never a finding of the engine's), the other groups still run, and every report is written (found by
    review: in this process it was a traceback, exit 1, and no report.md; in workers, exit 1 and rows 'not run')."""
    args = ["run", "--device", "cpu", "--backends", "torch_native", "--properties", "outputs", "--modes", "decode",
            "idle", "--seed", "3"]
    monkeypatch.setenv("HARNESS_TEST_BREAK_DECODE_GROUPS", "1")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BREAK_DECODE_GROUPS)
    import search.group
    strategy = search.group.Group.strategy
    try:
        exec(BREAK_DECODE_GROUPS, {})  # this process, as the sitecustomize patches the workers
        assert main([*args, "--out", str(tmp_path / "here"), "--db", str(tmp_path / "db1")]) == 3
    finally:
        search.group.Group.strategy = strategy
    captured = capsys.readouterr()
    check_broken_decode_groups(tmp_path / "here", captured.out)
    assert "Traceback" not in captured.err and (tmp_path / "here" / "logs" / "harness-errors.log").exists()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "harness", *args, "--workers", "1", "--out", str(tmp_path / "w"),
                          "--db", str(tmp_path / "db2")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 3, out.stdout + out.stderr
    check_broken_decode_groups(tmp_path / "w", out.stdout)


def test_a_budgeted_run_reaches_every_row_before_searching_any_in_full(tmp_path):
    # Two rounds in workers: each row's first examples, then its own; with time to spare both end
    out = subprocess.run([sys.executable, "-m", "harness", "run", *SELECTION, "--budget", "10m", "--out",
                          str(tmp_path / "ample"), "--db", str(tmp_path / "db1")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"within 10m00s (each row's first {FIRST_ROUND_EXAMPLES} examples first)" in out.stdout
    assert "budget 10m00s: 4 row(s) searched in full or with a finding, 0 with their first examples only, 0 not reached" \
        in out.stdout
    rows = rows_of(tmp_path / "ample")
    assert all(status == "passed" and cases == FIRST_ROUND_EXAMPLES + EXAMPLES for status, cases, _ in rows.values())
    assert json.loads((tmp_path / "ample" / "report.json").read_text())["run"]["budget_s"] == 600
    # Its report estimates the next run there; a budget shorter than the estimate is what the run expects
    again = subprocess.run([sys.executable, "-m", "harness", "run", *SELECTION, "--budget", "0.1s", "--out",
                            str(tmp_path / "ample"), "--db", str(tmp_path / "db1")], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert "its budget: the last run here checked 4 rows in" in again.stdout, again.stdout
    # A budget that ends before any worker has started: nothing reached, said so, and no failure
    out = subprocess.run([sys.executable, "-m", "harness", "run", *SELECTION, "--budget", "0.1s", "--out",
                          str(tmp_path / "none"), "--db", str(tmp_path / "db2")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 with their first examples only, 4 not reached" in out.stdout
    assert {status for status, *_ in rows_of(tmp_path / "none").values()} == {"not run"}


def test_a_bad_budget_is_one_line(capsys):
    assert main(["run", *SELECTION, "--budget", "soon"]) == 2
    err = capsys.readouterr().err
    assert "--budget 'soon' is not a duration" in err and "Traceback" not in err


def test_a_row_the_budget_cuts_short_ends_with_the_cases_it_ran(tmp_path):
    # Round 0 (3 examples a row) fits the budget a few times over; round 1 (5000 a row) cannot: every row ends as
    # passed with its first round's cases, and the run says so
    decode = ["--device", "cpu", "--backends", "torch_native", "--properties", "outputs", "--modes", "decode",
              "--seed", "11"]
    out = subprocess.run([sys.executable, "-m", "harness", "run", *decode, "--max-examples", "5000", "--budget", "15s",
                          "--out", str(tmp_path), "--db", str(tmp_path / "db")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "budget 15s: 0 row(s) searched in full or with a finding, 2 with their first examples only, 0 not reached" \
        in out.stdout, out.stdout
    assert {row: (status, cases) for row, (status, cases, _) in rows_of(tmp_path).items()} == {
        row: ("passed", FIRST_ROUND_EXAMPLES) for row in rows_of(tmp_path)}
    # A run the budget cut short says nothing of how long the whole would take
    again = subprocess.run([sys.executable, "-m", "harness", "run", *decode, "--budget", "0.1s", "--out",
                            str(tmp_path), "--db", str(tmp_path / "db")], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert "ended with its budget before its last row: no estimate" in again.stdout, again.stdout


BREAK_DECODE_SECOND_ROUND = '''
import os
marker = os.environ.get("HARNESS_TEST_BREAK_DECODE_AFTER")
if marker:
    import search.group as g
    strategy = g.Group.strategy

    def broken(self):
        if "decode" in self.id:
            if os.path.exists(marker):
                raise RuntimeError("injected: the group search broke in its second round")
            open(marker, "w").close()
        return strategy(self)

    g.Group.strategy = broken
'''


def test_a_group_that_fails_in_a_budgeted_runs_second_round_is_not_reported_as_passed(tmp_path):
    # Its rows passed their first round; the failure between cases of the second is theirs (found by review: the
    # rows cut short by the budget were reported first, as passed with their first examples, and the group's error
    # only as a loose line)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BREAK_DECODE_SECOND_ROUND)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
               HARNESS_TEST_BREAK_DECODE_AFTER=str(tmp_path / "marker"))
    out = subprocess.run([sys.executable, "-m", "harness", "run", *SELECTION, "--budget", "10m", "--out",
                          str(tmp_path / "out"), "--db", str(tmp_path / "db")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 3, out.stdout + out.stderr
    rows = {r["row"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["rows"]}
    for name, r in rows.items():
        if "decode" in name:
            assert r["status"] == "adapter error" and "second round" in r["failure"], r
        else:
            assert r["status"] == "passed" and r["cases"] == FIRST_ROUND_EXAMPLES + EXAMPLES, r
