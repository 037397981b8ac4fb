"""What the tests of SGLang's leaves whose level depends on the machine (FlashAttention's, TRT-LLM's, FlashMLA's) share:
one eager plan held to the metadata invariants, and a machine stood in for (its packages, GPU and compute capability)."""

from __future__ import annotations

import pytest
import torch

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


def on_machine(monkeypatch, installed: dict[str, bool], gpu: bool, capability) -> None:
    """Answer, in this test, as a machine whose packages ``installed`` names are (or are not) really installed (the
    rest as here), with a CUDA GPU or not, of ``capability`` (or whose NVML raises it, an exception)."""
    from backends.sglang import features
    from backends.sglang import flashinfer as fi

    really = features.really_installed
    monkeypatch.setattr(features, "really_installed", lambda name: installed.get(name, really(name)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)

    def read():
        if isinstance(capability, Exception):
            raise capability
        return capability

    monkeypatch.setattr(fi, "_compute_capability", read)
