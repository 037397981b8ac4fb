"""refuse_or_correct (properties/refusal.py): its rows, the batches it draws, and its three outcomes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from backends.registry import parse
from batch.spec import VERIFY_ALGORITHMS, BatchSpec, ForwardMode, MHALayer
from engine.materialize import query_positions
from harness.mutants.catalogue import MUTANTS
from properties import PROPERTIES
from properties.refusal import OVERREACHES, overreaches
from search.profiles import PROFILES
from search.strategies import batch_specs

PROPERTY = PROPERTIES["refuse_or_correct"]
CI = PROFILES["ci"]
# Options that keep a batch inside every limit an overreach lifts (as a backend declaring all of them would)
INSIDE = dict(sliding_window=False, logit_cap=False, kv_cache_dtypes=("auto",), kv_scales=False,
              verify_window=False, draft_window=False)


def test_rows_are_the_leaves_that_declare_a_limit():
    torch_native, mode = parse("torch_native"), ForwardMode.DECODE
    assert overreaches(torch_native, mode) == ("logit_cap",)
    assert PROPERTY.applies(torch_native, mode) is None
    assert PROPERTY.applies(parse("tbo(torch_native)"), mode).startswith("a wrapper's limits are its leaves'")
    assert "declares no limit" in PROPERTY.applies(parse("triton"), mode)  # it declares every limit crossable
    assert "declares no limit" in PROPERTY.applies(torch_native, ForwardMode.IDLE)


CROSSINGS = [(name, mode) for name, o in sorted(OVERREACHES.items()) for mode in sorted(o.modes, key=str)]


@pytest.mark.parametrize("name, mode", CROSSINGS, ids=[f"{n}-{m.value}" for n, m in CROSSINGS])
def test_each_overreach_draws_batches_that_cross_it(name, mode):
    # trees and empty extends drawn too: a crossing must land where a query sees it; and the draws a crossing must
    # not contradict (a draft window over the prefix needs a model without a sliding window; every verify algorithm)
    inside = INSIDE | {"tree": mode is ForwardMode.TARGET_VERIFY, "empty_extend": True, "draft_prefix_window": True,
                       "verify_algorithms": VERIFY_ALGORITHMS}
    inside |= {"sliding_window": True} if name in ("verify_window", "draft_window") else {}

    @settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batch_specs(CI, mode, frozenset({"mha", "mla"}), overreach=(name,), **inside))
    def crosses(spec):
        furthest = int(query_positions(spec).max())
        mha = [l for l in spec.layers if l.kind == "mha"]
        assert mha, "a limit of MHA layers is crossed by MHA layers"
        if name == "logit_cap":  # a query over two keys or more, a cap small enough to show in any dtype's bound
            assert furthest >= 1 and any(l.logit_cap and l.logit_cap <= 5.0 for l in mha)
        elif name in ("sliding_window", "verify_window", "draft_window"):
            # some query sits past the window: key 0 is hidden from it (a tree node's position is its depth's)
            assert any(l.sliding_window is not None and furthest - l.sliding_window > 0 for l in mha)
        elif name == "fp8_kv_cache":
            assert spec.kv_cache_dtype == "fp8_e4m3"
        else:
            assert spec.kv_cache_dtype == "fp8_e4m3" and any(l.k_scale != 1.0 or l.v_scale != 1.0 for l in mha)
    crosses()


CAPPED = BatchSpec(ForwardMode.DECODE, (5, 2), (1, 1), (MHALayer(0, 4, 2, 32, 32, logit_cap=5.0),), seed=3)


def test_a_refusal_passes_a_silent_wrong_answer_fails_and_a_batch_inside_has_nothing_to_refuse(device):
    torch_native = parse("torch_native")
    refused = PROPERTY.run(torch_native, CAPPED, device)
    assert refused.ok and refused.reason.startswith("refused (logit cap not supported): ValueError: TorchNative")
    with MUTANTS["soft_cap_silently_dropped"].patch():  # the backend computes the layer without its cap
        wrong = PROPERTY.run(torch_native, CAPPED, device)
    assert not wrong.ok and wrong.reason.startswith("answered without refusing (logit cap not supported)")
    assert wrong.worst_error > wrong.bound
    uncapped = dataclasses.replace(CAPPED, layers=(MHALayer(0, 4, 2, 32, 32),))
    inside = PROPERTY.run(torch_native, uncapped, device)
    assert inside.ok and "stays inside the declarations" in inside.reason
