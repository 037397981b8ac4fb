"""The test matrix, derived from the backends' declarations: composition x mode x property.

Nothing here lists backends by hand: rows come from ``backends.registry.all_compositions`` filtered by
what each composition declares and what can run on this machine; every excluded row has a reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from backends.registry import Composition, all_compositions, leaf_capabilities, parse
from batch.spec import VERIFY_ALGORITHMS, ForwardMode
from properties import PROPERTIES, Property
from search.profiles import Profile


@dataclass(frozen=True)
class Row:
    composition: Composition
    mode: ForwardMode
    property: Property

    @property
    def id(self) -> str:
        return f"{self.composition}-{self.mode.value}-{self.property.name}"


def composition_modes(c: Composition) -> frozenset[ForwardMode]:
    return c.support().modes


def row_dtype(c: Composition, profile: Profile, device: str = "cuda") -> str | None:
    """The dtype ``c``'s batches are drawn in: the profile's, else its fallback, whichever ``c`` runs here."""
    support = c.support()
    for dtype in (profile.dtype, profile.fallback_dtype):
        if dtype in support.dtypes and (device != "cpu" or dtype in support.cpu_dtypes):
            return dtype
    return None


def strategy_options(c: Composition, profile: Profile, device: str = "cuda") -> dict:
    """Keyword arguments of ``batch_specs`` that keep drawn batches inside what ``c`` declares."""
    support = c.support()
    pages = set(profile.page_sizes) if support.page_sizes is None else set(profile.page_sizes) & support.page_sizes
    heads = tuple(h for h in profile.heads if support.head_dims is None or h[2] in support.head_dims)
    return {
        "dtype": row_dtype(c, profile, device) or profile.dtype,
        "page_sizes": tuple(sorted(pages)),
        "fixed_width": support.fixed_width_draft_extend,
        "sliding_window": support.sliding_window,
        "logit_cap": support.logit_cap,
        "mrope": support.mrope,
        "hybrid": "hybrid" in c.wrappers() and support.hybrid_draft_worker,
        "kv_cache_dtypes": tuple(d for d in profile.kv_cache_dtypes if d in support.kv_cache_dtypes),
        "kv_scales": support.kv_scales,
        "head_configs": heads,
        "boundaries": support.length_boundaries,
        "empty_extend": support.empty_extend,
        "verify_window": support.verify_window,
        "draft_window": support.draft_window,
        "draft_prefix_window": support.draft_prefix_window and ForwardMode.DRAFT_DECODE in support.modes,
        "paged_draft_prefix_window": support.paged_draft_prefix_window,
        "paged_draft_trees": support.paged_draft_trees,
        "draft_loop_trees": support.draft_loop_trees,
        "verify_algorithms": tuple(a for a in VERIFY_ALGORITHMS if a in support.verify_algorithms) or ("eagle",),
        "chain": not support.draft_trees,
        "kda_safe_gate": support.kda_safe_gate,
        "graph_padding": "graph" in c.wrappers(),
    }


def composition_axes(c: Composition, profile: Profile) -> str:
    """The axes that depend on ``c``'s declarations, in one line (``harness list --why``)."""
    o = strategy_options(c, profile)
    bounds = sorted(b for b in o["boundaries"] if b <= max(profile.max_boundary, profile.max_prefix))
    return (f"draws page sizes {','.join(map(str, o['page_sizes']))}; kernel boundaries "
            f"{','.join(map(str, bounds)) or '-'}; empty extends {'yes' if o['empty_extend'] else 'no'}; windows in "
            f"verify {'yes' if o['verify_window'] and o['sliding_window'] else 'no'}; draft windows over the prefix "
            f"{'yes' if o['draft_prefix_window'] else 'no'}; verifies {','.join(o['verify_algorithms'])}")


def profile_reason(c: Composition, profile: Profile, device: str = "cuda") -> str | None:
    """Why none of ``c``'s rows can run under ``profile`` (a kernel configuration it does not declare)."""
    support = c.support()
    options = strategy_options(c, profile)
    if not options["page_sizes"]:
        return f"declares none of the profile's page sizes {profile.page_sizes}"
    if row_dtype(c, profile, device) is None:
        wanted = " or ".join(d for d in (profile.dtype, profile.fallback_dtype) if d)
        where = " on the CPU" if device == "cpu" and profile.dtype in support.dtypes else ""
        return f"does not support the profile's dtype {wanted}{where}"
    if "lightning" in support.attention_kinds and support.linear_head_dims is not None \
            and profile.lightning[1] not in support.linear_head_dims:
        return (f"does not support the profile's lightning head_dim {profile.lightning[1]} "
                f"(declares {sorted(support.linear_head_dims)})")
    if "mla" in support.attention_kinds and support.mla_latents is not None \
            and (profile.mla[3], profile.mla[2]) not in support.mla_latents:
        return (f"does not support the profile's MLA latent {profile.mla[3]} + rope {profile.mla[2]} "
                f"(declares {' or '.join(f'{c} + {r}' for c, r in sorted(support.mla_latents))})")
    if "mha" in support.attention_kinds and not options["head_configs"]:
        dims = sorted({h[2] for h in profile.heads})
        return f"supports none of the profile's head_dims {dims} (declares {sorted(support.head_dims)})"
    return None


