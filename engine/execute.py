"""Run one materialized case through one composition, as a serving engine would."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import AttentionBackend
from backends.registry import Composition
from batch.case import Case
from batch.forward_batch import ModelRunner
from batch.tbo_split import TboSplit, attach_tbo_children
from engine.draft_loop import run_draft_steps
from engine.model import run_layers


@dataclass
class Execution:
    backend: AttentionBackend
    outputs: list[torch.Tensor]  # one per layer
    split: TboSplit | None = None


def execute(composition: Composition, case: Case, backend: AttentionBackend | None = None,
            fused_qkv: bool = False) -> Execution:
    """Build the composition (unless given), split the batch if it is a TBO composition, run every layer (MHA
    layers' q, k, v as views of one buffer with ``fused_qkv``: engine.model.fused_views)."""
    backend = backend or composition.build(case.spec, ModelRunner.of(case.forward_batch, case.spec.layers))
    if case.spec.mode.is_draft_decode():  # a multi-step draft backend, run as the draft worker's loop
        return Execution(backend, run_draft_steps(backend, case.spec, case.forward_batch, case.inputs, case.weights,
                                                  fused_qkv))
    split = None
    if composition.name == "tbo" and composition.engine == "harness":
        split = attach_tbo_children(case.forward_batch)
    outputs = run_layers(backend, case.forward_batch, case.spec.layers, case.inputs, case.weights,
                         case.spec.mrope_sections, fused_qkv)
    if composition.name == "tbo" and composition.engine != "harness":
        split = backend.split  # an engine's TBO wrapper splits with the engine's own splitter while planning
    return Execution(backend, outputs, split)
