"""What a property returns, and the comparison that locates the worst error."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.registry import Composition
from batch.spec import BatchSpec
from properties.tolerances import Bound, layer_bound, widen_for_cancellation
from reference.batch import ReferenceResult


CHECKS = ("rel_l2", "element")  # the two checks of an output comparison (properties/tolerances.py)


@dataclass
class Verdict:
    """The outcome of one property on one case: ok or not, why, and the worst error against its bound.

    ``check`` names which check ``worst_error`` and ``bound`` belong to: ``"rel_l2"`` (a tensor's relative L2
    error) or ``"element"`` (one element's absolute error and that element's own bound), the one that failed,
    or the closest to its bound if none did; ``rel_l2`` is that comparison's relative L2 error whichever check
    decided. ``details["headroom"]`` holds each check's largest ratio to its bound over the case's comparisons."""

    property: str
    ok: bool
    reason: str
    worst_error: float | None = None
    bound: float | None = None
    where: str | None = None
    details: dict = field(default_factory=dict)
    check: str | None = None
    rel_l2: float | None = None

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        loc = f" at {self.where}" if self.where else ""
        return f"{self.property}: {status}: {self.reason}{self.measure()}{loc}"

    def measure(self) -> str:
        """`` (element error 3.1e-06 > bound 2.0e-06)``: the deciding check, its value and its bound."""
        if self.worst_error is None:
            return ""
        what = CHECK_WORDS.get(self.check, "worst")
        rel = ">" if not self.ok and self.worst_error > (self.bound or 0.0) else "<="
        return f" ({what} {self.worst_error:.3g} {rel} bound {self.bound:.3g})"


CHECK_WORDS = {"rel_l2": "relative L2 error", "element": "element error"}


def locate(token: int, token_starts: list[int]) -> tuple[int, int]:
    """Map a flat token row to (request, token within the request's new tokens)."""
    request = 0
    while request + 1 < len(token_starts) and token_starts[request + 1] <= token:
        request += 1
    return request, token - token_starts[request]


@dataclass
class Comparison:
    """Both checks of one tensor against its expected value. ``element_error`` and ``element_bound`` are those
    of the element nearest its own bound (``index``, ``where``), ``max_abs`` the largest absolute error."""

    rel_l2: float
    max_abs: float
    ok: bool
    where: str
    index: tuple[int, ...]
    rel_l2_bound: float = 0.0
    element_error: float = float("inf")
    element_bound: float = 0.0

    def ratios(self) -> dict[str, float]:
        """Each check's value over its bound (inf for a non-finite or misshapen output)."""
        return {"rel_l2": _ratio(self.rel_l2, self.rel_l2_bound), "element": _ratio(self.element_error,
                                                                                       self.element_bound)}

    def deciding(self) -> str:
        """The check that failed (relative L2 first), or the one closest to its bound."""
        ratios = self.ratios()
        failed = [c for c in CHECKS if ratios[c] > 1.0]
        return failed[0] if failed else max(CHECKS, key=lambda c: ratios[c])

    def value(self, check: str) -> tuple[float, float]:
        return (self.rel_l2, self.rel_l2_bound) if check == "rel_l2" else (self.element_error, self.element_bound)


def _ratio(value: float, bound: float) -> float:
    if value == 0.0:
        return 0.0
    return value / bound if bound > 0.0 else float("inf")


def compare(actual: torch.Tensor, expected: torch.Tensor, bound: Bound, token_starts: list[int] | None = None,
            label: str = "", scale: torch.Tensor | None = None, score_size: torch.Tensor | None = None) -> Comparison:
    """Compare ``actual`` with the float64 ``expected`` (same shape; rows are tokens if token_starts given).

    ``scale``: each element's magnitude ``m`` (``ReferenceResult.element_scales``, shape of ``expected``), which
    its element bound ``bound.element * m`` scales with; None: ``max|expected|`` for every element. ``score_size``:
    each row's score size S (``ReferenceResult.score_sizes``, the shape of ``expected`` without its last dim), which
    adds ``bound.score * S * m`` for the rounding of the scores."""
    if actual.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), False,
                          f"{label} shape {tuple(actual.shape)} != expected {tuple(expected.shape)}", (),
                          bound.rel_l2, float("inf"), 0.0)
    # On the device, with every statistic read back in one transfer: copying whole outputs to the host and
    # reading each statistic separately would cost more than the comparison.
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    if e.numel() == 0:
        return Comparison(0.0, 0.0, True, label, (), bound.rel_l2, 0.0, 0.0)
    diff = (a - e).abs()
    if scale is None:
        allowed = (bound.element * e.abs().max()).expand_as(diff)
    else:
        m = scale.detach().to(a.device, torch.float64)
        allowed = bound.element * m
        if score_size is not None and bound.score:
            allowed = allowed + bound.score * score_size.detach().to(a.device, torch.float64)[..., None] * m
    # diff / allowed, with 0/0 = 0 (an element computed from nothing but zeros must be zero) and x/0 = inf
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300),
                        torch.where(diff > 0, torch.inf, 0.0).to(torch.float64))
    flat_ratio = ratio.argmax()
    stats = torch.stack([torch.isfinite(a).all().to(torch.float64), torch.linalg.vector_norm(diff),
                         torch.linalg.vector_norm(e), diff.max(), flat_ratio.to(torch.float64),
                         diff.flatten()[flat_ratio], allowed.flatten()[flat_ratio]])
    finite, diff_norm, e_norm, max_abs, flat, element_error, element_bound = stats.tolist()
    if not finite:
        idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(a))[0])
        return Comparison(float("inf"), float("inf"), False, f"{label} non-finite value at {_where(idx, token_starts)}",
                          idx, bound.rel_l2, float("inf"), element_bound)
    rel_l2 = diff_norm / max(e_norm, 1e-300)
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(int(flat)), diff.shape))
    ok = rel_l2 <= bound.rel_l2 and element_error <= element_bound
    return Comparison(rel_l2, max_abs, ok, f"{label} {_where(idx, token_starts)}".strip(), idx, bound.rel_l2,
                      element_error, element_bound)


