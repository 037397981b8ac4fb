"""Every property can fail: each is shown catching a deliberately broken backend or wrapper on a fixed
batch, and passing on the same batch without the fault (so the check is not vacuous)."""

from __future__ import annotations

import pytest

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, LinearLayer, MHALayer, MLALayer, SpecInput, draft_forest
from harness.mutants.catalogue import MUTANTS
from properties import PROPERTIES

MHA = MHALayer(0, 4, 2, 32, 32)
HYBRID_LAYERS = (MHA, LinearLayer(1, 2, 4, 16, 16))
EXTEND = BatchSpec(ForwardMode.EXTEND, (3, 0, 9), (5, 2, 7), (MHA,), page_size=4, seed=1)
HYBRID_EXTEND = BatchSpec(ForwardMode.EXTEND, (4, 0), (6, 3), HYBRID_LAYERS, seed=2)
MLA_EXTEND = BatchSpec(ForwardMode.EXTEND, (5, 0), (3, 2), (MLALayer(0, 4, 16, 8, 32, 16), LinearLayer(1, 2, 4, 16, 16)))
UNEVEN = BatchSpec(ForwardMode.EXTEND, (6, 0), (30, 2), (MHA,), seed=3)  # two-chunk TBO split
CHAIN_VERIFY = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 7), (3, 3), HYBRID_LAYERS,
                         spec=SpecInput(3, 1, 2, ((-1, 0, 1), (-1, 0, 1)), (2, 3)), seed=4)
DRAFT_WORKER = BatchSpec(ForwardMode.DECODE, (4, 2), (1, 1), (MHA,), draft_worker=True)
# Siblings at depth 1 in rows 1..3, under a window of 2: a row-indexed window cuts what their depth keeps.
TREE_VERIFY = BatchSpec(ForwardMode.TARGET_VERIFY, (9, 5), (4, 4), (MHALayer(0, 4, 2, 32, 32, sliding_window=2),),
                        spec=SpecInput(4, 3, 2, ((-1, 0, 0, 0), (-1, 0, 1, 0)), (2, 3)), seed=5)
HYB = "hybrid(torch_native,linear_torch)"
# The draft loop: two requests, three branches each, two draft steps
DRAFT_DECODE = BatchSpec(ForwardMode.DRAFT_DECODE, (5, 9), (6, 6), (MHA,),
                         spec=SpecInput(6, 3, 3, (draft_forest(3, 3),) * 2, (1, 1)), seed=8)

CASES = [
    ("outputs", "gqa_modulo_mapping", "torch_native", EXTEND),
    ("outputs", "draft_worker_target_layout", HYB, DRAFT_WORKER),
    ("metadata", "prefix_drops_last_token", "torch_native", EXTEND),
    ("metadata", "mla_last_chunk_dropped", "torch_native", BatchSpec(ForwardMode.EXTEND, (70,), (2,), MLA_EXTEND.layers[:1])),
    ("cache", "kv_written_one_slot_off", "torch_native", EXTEND),
    ("cache", "state_slot_is_request_row", "linear_torch", BatchSpec(ForwardMode.EXTEND, (2, 3), (2, 2), HYBRID_LAYERS[1:])),
    ("conformance", "tbo_lacks_forward", f"tbo({HYB})", HYBRID_EXTEND),
    ("conformance", "backend_lacks_update_verify", "torch_native", EXTEND),
    ("conformance", "hybrid_extra_kwarg", HYB, HYBRID_EXTEND),
    ("conformance", "hybrid_lacks_mha_chunk", HYB, HYBRID_EXTEND),
    ("dispatch", "hybrid_dispatch_by_type", HYB, HYBRID_EXTEND),
    ("tbo_split", "two_chunk_prefix_not_grown", "tbo(torch_native)", UNEVEN),
    ("chunked_prefill", "conv_state_not_saved", "linear_torch", BatchSpec(ForwardMode.EXTEND, (0, 3), (6, 5), HYBRID_LAYERS[1:])),
    ("prefill_then_decode", "fresh_request_reads_pool", "linear_torch", BatchSpec(ForwardMode.EXTEND, (0,), (4,), HYBRID_LAYERS[1:])),
    ("verify_chain", "commit_wrong_position", HYB, CHAIN_VERIFY),
    # a verify-only graph buffer left stale: no decode graph and no eager run reads it
    ("graph_replay", "graph_verify_mask_stale", "graph(triton)",
     BatchSpec(ForwardMode.TARGET_VERIFY, (4, 7), (3, 3), (MHA,),
               spec=SpecInput(3, 2, 2, ((-1, 0, 0), (-1, 0, 1)), (2, 3)), seed=5)),
    ("verify_commit", "commit_skips_tracked_copy", HYB, CHAIN_VERIFY),
    # a replay that keeps the capture's plan: three real requests in a graph of four, each reading the padding's keys
    ("graph_metadata", "stale_graph_replay", "graph(triton)",
     BatchSpec(ForwardMode.DECODE, (5, 9, 2), (1, 1, 1), (MHA,), seed=6)),
    ("outputs", "fp8_dequant_ignores_scale", "torch_native",
     BatchSpec(ForwardMode.DECODE, (9, 4), (1, 1), (MHALayer(0, 4, 2, 32, 32, k_scale=0.5, v_scale=4.0),),
               kv_cache_dtype="fp8_e4m3")),
    ("cache", "state_slot_bound_by_request_rows", "linear_torch",
     BatchSpec(ForwardMode.EXTEND, (2, 3), (2, 2), HYBRID_LAYERS[1:], state_slot_layout="gapped")),
    ("tree_branch", "verify_window_by_row", "torch_native", TREE_VERIFY),
    ("replan", "plan_cached_by_shape", "torch_native", EXTEND),
    ("outputs", "draft_branches_read_first_branch", "torch_native", DRAFT_DECODE),
    ("refuse_or_correct", "soft_cap_silently_dropped", "torch_native",
     BatchSpec(ForwardMode.DECODE, (5, 2), (1, 1), (MHALayer(0, 4, 2, 32, 32, logit_cap=5.0),), seed=3)),
]


@pytest.mark.parametrize("prop, mutant, composition, spec", CASES, ids=[f"{p}-{m}" for p, m, _, _ in CASES])
def test_property_catches_the_fault_and_passes_without_it(prop, mutant, composition, spec, device):
    comp = parse(composition)
    clean = PROPERTIES[prop].run(comp, spec, device)
    assert clean.ok, f"without the fault: {clean}"
    with MUTANTS[mutant].patch():
        broken = PROPERTIES[prop].run(comp, spec, device)
    assert not broken.ok, f"{prop} did not catch {mutant}: {broken}"
    again = PROPERTIES[prop].run(comp, spec, device)
    assert again.ok, f"the fault was not removed after the context: {again}"


# Properties whose compositions exist only over an engine's classes (no harness backend has a prefill/decode split):
# their tooth is a fault patched into the engine, in the adapter's tests.
ENGINE_TEETH = {"mode_dispatch": "tests/test_sglang_adapter.py::"
                                 "test_mode_dispatch_catches_a_split_that_routes_a_mode_to_the_wrong_backend"}


def test_every_property_has_a_tooth():
    import tests.test_sglang_adapter as adapter_tests

    covered = {p for p, _, _, _ in CASES}
    assert covered | set(ENGINE_TEETH) == set(PROPERTIES)
    for where in ENGINE_TEETH.values():
        assert hasattr(adapter_tests, where.split("::")[1]), where
