"""Running a composition next to the reference: the first step of the output-level properties."""

from __future__ import annotations

from dataclasses import dataclass

from backends.registry import Composition
from batch.case import Case
from batch.spec import BatchSpec
from engine.execute import Execution, execute
from engine import sharing
from engine.materialize import materialize
from reference.batch import ReferenceResult, reference_outputs


@dataclass
class Run:
    case: Case
    execution: Execution
    reference: ReferenceResult


# The float64 reference of a batch checked by several rows (engine.sharing): it reads only the batch, and no check
# writes into it
_REFERENCES = sharing.LastMade()


def run_case(composition: Composition, spec: BatchSpec, device: str) -> Run:
    case = materialize(spec, device)
    # before the run: it reads only the pool snapshots and inputs
    reference = _REFERENCES.get((spec, device), lambda: reference_outputs(case))
    return Run(case, execute(composition, case), reference)
