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

from backends.registry import parse
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


# A stand-in for an SGLang that refuses what its CPU backends cannot compute: their forward raises on a soft-capped,
# windowed or KV-scaled layer (the limits the refusal entries cross), before computing anything.
REFUSING = '''
def refusing():
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

# SGLang with the fixes the triage pages propose: an idle linear layer answered by the interface it used
# (sglang-hybrid-idle-lightning.md), no cast of a lightning layer's q and output to the KV cache's dtype, which
# a linear layer has no cache of (sglang-lightning-fp8-decode.md), and KDA's prefill on its token-parallel
# intra-chunk path, which has no clamped exponent (sglang-kda-fused-intra-clamp.md); and TRT-LLM MLA's draft steps
# (CuTe DSL MLA's container is its subclass) each planned over its own keys, seq_lens + step + 1, as TRT-LLM MHA's
# steps are (sglang-mla-draft-steps-read-committed-prefix.md).
FIXING = '''
def fixing():
    import copy

    from sglang.kernels.ops.attention.fla import kda
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.lightning_backend import LightningAttentionBackend
    from sglang.srt.layers.attention.trtllm_mla_backend import TRTLLMMLAMultiStepDraftBackend

    forward, init, intra = HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__, kda.chunk_kda_fwd_intra
    draft_plan = TRTLLMMLAMultiStepDraftBackend.init_forward_metadata

    def own_keys_per_step(self, forward_batch):
        for i in range(self.speculative_num_steps - 1):
            step = copy.copy(forward_batch)
            step.seq_lens, step.seq_lens_cpu = forward_batch.seq_lens + i + 1, forward_batch.seq_lens_cpu + i + 1
            step.seq_lens_sum = forward_batch.seq_lens_sum + (i + 1) * forward_batch.batch_size
            self.attn_backends[i].init_forward_metadata(step)

    def token_parallel_intra(*args, **kwargs):
        return intra(*args, **{**kwargs, "fuse_diagonal": False, "fuse_recompute": False})

    def fixed_forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True,
                      mixed_qkv=None, a=None, b=None, **kwargs):
        if forward_batch.forward_mode.is_idle() and mixed_qkv is None:
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        return forward(self, q, k, v, layer, forward_batch, save_kv_cache, mixed_qkv, a, b, **kwargs)

    def fixed_init(self, model_runner):
        init(self, model_runner)
        self.kv_cache_dtype_str = "auto"

    HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__ = fixed_forward, fixed_init
    kda.chunk_kda_fwd_intra = token_parallel_intra
    TRTLLMMLAMultiStepDraftBackend.init_forward_metadata = own_keys_per_step

    def undo():
        HybridLinearAttnBackend.forward, LightningAttentionBackend.__init__ = forward, init
        kda.chunk_kda_fwd_intra = intra
        TRTLLMMLAMultiStepDraftBackend.init_forward_metadata = draft_plan
    return undo
'''


# A pytest plugin: each listed file's tests run with SGLang patched as PATCHES says (a stand-in patch below, or the
# name of a harness mutant whose fault goes in), undone after each; the other files' tests run on SGLang as it is.
# Written after the lines ``PATCHES = {file: patch}`` and ``STAND_INS = STAND_IN_PATCHES``.
STAND_IN_PATCHES = ("refusing", "fixing")
PATCHING_PLUGIN = '''
import pytest


def _apply(patch):
    """Patches SGLang; returns how to undo it."""
    if patch in STAND_INS:  # written without the project: SGLang alone
        return globals()[patch]()
    from harness.mutants.catalogue import MUTANTS

    fault = MUTANTS[patch].patch()
    fault.__enter__()
    return lambda: fault.__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    patch = PATCHES.get(item.path.name)
    item.stash[KEY] = None if patch is None else _apply(patch)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    undo = item.stash.get(KEY, None)
    if undo is not None:
        undo()