def _where(idx: tuple[int, ...], token_starts: list[int] | None) -> str:
    if not idx:
        return ""
    if token_starts is None:
        return f"index {idx}"
    request, token = locate(idx[0], token_starts)
    head = f", head {idx[1]}" if len(idx) > 1 else ""
    dim = f", dim {idx[2]}" if len(idx) > 2 else ""
    return f"request {request}, token {token}{head}{dim}"


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

    def headroom(self) -> dict[str, float]:
        """Each check's largest value-to-bound ratio over every comparison."""
        return {check: max(c.ratios()[check] for c, _ in self.items) for check in CHECKS}

    def verdict(self, name: str, what: str) -> Verdict:
        if not self.items:
            return Verdict(name, True, f"{what}: nothing to compare")
        severity = lambda x: max(x[0].ratios().values())  # noqa: E731
        pool = [x for x in self.items if not x[0].ok] or self.items
        c, bound = max(pool, key=severity)
        check = c.deciding()
        value, limit = c.value(check)
        reason = f"{what}: within bounds" if self.ok else \
            f"{what}: {CHECK_WORDS[check]} out of bounds ({bound.reason})"
        details = {"max_abs": c.max_abs, "compared": len(self.items), "bound": bound, "headroom": self.headroom()}
        if not self.ok:  # every failing comparison, worst first: the ledger must explain each of them
            failing = sorted((x for x in self.items if not x[0].ok), key=lambda x: -severity(x))
            details["failing"] = tuple((x[0].where, x[0].deciding(), *x[0].value(x[0].deciding()), x[0].rel_l2)
                                       for x in failing)
        return Verdict(name, self.ok, reason, value, limit, c.where, details, check, c.rel_l2)


def compare_outputs(outputs: list[torch.Tensor], reference: ReferenceResult, composition: Composition,
                    spec: BatchSpec, device: str, worst: Worst, label: str = "") -> None:
    starts = token_starts(spec)
    for layer, out, ref in zip(spec.layers, outputs, reference.outputs):
        bound = widen_for_cancellation(layer_bound(composition, spec, layer, device), ref,
                                       reference.magnitudes.get(layer.layer_id))
        worst.add(compare(out, ref, bound, starts, f"{label}layer {layer.layer_id}:",
                          reference.element_scales.get(layer.layer_id), reference.score_sizes.get(layer.layer_id)), bound)
