"""Inputs and a dense float64 oracle for the Triton attention kernels' tests.

A case is pure data (lengths, heads, dims, dtype, seed); ``make_*_inputs`` turns it into tensors on the test
device. The KV pool is laid out the way a serving engine leaves it: slot 0 reserved, the used slots shuffled
and non-contiguous, spare slots in between. Slot 0 and the spare slots hold large values, so a kernel that
reads a slot it should not read is far off, not slightly off.

The oracle builds every request's key sequence (prefix gathered from the pool, then the new tokens) and its
boolean visibility matrix explicitly, and applies a plain softmax in float64 to the very values the kernel
received (bfloat16 inputs are upcast exactly), so only the kernel's own rounding counts as error.

Tolerances (``assert_matches``), with ``vmax = max |v|`` over the values read:

- float32: ``|out - ref| <= 1e-5 * vmax``. Inputs are exact; scores are float32 dots of <= 128 products
  (IEEE in the interpreter; three-pass TF32 on a GPU, about 2**-21 per product, never single-pass TF32),
  softmax and the PV sum accumulate in float32 over <= a few hundred keys: errors of order 1e-6 * vmax
  (measured max: 5e-7 interpreted, 2.4e-6 on an H100, with vmax about 4), with margin.
- bfloat16: ``|out - ref| <= 2**-7 * vmax`` and relative L2 error <= 2**-8. Products of bfloat16 values
  are exact in float32, so QK^T is float32-accurate; the error comes from rounding P to bfloat16 before the
  PV dot (relative <= u = 2**-8 per weight, so <= u * vmax on the output, since the weights sum to 1) and
  from rounding the output to bfloat16 (<= u * |o|). Random signs make the L2 error about u / sqrt(3)
  per rounding, well under 2**-8.
- float16: the same argument with u = 2**-11: ``2**-10 * vmax`` and relative L2 <= 2**-11.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 1000.0  # held by slot 0 and the spare slots: reading one of them shows up at once


@dataclass(frozen=True)
class ExtendCase:
    """A ragged extend batch: request ``i`` has ``prefix_lens[i]`` cached and ``extend_lens[i]`` new tokens."""

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    v_head_dim: int = 64
    dtype: torch.dtype = torch.float32
    seed: int = 0
    q_scale: float = 1.0  # > 1 makes the softmax peakier (and the logit cap bite)


@dataclass(frozen=True)
class DecodeCase:
    """A decode batch: request ``i`` has ``kv_lens[i]`` keys in the pool, its new one last."""

    kv_lens: tuple[int, ...]
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    v_head_dim: int = 64
    dtype: torch.dtype = torch.float32
    seed: int = 0
    q_scale: float = 1.0


def _indptr(lens, device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)


def _pool(gen: torch.Generator, num_used: int, num_kv_heads: int, head_dim: int, v_head_dim: int):
    """A poisoned pool with ``num_used`` shuffled slots (never slot 0) holding random K/V."""
    num_slots = 1 + num_used + max(3, num_used // 3)
    k_buffer = torch.full((num_slots, num_kv_heads, head_dim), POISON)
    v_buffer = torch.full((num_slots, num_kv_heads, v_head_dim), POISON)
    slots = 1 + torch.randperm(num_slots - 1, generator=gen)[:num_used]
    k_buffer[slots] = torch.randn(num_used, num_kv_heads, head_dim, generator=gen)
    v_buffer[slots] = torch.randn(num_used, num_kv_heads, v_head_dim, generator=gen)
    return k_buffer, v_buffer, slots


def make_extend_inputs(case: ExtendCase, device: str = DEVICE) -> dict[str, torch.Tensor]:
    """Tensors for ``extend_attention_fwd``: q/k/v of the new tokens, the pool, indptrs, indices, and ``o``
    filled with NaN (so an unwritten element fails the test)."""
    if len(case.prefix_lens) != len(case.extend_lens):
        raise ValueError("prefix_lens and extend_lens need one entry per request")
    gen = torch.Generator().manual_seed(case.seed)
    T, H, Hk = sum(case.extend_lens), case.num_qo_heads, case.num_kv_heads
    k_buffer, v_buffer, slots = _pool(gen, sum(case.prefix_lens), Hk, case.head_dim, case.v_head_dim)
    t = dict(
        q=torch.randn(T, H, case.head_dim, generator=gen) * case.q_scale,
        k=torch.randn(T, Hk, case.head_dim, generator=gen),
        v=torch.randn(T, Hk, case.v_head_dim, generator=gen),
        k_buffer=k_buffer, v_buffer=v_buffer,
    )
    t = {name: x.to(case.dtype).to(device) for name, x in t.items()}
    t["o"] = torch.full((T, H, case.v_head_dim), float("nan"), dtype=case.dtype, device=device)
    t["qo_indptr"] = _indptr(case.extend_lens, device)
    t["kv_indptr"] = _indptr(case.prefix_lens, device)
    t["kv_indices"] = slots.to(torch.int64).to(device)
    return t


def make_decode_inputs(case: DecodeCase, device: str = DEVICE) -> dict[str, torch.Tensor]:
    """Tensors for ``decode_attention_fwd``; ``o`` filled with NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    B, H = len(case.kv_lens), case.num_qo_heads
    k_buffer, v_buffer, slots = _pool(gen, sum(case.kv_lens), case.num_kv_heads, case.head_dim, case.v_head_dim)
    t = dict(q=torch.randn(B, H, case.head_dim, generator=gen) * case.q_scale, k_buffer=k_buffer, v_buffer=v_buffer)
    t = {name: x.to(case.dtype).to(device) for name, x in t.items()}
    t["o"] = torch.full((B, H, case.v_head_dim), float("nan"), dtype=case.dtype, device=device)
    t["kv_indptr"] = _indptr(case.kv_lens, device)
    t["kv_indices"] = slots.to(torch.int64).to(device)
    return t


