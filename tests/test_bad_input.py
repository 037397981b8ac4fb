"""Every bad input gives one line on stderr (``error: ...``) and exit status 2, never a traceback
(the "Bad inputs" table of the reliability review). Most checks run ``main`` in-process; the few that must
happen before torch is imported run ``python -m harness`` in a fresh interpreter and check that torch was
never loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import search.casefile
from batch.spec import BatchSpec, ForwardMode, LightningLayer, MHALayer, SpecInput
from harness.cli import main
from harness.options import UsageError, parse_budget
from search.casefile import CaseFile, estimated_bytes

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_without_torch(*args: str) -> subprocess.CompletedProcess:
    """``python -m harness ARGS`` in a fresh interpreter; exits 3 if torch got imported before the error."""
    script = ("import sys; from harness.cli import main; rc = main(sys.argv[1:]); "
              "sys.exit(3 if 'torch' in sys.modules else rc)")
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


# ---- run / mutants / sweep options -------------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["run", "--properties", "nosuch"], ["unknown property nosuch", "properties: outputs"]),
    (["run", "--properties", "outputs", "nosuch"], ["unknown property nosuch", "outputs"]),
    (["run", "--device", "cpu", "--backends", "flashinfer"], ["flashinfer", "needs a cuda device"]),
    (["sweep", "--device", "cpu", "--modes", "decode", "nosuch"], ["unknown mode nosuch"]),
    (["run", "--device", "cpu", "--backends", "torch_native", "--modes", "decode", "--properties", "verify_chain"],
     ["torch_native-decode-verify_chain", "needs target_verify batches"]),
])
def test_run_selection_errors_name_the_cause(args, needles, capsys):
    assert main(args) == 2
    one_error_line(capsys, *needles)


@pytest.mark.parametrize("args, needles", [
    (["run", "--modes", "nosuch"], ["unknown mode nosuch", "modes: extend, decode"]),
    (["run", "--modes", "decode", "nosuch"], ["unknown mode nosuch"]),
    (["run", "--max-examples", "0"], ["--max-examples must be >= 1, got 0"]),
    (["run", "--max-examples", "-1"], ["--max-examples must be >= 1, got -1"]),
    (["run", "--stall-seconds", "-1"], ["--stall-seconds must be positive"]),
    (["run", "--stall-seconds", "0"], ["--stall-seconds must be positive"]),
    (["mutants", "--budget", "-3"], ["--budget '-3'"]),
    (["mutants", "--budget", "0"], ["--budget '0'"]),
    (["mutants", "--budget", "10q"], ["--budget '10q'"]),
    (["run", "--device", "tpu"], ["--device must be auto, cpu or cuda, got 'tpu'"]),
    (["mutants", "--device", "tpu"], ["--device must be auto, cpu or cuda"]),
    (["run", "--profile", "nosuch"], ["unknown profile 'nosuch'"]),
    (["mutants", "--profile", "nosuch"], ["unknown profile 'nosuch'"]),
    (["run", "--profile", "gpu@x"], ["write NAME@K with K a rotation number"]),
    (["run", "--workers", "0"], ["--workers must be positive"]),
    (["warmup", "--workers", "0"], ["--workers must be positive"]),
    (["warmup", "--budget", "0"], ["--budget '0'"]),
    (["warmup", "--profile", "nosuch"], ["unknown profile 'nosuch'"]),
])
def test_bad_options_fail_before_torch_is_imported(args, needles):
    out = run_without_torch(*args)
    assert out.returncode == 2, (out.returncode, out.stderr)  # 3: torch was imported first
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def test_bad_out_folder(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["run", "--device", "cpu", "--backends", "torch_native", "--properties", "outputs", "--modes", "decode",
            "--db", str(tmp_path / "db")]
    assert main(base + ["--out", str(a_file)]) == 2
    one_error_line(capsys, "--out", "is a file, not a folder")
    assert main(base + ["--out", str(a_file / "below")]) == 2
    one_error_line(capsys, "--out", "is a file, not a folder")
    assert main(base + ["--out", "/proc/nope"]) == 2  # an unwritable place
    one_error_line(capsys, "--out /proc/nope", "cannot write there")
    assert main(["mutants", "--out", str(a_file)]) == 2
    one_error_line(capsys, "--out", "is a file, not a folder")


def test_mutants_budget_takes_the_sweeps_durations(capsys):
    assert parse_budget("90s") == 90 and parse_budget("30m") == 1800 and parse_budget("300") == 300
    assert main(["mutants", "--list", "--budget", "60s"]) == 0
    assert "gqa_modulo_mapping" in capsys.readouterr().out
    for bad in ("-3", "0", "10q"):
        with pytest.raises(UsageError):
            parse_budget(bad)


# ---- repro -------------------------------------------------------------------------------------------------

def case_dict() -> dict:
    spec = BatchSpec(ForwardMode.DECODE, (3,), (1,), (MHALayer(0, 4, 2, 32, 32),))
    return json.loads(CaseFile("torch_native", "outputs", spec, "cpu", "ci").to_json())


def write_case(tmp_path: Path, change=None, batch=None) -> Path:
    d = case_dict()
    d.update(change or {})
    d["batch"].update(batch or {})
    path = tmp_path / "case.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("change, batch, needles", [
    ({"composition": 5}, None, ["composition must be a string"]),
    ({"property": None}, None, ["property must be a string"]),
    ({"foo": 1}, None, ["unknown field(s) foo"]),
    (None, {"extend_lens": ["a"]}, ["batch.extend_lens[0] must be an integer, got 'a'"]),
    (None, {"extend_lens": 5}, ["batch.extend_lens must be a JSON list"]),
    (None, {"prefix_lens": None}, ["batch.prefix_lens must be a JSON list, got null"]),
    (None, {"context_len": "big"}, ["batch.context_len must be an integer, got 'big'"]),
    (None, {"seed": "abc"}, ["batch.seed must be an integer, got 'abc'"]),
    (None, {"extend_lens": [2.7]}, ["batch.extend_lens[0] must be an integer, got 2.7"]),
])
def test_mistyped_case_fields_are_named(tmp_path, capsys, change, batch, needles):
    path = write_case(tmp_path, change, batch)
    assert main(["repro", str(path)]) == 2
    one_error_line(capsys, str(path), *needles)


def test_case_file_that_is_not_a_case(tmp_path, capsys):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    assert main(["repro", str(binary)]) == 2
    one_error_line(capsys, "is not a case file", "not UTF-8")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert main(["repro", str(listed)]) == 2
    one_error_line(capsys, "is not a case file", "JSON list")


@pytest.mark.parametrize("batch, limit", [
    ({"mode": "extend", "prefix_lens": [0], "extend_lens": [10**9], "context_len": 2 * 10**9}, None),
    ({"prefix_lens": [10**9], "extend_lens": [1], "context_len": 2 * 10**9}, None),
    ({"prefix_lens": [3] * 10**6, "extend_lens": [1] * 10**6}, 8 * 2**30),
    ({"layers": [dict(case_dict()["batch"]["layers"][0], num_q_heads=10**6, num_kv_heads=10**6)]}, 8 * 2**30),
])
def test_case_too_large_is_refused_before_allocating(tmp_path, capsys, monkeypatch, batch, limit):
    if limit is not None:  # a machine of 16 GiB, whatever this one has
        monkeypatch.setattr(search.casefile, "memory_limit", lambda: limit)
    path = write_case(tmp_path, batch=batch)
    assert main(["repro", str(path)]) == 2
    one_error_line(capsys, str(path), "bytes) of memory to replay, more than the limit of")


def test_estimate_leaves_ordinary_cases_alone():
    spec = BatchSpec(ForwardMode.EXTEND, (600,) * 16, (200,) * 16, (MHALayer(0, 8, 2, 128, 128),) * 1,
                     dtype="bfloat16")
    assert estimated_bytes(spec) < 2**30  # the largest ordinary batch the gpu profile draws (its long-context
    # and wide edge cases take a few GiB: search/strategies.py SHAPES)
    # Every layer kind is estimated (a lightning layer's state is H x 128 x 128 per request and per draft step)
    verify = BatchSpec(ForwardMode.TARGET_VERIFY, (600,) * 16, (4,) * 16, (LightningLayer(0, 8, 128),),
                       spec=SpecInput(4, 1, 3, ((-1, 0, 1, 2),) * 16, (1,) * 16), dtype="bfloat16")
    assert 2**20 < estimated_bytes(verify) < 2**30


def test_repro_dump_onto_a_file(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["repro", str(write_case(tmp_path)), "--dump", str(a_file)]) == 2
    one_error_line(capsys, "--dump", "is a file, not a folder")


def test_case_recorded_on_cuda_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = write_case(tmp_path, {"device": "cuda"})
    assert main(["repro", str(path)]) == 2
    one_error_line(capsys, "recorded on cuda", "--device cpu")
