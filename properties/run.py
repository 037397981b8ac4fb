"""Running a composition next to the reference: the first step of the output-level properties."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from backends.registry import Composition
from batch.case import Case
from batch.spec import BatchSpec
from engine.execute import Execution, execute
from engine import materialize as materializing
from engine.materialize import materialize
from reference.batch import ReferenceResult, reference_outputs


@dataclass
class Run:
    case: Case
    execution: Execution
    reference: ReferenceResult


# While ``sharing()`` is on: the reference of the last batch run_case built, as (spec, device, its ReferenceResult)
_reference: list = []
_sharing = 0


@contextmanager
def sharing():
    """Within it, the float64 reference of one batch checked by several compositions and properties
    (search/group.py) is computed once: it reads only the batch, and no check writes into it. The batch itself is
    built once on a GPU and copied for each run (``engine.materialize.sharing``)."""
    global _sharing
    _sharing += 1
    try:
        with materializing.sharing():
            yield
    finally:
        _sharing -= 1
        if not _sharing:
            _reference.clear()


def run_case(composition: Composition, spec: BatchSpec, device: str) -> Run:
    case = materialize(spec, device)
    if not _sharing:
        reference = reference_outputs(case)  # before the run: it reads only the pool snapshots and inputs
    else:
        if not _reference or _reference[0] != spec or _reference[1] != device:
            _reference[:] = [spec, device, reference_outputs(case)]
        reference = _reference[2]
    return Run(case, execute(composition, case), reference)
