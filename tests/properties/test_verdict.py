"""The comparison behind every output-level property: its statistics, where it points, non-finite values."""

from __future__ import annotations

import math

import pytest
import torch

from properties.tolerances import Bound
from properties.verdict import compare

BOUND = Bound(rel_l2=1e-3, element=1e-2, reason="test")


def test_statistics_and_location_of_the_worst_element():
    expected = torch.ones(5, 2, 3, dtype=torch.float64)
    actual = expected.float().clone()
    actual[3, 1, 2] += 0.5  # row 3 is token 1 of request 1 when requests start at rows 0 and 2
    c = compare(actual, expected, BOUND, token_starts=[0, 2])
    assert c.max_abs == 0.5 and c.index == (3, 1, 2)
    assert math.isclose(c.rel_l2, 0.5 / math.sqrt(30), rel_tol=1e-12)
    assert not c.ok and c.where == "request 1, token 1, head 1, dim 2"
    assert compare(expected.float(), expected, BOUND).ok


def test_non_finite_and_mismatched_shapes_fail():
    expected = torch.zeros(4, 2, dtype=torch.float64)
    actual = expected.clone()
    actual[2, 1] = float("nan")
    c = compare(actual, expected, BOUND)
    assert not c.ok and c.index == (2, 1) and "non-finite" in c.where
    assert not compare(expected[:3], expected, BOUND).ok
    assert compare(expected[:0], expected[:0], BOUND).ok


def test_an_asynchronous_kernel_fault_is_the_case_that_launched_it(monkeypatch):
    # On CUDA a faulting kernel raises at the next synchronizing call. Unless a case ends with one, its fault
    # surfaces in the next case: a GPU sweep blamed a materialize for the fault of a case whose Triton kernel had
    # raised "Triton Error [CUDA]: an illegal memory access", words that do not say the context is lost.
    from properties import Property
    from properties.verdict import Verdict
    from search.outcome import poisons_cuda_context

    def fault():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def triton_raises(composition, spec, device):
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", fault)
    passing = Property("probe", lambda composition, spec, device: Verdict("probe", True, "ok"), "test")
    assert passing.run(None, None, "cpu").ok  # no device to wait for
    verdict = passing.run(None, None, "cuda")
    assert not verdict.ok and poisons_cuda_context(verdict.reason)
    crashing = Property("probe", triton_raises, "test")
    verdict = crashing.run(None, None, "cuda")
    # the synchronize's error first, then the case's own crash
    assert poisons_cuda_context(verdict.reason) and verdict.reason.index("CUDA error") < verdict.reason.index("Triton")
    assert not poisons_cuda_context("crashed: RuntimeError: Triton Error [CUDA]: invalid argument")  # context intact


def test_a_bound_widens_by_as_much_as_the_terms_cancel_and_never_narrows():
    from properties.tolerances import widen_for_cancellation
    out = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # norm 5
    cancelled = widen_for_cancellation(BOUND, out, torch.tensor([[30.0, 40.0]], dtype=torch.float64))
    assert cancelled.rel_l2 == pytest.approx(10 * BOUND.rel_l2) and cancelled.element == pytest.approx(10 * BOUND.element)
    assert widen_for_cancellation(BOUND, out, torch.tensor([[1.0, 1.0]], dtype=torch.float64)) == BOUND
    assert widen_for_cancellation(BOUND, out, None) == BOUND  # a convex combination cannot cancel


def test_each_element_is_bounded_by_its_own_magnitude_when_the_reference_gives_one():
    # An average over many keys: the output is small beside the values it averages, and each element's rounding
    # scales with those values (properties/tolerances.py). Element 0 averages values of size 10, element 1 of
    # size 0.1: the same error passes the first and fails the second.
    expected = torch.tensor([[0.01, 0.01]], dtype=torch.float64)
    scale = torch.tensor([[10.0, 0.1]], dtype=torch.float64)
    bound = Bound(rel_l2=10.0, element=1e-2, reason="test")  # the relative L2 check left out of it
    assert compare(expected + torch.tensor([[0.05, 0.0]]), expected, bound, scale=scale).ok
    c = compare(expected + torch.tensor([[0.0, 0.005]]), expected, bound, scale=scale)
    assert not c.ok and c.index == (0, 1) and c.element_error == pytest.approx(0.005)
    assert c.element_bound == pytest.approx(1e-3)
    assert compare(expected, expected, bound).ok and compare(expected, expected, bound, scale=scale).ok
    # an element computed from zeros alone must be exactly zero
    assert not compare(torch.tensor([[0.01, 1e-12]]), expected * torch.tensor([[1.0, 0.0]]), bound,
                       scale=torch.tensor([[10.0, 0.0]], dtype=torch.float64)).ok


