"""Extend (prefill) attention in Triton: each request's new tokens over its cached prefix and themselves.

Layout (token granularity, page size 1 as seen by the kernel):

- ``q_extend (nnz_qo, num_qo_heads, head_dim)``, ``k_extend (nnz_qo, num_kv_heads, head_dim)``,
  ``v_extend (nnz_qo, num_kv_heads, v_head_dim)``: the new tokens of all requests, request ``i`` at rows
  ``qo_indptr[i]:qo_indptr[i+1]``.
- ``k_buffer (num_slots, num_kv_heads, head_dim)``, ``v_buffer (num_slots, num_kv_heads, v_head_dim)``: the KV
  pool; request ``i``'s prefix is at slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, in token order.

One program computes ``BLOCK_M`` query rows of one request and one query head. It runs one online softmax
(log2 domain, float32 state) over two stages: the prefix, gathered slot by slot from the pool, then the
request's new keys read straight from ``k_extend``/``v_extend``. Query row ``j`` of request ``i`` sits at
position ``prefix_i + j``; new key ``j`` at ``prefix_i + j``.

Visibility: causal over the new tokens (all of the prefix), or, with a custom mask, exactly the mask's bits
(the mask replaces the causal rule; tree verification). A sliding window (window_left) additionally hides
keys before ``position - window_left``; the upper end of the window comes from the causal rule or the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.triton_kernels.checks import check_index, require
from backends.triton_kernels.numerics import is_interpreted, round_like_gpu, soft_cap


@triton.jit
def _attend_block(q, m_i, l_i, acc, K, V, k_row_off, v_row_off, col_ok, visible, sm_scale, logit_cap,
                  k_descale, v_descale,
                  HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, USE_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  INTERPRETED: tl.constexpr, KV_FP8: tl.constexpr, PV_DTYPE: tl.constexpr):
    """One online-softmax step over a block of keys.

    ``k_row_off``/``v_row_off`` ``(BLOCK_N,)``: element offsets of each key's row for this kv head;
    ``col_ok`` ``(BLOCK_N,)``: the key exists (padding columns are never loaded); ``visible``
    ``(BLOCK_M, BLOCK_N)``. Scores are kept in the log2 domain so the softmax uses exp2. ``KV_FP8``: K and V are
    e4m3 rows, dequantized to ``PV_DTYPE`` (the queries' dtype) times ``k_descale``/``v_descale`` (exact for the
    power-of-two scales the harness uses).
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + k_row_off[:, None] + offs_d[None, :],
                mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if KV_FP8:
        k = (k.to(tl.float32) * k_descale).to(PV_DTYPE)
    if INTERPRETED:
        k = k.to(tl.float32)  # see numerics.py: the interpreter's 16-bit dots are wrong
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if USE_CAP:
        s = soft_cap(qk * sm_scale, logit_cap) * 1.4426950408889634
    else:
        s = qk * (sm_scale * 1.4426950408889634)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps p = 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + v_row_off[:, None] + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
    if KV_FP8:
        v = (v.to(tl.float32) * v_descale).to(PV_DTYPE)
    # P is rounded to V's dtype (the queries') for the tensor-core dot, as in FlashAttention; l stays float32.
    if INTERPRETED:
        v = v.to(tl.float32)
        if PV_DTYPE != tl.float32:
            p = round_like_gpu(p, PV_DTYPE)
    else:
        p = p.to(PV_DTYPE)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_fwd_kernel(
    Q, K_EXT, V_EXT, O, K_BUF, V_BUF, QO_INDPTR, KV_INDPTR, KV_INDICES, MASK, MASK_INDPTR, POS,
    sm_scale, logit_cap, window_left, k_descale, v_descale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, KV_FP8: tl.constexpr,
):
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    kv_head = head // GROUP

    qo_start = tl.load(QO_INDPTR + req).to(tl.int64)
    q_len = (tl.load(QO_INDPTR + req + 1) - qo_start).to(tl.int32)
    m_start = block_m * BLOCK_M
    if m_start >= q_len:
        return  # the grid is sized for the longest request
    kv_start = tl.load(KV_INDPTR + req).to(tl.int64)
    prefix_len = (tl.load(KV_INDPTR + req + 1) - kv_start).to(tl.int32)

    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + (qo_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)
    q_pos = prefix_len + rows
    # Under a tree mask a row is no position: the window reads the tokens' positions (prefix + tree depth).
    TREE_WINDOW: tl.constexpr = USE_CUSTOM_MASK and USE_WINDOW
    if TREE_WINDOW:
        q_pos = tl.load(POS + qo_start + rows, mask=row_ok, other=0).to(tl.int32)

    mask_row = tl.zeros([BLOCK_M], tl.int64)
    if USE_CUSTOM_MASK:
        # Row-major (q_len, prefix_len + q_len) block of this request.
        mask_row = tl.load(MASK_INDPTR + req).to(tl.int64) + rows.to(tl.int64) * (prefix_len + q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Stage 1: the cached prefix, gathered through kv_indices.
    lo = 0
    if USE_WINDOW:
        # Rows m_start.. sit at positions >= prefix_len + m_start, tree tokens at >= prefix_len.
        lo = tl.maximum(prefix_len + (0 if TREE_WINDOW else m_start) - window_left, 0)
    for n0 in range(lo, prefix_len, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < prefix_len
        visible = row_ok[:, None] & col_ok[None, :]
        if USE_CUSTOM_MASK:
            bits = tl.load(MASK + mask_row[:, None] + cols[None, :], mask=visible, other=0)
            visible = visible & (bits != 0)
        if USE_WINDOW:
            visible = visible & (cols[None, :] >= q_pos[:, None] - window_left)
        slots = tl.load(KV_INDICES + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, K_BUF, V_BUF, slots * stride_kbs + kv_head * stride_kbh,
            slots * stride_vbs + kv_head * stride_vbh, col_ok, visible, sm_scale, logit_cap, k_descale, v_descale,
            HEAD_DIM, V_HEAD_DIM, BLOCK_D, BLOCK_DV, USE_CAP, DOT_PRECISION, INTERPRETED, KV_FP8,
            Q.dtype.element_ty)

    # Stage 2: the request's own new tokens.
    lo = 0
    if USE_WINDOW and not TREE_WINDOW:
        lo = tl.maximum(m_start - window_left, 0)
    hi = q_len
    if CAUSAL and not USE_CUSTOM_MASK:
        hi = tl.minimum(q_len, m_start + BLOCK_M)  # later keys are hidden from every row of this block
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < q_len
        visible = row_ok[:, None] & col_ok[None, :]
        if USE_CUSTOM_MASK:
            bits = tl.load(MASK + mask_row[:, None] + (prefix_len + cols)[None, :], mask=visible, other=0)
            visible = visible & (bits != 0)
        elif CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if TREE_WINDOW:
            k_pos = tl.load(POS + qo_start + cols, mask=col_ok, other=0).to(tl.int32)
            visible = visible & (k_pos[None, :] >= q_pos[:, None] - window_left)
        elif USE_WINDOW:
            visible = visible & (cols[None, :] >= rows[:, None] - window_left)
        tok = qo_start + cols
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, K_EXT, V_EXT, tok * stride_kt + kv_head * stride_kh,
            tok * stride_vt + kv_head * stride_vh, col_ok, visible, sm_scale, logit_cap, 1.0, 1.0,
            HEAD_DIM, V_HEAD_DIM, BLOCK_D, BLOCK_DV, USE_CAP, DOT_PRECISION, INTERPRETED, False,
            Q.dtype.element_ty)

    # Rows that saw no key have l = 0 and acc = 0: they output zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if INTERPRETED and O.dtype.element_ty != tl.float32:
        out = round_like_gpu(out, O.dtype.element_ty)  # the interpreter's own cast would truncate
    tl.store(O + (qo_start + rows)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < V_HEAD_DIM))