def gqa_kv_head(num_qo_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The kv head of each query head: ``h // (Hq // Hk)``."""
    return torch.arange(num_qo_heads) // (num_qo_heads // num_kv_heads)


def dense_attention(q, k, v, visible, *, sm_scale: float, logit_cap: float = 0.0, kv_head=None) -> torch.Tensor:
    """One request in float64. q ``(Lq, H, D)``, k ``(Lk, Hk, D)``, v ``(Lk, Hk, Dv)``, visible ``(Lq, Lk)``
    bool; ``kv_head (H,)`` maps query heads to kv heads (GQA by default). Rows with no visible key give 0."""
    H, Hk = q.shape[1], k.shape[1]
    kv_head = gqa_kv_head(H, Hk) if kv_head is None else kv_head
    q, k, v = q.double().cpu(), k.double().cpu()[:, kv_head], v.double().cpu()[:, kv_head]
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    visible = visible.cpu()
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully hidden rows softmax to NaN; the kernels output 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def extend_visibility(prefix_len: int, extend_len: int, *, causal: bool = True, mask: torch.Tensor | None = None,
                      sliding_window: int = -1, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``(extend_len, prefix_len + extend_len)`` bool: query ``j`` at position ``prefix_len + j``, or at
    ``positions[j]`` (a draft tree's ``prefix_len + depth``), as is new key ``j``."""
    new_pos = torch.arange(prefix_len, prefix_len + extend_len) if positions is None else positions.cpu()
    q_pos = new_pos[:, None]
    k_pos = torch.cat([torch.arange(prefix_len), new_pos])[None, :]
    if mask is not None:
        visible = mask.reshape(extend_len, prefix_len + extend_len).bool().cpu().clone()
    elif causal:
        visible = k_pos <= q_pos
    else:
        visible = torch.ones(extend_len, prefix_len + extend_len, dtype=torch.bool)
    if sliding_window >= 0:
        visible &= k_pos >= q_pos - sliding_window
    return visible


def dense_extend(case: ExtendCase, t: dict[str, torch.Tensor], *, sm_scale: float, causal: bool = True,
                 custom_mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
                 sliding_window: int = -1, logit_cap: float = 0.0, kv_head=None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle for ``extend_attention_fwd`` on ``make_extend_inputs(case)``: ``(nnz_qo, H, Dv)`` float64."""
    outs = []
    qo, kv = t["qo_indptr"].tolist(), t["kv_indptr"].tolist()
    for i, (prefix_len, extend_len) in enumerate(zip(case.prefix_lens, case.extend_lens)):
        slots = t["kv_indices"][kv[i]:kv[i + 1]]
        rows = slice(qo[i], qo[i + 1])
        k = torch.cat([t["k_buffer"][slots], t["k"][rows]])
        v = torch.cat([t["v_buffer"][slots], t["v"][rows]])
        mask = None
        if custom_mask is not None:
            m0 = int(mask_indptr[i])
            mask = custom_mask[m0:m0 + extend_len * (prefix_len + extend_len)]
        visible = extend_visibility(prefix_len, extend_len, causal=causal, mask=mask, sliding_window=sliding_window,
                                    positions=None if positions is None else positions[rows])
        outs.append(dense_attention(t["q"][rows], k, v, visible, sm_scale=sm_scale, logit_cap=logit_cap,
                                    kv_head=kv_head))
    return torch.cat(outs)


def dense_decode(case: DecodeCase, t: dict[str, torch.Tensor], *, sm_scale: float, sliding_window: int = -1,
                 logit_cap: float = 0.0, kv_head=None) -> torch.Tensor:
    """The oracle for ``decode_attention_fwd`` on ``make_decode_inputs(case)``: ``(B, H, Dv)`` float64."""
    outs = []
    kv = t["kv_indptr"].tolist()
    for i, kv_len in enumerate(case.kv_lens):
        slots = t["kv_indices"][kv[i]:kv[i + 1]]
        visible = extend_visibility(kv_len - 1, 1, sliding_window=sliding_window) if kv_len else \
            torch.zeros(1, 0, dtype=torch.bool)
        outs.append(dense_attention(t["q"][i:i + 1], t["k_buffer"][slots], t["v_buffer"][slots], visible,
                                    sm_scale=sm_scale, logit_cap=logit_cap, kv_head=kv_head))
    return torch.cat(outs)


def value_bound(t: dict[str, torch.Tensor]) -> float:
    """``max |v|`` over the values a correct kernel reads (the poisoned slots excluded)."""
    v = t["v_buffer"][t["kv_indices"]].abs().max() if t["kv_indices"].numel() else torch.tensor(0.0)
    if "v" in t and t["v"].numel():
        v = torch.maximum(v.to(t["v"].device), t["v"].abs().max())
    return max(float(v), 1.0)


def tolerance(dtype: torch.dtype, vmax: float) -> tuple[float, float | None]:
    """``(elementwise atol, relative L2 bound or None)``; see the module docstring for the reasons."""
    if dtype == torch.float32:
        return 1e-5 * vmax, None
    if dtype == torch.bfloat16:
        return 2.0 ** -7 * vmax, 2.0 ** -8
    if dtype == torch.float16:  # the bfloat16 argument with u = 2**-11
        return 2.0 ** -10 * vmax, 2.0 ** -11
    raise ValueError(f"no tolerance written down for {dtype}")


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, vmax: float) -> None:
    """Every element written and finite, within the elementwise bound, and (bf16) within the L2 bound."""
    out = out.double().cpu()
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} elements are NaN/inf (unwritten?)"
    atol, rel_l2 = tolerance(dtype, vmax)
    err = (out - ref).abs()
    worst = err.argmax().item()
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert err.max().item() <= atol, (
        f"max |out - ref| = {err.max().item():.3g} > {atol:.3g} at (token, head, dim) = {where}: "
        f"out {out.flatten()[worst].item():.6g}, ref {ref.flatten()[worst].item():.6g}")
    if rel_l2 is not None and ref.norm() > 0:
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel <= rel_l2, f"relative L2 error {rel:.3g} > {rel_l2:.3g}"


def tree_mask(gen: torch.Generator, prefix_len: int, num_draft: int, *, prefix_keep: float = 1.0,
              with_depths: bool = False):
    """A speculative-verification mask ``(num_draft, prefix_len + num_draft)``, bool: draft token ``j`` sees
    the prefix (each column kept with probability ``prefix_keep``), itself and its ancestors in a random
    tree (parent of ``j`` drawn from ``-1 .. j-1``); with ``with_depths`` also each token's depth
    ``(num_draft,)`` (a root, parent -1, has depth 0)."""
    tree = torch.eye(num_draft, dtype=torch.bool)
    depth = torch.zeros(num_draft, dtype=torch.int64)
    for j in range(1, num_draft):
        parent = int(torch.randint(-1, j, (1,), generator=gen))
        if parent >= 0:
            tree[j] |= tree[parent]
            depth[j] = depth[parent] + 1
    prefix = torch.rand(num_draft, prefix_len, generator=gen) < prefix_keep
    mask = torch.cat([prefix, tree], dim=1)
    return (mask, depth) if with_depths else mask
