"""SGLang's TRT-LLM MHA backend (backends/sglang/flashinfer.py, ``SglangTrtllmMha``): every property where FlashInfer
and a GPU of its kernels' architectures are present (run on an H200: harness-out/gpu77.sh to gpu80.sh), its planning
elsewhere (a plan-level leaf: built with FlashInfer's wrapper classes as inert stand-ins, planned eagerly and for
graphs, its Triton page-table kernels interpreted on a CPU). What a CPU checks of it: which level the leaf takes and
why, its plans (eager, captured, replayed, under SGLang's TBO) against the invariants, that a wrong plan fails them, and
that nothing of FlashInfer's can be called through the stand-ins. And SGLang's TRT-LLM MLA backend
(``SglangTrtllmMla``), a plan-level leaf wherever the harness runs: the same for its eager plans, and its classes read
under the hybrid."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.registry import leaf_capabilities, parse
from backends.sglang import flashinfer as fi
from batch.spec import BatchSpec, ForwardMode, MHALayer, MLALayer, SpecInput, draft_forest
from properties import PROPERTIES
from search.matrix import matrix
from search.profiles import PROFILES
from tests.plan_checks import assert_eager_plan_holds, on_machine

pytest.importorskip("sglang")


@pytest.mark.parametrize("installed, gpu, capability, expected", [
    (False, True, (9, 0), "FlashInfer is not installed"),
    (True, False, (9, 0), "no CUDA GPU is visible"),
    (True, True, (8, 0), "this GPU is SM80"),
    (True, True, RuntimeError("NVML unavailable"), "could not be read (RuntimeError: NVML unavailable)"),
    (True, True, (9, 0), None),  # Hopper: XQA decode, fmha_v2 prefill
    (True, True, (10, 0), None),  # Blackwell: TRT-LLM-gen
    (True, True, (12, 0), None),
])
def test_the_leaf_runs_only_where_flashinfer_and_a_gpu_of_its_kernels_are(monkeypatch, installed, gpu, capability,
                                                                          expected):
    on_machine(monkeypatch, {"flashinfer": installed}, gpu, capability)
    why = fi.trtllm_mha_unrunnable()
    if expected is None:
        assert why is None
        # an fp8 cache where it has been run: SM90's XQA decode (the H200), not Blackwell's or SM120's kernels
        fp8 = "fp8_e4m3" in fi._trtllm_mha_declared().kv_cache_dtypes
        assert fp8 == (capability[0] == 9)
    else:
        assert why.startswith(fi.TRTLLM_MHA_KERNELS) and why.endswith(expected), why
        assert "fp8_e4m3" in fi._trtllm_mha_declared().kv_cache_dtypes  # its planning over an fp8 pool, anywhere


def _plan_level():
    caps = leaf_capabilities("sglang.trtllm_mha")
    if caps.plan_only is None:
        pytest.skip("TRT-LLM MHA's kernels can run here: the leaf is built (its GPU rows run)")
    why = parse("sglang.trtllm_mha").unavailable_reason("cpu")
    if why:
        pytest.skip(why)
    return caps


LAYERS = (MHALayer(0, 4, 2, 64, 64),)


def _spec(mode, prefix, extend, page_size=16, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), LAYERS, page_size=page_size, dtype="bfloat16", seed=3, **kw)


def _window(D: int, B: int) -> SpecInput:
    """EAGLE v2's draft extend of B requests, each its whole window of D tokens (a fixed width)."""
    return dataclasses.replace(_chain(D, B), accept_lens=(D,) * B)


def _chain(D: int, B: int) -> SpecInput:
    return SpecInput(draft_token_num=D, spec_steps=D, topk=1, parents=tuple((-1,) + tuple(range(D - 1))
                                                                           for _ in range(B)), accept_lens=(1,) * B)