def _launch_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> dict:
    """Block sizes, warps, pipeline depth and float32 dot mode.

    Compiled: measured on an H100 (triton 3.6; 8 requests of 1024 prefix + 512 new tokens, 32/8 heads):
    bfloat16 head_dim 128 ran at 189 TFLOP/s, 256 at 181. Float32 uses three-pass TF32 ("tf32x3", errors
    ~1e-6 relative like IEEE float32, measured 1.3e-6 vs 1.1e-6 max abs) because IEEE float32 dots run on
    the CUDA cores at 7 TFLOP/s against 30. Interpreted: small blocks, so short test sequences cross
    block boundaries.
    """
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=16, DOT_PRECISION="ieee")
    if dtype == torch.float32:
        precision = "ieee" if torch.version.hip else "tf32x3"
        if block_d <= 128:
            return dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, DOT_PRECISION=precision)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1, DOT_PRECISION=precision)
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3, DOT_PRECISION="ieee")
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, DOT_PRECISION="ieee")


def extend_attention_fwd(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None, *,
                         sm_scale: float, logit_cap: float = 0.0, sliding_window: int = -1,
                         causal: bool = True, max_extend_len: int | None = None, k_descale: float = 1.0,
                         v_descale: float = 1.0, positions: torch.Tensor | None = None) -> None:
    """Attention of each request's new tokens over its cached prefix, then its new tokens; writes
    ``o_extend`` in place.

    Parameters
    ----------
    q_extend : ``(nnz_qo, num_qo_heads, head_dim)``
    k_extend : ``(nnz_qo, num_kv_heads, head_dim)``
    v_extend : ``(nnz_qo, num_kv_heads, v_head_dim)``
    o_extend : ``(nnz_qo, num_qo_heads, v_head_dim)``, written in place (in its own dtype).
    k_buffer, v_buffer : ``(num_slots, num_kv_heads, head_dim)``, ``(num_slots, num_kv_heads, v_head_dim)``:
        the KV pool holding the prefixes, in q's dtype or both ``float8_e4m3fn`` (an fp8 cache: each row means
        ``row * k_descale`` / ``row * v_descale``; the new tokens' k/v stay in q's dtype).
    qo_indptr : ``(B + 1,)`` int32/int64; request ``i``'s new tokens are rows ``qo_indptr[i]:qo_indptr[i+1]``.
    kv_indptr : ``(B + 1,)`` int32/int64; kv_indices ``(kv_indptr[-1],)`` int32/int64: request ``i``'s prefix
        slots are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, in token order.
    custom_mask : None, or flat bool/uint8; with ``mask_indptr (B + 1,)``, request ``i``'s block is a
        row-major ``(qlen_i, prefix_i + qlen_i)`` matrix (prefix columns first), True = may attend. It
        replaces the causal rule (``causal`` is then ignored).
    sm_scale : multiplies ``q . k``.
    logit_cap : > 0 applies ``logit_cap * tanh(s / logit_cap)`` after scaling; 0 is off.
    sliding_window : window_left: a query at position ``p`` sees no key before ``p - window_left``; -1 is off.
        A new token's position is ``prefix_i + j``, except under a custom mask, where it is ``positions``.
    causal : without a custom mask, new token ``j`` sees new tokens ``0..j`` (False: all of them).
    max_extend_len : the most new tokens of any request, when the caller knows it (a CUDA graph's fixed width:
        reading it from ``qo_indptr`` is a device sync, which graph capture forbids); None reads it.
    k_descale, v_descale : the fp8 cache's scales (ignored for a cache in q's dtype).
    positions : ``(nnz_qo,)`` int: each new token's position; needed with a custom mask and a window (a
        draft tree's token sits at ``prefix_i + depth``, not at its row).

    GQA: query head ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)``. A query row that sees no
    key outputs zeros. Accumulation is float32; P is rounded to v's dtype before the PV product; float32
    inputs use IEEE dots in the interpreter and three-pass TF32 (float32-accurate) on NVIDIA GPUs.
    Without ``max_extend_len``, reads ``max(qo_indptr diffs)`` on the host to size the grid (one device sync).
    """
    require(q_extend.dim() == k_extend.dim() == v_extend.dim() == 3,
             "q_extend, k_extend and v_extend must be 3-D (tokens, heads, dim)")
    T, H, D = q_extend.shape
    Hk, DV = k_extend.shape[1], v_extend.shape[2]
    require(Hk > 0 and H % Hk == 0, f"num_qo_heads {H} must be a multiple of num_kv_heads {Hk}")
    for name, t, shape in (("k_extend", k_extend, (T, Hk, D)), ("v_extend", v_extend, (T, Hk, DV)),
                           ("o_extend", o_extend, (T, H, DV)), ("k_buffer", k_buffer, (k_buffer.shape[0], Hk, D)),
                           ("v_buffer", v_buffer, (k_buffer.shape[0], Hk, DV))):
        require(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend), ("o_extend", o_extend),
                    ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        require(t.stride(-1) == 1, f"{name} needs a unit stride in its last dimension; pass {name}.contiguous()")
        fp8_buffer = name in ("k_buffer", "v_buffer") and t.dtype == torch.float8_e4m3fn
        require(name == "o_extend" or t.dtype == q_extend.dtype or fp8_buffer,
                 f"{name} is {t.dtype} but q_extend is {q_extend.dtype}; cast them to one dtype")
    kv_fp8 = k_buffer.dtype == torch.float8_e4m3fn
    require(v_buffer.dtype == k_buffer.dtype, f"k_buffer is {k_buffer.dtype} but v_buffer is {v_buffer.dtype}")
    B = qo_indptr.numel() - 1
    check_index("qo_indptr", qo_indptr, B + 1)
    check_index("kv_indptr", kv_indptr, B + 1)
    check_index("kv_indices", kv_indices)
    use_mask = custom_mask is not None
    if use_mask:
        require(mask_indptr is not None, "custom_mask needs mask_indptr (B + 1 offsets into the flat mask)")
        check_index("mask_indptr", mask_indptr, B + 1)
        require(custom_mask.dim() == 1 and custom_mask.dtype in (torch.bool, torch.uint8)
                 and custom_mask.stride(0) == 1,
                 f"custom_mask must be a flat contiguous bool/uint8 tensor, got {custom_mask.dtype} "
                 f"of shape {tuple(custom_mask.shape)}")
    for name, t in (("k_extend", k_extend), ("v_extend", v_extend), ("o_extend", o_extend), ("k_buffer", k_buffer),
                    ("v_buffer", v_buffer), ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices), ("custom_mask", custom_mask), ("mask_indptr", mask_indptr)):
        require(t is None or t.device == q_extend.device,
                 f"{name} is on {t.device if t is not None else None} but q_extend is on {q_extend.device}; "
                 "put all inputs on one device")
    if sliding_window is None:
        sliding_window = -1
    tree_window = use_mask and sliding_window >= 0
    if tree_window:
        require(positions is not None, "a custom mask with a sliding window needs positions (nnz_qo,)")
        require(positions.dim() == 1 and positions.numel() == T and positions.dtype in (torch.int32, torch.int64)
                and positions.stride(0) == 1, f"positions must be a contiguous ({T},) int32/int64 tensor, got "
                                              f"{positions.dtype} of shape {tuple(positions.shape)}")
        require(positions.device == q_extend.device, f"positions is on {positions.device} but q_extend is on "
                                                     f"{q_extend.device}; put all inputs on one device")
    logit_cap = float(logit_cap or 0.0)
    if B <= 0 or T == 0:
        return

    max_q = max_extend_len if max_extend_len is not None else int((qo_indptr[1:] - qo_indptr[:-1]).max())
    if max_q <= 0:
        return
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    interpreted = is_interpreted(_extend_fwd_kernel)
    cfg = _launch_config(max(block_d, block_dv), q_extend.dtype, interpreted)
    # Bool and uint8 share a byte layout; the kernel reads bytes.
    mask = custom_mask.view(torch.uint8) if use_mask else qo_indptr
    grid = (triton.cdiv(max_q, cfg["BLOCK_M"]), H, B)
    _extend_fwd_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        mask, mask_indptr if use_mask else qo_indptr, positions if tree_window else qo_indptr,
        float(sm_scale), logit_cap, int(sliding_window), float(k_descale), float(v_descale),
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=H // Hk, HEAD_DIM=D, V_HEAD_DIM=DV, BLOCK_D=block_d, BLOCK_DV=block_dv,
        USE_CUSTOM_MASK=use_mask, CAUSAL=bool(causal), USE_WINDOW=sliding_window >= 0, USE_CAP=logit_cap > 0,
        INTERPRETED=interpreted, KV_FP8=kv_fp8, **cfg,
    )
