"""The SGLang adapter's pure parts, which run without SGLang; its rows join the matrix (tests/test_matrix.py)
where the extra is installed (bash ci/install-sglang.sh) and are listed as unavailable, with why, elsewhere."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from backends.registry import CompositionError, all_compositions, parse
from batch.forward_batch import ModelRunner
from backends.sglang import runtime
from backends.sglang.adapter import retrieve_links
from batch.spec import (BatchSpec, ForwardMode, KdaLayer, LightningLayer, LinearLayer, Mamba2Layer, MHALayer,
                        ShortConvLayer, SpecInput)
from engine.materialize import materialize
from properties import PROPERTIES
from properties.run import run_case
from search.matrix import matrix, mode_reason, strategy_options
from search.profiles import PROFILES


def test_retrieve_links_follow_the_tree():
    # root 0 with children 1 and 2; 3 is a child of 1
    first_child, next_sibling = retrieve_links([-1, 0, 0, 1])
    assert first_child == [1, 3, -1, -1]
    assert next_sibling == [-1, 2, -1, -1]
    assert retrieve_links([-1, 0, 1]) == ([1, 2, -1], [-1, -1, -1])  # a chain has no siblings


def test_sglang_terms_are_sglangs_own_classes_only():
    assert str(parse("sglang.triton")) == "sglang.triton"
    assert parse("tbo(sglang.triton)").engine == "sglang"  # SGLang's TboAttnBackend, not the harness's
    assert parse("graph(tbo(sglang.triton))").engine == "sglang"
    with pytest.raises(CompositionError, match="cannot mix"):
        parse("hybrid(sglang.triton,linear_torch)")
    with pytest.raises(CompositionError, match="are adapted so far"):
        parse("tbo(graph(sglang.triton))")
    assert parse("tbo(hybrid(sglang.triton,sglang.gdn))").engine == "sglang"
    terms = {str(c) for c in all_compositions()}
    assert {"sglang.torch_native", "sglang.triton", "tbo(sglang.triton)", "tbo(sglang.torch_native)",
            "graph(sglang.triton)", "graph(tbo(sglang.triton))",
            "hybrid(sglang.triton,sglang.gdn)", "tbo(hybrid(sglang.triton,sglang.gdn))"} <= terms
    assert "sglang.gdn" not in terms  # SGLang builds its GDN backend inside its hybrid wrapper only
    # TorchNativeAttnBackend captures no graph (the base's init_cuda_graph_state raises): declared, so no row
    assert not any(t.startswith("graph") and "sglang.torch_native" in t for t in terms)
    # asked for by name, the row that cannot exist says why
    m = matrix("cpu", PROFILES["ci"], ["graph(sglang.torch_native)"])
    assert m.unavailable == [("graph(sglang.torch_native)",
                              "sglang.torch_native captures no CUDA graph (declares no cuda_graph_modes, no prefill graph)")]


def test_sglang_graph_modes_are_declared_from_sglangs_graph_runners():
    graph = parse("graph(sglang.triton)").support().modes
    # decode/verify/draft-extend graphs, extends through the breakable prefill graph, the draft loop through the draft
    # graph runner
    assert graph == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE,
                     ForwardMode.EXTEND, ForwardMode.DRAFT_DECODE}
    # The draft loop's container is built from one backend: a graph over a wrapper has no draft_decode rows
    assert ForwardMode.DRAFT_DECODE not in parse("graph(tbo(sglang.triton))").support().modes
    # The GDN hybrid: SGLang's hybrid plans decode/idle and verify graphs only (hybrid_linear_attn_backend.py:911)
    assert parse("graph(hybrid(sglang.triton,sglang.gdn))").support().modes == {
        ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE, ForwardMode.EXTEND}
    assert ForwardMode.EXTEND not in parse("graph(tbo(sglang.triton))").support().modes
    # SGLang's draft worker plans draft extends with its own backend, never under TboAttnBackend
    assert ForwardMode.DRAFT_EXTEND not in parse("graph(tbo(sglang.triton))").support().modes
    assert ForwardMode.DRAFT_EXTEND not in parse("tbo(sglang.triton)").support().modes
    assert {ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE} <= parse("sglang.torch_native").support().modes


def test_unavailable_reason_names_the_install_command_and_never_a_version(monkeypatch):
    monkeypatch.setattr(runtime, "installed_version", lambda: None)
    assert runtime.INSTALL_HINT in runtime.unavailable_reason()
    # Any version string: only the features decide (tests/test_sglang_features.py)
    monkeypatch.setattr(runtime, "installed_version", lambda: "0.4.0")
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(runtime.features, "missing", lambda names: ("tbo (two-batch overlap): gone",))
    assert runtime.unavailable_reason() == "sglang 0.4.0 lacks tbo (two-batch overlap): gone"
    monkeypatch.setattr(runtime.features, "missing", lambda names: ())
    assert runtime.unavailable_reason() is None


needs_sglang = pytest.mark.skipif(runtime.unavailable_reason() is not None,
                                  reason=f"SGLang extra: {runtime.unavailable_reason()}")
MHA = MHALayer(0, 4, 2, 32, 32)
DRAFT_EXTEND = BatchSpec(ForwardMode.DRAFT_EXTEND, (4, 1, 9), (3, 1, 2), (MHA,),
                         spec=SpecInput(3, 1, 2, ((-1, 0, 1),) * 3, (3, 1, 2)), seed=11)


# Scheduling settings SGLang's attention and speculative code reads that a server may leave unset: each read falls back
# (``or 0`` in base_spec_worker.py and dspark_planner.py; mqa_logits_utils.py serves DSA's indexer, not adapted)
UNSET_SCHEDULE_SETTINGS = {"max_running_requests", "mem_fraction_static"}


@needs_sglang
def test_every_scheduling_setting_sglangs_backends_read_is_published():
    """The adapter publishes what a server would (0.5.22 on: the runtime context). A setting it forgets reads None in
    SGLang's code, which fails there, as a finding against SGLang rather than an adapter error: ``page_size`` was such
    a setting (the draft containers read it, their kv-index kernel divided by None)."""
    import re

    from backends.sglang import compat, features

    if features.chosen("server_args") != "runtime_context":
        pytest.skip("before 0.5.22 the server args are one ServerArgs dataclass, published with its defaults")
    spec = BatchSpec(ForwardMode.DECODE, (5,), (1,), (MHA,), page_size=4)
    case = materialize(spec)
    runtime.make_runner(ModelRunner.of(case.forward_batch, spec.layers), "triton")
    root = features.package_root() / "srt"
    read = {name for folder in ("layers/attention", "speculative") for path in (root / folder).rglob("*.py")
            for name in re.findall(r"get_schedule\(\)\.(\w+)", path.read_text(encoding="utf-8", errors="replace"))}
    assert "page_size" in read
    unset = {name for name in read - UNSET_SCHEDULE_SETTINGS
             if compat.server_setting(runtime.load(), "schedule", name) is None}
    assert not unset, f"settings SGLang's backends read that the adapter leaves unset: {sorted(unset)}"
    assert compat.server_setting(runtime.load(), "schedule", "page_size") == 4


@needs_sglang
def test_server_args_are_published_again_only_when_they_differ_or_another_publication_replaced_them():
    """Publishing builds SGLang's config bags from every field (a third of a CPU case's time, issue 26): a set of
    arguments is published once while it stays installed. Other arguments, or the same after another publication
    replaced them, are published anew: every runner reads what its server would have published."""
    from backends.sglang import compat, features

    if features.chosen("server_args") != "runtime_context":
        pytest.skip("before 0.5.22 the server args are one ServerArgs dataclass, built for each runner")
    sgl = runtime.load()
    first = compat.publish_server_args(sgl, attention_backend="triton", page_size=4)
    assert compat.publish_server_args(sgl, attention_backend="triton", page_size=4) is first
    sgl.get_context().override("a test", page_size=16)  # a setting changed over the publication
    first = compat.publish_server_args(sgl, attention_backend="triton", page_size=4)
    assert compat.server_setting(sgl, "schedule", "page_size") == 4
    assert compat.publish_server_args(sgl, attention_backend="triton", page_size=4) is first
    other = compat.publish_server_args(sgl, attention_backend="triton", page_size=8)
    assert other is not first and compat.server_setting(sgl, "schedule", "page_size") == 8
    sgl.get_context().override_server_args(page_size=2).install()  # a publication the adapter did not make
    again = compat.publish_server_args(sgl, attention_backend="triton", page_size=8)
    assert again is not other and compat.server_setting(sgl, "schedule", "page_size") == 8
    spec = BatchSpec(ForwardMode.DECODE, (5,), (1,), (MHA,), page_size=4)
    runners = [runtime.make_runner(ModelRunner.of(materialize(spec).forward_batch, spec.layers), "triton")
               for _ in range(2)]
    assert runners[0].server_args is runners[1].server_args
    assert compat.server_setting(sgl, "schedule", "page_size") == 4


@needs_sglang
def test_draft_extend_is_sglangs_eagle_draft_extend_input(device):
    from backends.sglang.adapter import SglangTriton
    case = materialize(DRAFT_EXTEND, device)
    backend = SglangTriton(ModelRunner.of(case.forward_batch, DRAFT_EXTEND.layers))
    backend.init_forward_metadata(case.forward_batch)
    sfb = backend.batches[id(case.forward_batch)]
    assert sfb.forward_mode == backend.sgl.ForwardMode.DRAFT_EXTEND_V2
    info = sfb.spec_info
    assert type(info).__name__ == "EagleDraftExtendInput"
    assert info.num_accept_tokens_cpu == [3, 1, 2] and info.extend_seq_lens_tensor.tolist() == [3, 1, 2]
    assert info.num_correct_drafts.tolist() == [2, 0, 1] and info.num_tokens_per_req == 3
    assert sfb.seq_lens.tolist() == [7, 2, 11]  # prefix + accepted: the length after the extend writes
    # SGLang plans it as an extend: the prefix from the cache, qo_indptr from the accepted counts
    meta = backend.planned_metadata()
    assert meta.qo_indptr.tolist() == [0, 3, 4, 6] and meta.kv_indptr.tolist() == [0, 4, 5, 14]


@needs_sglang
@pytest.mark.parametrize("term", ["sglang.triton", "tbo(sglang.triton)"])
def test_an_empty_idle_batch_is_never_planned(term, device):
    # SGLang's EagerRunner._execute_idle drops the plan of an empty idle batch instead of planning it
    # (planning it would make Triton divide by the batch size: docs/findings/sglang-idle-empty-batch-triage.md).
    idle = BatchSpec(ForwardMode.IDLE, (), (), (MHA,))
    assert PROPERTIES["outputs"].run(parse(term), idle, device).ok


@needs_sglang
@pytest.mark.parametrize("term, spec", [
    ("graph(sglang.triton)", BatchSpec(ForwardMode.DRAFT_EXTEND, (4, 1, 9), (3, 3, 3), (MHA,),
                                       spec=SpecInput(3, 1, 2, ((-1, 0, 1),) * 3, (3, 3, 3)), seed=12)),
], ids=["draft_extend"])
def test_sglang_graph_replay_runs_sglangs_three_methods(term, spec, device):
    runtime.load()  # SGLang imported the adapter's way (an inert torchvision where the real one is absent)
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    calls = []
    originals = {name: getattr(TritonAttnBackend, name) for name in
                 ("init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph")}

    def spy(name):
        def method(self, *args, **kwargs):
            calls.append((name, kwargs.get("in_capture")))
            return originals[name](self, *args, **kwargs)
        return method
    with contextlib.ExitStack() as stack:
        for name in originals:
            stack.enter_context(mock.patch.object(TritonAttnBackend, name, spy(name)))
        verdict = PROPERTIES["graph_replay"].run(parse(term), spec, device)
    assert verdict.ok, str(verdict)
    names = [n for n, _ in calls]
    assert names[0] == "init_cuda_graph_state"
    assert ("init_forward_metadata_out_graph", True) in calls and ("init_forward_metadata_out_graph", False) in calls
    assert "init_forward_metadata_in_graph" in names


# Batches a graph replays with one row of padding: the verify's trees are of topk 2 (a token's position is its
# request's committed length plus its depth, not its index in the block)
REPLAYED = {
    "decode": BatchSpec(ForwardMode.DECODE, (5, 9, 2), (1, 1, 1), (MHA,), page_size=4, graph_padding=1, seed=3),
    "target_verify": BatchSpec(ForwardMode.TARGET_VERIFY, (5, 9), (4, 4), (MHA,), graph_padding=1, seed=3,
                               spec=SpecInput(4, 2, 2, ((-1, 0, 0, 1), (-1, 0, 1, 0)), (2, 3))),
    "draft_extend": BatchSpec(ForwardMode.DRAFT_EXTEND, (4, 1), (3, 3), (MHA,), graph_padding=1, seed=12,
                              spec=SpecInput(3, 1, 2, ((-1, 0, 1),) * 2, (3, 3))),
}


@needs_sglang
@pytest.mark.parametrize("term", ["graph(sglang.triton)", "graph(tbo(sglang.triton))"])
@pytest.mark.parametrize("mode", sorted(REPLAYED))
def test_a_replays_real_rows_loaded_wrong_are_the_adapters_error_not_sglangs(term, mode, device, monkeypatch):
    """The real rows of a replay's static batch are what the scheduler handed the graph runner (backends/sglang/
    handover.py, check_replay). Loaded wrong by the harness's runner, here one position past each token's, the
    replay differed from the eager run (relative L2 0.15 for a decode, 0.248 for a verify before its positions were
    checked against its trees), a failure SGLang's code would have been blamed for; it is the adapter's error
    instead."""
    from engine import graph_runner

    spec = REPLAYED[mode]
    support = parse(term).support()
    if spec.mode not in support.modes & support.cuda_graph_modes:
        pytest.skip(f"{term} runs no {mode} graph here: {mode_reason(parse(term), spec.mode)}")
    assert PROPERTIES["graph_replay"].run(parse(term), spec, device).ok  # loaded right: SGLang's replay agrees
    load = graph_runner.load_token_rows

    def shifted(runner, fb, inputs, t):
        load(runner, fb, inputs, t)
        runner.positions[:t] += 1

    monkeypatch.setattr(graph_runner, "load_token_rows", shifted)
    verdict = PROPERTIES["graph_replay"].run(parse(term), spec, device)
    assert not verdict.ok and "adapter_error" in verdict.details, str(verdict)
    assert "BrokenHandover" in verdict.reason and "real rows of the graph runner's" in verdict.reason
    assert "positions is" in verdict.reason


@needs_sglang
def test_a_verify_whose_positions_do_not_follow_its_trees_is_the_adapters_error(device, monkeypatch):
    """Eagerly too: a verify's token sits at its request's committed length plus its depth in the draft tree
    (SGLang's build_tree_kernel_efficient), not at its index in the block."""
    from engine import materialize as mat

    spec = REPLAYED["target_verify"]
    assert PROPERTIES["outputs"].run(parse("sglang.triton"), spec, device).ok
    real = mat.query_positions

    def by_index(s):  # prefix + index in the block: right for a chain, wrong for these trees
        out = real(s)
        if s.mode is ForwardMode.TARGET_VERIFY:
            D = s.spec.draft_token_num
            out = torch.tensor([p + j for p in s.prefix_lens for j in range(D)], dtype=out.dtype)
        return out

    monkeypatch.setattr(mat, "query_positions", by_index)
    verdict = PROPERTIES["outputs"].run(parse("sglang.triton"), spec, device)
    assert not verdict.ok and "adapter_error" in verdict.details, str(verdict)
    assert "BrokenHandover" in verdict.reason and "positions is" in verdict.reason


@needs_sglang
def test_a_replays_request_table_is_read_at_its_first_replay_only(device, monkeypatch):
    """The request table is shared by every replay of a static batch and not restored between them: checked at the
    first replay, so that a write of SGLang's into it during a replay is not read back as the adapter's error."""
    from backends.sglang import handover
    from backends.sglang.adapter import SglangTriton

    tables = []
    monkeypatch.setattr(handover, "check_replay", lambda sfb, padding, loc, table, *rest: tables.append(table))
    spec = BatchSpec(ForwardMode.DECODE, (5, 9, 2), (1, 1, 1), (MHA,), page_size=4, seed=3)
    case = materialize(spec, device)
    backend = SglangTriton(ModelRunner.of(case.forward_batch, spec.layers))
    backend.init_forward_metadata(case.forward_batch)  # builds SGLang's runner over the harness's request table
    for _ in range(3):  # one static batch replayed three times
        backend.check_replay(case.forward_batch, None, in_capture=False)
    assert tables[0] is backend.sgl_runner.req_to_token_pool.req_to_token and tables[1:] == [None, None]


@needs_sglang
def test_graph_capture_is_no_larger_than_sglangs_request_pool(device):
    # Nine requests in a pool of eleven: SGLang captures sizes 1, 2, 4, 8 and the pool's 11, never 16, and its
    # Triton backend sizes kv_indptr by the pool. Capturing at 16 crashed every such replay on the H100
    # ("expanded size (12) must match (16)", triton_backend.py:526).
    decode = BatchSpec(ForwardMode.DECODE, (1,) * 9, (1,) * 9, (MHA,), seed=3)
    assert PROPERTIES["graph_replay"].run(parse("graph(sglang.triton)"), decode, device).ok


@needs_sglang
def test_a_real_row_with_the_padding_length_is_not_padding(device):
    # SGLang's hybrid counts a graph's padded rows from the replay view's num_padding, and only without it from
    # seq_lens == its fill value 1 (hybrid_linear_attn_backend.py:758-763). A verify of a one-token prompt has
    # seq_len 1: counted as padding, its GDN rows got slot -1 and NaN output until the adapter passed num_padding.
    chain = SpecInput(3, 1, 2, ((-1, 0, 1),) * 2, (3, 3))
    verify = BatchSpec(ForwardMode.TARGET_VERIFY, (5, 1), (3, 3), (LinearLayer(0, 2, 4, 16, 16), MHALayer(1, 4, 2, 16, 16)),
                       dtype="float16", spec=chain, seed=4)
    verdict = PROPERTIES["graph_replay"].run(parse("graph(hybrid(sglang.triton,sglang.gdn))"), verify, device)
    assert verdict.ok, str(verdict)


@needs_sglang
def test_prefill_graph_runs_attention_in_sglangs_graph_breaks(device):
    # An extend through SGLang's breakable prefill graph: both layer kinds take their graph-break paths (eager on
    # the live plan, real tokens only) over a static batch padded to the token bucket. On the CPU nothing is
    # captured; this is the routing a real capture relies on, and the padding it must ignore.
    runtime.load()
    from sglang.srt.layers import radix_attention, radix_linear_attention
    calls = []
    linear_impl = radix_linear_attention._linear_attention_with_output_impl
    full_tokens = radix_attention.attention_query_tokens  # called only inside RadixAttention._eager_attention

    def linear_spy(mixed_qkv, a, b, output, attention_layer, forward_batch):
        calls.append(("linear", mixed_qkv.shape[0], forward_batch.global_num_token_non_padded_cpu))
        return linear_impl(mixed_qkv, a, b, output, attention_layer, forward_batch)

    def full_spy(forward_batch, n):
        calls.append(("full", forward_batch.input_ids.shape[0], n))
        return full_tokens(forward_batch, n)
    extend = BatchSpec(ForwardMode.EXTEND, (3, 0), (5, 4), (LinearLayer(0, 2, 4, 16, 16), MHALayer(1, 4, 2, 16, 16)),
                       dtype="float16", seed=6)
    with mock.patch.object(radix_linear_attention, "_linear_attention_with_output_impl", linear_spy), \
            mock.patch.object(radix_attention, "attention_query_tokens", full_spy):
        verdict = PROPERTIES["graph_replay"].run(parse("graph(hybrid(sglang.triton,sglang.gdn))"), extend, device)
    assert verdict.ok, str(verdict)
    assert ("linear", 16, 9) in calls and ("full", 16, 9) in calls  # 9 real tokens in a bucket of 16


@needs_sglang
@pytest.mark.parametrize("kind", ["linear", "full"])
def test_a_layer_that_does_not_break_the_prefill_graph_fails(device, kind):
    # Without SGLang's eager_on_graph on a layer's eager entry (the GDN layer before sgl-project/sglang#25110), its
    # kernels are captured into a segment and every replay reuses the capture batch's plan: the capture counts that
    # layer's breaks, on the CPU too (nothing captured there, the same decorator consulted).
    sgl = runtime.load()
    owner, method = ((sgl.RadixLinearAttention, "_eager_linear_attention") if kind == "linear"
                     else (sgl.RadixAttention, "_eager_attention"))
    if method not in owner.__dict__:
        pytest.skip(f"this SGLang's {owner.__name__} breaks the graph through a split op, not {method} (0.5.22)")
    extend = BatchSpec(ForwardMode.EXTEND, (3, 0), (5, 4), (LinearLayer(0, 2, 4, 16, 16), MHALayer(1, 4, 2, 16, 16)),
                       dtype="float16", seed=6)
    with mock.patch.object(owner, method, owner.__dict__[method].__wrapped__):
        verdict = PROPERTIES["graph_replay"].run(parse("graph(hybrid(sglang.triton,sglang.gdn))"), extend, device)
    assert not verdict.ok
    layer = "layer 0 (linear)" if kind == "linear" else "layer 1 (mha)"
    assert f"{layer} took 0 eager graph break(s)" in verdict.reason, verdict.reason


@needs_sglang
def test_tree_branches_start_from_the_states_before_the_verify(device):
    # SGLang's GDN verify advances the committed conv state in place; the chain re-run of each branch must start
    # from the state the verify started from (the H100 sweep of 2026-11-24 saw the root node "differ" by 105%
    # before the property restored the states).
    chain = SpecInput(3, 1, 2, ((-1, 0, 1), (-1, 0, 1)), (2, 1))  # linear layers verify chains only
    verify = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 6), (3, 3), (LinearLayer(0, 2, 4, 16, 16), MHALayer(1, 4, 2, 16, 16)),
                       dtype="float16", spec=chain, seed=2)
    verdict = PROPERTIES["tree_branch"].run(parse("hybrid(sglang.triton,sglang.gdn)"), verify, device)
    assert verdict.ok, str(verdict)