def test_where_it_cannot_run_its_planning_runs_and_the_reason_is_said():
    caps = _plan_level()
    assert caps.plan_only == fi.trtllm_mha_unrunnable() and caps.plan_only.startswith(fi.TRTLLM_MHA_KERNELS)
    assert [c.__name__ for c in fi.SglangTrtllmMha.engine_classes()] == ["TRTLLMHAAttnBackend"]
    m = matrix("cpu", PROFILES["ci"],
               ["sglang.trtllm_mha", "graph(sglang.trtllm_mha)", "graph(tbo(sglang.trtllm_mha))"])
    names = {(r.composition.name, r.property.name) for r in m.rows}
    assert ("sglang.trtllm_mha", "metadata") in names and ("sglang.trtllm_mha", "conformance") in names
    assert {p for c, p in names if c == "graph"} == {"graph_metadata"}
    # its graphs, and the draft loop's under the draft graph runner
    assert {r.mode for r in m.rows if r.composition.name == "graph"} == \
        set(fi.TRTLLM_MHA_GRAPH_MODES) | {ForwardMode.DRAFT_DECODE}
    batch = _spec(ForwardMode.EXTEND, (0,), (1,))
    verdict = PROPERTIES["conformance"].run(parse("sglang.trtllm_mha"), batch, "cpu")
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("batch", [
    _spec(ForwardMode.EXTEND, (0, 5, 17), (7, 3, 1)),
    _spec(ForwardMode.EXTEND, (0, 40), (9, 30), page_size=32),
    _spec(ForwardMode.DECODE, (9, 40, 64), (1, 1, 1)),
    _spec(ForwardMode.MIXED, (4, 7), (3, 1), page_size=64),
    _spec(ForwardMode.TARGET_VERIFY, (6, 11), (4, 4), spec=_chain(4, 2)),
], ids=["extend", "extend-page32", "decode", "mixed", "verify"])
@pytest.mark.parametrize("composition", ["sglang.trtllm_mha", "tbo(sglang.trtllm_mha)"])
def test_its_eager_plans_satisfy_the_invariants(batch, composition):
    _plan_level()
    assert_eager_plan_holds(composition, batch)


@pytest.mark.parametrize("batch", [
    _spec(ForwardMode.DECODE, (1,), (1,)),  # one request in a graph of two: one padded row, and one half of it
    _spec(ForwardMode.DECODE, (9, 40, 70), (1, 1, 1)),
    _spec(ForwardMode.TARGET_VERIFY, (6,), (3,), spec=_chain(3, 1)),
], ids=["decode-padded", "decode", "verify-padded"])
@pytest.mark.parametrize("composition", ["graph(sglang.trtllm_mha)", "graph(tbo(sglang.trtllm_mha))"])
def test_its_replayed_graph_plans_satisfy_the_invariants(batch, composition):
    # Its graphs plan only inside the graph (the fused update_trtllm_mha_graph_metadata kernel): under TBO, a CPU's
    # replay must run what the capture recorded, both halves included (SglangTbo.init_forward_metadata_in_graph); run
    # over SGLang's replay view instead, the first half kept the capture's fill-value plan ("key lengths [1],
    # expected [2]" on the decode-padded batch)
    _plan_level()
    verdict = PROPERTIES["graph_metadata"].run(parse(composition), batch, "cpu")
    assert verdict.ok, str(verdict)


def _draft(prefix, steps, page_size=16) -> BatchSpec:
    forest = draft_forest(1, steps)
    return _spec(ForwardMode.DRAFT_DECODE, prefix, (len(forest),) * len(prefix), page_size=page_size,
                 spec=SpecInput(len(forest), 1, steps, (forest,) * len(prefix), (1,) * len(prefix)))


@pytest.mark.parametrize("composition, prop", [("sglang.trtllm_mha", "metadata"),
                                               ("graph(sglang.trtllm_mha)", "graph_metadata")])
