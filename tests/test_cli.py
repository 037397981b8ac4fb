"""The command line: bad input gives one line and exit 2; a failure gives a case file that replays."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batch.spec import BatchSpec, ForwardMode, MHALayer
from harness.cli import main
from search.casefile import CASE_SCHEMA_VERSION, CaseFile

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("args, message", [
    (["run", "--backends", "nosuch"], "unknown backend 'nosuch'"),
    (["run", "--profile", "fast"], "unknown profile 'fast'"),
    (["list", "--backends", "hybrid(torch_native)"], "hybrid() takes 2 argument(s)"),
    (["mutants", "--only", "nosuch"], "unknown mutant(s) nosuch"),
    (["run", "--mutant", "nosuch"], "unknown mutant 'nosuch'"),
    (["repro", "docs/findings/cases/sglang-cutedsl-mla-draft-steps-read-committed-prefix.json", "--mutant", "nosuch"],
     "unknown mutant 'nosuch'"),
    (["run", "--shrink-seconds", "-1"], "--shrink-seconds must be >= 0"),
    (["run", "--case-timeout", "0"], "--case-timeout must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_malformed_case_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for text, message in [("{", "invalid JSON"), ('{"case_schema_version": 7}', "case_schema_version 7"),
                          ('{"case_schema_version": 1}', "case_schema_version 1"),
                          (f'{{"case_schema_version": {CASE_SCHEMA_VERSION}, "composition": "torch_native"}}',
                           "missing field")]:
        bad.write_text(text)
        assert main(["repro", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
    assert main(["repro", str(tmp_path / "missing.json")]) == 2
    assert "cannot read case file" in capsys.readouterr().err


def test_case_for_an_unavailable_backend_says_why(tmp_path, capsys):
    spec = BatchSpec(ForwardMode.DECODE, (3,), (1,), (MHALayer(0, 8, 2, 128, 128),), dtype="bfloat16")
    path = CaseFile("flashinfer", "outputs", spec, "cuda", "gpu").write(tmp_path / "gpu.json")
    code = main(["repro", str(path), "--device", "cpu"])
    assert code == 2
    assert "cannot replay flashinfer here" in capsys.readouterr().err


def test_list_shows_available_and_unavailable_with_reasons(capfd):
    assert main(["list", "--device", "cpu"]) == 0
    out = capfd.readouterr().out
    assert "torch_native" in out and "available" in out
    assert "tbo(hybrid(torch_native,linear_torch))" in out
    assert "unavailable:" in out  # the GPU backends, with their reason


def test_failure_writes_a_case_file_that_replays(tmp_path, capfd):
    # The command line itself, once in its own process; the faulted run and the replays call main() in this one
    # (capfd: the run's stall watchdog writes to stderr's file descriptor).
    out = run_cli("run", "--device", "cpu", "--backends", "torch_native", "--properties", "outputs",
                  "--modes", "decode", "--out", str(tmp_path), "--db", str(tmp_path / "db"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b[1-9]\d* passed, 0 failed", out.stdout), out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows"][0]["ok"] and report["rows"][0]["cases"] > 0

    # The same run with a fault injected fails and leaves a small, replayable case behind. Shrinking gets a
    # minute, not the profile's 10 s: on a GPU host's loaded pytest (16 workers compiling kernels) 10 s left a
    # two-request case (harness-out/gpu61.sh); on a 2-core CPU the whole test takes about 5 s.
    from harness.mutants.catalogue import MUTANTS

    fault = MUTANTS["gqa_modulo_mapping"]
    with fault.patch():
        code = main(["run", "--device", "cpu", "--backends", "torch_native", "--properties", "outputs",
                     "--modes", "decode", "--shrink-seconds", "60", "--out", str(tmp_path / "f"),
                     "--db", str(tmp_path / "db2")])
    printed = capfd.readouterr().out
    assert code == 1, printed
    cases = list((tmp_path / "f" / "cases").glob("torch_native-*.json"))  # tbo(torch_native) fails too
    assert len(cases) == 1 and f"python -m harness repro {cases[0]}" in printed
    case = CaseFile.read(cases[0])
    assert case.spec.batch_size == 1 and case.spec.num_tokens == 1  # shrunk to the smallest batch
    assert not list((tmp_path / "f" / "pending").glob("*.json"))
    assert main(["repro", str(cases[0])]) == 0  # without the fault, the case passes
    assert "verdict:     outputs: ok" in capfd.readouterr().out
    with fault.patch():
        assert main(["repro", str(cases[0]), "--dump", str(tmp_path / "dump")]) == 1
    printed = capfd.readouterr().out
    assert "request 0, token 0, head" in printed and "out of bounds" in printed
    assert (tmp_path / "dump" / "tensors.pt").exists()
    # --mutant injects it for the replay, as a sweep's worker replays a case alone under its own mutant
    assert main(["repro", str(cases[0]), "--mutant", "gqa_modulo_mapping"]) == 1
    assert "out of bounds" in capfd.readouterr().out


def test_a_seeded_run_draws_the_same_cases_every_time(tmp_path):
    # What CI's older-release step relies on: the same seed and an empty example database give the same cases.
    worst = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        assert main(["run", "--device", "cpu", "--backends", "torch_native", "--properties", "outputs",
                     "--modes", "decode", "extend", "--max-examples", "3", "--seed", "7",
                     "--db", str(tmp_path / f"db{i}"), "--out", str(out)]) == 0
        rows = json.loads((out / "report.json").read_text())["rows"]
        worst.append({r["row"]: (r["cases"], r["worst_error"]) for r in rows})
    assert worst[0] == worst[1] and len(worst[0]) >= 2


@pytest.mark.skipif(__import__("backends.sglang.runtime", fromlist=["x"]).unavailable_reason() is not None,
                    reason="needs SGLang")
def test_repro_names_the_ledger_entry_a_case_fails_as_and_known_passes_says_so_in_its_status():
    """A sweep replays a case alone to ask whether it has a bug no ledger entry explains: ``--known-passes``."""
    case = "docs/findings/cases/sglang-flex-ignores-logit-cap.json"
    out = run_cli("repro", case)
    assert out.returncode == 1, out.stdout + out.stderr  # it fails: a user replaying it sees the failure
    assert "known:       sglang-flex-ignores-logit-cap" in out.stdout
    out = run_cli("repro", case, "--known-passes")
    assert out.returncode == 0, out.stdout + out.stderr