def mode_reason(c: Composition, mode: ForwardMode) -> str:
    """Why ``c`` has no rows of ``mode``: the first leaf (or the graph wrapper) that does not declare it."""
    for n in c.leaves():
        caps = leaf_capabilities(n)
        if mode not in caps.modes:
            return f"{n} does not declare {mode.value}"
        decodes_only = any(n == s.children[1].name for s in c.splits())  # verify goes to the prefill backend
        if mode is ForwardMode.TARGET_VERIFY and not caps.custom_mask and not decodes_only:
            return f"{n} has no custom (tree) mask"
    for wrapper, gapped, why in c.wrapped_gaps():
        if gapped is mode:
            return f"under {wrapper}(): {why}"
    for gapped, why in c.engine_mode_gaps():
        if gapped is mode:
            return why
    for n in c.leaves():
        if mode not in leaf_capabilities(n).cuda_graph_modes:
            return f"{n} captures no {mode.value} graph"
    return "not declared"


def not_derived_reason(c: Composition) -> str:
    """Why a well-formed term is not among the compositions the declarations allow."""
    if "graph" in c.wrappers():
        missing = [n for n in c.leaves() if not leaf_capabilities(n).cuda_graph_modes
                   and not leaf_capabilities(n).prefill_graph]
        if missing:
            return f"{', '.join(missing)} captures no CUDA graph (declares no cuda_graph_modes, no prefill graph)"
    return "not a composition the backends' declarations allow"


def select(term_or_names: list[str] | None, compositions: list[Composition]) -> list[Composition]:
    """Compositions named by term, or containing only the named leaf backends."""
    if not term_or_names:
        return compositions
    terms = {str(parse(t)) for t in term_or_names if "(" in t}
    leaves = {t for t in term_or_names if "(" not in t}
    for name in leaves:
        parse(name)  # unknown names fail with the list of known ones
    return [c for c in compositions if str(c) in terms or (leaves and set(c.leaves()) <= leaves)]


@dataclass(frozen=True)
class Matrix:
    """The rows that run here; compositions that cannot run here; and every other row left out, with why."""

    rows: list[Row]
    unavailable: list[tuple[str, str]]  # (composition, reason)
    excluded: list[tuple[str, str]]  # (row id or "composition-mode", reason)

    def why_empty(self) -> str:
        """Why a selection gave no row, in one line: the selected compositions' unavailable reasons, or the
        rows that were left out and why."""
        head = "no matrix row matches the selection"
        if self.unavailable and not self.excluded:
            reasons = list(dict.fromkeys(why for _, why in self.unavailable))
            names = ", ".join(name for name, _ in self.unavailable[:3]) + (" ..." if len(self.unavailable) > 3 else "")
            return f"{head}: {names} cannot run here: {'; '.join(reasons[:3])}"
        if self.excluded:
            shown = "; ".join(f"{what}: {why}" for what, why in self.excluded[:3])
            more = f" (and {len(self.excluded) - 3} more)" if len(self.excluded) > 3 else ""
            return f"{head}: left out: {shown}{more} (see `python -m harness list --why`)"
        return f"{head} (see `python -m harness list`)"


def matrix(device: str, profile: Profile, backends: list[str] | None = None, properties: list[str] | None = None,
           modes: list[str] | None = None) -> Matrix:
    rows, unavailable, excluded = [], [], []
    wanted_props = [PROPERTIES[p] for p in (properties or PROPERTIES)]
    compositions = all_compositions()
    known = {str(c) for c in compositions}
    for term in [t for t in backends or () if "(" in t and str(parse(t)) not in known]:
        unavailable.append((str(parse(t := term)), not_derived_reason(parse(t))))
    for c in select(backends, compositions):
        reason = c.unavailable_reason(device) or profile_reason(c, profile, device)
        if reason:
            unavailable.append((str(c), reason))
            continue
        supported = composition_modes(c)
        for mode in ForwardMode:
            if modes and mode.value not in modes:
                continue
            if mode not in supported:
                excluded.append((f"{c}-{mode.value}", mode_reason(c, mode)))
                continue
            for prop in wanted_props:
                why = prop.applies(c, mode) or c.support().gaps.get(prop.name) or \
                    (c.support().cpu_gaps.get(prop.name) if device == "cpu" else None)
                if why is None:
                    rows.append(Row(c, mode, prop))
                else:
                    excluded.append((Row(c, mode, prop).id, why))
    return Matrix(rows, unavailable, excluded)


def matrix_rows(device: str, profile: Profile, backends: list[str] | None = None,
                properties: list[str] | None = None, modes: list[str] | None = None
                ) -> tuple[list[Row], list[tuple[str, str]]]:
    """Rows that can run here, and (composition, why not) for compositions that cannot."""
    m = matrix(device, profile, backends, properties, modes)
    return m.rows, m.unavailable


def shard_of(row_id: str, shards: int) -> int:
    """A row's shard: a stable hash of its id, so it depends on neither the row's order nor the machine."""
    return int.from_bytes(hashlib.sha256(row_id.encode()).digest()[:8], "big") % shards


def shard_rows(rows: list[Row], shard: tuple[int, int] | None) -> list[Row]:
    """The rows of shard ``(index, count)`` (all rows for None)."""
    if shard is None:
        return list(rows)
    index, count = shard
    return [r for r in rows if shard_of(r.id, count) == index]
