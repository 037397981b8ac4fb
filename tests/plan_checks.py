"""What the plan-level leaves' tests (FlashAttention's, TRT-LLM MHA's) share: one eager plan held to the metadata
invariants."""

from __future__ import annotations

import pytest

from backends.registry import parse
from batch.spec import BatchSpec
from properties import PROPERTIES
from search.ledger import match


def assert_eager_plan_holds(composition: str, batch: BatchSpec) -> None:
    """The composition's plan of ``batch`` satisfies the invariants, or fails as the ledger's two-chunk TBO entry
    (SGLang's TBO splitter cuts a MIXED batch's tokens two-chunk but its requests plainly: the halves' plans then
    disagree with their batches, through any backend's plan). A batch it does not take is skipped with the reason."""
    c = parse(composition)
    if c.unsupported_reason(batch) or PROPERTIES["metadata"].applies(c, batch.mode):
        pytest.skip(c.unsupported_reason(batch) or PROPERTIES["metadata"].applies(c, batch.mode))
    verdict = PROPERTIES["metadata"].run(c, batch, "cpu")
    known = None if verdict.ok else match(composition, batch.mode.value, "metadata", batch, verdict, "cpu")
    assert verdict.ok or (known and known.id == "sglang-tbo-mixed-two-chunk"), str(verdict)
