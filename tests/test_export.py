"""``harness export``: an exported file runs with torch and SGLang alone (a fresh process, this project off
``sys.path``), fails where the harness's case fails, and passes where the fault is gone."""

from __future__ import annotations

import json
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


# Ledger entries of refuse_or_correct (a batch past a limit the backend declares: refused or right), each with what
# its exported file's failure says on 0.5.23: the refusal property's words, then the figure the harness measured.
REFUSAL_ENTRIES = {
    "sglang-torch-native-ignores-logit-cap": r"answered without refusing \(logit cap not supported\); outputs vs "
                                             r"float64 reference: relative L2 error 0\.00509 > bound 6\.6e-07",
    "sglang-torch-native-ignores-kv-scales": r"answered without refusing \(KV scales other than 1 not supported\); "
                                             r"outputs vs float64 reference: relative L2 error 0\.695 > bound 6\.6e-07",
    "sglang-flex-ignores-logit-cap": r"answered without refusing \(logit cap not supported\); outputs vs float64 "
                                     r"reference: relative L2 error 0\.0149 > bound 6\.6e-07",
    "sglang-flex-ignores-window": r"answered without refusing \(sliding window not supported\); outputs vs float64 "
                                  r"reference: relative L2 error 0\.743 > bound 6\.79e-07",
}

# A stand-in for an SGLang that refuses what its CPU backends cannot compute: their forward raises on a soft-capped,
# windowed or KV-scaled layer (the limits the ledger entries above cross), before computing anything.
REFUSING_PATCH = '''
def patch():
    from sglang.srt.layers.attention.torch_flex_backend import TorchFlexAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    saved = [(cls, cls.forward) for cls in (TorchNativeAttnBackend, TorchFlexAttnBackend)]
    for cls, forward in saved:
        def refusing(self, q, k, v, layer, *args, _forward=forward, **kwargs):
            scales = (getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None))
            if layer.logit_cap or layer.sliding_window_size >= 0 or any(s not in (None, 1.0) for s in scales):
                raise NotImplementedError(f"{type(self).__name__} cannot compute this layer")
            return _forward(self, q, k, v, layer, *args, **kwargs)

        cls.forward = refusing
    return lambda: [setattr(cls, "forward", forward) for cls, forward in saved]
'''

# A pytest plugin: the tests of FILES run on SGLang patched by ``patch()`` (which returns how to undo it), restored
# after each; the other files' tests run on SGLang as it is, in the same process.
PATCHING_PLUGIN = '''
import pytest

FILES = {files!r}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if item.path.name not in FILES:
        yield
        return
    undo = patch()
    try:
        yield
    finally:
        undo()

{patch}
'''