def _with_interpreter_shims() -> None:
    """Skip unless Triton's CPU interpreter is on (the shims apply to it only); load SGLang, which installs them."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the shims apply to Triton's CPU interpreter only")
    runtime.load()

@needs_sglang
def test_interpreted_kernels_are_bounds_checked():
    # An out-of-bounds access under Triton's CPU interpreter corrupts the heap and aborts the process far from
    # the cause; the adapter's shim turns it into an error naming the kernel (it found
    # docs/findings/sglang-tbo-gdn-child-start-loc.md), and leaves in-bounds kernels alone.
    _with_interpreter_shims()
    import triton
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    copy[(1,)](src, dst, 8, BLOCK=16)
    assert torch.equal(dst, src)
    with pytest.raises(InterpreterError, match="copy loads 4 element"):
        copy[(1,)](src, dst, 12, BLOCK=16)


@needs_sglang
def test_the_bounds_shim_takes_a_block_pointers_bare_mask():
    # Triton 3.6's interpreter loads through a block pointer (tl.make_block_ptr, which fla's chunk kernels use) with
    # its mask as a bare numpy array, not a handle; the shim read the handle's .data and every fla kernel crashed
    # with "'memoryview' object has no attribute 'dtype'": 45 false findings on SGLang's GDN rows in a CPU
    # campaign (triton 3.6.0, docs/false-findings-campaign.md). Both forms must pass, be bounds-checked, and keep
    # their form.
    _with_interpreter_shims()
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from backends.sglang import interpreter_shims as shims

    bare = np.array([1, 0, 2], dtype=np.uint8)
    assert shims._as_bool(bare).tolist() == [True, False, True] and isinstance(shims._as_bool(bare), np.ndarray)
    handle = interpreter.TensorHandle(bare, tl.int1)
    assert shims._as_bool(handle).data.tolist() == [True, False, True]
    ok = np.ones(3, dtype=bool)
    assert shims._as_bool(ok) is ok
    ptrs = interpreter.TensorHandle(np.array([16, 24, 1 << 40], dtype=np.uint64), tl.pointer_type(tl.float32))
    shims._ranges[:] = [(16, 32, "x")]
    try:
        shims._check(ptrs, np.array([True, True, False]), "loads")  # the far address is masked off
        with pytest.raises(shims.OutOfBounds, match="1 element"):
            shims._check(ptrs, np.array([True, False, True]), "loads")
    finally:
        shims._ranges.clear()

    @triton.jit
    def rows(src, dst, n, BLOCK: tl.constexpr):
        block = tl.make_block_ptr(src, shape=(n,), strides=(1,), offsets=(0,), block_shape=(BLOCK,), order=(0,))
        x = tl.load(block, boundary_check=(0,), padding_option="zero")
        tl.store(dst + tl.arange(0, BLOCK), x)

    src, dst = torch.arange(5, dtype=torch.float32), torch.full((8,), -1.0)
    rows[(1,)](src, dst, 5, BLOCK=8)
    assert dst.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


@needs_sglang
def test_interpreted_fp8_casts_round_as_a_gpu_does():
    # SGLang's Triton kernels cast q and P to the cache's fp8 dtype. Triton 3.8.0's interpreter drops the carry of
    # a mantissa rounded up into an odd exponent field (1.97 -> 1.0), which tripled the CPU rows' fp8 errors
    # (docs/findings/sglang-triton-draft-extend-v2.md); the adapter's shim rounds to nearest even and saturates,
    # as the GPU's cvt.rn.satfinite does.
    _with_interpreter_shims()
    import triton
    import triton.language as tl

    @triton.jit
    def cast(src, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs).to(dst.dtype.element_ty))

    x = torch.tensor([1.97, 0.4965, 126.24, 0.0146, 1.0625, 1000.0, -float("inf"), float("nan")])
    out = torch.empty(8, dtype=torch.float8_e4m3fn)
    cast[(1,)](x, out, BLOCK=8)
    assert out.float()[:7].tolist() == [2.0, 0.5, 128.0, 0.013671875, 1.0, 448.0, -448.0]  # 1.0625: a tie, to even
    assert out.float()[7].isnan()
    for source in (torch.float16, torch.bfloat16):
        cast[(1,)](x.to(source), out, BLOCK=8)
        want = x.to(source).float().clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (source, out.float())


@needs_sglang
def test_interpreted_bfloat16_dots_and_casts_take_the_values_not_the_bits():
    # The interpreter keeps bfloat16 as uint16 bits: its tl.dot multiplied the bits as integers and its casts to and
    # from float16 converted them (1.0 -> 16256.0). SGLang's KDA chunk kernels cast blocks to bfloat16 before their
    # dots whatever the model's dtype, so every CPU KDA prefill of more than 16 tokens came out NaN. And libdevice's
    # functions are declarations there (None): KDA's gate kernel takes its sigmoid through libdevice.exp.
    _with_interpreter_shims()
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a, b, c, N: tl.constexpr):
        rows, cols = tl.arange(0, N)[:, None], tl.arange(0, N)[None, :]
        x = tl.load(a + rows * N + cols).to(tl.bfloat16)  # float16 -> bfloat16
        y = tl.load(b + rows * N + cols).to(tl.bfloat16)
        tl.store(c + rows * N + cols, tl.dot(x, y).to(tl.float16))

    a = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).half()
    b = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).half()
    c = torch.empty(16, 16, dtype=torch.float16)
    dot[(1,)](a, b, c, N=16)
    want = (a.bfloat16().float() @ b.bfloat16().float()).half()
    torch.testing.assert_close(c, want, rtol=2**-10, atol=1e-3)

    @triton.jit
    def sigmoid(x, out, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out + offs, 1.0 / (1.0 + tl.extra.libdevice.exp(-tl.load(x + offs))))

    x, out = torch.linspace(-4, 4, 8), torch.empty(8)
    sigmoid[(1,)](x, out, N=8)
    torch.testing.assert_close(out, torch.sigmoid(x))


@needs_sglang
def test_sglang_builds_its_lightning_hybrid_for_a_bailing_model(device):
    # A Bailing/Ling-shaped model: SGLang's attn_backend_wrapper picks LightningAttentionBackend for its
    # BailingHybridConfig, the full layers by id; the lightning layers are plain RadixAttention objects.
    layers = (LightningLayer(0, 2, 128), MHALayer(1, 4, 2, 16, 16), LightningLayer(2, 2, 128))
    extend = BatchSpec(ForwardMode.EXTEND, (5, 0, 3), (4, 7, 1), layers, seed=9)
    run = run_case(parse("hybrid(sglang.torch_native,sglang.lightning)"), extend, device)
    sgl = runtime.load()
    hybrid = run.execution.backend.inner
    assert type(hybrid) is sgl.HybridLinearAttnBackend and hybrid.full_attn_layers == [1]
    assert type(hybrid.linear_attn_backend).__name__ == "LightningAttentionBackend"
    radix = run.execution.backend.radix
    assert {i: type(r).__name__ for i, r in radix.items()} == {0: "RadixAttention", 1: "RadixAttention",
                                                               2: "RadixAttention"}
    # Its per-layer decay rates: ALiBi slopes scaled by depth in a model of three layers
    from reference.lightning import decay_rates
    for layer_id in (0, 2):
        torch.testing.assert_close(hybrid.linear_attn_backend.tp_slope[layer_id].flatten().double().cpu(),
                                   decay_rates(2, layer_id, 3), rtol=1e-6, atol=0)
    assert PROPERTIES["outputs"].run(parse("hybrid(sglang.torch_native,sglang.lightning)"), extend, device).ok


@needs_sglang
def test_lightning_hybrids_verify_chains_only():
    # LightningAttentionBackend refuses speculative_eagle_topk > 1 when it is built (lightning_backend.py:82-93):
    # declared, so its compositions draw chains and a tree batch is refused with the reason.
    c = parse("hybrid(sglang.triton,sglang.lightning)")
    tree = BatchSpec(ForwardMode.TARGET_VERIFY, (3,), (3,), (MHALayer(0, 4, 2, 16, 16),),
                     spec=SpecInput(3, 2, 1, ((-1, 0, 0),), (1,)))
    assert c.unsupported_reason(tree) == "draft trees (topk > 1) not supported: verify chains only"
    assert strategy_options(c, PROFILES["ci"], "cpu")["chain"]
    assert not strategy_options(parse("hybrid(sglang.triton,sglang.gdn)"), PROFILES["ci"], "cpu")["chain"]


@needs_sglang
def test_lightning_layers_are_held_to_the_precision_of_the_device_they_run_on():
    # seg_la's float32 dots are TF32 on an NVIDIA GPU, exact float32 in Triton's interpreter. Holding the CPU to
    # TF32's bound let the fp8 decode finding pass CPU CI's prefill-then-decode rows at 0.97 of the bound.
    from properties.tolerances import layer_bound
    c = parse("hybrid(sglang.triton,sglang.lightning)")
    spec = BatchSpec(ForwardMode.EXTEND, (3,), (5,), (LightningLayer(0, 2), MHALayer(1, 4, 2, 16, 16)),
                     dtype="float32")
    lightning, mha = spec.layers
    assert c.support().matmul_roundoff("lightning", "cuda") == 2.0**-10
    assert c.support().matmul_roundoff("lightning", "cpu") == 2.0**-24
    assert layer_bound(c, spec, lightning, "cpu").rel_l2 < layer_bound(c, spec, lightning, "cuda").rel_l2 / 1000
    # the full layers: SGLang Triton's TF32 dots on the GPU, the interpreter held to tf32x3
    assert c.support().matmul_roundoff("mha", "cuda") == 2.0**-10
    assert c.support().matmul_roundoff("mha", "cpu") == 2.0**-21
    assert layer_bound(c, spec, mha, "cpu").rel_l2 < layer_bound(c, spec, mha, "cuda").rel_l2


@needs_sglang
def test_shapes_sglang_cannot_build_are_refused_in_one_line_not_blamed_on_it(tmp_path, capsys, device):
    # SGLang sizes one KV pool and one linear config per model, and seg_la's decode splits the key dim in blocks
    # of 128. A hand-written case outside that used to crash inside the adapter or seg_la and read as a finding.
    from harness.cli import main
    from search.casefile import CaseFile
    mixed_mha = BatchSpec(ForwardMode.EXTEND, (2,), (3,), (MHALayer(0, 4, 2, 16, 16), MHALayer(1, 4, 2, 32, 32)))
    mixed_lightning = BatchSpec(ForwardMode.EXTEND, (5,), (3,), (LightningLayer(0, 2), LightningLayer(1, 4),
                                                               MHALayer(2, 4, 2, 16, 16)))
    narrow = BatchSpec(ForwardMode.DECODE, (5,), (1,), (LightningLayer(0, 2, 64), MHALayer(1, 4, 2, 16, 16)))
    hybrid = parse("hybrid(sglang.triton,sglang.lightning)")
    assert "mha layers of shapes [(4, 2, 16, 16), (4, 2, 32, 32)]" in parse("sglang.triton").unsupported_reason(mixed_mha)
    assert "lightning layers of shapes [(2, 128), (4, 128)]" in hybrid.unsupported_reason(mixed_lightning)
    assert hybrid.unsupported_reason(narrow) == "lightning head_dim 64 not supported"
    assert parse("torch_native").unsupported_reason(mixed_mha) is None  # ours sizes each layer's pool by the layer
    # recorded on this host's device: on a GPU host a pytest worker cannot interpret Triton (backends/interpreter.py)
    case = CaseFile(str(hybrid), "outputs", narrow, device, "ci").write(tmp_path / "case.json")
    assert main(["repro", str(case)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "head_dim 64" in err[0], err


def test_the_prefill_decode_split_is_sglangs_and_routes_verify_to_prefill():
    split = parse("pd(sglang.triton,sglang.torch_native)")
    assert split.engine == "sglang" and split.leaves() == ["sglang.triton", "sglang.torch_native"]
    with pytest.raises(CompositionError, match="engine's prefill/decode split"):
        parse("pd(triton,torch_native)")
    with pytest.raises(CompositionError, match="two different full-attention"):
        parse("pd(sglang.triton,sglang.triton)")
    with pytest.raises(CompositionError, match="two different full-attention"):
        parse("pd(hybrid(sglang.triton,sglang.gdn),sglang.torch_native)")
    terms = {str(c) for c in all_compositions()}
    assert {"pd(sglang.triton,sglang.torch_native)", "pd(sglang.torch_native,sglang.triton)"} <= terms
    # A verify batch goes to the prefill backend (--speculative-attention-mode prefill): Triton's tree mask serves
    # it, and TorchNative's missing one matters only where TorchNative prefills.
    assert ForwardMode.TARGET_VERIFY in split.support().modes
    assert ForwardMode.TARGET_VERIFY not in parse("pd(sglang.torch_native,sglang.triton)").support().modes
    # Both halves run one request's life (prefill_then_decode), so what either lacks is lacking
    assert not split.support().logit_cap


@needs_sglang
def test_mode_dispatch_catches_a_split_that_routes_a_mode_to_the_wrong_backend(device):
    from backends.sglang.runtime import load

    mode = ForwardMode.DECODE  # the silent case: TorchNative decodes right too, only the routing check can tell
    split = parse("pd(sglang.torch_native,sglang.triton)")
    spec = BatchSpec(mode, (3, 5), (1, 1), (MHA,), seed=3)
    assert PROPERTIES["mode_dispatch"].run(split, spec, device).ok
    # The fault: every mode to the prefill backend (decode then runs TorchNative, which computes it right: only
    # the routing check can tell). And every mode to the decode backend.
    hybrid = load().HybridAttnBackend
    right = "decode" if mode is ForwardMode.DECODE else "prefill"
    for routed in ("prefill", "decode"):
        with mock.patch.object(hybrid, "_select_backend", lambda self, _, _r=routed: getattr(self, f"{_r}_backend")):
            verdict = PROPERTIES["mode_dispatch"].run(split, spec, device)
        assert verdict.ok == (routed == right), verdict.reason
        if not verdict.ok:
            assert f"batch reached the {routed} backend" in verdict.reason


def test_a_backend_that_cannot_take_long_contexts_on_a_cpu_draws_none_there():
    # SGLang's torch_native pads each request's queries to its key count: a 10,576-key prefix ran past the CPU's
    # case timeout in a sweep and was reported as a hang. Correct, only slow: a GPU still draws them.
    from search.search_row import row_profile

    nightly = PROFILES["nightly"]
    assert nightly.long_context is not None
    support = parse("sglang.torch_native").support()
    assert support.no_long_context_on_cpu and not support.interpreted_on_cpu
    assert row_profile(support, nightly, "cpu").long_context is None
    assert row_profile(support, nightly, "cuda").long_context == nightly.long_context
    assert row_profile(parse("tbo(sglang.torch_native)").support(), nightly, "cpu").long_context is None
    assert row_profile(parse("torch_native").support(), nightly, "cpu") == nightly  # our own keeps them there


@needs_sglang
def test_graph_metadata_reads_each_tbo_half_a_replay_plans(device):
    # A padded replay under SGLang's TboAttnBackend replans each half from the replay view it cuts itself; the check
    # holds each half's plan to that half of the padded batch, its own padded rows counted. Three requests replay in a
    # graph of four, cut 2 | 2: the right half holds request 2 and the padded row.
    from harness.mutants.catalogue import MUTANTS

    comp = parse("graph(tbo(sglang.triton))")
    spec = BatchSpec(ForwardMode.DECODE, (5, 9, 2), (1, 1, 1), (MHA,), seed=6)
    assert PROPERTIES["graph_metadata"].run(comp, spec, device).ok
    with MUTANTS["sglang_tbo_replay_right_half_reads_left_lengths"].patch():
        verdict = PROPERTIES["graph_metadata"].run(comp, spec, device)
    assert not verdict.ok and "_TboChild: request 0" in verdict.reason, verdict.reason


@needs_sglang
def test_sglang_builds_its_short_conv_hybrid_for_an_lfm2_model(device):
    # An LFM2-shaped model: SGLang's attn_backend_wrapper picks its short-conv sidecar for the Lfm2Config (0.5.22 on:
    # ShortConvAttnBackend under ShortConvHybridAttnBackend; before, Mamba2AttnBackend under the plain hybrid), the
    # full layers by id; the conv layers are SGLang's own Lfm2ShortConv, asking the hybrid for their state.
    layers = (ShortConvLayer(0, 16, 3, True), MHALayer(1, 4, 2, 16, 16), ShortConvLayer(2, 16, 3, True))
    extend = BatchSpec(ForwardMode.EXTEND, (5, 0, 3), (4, 7, 1), layers, seed=9)
    composition = parse("hybrid(sglang.torch_native,sglang.short_conv)")
    run = run_case(composition, extend, device)
    sgl = runtime.load()
    hybrid = run.execution.backend.inner
    assert isinstance(hybrid, sgl.HybridLinearAttnBackend) and hybrid.full_attn_layers == [1]
    assert {i: type(r).__name__ for i, r in run.execution.backend.radix.items()} == {
        0: "Lfm2ShortConv", 1: "RadixAttention", 2: "Lfm2ShortConv"}
    if hasattr(hybrid, "conv_state_metadata"):
        assert type(hybrid.linear_attn_backend).__name__ == "ShortConvAttnBackend"
    for name in ("outputs", "cache"):  # (dispatch: the matrix's rows of this composition; routing is not the batch's)
        assert PROPERTIES[name].run(composition, extend, device).ok, name


@needs_sglang
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_sglang_builds_its_kda_hybrid_for_a_kimi_linear_model(device, lower_bound):
    # A Kimi-Linear-shaped model: SGLang's attn_backend_wrapper picks KDAAttnBackend for its KimiLinearConfig, the
    # full layers by linear_attn_config; each KDA layer is SGLang's own KimiDeltaAttention over its
    # RadixLinearAttention. Two requests continue cached prefixes over more than one 16-token block of the chunked
    # kernels, one starts fresh; the safe gate or the standard one. Float16: the interpreted fla kernels' dtype.
    layers = (KdaLayer(0, 2, 16, 16, lower_bound=lower_bound), MHALayer(1, 4, 2, 16, 16),
              KdaLayer(2, 2, 16, 16, lower_bound=lower_bound))
    extend = BatchSpec(ForwardMode.EXTEND, (20, 0, 3), (13, 18, 1), layers, dtype="float16", seed=9)
    composition = parse("hybrid(sglang.torch_native,sglang.kda)")
    run = run_case(composition, extend, device)
    hybrid = run.execution.backend.inner
    assert type(hybrid).__name__ == "HybridLinearAttnBackend" and hybrid.full_attn_layers == [1]
    assert type(hybrid.linear_attn_backend).__name__ == "KDAAttnBackend"
    assert {i: type(r).__name__ for i, r in run.execution.backend.radix.items()} == {
        0: "KimiDeltaAttention", 1: "RadixAttention", 2: "KimiDeltaAttention"}
    assert run.execution.backend.radix[0].attn.lower_bound == lower_bound
    for name in ("outputs", "cache"):  # (dispatch: the matrix's rows of this composition; routing is not the batch's)
        assert PROPERTIES[name].run(composition, extend, device).ok, name


@needs_sglang
def test_sglang_builds_its_mamba2_hybrid_for_a_nemotron_h_model(device):
    # A Nemotron-H-shaped model: SGLang's attn_backend_wrapper picks Mamba2AttnBackend for its NemotronHConfig, the
    # attention layers by the pattern; each mamba layer is SGLang's own decoder layer handing its MambaMixer2 to the
    # backend. Two requests continue cached prefixes across the 16-token chunks of the scan, one starts fresh.
    layers = (Mamba2Layer(0, 4, 8, 2, 16, chunk_size=16), MHALayer(1, 4, 2, 16, 16),
              Mamba2Layer(2, 4, 8, 2, 16, chunk_size=16))
    extend = BatchSpec(ForwardMode.EXTEND, (20, 0, 3), (13, 18, 1), layers, seed=9)
    composition = parse("hybrid(sglang.torch_native,sglang.mamba2)")
    run = run_case(composition, extend, device)
    hybrid = run.execution.backend.inner
    assert type(hybrid).__name__ == "HybridLinearAttnBackend" and hybrid.full_attn_layers == [1]
    assert type(hybrid.linear_attn_backend).__name__ == "Mamba2AttnBackend"
    assert {i: type(r).__name__ for i, r in run.execution.backend.radix.items()} == {
        0: "NemotronHMambaDecoderLayer", 1: "RadixAttention", 2: "NemotronHMambaDecoderLayer"}
    for name in ("outputs", "cache"):  # (dispatch: the matrix's rows of this composition; routing is not the batch's)
        assert PROPERTIES[name].run(composition, extend, device).ok, name
    # Nemotron-H's MTP draft has no mamba layer: SGLang wraps no draft worker in its hybrid, so none is drawn
    assert not parse("hybrid(sglang.triton,sglang.mamba2)").support().hybrid_draft_worker


@needs_sglang
def test_a_crash_in_the_batch_replan_runs_first_is_marked_and_known_by_that_batch():
    # replan runs the drawn batch's requests rotated first: here that batch is a two-chunk TBO cut (the drawn one is
    # not), which crashes SGLang's TorchNative extend (the known sglang-tbo-mixed-two-chunk). The H100 main job
    # reported three such rows as new findings (gpu53.sh, 2026-11-27) before the crash was marked.
    from search import ledger

    spec = BatchSpec(ForwardMode.MIXED, (0,) * 10, (45, 1, 1, 1, 1, 1, 1, 1, 55, 1), (MHALayer(0, 4, 2, 32, 32),),
                     dtype="float32")
    verdict = PROPERTIES["replan"].run(parse("tbo(sglang.torch_native)"), spec, "cpu")
    assert not verdict.ok and verdict.details.get("batch") == "before", str(verdict)
    assert verdict.reason.endswith("running the batch before the drawn one")
    known = ledger.match("tbo(sglang.torch_native)", "mixed", "replan", spec, verdict, "cpu")
    assert known is not None and known.id == "sglang-tbo-mixed-two-chunk"


@needs_sglang
def test_a_nemotron_h_mamba_layer_breaks_the_prefill_graph_through_its_split_op(device):
    # Nemotron-H's mamba layer leaves a breakable prefill graph through its model-level split op, which finds the
    # layer and the batch in the piecewise forward context; without its eager_on_graph the layer is captured.
    import engine.graph_runner as graph_runner

    runtime.load()  # first: it installs the stand-ins (torchvision) the model module's imports need on a CPU
    from sglang.srt.models import nemotron_h
    layers = (Mamba2Layer(0, 4, 8, 2, 16, chunk_size=16), MHALayer(1, 4, 2, 16, 16))
    extend = BatchSpec(ForwardMode.EXTEND, (20, 0), (13, 3), layers, dtype="float16", seed=9)
    composition = parse("graph(hybrid(sglang.triton,sglang.mamba2))")
    breaks = []
    counted = graph_runner.PrefillGraphRunner.unbroken_layers

    def spy(runner, *args, **kwargs):
        breaks.append(list(runner.breaks))
        return counted(runner, *args, **kwargs)

    with mock.patch.object(graph_runner.PrefillGraphRunner, "unbroken_layers", spy):
        verdict = PROPERTIES["graph_replay"].run(composition, extend, device)
    assert verdict.ok, str(verdict)
    assert breaks == [[1, 1]]
    # The SGLang mutant that takes the op away (Granite 4.0-H's and Falcon-H1's call, a ledger entry for their shape)
    from harness.mutants.catalogue import SGLANG_CATALOGUE
    with next(m for m in SGLANG_CATALOGUE if m.name == "sglang_mamba_mixer_captured_in_prefill_graph").patch():
        assert nemotron_h.breakable_nemotron_mamba2_with_output is nemotron_h.nemotron_mamba2_with_output
        verdict = PROPERTIES["graph_replay"].run(composition, extend, device)
    assert not verdict.ok and "layer 0 (mamba2) took 0 eager graph break(s)" in verdict.reason, str(verdict)


@needs_sglang
def test_kimi_linear_runs_its_kda_extend_inside_the_prefill_graph_and_replays_must_follow_eager(device):
    # Under a breakable prefill graph, 0.5.23's hybrid runs the KDA extend inside the graph over static tables it
    # refreshes before each replay (the captured-metadata contract): its KDA layer takes no eager break, the full
    # layer one, and each replay (padded: 11 tokens in the 16-token bucket, one request continuing a prefix) must
    # equal the eager run. It does not in 0.5.23: the in-graph call says beta is raw only for a flat gate, and Kimi
    # Linear's is [1, T, H, K] (a ledger entry). Given the eager path's beta_is_raw=True, the replays agree.
    import engine.graph_runner as graph_runner
    from search import ledger

    sgl = runtime.load()
    if "init_forward_metadata_for_breakable_cuda_graph_capture" not in vars(sgl.HybridLinearAttnBackend):
        pytest.skip("this SGLang's hybrid has no captured-metadata prefill graph (before 0.5.22): its KDA layers "
                    "break out of the graph as GDN's do")
    from sglang.srt.layers.attention.linear.kernels import kda_triton
    layers = (KdaLayer(0, 2, 16, 16), MHALayer(1, 4, 2, 16, 16))
    extend = BatchSpec(ForwardMode.EXTEND, (20, 0), (5, 6), layers, dtype="float16", seed=3)
    composition = parse("graph(hybrid(sglang.triton,sglang.kda))")
    seen = []
    counted = graph_runner.PrefillGraphRunner.unbroken_layers

    def spy(runner, *args, **kwargs):
        seen.append((list(runner.breaks), runner.in_graph))
        return counted(runner, *args, **kwargs)

    with mock.patch.object(graph_runner.PrefillGraphRunner, "unbroken_layers", spy):
        verdict = PROPERTIES["graph_replay"].run(composition, extend, device)
    assert seen == [([0, 1], frozenset({"kda"}))]
    assert not verdict.ok and verdict.where.startswith("replay layer 0:"), str(verdict)
    known = ledger.match(str(composition), "extend", "graph_replay", extend, verdict, device)
    assert known is not None and known.id == "sglang-kda-prefill-graph-beta-not-raw"

    chunk_kda = kda_triton.chunk_kda

    def beta_raw(**kwargs):  # the eager extend's convention: the model hands beta raw
        return chunk_kda(**(kwargs | {"beta_is_raw": True}))

    with mock.patch.object(kda_triton, "chunk_kda", beta_raw):
        verdict = PROPERTIES["graph_replay"].run(composition, extend, device)
    assert verdict.ok, str(verdict)


@needs_sglang
def test_a_batch_of_more_requests_than_the_kda_graph_tables_hold_runs_eagerly_as_sglang_votes(device, monkeypatch):
    # SGLang's prefill runner replays a captured-metadata graph only for batches its tables hold
    # (prefill_cuda_graph_max_batch_size, for KDA SGLANG_KDA_PREFILL_GRAPH_MAX_SEQS); a larger one runs eagerly.
    # With one request allowed, a two-request extend must not reach the tables (SGLang's fill asserts there).
    sgl = runtime.load()
    if "init_forward_metadata_for_breakable_cuda_graph_capture" not in vars(sgl.HybridLinearAttnBackend):
        pytest.skip("this SGLang's hybrid has no captured-metadata prefill graph (before 0.5.22)")
    monkeypatch.setenv("SGLANG_KDA_PREFILL_GRAPH_MAX_SEQS", "1")
    import sglang.srt.layers.attention.linear.kda_backend as kda_backend

    in_graph = []
    extend_in_graph = kda_backend.kda_extend_in_graph

    def spy(**kwargs):
        in_graph.append(kwargs["meta"].max_seqs)
        return extend_in_graph(**kwargs)

    layers = (KdaLayer(0, 2, 16, 16), MHALayer(1, 4, 2, 16, 16))
    composition = parse("graph(hybrid(sglang.triton,sglang.kda_glm5))")
    with mock.patch.object(kda_backend, "kda_extend_in_graph", spy):
        verdict = PROPERTIES["graph_replay"].run(
            composition, BatchSpec(ForwardMode.EXTEND, (4, 0), (3, 2), layers, dtype="float16", seed=1), device)
        assert verdict.ok, str(verdict)
        assert in_graph == [1] * (3 if device == "cuda" else 1)  # the capture (and its warm-up runs) only
        verdict = PROPERTIES["graph_replay"].run(
            composition, BatchSpec(ForwardMode.EXTEND, (4,), (3,), layers, dtype="float16", seed=1), device)
        assert verdict.ok, str(verdict)
    # One request fits: on a CPU that replay reruns the in-graph extend (a GPU replays it without Python)
    assert len(in_graph) == (6 if device == "cuda" else 3)


@needs_sglang
def test_glm5_flash_hands_its_kda_gate_flat_and_its_prefill_graph_replays_follow_eager(device):
    # GLM-5.3 Flash, the KDA model whose breakable prefill graph SGLang keeps on by default: its own layer module hands
    # the backend a flat [1, T, H * K] gate (Kimi Linear's is [1, T, H, K]), and the graph's in-graph KDA extend then
    # takes beta raw, as the eager one does: replays (padded, one request continuing a prefix) equal eager.
    import engine.graph_runner as graph_runner

    sgl = runtime.load()
    if sgl.Glm5NextLinearAttention is None:
        pytest.skip("this SGLang has no GLM-5.3 Flash model")
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

    gates, seen = [], []
    extend_kda = KDAAttnBackend.forward_extend

    def spy_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        gates.append(tuple(a.shape))
        return extend_kda(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)

    counted = graph_runner.PrefillGraphRunner.unbroken_layers

    def spy_breaks(runner, *args, **kwargs):
        seen.append(list(runner.breaks))
        return counted(runner, *args, **kwargs)

    layers = (KdaLayer(0, 2, 16, 16), MHALayer(1, 4, 2, 16, 16))
    extend = BatchSpec(ForwardMode.EXTEND, (20, 0), (5, 6), layers, dtype="float16", seed=3)
    with mock.patch.object(KDAAttnBackend, "forward_extend", spy_extend), \
            mock.patch.object(graph_runner.PrefillGraphRunner, "unbroken_layers", spy_breaks):
        verdict = PROPERTIES["graph_replay"].run(parse("graph(hybrid(sglang.triton,sglang.kda_glm5))"), extend, device)
    assert verdict.ok, str(verdict)
    assert gates and all(g[0] == 1 and g[-1] == 2 * 16 for g in gates), gates  # flat: [1, tokens, H * K]
    in_graph = "init_forward_metadata_for_breakable_cuda_graph_capture" in vars(sgl.HybridLinearAttnBackend)
    assert seen == [[0 if in_graph else 1, 1]]


@needs_sglang
@pytest.mark.parametrize("composition", ["hybrid(sglang.torch_native,sglang.mamba2_granite)",
                                         "tbo(hybrid(sglang.torch_native,sglang.mamba2_granite))"])
def test_a_granite_shaped_mamba_layer_hands_its_mixer_over_as_granite_does(device, composition):
    # The Granite leaf's call (Mamba2AttnBackend.forward with an output buffer, no graph break), under TBO's child
    # adapters too (found by review: there the Nemotron-H call ran instead, silently)
    from backends.sglang.adapter import SglangMamba2Granite

    runtime.load()
    calls = []
    granite = SglangMamba2Granite.hand_over

    def spy(block, hidden_states, sfb, backend):
        calls.append(type(backend).__name__)
        return granite(block, hidden_states, sfb, backend)

    layers = (Mamba2Layer(0, 4, 8, 2, 16, chunk_size=16), MHALayer(1, 4, 2, 16, 16))
    extend = BatchSpec(ForwardMode.EXTEND, (5, 0), (6, 3), layers, dtype="float32", seed=4)
    with mock.patch.object(SglangMamba2Granite, "hand_over", staticmethod(spy)):
        verdict = PROPERTIES["outputs"].run(parse(composition), extend, device)
    assert verdict.ok, str(verdict)
    assert calls and set(calls) == {"HybridLinearAttnBackend"}, calls


@pytest.mark.parametrize("block, expected", [
    # 0.5.21: _forward_mixer(hidden, fb, skip_reduce); seen as an adapter error on every Nemotron-H row there
    (SimpleNamespace(_forward_mixer=lambda hidden, fb, skip_reduce: ("mixer", skip_reduce),
                     _forward_mamba=lambda hidden, fb: "mamba"), ("mixer", False)),
    # 0.5.22 on: _forward_mixer(hidden, fb)
    (SimpleNamespace(_forward_mixer=lambda hidden, fb: ("mixer",), _forward_mamba=lambda hidden, fb: "mamba"),
     ("mixer",)),
    # before 0.5.21: _forward_mamba only
    (SimpleNamespace(_forward_mamba=lambda hidden, fb: "mamba"), "mamba"),
], ids=["0.5.21", "0.5.22-on", "older"])
def test_nemotron_h_hands_its_mixer_over_by_each_releases_call(block, expected):
    from backends.sglang.adapter import SglangMamba2

    assert SglangMamba2.hand_over(block, "hidden", "fb", None) == expected


@needs_sglang
def test_a_prefill_graph_scope_that_does_not_take_hold_is_an_adapter_error(device):
    # Were the adapter's scope to miss a flag the installed release's layers read, they would take no break and the
    # break count would blame SGLang; the scope checks the engine's own predicates instead, in the adapter's code.
    from backends.sglang import compat

    if runtime.load().is_in_prefill_graph_scope is None:
        pytest.skip("this SGLang's layers read no prefill-graph scope flags (0.5.22): nothing to leave out")
    extend = BatchSpec(ForwardMode.EXTEND, (3, 0), (5, 4), (LinearLayer(0, 2, 4, 16, 16), MHALayer(1, 4, 2, 16, 16)),
                       dtype="float16", seed=6)
    with mock.patch.object(compat, "prefill_graph_flags", lambda sgl, raw: contextlib.nullcontext()):
        verdict = PROPERTIES["graph_replay"].run(parse("graph(hybrid(sglang.triton,sglang.gdn))"), extend, device)
    assert not verdict.ok and verdict.reason.startswith("adapter error at backends/sglang/adapter.py"), verdict.reason
    assert "is_in_prefill_graph_scope()" in verdict.reason
