"""Hypothesis strategies for batch specifications, valid by construction.

Each strategy draws sizes first and contents second, so the shrinker moves toward fewer requests, shorter
lengths, zero prefixes and fewer layers. No ``assume`` or filter is needed: every drawn example is a batch
the composition can run (its declared page sizes, modes and layer kinds).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from hypothesis import strategies as st

from batch.spec import (KV_LAYOUTS, MAX_GRAPH_PADDING, RECURRENT_KINDS, STATE_SLOT_LAYOUTS, BatchSpec, ForwardMode,
                        ImageSpan, KDA_LOWER_BOUND, KdaLayer, LightningLayer, LinearLayer, Mamba2Layer, MHALayer, MLALayer, MropeLayout,
                        ShortConvLayer, SpecInput, VERIFY_ALGORITHMS, draft_forest, is_recurrent)
from search.profiles import Profile


def _without_local_constants() -> None:
    """Keep Hypothesis from mixing constants read from "local" source into the draws.

    Hypothesis (6.131 on) parses every loaded module that is not under site-packages and draws its literals now and
    then. For the harness that is its own modules and, where SGLang is a source checkout or on ``PYTHONPATH`` (a
    pull-request head in CI, a lent host's bundle), SGLang's ~1,000 modules: 18 s of parsing per process here, and on
    a 64-process CPU campaign a worker's first draw ran past the 120 s case timeout and was reported as a hang
    (``tbo(sglang.flex_attention)``, stuck in ``hypothesis/internal/constants_ast.py``, 2026-11-26). The strategies
    draw the values that matter explicitly (``Capabilities.length_boundaries``, the profile's shapes), and a seeded
    draw should not depend on which modules a process happens to have loaded. Private API: where a release lacks
    it, nothing changes."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return
    if callable(getattr(providers, "_get_local_constants", None)) and hasattr(providers, "_local_constants"):
        providers._get_local_constants = lambda: providers._local_constants


_without_local_constants()


@st.composite
def lengths(draw, lo: int, hi: int, page_size: int, boundaries: frozenset[int] = frozenset(),
            cap: int = 0) -> int:
    """A length in [lo, hi]; or at a page boundary (k*ps - 1, k*ps, k*ps + 1, and the first page's up to
    ``cap``), or 1; or at a kernel boundary b (b - 1, b, b + 1) up to ``cap`` even past ``hi``. Page and
    kernel boundaries are drawn apart, so a small page size's many boundaries do not crowd out the kernels'."""
    return draw(_lengths(lo, max(hi, lo), page_size, tuple(sorted(boundaries)), cap))


@functools.lru_cache(maxsize=None)
def _special_lengths(lo: int, hi: int, page_size: int, boundaries: tuple[int, ...] = (),
                     cap: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The lengths ``lengths`` draws apart from [lo, hi]: at page boundaries, and at kernel boundaries (up to
    ``cap``, past ``hi`` too)."""
    top = max(hi, cap)
    pages = [k * page_size + d for k in range(1, hi // max(page_size, 1) + 1) for d in (-1, 0, 1)]
    pages += [page_size + d for d in (-1, 0, 1)]
    special = sorted({x for x in [lo, 1, *pages] if lo <= x <= top})
    kernel = sorted({b + d for b in boundaries for d in (-1, 0, 1) if lo <= b + d <= top})
    return tuple(special), tuple(kernel)


@functools.lru_cache(maxsize=None)
def _lengths(lo: int, hi: int, page_size: int, boundaries: tuple[int, ...] = (), cap: int = 0) -> st.SearchStrategy[int]:
    # Built once per bounds: a fresh strategy per draw cost more than the draw (listing and validating up
    # to 3 * hi / page_size boundary lengths every time).
    special, kernel = _special_lengths(lo, hi, page_size, boundaries, cap)
    options = [st.integers(lo, hi), st.sampled_from(special)]
    return st.one_of(*options, *([st.sampled_from(kernel)] if kernel else []))


# The declared limits a batch crosses with a sliding window (properties/refusal.py's OVERREACHES)
WINDOW_CROSSINGS = ("sliding_window", "verify_window", "draft_window")


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


def _full_layer(kind: str, layer_id: int, profile: Profile, draw, window: int | None,
                head: tuple[int, int, int, int]) -> MHALayer | MLALayer:
    """A full-attention layer; an MHA layer has the batch's head configuration and uses the model's sliding
    ``window`` or none."""
    if kind == "mla":
        h, nope, rope, rank, v = profile.mla
        return MLALayer(layer_id, h, nope, rope, rank, v)
    hq, hk, d, dv = head
    sliding = window if window is not None and draw(st.booleans()) else None
    cap = draw(st.sampled_from([None, 5.0, 50.0]))
    return MHALayer(layer_id, hq, hk, d, dv, sliding_window=sliding, logit_cap=cap)


# Shapes of a batch, drawn first (an integer in 0..15 that shrinks toward 0, the ordinary shape): each edge in
# about one case in 16. SINGLE_TOKEN: one request, one new token. LARGEST: the profile's largest batch.
# LONG: a few requests with cached lengths in profile.long_context. WIDE: profile.wide_batch requests, each
# with a few new tokens. A profile without long contexts or wide batches draws the ordinary shape instead.
SHAPES = 16
SINGLE_TOKEN, LARGEST, LONG, WIDE = 12, 13, 14, 15
LONG_MAX_REQUESTS = 3
GRAPH_PADDING_ORDER = (1, 0) + tuple(range(2, MAX_GRAPH_PADDING + 1))  # graph_padding, simplest first
DRAFT_TOPK_ORDER, DRAFT_STEPS_ORDER = (2, 1, 3, 4), (3, 2, 4)  # a draft loop's branches and spec_steps, simplest first
LONG_MAX_EXTEND = 64
WIDE_MAX_EXTEND = 4


def _accept(draw, hi: int) -> int:
    """An accepted length in 1..hi, at an extreme (1: only the root; hi: the whole branch) as often as not."""
    return draw(st.one_of(st.sampled_from(sorted({1, hi})), st.integers(1, hi)))


@st.composite
def batch_specs(draw, profile: Profile, mode: ForwardMode, kinds: frozenset[str], *,
                page_sizes: tuple[int, ...] | None = None, sliding_window: bool = True, logit_cap: bool = True,
                mrope: bool = True, hybrid: bool = False, chain: bool = False, tree: bool = False,
                fixed_width: bool = False, dtype: str | None = None, kv_cache_dtypes: tuple[str, ...] = ("auto",),
                kv_scales: bool = True, require_recurrent: bool = False,
                head_configs: tuple[tuple[int, int, int, int], ...] | None = None,
                boundaries: frozenset[int] = frozenset(), empty_extend: bool = False,
                verify_window: bool = False, draft_window: bool = True, draft_prefix_window: bool = False,
                paged_draft_prefix_window: bool = True, paged_draft_trees: bool = True,
                draft_loop_trees: bool = True,
                verify_algorithms: tuple[str, ...] = ("eagle",),
                graph_padding: bool = False,
                overreach: tuple[str, ...] = (), kda_safe_gate: bool = True) -> BatchSpec:
    """A batch in ``mode`` whose layers use only ``kinds`` (those the composition runs).

    ``hybrid`` also draws draft-worker batches (a hybrid wrapper built for an MTP draft worker: its one full layer,
    id 0; off where the model's draft has no linear layer and the engine wraps none, Capabilities.hybrid_draft_worker);
    ``chain`` makes every draft tree a chain (topk 1), ``tree`` gives trees two or more children per node
    where the layers allow it (linear layers verify chains only); ``fixed_width`` makes every draft extend
    cover the whole draft window (``spec_steps + 1`` tokens per request, as EAGLE v2 and its CUDA graphs run
    it); ``dtype`` overrides the profile's; ``require_recurrent`` puts at least one linear-attention layer (of
    the kind the composition serves) in every batch (for properties about states); ``state_slot_layout`` is
    drawn for batches with linear layers. ``head_configs`` (default the profile's) are the MHA shapes the composition compiles;
    ``boundaries`` its kernels' length boundaries; ``empty_extend`` lets EXTEND/MIXED requests have no new
    tokens; ``verify_window`` keeps sliding windows in TARGET_VERIFY batches, ``draft_window`` in DRAFT_DECODE ones;
    ``draft_prefix_window`` draws the server's draft window over the prefix in DRAFT_DECODE batches of models without
    sliding windows (about one in two, often narrower than the prefixes, so that the window cuts them; over pages of
    more than one token only where ``paged_draft_prefix_window``); ``paged_draft_trees`` draws draft trees (topk > 1)
    over pages of more than one token, in SGLang's paged tree layout (batch.spec.draft_region), ``draft_loop_trees``
    draws them in the draft loop at all;
    ``verify_algorithms`` are the speculative algorithms a TARGET_VERIFY batch's verify input is drawn from.
    ``graph_padding`` (graph()
    compositions) draws the padded rows a replay adds beyond those its size needs (``BatchSpec.graph_padding``): one
    in the simplest batch, at least one in about two cases of three, so a replay's padded rows are reached on first
    contact whatever the batch size. ``overreach`` names declared limits (properties/refusal.py's OVERREACHES):
    one of them is drawn and the batch crosses it (the options above that keep batches inside it are lifted).
    """
    dtype = dtype or profile.dtype
    if mode is ForwardMode.DRAFT_DECODE:  # a draft model's layers: full attention only
        if not kinds - RECURRENT_KINDS:
            raise ValueError(f"draft_decode batches need a full-attention layer kind; {sorted(kinds)} has none")
        kinds = kinds - RECURRENT_KINDS
    crossing = draw(st.sampled_from(overreach)) if overreach else None
    if crossing == "logit_cap" or crossing in WINDOW_CROSSINGS:
        logit_cap = logit_cap or crossing == "logit_cap"
        sliding_window = sliding_window or crossing in ("sliding_window", "draft_window")
        verify_window = verify_window or crossing in ("sliding_window", "verify_window")
        draft_window = draft_window or crossing in ("sliding_window", "draft_window")
    elif crossing in ("fp8_kv_cache", "kv_scales"):
        kv_cache_dtypes, kv_scales = ("fp8_e4m3",), True
    shape = draw(st.integers(0, SHAPES - 1))
    if (shape == LONG and profile.long_context is None) or (shape == WIDE and profile.wide_batch is None) \
            or mode is ForwardMode.IDLE:
        shape = 0
    page_size = draw(st.sampled_from(page_sizes or profile.page_sizes))
    kv_layout = draw(st.sampled_from(KV_LAYOUTS))
    head = draw(st.sampled_from(head_configs or profile.heads))
    # A limit of MHA layers is crossed by a batch of them (an MLA model is not handed a soft-cap, a window or fp8)
    full_kinds = sorted(kinds & ({"mha"} if crossing else {"mha", "mla"}))
    draft_worker = hybrid and bool(full_kinds) and mode in (ForwardMode.DECODE, ForwardMode.EXTEND) and \
        draw(st.booleans()) and draw(st.booleans())
    # The model's one sliding window (SGLang: runner.sliding_window_size), then the layers: how many, the kind
    # of each, and whether it uses the window.
    window = draw(st.none() | st.integers(1, 2 * profile.max_extend))
    if draft_worker:
        layers = (_full_layer(full_kinds[0], 0, profile, draw, window, head),)
    else:
        full_kind = draw(st.sampled_from(full_kinds)) if full_kinds else None
        n_layers = draw(st.integers(1, profile.max_layers))
        recurrent = kinds & RECURRENT_KINDS
        assert len(recurrent) <= 1, f"a model has one kind of linear attention, the composition serves {recurrent}"
        recurrent_kind = next(iter(recurrent), None)
        # The linear kind first: Hypothesis's first and simplest batch of a hybrid is then one linear layer, the
        # layer the hybrid wrapper exists for (a row with one example, a slow row in CI, ran only a full layer)
        layer_kinds = [draw(st.sampled_from([k for k in (recurrent_kind, full_kind) if k])) for _ in range(n_layers)]
        if require_recurrent and recurrent_kind is not None and recurrent_kind not in layer_kinds:
            layer_kinds[-1] = recurrent_kind
        conv = (profile.short_conv_hidden, draw(st.sampled_from(profile.short_conv_kernels)), draw(st.booleans())) \
            if recurrent_kind == "short_conv" else None  # one kernel width and bias setting per model
        if recurrent_kind == "mamba2":  # one setting of each per model
            heads, head_dim, state, kernel = profile.mamba2
            mixer = dict(num_heads=heads, head_dim=head_dim, state_size=state, conv_kernel=kernel,
                         n_groups=draw(st.sampled_from(profile.mamba2_groups)),
                         chunk_size=draw(st.sampled_from(profile.mamba2_chunks)), conv_bias=draw(st.booleans()))
        # KDA: the standard gate (Kimi Linear) or the safe one (Ling V3, Kimi K3), one per model
        gates = (None, KDA_LOWER_BOUND) if kda_safe_gate else (None,)
        gate = draw(st.sampled_from(gates)) if recurrent_kind == "kda" else None
        sharp = draw(st.booleans()) if recurrent_kind == "kda" else False  # the model's decay rates, mild or sharp
        layers = tuple(LinearLayer(i, *profile.linear) if k == "linear"
                       else KdaLayer(i, *profile.kda, lower_bound=gate, sharp_decay=sharp) if k == "kda"
                       else LightningLayer(i, *profile.lightning) if k == "lightning"
                       else ShortConvLayer(i, *conv) if k == "short_conv"
                       else Mamba2Layer(i, **mixer) if k == "mamba2"
                       else _full_layer(k, i, profile, draw, window, head) for i, k in enumerate(layer_kinds))
    sliding_window = sliding_window and (verify_window or not mode.is_target_verify()) \
        and (draft_window or not mode.is_draft_decode())
    if not sliding_window or not logit_cap:
        layers = tuple(_strip(l, sliding_window, logit_cap) for l in layers)
    kv_cache_dtype, layers = draw(kv_caches(layers, kv_cache_dtypes, kv_scales))
    has_linear = any(is_recurrent(l) for l in layers)
    state_slot_layout = draw(st.sampled_from(STATE_SLOT_LAYOUTS)) if has_linear else STATE_SLOT_LAYOUTS[0]

    # Requests: how many, then their lengths.
    if mode is ForwardMode.IDLE:
        return BatchSpec(mode, (), (), layers, page_size=page_size, dtype=dtype,
                         seed=draw(st.integers(0, 2**31 - 1)), draft_worker=draft_worker, kv_layout=kv_layout,
                         kv_cache_dtype=kv_cache_dtype, state_slot_layout=state_slot_layout)
    if shape == SINGLE_TOKEN:
        B = 1
    elif shape == LARGEST:
        B = profile.max_requests
    elif shape == LONG:
        B = draw(st.integers(1, LONG_MAX_REQUESTS))
    elif shape == WIDE:
        B = draw(st.integers(*profile.wide_batch))
    else:
        B = draw(st.integers(1, profile.max_requests))

    def prefix_len(lo: int) -> int:
        if shape == LONG:
            a, b = profile.long_context
            return draw(st.one_of(st.sampled_from([a, b]), st.integers(a, b)))
        return draw(lengths(lo, profile.max_prefix, page_size, boundaries, profile.max_boundary))

    def new_len(hi: int) -> int:
        if shape == SINGLE_TOKEN:
            return 1
        hi = min(hi, LONG_MAX_EXTEND if shape == LONG else WIDE_MAX_EXTEND if shape == WIDE else hi)
        return draw(lengths(1, hi, page_size, boundaries, 0))

    spec_input = None
    if mode is ForwardMode.DECODE:
        prefix = [prefix_len(1) for _ in range(B)]
        extend = [1] * B
    elif mode is ForwardMode.TARGET_VERIFY:
        single = shape == SINGLE_TOKEN
        # Whose verify (EAGLE's first: the simplest draw): DFlash verifies a chain; n-gram trees are as deep as their
        # node budget allows (its server's topk is the search's breadth, its steps D // topk mean nothing here)
        algorithm = draw(st.sampled_from(verify_algorithms))
        steps = 1 if single else draw(st.integers(1, 4))
        topk = 1 if (has_linear or chain or single or algorithm == "dflash") else draw(st.integers(2 if tree else 1, 4))
        D = 1 if single else draw(st.integers(min(3, steps * topk + 1) if tree else 1, steps * topk + 1)) \
            if topk > 1 else steps + 1
        if algorithm == "ngram":
            steps = max(1, D - 1)
        prefix = [prefix_len(1) for _ in range(B)]
        extend = [D] * B
        trees = tuple(draw(draft_tree(D, steps, topk, chain=topk == 1)) for _ in range(B))
        accept = []
        for tree_ in trees:
            depth = [0] * D
            for j in range(1, D):
                depth[j] = depth[tree_[j]] + 1
            accept.append(_accept(draw, max(depth) + 1))
        spec_input = SpecInput(D, topk, steps, trees, tuple(accept), algorithm=algorithm)
    elif mode is ForwardMode.DRAFT_DECODE:
        # The draft loop: 1..3 forward steps (spec_steps 2..4), each decoding every branch of every request. The
        # simplest loop has two branches and two steps (DRAFT_TOPK_ORDER, DRAFT_STEPS_ORDER): a row searched with few examples still
        # sees a step read its own branch's earlier token, beside another branch's.
        steps = 2 if shape == SINGLE_TOKEN else draw(st.sampled_from(DRAFT_STEPS_ORDER))
        topk = 1 if (chain or not draft_loop_trees or shape == SINGLE_TOKEN
                     or (page_size > 1 and not paged_draft_trees)) \
            else draw(st.sampled_from(DRAFT_TOPK_ORDER))
        prefix = [prefix_len(1) for _ in range(B)]
        forest = draft_forest(topk, steps)
        extend = [len(forest)] * B
        window = sink = 0
        # (not where the draw crosses a window limit: that gives a layer its sliding window further down)
        if draft_prefix_window and (page_size == 1 or paged_draft_prefix_window) and crossing not in WINDOW_CROSSINGS \
                and not any(getattr(l, "sliding_window", None) for l in layers) and draw(st.booleans()):
            # SGLang's --speculative-draft-window-size (and -sink-size): no wider than the longest prefix, so most
            # draws cut some request's prefix into its sinks and its recent tokens
            window = draw(st.integers(1, max(prefix)))
            sink = draw(st.integers(0, min(4, max(prefix))))
        spec_input = SpecInput(len(forest), topk, steps, tuple(forest for _ in range(B)), (1,) * B,
                               draft_window_size=window, draft_sink_size=sink)
    elif mode is ForwardMode.DRAFT_EXTEND:
        # Ragged accepted lengths: each request extends by what verification accepted of its branch, after what
        # earlier steps cached (its prompt at least: batch.spec's rule)
        steps = 1 if shape == SINGLE_TOKEN else draw(st.integers(1, 4))
        prefix = [prefix_len(1) for _ in range(B)]
        extend = [steps + 1 if fixed_width else 1 if shape == SINGLE_TOKEN else _accept(draw, steps + 1)
                  for _ in range(B)]
        spec_input = SpecInput(steps + 1, 1, steps, tuple(tuple(range(-1, steps)) for _ in range(B)), tuple(extend))
    else:
        # No prefix (a fresh prompt) as often as a cached one, except in long contexts.
        prefix = [prefix_len(0) if shape == LONG or draw(st.integers(0, 1)) else 0 for _ in range(B)]
        extend = [new_len(profile.max_extend) for _ in range(B)]
        if mode is ForwardMode.MIXED:
            # Some requests are decodes (an extend of 1 after a cached prefix).
            for i in range(B):
                if draw(st.booleans()):
                    prefix[i], extend[i] = max(prefix[i], 1), 1
        if empty_extend and B > 1:
            # A request with nothing new after its cached prefix (one in eight), never all of them.
            empty = [draw(st.integers(0, 7)) == 7 for _ in range(B)]
            empty[0] = empty[0] and not all(empty)
            for i in range(B):
                if empty[i]:
                    prefix[i], extend[i] = max(prefix[i], 1), 0
    if crossing is not None:
        # Over one key a soft-cap changes nothing, and a window w hides key 0 only from a query at a position past w:
        # a request with queries gets the cached keys for its crossing to show (its first query at position 2 or
        # more under a window, whatever its draft tree; two keys or more under a soft-cap)
        asking = max((i for i in range(B) if extend[i]), key=lambda i: prefix[i] + extend[i])
        least = 2 if crossing in WINDOW_CROSSINGS else 2 - extend[asking]
        prefix[asking] = max(prefix[asking], least)
    mrope_layout = None
    if mrope and not mode.drafts_tree() and not has_linear and draw(st.booleans()):
        mrope_layout = draw(mrope_layouts(layers, prefix, extend))
    # The longest cache row: its keys, or in a draft loop the prefix and every branch's draft slots
    kv_max = max(p + (spec_input.topk * spec_input.spec_steps if mode is ForwardMode.DRAFT_DECODE else e)
                 for p, e in zip(prefix, extend))
    seed = draw(st.integers(0, 2**31 - 1))
    # One padded row first: Hypothesis tries each choice's simplest value first, and a row searched with one example
    # (the ci profile's slow rows) checks that batch alone, so its replay is padded too. Then an exact fit, then more.
    padding = GRAPH_PADDING_ORDER[draw(st.integers(0, MAX_GRAPH_PADDING))] if graph_padding else 0
    if crossing is not None:
        layers = draw(_crossing_layers(crossing, layers, _highest_query_position(mode, prefix, extend, spec_input)))
    return BatchSpec(mode, tuple(prefix), tuple(extend), layers, page_size=page_size, dtype=dtype,
                     seed=seed, spec=spec_input, mrope=mrope_layout,
                     draft_worker=draft_worker, kv_layout=kv_layout, context_len=context_len_for(kv_max),
                     kv_cache_dtype=kv_cache_dtype, state_slot_layout=state_slot_layout, graph_padding=padding)


# ``batch_specs`` options that several rows' strategies merge into one (search/group.py: one batch drawn for many
# rows, each row running those it could have drawn itself, ``drawable``): sets are joined, permissions granted where
# any row grants them, a restriction kept where every row keeps it. Any other option must be equal to be merged.
UNION_OPTIONS = ("page_sizes", "kv_cache_dtypes", "head_configs", "boundaries", "verify_algorithms")
ANY_OPTIONS = ("sliding_window", "logit_cap", "mrope", "kv_scales", "empty_extend", "verify_window", "draft_window",
               "draft_prefix_window", "paged_draft_prefix_window", "paged_draft_trees", "draft_loop_trees", "kda_safe_gate",
               "hybrid", "graph_padding")
ALL_OPTIONS = ("chain",)
MERGED_OPTIONS = UNION_OPTIONS + ANY_OPTIONS + ALL_OPTIONS


def merge_options(options: list[dict]) -> dict:
    """One set of ``batch_specs`` options whose draws include every one of ``options``' (their keys outside
    MERGED_OPTIONS equal)."""
    merged = dict(options[0])
    for o in options[1:]:
        for key in set(merged) | set(o):
            a, b = merged.get(key), o.get(key)
            if key in UNION_OPTIONS and (a is None or b is None) and key in ("page_sizes", "head_configs"):
                merged[key] = None  # the profile's, all of them
            elif key == "boundaries":
                merged[key] = frozenset(a or ()) | frozenset(b or ())
            elif key == "verify_algorithms":
                merged[key] = tuple(sorted(set(a or ()) | set(b or ()), key=VERIFY_ALGORITHMS.index))
            elif key in UNION_OPTIONS:
                # In order, the first row's first: a list's first entry is where Hypothesis starts and shrinks to (the
                # profile's first head configuration, GQA with two KV heads, is the one that shows a head-mapping
                # bug; sorted, a group started from one KV head, and its rows met that bug in 2 runs of 12 where
                # each row searched alone met it in 12)
                merged[key] = tuple(dict.fromkeys([*(a or ()), *(b or ())]))
            elif key in ANY_OPTIONS:
                merged[key] = bool(merged.get(key, _DEFAULTS[key])) or bool(o.get(key, _DEFAULTS[key]))
            elif key in ALL_OPTIONS:
                merged[key] = bool(merged.get(key, _DEFAULTS[key])) and bool(o.get(key, _DEFAULTS[key]))
            elif a != b:
                raise ValueError(f"option {key} differs ({a!r}, {b!r}): not mergeable")
    return merged


# batch_specs' own defaults of the options merged (page sizes and head configurations: None, the profile's)
_DEFAULTS = {k: p.default for k, p in inspect.signature(batch_specs).parameters.items() if k in MERGED_OPTIONS}


def drawable(spec: BatchSpec, options: dict, profile: Profile) -> str | None:
    """Why ``batch_specs(profile, ..., **options)`` could not have drawn ``spec`` (for the options in MERGED_OPTIONS;
    the others are a merged group's common ones), or None. A graph replay's padded rows are read by graph()
    compositions alone (a row that draws none runs the batch without them): not checked. Lengths at kernel boundaries
    within the profile's ranges only weigh draws; a cached prefix past them is drawn only at the row's own
    boundaries (or its page's)."""
    o = _DEFAULTS | options
    s, mha = spec.spec, [l for l in spec.layers if l.kind == "mha"]
    own = tuple(sorted(o["boundaries"]))
    special, kernel = _special_lengths(0, profile.max_prefix, spec.page_size, own, profile.max_boundary)
    long = profile.long_context or (0, -1)
    for x in spec.prefix_lens:
        if x > profile.max_prefix and x not in special and x not in kernel and not long[0] <= x <= long[1]:
            return f"a cached prefix of {x}"
    if o["page_sizes"] and spec.page_size not in o["page_sizes"]:
        return f"page size {spec.page_size}"
    if spec.kv_cache_dtype not in o["kv_cache_dtypes"]:
        return f"KV cache {spec.kv_cache_dtype}"
    if o["head_configs"] and any(l.shape not in o["head_configs"] for l in mha):
        return "an MHA head configuration"
    if not o["kv_scales"] and any(l.k_scale != 1.0 or l.v_scale != 1.0 for l in mha):
        return "KV scales"
    windows = o["sliding_window"] and (o["verify_window"] or not spec.mode.is_target_verify()) \
        and (o["draft_window"] or not spec.mode.is_draft_decode())
    if not windows and any(l.sliding_window is not None for l in mha):
        return "a sliding window"
    if not o["logit_cap"] and any(l.logit_cap is not None for l in mha):
        return "a logit cap"
    if not o["mrope"] and spec.mrope is not None:
        return "M-RoPE"
    if not o["empty_extend"] and 0 in spec.extend_lens and spec.mode is not ForwardMode.IDLE:
        return "an empty extend"
    if not o["hybrid"] and spec.draft_worker:
        return "a draft worker's batch"
    if not o["kda_safe_gate"] and any(l.kind == "kda" and l.lower_bound is not None for l in spec.layers):
        return "KDA's safe gate"
    if s is not None:
        if o["chain"] and s.topk > 1:
            return "a draft tree"
        if spec.mode.is_target_verify() and s.algorithm not in o["verify_algorithms"]:
            return f"{s.algorithm}'s verify"
        if s.draft_window_size and not (o["draft_prefix_window"] and (spec.page_size == 1
                                                                       or o["paged_draft_prefix_window"])):
            return "a draft window over the prefix"
        if spec.mode.is_draft_decode() and spec.page_size > 1 and s.topk > 1 and not o["paged_draft_trees"]:
            return "a paged draft tree"
        if spec.mode.is_draft_decode() and s.topk > 1 and not o["draft_loop_trees"]:
            return "a tree in the draft loop"
    return None


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


def context_len_for(kv_len: int) -> int:
    """The req_to_token row length of a batch whose longest request has ``kv_len`` keys: 4096, or the next
    power of two that holds it (long contexts)."""
    n = BatchSpec.context_len  # the default row length
    while n < kv_len:
        n *= 2
    return n


def _highest_query_position(mode: ForwardMode, prefix: list[int], extend: list[int], spec_input) -> int:
    """The position of the batch's furthest query: a request's last new token, or in a verify the deepest node of its
    draft tree or a draft loop's branches (a node's position is the cached length plus its depth)."""
    def top(i: int) -> int:
        if mode.drafts_tree():
            return prefix[i] + max(spec_input.depths(i))
        return prefix[i] + extend[i] - 1
    return max(top(i) for i in range(len(prefix)) if extend[i])


@st.composite
def _crossing_layers(draw, crossing: str, layers, highest: int):
    """``layers`` with the first MHA layer made to cross ``crossing`` where the draw left none that crosses it
    visibly: a soft-cap of 5 or less (a cap of 50 changes unit-scale scores by less than a bfloat16 bound), the
    model's window short enough to hide a key from the query at position ``highest`` (the furthest), a KV scale
    other than 1. An fp8 cache is the batch's, drawn as such already."""
    mha = [i for i, l in enumerate(layers) if l.kind == "mha"]
    if not mha:
        return layers
    first = layers[mha[0]]
    if crossing == "logit_cap" and not any(layers[i].logit_cap and layers[i].logit_cap <= 5.0 for i in mha):
        first = dataclasses.replace(first, logit_cap=draw(st.sampled_from([5.0, 1.0])))
    elif crossing in WINDOW_CROSSINGS:
        window = next((layers[i].sliding_window for i in mha if layers[i].sliding_window), None)
        if window is None or window > highest - 1:  # one model window, short of the furthest query's position
            window = draw(st.integers(1, max(1, highest - 1)))
            layers = tuple(dataclasses.replace(l, sliding_window=window) if l.kind == "mha" and l.sliding_window
                           else l for l in layers)
            first = layers[mha[0]]
        first = dataclasses.replace(first, sliding_window=window)
    elif crossing == "kv_scales" and all(layers[i].k_scale == layers[i].v_scale == 1.0 for i in mha):
        first = dataclasses.replace(first, k_scale=draw(st.sampled_from(KV_SCALES[1:])))
    return layers[:mha[0]] + (first,) + layers[mha[0] + 1:]


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


def _heads_text(head: tuple[int, int, int, int]) -> str:
    hq, hk, d, _ = head
    kind = "MHA" if hq == hk else "MQA" if hk == 1 else f"GQA {hq // hk}"
    return f"{hq}/{hk}x{d} ({kind})"


def describe_axes(profile: Profile) -> list[str]:
    """What ``batch_specs`` draws under ``profile``, one axis a line (``harness list`` prints it)."""
    rot = profile.rotating_head_configs
    heads = ", ".join(_heads_text(h) for h in profile.head_configs)
    if rot:
        heads += (f"; rotating ({profile.name}: one of {len(rot)} a run, NAME@K picks K): "
                  + ", ".join(("*" if k == profile.rotation % len(rot) else "") + _heads_text(h)
                              for k, h in enumerate(rot)))
    long = "-" if profile.long_context is None else \
        f"{profile.long_context[0]}..{profile.long_context[1]} cached keys, up to {LONG_MAX_REQUESTS} requests (1 case in {SHAPES})"
    wide = "-" if profile.wide_batch is None else \
        f"{profile.wide_batch[0]}..{profile.wide_batch[1]} requests of <= {WIDE_MAX_EXTEND} new tokens (1 case in {SHAPES})"
    return [
        f"page sizes    {', '.join(map(str, profile.page_sizes))} (a composition draws those it declares)",
        f"KV layouts    {', '.join(KV_LAYOUTS)}",
        f"head configs  {heads}",
        f"lengths       prefixes <= {profile.max_prefix}, new tokens <= {profile.max_extend}; at page boundaries and "
        f"at the kernels' declared boundaries (prefixes up to {profile.max_boundary})",
        f"long contexts {long}",
        f"wide batches  {wide}",
        f"edges         one request of one token, the largest batch ({profile.max_requests} requests) "
        f"(1 case in {SHAPES} each); empty extends where declared",
        "speculative   trees of topk 1..4 (tree_branch: >= 2), accepted lengths at 1 and at the branch's end, "
        "sliding windows in target_verify where declared",
    ]