@pytest.mark.parametrize("offset", [True, False], ids=["as-sglang", "step-offset-lost"])
def test_its_draft_steps_read_their_chain_and_one_that_does_not_fails(monkeypatch, composition, prop, offset):
    # TRTLLMHAAttnMultiStepDraftBackend gives step i speculative_step_id = i, added to the committed lengths: every
    # step's keys are the prefix and the chain through its own token, eager and replayed (a graph of 4 requests, 1
    # padded). Without the offset a step plans the committed prefix alone, as SGLang's MLA containers do (ledger
    # sglang-*-draft-steps-read-committed-prefix): the same properties must fail.
    _plan_level()
    if not offset:
        from backends.sglang import runtime

        runtime.load()
        import sglang.srt.layers.attention.trtllm_mha_backend as trt

        built = trt.TRTLLMHAAttnBackend.__init__

        def init(self, *args, **kwargs):
            built(self, *args, **kwargs)
            self.speculative_step_id = -1  # seq_lens + (step_id + 1): the committed prefix
        monkeypatch.setattr(trt.TRTLLMHAAttnBackend, "__init__", init)
    verdict = PROPERTIES[prop].run(parse(composition), _draft((5, 40, 3), 3), "cpu")
    assert verdict.ok is offset, str(verdict)
    if not offset:
        assert "draft step 0: key lengths [5, 40, 3" in verdict.reason, str(verdict)
        # what the ledger's MLA draft entries read (properties/metadata.py draft_plans_read), eager and from the
        # replayed steps' plans with the padded row held apart (a replayed step read as a replayed plan: draft.py
        # step_plans; FlashInfer MLA's read as eager ones showed the capture's counts on the H200)
        assert verdict.details.get("draft_step_reads") == "committed prefix", str(verdict.details)


@pytest.mark.parametrize("fault, expected", [
    ("page_table", "kv_indices hold"),  # each request's pages read from the next request's row
    ("cache_seqlens", "key lengths"),  # one key too few
])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "replayed"])
def test_a_wrong_trtllm_plan_fails_the_metadata_properties(monkeypatch, fault, expected, graph):
    _plan_level()
    from backends.sglang import runtime

    runtime.load()  # SGLang imported with the stand-ins a CPU install needs, whichever test ran before in this process
    import sglang.srt.layers.attention.trtllm_mha_backend as trt

    def wrong(metadata):
        if fault == "page_table":
            metadata.page_table.copy_(metadata.page_table.roll(1, 0))
        else:
            metadata.cache_seqlens_int32.sub_(1)

    if graph:
        planned = trt.TRTLLMHAAttnBackend._apply_cuda_graph_metadata

        def apply(self, *args, **kwargs):
            planned(self, *args, **kwargs)
            wrong(self.forward_metadata)
        monkeypatch.setattr(trt.TRTLLMHAAttnBackend, "_apply_cuda_graph_metadata", apply)
    else:
        planned = trt.TRTLLMHAAttnBackend.init_forward_metadata

        def init(self, forward_batch):
            planned(self, forward_batch)
            wrong(self.forward_metadata)
        monkeypatch.setattr(trt.TRTLLMHAAttnBackend, "init_forward_metadata", init)
    batch = _spec(ForwardMode.DECODE, (9, 40), (1, 1))
    composition = "graph(sglang.trtllm_mha)" if graph else "sglang.trtllm_mha"
    verdict = PROPERTIES["graph_metadata" if graph else "metadata"].run(parse(composition), batch, "cpu")
    assert not verdict.ok and expected in verdict.reason, str(verdict)


def test_flashinfers_stand_ins_plan_nothing_and_are_gone_after_the_build():
    _plan_level()
    from backends.sglang import runtime

    runtime.load()
    import sglang.srt.layers.attention.flashinfer_backend as fib

    before = {name: getattr(fib, name, None) for name in fi.FLASHINFER_WRAPPER_CLASSES}
    with fi.flashinfer_absent():
        wrapper = fib.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), "NHD")
    with pytest.raises(RuntimeError, match="BatchDecodeWithPagedKVCacheWrapper.plan was called"):
        wrapper.plan
    assert {name: getattr(fib, name, None) for name in fi.FLASHINFER_WRAPPER_CLASSES} == before
    # and a layer never reaches a kernel: the plan-level leaf refuses to run one
    verdict = PROPERTIES["outputs"].applies(parse("sglang.trtllm_mha"), ForwardMode.DECODE)
    assert verdict and verdict.startswith("only its planning runs"), verdict


