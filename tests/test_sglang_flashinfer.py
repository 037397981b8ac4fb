"""SGLang's FlashInfer leaves on a CPU: their declarations and registration, and the parts of the adapter
that run without a GPU (the MLA runner over shared pools, SGLang's own choice of MLA forward method, where a graph's
plan is read). The leaves themselves run on the GPU (`harness run --profile gpu --backends sglang.flashinfer ...`)."""

from __future__ import annotations

import sys

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from backends.registry import LEAVES, all_compositions, leaf_capabilities, parse
from backends.sglang import runtime
from batch.forward_batch import ModelRunner
from batch.spec import BatchSpec, ForwardMode, MLALayer
from engine.materialize import materialize

FLASHINFER_LEAVES = ("sglang.flashinfer", "sglang.flashinfer_mla")


@pytest.mark.parametrize("name", FLASHINFER_LEAVES)
def test_declared_as_sglang_cuda_leaves(name):
    caps = leaf_capabilities(name)
    assert name in LEAVES and caps.engine == "sglang"
    assert caps.devices == {"cuda"} and "flashinfer" in caps.requires
    assert caps.dtypes == {"bfloat16", "float16"}  # FlashInfer has no float32 attention
    assert caps.attention_kinds == ({"mha"} if name == "sglang.flashinfer" else {"mla"})
    # Every mode listed is served. Both backends' draft workers run the draft loop (FlashInferMultiStepDraftBackend,
    # FlashInferMLAMultiStepDraftBackend) and EAGLE v2's draft extend (the MLA one's over its fixed window: seen on an
    # H200, harness-out/gpu100.sh and gpu102.sh)
    served = {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE}
    assert caps.modes == served | {ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE}
    assert caps.fixed_width_draft_extend == (name == "sglang.flashinfer_mla")
    # The graphs SGLang captures for each: the MLA backend's out_graph raises for anything but decode/idle and verify
    # (its draft container's steps capture decodes)
    graphs = {ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY}
    drafting = {ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE} if name == "sglang.flashinfer" \
        else {ForwardMode.DRAFT_DECODE}
    assert caps.cuda_graph_modes == graphs | drafting
    assert caps.cuda_graph_modes <= caps.modes
    reason = caps.unavailable_reason("cpu")
    assert reason is not None and "cuda" in reason
    terms = {str(c) for c in all_compositions()}
    assert {name, f"tbo({name})", f"graph({name})", f"graph(tbo({name}))"} <= terms
    assert parse(f"tbo({name})").engine == "sglang"


def _mla_case(prefix: tuple[int, ...], mode=ForwardMode.EXTEND):
    layers = (MLALayer(0, 4, 16, 8, 32, 16), MLALayer(1, 4, 16, 8, 32, 16))
    extend = (1,) * len(prefix) if mode is ForwardMode.DECODE else (3,) * len(prefix)
    spec = BatchSpec(mode, prefix, extend, layers, page_size=4, dtype="float32", seed=3)
    return spec, materialize(spec)


def test_mla_runner_shares_the_latent_pool():
    pytest.importorskip("sglang")
    if runtime.unavailable_reason():
        pytest.skip(runtime.unavailable_reason())
    spec, case = _mla_case((5, 0))
    runner = runtime.make_runner(ModelRunner.of(case.forward_batch, spec.layers), "flashinfer")
    assert runner.use_mla_backend and runner.model_config.attention_arch.name == "MLA"
    cfg = runner.model_config
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 16, 8, 16)
    assert cfg.scaling == spec.layers[0].sm_scale
    ours = case.forward_batch.token_to_kv_pool.k_buffers
    for layer_id in (0, 1):  # the same storage, not a copy: SGLang's writes are what the harness checks
        assert runner.token_to_kv_pool.get_key_buffer(layer_id).data_ptr() == ours[layer_id].data_ptr()


