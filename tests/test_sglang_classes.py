"""SGLang's registered backends whose kernels cannot run here, read at class level (backends/sglang/classes.py): their
rows, why the others are unavailable, and what the class-level check catches."""

from __future__ import annotations

import pytest

from backends.registry import leaf_capabilities, parse
from batch.spec import BatchSpec, ForwardMode, MHALayer
from properties import PROPERTIES
from search.matrix import matrix
from search.profiles import PROFILES

pytest.importorskip("sglang")

# FlashMLA is built where flash_mla, FlashInfer and a Hopper GPU are (backends/sglang/flashinfer.py), read at class
# level elsewhere
CLASS_LEAVES = tuple(n for n in ("sglang.cutlass_mla", "sglang.flashmla", "sglang.dsa", "sglang.nsa", "sglang.aiter",
                                 "sglang.wave", "sglang.qsa", "sglang.hpc_ops", "sglang.intel_amx", "sglang.intel_xpu",
                                 "sglang.minicpm_flashattn", "sglang.minicpm_flashinfer",
                                 "sglang.llada2_cfg_flashinfer")
                     if leaf_capabilities(n).class_only)


def test_class_level_leaves_get_a_conformance_row_or_say_why_not():
    m = matrix("cpu", PROFILES["ci"], list(CLASS_LEAVES))
    assert {r.property.name for r in m.rows} <= {"conformance"}
    assert {r.mode for r in m.rows} <= {ForwardMode.EXTEND}
    ran = {str(r.composition) for r in m.rows if r.composition.is_leaf}
    unavailable = {name: why for name, why in m.unavailable if "(" not in name}
    assert ran | set(unavailable) == set(CLASS_LEAVES)  # every one is a row or says why not
    # every other property is left out with the leaf's reason, never silently
    assert any(why.startswith("only its classes are checked") for _, why in m.excluded)
    # over a leaf that is never built, SGLang's TBO and hybrid wrappers are read at class level too (conformance only)
    from backends.registry import all_compositions
    wrapped = [c for c in all_compositions() if not c.is_leaf and set(c.leaves()) & set(CLASS_LEAVES)]
    assert wrapped and {c.name for c in wrapped} == {"tbo", "hybrid"}
    m = matrix("cpu", PROFILES["ci"], [str(c) for c in wrapped])
    assert {r.property.name for r in m.rows} == {"conformance"}
    for name, why in unavailable.items():
        assert "imports here" in why or "registers no attention backend" in why or "of its own" in why, (name, why)


def test_a_class_level_row_runs_and_passes_on_a_class_that_takes_sglangs_calls(device):
    spec = BatchSpec(ForwardMode.EXTEND, (0,), (3,), (MHALayer(0, 2, 1, 16, 16),), seed=1)
    composition = parse("sglang.wave")
    if composition.unavailable_reason("cpu"):
        pytest.skip(composition.unavailable_reason("cpu"))
    verdict = PROPERTIES["conformance"].run(composition, spec, device)
    assert verdict.ok and "WaveAttnBackend" in verdict.reason, str(verdict)


def test_the_class_level_check_catches_what_breaks_sglangs_calls():
    # The bug this project started from (TRT-LLM MLA's init_mha_chunk_metadata taking only the batch, where the
    # hybrid wrappers pass two), a graph hook that drops the in_capture keyword, a backend with no extend path;
    # an override that adds parameters with defaults is fine.
    from backends.sglang import runtime
    from properties.conformance import class_call_problems

    sgl = runtime.load()
    base = sgl.AttentionBackend
    forwarders = [w for w in (sgl.HybridLinearAttnBackend, sgl.HybridAttnBackend) if w is not None]
    probed = runtime.probed_members()
    assert "init_mha_chunk_metadata" in probed

    class Good(base):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs): ...
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs): ...
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False, extra=None): ...
        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged=False): ...

    problems, checked = class_call_problems(Good, base, forwarders, probed)
    assert problems == [] and checked >= 4

    class OneArgChunk(Good):
        def init_mha_chunk_metadata(self, forward_batch): ...

    class NoCaptureFlag(Good):
        def init_forward_metadata_out_graph(self, forward_batch): ...

    class NoExtend(base):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs): ...

    (one,), _ = class_call_problems(OneArgChunk, base, forwarders, probed)
    assert "OneArgChunk.init_mha_chunk_metadata(forward_batch)" in one and "too many positional" in one
    (flag,), _ = class_call_problems(NoCaptureFlag, base, forwarders, probed)
    assert "in_capture" in flag
    (extend,), _ = class_call_problems(NoExtend, base, forwarders, probed)
    assert "keeps AttentionBackend.forward_extend" in extend


def test_a_wrapper_read_at_class_level_must_reach_what_its_children_have():
    # A wrapper that leaves to the base class a member its child overrides (the base's default answers), or lacks
    # a member callers probe with hasattr, is caught from the classes alone; one its __init__ copies from the
    # child is reachable, and one callers also seek on a hybrid wrapper's full_attn_backend is not owed by it.
    from backends.sglang import runtime
    from properties.conformance import class_hidden

    sgl = runtime.load()
    base = sgl.AttentionBackend

    class Child(base):
        needs_cpu_seq_lens = False

        def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs): ...
        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged=False): ...
        def set_mtp_shared_sparse_indices(self, state): ...

    class Forgets(base):
        def __init__(self, child):
            self.child = child

    class Copies(base):
        def __init__(self, child):
            self.full_attn_backend = child
            self.needs_cpu_seq_lens = child.needs_cpu_seq_lens

        def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs): ...
        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged=False): ...

    probed = ("init_mha_chunk_metadata", "set_mtp_shared_sparse_indices")
    fallback = frozenset({"set_mtp_shared_sparse_indices"})
    forgot = {m for m, _ in class_hidden(Forgets, [Child], [Child], base, probed, fallback)}
    assert {"update_verify_buffers_to_fill_after_draft", "needs_cpu_seq_lens", "init_mha_chunk_metadata",
            "set_mtp_shared_sparse_indices"} <= forgot
    assert class_hidden(Copies, [Child], [Child], base, probed, fallback) == []
    assert class_hidden(Copies, [Child], [Child], base, probed) == [("set_mtp_shared_sparse_indices", "Child")]