def test_a_verdict_names_the_check_that_failed_with_its_own_value_and_bound():
    from properties.verdict import Worst
    expected = torch.ones(4, 1, 2, dtype=torch.float64)
    bound = Bound(rel_l2=1e-2, element=1e-3, reason="the formula")
    element_only = expected.clone()
    element_only[2, 0, 1] += 5e-3  # relative L2 1.8e-3, within 1e-2; one element 5e-3 against 1e-3
    worst = Worst()
    worst.add(compare(element_only, expected, bound, token_starts=[0], label="layer 0:"), bound)
    v = worst.verdict("outputs", "vs reference")
    assert not v.ok and v.check == "element"
    assert v.worst_error == pytest.approx(5e-3) and v.bound == pytest.approx(1e-3)
    assert v.rel_l2 == pytest.approx(5e-3 / math.sqrt(8))
    assert v.where == "layer 0: request 0, token 2, head 0, dim 1"
    assert "element error 0.005 > bound 0.001" in str(v) and "element error out of bounds" in v.reason
    # the report's headline and case file say the same
    from search.outcome import failure_at, failure_headline
    assert failure_headline(v).startswith("element error 0.005 / bound 0.001")
    assert failure_at(v)["check"] == "element"
    spread = expected * 1.02  # every element 2% off: relative L2 2e-2 fails first
    worst = Worst()
    worst.add(compare(spread, expected, Bound(1e-2, 1.0, "f"), label="layer 1:"), Bound(1e-2, 1.0, "f"))
    v = worst.verdict("outputs", "vs reference")
    assert v.check == "rel_l2" and v.worst_error == pytest.approx(0.02) and v.bound == 1e-2
    assert "relative L2 error 0.02 > bound 0.01" in str(v)


def test_headroom_keeps_each_checks_largest_ratio_over_passing_cases_only():
    from properties.verdict import Verdict
    from search.outcome import RowOutcome, checks_at_risk
    row = RowOutcome("r", "torch_native", "extend", "outputs")
    for rel, element, ok in ((0.1, 0.3, True), (0.4, 0.2, True), (9.0, 9.0, False)):
        row.keep_worst(Verdict("outputs", ok, "x", rel, 1.0, details={"headroom": {"rel_l2": rel, "element": element}},
                               check="rel_l2"))
    assert row.headroom == {"rel_l2": 0.4, "element": 0.3} and row.at_risk == []
    row.keep_worst(Verdict("outputs", True, "x", 0.6, 1.0, details={"headroom": {"rel_l2": 0.1, "element": 0.6}}))
    assert row.at_risk == ["element"] and checks_at_risk(row.record()["headroom"]) == ["element"]
    assert row.record()["at_risk"] == ["element"] and "AT RISK: element at 0.60" in row.summary()


def test_a_near_miss_the_ledger_explains_is_counted_but_puts_no_row_at_risk():
    # SGLang Triton's e4m3 arithmetic over an fp8 cache (a ledger entry) passes at up to 0.99 of the bf16 bound on
    # an H100, where the same batches over a bf16 cache sit at 0.17: the bound is right, the kernel is the known bug.
    from harness.sweep import RowState
    from properties.verdict import Verdict
    from search.outcome import RowOutcome, row_at_risk
    row = RowOutcome("r", "sglang.triton", "extend", "outputs")
    near = Verdict("outputs", True, "x", 0.9, 1.0, details={"headroom": {"rel_l2": 0.9, "element": 0.8}})
    row.keep_worst(near, explained_by="sglang-triton-fp8-e4m3-arithmetic")
    row.keep_worst(Verdict("outputs", True, "x", 0.2, 1.0, details={"headroom": {"rel_l2": 0.2, "element": 0.1}}))
    record = row.record()
    assert record["headroom"] == {"rel_l2": 0.9, "element": 0.8} and record["unexplained_headroom"]["rel_l2"] == 0.2
    assert record["at_risk"] == [] == row_at_risk(record)
    assert record["near_misses_known"] == {"sglang-triton-fp8-e4m3-arithmetic": 1}

    class FakeRow:  # a matrix row as RowState reads it
        id, composition, mode, property = "r", "sglang.triton", type("M", (), {"value": "extend"})(), \
            type("P", (), {"name": "outputs"})()
    state = RowState(FakeRow())
    state.absorb(record)
    state.absorb(record | {"unexplained_headroom": {"rel_l2": 0.7, "element": 0.1}})  # a later round's own near miss
    merged = state.record()
    assert merged["headroom"]["rel_l2"] == 0.9 and merged["at_risk"] == ["rel_l2"]
    assert merged["near_misses_known"] == {"sglang-triton-fp8-e4m3-arithmetic": 2}