@needs_kit
def test_refusal_cases_export_to_files_that_fail_on_their_own_and_pass_when_refused(tmp_path, monkeypatch):
    """The four refuse_or_correct entries of SGLang's CPU backends (TorchNative and flex attention ignore a
    soft-cap, a window, an fp8 cache's KV scales, and answer anyway), exported and run in one fresh process without
    this project: each file fails with the refusal property's words and the harness's figure. With SGLang made to
    refuse those layers (a stand-in plugin), each file passes and says it was refused; a file whose own code
    breaks is not taken for a refusal."""
    from harness.export import run_exported

    files = {}
    for entry in REFUSAL_ENTRIES:
        files[entry] = tmp_path / f"test_{entry.replace('-', '_')}.py"
        assert main(["export", str(ROOT / f"docs/findings/cases/{entry}.json"), "--out", str(files[entry])]) == 0
        _imports_nothing_of_ours(files[entry])
    assert "CROSSED = 'logit cap not supported'" in files["sglang-flex-ignores-logit-cap"].read_text()
    assert "--kv-cache-dtype fp8_e4m3" in files["sglang-torch-native-ignores-kv-scales"].read_text()

    # The same files again where SGLang refuses (a stand-in plugin, for their copies only), and one whose own code no
    # longer fits the release (it must fail): all in one fresh process
    refused = {entry: path.with_name(path.name.replace("test_", "test_refused_", 1)) for entry, path in files.items()}
    for entry, path in refused.items():
        path.write_text(files[entry].read_text())
    broken = tmp_path / "test_broken_file.py"
    text = files["sglang-flex-ignores-window"].read_text()
    assert "kit.forward_context(" in text
    broken.write_text(text.replace("kit.forward_context(", "kit.no_such_forward_context(", 1))
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "harness_refusing.py").write_text(PATCHING_PLUGIN.format(files=sorted(p.name for p in refused.values()),
                                                                      patch=REFUSING_PATCH))
    monkeypatch.setenv("PYTHONPATH", str(plugin))
    status, output = run_exported([*files.values(), *refused.values(), broken], extra=["-rA", "-p", "harness_refusing"])
    assert status == 1, output[-3000:]
    for entry, says in REFUSAL_ENTRIES.items():
        assert re.search(rf"^FAILED {files[entry].name}::", output, flags=re.M), f"{entry}: {output[-3000:]}"
        assert re.search(rf"AssertionError: {says}", output), f"{entry}: {output[-3000:]}"
    for entry, path in refused.items():
        assert re.search(rf"^PASSED {path.name}::", output, flags=re.M), f"{entry}: {output[-3000:]}"
    assert len(re.findall(r"^refused \(.+ not supported\): NotImplementedError: \w+ cannot compute this layer",
                          output, flags=re.M)) == len(refused), output[-3000:]
    assert re.search(r"^FAILED test_broken_file.py::", output, flags=re.M), output[-3000:]
    assert "has no attribute 'no_such_forward_context'" in output, output[-3000:]


def _variant(case: Path, out: Path, change) -> Path:
    """A copy of a ledger case with ``change`` applied to its batch, its verdict dropped (it is not the finding)."""
    data = json.loads(case.read_text())
    change(data["batch"])
    data.pop("verdict")
    out.write_text(json.dumps(data))
    return out


@needs_kit
def test_fp8_cache_case_exports_to_a_file_that_fails_where_triton_computes_in_e4m3(tmp_path):
    """sglang-triton-fp8-e4m3-arithmetic: over an fp8 e4m3 cache SGLang's Triton GQA decode rounds q and the
    probabilities to e4m3. Its file reads the cache as the harness's reference does (the stored e4m3 values times
    the scales) and fails with the harness's figure (1.13e-2, with Triton's interpreted fp8 cast corrected as the
    harness corrects it; uncorrected it would be 0.109). The same batch with one q head per KV head, which Triton's
    other decode kernel dequantizes exactly, passes in the same fresh process."""
    from harness.export import run_exported

    case = ROOT / "docs/findings/cases/sglang-triton-fp8-e4m3-arithmetic.json"
    gqa, mha = tmp_path / "test_fp8_gqa.py", tmp_path / "test_fp8_mha.py"

    def one_q_head_per_kv_head(batch):
        batch["layers"][0]["num_q_heads"] = batch["layers"][0]["num_kv_heads"]

    for source, out in ((case, gqa), (_variant(case, tmp_path / "fp8_mha.json", one_q_head_per_kv_head), mha)):
        assert main(["export", str(source), "--out", str(out)]) == 0
        _imports_nothing_of_ours(out)
    text = gqa.read_text()
    assert "KV_CACHE_DTYPE = \"fp8_e4m3\"" in text and "dtype=torch.float8_e4m3fn" in text
    assert "def _fp8_downcaster" in text  # the harness's interpreter cast, copied in

    status, output = run_exported([gqa, mha], extra=["-rA"])
    assert status == 1, output[-3000:]
    assert re.search(r"^FAILED test_fp8_gqa.py::", output, flags=re.M), output[-3000:]
    assert re.search(r"AssertionError: relative L2 error 0\.0113 > bound 2\.36e-06", output), output[-3000:]
    assert re.search(r"^PASSED test_fp8_mha.py::", output, flags=re.M), output[-3000:]


