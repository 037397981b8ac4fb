"""Hypothesis strategies for batch specifications, valid by construction.

Each strategy draws sizes first and contents second, so the shrinker moves toward fewer requests, shorter
lengths, zero prefixes and fewer layers. No ``assume`` or filter is needed: every drawn example is a batch
the composition can run (its declared page sizes, modes and layer kinds).
"""

from __future__ import annotations

import dataclasses
import functools

from hypothesis import strategies as st

from batch.spec import (STATE_SLOT_LAYOUTS, BatchSpec, ForwardMode, ImageSpan, LinearLayer, MHALayer, MLALayer,
                        MropeLayout, SpecInput)
from search.profiles import Profile


@st.composite
def lengths(draw, lo: int, hi: int, page_size: int) -> int:
    """A length in [lo, hi] that is often at a page boundary (k*ps - 1, k*ps, k*ps + 1), or 1."""
    return draw(_lengths(lo, max(hi, lo), page_size))


@functools.lru_cache(maxsize=None)
def _lengths(lo: int, hi: int, page_size: int) -> st.SearchStrategy[int]:
    # Built once per bounds: a fresh strategy per draw cost more than the draw (listing and validating up
    # to 3 * hi / page_size boundary lengths every time).
    pages = [k * page_size + d for k in range(1, hi // max(page_size, 1) + 1) for d in (-1, 0, 1)]
    special = sorted({x for x in [lo, 1, *pages] if lo <= x <= hi})
    return st.one_of(st.integers(lo, hi), st.sampled_from(special))


@st.composite
def draft_tree(draw, draft_token_num: int, steps: int, topk: int, chain: bool) -> tuple[int, ...]:
    """Parent indices of an EAGLE-style draft tree: node 0 is the root; no node deeper than ``steps``;
    at most ``topk`` children per node."""
    if chain:
        return tuple(range(-1, draft_token_num - 1))
    parents, depth, children = [-1], [0], [0]
    for j in range(1, draft_token_num):
        options = [i for i in range(j) if depth[i] < steps and children[i] < topk] or [0]
        p = draw(st.sampled_from(options))
        parents.append(p)
        depth.append(depth[p] + 1)
        children.append(0)
        children[p] += 1
    return tuple(parents)


def _full_layer(kind: str, layer_id: int, profile: Profile, draw, window: int | None) -> MHALayer | MLALayer:
    """A full-attention layer; an MHA layer uses the model's sliding ``window`` or none."""
    if kind == "mla":
        h, nope, rope, rank, v = profile.mla
        return MLALayer(layer_id, h, nope, rope, rank, v)
    hq, hk, d, dv = profile.mha
    sliding = window if window is not None and draw(st.booleans()) else None
    cap = draw(st.sampled_from([None, 5.0, 50.0]))
    return MHALayer(layer_id, hq, hk, d, dv, sliding_window=sliding, logit_cap=cap)


@st.composite
def batch_specs(draw, profile: Profile, mode: ForwardMode, kinds: frozenset[str], *,
                page_sizes: tuple[int, ...] | None = None, sliding_window: bool = True, logit_cap: bool = True,
                mrope: bool = True, hybrid: bool = False, chain: bool = False, fixed_width: bool = False,
                dtype: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto",), kv_scales: bool = True,
                require_kind: str | None = None) -> BatchSpec:
    """A batch in ``mode`` whose layers use only ``kinds`` (those the composition runs).

    ``hybrid`` draws layouts mixing full and linear layers by layer id (and draft-worker batches);
    ``chain`` makes every draft tree a chain (topk 1); ``fixed_width`` makes every draft extend cover the
    whole draft window (``spec_steps + 1`` tokens per request, as EAGLE v2 and its CUDA graphs run it);
    ``dtype`` overrides the profile's; ``require_kind`` ("linear") puts at least one layer of that kind in every
    batch (for properties about that kind); ``state_slot_layout`` is drawn for batches with linear layers.
    """
    dtype = dtype or profile.dtype
    page_size = draw(st.sampled_from(page_sizes or profile.page_sizes))
    full_kinds = sorted(kinds & {"mha", "mla"})
    draft_worker = hybrid and bool(full_kinds) and mode in (ForwardMode.DECODE, ForwardMode.EXTEND) and \
        draw(st.booleans()) and draw(st.booleans())
    # The model's one sliding window (SGLang: runner.sliding_window_size), then the layers: how many, the kind
    # of each, and whether it uses the window.
    window = draw(st.none() | st.integers(1, 2 * profile.max_extend))
    if draft_worker:
        layers = (_full_layer(full_kinds[0], 0, profile, draw, window),)
    else:
        full_kind = draw(st.sampled_from(full_kinds)) if full_kinds else None
        n_layers = draw(st.integers(1, profile.max_layers))
        layer_kinds = [draw(st.sampled_from([k for k in (full_kind, "linear" if "linear" in kinds else None) if k]))
                       for _ in range(n_layers)]
        if require_kind is not None and require_kind not in layer_kinds:
            layer_kinds[-1] = require_kind
        layers = tuple(LinearLayer(i, *profile.linear) if k == "linear" else _full_layer(k, i, profile, draw, window)
                       for i, k in enumerate(layer_kinds))
    sliding_window = sliding_window and not mode.is_target_verify()  # not modelled with tree masks
    if not sliding_window or not logit_cap:
        layers = tuple(_strip(l, sliding_window, logit_cap) for l in layers)
    kv_cache_dtype, layers = draw(kv_caches(layers, kv_cache_dtypes, kv_scales))
    has_linear = any(l.kind == "linear" for l in layers)
    state_slot_layout = draw(st.sampled_from(STATE_SLOT_LAYOUTS)) if has_linear else STATE_SLOT_LAYOUTS[0]

    # Requests: how many, then their lengths.
    if mode is ForwardMode.IDLE:
        return BatchSpec(mode, (), (), layers, page_size=page_size, dtype=dtype,
                         seed=draw(st.integers(0, 2**31 - 1)), draft_worker=draft_worker,
                         kv_cache_dtype=kv_cache_dtype, state_slot_layout=state_slot_layout)
    B = draw(st.integers(1, profile.max_requests))
    spec_input = None
    if mode is ForwardMode.DECODE:
        prefix = [draw(lengths(1, profile.max_prefix, page_size)) for _ in range(B)]
        extend = [1] * B
    elif mode is ForwardMode.TARGET_VERIFY:
        steps = draw(st.integers(1, 4))
        topk = 1 if (has_linear or chain) else draw(st.integers(1, 4))
        D = draw(st.integers(1, steps * topk + 1)) if topk > 1 else steps + 1
        prefix = [draw(lengths(1, profile.max_prefix, page_size)) for _ in range(B)]
        extend = [D] * B
        trees = tuple(draw(draft_tree(D, steps, topk, chain=topk == 1)) for _ in range(B))
        accept = []
        for tree in trees:
            depth = [0] * D
            for j in range(1, D):
                depth[j] = depth[tree[j]] + 1
            accept.append(draw(st.integers(1, max(depth) + 1)))
        spec_input = SpecInput(D, topk, steps, trees, tuple(accept))
    elif mode is ForwardMode.DRAFT_EXTEND:
        steps = draw(st.integers(1, 4))
        prefix = [draw(lengths(0, profile.max_prefix, page_size)) for _ in range(B)]
        extend = [steps + 1 if fixed_width else draw(st.integers(1, steps + 1)) for _ in range(B)]
        spec_input = SpecInput(steps + 1, 1, steps, tuple(tuple(range(-1, steps)) for _ in range(B)), tuple(extend))
    else:
        prefix = [draw(st.one_of(st.just(0), lengths(0, profile.max_prefix, page_size))) for _ in range(B)]
        extend = [draw(lengths(1, profile.max_extend, page_size)) for _ in range(B)]
        if mode is ForwardMode.MIXED:
            # Some requests are decodes (an extend of 1 after a cached prefix).
            for i in range(B):
                if draw(st.booleans()):
                    prefix[i], extend[i] = max(prefix[i], 1), 1
    mrope_layout = None
    if mrope and not mode.is_target_verify() and not has_linear and draw(st.booleans()):
        mrope_layout = draw(mrope_layouts(layers, prefix, extend))
    return BatchSpec(mode, tuple(prefix), tuple(extend), layers, page_size=page_size, dtype=dtype,
                     seed=draw(st.integers(0, 2**31 - 1)), spec=spec_input, mrope=mrope_layout,
                     draft_worker=draft_worker, kv_cache_dtype=kv_cache_dtype, state_slot_layout=state_slot_layout)


KV_SCALES = (1.0, 0.5, 2.0, 2.0**-6, 2.0**4)  # powers of two: batch.spec.KV_SCALE_RANGE, shrinking toward 1


@st.composite
def kv_caches(draw, layers, kv_cache_dtypes: tuple[str, ...], kv_scales: bool):
    """The KV cache's storage (one of ``kv_cache_dtypes``; fp8 only for models without MLA layers) and the layers,
    each MHA layer with its KV scales under an fp8 cache (1 where the composition honours no other)."""
    options = [d for d in kv_cache_dtypes if d == "auto" or all(l.kind != "mla" for l in layers)] or ["auto"]
    kv_cache_dtype = draw(st.sampled_from(options))
    if kv_cache_dtype == "auto" or not kv_scales:
        return kv_cache_dtype, layers
    scale = st.sampled_from(KV_SCALES)
    return kv_cache_dtype, tuple(dataclasses.replace(l, k_scale=draw(scale), v_scale=draw(scale))
                                 if l.kind == "mha" else l for l in layers)


def _strip(layer, sliding_window: bool, logit_cap: bool):
    if layer.kind != "mha":
        return layer
    return MHALayer(layer.layer_id, layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim,
                    sliding_window=layer.sliding_window if sliding_window else None,
                    logit_cap=layer.logit_cap if logit_cap else None)


@st.composite
def mrope_layouts(draw, layers, prefix: list[int], extend: list[int]) -> MropeLayout:
    """Text with image grids inside: sections split the rotary half-dim; images never overlap."""
    rot = next(l.head_dim if l.kind == "mha" else l.qk_rope_head_dim for l in layers)
    half = rot // 2
    t = draw(st.integers(0, half // 3))
    h = draw(st.integers(0, half - t))
    sections = (t, h, half - t - h)
    images = []
    for i, (p, e) in enumerate(zip(prefix, extend)):
        pos, total = 0, p + e
        while draw(st.booleans()):
            gt, gh, gw = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
            start = draw(st.integers(pos, total))
            if start + gt * gh * gw > total:
                break
            images.append(ImageSpan(i, start, gt, gh, gw))
            pos = start + gt * gh * gw
    return MropeLayout(sections, tuple(images))
