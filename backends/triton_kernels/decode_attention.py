"""Paged decode attention in Triton, split over the keys ("flash decoding").

One query token per request over the request's keys in the KV pool (its own new key included, last), at
token granularity: request ``i``'s keys are at slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.

Stage 1: one program per (request, block of up to ``BLOCK_H`` query heads sharing one kv head, split) walks
its share of the request's keys once for all those heads (GQA: K/V are read once per group, and the scores
are one ``tl.dot``), and writes each head's partial output, normalised, with its log-sum-exp (log2 domain).
Stage 2: one program per (request, query head) merges the splits by their log-sum-exps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.triton_kernels.checks import check_index, require
from backends.triton_kernels.numerics import is_interpreted, round_like_gpu, soft_cap

# Query heads per stage-1 program: tl.dot needs at least 16 rows on NVIDIA GPUs; unused rows are masked.
_BLOCK_H = 16


@triton.jit
def _decode_split_kernel(
    Q, K_BUF, V_BUF, KV_INDPTR, KV_INDICES, PART_O, PART_LSE,
    sm_scale, logit_cap, window_left, k_descale, v_descale,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr, KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_group: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = head_block // blocks_per_group
    in_group = (head_block % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = in_group < GROUP
    heads = kv_head * GROUP + in_group

    kv_start = tl.load(KV_INDPTR + req).to(tl.int64)
    kv_len = (tl.load(KV_INDPTR + req + 1) - kv_start).to(tl.int32)
    lo = 0
    if USE_WINDOW:
        # The query sits at position kv_len - 1; earlier keys are out of the window and never read.
        lo = tl.maximum(kv_len - 1 - window_left, 0)
    # Splits cover [lo, kv_len) in whole blocks, so only a split's last block is partial.
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, kv_len)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)  # see numerics.py: the interpreter's 16-bit dots are wrong

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        slots = tl.load(KV_INDICES + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        k = tl.load(K_BUF + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        if KV_FP8:  # e4m3 rows times the scale, in q's dtype (exact for power-of-two scales)
            k = (k.to(tl.float32) * k_descale).to(Q.dtype.element_ty)
        if INTERPRETED:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if USE_CAP:
            s = soft_cap(qk * sm_scale, logit_cap) * 1.4426950408889634
        else:
            s = qk * (sm_scale * 1.4426950408889634)
        s = tl.where(col_ok[None, :], s, float("-inf"))
        # Every block holds at least one real key, so m_new is finite and no NaN can arise.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_BUF + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
        if KV_FP8:
            v = (v.to(tl.float32) * v_descale).to(Q.dtype.element_ty)
        # P is rounded to V's dtype (the queries') for the tensor-core dot; the sum l stays float32.
        if INTERPRETED:
            v = v.to(tl.float32)
            if Q.dtype.element_ty != tl.float32:
                p = round_like_gpu(p, Q.dtype.element_ty)
        else:
            p = p.to(Q.dtype.element_ty)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split writes zeros with lse = -inf, so stage 2 gives it weight 0 (never 0 * garbage).
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(PART_O + req * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_dv[None, :],
             out, mask=head_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM))
    tl.store(PART_LSE + req * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    PART_O, PART_LSE, O,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    V_HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(PART_LSE + req * stride_lb + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty (a request with no keys): weights 0, output 0.
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(PART_O + req * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
                   mask=s_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    if INTERPRETED and O.dtype.element_ty != tl.float32:
        out = round_like_gpu(out, O.dtype.element_ty)  # the interpreter's own cast would truncate
    tl.store(O + req * stride_ob + head * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=offs_dv < V_HEAD_DIM)


def _launch_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> dict:
    """Key block size, warps, pipeline depth and float32 dot mode.

    Compiled: measured on an H100 (triton 3.6; 64 requests of 2048 keys, 32/8 heads, head_dim 128):
    bfloat16 read the KV cache at about 2.5 TB/s with any BLOCK_N of 32..128. Float32 uses three-pass TF32
    ("tf32x3", float32-accurate): 2.2 TB/s against 0.8 for IEEE dots. Interpreted: small blocks, so short
    test sequences cross block and split boundaries.
    """
    if interpreted:
        return dict(BLOCK_N=16, DOT_PRECISION="ieee")
    if dtype == torch.float32:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2, DOT_PRECISION="ieee" if torch.version.hip else "tf32x3")
    if block_d > 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2, DOT_PRECISION="ieee")
    return dict(BLOCK_N=64, num_warps=4, num_stages=3, DOT_PRECISION="ieee")


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, sm_scale: float,
                         logit_cap: float = 0.0, sliding_window: int = -1, num_kv_splits: int = 4,
                         k_descale: float = 1.0, v_descale: float = 1.0) -> None:
    """One query token per request over its paged keys; writes ``o`` in place.

    Parameters
    ----------
    q : ``(B, num_qo_heads, head_dim)``
    k_buffer, v_buffer : ``(num_slots, num_kv_heads, head_dim)``, ``(num_slots, num_kv_heads, v_head_dim)``, in
        q's dtype or both ``float8_e4m3fn`` (an fp8 cache: a row means ``row * k_descale`` / ``row * v_descale``).
    o : ``(B, num_qo_heads, v_head_dim)``, written in place (in its own dtype).
    kv_indptr : ``(B + 1,)`` int32/int64; kv_indices int32/int64: request ``i``'s keys, its new token last
        (the caller writes it to the pool first), are at slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.
    sm_scale : multiplies ``q . k``.
    logit_cap : > 0 applies ``logit_cap * tanh(s / logit_cap)`` after scaling; 0 is off.
    sliding_window : window_left: the query (position ``kv_len - 1``) sees keys from ``kv_len - 1 -
        window_left`` on; -1 is off.
    num_kv_splits : how many parts each request's keys are split into (stage 1), merged in stage 2.
    k_descale, v_descale : the fp8 cache's scales (ignored for a cache in q's dtype).

    GQA: query head ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)``. A request with no keys
    outputs zeros. P is rounded to v's dtype before the PV product; float32 inputs use IEEE dots in the
    interpreter and three-pass TF32 (float32-accurate) on NVIDIA GPUs. Allocates two float32 scratch
    tensors for the partial results, ``(B, num_qo_heads, num_kv_splits, v_head_dim)`` and
    ``(B, num_qo_heads, num_kv_splits)`` (inside a CUDA graph capture they come from the graph's pool);
    no host sync.
    """
    require(q.dim() == o.dim() == k_buffer.dim() == v_buffer.dim() == 3,
             "q, o, k_buffer and v_buffer must be 3-D: (batch, heads, dim) and (num_slots, num_kv_heads, dim)")
    B, H, D = q.shape
    Hk, DV = k_buffer.shape[1], v_buffer.shape[2]
    require(Hk > 0 and H % Hk == 0, f"num_qo_heads {H} must be a multiple of num_kv_heads {Hk}")
    for name, t, shape in (("k_buffer", k_buffer, (k_buffer.shape[0], Hk, D)),
                           ("v_buffer", v_buffer, (k_buffer.shape[0], Hk, DV)), ("o", o, (B, H, DV))):
        require(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape} (head_dim from q)")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o)):
        require(t.stride(-1) == 1, f"{name} needs a unit stride in its last dimension; pass {name}.contiguous()")
        fp8_buffer = name in ("k_buffer", "v_buffer") and t.dtype == torch.float8_e4m3fn
        require(name == "o" or t.dtype == q.dtype or fp8_buffer,
                 f"{name} is {t.dtype} but q is {q.dtype}; cast them to one dtype")
    require(v_buffer.dtype == k_buffer.dtype, f"k_buffer is {k_buffer.dtype} but v_buffer is {v_buffer.dtype}")
    check_index("kv_indptr", kv_indptr, B + 1)
    check_index("kv_indices", kv_indices)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices)):
        require(t.device == q.device, f"{name} is on {t.device} but q is on {q.device}; put all inputs on one device")
    require(int(num_kv_splits) >= 1, f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if sliding_window is None:
        sliding_window = -1
    logit_cap = float(logit_cap or 0.0)
    if B == 0:
        return

    splits = int(num_kv_splits)
    group = H // Hk
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    interpreted = is_interpreted(_decode_split_kernel)
    cfg = _launch_config(max(block_d, block_dv), q.dtype, interpreted)
    part_o = torch.empty(B, H, splits, DV, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    grid = (B, Hk * triton.cdiv(group, _BLOCK_H), splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, part_o, part_lse,
        float(sm_scale), logit_cap, int(sliding_window), float(k_descale), float(v_descale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=D, V_HEAD_DIM=DV, BLOCK_H=_BLOCK_H, BLOCK_D=block_d, BLOCK_DV=block_dv,
        NUM_SPLITS=splits, USE_WINDOW=sliding_window >= 0, USE_CAP=logit_cap > 0, INTERPRETED=interpreted,
        KV_FP8=k_buffer.dtype == torch.float8_e4m3fn, **cfg,
    )
    _decode_merge_kernel[(B, H)](
        part_o, part_lse, o,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        V_HEAD_DIM=DV, BLOCK_DV=block_dv, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        INTERPRETED=interpreted,
    )