@needs_kit
def test_speculative_cases_export_to_files_that_fail_where_the_bug_lives(tmp_path):
    """TARGET_VERIFY and DRAFT_EXTEND batches, their spec info rebuilt in the file with SGLang's EagleVerifyInput and
    EagleDraftExtendInput, in one fresh process without this project:
    - sglang-triton-verify-window-by-row: under a topk-2 tree Triton windows a sibling draft by its row, not its
      depth; the file fails with the harness's figure, and the same batch as a chain (each row its depth) passes;
    - sglang-triton-draft-extend-v2-fp8-e4m3-arithmetic: a draft extend over an fp8 cache, whose prefix stage rounds
      q and P to e4m3; the file fails with the harness's figure, and the same batch over an auto cache passes."""
    from harness.export import run_exported

    cases = ROOT / "docs/findings/cases"
    verify_case = cases / "sglang-triton-verify-window-by-row.json"
    draft_case = cases / "sglang-triton-draft-extend-v2.json"

    def as_chain(batch):
        batch["spec"].update(parents=[[-1, 0, 1]], topk=1, spec_steps=2)

    sources = {
        "test_verify_tree.py": verify_case,
        "test_verify_chain.py": _variant(verify_case, tmp_path / "chain.json", as_chain),
        "test_draft_extend_fp8.py": draft_case,
        "test_draft_extend_auto.py": _variant(draft_case, tmp_path / "auto.json",
                                              lambda batch: batch.update(kv_cache_dtype="auto")),
    }
    folder = tmp_path / "export"
    for name, source in sources.items():
        assert main(["export", str(source), "--out", str(folder / name)]) == 0
        _imports_nothing_of_ours(folder / name)
    verify = (folder / "test_verify_tree.py").read_text()
    assert "EagleVerifyInput(" in verify and "PARENTS = [[-1, 0, 0]]" in verify
    assert "--speculative-eagle-topk 2" in verify
    assert "EagleDraftExtendInput(" in (folder / "test_draft_extend_fp8.py").read_text()

    status, output = run_exported([folder / name for name in sources], extra=["-rA"])
    assert status == 1, output[-3000:]
    for name in ("test_verify_tree.py", "test_draft_extend_fp8.py"):
        assert re.search(rf"^FAILED {name}::", output, flags=re.M), f"{name}: {output[-3000:]}"
    for name in ("test_verify_chain.py", "test_draft_extend_auto.py"):
        assert re.search(rf"^PASSED {name}::", output, flags=re.M), f"{name}: {output[-3000:]}"
    assert re.search(r"AssertionError: relative L2 error 0\.415 > bound 2\.41e-06 \(worst element at request 0, "
                     r"token 2, head 0", output), output[-3000:]
    assert re.search(r"AssertionError: relative L2 error 0\.0112 > bound 2\.35e-06", output), output[-3000:]


# SGLang with the fixes the lightning triage pages propose: an idle linear layer answered by the interface it used
# (sglang-hybrid-idle-lightning.md), and no cast of a lightning layer's q and output to the KV cache's dtype, which
# a linear layer has no cache of (sglang-lightning-fp8-decode.md).
FIXING_PATCH = '''
def patch():
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.lightning_backend import LightningAttentionBackend

    forward, init = HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__

    def fixed_forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True,
                      mixed_qkv=None, a=None, b=None, **kwargs):
        if forward_batch.forward_mode.is_idle() and mixed_qkv is None:
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        return forward(self, q, k, v, layer, forward_batch, save_kv_cache, mixed_qkv, a, b, **kwargs)

    def fixed_init(self, model_runner):
        init(self, model_runner)
        self.kv_cache_dtype_str = "auto"

    HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__ = fixed_forward, fixed_init

    def undo():
        HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__ = forward, init
    return undo
'''


