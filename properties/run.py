"""Running a composition next to the reference, shared by the output-level properties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.registry import Composition, leaf_capabilities
from harness.execute import Execution, execute
from harness.materialize import Case, materialize
from harness.spec import BatchSpec, Layer, MHALayer, MLALayer
from properties.tolerances import Bound, output_bound
from properties.verdict import Comparison, Verdict, compare
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


def token_starts(spec: BatchSpec) -> list[int]:
    out, total = [], 0
    for e in spec.extend_lens:
        out.append(total)
        total += e
    return out


def layer_bound(composition: Composition, spec: BatchSpec, layer: Layer) -> Bound:
    """The output bound of one layer: its dtype, the longest reduction, the kernels' matmul precision."""
    roundoff = max(leaf_capabilities(n).fp32_matmul_roundoff for n in composition.leaves())
    reduction = max(spec.kv_lens, default=1)
    return output_bound(spec.dtype, reduction, roundoff, inner_dim=score_dot_len(layer))


def score_dot_len(layer: Layer) -> int:
    """Length of the dot product behind each attention score (or each state read of a recurrence)."""
    if isinstance(layer, MHALayer):
        return layer.head_dim
    if isinstance(layer, MLALayer):
        return layer.kv_lora_rank + layer.qk_rope_head_dim
    return max(layer.head_k_dim, layer.conv_kernel)


class Worst:
    """Collects comparisons; reports the worst failing one, or the closest to its bound if all pass."""

    def __init__(self) -> None:
        self.items: list[tuple[Comparison, Bound]] = []

    def add(self, c: Comparison, bound: Bound) -> None:
        self.items.append((c, bound))

    @property
    def ok(self) -> bool:
        return all(c.ok for c, _ in self.items)

    def verdict(self, name: str, what: str) -> Verdict:
        if not self.items:
            return Verdict(name, True, f"{what}: nothing to compare")
        pool = [x for x in self.items if not x[0].ok] or self.items
        c, bound = max(pool, key=lambda x: x[0].rel_l2 / x[1].rel_l2)
        reason = f"{what}: within bounds" if self.ok else f"{what}: out of bounds ({bound.reason})"
        return Verdict(name, self.ok, reason, c.rel_l2, bound.rel_l2, c.where,
                       {"max_abs": c.max_abs, "compared": len(self.items)})


def compare_outputs(outputs: list[torch.Tensor], reference: list[torch.Tensor], composition: Composition,
                    spec: BatchSpec, worst: Worst, label: str = "") -> None:
    starts = token_starts(spec)
    for layer, out, ref in zip(spec.layers, outputs, reference):
        worst.add(compare(out, ref, layer_bound(composition, spec, layer), starts,
                          f"{label}layer {layer.layer_id}:"), layer_bound(composition, spec, layer))
