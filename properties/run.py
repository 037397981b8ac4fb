"""Running a composition next to the reference: the first step of the output-level properties."""

from __future__ import annotations

from dataclasses import dataclass

from backends.registry import Composition
from batch.case import Case
from batch.spec import BatchSpec
from engine.execute import Execution, execute
from engine.materialize import materialize
from reference.batch import ReferenceResult, reference_outputs


@dataclass
class Run:
    case: Case
    execution: Execution
    reference: ReferenceResult


def run_case(composition: Composition, spec: BatchSpec, device: str) -> Run:
    case = materialize(spec, device)
    reference = reference_outputs(case)  # before the run: it reads only the pool snapshots and inputs
    return Run(case, execute(composition, case), reference)