@needs_kit
def test_wrapped_cases_export_to_files_that_fail_as_triaged_and_pass_when_fixed(tmp_path, monkeypatch):
    """Ledger entries of SGLang's wrappers live in 0.5.23, exported and run in one fresh process without this project,
    each failing as the harness's replay did.
    Lightning under SGLang's HybridLinearAttnBackend (built with SGLang's lightning kit):
    - sglang-lightning-fp8-decode: a decode over an fp8 cache rounds q and the output to e4m3 (relative L2 0.0468);
    - sglang-hybrid-idle-lightning: an idle batch crashes in the hybrid's forward on ``mixed_qkv``;
    - sglang-lightning-single-token-verify: a verify of one draft token leaves no per-step state (all zeros).
    With the fixes the triage pages propose (a plugin), the first two pass; the verify's batch with two draft tokens
    per request, which takes SGLang's verify path, passes.
    Two-batch overlap (TboAttnBackend over TorchNative, the batch split by SGLang's own splitter):
    - sglang-tbo-mixed-two-chunk: a MIXED batch's halves disagree with their tokens, and TorchNative crashes on the
      second half; the same batch as EXTEND, which SGLang splits with its two-chunk bookkeeping, passes."""
    from harness.export import run_exported

    cases = ROOT / "docs/findings/cases"
    verify_case = cases / "sglang-lightning-single-token-verify.json"
    tbo_case = cases / "sglang-tbo-mixed-two-chunk.json"

    def two_drafts(batch):
        batch["extend_lens"] = [2]
        batch["spec"].update(parents=[[-1, 0]], draft_token_num=2, spec_steps=1)

    sources = {"test_fp8_decode.py": cases / "sglang-lightning-fp8-decode.json",
               "test_idle.py": cases / "sglang-hybrid-idle-lightning.json",
               "test_verify_one.py": verify_case,
               "test_verify_two.py": _variant(verify_case, tmp_path / "two.json", two_drafts),
               "test_tbo_mixed.py": tbo_case,
               "test_tbo_extend.py": _variant(tbo_case, tmp_path / "extend.json",
                                              lambda batch: batch.update(mode="extend"))}
    folder = tmp_path / "export"
    for name, source in sources.items():
        assert main(["export", str(source), "--out", str(folder / name)]) == 0
        _imports_nothing_of_ours(folder / name)
    fp8 = " ".join((folder / "test_fp8_decode.py").read_text().split())  # the header's lines joined
    assert "--kv-cache-dtype fp8_e4m3" in fp8 and "full attention at layers [0, 1];" in fp8 and "LAYER_ID = 2" in fp8
    assert "Triage: docs/findings/sglang-hybrid-idle-lightning.md" in (folder / "test_idle.py").read_text()
    assert "--speculative-eagle-topk 1" in (folder / "test_verify_one.py").read_text()
    tbo = (folder / "test_tbo_mixed.py").read_text()
    assert "--enable-two-batch-overlap" in tbo and "TboAttnBackend(primary=make()" in tbo

    # With the fixes the triage pages propose (a plugin, for copies of the first two only), in the same fresh process
    fixed = [folder / "test_fixed_fp8_decode.py", folder / "test_fixed_idle.py"]
    for path, name in zip(fixed, ("test_fp8_decode.py", "test_idle.py")):
        path.write_text((folder / name).read_text())
        if (folder / name).with_suffix(".pt").exists():  # the tensors of a large case, beside its file
            path.with_suffix(".pt").write_bytes((folder / name).with_suffix(".pt").read_bytes())
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "harness_fixing.py").write_text(PATCHING_PLUGIN.format(files=[p.name for p in fixed], patch=FIXING_PATCH))
    monkeypatch.setenv("PYTHONPATH", str(plugin))
    status, output = run_exported([*(folder / name for name in sources), *fixed],
                                  extra=["-rA", "--tb=short", "-p", "harness_fixing"])
    assert status == 1, output[-3000:]
    assert re.search(r"AssertionError: lightning layer 2 outputs: relative L2 error 0\.0468 > bound", output), \
        output[-3000:]
    assert "AttributeError: 'NoneType' object has no attribute 'new_empty'" in output, output[-3000:]
    assert re.search(r"AssertionError: request 0 state after each draft token: relative L2 error 1 > bound", output), \
        output[-3000:]
    assert re.search(r"^PASSED test_verify_two.py::", output, flags=re.M), output[-3000:]
    assert re.search(r"^FAILED test_tbo_mixed.py::.* - RuntimeError: The expanded size of the tensor \(5\) must match "
                     r"the existing size \(3\)", output, flags=re.M), output[-3000:]
    assert re.search(r"^PASSED test_tbo_extend.py::", output, flags=re.M), output[-3000:]
    for path in fixed:
        assert re.search(rf"^PASSED {path.name}::", output, flags=re.M), f"{path.name}: {output[-3000:]}"


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
    # a DFlash verify (the fault shows only there): the file builds DFlashVerifyInput and widens the host lengths
    "sglang_triton_verify_plans_from_host_lengths": ("outputs", r"AssertionError: (relative L2|element) error"),
    "sglang_triton_lacks_update_verify": (
        "conformance", r"AssertionError: TritonAttnBackend serves target_verify but leaves "
                       r"update_verify_buffers_to_fill_after_draft to AttentionBackend"),
    # plans: an eager extend's, and a decode graph's at a padded replay, each judged by the harness's check_plan
    "sglang_triton_extend_prefix_from_new_lens": (
        "metadata", r"AssertionError: TritonAttnBackend: request \d+: kv_indices hold .*expected its req_to_token slots"),
    "sglang_triton_replay_pads_real_rows": (
        "graph_metadata", r"AssertionError: at replay at \d+ x 1 \(\d+ padded row\(s\)\): TritonAttnBackend: "
                          r"request \d+: kv_indices hold .*expected its req_to_token slots"),
    # a class-level leaf: the file runs the harness's class check, copied in
    "sglang_trtllm_mla_one_arg_mha_chunk": (
        "conformance", r"AssertionError: TRTLLMMLABackend.init_mha_chunk_metadata\(forward_batch\) does not take "
                       r"the call"),
}


