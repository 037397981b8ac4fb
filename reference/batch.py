"""The reference over a whole materialized batch, in float64: the single-request definitions of
``reference.mha`` and ``reference.mla`` applied to every request, computed a group of requests at a time on a
padded grid (a few large tensor ops per layer rather than a dozen small ones per request).

It reads only the pure specification (lengths, positions, trees), the pool snapshots taken before the
forward, the token slots, and the layer inputs; never the backend's metadata nor ``forward_batch.positions``,
so a wrong position, slot or split on the backend side shows up as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batch.case import Case
from batch.masks import tree_mask
from batch.spec import BatchSpec
from reference import gdn, kda, lightning, mamba2, mha, mla, short_conv
from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin


@dataclass
class LinearStates:
    """Expected linear-attention states of one layer for each request (float64).

    ``conv[i]`` ``[conv_dim, W-1]`` and ``ssm[i]`` ``[Hv, K, V]`` are the final states; in TARGET_VERIFY
    ``conv_steps[i]`` ``[D, conv_dim, W-1]`` and ``ssm_steps[i]`` ``[D, Hv, K, V]`` hold the state after
    each draft position. A lightning layer has no conv state (``[0, 0]``) and ``ssm[i]`` ``[H, K, V]``.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    conv_steps: list[torch.Tensor] | None = None
    ssm_steps: list[torch.Tensor] | None = None


@dataclass
class ReferenceResult:
    outputs: list[torch.Tensor]  # one per layer, [T, H, Dv] in the reference dtype
    linear_states: dict[int, LinearStates]  # by layer id
    # By layer id, for layers whose outputs are signed sums (lightning, GDN): the root sum of squares of each output
    # element's terms (reference/lightning.py, term_magnitudes; reference/gdn.py, read_magnitudes), which the
    # tolerances measure cancellation by
    magnitudes: dict[int, torch.Tensor] = field(default_factory=dict)
    # By layer id, for softmax-attention layers (MHA, MLA): each output element's probability-weighted magnitude
    # of the values it averages, ``sum_j p_j |v_j|`` (shape of the output), the scale of its element bound
    element_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    # By layer id, for the same layers: each query row's score size, ``sm_scale * |q| * max_j |k_j|`` over the keys
    # it sees (``[T, H]``), which the rounding of its scores scales with (properties/tolerances.py)
    score_sizes: dict[int, torch.Tensor] = field(default_factory=dict)


# A group of requests may be padded to at most this many times the attention scores its requests need, or
# to any size within the budget: on a GPU a padded score costs next to nothing beside a kernel launch, on a
# CPU it costs as much as a real one.
MAX_PADDING = 1.5
PADDING_BUDGET = {"cuda": 1 << 22, "cpu": 1 << 16}  # padded (query, key) pairs per group
# Key rows a group gathers at most (requests x its longest sequence), whatever the padding: a group's keys are
# float64 copies, and 160 decode requests of 32k tokens would hold 24 GiB of MLA latents in one.
MAX_KEY_ROWS = 1 << 19


def request_groups(spec: BatchSpec, device: torch.device) -> list[list[int]]:
    """The batch's requests split into groups that pad well together, longest sequences first.

    A group grows while ``len(group) * max extend_len * max kv_len`` stays within ``MAX_PADDING`` times
    ``sum(extend_len * kv_len)`` or within the device's ``PADDING_BUDGET``, and ``len(group) * max kv_len``
    within ``MAX_KEY_ROWS``. A small batch or a short decode batch is one group.
    """
    budget = PADDING_BUDGET.get(device.type, PADDING_BUDGET["cpu"])
    order = sorted(range(spec.batch_size), key=lambda i: (spec.kv_lens[i], spec.extend_lens[i]), reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1] + [i]
            padded = len(group) * max(spec.extend_lens[r] for r in group) * max(spec.kv_lens[r] for r in group)
            needed = sum(spec.extend_lens[r] * spec.kv_lens[r] for r in group)
            key_rows = len(group) * max(spec.kv_lens[r] for r in group)
            if padded <= max(MAX_PADDING * needed, budget) and key_rows <= MAX_KEY_ROWS:
                groups[-1] = group
                continue
        groups.append([i])
    return groups


