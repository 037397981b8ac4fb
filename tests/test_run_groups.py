"""``harness run`` searches groups of rows that share their batches, in this process or in worker processes; either
way a seed draws the same cases, each row is reported on its own, and the run says how long it expects to take."""

from __future__ import annotations

import json
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
