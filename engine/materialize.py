"""Specification + device -> tensors. The one place where the harness makes tensors.

Every random value comes from a counter-based generator keyed by ``spec.seed`` and the draw's place in a
fixed order (``_Draw``); large tensors are drawn where they live, and a specification and seed give the same
tensors bit for bit on a CPU and on any GPU.
Memory that a correct backend must not read (spare pages, spare ``req_to_token`` rows, slots past a
request's length, states of requests without a prefix) is filled with random garbage rather than zeros,
so reading it changes the output instead of hiding behind a zero.
"""

from __future__ import annotations

import copy
import math

import torch

from batch.case import TORCH_DTYPES, Case
from batch.forward_batch import (FP8_KV_DTYPE, ForwardBatch, KVPool, LayerInputs, LayerWeights, MambaPool, SpecInfo,
                                 quantize_kv)
from batch.masks import tree_depths, verify_custom_mask
from batch.spec import (KDA_NEG_A, KDA_SHARP_NEG_A, MAMBA2_DT_BIAS, MAMBA2_DT_RAW, MAMBA2_NEG_A, MAX_GRAPH_PADDING, BatchSpec)
from engine import sharing

# Rows of req_to_token / state slots that belong to no request of the batch; a graph replay's padded rows fit
# beside the batch's requests (the request pool is what graph buffers are sized by).
SPARE_REQ_ROWS = MAX_GRAPH_PADDING


_CPU = torch.device("cpu")
_U64 = (1 << 64) - 1
_NORMAL_TABLES: dict[torch.device, torch.Tensor] = {}


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _signed32(c: int) -> int:
    """A 32-bit pattern as the int32 value with the same bits (torch's int32 scalars are signed)."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 words (``>>`` on a signed tensor copies the sign bit)."""
    return torch.bitwise_right_shift(x, s).bitwise_and_((1 << (32 - s)) - 1)


def _normal_table(device: torch.device) -> torch.Tensor:
    """``[65536]`` float32 quantiles of the standard normal at ``(j + 0.5) / 65536``, computed in float64 on the CPU."""
    if device not in _NORMAL_TABLES:
        p = (torch.arange(1 << 16, dtype=torch.float64) + 0.5) / (1 << 16)
        _NORMAL_TABLES[device] = (math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)).to(torch.float32).to(device)
    return _NORMAL_TABLES[device]