def test_its_plan_is_read_as_flashattentions_over_sglangs_own_metadata_class():
    # The adapter reads TRTLLMMHAMetadata with flash_attention_plan, by its field names: if SGLang renames one, this
    # fails on a CPU, not first on a GPU runner
    from backends.sglang import runtime
    from backends.sglang.adapter import FLASH_ATTENTION_READ, flash_attention_plan

    runtime.load()
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMMHAMetadata

    page = 16
    meta = TRTLLMMHAMetadata()
    assert FLASH_ATTENTION_READ <= set(vars(meta)), sorted(FLASH_ATTENTION_READ - set(vars(meta)))
    # a decode of two requests, 3 and 20 keys: pages [5] and [2, 7] of a table 4 pages wide, as _fill_page_table_device
    # writes it (the row's tail unwritten)
    meta.cache_seqlens_int32 = torch.tensor([3, 20], dtype=torch.int32)
    meta.cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    meta.cu_seqlens_k = torch.tensor([0, 3, 23], dtype=torch.int32)
    meta.page_table = torch.tensor([[5, -1, -1, -1], [2, 7, -1, -1]], dtype=torch.int32)
    meta.swa_page_table = meta.page_table.clone()
    plan = flash_attention_plan(meta, page)
    assert plan.kv_indptr.tolist() == [0, 1, 3] and plan.kv_indices.tolist() == [5, 2, 7]
    assert plan.kv_indices_are_pages and plan.key_lens.tolist() == [3, 20]
    assert "swa_page_table" in plan.unread  # a window model's table: planned, not yet checked, and said so


def test_a_tbo_half_refuses_to_run_a_plan_level_leafs_kernels_as_the_leaf_does():
    # A TBO half borrows its leaf's _run, which reads the leaf's declaration (a missing one was an adapter error on
    # every tbo(sglang.trtllm_mha) row of the H200, where the leaf is built)
    _plan_level()
    from properties.metadata import planned

    batch = _spec(ForwardMode.DECODE, (9, 40), (1, 1))
    backend, fb = planned(parse("tbo(sglang.trtllm_mha)"), batch, "cpu")
    half = backend.children[0]
    assert half.capabilities is backend.primary.capabilities
    with pytest.raises(RuntimeError, match="plan-level leaf"):
        half._run(None, None, None, None, fb, True)


def test_a_tbo_half_runs_a_built_leafs_kernels_through_the_leafs_run(monkeypatch):
    # Where the leaf is built (a GPU), its _run (SglangPlanOnly's) hands the half on to SGLang's call
    _plan_level()
    from dataclasses import replace

    from backends.sglang.adapter import SglangBackend
    from properties.metadata import planned

    batch = _spec(ForwardMode.DECODE, (9, 40), (1, 1))
    backend, fb = planned(parse("tbo(sglang.trtllm_mha)"), batch, "cpu")
    monkeypatch.setattr(fi.SglangTrtllmMha, "capabilities", replace(fi.SglangTrtllmMha.capabilities, plan_only=None))
    ran = []
    monkeypatch.setattr(SglangBackend, "_run", lambda self, *args: ran.append(self) or "ran")
    half = backend.children[1]
    assert half._run(None, None, None, None, fb, True) == "ran" and ran == [half]


# ---- TRT-LLM MLA (sglang.trtllm_mla): a plan-level leaf everywhere the harness runs ----
MLA = (MLALayer(0, 8, 64, 32, 128, 64),)


def _mla_spec(mode, prefix, extend, page_size=64, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), MLA, page_size=page_size, dtype="bfloat16", seed=5, **kw)


def _mla_plan_level():
    why = parse("sglang.trtllm_mla").unavailable_reason("cpu")
    if why:
        pytest.skip(why)
    return leaf_capabilities("sglang.trtllm_mla")