@dataclass
class PaddedBatch:
    """A group of the batch's ragged requests laid out on a padded ``(B, Lq)`` / ``(B, Lk)`` grid.

    Built once per case. Grid row ``b`` holds request ``requests[b]``. Its query row ``r`` (``r <
    extend_len``) is row ``starts + r`` of the layer inputs and sits at key index ``prefix_len + r``
    (end-aligned: the new tokens are the last ones). Its key ``j`` (``j < kv_len``) is cached token ``j``,
    read from the pool snapshot, for ``j < prefix_len``, else new token ``j - prefix_len``. Keys are gathered
    from ``cat(cached rows, new rows)``: the group's cached tokens request by request (``cached_slots``),
    then all ``T`` new rows of the batch. Padding points at row 0 and is hidden by ``visible``.
    """

    requests: list[int]
    query_rows: torch.Tensor  # (B, Lq) int64: row of the layer inputs (padding: 0)
    real_queries: torch.Tensor  # (n,) int64: the real query rows' places in the flattened (B * Lq) grid
    query_key_index: torch.Tensor  # (B, Lq) int64: key index of each query row (prefix_len + r)
    key_rows: torch.Tensor  # (B, Lk) int64: row of cat(cached rows, new rows) (padding: 0)
    cached_slots: torch.Tensor  # (group's sum of prefix_lens,) int64: KV slot of every cached token
    visible: torch.Tensor  # (B, Lq, Lk) bool: causal (or the verify tree mask) and padding, no window yet
    query_pos: torch.Tensor  # (B, Lq) int64: position of each query row (verify: prefix_len + tree depth)
    key_pos: torch.Tensor  # (B, Lk) int64: position of each key (a draft key: prefix_len + its depth)

    @classmethod
    def build(cls, case: Case, requests: list[int]) -> "PaddedBatch":
        spec, dev = case.spec, case.device
        as_column = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)[:, None]  # noqa: E731
        prefix = as_column([spec.prefix_lens[i] for i in requests])  # (B, 1)
        extend = as_column([spec.extend_lens[i] for i in requests])
        starts = as_column([sum(spec.extend_lens[:i]) for i in requests])  # first input row of each request
        kv_len = prefix + extend
        cached_starts = torch.cumsum(prefix, 0) - prefix  # first cached row of each request
        # Sizes from the spec, not from the tensors: reading a device tensor's value would stall a GPU.
        r = torch.arange(max(spec.extend_lens[i] for i in requests), device=dev)[None, :]  # (1, Lq)
        j = torch.arange(max(spec.kv_lens[i] for i in requests), device=dev)[None, :]  # (1, Lk)
        num_cached = sum(spec.prefix_lens[i] for i in requests)
        query_valid = r < extend
        key_valid = j < kv_len
        query_key_index = prefix + r
        key_rows = torch.where(j < prefix, cached_starts + j, num_cached + starts + j - prefix)
        query_pos, key_pos = query_key_index, j.expand(len(requests), -1)
        if spec.mode.drafts_tree():
            # Every cached token, plus the draft tree (a draft loop's branches): the token itself and its ancestors.
            trees = torch.stack([tree_mask(spec.spec.parents[i]) for i in requests]).to(dev)  # (B, D, D)
            D = trees.shape[-1]
            draft = (j - prefix).clamp(0, D - 1)[:, None, :].expand(-1, D, -1)  # (B, D, Lk)
            read = j < prefix  # the cached keys each draft token reads
            if spec.spec.draft_window_size > 0:
                # A draft window: the prefix's first sink tokens and its last window tokens (all of a prefix no
                # longer than both together)
                sink, window = spec.spec.draft_sink_size, spec.spec.draft_window_size
                read &= (prefix <= sink + window) | (j < sink) | (j >= prefix - window)
            attend = read[:, None, :] | ((j >= prefix)[:, None, :] & trees.gather(2, draft))
            # A draft token sits at prefix_len + its depth in the tree, whatever its row.
            depth = torch.tensor([spec.spec.depths(i) for i in requests], dtype=torch.int64, device=dev)  # (B, D)
            query_pos = prefix + depth
            key_pos = torch.where(j < prefix, j, prefix + depth.gather(1, (j - prefix).clamp(0, D - 1)))
        else:
            attend = j[:, None, :] <= query_key_index[:, :, None]  # causal
        visible = attend & query_valid[:, :, None] & key_valid[:, None, :]
        cached_slots = torch.cat([case.token_slots[i][:spec.prefix_lens[i]] for i in requests]).to(dev)
        return cls(requests, torch.where(query_valid, starts + r, 0), query_valid.flatten().nonzero()[:, 0],
                   query_key_index, torch.where(key_valid, key_rows, 0), cached_slots, visible, query_pos, key_pos)

    def visible_in_window(self, sliding_window: int | None) -> torch.Tensor:
        """``visible``, further limited to keys at most ``sliding_window`` positions behind the query (by
        positions: in a draft tree a token's row is not its position)."""
        if sliding_window is None:
            return self.visible
        return self.visible & (self.key_pos[:, None, :] >= self.query_pos[:, :, None] - sliding_window)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ...)``: the real query rows of a ``(B, Lq, ...)`` result, request by request."""
        return x.flatten(0, 1)[self.real_queries]

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Lq, ...)`` from the ``(T, ...)`` rows of the whole batch."""
        return x[self.query_rows]

    def keys(self, cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``(B, Lk, ...)`` keys (or values) from the group's ``(sum prefix_lens, ...)`` cached rows and the
        batch's ``(T, ...)`` new rows."""
        return torch.cat([cached, new.to(cached.dtype)])[self.key_rows]


# Attention scores (query row, head, key) one call holds at most: a long prefill's query rows go through in
# chunks (a query row's attention does not depend on the other rows, so the result is the same). 2**26 float64
# scores are 512 MiB; a 32k-token request with 16 heads would otherwise hold 128 GiB.
MAX_SCORES = 1 << 26


def by_query_chunks(attend, queries: tuple[torch.Tensor, ...], visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``attend(*queries, visible)`` over ``(B, Lq, H, ...)`` queries and ``(B, Lq, Lk)`` visibility, a chunk of
    query rows at a time (at most :data:`MAX_SCORES` scores each); each of the tensors it returns joined on the
    query dimension."""
    B, Lq, Lk = visible.shape
    rows = max(1, MAX_SCORES // max(1, B * queries[0].shape[2] * Lk))
    if rows >= Lq:
        return attend(*queries, visible)
    chunks = [attend(*(q[:, a:a + rows] for q in queries), visible[:, a:a + rows]) for a in range(0, Lq, rows)]
    return tuple(torch.cat(parts, dim=1) for parts in zip(*chunks))


def _in_batch_order(groups: list[PaddedBatch], padded: list[torch.Tensor]) -> torch.Tensor:
    """``(T, ...)``: each group's ``(B, Lq, ...)`` result without padding, rows back in batch order."""
    rows = torch.cat([g.unpad(g.query_rows) for g in groups])
    values = torch.cat([g.unpad(x) for g, x in zip(groups, padded)])
    out = torch.empty_like(values)
    out[rows] = values
    return out


class _Rope:
    """cos/sin of every query row, per (rotary_dim, theta), from the specification's positions alone."""

    def __init__(self, case: Case) -> None:
        spec = case.spec
        self.sections = spec.mrope.sections if spec.mrope is not None else None
        rows = spec.mrope_positions() if self.sections is not None else spec.positions()
        self.positions = torch.tensor(rows, dtype=torch.int64, device=case.device)  # (T,) or (3, T)
        self.cache: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def as_model_rotates(self, x: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
        """``x (T, H, rotary_dim)`` (the input in its dtype) rotated as the model rotates it before handing it to a
        backend: angles rounded to float32, the product in float32, the result rounded to x's dtype. (Only an fp8
        cache needs these exact values: they decide the e4m3 rounding of the keys it stores.)"""
        if self.sections is not None:
            cos, sin = mrope_cos_sin(self.positions, rotary_dim, self.sections, theta=theta, dtype=torch.float32)
        else:
            cos, sin = rope_cos_sin(self.positions, rotary_dim, theta=theta, dtype=torch.float32)
        return apply_rope(x.float(), cos, sin).to(x.dtype)

    def __call__(self, x: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
        """Rotate ``x (T, H, rotary_dim)``."""
        if (rotary_dim, theta) not in self.cache:
            if self.sections is not None:
                cs = mrope_cos_sin(self.positions, rotary_dim, self.sections, theta=theta)
            else:
                cs = rope_cos_sin(self.positions, rotary_dim, theta=theta)
            self.cache[rotary_dim, theta] = cs
        cos, sin = self.cache[rotary_dim, theta]
        return apply_rope(x, cos, sin)


def reference_outputs(case: Case, dtype: torch.dtype = torch.float64) -> ReferenceResult:
    """Every layer's expected output (and linear-attention states) for a materialized case.

    Full-attention layers run each group of requests (:func:`request_groups`; usually the whole batch) at
    once on a :class:`PaddedBatch` grid, through :func:`reference.mha.attention_padded` and
    :func:`reference.mla.attention_absorbed_padded` (the single-request formulas with a batch dimension);
    ``tests/reference/test_reference_batch.py`` checks that this equals the single-request definitions
    applied one request at a time. Linear-attention layers are a recurrence and run request by request.

    Returns outputs ``(T, H, Dv)`` per layer, in ``dtype``, the linear layers' states, and the magnitudes the
    tolerances scale by (softmax layers: ``element_scales``; lightning layers: ``magnitudes``).
    """
    spec = case.spec
    outputs: list[torch.Tensor] = []
    linear_states: dict[int, LinearStates] = {}
    magnitudes: dict[int, torch.Tensor] = {}
    element_scales: dict[int, torch.Tensor] = {}
    score_sizes: dict[int, torch.Tensor] = {}
    groups = [PaddedBatch.build(case, g) for g in request_groups(spec, case.device)]
    rope = _Rope(case)
    pool = case.kv_pool_before
    for layer, inp, w in zip(spec.layers, case.inputs, case.weights):
        t = {n: x.to(dtype) for n, x in inp.tensors.items()}
        wt = {n: x.to(dtype) for n, x in w.tensors.items()}
        if layer.kind == "linear":
            out, linear_states[layer.layer_id], magnitudes[layer.layer_id] = _linear_layer(case, layer, t, wt, dtype)
            outputs.append(out)
        elif layer.kind == "lightning":
            out, linear_states[layer.layer_id], magnitudes[layer.layer_id] = _lightning_layer(case, layer, t, dtype)
            outputs.append(out)
        elif layer.kind == "short_conv":
            out, linear_states[layer.layer_id], magnitudes[layer.layer_id] = _short_conv_layer(case, layer, t, wt,
                                                                                                dtype)
            outputs.append(out)
        elif layer.kind == "kda":
            out, linear_states[layer.layer_id], magnitudes[layer.layer_id] = _kda_layer(case, layer, t, wt, dtype)
            outputs.append(out)
        elif layer.kind == "mamba2":
            out, linear_states[layer.layer_id], magnitudes[layer.layer_id] = _mamba2_layer(case, layer, t, wt, dtype)
            outputs.append(out)
        elif not groups:  # an idle batch
            outputs.append(_empty(layer, dtype, case.device))
            element_scales[layer.layer_id] = _empty(layer, dtype, case.device)
            score_sizes[layer.layer_id] = _empty(layer, dtype, case.device)[..., 0]
        elif layer.kind == "mha":
            q = rope(t["q"], layer.head_dim, layer.rope_theta)
            k_new, v_new = rope(t["k"], layer.head_dim, layer.rope_theta), t["v"]
            k_pool, v_pool = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
            k_scale = v_scale = 1.0
            if spec.kv_cache_dtype == "fp8_e4m3":
                k_scale, v_scale = layer.k_scale, layer.v_scale
                # What an fp8 cache holds: the K/V the model hands over (RoPE'd in float32, rounded to the dtype,
                # then moved to the e4m3 grid), exactly; see properties/tolerances.py.
                k_new = fp8_grid(rope.as_model_rotates(inp.tensors["k"], layer.head_dim, layer.rope_theta),
                                 k_scale, dtype)
                v_new = fp8_grid(inp.tensors["v"], v_scale, dtype)
            padded = []
            for g in groups:
                k = g.keys(k_pool[g.cached_slots].to(dtype) * k_scale, k_new)
                v = g.keys(v_pool[g.cached_slots].to(dtype) * v_scale, v_new)
                padded.append(by_query_chunks(
                    lambda rows, visible: mha.attention_padded(rows, k, v, visible, sm_scale=layer.sm_scale,
                                                               logit_cap=layer.logit_cap, magnitudes=True),
                    (g.queries(q),), g.visible_in_window(layer.sliding_window)))
            outputs.append(_in_batch_order(groups, [out for out, _, _ in padded]))
            element_scales[layer.layer_id] = _in_batch_order(groups, [scale for _, scale, _ in padded])
            score_sizes[layer.layer_id] = _in_batch_order(groups, [size for _, _, size in padded])
        else:  # mla
            N, R, C = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank
            q_nope = t["q"][..., :N]
            q_pe = rope(t["q"][..., N:], R, layer.rope_theta)
            kpe_new = rope(t["kpe"][:, None, :], R, layer.rope_theta)[:, 0]
            latent_pool = pool.k_buffers[layer.layer_id]
            padded = []
            for g in groups:
                cached = latent_pool[g.cached_slots, 0].to(dtype)  # (cached tokens, C + R): ckv then kpe
                ckv, kpe = g.keys(cached[:, :C], t["ckv"]), g.keys(cached[:, C:], kpe_new)
                padded.append(by_query_chunks(
                    lambda nope, pe, visible: mla.attention_absorbed_padded(
                        nope, pe, ckv, kpe, wt["w_kc"], wt["w_vc"], visible, sm_scale=layer.sm_scale,
                        magnitudes=True),
                    (g.queries(q_nope), g.queries(q_pe)), g.visible))
            outputs.append(_in_batch_order(groups, [out for out, _, _ in padded]))
            element_scales[layer.layer_id] = _in_batch_order(groups, [scale for _, scale, _ in padded])
            score_sizes[layer.layer_id] = _in_batch_order(groups, [size for _, _, size in padded])
    return ReferenceResult(outputs, linear_states, magnitudes, element_scales, score_sizes)


def fp8_grid(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` moved to the fp8 e4m3 grid scaled by ``scale`` (round to nearest even), in ``dtype``: the value an fp8
    KV cache stores for ``x``, read back exactly (``e4m3 * scale`` with a power-of-two scale)."""
    return (x / scale).to(torch.float8_e4m3fn).to(dtype) * scale


@dataclass
class _RequestStep:
    """One request through a recurrent layer: its outputs ``[n, H, Dv]`` and their rounding scales, its final
    states, and (verify) its states after each token."""

    o: torch.Tensor
    magnitudes: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor
    conv_steps: torch.Tensor | None = None
    ssm_steps: torch.Tensor | None = None


def _by_request(case: Case, layer, dtype: torch.dtype, step) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """A recurrent layer, request by request (a recurrence over each request's tokens):
    ``step(rows, slot, carried, keep_states)`` runs one request's token ``rows`` from the states at its state
    ``slot`` when ``carried`` (a cached prefix; a fresh request starts from zeros), keeping its per-token states in
    TARGET_VERIFY. Returns the outputs in batch order, the states, and the outputs' rounding scales."""
    spec = case.spec
    verify = spec.mode.is_target_verify()
    states = LinearStates([], [], [] if verify else None, [] if verify else None)
    outputs, magnitudes, start = [], [], 0
    for i, slot in enumerate(case.forward_batch.state_slots.tolist()):
        rows = slice(start, start + spec.extend_lens[i])
        start = rows.stop
        res = step(rows, slot, spec.prefix_lens[i] > 0, verify)
        outputs.append(res.o)
        magnitudes.append(res.magnitudes)
        states.conv.append(res.conv)
        states.ssm.append(res.ssm)
        if verify:
            states.conv_steps.append(res.conv_steps)
            states.ssm_steps.append(res.ssm_steps)
    if not outputs:
        return _empty(layer, dtype, case.device), states, _empty(layer, dtype, case.device)
    return torch.cat(outputs), states, torch.cat(magnitudes)


def _carried(case: Case, layer, dtype: torch.dtype):
    """The pool states a request with a cached prefix starts from: ``(conv, ssm)`` at its slot (None without)."""
    mp = case.mamba_pool_before

    def at(slot: int, carried: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not carried:
            return None, None
        return (mp.conv_states[layer.layer_id][slot].to(dtype), mp.ssm_states[layer.layer_id][slot].to(dtype))
    return at


def _delta_rule_layer(case: Case, layer, t: dict[str, torch.Tensor], wt: dict[str, torch.Tensor],
                      dtype: torch.dtype, layer_fn, **shape) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One delta-rule layer (GDN's ``gdn.linear_attention_layer``, KDA's ``kda.kda_layer``: ``layer_fn``, with the
    layer's ``shape`` arguments), request by request, with its outputs' state-read magnitudes."""
    states_at = _carried(case, layer, dtype)

    def step(rows, slot, carried, keep_states):
        conv, ssm = states_at(slot, carried)
        res = layer_fn(t["mixed_qkv"][rows], t["a"][rows], t["b"][rows], conv_weight=wt["conv_weight"],
                       A_log=wt["A_log"], dt_bias=wt["dt_bias"], conv_state=conv, ssm_state=ssm,
                       keep_states=keep_states, **shape)
        return _RequestStep(res.o, res.read_magnitudes, res.conv_state, res.ssm_state, res.conv_states,
                            res.ssm_states)
    return _by_request(case, layer, dtype, step)


def _linear_layer(case: Case, layer, t: dict[str, torch.Tensor], wt: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One gated-delta-rule layer."""
    return _delta_rule_layer(case, layer, t, wt, dtype, gdn.linear_attention_layer, num_k_heads=layer.num_k_heads,
                             num_v_heads=layer.num_v_heads, head_k_dim=layer.head_k_dim,
                             head_v_dim=layer.head_v_dim, scale=layer.scale)


def _kda_layer(case: Case, layer, t: dict[str, torch.Tensor], wt: dict[str, torch.Tensor],
               dtype: torch.dtype) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One KDA layer."""
    return _delta_rule_layer(case, layer, t, wt, dtype, kda.kda_layer, num_heads=layer.num_heads,
                             head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim,
                             lower_bound=layer.lower_bound)


def _lightning_layer(case: Case, layer, t: dict[str, torch.Tensor], dtype: torch.dtype
                     ) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One lightning-attention layer, with its outputs' term magnitudes; no conv state (``[0, 0]``)."""
    decay = lightning.decay_rates(layer.num_heads, layer.layer_id, case.spec.num_model_layers).to(case.device)
    states_at = _carried(case, layer, dtype)
    no_conv = t["v"].new_zeros(0, 0)

    def step(rows, slot, carried, keep_states):
        _, state = states_at(slot, carried)
        q, k, v = t["q"][rows], t["k"][rows], t["v"][rows]
        res = lightning.lightning_attention(q, k, v, decay, scale=layer.scale, initial_state=state,
                                            keep_states=keep_states)
        magnitudes = lightning.term_magnitudes(q, k, v, decay, scale=layer.scale, initial_state=state)
        conv_steps = t["v"].new_zeros(rows.stop - rows.start, 0, 0) if keep_states else None
        return _RequestStep(res.o, magnitudes, no_conv, res.state, conv_steps, res.states)
    return _by_request(case, layer, dtype, step)


def _short_conv_layer(case: Case, layer, t: dict[str, torch.Tensor], wt: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One short-convolution layer: outputs ``[T, 1, hidden]`` with their terms' magnitudes. No SSM state:
    ``ssm[i]`` is ``[1, hidden, 0]``, as the pools keep it."""
    states_at = _carried(case, layer, dtype)
    no_ssm = t["bcx"].new_zeros(1, layer.hidden, 0)

    def step(rows, slot, carried, keep_states):
        conv, _ = states_at(slot, carried)
        res = short_conv.short_conv(t["bcx"][rows], wt["conv_weight"], wt.get("conv_bias"), conv,
                                    keep_states=keep_states)
        ssm_steps = t["bcx"].new_zeros(rows.stop - rows.start, 1, layer.hidden, 0) if keep_states else None
        return _RequestStep(res.o[:, None, :], res.magnitudes[:, None, :], res.state, no_ssm, res.states, ssm_steps)
    return _by_request(case, layer, dtype, step)


def _mamba2_layer(case: Case, layer, t: dict[str, torch.Tensor], wt: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> tuple[torch.Tensor, LinearStates, torch.Tensor]:
    """One Mamba-2 layer: outputs ``[T, H, P]`` with their rounding scales."""
    states_at = _carried(case, layer, dtype)
    H, P = layer.num_heads, layer.head_dim

    def step(rows, slot, carried, keep_states):
        conv, ssm = states_at(slot, carried)
        res = mamba2.mamba2_mixer(
            t["zxbcdt"][rows], conv_weight=wt["conv_weight"], conv_bias=wt.get("conv_bias"), dt_bias=wt["dt_bias"],
            A=wt["A"], D=wt["D"], norm_weight=wt["norm_weight"], num_heads=H, head_dim=P, n_groups=layer.n_groups,
            state_size=layer.state_size, conv_state=conv, ssm_state=ssm, keep_states=keep_states)
        return _RequestStep(res.o.reshape(-1, H, P), res.magnitudes.reshape(-1, H, P), res.conv_state,
                            res.ssm_state, res.conv_states, res.ssm_states)
    return _by_request(case, layer, dtype, step)


def _empty(layer, dtype, device) -> torch.Tensor:
    if layer.kind == "mha":
        return torch.zeros(0, layer.num_q_heads, layer.v_head_dim, dtype=dtype, device=device)
    if layer.kind == "mla":
        return torch.zeros(0, layer.num_heads, layer.v_head_dim, dtype=dtype, device=device)
    if layer.kind == "lightning":
        return torch.zeros(0, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
    if layer.kind == "short_conv":
        return torch.zeros(0, 1, layer.hidden, dtype=dtype, device=device)
    if layer.kind == "mamba2":
        return torch.zeros(0, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
    if layer.kind == "kda":
        return torch.zeros(0, layer.num_heads, layer.head_v_dim, dtype=dtype, device=device)
    return torch.zeros(0, layer.num_v_heads, layer.head_v_dim, dtype=dtype, device=device)