class _Draw:
    """Counter-based random draws, the same bit for bit on every device.

    Element ``i`` of the ``n``-th draw of a seed is a 32-bit hash of ``(seed, n, i)``, computed with int32
    tensor ops (wrapping multiplies, xors, shifts: exact on every device). A normal value is the hash's top 16
    bits looked up in a table of the standard normal's quantiles at ``(j + 0.5) / 2**16``, built once in
    float64 on the CPU; so a draw can be made where its tensor lives (a KV pool of millions of values costs a
    few kernel launches on a GPU instead of a CPU ``randn`` and a copy), and still give the same tensors on a
    CPU and on any GPU. Values are quantized to 65536 levels (|x| <= 4.32): far finer than bf16 near 1.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    def _keys(self) -> tuple[int, int]:
        self.calls += 1
        z = _splitmix64((self.seed * 0x9E3779B97F4A7C15 + self.calls) & _U64)
        return _signed32(z & 0xFFFFFFFF), _signed32(z >> 32)

    def bits(self, n: int, device: torch.device) -> torch.Tensor:
        """``[n]`` int32 hashed words of the next draw (all 32 bits random; read them with logical shifts)."""
        k1, k2 = self._keys()
        x = torch.arange(n, dtype=torch.int32, device=device)
        x.add_(k1).mul_(_signed32(0x9E3779B1))
        x.bitwise_xor_(_srl(x, 16))
        # The second key enters after a nonlinear step, so one draw's stream is not a shifted copy of another's.
        x.mul_(_signed32(0x7FEB352D)).bitwise_xor_(k2)
        x.bitwise_xor_(_srl(x, 15))
        x.mul_(_signed32(0x846CA68B))
        x.bitwise_xor_(_srl(x, 16))
        return x

    def normal(self, *shape: int, scale: float = 1.0, device: torch.device = _CPU) -> torch.Tensor:
        x = _normal_table(device)[_srl(self.bits(math.prod(shape), device), 16)].reshape(shape)
        return x if scale == 1.0 else x * scale

    def uniform(self, *shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        """On the CPU: ``(k + 0.5) / 2**23`` for a 23-bit ``k`` is exact in float32."""
        u = (_srl(self.bits(math.prod(shape), _CPU), 9).to(torch.float32) + 0.5) * 2.0**-23
        return lo + (hi - lo) * u.reshape(shape)

    def perm(self, n: int) -> torch.Tensor:
        """A random permutation of ``range(n)`` (int64, CPU): a stable sort of hashed words."""
        return torch.sort(self.bits(n, _CPU).to(torch.int64) & 0xFFFFFFFF, stable=True).indices

    def ints(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        """Integers in ``[lo, hi)`` (int64, CPU)."""
        words = self.bits(math.prod(shape), _CPU).to(torch.int64) & 0xFFFFFFFF
        return (lo + words % (hi - lo)).reshape(shape)


# Where a batch checked by several rows (engine.sharing) is built once and copied: on an H100 a copy took a third of a
# build (decode batches of the gpu profile: 2.6 ms against 7.9 ms; harness-out/matcopy.py, 2026-11-27); on a CPU the two
# were close, one way or the other by the batch, and a CPU batch is built again. Each call gets tensors of its own (a
# run writes into its pools).
COPIED_ON = ("cuda",)
_BATCHES = sharing.LastMade()


def materialize(spec: BatchSpec, device: str | torch.device = "cpu") -> Case:
    device = torch.device(device)
    if not sharing.active() or device.type not in COPIED_ON:
        return _build(spec, device)
    return copy.deepcopy(_BATCHES.get((spec, device), lambda: _build(spec, device)))


def _build(spec: BatchSpec, device: torch.device) -> Case:
    dtype = TORCH_DTYPES[spec.dtype]
    draw = _Draw(spec.seed)
    B, ps = spec.batch_size, spec.page_size
    kv_lens = spec.cache_lens  # what each request's cache row holds (its keys; a draft loop's slots too)

    # Pages, in the spec's layout (batch.spec.KV_LAYOUTS); page 0 reserved so slot 0 is never a real token.
    # The shuffle is drawn whatever the layout, so the draws after it (pools, inputs) do not depend on it.
    pages_needed = [math.ceil(n / ps) for n in kv_lens]
    num_pages = 1 + sum(pages_needed) + 2 + sum(pages_needed) // 4
    num_slots = num_pages * ps
    page_order = page_layout(spec, pages_needed, draw.perm(num_pages - 1) + 1)
    # req_to_token row 0 is reserved for padded rows (CUDA-graph padding), like slot 0 of the pools.
    max_reqs = 1 + B + SPARE_REQ_ROWS
    req_to_token = draw.ints(1, num_slots, max_reqs, spec.context_len).to(torch.int32)  # garbage by default
    # ... but row 0 is SGLang's padding row, zeros (its pool is allocated with torch.zeros, and row 0 is never a
    # request's from 0.5.12 on): a padded row reads and writes slot 0, the pools' padding slot, which the graph
    # properties poison. Garbage there had padded rows read real tokens' keys, finite, so a padded row leaking into
    # a real one could pass unseen.
    req_to_token[0] = 0
    req_pool_indices = (draw.perm(max_reqs - 1) + 1)[:B].to(torch.int64)
    # Token j of request i sits at offset j % ps of the request's (j // ps)-th page, its pages taken in turn
    # from page_order: all requests' tokens at once, flattened request by request.
    kv = torch.tensor(kv_lens, dtype=torch.int64)
    request_of_token = torch.repeat_interleave(torch.arange(B), kv)
    index_in_request = torch.arange(int(kv.sum())) - torch.repeat_interleave(torch.cumsum(kv, 0) - kv, kv)
    pages = torch.tensor(pages_needed, dtype=torch.int64)
    first_page = torch.cumsum(pages, 0) - pages
    page = page_order[first_page[request_of_token] + index_in_request // ps]
    slots = page * ps + index_in_request % ps  # [sum(kv_lens)] int64
    req_to_token[req_pool_indices[request_of_token], index_in_request] = slots.to(torch.int32)
    token_slots = slots.split(list(kv_lens))
    out_cache_loc = torch.cat([token_slots[i][spec.new_token_columns(i)] for i in range(B)]) if B else slots[:0]

    # Linear-attention state slot of each req_to_token row (SGLang's mamba index), laid out as the spec says
    # (state_slots_of); row 0 (the padding row) maps to state slot 0, which is reserved.
    req_to_state_slot, num_state_slots = state_slots_of(spec.state_slot_layout, draw.perm(max_reqs - 1) + 1,
                                                        req_pool_indices)
    state_slots = req_to_state_slot[req_pool_indices]

    # Pools and per-layer tensors, layer by layer in spec order.
    k_buffers: dict[int, torch.Tensor] = {}
    v_buffers: dict[int, torch.Tensor | None] = {}
    conv_states: dict[int, torch.Tensor] = {}
    ssm_states: dict[int, torch.Tensor] = {}
    inter_conv: dict[int, torch.Tensor] = {}
    inter_ssm: dict[int, torch.Tensor] = {}
    inputs: list[LayerInputs] = []
    weights: list[LayerWeights] = []
    T = spec.num_tokens
    D = spec.spec.draft_token_num if spec.spec is not None else 0
    def recurrent_states(layer_id: int, conv: tuple[int, ...], ssm: tuple[int, ...]) -> None:
        """A recurrent layer's conv and SSM states per slot (and per draft step in TARGET_VERIFY)."""
        conv_states[layer_id] = draw.normal(num_state_slots, *conv, device=device)
        ssm_states[layer_id] = draw.normal(num_state_slots, *ssm, scale=0.5, device=device)
        if spec.mode.is_target_verify():
            inter_conv[layer_id] = draw.normal(num_state_slots, D, *conv, device=device)
            inter_ssm[layer_id] = draw.normal(num_state_slots, D, *ssm, device=device)

    for layer in spec.layers:
        if layer.kind == "mha":
            if layer.layer_id not in k_buffers:
                k_buffers[layer.layer_id] = draw.normal(num_slots, layer.num_kv_heads, layer.head_dim, device=device)
                v_buffers[layer.layer_id] = draw.normal(num_slots, layer.num_kv_heads, layer.v_head_dim, device=device)
            inputs.append(LayerInputs({
                "q": draw.normal(T, layer.num_q_heads, layer.head_dim, device=device),
                "k": draw.normal(T, layer.num_kv_heads, layer.head_dim, device=device),
                "v": draw.normal(T, layer.num_kv_heads, layer.v_head_dim, device=device),
            }))
            weights.append(LayerWeights({}))
        elif layer.kind == "mla":
            C, R = layer.kv_lora_rank, layer.qk_rope_head_dim
            if layer.layer_id not in k_buffers:
                k_buffers[layer.layer_id] = draw.normal(num_slots, 1, C + R, device=device)
                v_buffers[layer.layer_id] = None
            inputs.append(LayerInputs({
                "q": draw.normal(T, layer.num_heads, layer.qk_nope_head_dim + R, device=device),
                "ckv": draw.normal(T, C, device=device),
                "kpe": draw.normal(T, R, device=device),
            }))
            # Up-projections scaled so expanded keys and values have unit-order entries.
            weights.append(LayerWeights({
                "w_kc": draw.normal(layer.num_heads, layer.qk_nope_head_dim, C, scale=C**-0.5, device=device),
                "w_vc": draw.normal(layer.num_heads, C, layer.v_head_dim, scale=C**-0.5, device=device),
            }))
        elif layer.kind == "lightning":
            H, Dh = layer.num_heads, layer.head_dim
            # No conv state (SGLang's pool for Bailing keeps an empty one, conv_kernel 1, "to keep the interface")
            recurrent_states(layer.layer_id, (0, 0), (H, Dh, Dh))
            inputs.append(LayerInputs({n: draw.normal(T, H, Dh, device=device) for n in ("q", "k", "v")}))
            weights.append(LayerWeights({}))  # the decay rates are the model's (reference/lightning.py)
        elif layer.kind == "kda":
            H, K, V, W, Cd = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_kernel, layer.conv_dim
            recurrent_states(layer.layer_id, (Cd, W - 1), (H, K, V))
            inputs.append(LayerInputs({"mixed_qkv": draw.normal(T, Cd, device=device),
                                       "a": draw.normal(T, H * K, device=device),
                                       "b": draw.normal(T, H, device=device)}))
            # As Kimi Linear keeps them: the conv weights, A_log and dt_bias in float32 (models/kimi_linear.py)
            neg_a = KDA_SHARP_NEG_A if layer.sharp_decay else KDA_NEG_A
            weights.append(LayerWeights({
                "conv_weight": draw.normal(Cd, W, scale=W**-0.5, device=device),
                "A_log": torch.log(draw.uniform(H, lo=neg_a[0], hi=neg_a[1])),
                "dt_bias": draw.normal(H * K, scale=0.5, device=device),
            }))
        elif layer.kind == "mamba2":
            H, P, N, W, Cd = layer.num_heads, layer.head_dim, layer.state_size, layer.conv_kernel, layer.conv_dim
            recurrent_states(layer.layer_id, (Cd, W - 1), (H, P, N))
            # z, xBC, dt as the input projection emits them; dt in a fixed range (batch/spec.py, MAMBA2_DT_RAW)
            lo, hi = MAMBA2_DT_RAW
            inputs.append(LayerInputs({"zxbcdt": torch.cat([
                draw.normal(T, layer.intermediate + Cd), lo + (hi - lo) * draw.uniform(T, H)], dim=1)}))
            # Parameters as a checkpoint loads them: A in float32 (SGLang keeps it so), the others in the model's
            # dtype, drawn on its grid so every path reads the same values
            grid = lambda t: t.to(dtype).float()  # noqa: E731
            mixer = {"conv_weight": grid(draw.normal(Cd, W, scale=W**-0.5)),
                     "dt_bias": grid(draw.uniform(H, lo=MAMBA2_DT_BIAS[0], hi=MAMBA2_DT_BIAS[1])),
                     "A": -draw.uniform(H, lo=MAMBA2_NEG_A[0], hi=MAMBA2_NEG_A[1]),
                     "D": grid(draw.normal(H)),
                     "norm_weight": grid(1.0 + draw.normal(layer.intermediate, scale=0.1))}
            if layer.conv_bias:
                mixer["conv_bias"] = grid(draw.normal(Cd, scale=0.5))
            weights.append(LayerWeights(mixer))
        elif layer.kind == "short_conv":
            Dh, W = layer.hidden, layer.conv_kernel
            # No SSM state: SGLang's pool for LFM2 keeps an empty one ([1, hidden, 0]: state_size 0, configs/lfm2.py)
            recurrent_states(layer.layer_id, (Dh, W - 1), (1, Dh, 0))
            # B, C and x as LFM2's in_proj emits them (one [T, 3 * hidden] output, chunked in that order)
            inputs.append(LayerInputs({"bcx": draw.normal(T, 3 * Dh, device=device)}))
            # A model's conv parameters are in its dtype (SGLang's CUDA causal_conv1d takes them in x's dtype only):
            # drawn on that grid, so the float32 copies every path reads hold the very values the model has.
            conv = {"conv_weight": draw.normal(Dh, W, scale=W**-0.5, device=device).to(dtype).float()}
            if layer.conv_bias:
                conv["conv_bias"] = draw.normal(Dh, scale=0.5, device=device).to(dtype).float()
            weights.append(LayerWeights(conv))
        else:
            W, Hv, K, V = layer.conv_kernel, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
            recurrent_states(layer.layer_id, (layer.conv_dim, W - 1), (Hv, K, V))
            inputs.append(LayerInputs({
                "mixed_qkv": draw.normal(T, layer.conv_dim, device=device),
                "a": draw.normal(T, Hv, device=device),
                "b": draw.normal(T, Hv, device=device),
            }))
            # Decays near one (exp(g) ~ 0.6..0.99) so state carried across a prefix matters.
            weights.append(LayerWeights({
                "conv_weight": draw.normal(layer.conv_dim, W, scale=W**-0.5, device=device),
                "A_log": torch.log(draw.uniform(Hv, lo=0.02, hi=0.5)),  # log on the CPU, whatever the device
                "dt_bias": draw.normal(Hv, scale=0.5, device=device),
            }))

    # A paged draft tree: each branch's tail slots repeat the prefix's last partial page, as SGLang's
    # prepare_for_draft duplicates it before the draft loop (batch.spec.draft_region)
    for i in range(B):
        for src, dst in spec.draft_tail_columns(i):
            for buf in (*k_buffers.values(), *v_buffers.values()):
                if buf is not None:
                    buf[token_slots[i][dst].to(buf.device)] = buf[token_slots[i][src].to(buf.device)]

    def dev(t: torch.Tensor, dt: torch.dtype | None = None) -> torch.Tensor:
        return t.to(dtype=dt or t.dtype).to(device)

    if spec.kv_cache_dtype == "fp8_e4m3":
        # The cache holds each layer's values divided by its scale, rounded to e4m3 (dequantized: ~N(0, 1) again).
        scales = {l.layer_id: (l.k_scale, l.v_scale) for l in spec.layers if l.kind == "mha"}
        kv_pool = KVPool(ps, {i: quantize_kv(dev(b), FP8_KV_DTYPE, scales[i][0]) for i, b in k_buffers.items()},
                         {i: quantize_kv(dev(b), FP8_KV_DTYPE, scales[i][1]) for i, b in v_buffers.items()},
                         model_dtype=dtype)
    else:
        kv_pool = KVPool(ps, {i: dev(b, dtype) for i, b in k_buffers.items()},
                         {i: (None if b is None else dev(b, dtype)) for i, b in v_buffers.items()})
    mamba_pool = None
    if conv_states:
        mamba_pool = MambaPool({i: dev(t, dtype) for i, t in conv_states.items()},
                               {i: dev(t, torch.float32) for i, t in ssm_states.items()},
                               {i: dev(t, dtype) for i, t in inter_conv.items()},
                               {i: dev(t, torch.float32) for i, t in inter_ssm.items()})
    layer_inputs = [LayerInputs({n: dev(t, dtype) for n, t in li.tensors.items()}) for li in inputs]
    # Weights stay float32: they are model parameters, and both paths read the same values.
    layer_weights = [LayerWeights({n: dev(t) for n, t in lw.tensors.items()}) for lw in weights]

    positions = query_positions(spec)
    mrope_positions = None
    if spec.mrope is not None:
        mrope_positions = torch.tensor(spec.mrope_positions(), dtype=torch.int64).reshape(3, T)

    spec_info = _spec_info(spec, positions, device)
    fb = ForwardBatch(
        forward_mode=spec.mode,
        batch_size=B,
        req_pool_indices=dev(req_pool_indices),
        seq_lens=dev(torch.tensor(spec.seq_lens, dtype=torch.int64)),
        seq_lens_cpu=torch.tensor(spec.seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(spec.seq_lens),
        extend_seq_lens=dev(torch.tensor(spec.extend_lens, dtype=torch.int32)),
        extend_prefix_lens=dev(torch.tensor(spec.prefix_lens, dtype=torch.int32)),
        extend_start_loc=dev(torch.tensor(_exclusive_cumsum(spec.extend_lens), dtype=torch.int32)),
        extend_seq_lens_cpu=list(spec.extend_lens),
        extend_prefix_lens_cpu=list(spec.prefix_lens),
        extend_num_tokens=T,
        positions=dev(positions),
        mrope_positions=None if mrope_positions is None else dev(mrope_positions),
        out_cache_loc=dev(out_cache_loc),
        req_to_token=dev(req_to_token),
        req_to_state_slot=dev(req_to_state_slot),
        state_slots=dev(state_slots),
        token_to_kv_pool=kv_pool,
        mamba_pool=mamba_pool,
        spec_info=spec_info,
        device=device,
        num_token_non_padded=T,
    )
    return Case(spec, fb, layer_inputs, layer_weights, kv_pool.clone(),
                None if mamba_pool is None else mamba_pool.clone(), token_slots)


def page_layout(spec: BatchSpec, pages_needed: list[int], shuffled: torch.Tensor) -> torch.Tensor:
    """The physical page of each request's pages, request by request (``[sum(pages_needed)]`` int64, then the
    spare pages), from a random permutation ``shuffled`` of pages ``1..num_pages-1``.

    ``shuffled_pages`` takes them as drawn; ``contiguous`` in ascending order; ``interleaved_pages`` deals them
    out one page per request in turn (page k of request i lands next to page k of request i+1);
    ``non_monotonic_extend`` lays each request out ascending but reverses the pages that hold only new
    tokens (those starting at or after its prefix), so its ``out_cache_loc`` descends across them.
    """
    layout = spec.kv_layout
    if layout == "shuffled_pages":
        return shuffled
    ordered = torch.sort(shuffled).values  # pages 1..num_pages-1
    total = sum(pages_needed)
    if layout == "contiguous":
        return ordered
    if layout == "interleaved_pages":
        # Round-robin over the requests that still need a page: request i's k-th page is the next free one.
        ranks = [(k, i) for i, n in enumerate(pages_needed) for k in range(n)]
        by_turn = sorted(range(total), key=lambda r: ranks[r])  # rank r (request-major) -> its turn
        out = ordered.clone()
        out[torch.tensor(by_turn, dtype=torch.int64)] = ordered[:total]
        return out
    # non_monotonic_extend
    out, start = ordered.clone(), 0
    for n, p in zip(pages_needed, spec.prefix_lens):
        first_new = min(-(-p // spec.page_size), n)  # the first page that holds no cached token
        out[start + first_new:start + n] = ordered[start + first_new:start + n].flip(0)
        start += n
    return out


def state_slots_of(layout: str, shuffled: torch.Tensor, req_pool_indices: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``req_to_state_slot[max_reqs]`` and the state pool's size, for a layout of ``batch.spec.STATE_SLOT_LAYOUTS``.

    ``shuffled`` is a random permutation of ``1..max_reqs-1`` (the "shuffled" layout itself). "compact" gives the
    batch's requests slots 1..B in batch order, "reversed" B..1 (the other rows follow); "gapped" doubles the
    shuffled slots, so every other slot of a pool twice as large belongs to no request row (its state must stay
    untouched like any other). Every layout is a bijection from request rows to slots.
    """
    rows = shuffled.numel() + 1
    table = torch.cat([torch.zeros(1, dtype=torch.int64), shuffled])
    if layout == "gapped":
        return table * 2, 2 * rows - 1
    if layout in ("compact", "reversed"):
        others = [r for r in range(1, rows) if r not in set(req_pool_indices.tolist())]
        order = req_pool_indices.tolist() if layout == "compact" else req_pool_indices.tolist()[::-1]
        table = torch.zeros(rows, dtype=torch.int64)
        table[torch.tensor(order + others, dtype=torch.int64)] = torch.arange(1, rows, dtype=torch.int64)
    return table, rows


def query_positions(spec: BatchSpec) -> torch.Tensor:
    """``[T]`` positions as a scheduler builds them with tensor ops: prefix + offset, or in verification
    seq_len + tree depth (a draft loop's: + step). (The reference derives them separately, from
    ``BatchSpec.positions``.)"""
    prefix = torch.tensor(spec.prefix_lens, dtype=torch.int64)
    extend = torch.tensor(spec.extend_lens, dtype=torch.int64)
    if spec.mode.drafts_tree():
        parents = torch.tensor(spec.spec.parents, dtype=torch.int64)
        return (prefix[:, None] + tree_depths(parents)).reshape(-1)
    starts = torch.cumsum(extend, 0) - extend
    offsets = torch.arange(int(extend.sum())) - torch.repeat_interleave(starts, extend)
    return torch.repeat_interleave(prefix, extend) + offsets


def _exclusive_cumsum(xs: tuple[int, ...]) -> list[int]:
    out, total = [], 0
    for x in xs:
        out.append(total)
        total += x
    return out


def _spec_info(spec: BatchSpec, positions: torch.Tensor, device: torch.device) -> SpecInfo | None:
    if spec.spec is None:
        return None
    s = spec.spec
    verify = spec.mode.is_target_verify()
    return SpecInfo(
        draft_token_num=s.draft_token_num,
        topk=s.topk,
        spec_steps=s.spec_steps,
        custom_mask=verify_custom_mask(spec).to(device) if verify else None,
        positions=positions.to(device) if verify else None,
        parents=torch.tensor(s.parents, dtype=torch.int64).to(device),
        accept_length=torch.tensor(s.accept_lens, dtype=torch.int32).to(device),
        accept_length_cpu=list(s.accept_lens),
        algorithm=s.algorithm,
    )