@needs_kit
def test_mutant_cases_fail_under_their_fault_and_pass_without_it(tmp_path):
    """`harness mutants --engine sglang` finds faults patched into SGLang's real classes (the dropped soft-cap of
    its MHA decode branch; a Triton verify planned from DFlash's widened host lengths; a Triton backend without its
    verify-buffer refresh; a Triton extend planned by its new-token counts (metadata); a Triton decode graph's replay
    that pads its real rows too (graph_metadata); TRT-LLM MLA's one-argument
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


def test_a_lightning_hybrid_case_that_failed_at_a_full_attention_layer_is_one_line_and_exit_2(tmp_path, capsys):
    """Its file would run the lightning layer only, which passes: refused before anything runs, naming the layer."""
    case = json.loads((ROOT / "docs/findings/cases/sglang-lightning-fp8-decode.json").read_text())
    case["verdict"]["where"] = "layer 1: request 0, token 0, head 0"
    (tmp_path / "case.json").write_text(json.dumps(case))
    assert main(["export", str(tmp_path / "case.json"), "--out", str(tmp_path / "test_x.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "failed at its mha layer 1" in err, err
    assert not (tmp_path / "test_x.py").exists()


@needs_kit
def test_a_crash_of_the_projects_own_code_in_the_replay_is_never_handed_over_as_sglangs(tmp_path, monkeypatch):
    """The idle lightning case crashes inside SGLang, and its file shows that crash; a crash of the harness's own code
    during the same replay (here the recorder's) is the harness's error: it propagates, and no file is written."""
    import harness.export as export

    def broken(*args, **kwargs):
        raise RuntimeError("the recorder broke")

    monkeypatch.setattr(export, "_linear_call", broken)
    with pytest.raises(RuntimeError, match="the recorder broke"):
        main(["export", str(ROOT / "docs/findings/cases/sglang-hybrid-idle-lightning.json"), "--out",
              str(tmp_path / "test_idle.py")])
    assert not (tmp_path / "test_idle.py").exists()


def test_export_refuses_an_out_path_that_is_not_python(tmp_path, capsys):
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-triton-swa-decode.json"), "--out",
                 str(tmp_path / "repro.txt")]) == 2
    assert "must end in .py" in capsys.readouterr().err
