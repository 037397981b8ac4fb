"""``harness export``: an exported file runs with torch and SGLang alone (a fresh process, this project off
``sys.path``), fails where the harness's case fails, and passes where the fault is gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
# What the project's own packages are called: an exported file imports none of them.
PROJECT_PACKAGES = ("harness", "backends", "batch", "engine", "properties", "reference", "search")


def _sglang_kit_missing() -> str | None:
    from backends.registry import parse

    reason = parse("sglang.triton").unavailable_reason("cpu")
    if reason:
        return reason
    import importlib.util

    if importlib.util.find_spec("sglang.test.kits.attention_unittest") is None:
        return "the installed SGLang ships no attention unit-test kit (0.5.14 on)"
    return None


needs_kit = pytest.mark.skipif(_sglang_kit_missing() is not None, reason=str(_sglang_kit_missing()))


def _imports_nothing_of_ours(path: Path) -> None:
    text = path.read_text()
    ours = re.findall(rf"^\s*(?:from|import)\s+({'|'.join(PROJECT_PACKAGES)})\b", text, flags=re.M)
    assert not ours, f"{path.name} imports the project's {sorted(set(ours))}"


@needs_kit
def test_ledger_cases_export_to_files_that_fail_on_their_own(tmp_path):
    """Two ledger entries live in 0.5.23, exported and run together in one fresh process without this project:
    - SGLang's Triton decode reads one key short of a sliding window (sglang-triton-swa-decode-one-key-short): its
      file fails with the check the harness failed;
    - its hybrid wrapper has no extend_attention_block_m, which its Triton child has (sglang-hybrid-hides-extend-
      block-m): its file fails on exactly the members the harness names, each its own test (classes and sources
      only)."""
    from harness.export import run_exported

    swa, block_m = tmp_path / "test_swa_decode.py", tmp_path / "test_block_m.py"
    for case, out in (("sglang-triton-swa-decode", swa), ("sglang-hybrid-hides-extend-block-m", block_m)):
        assert main(["export", str(ROOT / f"docs/findings/cases/{case}.json"), "--out", str(out)]) == 0
        _imports_nothing_of_ours(out)
    text = swa.read_text()
    assert "Triage: docs/findings/sglang-triton-swa-decode.md" in text and "--attention-backend triton" in text
    assert "sliding window 1" in text and not swa.with_suffix(".pt").exists()  # small: the tensors are inline

    status, output = run_exported([swa, block_m], extra=["-rA"])
    assert status == 1, output[-3000:]
    assert re.search(r"^FAILED test_swa_decode.py::", output, flags=re.M), output[-3000:]
    assert re.search(r"AssertionError: relative L2 error 1\.\d+ > bound 2\.36e-06", output), output[-3000:]
    failed = set(re.findall(r"^FAILED test_block_m.py::\S+\[(\w+\.\w+)\]", output, flags=re.M))
    assert failed == {"HybridLinearAttnBackend.extend_attention_block_m"}, output[-3000:]
    assert "which its child TritonAttnBackend has: SGLang's hasattr-guarded call skips it" in output


@needs_kit
@pytest.mark.parametrize("status, says, code", [(1, "fails on its own, as the harness's replay did", 0),
                                               (0, "passes on its own, NOT as the harness's replay did", 1)])
def test_export_check_says_whether_the_file_fails_as_the_harness_did(tmp_path, capsys, monkeypatch, status, says,
                                                                    code):
    """`export --check`'s verdict on what the fresh process reported (the process itself: the test above)."""
    import harness.export

    ran = []
    monkeypatch.setattr(harness.export, "run_exported",
                        lambda path, stand_ins=False: ran.append(path) or (status, "the file's pytest output"))
    out = tmp_path / "test_swa_decode.py"
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-triton-swa-decode.json"), "--out", str(out),
                 "--check"]) == code
    assert ran == [out] and f"the exported file {says}" in capsys.readouterr().out