KEY = pytest.StashKey()
''' + REFUSING + FIXING


class RoundTrip:
    """The module's exported files and what their two fresh interpreters reported. The files as they are, and copies
    of some with SGLang made to refuse or fixed as a triage page proposes, run in one interpreter with this project off
    ``sys.path``; copies carrying a harness mutant's fault run in a second one, which needs the project for the faults.
    One SGLang import each (7 s of CPU here, `python -c "import sglang.srt.layers.attention.triton_backend"`), not
    one or two per test: the tests below share this module's two runs (``xdist_group``: ci/test.sh keeps them on one
    pytest worker). Each file's failure is read from its own line of pytest's summary, which CI=true keeps whole."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.files, self.patches = folder, [], {}
        self.clean = self.faulted = ""

    def export(self, source: Path | str, name: str) -> Path:
        out = self.folder / name
        assert main(["export", str(source), "--out", str(out)]) == 0, source
        _imports_nothing_of_ours(out)
        self.files.append(out)
        return out

    def copy(self, original: Path, name: str, patch: str) -> Path:
        """A copy of ``original`` whose tests run with SGLang patched by ``patch`` ("refusing", "fixing" or a harness
        mutant's name); the tensors of a large case, beside its file, go with it."""
        path = self.folder / name
        path.write_text(original.read_text())
        if original.with_suffix(".pt").exists():
            path.with_suffix(".pt").write_bytes(original.with_suffix(".pt").read_bytes())
        self.patches[name] = patch
        return path

    def _faults(self) -> set[str]:
        return {name for name, patch in self.patches.items() if patch not in STAND_IN_PATCHES}

    def _plugin(self, folder: str, patches: dict[str, str]) -> Path:
        plugin = self.folder.parent / folder
        plugin.mkdir()
        (plugin / "harness_patching.py").write_text(f"PATCHES = {patches!r}\nSTAND_INS = {STAND_IN_PATCHES!r}\n"
                                                    + PATCHING_PLUGIN)
        return plugin

    def run(self) -> None:
        from harness.export import run_exported

        faults = self._faults()
        stand_ins = {name: patch for name, patch in self.patches.items() if name not in faults}
        plugin = self._plugin("plugin", stand_ins)
        with pytest.MonkeyPatch.context() as mp:  # run_exported keeps PYTHONPATH's other folders: the plugin's
            mp.setenv("PYTHONPATH", str(plugin))
            mp.setenv("CI", "true")
            status, self.clean = run_exported([*self.files, *(self.folder / name for name in sorted(stand_ins))],
                                              extra=["-rA", "--tb=short", "-p", "harness_patching"])
        assert status in (0, 1), self.clean[-3000:]  # tests passed or failed: none interrupted, no usage error
        plugin = self._plugin("fault-plugin", {name: self.patches[name] for name in faults})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]), "CI": "true"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "--tb=short", "-p", "no:cacheprovider",
                               "-p", "harness_patching", "--rootdir", str(self.folder), *sorted(faults)],
                              cwd=self.folder, env=env, capture_output=True, text=True, timeout=1800)
        self.faulted = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1), self.faulted[-3000:]

    def output(self, name: str) -> str:
        return self.faulted if name in self._faults() else self.clean

    def outcomes(self, name: str) -> set[str]:
        """What the tests of file ``name`` ended as (PASSED, FAILED, ERROR: a collection error's line may end at the
        file's name)."""
        return set(re.findall(rf"^(PASSED|FAILED|ERROR) {re.escape(name)}(?=::|\s|$)", self.output(name), flags=re.M))

    def failed(self, name: str, only: bool = False) -> None:
        """Some test of file ``name`` failed (``only``: every one), none errored."""
        got = self.outcomes(name)
        assert "FAILED" in got and "ERROR" not in got and (not only or got == {"FAILED"}), \
            f"{name}: {sorted(got)}\n{self.output(name)[-3000:]}"

    def passed(self, name: str) -> None:
        assert self.outcomes(name) == {"PASSED"}, f"{name}: {sorted(self.outcomes(name))}\n{self.output(name)[-3000:]}"

    def says(self, name: str, pattern: str) -> None:
        """A test of file ``name`` failed with a message that matches ``pattern`` (its line in pytest's summary)."""
        assert re.search(rf"^FAILED {re.escape(name)}::\S+ - .*?{pattern}", self.output(name), flags=re.M), \
            f"{name}: no failure saying {pattern!r}\n{self.output(name)[-3000:]}"


PREPARERS = []


def prepares(fn):
    """``fn(trip)`` exports a test's files (and its patched copies) before the module's two runs."""
    PREPARERS.append(fn)
    return fn


pytestmark = pytest.mark.xdist_group("export")


def test_under_loadgroup_this_modules_tests_share_one_worker(request):
    """The grouping the shared interpreters rely on: pytest-xdist marks a grouped test by suffixing its id, and a
    pytest that does not take the suffix (9.2, which keeps the id elsewhere) lets each worker build its own
    RoundTrip (three SGLang imports for one; seen on CI as a slower run, not as a failure)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a worker of --dist loadgroup (ci/test.sh runs the suite so)")
    assert request.node.nodeid.endswith("@export"), request.node.nodeid


@pytest.fixture(scope="module")
def trip(tmp_path_factory) -> RoundTrip:  # (its tests carry needs_kit: skipped, they never ask for it)
    trip = RoundTrip(tmp_path_factory.mktemp("round-trip") / "export")
    trip.folder.mkdir()
    for prepare in PREPARERS:
        prepare(trip)
    trip.run()
    return trip


@prepares
def _ledger_files(trip: RoundTrip) -> None:
    trip.export(ROOT / "docs/findings/cases/sglang-triton-swa-decode.json", "test_swa_decode.py")
    trip.export(ROOT / "docs/findings/cases/sglang-hybrid-hides-extend-block-m.json", "test_block_m.py")


@needs_kit
def test_ledger_cases_export_to_files_that_fail_on_their_own(trip):
    """Two ledger entries live in 0.5.23, exported and run in a fresh process without this project:
    - SGLang's Triton decode reads one key short of a sliding window (sglang-triton-swa-decode-one-key-short): its
      file fails with the check the harness failed;
    - its hybrid wrapper has no extend_attention_block_m, which its Triton child has (sglang-hybrid-hides-extend-
      block-m): its file fails on exactly the members the harness names, each its own test (classes and sources
      only)."""
    swa = trip.folder / "test_swa_decode.py"
    text = swa.read_text()
    assert "Triage: docs/findings/sglang-triton-swa-decode.md" in text and "--attention-backend triton" in text
    assert "sliding window 1" in text and not swa.with_suffix(".pt").exists()  # small: the tensors are inline
    trip.failed(swa.name, only=True)
    trip.says(swa.name, r"AssertionError: relative L2 error 1\.\d+ > bound 2\.36e-06")
    trip.failed("test_block_m.py")
    failed = set(re.findall(r"^FAILED test_block_m.py::\S+\[(\w+\.\w+)\]", trip.clean, flags=re.M))
    assert failed == {"HybridLinearAttnBackend.extend_attention_block_m"}, trip.clean[-3000:]
    trip.says("test_block_m.py",
              re.escape("which its child TritonAttnBackend has: SGLang's hasattr-guarded call skips it"))


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


def _refusal_file(entry: str) -> str:
    return f"test_{entry.replace('-', '_')}.py"


@prepares
def _refusal_files(trip: RoundTrip) -> None:
    for entry in REFUSAL_ENTRIES:
        exported = trip.export(ROOT / f"docs/findings/cases/{entry}.json", _refusal_file(entry))
        trip.copy(exported, _refusal_file(entry).replace("test_", "test_refused_", 1), "refusing")
    # A copy whose own code no longer fits the release: it must fail, not read as refused
    broken = trip.folder / "test_broken_file.py"
    text = (trip.folder / _refusal_file("sglang-flex-ignores-window")).read_text()
    assert "kit.forward_context(" in text
    broken.write_text(text.replace("kit.forward_context(", "kit.no_such_forward_context(", 1))
    trip.patches[broken.name] = "refusing"


@needs_kit
def test_refusal_cases_export_to_files_that_fail_on_their_own_and_pass_when_refused(trip):
    """The four refuse_or_correct entries of SGLang's CPU backends (TorchNative and flex attention ignore a
    soft-cap, a window, an fp8 cache's KV scales, and answer anyway), exported and run in a fresh process without
    this project: each file fails with the refusal property's words and the harness's figure. With SGLang made to
    refuse those layers (a stand-in patch, for their copies only), each file passes and says it was refused; a file
    whose own code breaks is not taken for a refusal."""
    files = {entry: trip.folder / _refusal_file(entry) for entry in REFUSAL_ENTRIES}
    assert "CROSSED = 'logit cap not supported'" in files["sglang-flex-ignores-logit-cap"].read_text()
    assert "--kv-cache-dtype fp8_e4m3" in files["sglang-torch-native-ignores-kv-scales"].read_text()
    for entry, says in REFUSAL_ENTRIES.items():
        trip.failed(files[entry].name, only=True)
        trip.says(files[entry].name, rf"AssertionError: {says}")
        trip.passed(files[entry].name.replace("test_", "test_refused_", 1))
    assert len(re.findall(r"^refused \(.+ not supported\): NotImplementedError: \w+ cannot compute this layer",
                          trip.clean, flags=re.M)) == len(REFUSAL_ENTRIES), trip.clean[-3000:]
    trip.failed("test_broken_file.py", only=True)
    trip.says("test_broken_file.py", "has no attribute 'no_such_forward_context'")


def _variant(case: Path, out: Path, change) -> Path:
    """A copy of a ledger case with ``change`` applied to its batch, its verdict dropped (it is not the finding)."""
    data = json.loads(case.read_text())
    change(data["batch"])
    data.pop("verdict")
    out.write_text(json.dumps(data))
    return out


def _one_q_head_per_kv_head(batch):
    batch["layers"][0]["num_q_heads"] = batch["layers"][0]["num_kv_heads"]


@prepares
def _fp8_files(trip: RoundTrip) -> None:
    case = ROOT / "docs/findings/cases/sglang-triton-fp8-e4m3-arithmetic.json"
    trip.export(case, "test_fp8_gqa.py")
    trip.export(_variant(case, trip.folder.parent / "fp8_mha.json", _one_q_head_per_kv_head), "test_fp8_mha.py")


@needs_kit
def test_fp8_cache_case_exports_to_a_file_that_fails_where_triton_computes_in_e4m3(trip):
    """sglang-triton-fp8-e4m3-arithmetic: over an fp8 e4m3 cache SGLang's Triton GQA decode rounds q and the
    probabilities to e4m3. Its file reads the cache as the harness's reference does (the stored e4m3 values times
    the scales) and fails with the harness's figure (1.13e-2, with Triton's interpreted fp8 cast corrected as the
    harness corrects it; uncorrected it would be 0.109). The same batch with one q head per KV head, which Triton's
    other decode kernel dequantizes exactly, passes in the same fresh process."""
    text = (trip.folder / "test_fp8_gqa.py").read_text()
    assert "KV_CACHE_DTYPE = \"fp8_e4m3\"" in text and "dtype=torch.float8_e4m3fn" in text
    assert "def _fp8_downcaster" in text  # the harness's interpreter cast, copied in
    trip.failed("test_fp8_gqa.py", only=True)
    trip.says("test_fp8_gqa.py", r"AssertionError: relative L2 error 0\.0113 > bound 2\.36e-06")
    trip.passed("test_fp8_mha.py")


def _as_chain(batch):
    batch["spec"].update(parents=[[-1, 0, 1]], topk=1, spec_steps=2)


@prepares
def _speculative_files(trip: RoundTrip) -> None:
    cases = ROOT / "docs/findings/cases"
    verify_case = cases / "sglang-triton-verify-window-by-row.json"
    draft_case = cases / "sglang-triton-draft-extend-v2.json"
    trip.export(verify_case, "test_verify_tree.py")
    trip.export(_variant(verify_case, trip.folder.parent / "chain.json", _as_chain), "test_verify_chain.py")
    trip.export(draft_case, "test_draft_extend_fp8.py")
    auto = _variant(draft_case, trip.folder.parent / "auto.json", lambda batch: batch.update(kv_cache_dtype="auto"))
    trip.export(auto, "test_draft_extend_auto.py")


@needs_kit
def test_speculative_cases_export_to_files_that_fail_where_the_bug_lives(trip):
    """TARGET_VERIFY and DRAFT_EXTEND batches, their spec info rebuilt in the file with SGLang's EagleVerifyInput and
    EagleDraftExtendInput, in a fresh process without this project:
    - sglang-triton-verify-window-by-row: under a topk-2 tree Triton windows a sibling draft by its row, not its
      depth; the file fails with the harness's figure, and the same batch as a chain (each row its depth) passes;
    - sglang-triton-draft-extend-v2-fp8-e4m3-arithmetic: a draft extend over an fp8 cache, whose prefix stage rounds
      q and P to e4m3; the file fails with the harness's figure, and the same batch over an auto cache passes."""
    verify = (trip.folder / "test_verify_tree.py").read_text()
    assert "EagleVerifyInput(" in verify and "PARENTS = [[-1, 0, 0]]" in verify
    assert "--speculative-eagle-topk 2" in verify
    assert "EagleDraftExtendInput(" in (trip.folder / "test_draft_extend_fp8.py").read_text()
    for name in ("test_verify_tree.py", "test_draft_extend_fp8.py"):
        trip.failed(name, only=True)
    for name in ("test_verify_chain.py", "test_draft_extend_auto.py"):
        trip.passed(name)
    trip.says("test_verify_tree.py", r"AssertionError: relative L2 error 0\.415 > bound 2\.41e-06 \(worst element at "
                                     r"request 0, token 2, head 0")
    trip.says("test_draft_extend_fp8.py", r"AssertionError: relative L2 error 0\.0112 > bound 2\.35e-06")


def _two_drafts(batch):
    batch["extend_lens"] = [2]
    batch["spec"].update(parents=[[-1, 0]], draft_token_num=2, spec_steps=1)


@prepares
def _wrapped_files(trip: RoundTrip) -> None:
    cases = ROOT / "docs/findings/cases"
    verify_case = cases / "sglang-lightning-single-token-verify.json"
    tbo_case = cases / "sglang-tbo-mixed-two-chunk.json"
    fp8 = trip.export(cases / "sglang-lightning-fp8-decode.json", "test_fp8_decode.py")
    idle = trip.export(cases / "sglang-hybrid-idle-lightning.json", "test_idle.py")
    trip.export(verify_case, "test_verify_one.py")
    trip.export(_variant(verify_case, trip.folder.parent / "two.json", _two_drafts), "test_verify_two.py")
    trip.export(tbo_case, "test_tbo_mixed.py")
    trip.export(_variant(tbo_case, trip.folder.parent / "extend.json", lambda batch: batch.update(mode="extend")),
                "test_tbo_extend.py")
    trip.copy(fp8, "test_fixed_fp8_decode.py", "fixing")
    trip.copy(idle, "test_fixed_idle.py", "fixing")
    # a decode of one request, which SGLang's splitter cuts into a half with no token (its bug, unsliced M-RoPE
    # positions, lives in 0.5.10 only): the file runs the empty half as the server does
    trip.export(cases / "sglang-tbo-mrope-unsliced.json", "test_tbo_one_decode.py")


@needs_kit
def test_wrapped_cases_export_to_files_that_fail_as_triaged_and_pass_when_fixed(trip):
    """Ledger entries of SGLang's wrappers live in 0.5.23, exported and run in a fresh process without this project,
    each failing as the harness's replay did.
    Lightning under SGLang's HybridLinearAttnBackend (built with SGLang's lightning kit):
    - sglang-lightning-fp8-decode: a decode over an fp8 cache rounds q and the output to e4m3 (relative L2 0.0468);
    - sglang-hybrid-idle-lightning: an idle batch crashes in the hybrid's forward on ``mixed_qkv``;
    - sglang-lightning-single-token-verify: a verify of one draft token leaves no per-step state (all zeros).
    With the fixes the triage pages propose (a patch, for copies of the first two only), the first two pass; the
    verify's batch with two draft tokens per request, which takes SGLang's verify path, passes.
    Two-batch overlap (TboAttnBackend over TorchNative, the batch split by SGLang's own splitter):
    - sglang-tbo-mixed-two-chunk: a MIXED batch's halves disagree with their tokens, and TorchNative crashes on the
      second half; the same batch as EXTEND, which SGLang splits with its two-chunk bookkeeping, passes."""
    fp8 = " ".join((trip.folder / "test_fp8_decode.py").read_text().split())  # the header's lines joined
    assert "--kv-cache-dtype fp8_e4m3" in fp8 and "full attention at layers [0, 1];" in fp8 and "LAYER_ID = 2" in fp8
    assert "Triage: docs/findings/sglang-hybrid-idle-lightning.md" in (trip.folder / "test_idle.py").read_text()
    assert "--speculative-eagle-topk 1" in (trip.folder / "test_verify_one.py").read_text()
    tbo = (trip.folder / "test_tbo_mixed.py").read_text()
    assert "--enable-two-batch-overlap" in tbo and "TboAttnBackend(primary=make()" in tbo

    for name in ("test_fp8_decode.py", "test_idle.py", "test_verify_one.py", "test_tbo_mixed.py"):
        trip.failed(name, only=True)
    trip.says("test_fp8_decode.py", r"AssertionError: lightning layer 2 outputs: relative L2 error 0\.0468 > bound")
    trip.says("test_idle.py", "AttributeError: 'NoneType' object has no attribute 'new_empty'")
    trip.says("test_verify_one.py",
              r"AssertionError: request 0 state after each draft token: relative L2 error 1 > bound")
    trip.passed("test_verify_two.py")
    trip.says("test_tbo_mixed.py",
              r"RuntimeError: The expanded size of the tensor \(5\) must match the existing size \(3\)")
    trip.passed("test_tbo_extend.py")
    trip.passed("test_tbo_one_decode.py")
    for name in ("test_fixed_fp8_decode.py", "test_fixed_idle.py"):
        trip.passed(name)


def _three_chains(batch: dict) -> None:
    """Three requests (one across a page boundary's first slot, one a page's last), two draft steps each."""
    batch.update(prefix_lens=[5, 40, 31], extend_lens=[2, 2, 2])
    batch["spec"].update(spec_steps=3, draft_token_num=2, parents=[[-1, 0]] * 3, accept_lens=[1, 1, 1])


@prepares
def _draft_plan_files(trip: RoundTrip) -> None:
    cases = ROOT / "docs/findings/cases"
    trtllm = trip.export(cases / "sglang-trtllm-mla-draft-steps-read-committed-prefix.json", "test_trtllm_mla_draft.py")
    cutedsl = trip.export(cases / "sglang-cutedsl-mla-draft-steps-read-committed-prefix.json", "test_cutedsl_draft.py")
    three = trip.export(_variant(cases / "sglang-trtllm-mla-draft-steps-read-committed-prefix.json",
                                 trip.folder.parent / "three.json", _three_chains), "test_trtllm_mla_three.py")
    for exported in (trtllm, cutedsl, three):
        trip.copy(exported, exported.name.replace("test_", "test_fixed_"), "fixing")


@needs_kit
def test_mla_draft_plan_cases_export_to_files_that_fail_as_triaged_and_pass_when_fixed(trip):
    """The MLA draft containers' ledger entries that plan on a CPU (TRT-LLM MLA's and CuTe DSL MLA's, planned as on
    Blackwell), exported and run in a fresh process without this project: SGLang's own DraftBackendFactory builds
    the container over the kit's MLA runner, plans the draft batch once, and each step's plan is judged by the
    harness's check against its own keys. Each fails as triaged (step 0 reads the committed prefix: 5 keys, not 6);
    with each step planned over seq_lens + step + 1 (the triage page's fix) each passes, three requests over two
    steps included."""
    text = (trip.folder / "test_trtllm_mla_draft.py").read_text()
    assert "--speculative-algorithm EAGLE --speculative-num-steps 2" in " ".join(text.split())
    assert "Triage: docs/findings/sglang-mla-draft-steps-read-committed-prefix.md" in text
    for name in ("test_trtllm_mla_draft.py", "test_cutedsl_draft.py"):
        trip.failed(name, only=True)
        trip.says(name, r"AssertionError: draft step 0: key lengths \[5\]\.\.\., expected \[6\]")
    trip.says("test_trtllm_mla_three.py", r"key lengths \[5, 40, 31\]\.\.\., expected \[6, 41, 32\]")
    for name in ("test_fixed_trtllm_mla_draft.py", "test_fixed_cutedsl_draft.py", "test_fixed_trtllm_mla_three.py"):
        trip.passed(name)


def _kda_mode(mode: str, prefix_lens: list[int], extend_lens: list[int]):
    return lambda batch: batch.update(mode=mode, prefix_lens=prefix_lens, extend_lens=extend_lens)


@prepares
def _kda_files(trip: RoundTrip) -> None:
    clamp = ROOT / "docs/findings/cases/sglang-kda-fused-intra-clamp.json"
    exported = trip.export(clamp, "test_kda_clamp.py")
    trip.copy(exported, "test_fixed_kda_clamp.py", "fixing")
    for mode, prefix_lens, extend_lens in (("mixed", [3, 7], [4, 1]), ("decode", [5, 9], [1, 1])):
        trip.export(_variant(clamp, trip.folder.parent / f"kda-{mode}.json", _kda_mode(mode, prefix_lens, extend_lens)),
                    f"test_kda_{mode}.py")


@needs_kit
def test_kda_cases_export_to_files_that_fail_as_triaged_and_pass_when_fixed(trip):
    """A KDA layer under SGLang's HybridLinearAttnBackend (built with SGLang's KDA kit), exported and run in a fresh
    process without this project: sglang-kda-fused-intra-clamp (open upstream, sgl-project/sglang#39971) fails as the
    harness's replay did, at the same token (relative L2 0.67, token 14 of 18); with the intra-chunk path the triage
    page measured correct, it passes. The same layers in a mixed batch whose requests carry their conv and recurrent
    states, and in a decode step (SGLang's recurrent step and conv update), pass: the file loads the states SGLang's
    pool held and checks them after the batch (the reference starts from the recorded states: had the file left
    SGLang's slots empty, these would fail). The mutant sglang_kda_prefix_conv_window_dropped was exported this way
    once (its file fails with the fault patched in) and is not in the round trip below: 23 s of CI for what these
    passes already show."""
    text = " ".join((trip.folder / "test_kda_clamp.py").read_text().split())
    assert "KDA layer 0 with 2 heads, key dim 16, value dim 16, a conv of width 4, the standard forget gate" in text
    assert "Triage: docs/findings/sglang-kda-fused-intra-clamp.md" in text
    trip.failed("test_kda_clamp.py", only=True)
    trip.says("test_kda_clamp.py", r"AssertionError: KDA layer 0 outputs: relative L2 error 0\.67 > bound 0\.0156 "
                                   r"\(worst element at \(14, 0, 2\)")
    for name in ("test_fixed_kda_clamp.py", "test_kda_mixed.py", "test_kda_decode.py"):
        trip.passed(name)


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
    # KDA's extend handed no safe-gate bound: the file builds the layer with its lower_bound, which the fault drops
    "sglang_kda_safe_gate_dropped": ("outputs", r"AssertionError: KDA layer \d+ outputs: (relative L2|element) error"),
    # a class-level leaf: the file runs the harness's class check, copied in
    "sglang_trtllm_mla_one_arg_mha_chunk": (
        "conformance", r"AssertionError: TRTLLMMLABackend.init_mha_chunk_metadata\(forward_batch\) does not take "
                       r"the call"),
}


@prepares
def _mutant_files(trip: RoundTrip) -> None:
    from harness.mutants.catalogue import MUTANTS
    from harness.mutants.run import run_mutant
    from search.profiles import PROFILES

    for name, (prop, _) in EXPORTED_MUTANTS.items():
        result = run_mutant(MUTANTS[name], PROFILES["ci"], "cpu", trip.folder.parent / "mutants", budget_s=600,
                            shrink_seconds=0)
        assert result.status == "killed" and result.case_file and result.property == prop, result
        exported = trip.export(result.case_file, f"test_{name}.py")
        trip.copy(exported, f"test_faulted_{name}.py", name)


@needs_kit
def test_mutant_cases_fail_under_their_fault_and_pass_without_it(trip):
    """`harness mutants --engine sglang` finds faults patched into SGLang's real classes (the dropped soft-cap of
    its MHA decode branch; a Triton verify planned from DFlash's widened host lengths; a Triton backend without its
    verify-buffer refresh; a Triton extend planned by its new-token counts (metadata); a Triton decode graph's replay
    that pads its real rows too (graph_metadata); KDA's extend without its safe gate's bound; TRT-LLM MLA's
    one-argument init_mha_chunk_metadata, read at class level); each exported case passes on its own (the real SGLang
    has no such fault) and fails with its fault patched in (its copy, in the second interpreter, which has the project for the faults)."""
    for name, (_, says) in EXPORTED_MUTANTS.items():
        trip.passed(f"test_{name}.py")
        trip.failed(f"test_faulted_{name}.py", only=True)
        trip.says(f"test_faulted_{name}.py", says)


@needs_kit
@pytest.mark.parametrize("status, raised, says, code", [
    (1, ("test_swa_decode.py", "AssertionError"), "fails on its own, as the harness's replay did", 0),
    (0, None, "passes on its own, NOT as the harness's replay did", 1),
    # a file that fails on its own setup (seen: a configuration step before SGLang had published its configuration)
    (1, ("test_swa_decode.py", "ValueError"), "fails on its own, NOT as the harness's replay did: a test failed with "
                                              "ValueError raised in the file's own check", 1),
    # an assert inside SGLang or its kit is not the file's check
    (1, ("/site-packages/sglang/srt/layers/attention/triton_backend.py", "AssertionError"),
     "NOT as the harness's replay did: a test failed with AssertionError raised in triton_backend.py", 1)])
def test_export_check_says_whether_the_file_fails_as_the_harness_did(tmp_path, capsys, monkeypatch, status, raised,
                                                                    says, code):
    """`export --check`'s verdict on what the fresh process reported (the process itself: the test above): a failing
    file must fail by its own check (or the crash it runs into), raised where pytest's --tb=line says, not on
    anything else."""
    import harness.export

    ran = []
    test = "test_swa_decode.py::test_outputs_match_float64_attention"
    output = "1 passed\n"
    if raised:
        path, name = raised
        output = (f"F\n===== FAILURES =====\n{path}:120: {name}: what it said\n===== warnings summary =====\n"
                  f"/site-packages/torch/jit/_script.py:365: 14 warnings\n=== short test summary info ===\n"
                  f"FAILED {test} - {name}: what it said\n1 failed\n")

    def run(path, extra=None, stand_ins=False):
        ran.append((path, tuple(extra or ())))
        return status, output
    monkeypatch.setattr(harness.export, "run_exported", run)
    out = tmp_path / "test_swa_decode.py"
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-triton-swa-decode.json"), "--out", str(out),
                 "--check"]) == code
    assert ran == [(out, harness.export.CHECK_ARGS)] and says in capsys.readouterr().out


@needs_kit
def test_export_check_agrees_on_a_real_failing_file_under_a_narrow_terminal(tmp_path, capsys, monkeypatch):
    """The run the review reproduced: outside CI pytest trims its summary to the terminal's width, which cut the
    exception's name, and --check called a file failing as triaged 'NOT as the harness's replay did'."""
    case = ROOT / "docs/findings/cases/sglang-trtllm-mla-draft-steps-read-committed-prefix.json"
    why = parse("sglang.trtllm_mla").unavailable_reason("cpu")
    if why:
        pytest.skip(why)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["export", str(case), "--out", str(tmp_path / "test_trtllm_mla_draft.py"), "--check"]) == 0
    assert "fails on its own, as the harness's replay did" in capsys.readouterr().out


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
def test_a_kda_case_on_a_release_before_its_files_kit_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """0.5.16's KDA kit builds its runner otherwise and its model hands the layer beta already through the sigmoid: a
    file written there would fail on its imports, not by the case's mechanism. Refused before anything is replayed."""
    import search.ledger

    monkeypatch.setattr(search.ledger, "engine_version", lambda: "0.5.16")
    assert main(["export", str(ROOT / "docs/findings/cases/sglang-kda-chunk-mixed-exp-bases.json"), "--out",
                 str(tmp_path / "test_x.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "on SGLang 0.5.16: the file builds with the KDA unit-test kit as SGLang " \
        "0.5.22 and later ship it" in err, err
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
