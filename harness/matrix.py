"""The test matrix, derived from the backends' declarations: composition x mode x property.

Nothing here lists backends by hand: rows come from ``backends.registry.all_compositions`` filtered by
what each composition declares and what can run on this machine; every excluded row has a reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.registry import Composition, all_compositions, leaf_capabilities, leaf_class, parse
from harness.profiles import Profile
from harness.spec import ForwardMode
from properties import PROPERTIES, Property


@dataclass(frozen=True)
class Row:
    composition: Composition
    mode: ForwardMode
    property: Property

    @property
    def id(self) -> str:
        return f"{self.composition}-{self.mode.value}-{self.property.name}"


def composition_modes(c: Composition) -> frozenset[ForwardMode]:
    modes = frozenset(ForwardMode)
    for n in c.leaves():
        caps = leaf_capabilities(n)
        modes &= caps.modes
        if not caps.custom_mask:
            modes -= {ForwardMode.TARGET_VERIFY}
    if "graph" in c.wrappers():
        graph_modes = frozenset(ForwardMode)
        for n in c.leaves():
            graph_modes &= getattr(leaf_class(n), "cuda_graph_modes", frozenset())
        modes &= graph_modes
    return modes


def strategy_options(c: Composition, profile: Profile) -> dict:
    """Keyword arguments of ``batch_specs`` that keep drawn batches inside what ``c`` declares."""
    caps = [leaf_capabilities(n) for n in c.leaves()]
    full_caps = [cap for cap in caps if cap.attention_kinds & {"mha", "mla"}]
    pages = set(profile.page_sizes)
    for cap in caps:
        if cap.page_sizes is not None:
            pages &= cap.page_sizes
    return {
        "page_sizes": tuple(sorted(pages)),
        "sliding_window": all(cap.sliding_window for cap in full_caps),
        "logit_cap": all(cap.logit_cap for cap in full_caps),
        "mrope": all(cap.mrope for cap in caps),
        "hybrid": "hybrid" in c.wrappers(),
    }


def select(term_or_names: list[str] | None, compositions: list[Composition]) -> list[Composition]:
    """Compositions named by term, or containing only the named leaf backends."""
    if not term_or_names:
        return compositions
    terms = {str(parse(t)) for t in term_or_names if "(" in t}
    leaves = {t for t in term_or_names if "(" not in t}
    for name in leaves:
        parse(name)  # unknown names fail with the list of known ones
    return [c for c in compositions if str(c) in terms or (leaves and set(c.leaves()) <= leaves)]


def matrix_rows(device: str, profile: Profile, backends: list[str] | None = None,
                properties: list[str] | None = None, modes: list[str] | None = None
                ) -> tuple[list[Row], list[tuple[str, str]]]:
    """Rows that can run here, and (what, why not) for compositions that cannot."""
    rows, skipped = [], []
    wanted_props = [PROPERTIES[p] for p in (properties or PROPERTIES)]
    for c in select(backends, all_compositions()):
        reason = c.unavailable_reason(device)
        if reason is None and not strategy_options(c, profile)["page_sizes"]:
            reason = f"declares none of the profile's page sizes {profile.page_sizes}"
        if reason is None and profile.dtype not in set.intersection(*(set(leaf_capabilities(n).dtypes) for n in c.leaves())):
            reason = f"does not support the profile's dtype {profile.dtype}"
        if reason:
            skipped.append((str(c), reason))
            continue
        for mode in sorted(composition_modes(c), key=lambda m: list(ForwardMode).index(m)):
            if modes and mode.value not in modes:
                continue
            for prop in wanted_props:
                if prop.applies(c, mode) is None:
                    rows.append(Row(c, mode, prop))
    return rows, skipped
