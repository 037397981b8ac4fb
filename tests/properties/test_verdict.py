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
    assert not c.ok and c.where == "request 1, token 1, head 1"
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