@pytest.mark.parametrize(("prefix", "mode", "method"), [
    ((0, 0), ForwardMode.EXTEND, "MHA_ONE_SHOT"),  # no prefix: ragged prefill over the new tokens
    ((5, 0), ForwardMode.EXTEND, "MLA"),  # a prefix under the chunked-prefix threshold: absorbed
    ((5, 2), ForwardMode.DECODE, "MLA"),
])
def test_sglang_chooses_the_mla_forward_method(prefix, mode, method):
    pytest.importorskip("sglang")
    if runtime.unavailable_reason():
        pytest.skip(runtime.unavailable_reason())
    from backends.sglang.flashinfer import SglangFlashInferMLA
    from backends.sglang.mla import forward_method

    spec, case = _mla_case(prefix, mode)
    leaf = SglangFlashInferMLA(ModelRunner.of(case.forward_batch, spec.layers))
    leaf.sgl_runner = runtime.make_runner(leaf.model_runner, leaf.sglang_name)
    sfb = leaf.translate(case.forward_batch)
    assert forward_method(leaf.sgl, sfb, spec.layers[0]).name == method


def test_wrapper_plan_reads_the_plan_not_the_slack():
    import torch

    from backends.sglang.flashinfer import wrapper_plan

    # A paged prefill wrapper as SGLang plans it: indices with 256 slots of slack, last-page lengths all 1.
    paged = SimpleNamespace(_qo_indptr_buf=torch.tensor([0, 2, 5, 0, 0]), _paged_kv_indptr_buf=torch.tensor([0, 0, 3]),
                            _paged_kv_indices_buf=torch.arange(3 + 256), _paged_kv_last_page_len_buf=torch.ones(8))
    meta = wrapper_plan(paged, kv_includes_new_tokens=False)
    assert meta.qo_indptr.tolist() == [0, 2, 5] and meta.kv_indices.tolist() == [0, 1, 2]
    assert meta.kv_last_page_len is None and not meta.kv_includes_new_tokens
    # The MLA wrapper's names; a wrapper without readable buffers gives only what it has.
    mla = SimpleNamespace(_qo_indptr_buf=torch.tensor([0, 1]), _kv_indptr_buf=torch.tensor([0, 4]),
                          _kv_indices_buf=torch.tensor([9, 8, 7, 6]))
    assert wrapper_plan(mla, kv_includes_new_tokens=True).kv_indices.tolist() == [9, 8, 7, 6]
    assert wrapper_plan(SimpleNamespace(_qo_indptr_buf=None), kv_includes_new_tokens=True).kv_indptr is None


def test_sgl_kernel_stand_in_answers_with_sglangs_own_and_is_inert_elsewhere():
    import importlib.machinery

    stub = runtime._StubPackage("sgl_kernel", runtime._SGL_KERNEL_SHIMS)
    utils = stub.create_module(importlib.machinery.ModuleSpec("sgl_kernel.utils", stub, is_package=True))
    assert utils.is_arch_support_pdl is runtime._is_arch_support_pdl
    top = stub.create_module(importlib.machinery.ModuleSpec("sgl_kernel", stub, is_package=True))
    with pytest.raises(RuntimeError, match="inert stub"):
        top.merge_state_v2()  # a kernel nobody adapted fails loudly