def test_trtllm_mla_plans_here_and_says_why_its_kernels_do_not_run():
    caps = _mla_plan_level()
    assert caps.plan_only == fi.TRTLLM_MLA_KERNELS and not caps.class_only
    m = matrix("cpu", PROFILES["ci"], ["sglang.trtllm_mla", "tbo(sglang.trtllm_mla)"])
    assert {r.property.name for r in m.rows} == {"metadata", "conformance"}
    # every mode it serves, its draft worker's loop and EAGLE v2's draft extend too (its container plans its steps
    # on a CPU from 0.5.23)
    assert {r.mode for r in m.rows if r.property.name == "metadata"} == \
        set(fi.FLASHINFER_MLA_MODES) | {ForwardMode.DRAFT_EXTEND}
    # Under SGLang's linear hybrid (Kimi Linear's MLA beside KDA) its classes are read, as a class-level leaf's: the
    # hybrid's class must reach every member TRT-LLM MLA overrides (its init_mha_chunk_metadata among them)
    hybrid = parse("hybrid(sglang.trtllm_mla,sglang.kda)")
    if hybrid.unavailable_reason("cpu") is None:
        assert hybrid.support().class_only and "read at class level" in hybrid.support().class_only
        m = matrix("cpu", PROFILES["ci"], [str(hybrid)])
        assert {(r.property.name, r.mode) for r in m.rows} == {("conformance", ForwardMode.EXTEND)}


@pytest.mark.parametrize("batch", [
    _mla_spec(ForwardMode.EXTEND, (0, 5, 70), (7, 3, 1)),
    _mla_spec(ForwardMode.DECODE, (9, 40, 130), (1, 1, 1)),
    _mla_spec(ForwardMode.DECODE, (31, 64), (1, 1), page_size=32),
    _mla_spec(ForwardMode.MIXED, (4, 7), (3, 1)),
    _mla_spec(ForwardMode.TARGET_VERIFY, (6, 11), (4, 4), spec=_chain(4, 2)),
    # EAGLE v2's draft extend: every request's whole window (accepted tokens first, the rest padding)
    _mla_spec(ForwardMode.DRAFT_EXTEND, (6, 70), (3, 3), spec=_window(3, 2)),
], ids=["extend", "decode", "decode-page32", "mixed", "verify", "draft-extend"])
# CuTe DSL MLA overrides TRT-LLM MLA's kernels only: the same planning, its own rows
@pytest.mark.parametrize("composition", ["sglang.trtllm_mla", "tbo(sglang.trtllm_mla)", "sglang.cutedsl_mla"])
def test_trtllm_mla_eager_plans_satisfy_the_invariants(batch, composition):
    _mla_plan_level()
    why = parse(composition).unavailable_reason("cpu") or parse(composition).unsupported_reason(batch)
    if why:
        pytest.skip(why)  # cutedsl_mla: 0.5.2x's; a draft extend under TBO: never (the draft worker's own backend)
    assert_eager_plan_holds(composition, batch)


@pytest.mark.parametrize("fault, mode, expected", [
    ("block_kv_indices", ForwardMode.DECODE, "kv_indices hold"),  # each request's pages read from the next one's row
    ("seq_lens_k", ForwardMode.TARGET_VERIFY, "key lengths"),  # the drafts' keys one short
    ("cum_seq_lens", ForwardMode.EXTEND, "qo_indptr"),  # the ragged prefill's query rows one off
    ("cu_seqlens_q", ForwardMode.DRAFT_EXTEND, "qo_indptr"),  # a draft extend's query windows one off
    ("seq_lens_k", ForwardMode.DRAFT_EXTEND, "key lengths"),  # its windows' last keys not read
])
def test_a_wrong_trtllm_mla_plan_fails_the_metadata_property(monkeypatch, fault, mode, expected):
    _mla_plan_level()
    import sglang.srt.layers.attention.trtllm_mla_backend as trt

    planned = trt.TRTLLMMLABackend.init_forward_metadata

    def init(self, forward_batch):
        planned(self, forward_batch)
        if fault == "block_kv_indices":
            table = self.forward_decode_metadata.block_kv_indices
            table.copy_(table.roll(1, 0))
        elif fault == "seq_lens_k":
            self.forward_decode_metadata.seq_lens_k.sub_(1)
        elif fault == "cu_seqlens_q":
            self.forward_decode_metadata.cu_seqlens_q[1:] += 1
        else:
            self.forward_prefill_metadata.cum_seq_lens[1:] += 1
    monkeypatch.setattr(trt.TRTLLMMLABackend, "init_forward_metadata", init)
    batch = {ForwardMode.DECODE: _mla_spec(ForwardMode.DECODE, (9, 70), (1, 1)),
             ForwardMode.TARGET_VERIFY: _mla_spec(ForwardMode.TARGET_VERIFY, (6, 11), (3, 3), spec=_chain(3, 2)),
             ForwardMode.EXTEND: _mla_spec(ForwardMode.EXTEND, (0, 5), (4, 2)),
             ForwardMode.DRAFT_EXTEND: _mla_spec(ForwardMode.DRAFT_EXTEND, (6, 70), (3, 3), spec=_window(3, 2))}[mode]
    verdict = PROPERTIES["metadata"].run(parse("sglang.trtllm_mla"), batch, "cpu")
    assert not verdict.ok and expected in verdict.reason, str(verdict)


