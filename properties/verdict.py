"""What a property returns, and the comparison that locates the worst error."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.registry import Composition
from batch.spec import BatchSpec
from properties.tolerances import Bound, layer_bound, widen_for_cancellation
from reference.batch import ReferenceResult


@dataclass
class Verdict:
    """The outcome of one property on one case: ok or not, why, and the worst error against its bound."""

    property: str
    ok: bool
    reason: str
    worst_error: float | None = None
    bound: float | None = None
    where: str | None = None
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        err = "" if self.worst_error is None else f" (worst {self.worst_error:.3g}, bound {self.bound:.3g})"
        loc = f" at {self.where}" if self.where else ""
        return f"{self.property}: {status}: {self.reason}{err}{loc}"


def locate(token: int, token_starts: list[int]) -> tuple[int, int]:
    """Map a flat token row to (request, token within the request's new tokens)."""
    request = 0
    while request + 1 < len(token_starts) and token_starts[request + 1] <= token:
        request += 1
    return request, token - token_starts[request]


@dataclass
class Comparison:
    rel_l2: float
    max_abs: float
    ok: bool
    where: str
    index: tuple[int, ...]


def compare(actual: torch.Tensor, expected: torch.Tensor, bound: Bound, token_starts: list[int] | None = None,
            label: str = "") -> Comparison:
    """Compare ``actual`` with the float64 ``expected`` (same shape; rows are tokens if token_starts given)."""
    if actual.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), False,
                          f"{label} shape {tuple(actual.shape)} != expected {tuple(expected.shape)}", ())
    # On the device, with every statistic read back in one transfer: copying whole outputs to the host and
    # reading each statistic separately would cost more than the comparison.
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    if e.numel() == 0:
        return Comparison(0.0, 0.0, True, label, ())
    diff = (a - e).abs()
    stats = torch.stack([torch.isfinite(a).all().to(torch.float64), torch.linalg.vector_norm(diff),
                         torch.linalg.vector_norm(e), e.abs().max(), diff.max(), diff.argmax().to(torch.float64)])
    finite, diff_norm, e_norm, scale, max_abs, flat = stats.tolist()
    if not finite:
        idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(a))[0])
        return Comparison(float("inf"), float("inf"), False, f"{label} non-finite value at {_where(idx, token_starts)}", idx)
    rel_l2 = diff_norm / max(e_norm, 1e-300)
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(int(flat)), diff.shape))
    ok = rel_l2 <= bound.rel_l2 and max_abs <= bound.element * max(scale, 1e-300)
    return Comparison(rel_l2, max_abs, ok, f"{label} {_where(idx, token_starts)}".strip(), idx)


def _where(idx: tuple[int, ...], token_starts: list[int] | None) -> str:
    if not idx:
        return ""
    if token_starts is None:
        return f"index {idx}"
    request, token = locate(idx[0], token_starts)
    head = f", head {idx[1]}" if len(idx) > 1 else ""
    return f"request {request}, token {token}{head}"


def token_starts(spec: BatchSpec) -> list[int]:
    out, total = [], 0
    for e in spec.extend_lens:
        out.append(total)
        total += e
    return out


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
        details = {"max_abs": c.max_abs, "compared": len(self.items), "bound": bound}
        if not self.ok:  # every failing comparison, worst first: the ledger must explain each of them
            failing = sorted((x for x in self.items if not x[0].ok), key=lambda x: -x[0].rel_l2 / x[1].rel_l2)
            details["failing"] = tuple((x[0].where, x[0].rel_l2, x[1].rel_l2) for x in failing)
        return Verdict(name, self.ok, reason, c.rel_l2, bound.rel_l2, c.where, details)


def compare_outputs(outputs: list[torch.Tensor], reference: ReferenceResult, composition: Composition,
                    spec: BatchSpec, device: str, worst: Worst, label: str = "") -> None:
    starts = token_starts(spec)
    for layer, out, ref in zip(spec.layers, outputs, reference.outputs):
        bound = widen_for_cancellation(layer_bound(composition, spec, layer, device), ref,
                                       reference.magnitudes.get(layer.layer_id))
        worst.add(compare(out, ref, bound, starts, f"{label}layer {layer.layer_id}:"), bound)