FAULT_PLUGIN = '''
import pytest

FAULTS = {faults!r}  # exported file -> the harness mutant that produced its case


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The file's harness mutant, patched into SGLang's real classes while each of its tests runs."""
    from harness.mutants.catalogue import MUTANTS

    fault = MUTANTS[FAULTS[item.path.name]].patch()
    fault.__enter__()
    item.stash[KEY] = fault


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    fault = item.stash.get(KEY, None)
    if fault is not None:
        fault.__exit__(None, None, None)


KEY = pytest.StashKey()
'''

# Mutants of SGLang's real classes whose cases export: the property that kills each, and what its exported file
# asserts when the fault is patched back in.
EXPORTED_MUTANTS = {
    "sglang_mha_decode_drops_logit_cap": ("outputs", r"AssertionError: (relative L2|element) error"),
    "sglang_triton_lacks_update_verify": (
        "conformance", r"AssertionError: TritonAttnBackend serves target_verify but leaves "
                       r"update_verify_buffers_to_fill_after_draft to AttentionBackend"),
    # a class-level leaf: the file runs the harness's class check, copied in
    "sglang_trtllm_mla_one_arg_mha_chunk": (
        "conformance", r"AssertionError: TRTLLMMLABackend.init_mha_chunk_metadata\(forward_batch\) does not take "
                       r"the call"),
}


@needs_kit
def test_mutant_cases_fail_under_their_fault_and_pass_without_it(tmp_path):
    """`harness mutants --engine sglang` finds faults patched into SGLang's real classes (the dropped soft-cap of
    its MHA decode branch; a Triton backend without its verify-buffer refresh; TRT-LLM MLA's one-argument
    init_mha_chunk_metadata, read at class level); each exported case passes on its own (the real SGLang has no such
    fault) and fails with its fault patched in. The files run together, one fresh interpreter without the faults and
    one with each file's own, so SGLang is imported twice, not twice per file."""
    from harness.export import run_exported
    from harness.mutants.catalogue import MUTANTS
    from harness.mutants.run import run_mutant
    from search.profiles import PROFILES

    folder = tmp_path / "export"
    files = {}
    for name, (prop, _) in EXPORTED_MUTANTS.items():
        result = run_mutant(MUTANTS[name], PROFILES["ci"], "cpu", tmp_path / "mutants", budget_s=600,
                            shrink_seconds=0)
        assert result.status == "killed" and result.case_file and result.property == prop, result
        files[name] = folder / f"test_{name}.py"
        assert main(["export", result.case_file, "--out", str(files[name])]) == 0
        _imports_nothing_of_ours(files[name])

    status, output = run_exported(list(files.values()), extra=["-rA"])  # without the faults, without this project
    assert status == 0, output[-3000:]
    for name, path in files.items():
        assert re.search(rf"^PASSED {path.name}::", output, flags=re.M), f"{name}: {output[-3000:]}"

    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "harness_fault.py").write_text(FAULT_PLUGIN.format(faults={p.name: n for n, p in files.items()}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)])}
    faulted = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p",
                              "harness_fault", "--rootdir", str(folder), *(p.name for p in files.values())],
                             cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    assert faulted.returncode == 1, faulted.stdout[-3000:] + faulted.stderr[-3000:]
    for name, path in files.items():
        assert re.search(rf"^FAILED {path.name}::", faulted.stdout, flags=re.M) and \
            not re.search(rf"^PASSED {path.name}::", faulted.stdout, flags=re.M), \
            f"{name}: {faulted.stdout[-3000:]}"
        assert re.search(EXPORTED_MUTANTS[name][1], faulted.stdout), f"{name}: {faulted.stdout[-3000:]}"


def test_a_case_of_a_kind_export_does_not_cover_is_one_line_and_exit_2(capsys):
    """A graph-replay case (not exported yet) is refused before anything runs."""
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-triton-draft-extend-graph-window.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot export") and "not exported yet" in err


def test_export_refuses_an_out_path_that_is_not_python(tmp_path, capsys):
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-triton-swa-decode.json"), "--out",
                 str(tmp_path / "repro.txt")]) == 2
    assert "must end in .py" in capsys.readouterr().err