def test_an_inert_ipython_lets_matplotlib_draw_the_reports_plots(monkeypatch, tmp_path):
    """A GPU image without IPython gets the stand-in, which matplotlib then asks for its version and shell when the
    report draws its plots: it must answer as IPython outside a shell does (measured: the inert one raised a
    TypeError at the end of `harness run --mutant` on the H200)."""
    import importlib.machinery

    from matplotlib.figure import Figure

    stub = runtime._StubPackage("IPython", runtime._REAL_WHEN_ABSENT["IPython"])
    ipython = stub.create_module(importlib.machinery.ModuleSpec("IPython", stub, is_package=True))
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    Figure(figsize=(2, 2)).savefig(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    with pytest.raises(RuntimeError, match="inert stub"):
        ipython.embed()  # anything else stays inert


def test_flashinfer_ledger_conditions_are_narrow():
    from batch.spec import MHALayer, SpecInput
    from properties.verdict import Verdict
    from search import ledger

    capped = (MHALayer(0, 8, 2, 128, 128), MHALayer(1, 8, 2, 128, 128, logit_cap=5.0))
    spec = BatchSpec(ForwardMode.DECODE, (30,), (1,), capped, dtype="bfloat16")
    fail = lambda where, **d: Verdict("outputs", False, "out of bounds", 1.0, 1e-2, where, details=d)  # noqa: E731
    known = lambda comp, sp, v, mode="decode", prop="outputs": ledger.match(comp, mode, prop, sp, v, "cuda")  # noqa: E731
    assert known("sglang.flashinfer", spec, fail("layer 1: request 0")).id == "sglang-flashinfer-softcap-dropped"
    assert known("sglang.flashinfer", spec, fail("layer 0: request 0")) is None  # an uncapped layer: a finding
    assert known("sglang.triton", spec, fail("layer 1: request 0")) is None
    windowed = (MHALayer(0, 8, 2, 128, 128, sliding_window=2),)
    long_extend = BatchSpec(ForwardMode.EXTEND, (0,), (4,), windowed, dtype="bfloat16")
    short_extend = BatchSpec(ForwardMode.EXTEND, (9,), (3,), windowed, dtype="bfloat16")
    assert known("sglang.flashinfer", long_extend, fail("layer 0: request 0"), "extend").id == \
        "sglang-flashinfer-ragged-window-dropped"
    assert known("sglang.flashinfer", short_extend, fail("layer 0: request 0"), "extend") is None
    mla = (MLALayer(0, 4, 16, 8, 32, 16),)
    tree = BatchSpec(ForwardMode.TARGET_VERIFY, (5,), (3,), mla, dtype="bfloat16",
                     spec=SpecInput(3, 2, 1, ((-1, 0, 0),), (1,)))
    chain = BatchSpec(ForwardMode.TARGET_VERIFY, (5,), (3,), mla, dtype="bfloat16",
                      spec=SpecInput(3, 1, 2, ((-1, 0, 1),), (1,)))
    assert known("sglang.flashinfer_mla", tree, fail("layer 0"), "target_verify").id == \
        "sglang-flashinfer-mla-verify-ignores-tree"
    assert known("sglang.flashinfer_mla", chain, fail("layer 0"), "target_verify") is None
    # A graphed draft extend's plan: its window list of a trimmed request taken from the row's start (the metadata
    # properties' words, seen on an H200, harness-out/gpu74.sh); no window layer is no window list
    draft = BatchSpec(ForwardMode.DRAFT_EXTEND, (2,), (2,), windowed, dtype="bfloat16",
                      spec=SpecInput(2, 1, 1, ((-1, 0),), (2,)))
    plan = lambda first: Verdict(  # noqa: E731
        "graph_metadata", False, "at replay at 2 x 2 (1 padded row(s)): SglangFlashInfer: request 0: window_kv_indices "
                                 f"hold [1, 4, 6]...{first}, expected the last 3 of its 4 keys' slots [4, 6, 3]...")
    assert known("graph(sglang.flashinfer)", draft, plan(" (its first ones)"), "draft_extend", "graph_metadata").id \
        == "sglang-flashinfer-draft-extend-graph-window"
    # any other wrong list (another row's slots, a stale buffer) is a finding
    assert known("graph(sglang.flashinfer)", draft, plan(""), "draft_extend", "graph_metadata") is None
    unwindowed = dataclasses.replace(draft, layers=capped)
    assert known("graph(sglang.flashinfer)", unwindowed, plan(" (its first ones)"), "draft_extend", "graph_metadata") \
        is None
    refresh = ["update_verify_buffers_to_fill_after_draft"]
    conf = lambda hidden: Verdict("conformance", False, "hidden", details={"hidden": hidden})  # noqa: E731
    assert known("sglang.flashinfer_mla", spec, conf(refresh), "extend", "conformance").id == \
        "sglang-flashinfer-no-verify-refresh"
    assert known("sglang.flashinfer", spec, conf(refresh + ["forward"]), "extend", "conformance") is None


class _Mode:
    """SGLang's ForwardMode as the graph-plan readers ask it (name, is_decode_or_idle)."""

    def __init__(self, name):
        self.name = name

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")


def _wrapper(indptr, indices, qo=None):
    w = SimpleNamespace(_paged_kv_indptr_buf=torch.tensor(indptr), _paged_kv_indices_buf=torch.tensor(indices))
    if qo is not None:
        w._qo_indptr_buf = torch.tensor(qo)
    return w


def test_graph_plans_are_read_from_the_wrappers_of_the_replayed_size_and_mode():
    # SGLang points forward_metadata at a graph's wrappers only while capturing them: after capturing 4 then 2, a replay
    # of 4 must be read from the size-4 set, not forward_metadata

    from backends.sglang.flashinfer import graph_wrappers
    four, two = [_wrapper([0, 1, 2, 3, 4], [5, 6, 7, 8])], [_wrapper([0, 1, 2], [9, 9])]
    verify, extend = [_wrapper([0, 3], [1, 2, 3], qo=[0, 2])], [_wrapper([0, 4], [4, 5, 6, 7], qo=[0, 2])]
    backend = SimpleNamespace(decode_cuda_graph_metadata={4: four, 2: two}, prefill_cuda_graph_metadata={1: verify},
                              draft_extend_cuda_graph_metadata={1: extend})
    batch = lambda mode, bs: SimpleNamespace(forward_mode=_Mode(mode), batch_size=bs)  # noqa: E731
    assert graph_wrappers(backend, batch("DECODE", 4)) is four
    assert graph_wrappers(backend, batch("IDLE", 2)) is two
    assert graph_wrappers(backend, batch("TARGET_VERIFY", 1)) is verify
    assert graph_wrappers(backend, batch("DRAFT_EXTEND_V2", 1)) is extend
    assert graph_wrappers(backend, batch("DECODE", 8)) is None  # never captured: the caller falls back
    del backend.draft_extend_cuda_graph_metadata  # up to 0.5.22 draft-extend graphs sit beside verify's
    assert graph_wrappers(backend, batch("DRAFT_EXTEND_V2", 1)) is verify
    backend.decode_cuda_graph_metadata = {4: four[0]}  # the MLA backend keeps one wrapper per size
    assert graph_wrappers(backend, batch("DECODE", 4)) == four


def test_an_mla_decode_replay_is_read_from_the_host_indptrs_it_was_planned_with():
    # fast_mla_decode_plan plans from host indptrs and refills only the index buffer; the wrapper's device kv_indptr
    # keeps the capture's fill values (one key per row), which no kernel reads

    from backends.sglang.flashinfer import SglangFlashInferMLA
    wrapper = SimpleNamespace(_kv_indptr_buf=torch.tensor([0, 1, 2]), _kv_indices_buf=torch.tensor([1, 2, 0, 7, 7]),
                              _qo_indptr_buf=torch.tensor([0, 1, 2]))
    leaf = object.__new__(SglangFlashInferMLA)
    leaf.inner = SimpleNamespace(decode_cuda_graph_metadata={2: wrapper}, forward_metadata=None,
                                 fast_decode_kwargs={"qo_indptr_cpu": torch.tensor([0, 1, 2]),
                                                     "kv_indptr_cpu": torch.tensor([0, 2, 3])})
    leaf.batches, leaf.planned_graph = {0: SimpleNamespace(forward_mode=_Mode("DECODE"), batch_size=2)}, True
    plan = leaf.planned_metadata()
    assert plan.kv_indptr.tolist() == [0, 2, 3] and plan.kv_indices.tolist() == [1, 2, 0]
    leaf.planned_graph = False  # an eager plan is forward_metadata's (none here)
    assert leaf.planned_metadata().kv_indptr is None


def test_an_mla_dflash_verify_replay_is_read_from_the_host_indptrs_sglang_rebuilds_for_it():
    # A DFlash verify replays through fast_mla_decode_plan from host indptrs SGLang builds from the batch's widened
    # host lengths and keeps nowhere (_build_fast_verify_plan_kwargs): the adapter asks that function for them; the
    # wrapper's device kv_indptr keeps the capture's fill values (seen on an H200 as a 16k-token replay read as 3 keys)

    from backends.sglang.flashinfer import SglangFlashInferMLA
    asked = []

    def fast_verify(*, bs, spec_info, seq_lens_cpu, in_capture):
        asked.append((bs, seq_lens_cpu.tolist(), in_capture))
        return {"qo_indptr_cpu": torch.tensor([0, 2, 4]), "kv_indptr_cpu": torch.tensor([0, 3, 5])}
    wrapper = SimpleNamespace(_kv_indptr_buf=torch.tensor([0, 3, 6]), _kv_indices_buf=torch.tensor([4, 5, 6, 8, 9, 0]),
                              _qo_indptr_buf=torch.tensor([0, 2, 4]))
    leaf = object.__new__(SglangFlashInferMLA)
    leaf.inner = SimpleNamespace(prefill_cuda_graph_metadata={2: wrapper}, forward_metadata=None,
                                 _build_fast_verify_plan_kwargs=fast_verify)
    verify = SimpleNamespace(forward_mode=_Mode("TARGET_VERIFY"), batch_size=2, spec_info=object(),
                             seq_lens_cpu=torch.tensor([3, 5]))
    leaf.batches, leaf.planned_graph = {0: verify}, True
    plan = leaf.planned_metadata()
    assert asked == [(2, [3, 5], False)]
    assert plan.kv_indptr.tolist() == [0, 3, 5] and plan.kv_indices.tolist() == [4, 5, 6, 8, 9]
    leaf.inner._build_fast_verify_plan_kwargs = lambda **kwargs: None  # an EAGLE verify: the wrapper's own plan
    assert leaf.planned_metadata().kv_indptr.tolist() == [0, 3, 6]


def test_a_window_models_window_wrapper_is_read_beside_the_full_one():
    """With a sliding window SGLang plans two wrappers, the first for window layers (_get_wrapper_idx): its lists are
    read as the plan's window lists, checked as the window invariant checks them (properties/metadata.py); without a
    window, or with one wrapper, the plan is the full wrapper's alone."""
    from backends.sglang.flashinfer import graph_plan, with_window
    from batch.spec import ForwardMode
    from properties.metadata import check_plan

    window, full = _wrapper([0, 3, 5], [8, 3, 1, 2, 9], qo=[0, 1, 2]), _wrapper([0, 4, 6], [7, 8, 3, 1, 4, 2])
    fb = SimpleNamespace(batch_size=2, extend_num_tokens=2, num_padding=0, extend_seq_lens_cpu=[1, 1],
                         extend_prefix_lens_cpu=[3, 1], state_slots=None, page_size=1, forward_mode=ForwardMode.DECODE,
                         req_to_token=torch.tensor([[7, 8, 3, 1], [4, 2, 0, 0]]), req_pool_indices=torch.tensor([0, 1]),
                         seq_lens_cpu=torch.tensor([4, 2]), spec_info=None)
    backend = SimpleNamespace(decode_cuda_graph_metadata={2: [window, full]})
    plan = graph_plan(backend, SimpleNamespace(forward_mode=_Mode("DECODE"), batch_size=2), window=3)
    assert plan.window == 3 and plan.window_kv_indices.tolist() == [8, 3, 1, 2, 9]
    # request 1's window list holds a slot of another row: named by the same check as Triton's
    assert check_plan(plan, fb) == ("request 1: window_kv_indices hold [2, 9]..., expected the last 2 of its 2 keys' "
                                    "slots [4, 2]...")
    window._paged_kv_indices_buf = torch.tensor([8, 3, 1, 4, 2])
    assert check_plan(graph_plan(backend, SimpleNamespace(forward_mode=_Mode("DECODE"), batch_size=2), 3), fb) is None
    assert with_window(plan, [full], 3) is plan and with_window(plan, [window, full], None) is plan


def test_a_wrappers_buffers_no_invariant_reads_are_named():
    """A FlashInfer wrapper keeps more than its indptrs and indices (workspaces, a verify's custom mask and its indptr,
    the last-page lengths): the plan read from it lists those tensors as unread, the window wrapper's apart, so the
    metadata verdict says what it did not check, as Triton's and FlashAttention's do."""
    from backends.sglang.flashinfer import with_window, wrapper_plan
    from properties.metadata import unread_note

    full = _wrapper([0, 2], [4, 5], qo=[0, 2])
    full._custom_mask_buf, full._mask_indptr_buf = torch.ones(4, dtype=torch.uint8), torch.tensor([0, 4])
    full._float_workspace_buffer, full._workspace_size = torch.empty(16, dtype=torch.uint8), 16  # not a tensor: not named
    window = _wrapper([0, 1], [5], qo=[0, 2])
    window._paged_kv_last_page_len_buf = torch.ones(1, dtype=torch.int32)
    plan = wrapper_plan(full, kv_includes_new_tokens=False)
    assert plan.unread == ("_custom_mask_buf", "_float_workspace_buffer", "_mask_indptr_buf")
    both = with_window(plan, [window, full], 1)
    assert both.unread == ("_custom_mask_buf", "_float_workspace_buffer", "_mask_indptr_buf",
                           "window wrapper._paged_kv_last_page_len_buf")
    assert "prefill wrapper._custom_mask_buf" in unread_note([("prefill wrapper", plan)])
    assert wrapper_plan(_wrapper([0, 1], [5], qo=[0, 1]), kv_includes_new_tokens=True).unread == ()