def test_flashinfers_mla_stand_ins_are_gone_after_the_build():
    _mla_plan_level()
    import sglang.srt.layers.attention.flashinfer_mla_backend as mla

    from properties.metadata import planned

    before = {name: getattr(mla, name, None) for name in fi.FLASHINFER_MLA_WRAPPER_CLASSES}
    backend, _ = planned(parse("sglang.trtllm_mla"), _mla_spec(ForwardMode.DECODE, (9,), (1,)), "cpu")
    assert {name: getattr(mla, name, None) for name in fi.FLASHINFER_MLA_WRAPPER_CLASSES} == before
    assert mla.torch is torch  # the unpinned stand-in only while it was built
    with pytest.raises(RuntimeError, match="BatchMLAPagedAttentionWrapper.plan was called"):
        backend.inner.decode_wrapper.plan


def test_the_trtllm_mha_verify_replay_mutant_is_caught_on_a_cpu():
    # harness mutants --engine sglang's fault in TRT-LLM MHA's fused graph-metadata call: a replayed verify plans each
    # request's keys one short. Its graphs are planned on a CPU (the plan-level leaf), so the CPU catches it.
    _plan_level()
    from harness.mutants.catalogue import SGLANG_CATALOGUE

    batch = _spec(ForwardMode.TARGET_VERIFY, (6, 20), (3, 3), spec=_chain(3, 2))
    composition = parse("graph(sglang.trtllm_mha)")
    assert PROPERTIES["graph_metadata"].run(composition, batch, "cpu").ok
    with next(m for m in SGLANG_CATALOGUE if m.name == "sglang_trtllm_mha_verify_replay_drops_last_draft").patch():
        verdict = PROPERTIES["graph_metadata"].run(composition, batch, "cpu")
    assert not verdict.ok and "key lengths" in verdict.reason, str(verdict)


def test_a_plan_level_draft_container_that_cannot_be_built_here_is_the_adapters_error(monkeypatch):
    # The draft container is built inside the leaf's stand-ins too (engine_build_scope); what SGLang's constructor
    # lacks there is the stand-ins' gap (a FlashInfer MLA wrapper class missing from them was a NameError in its
    # constructor, read as SGLang's crash before): marked, so the verdict is an adapter error
    _mla_plan_level()
    from backends.sglang import runtime

    sgl = runtime.load()

    def lacking(self):
        raise NameError("name 'BatchPrefillWithRaggedKVCacheWrapper' is not defined")
    monkeypatch.setattr(sgl.DraftBackendFactory, "create_decode_backend", lacking)
    forest = draft_forest(1, 2)
    batch = _mla_spec(ForwardMode.DRAFT_DECODE, (5,), (len(forest),), page_size=32,
                      spec=SpecInput(len(forest), 1, 2, (forest,), (1,)))
    verdict = PROPERTIES["metadata"].run(parse("sglang.trtllm_mla"), batch, "cpu")
    assert not verdict.ok and "adapter_error" in verdict.details, str(verdict)
