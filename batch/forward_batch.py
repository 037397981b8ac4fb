"""The runtime batch that backends read (DESIGN.md section 1), with its memory pools.

Field names follow SGLang's ``ForwardBatch`` so that a backend written for one reads the other. Tensors are
made only by :mod:`engine.materialize`; this module holds the containers and the pool operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from batch.spec import ForwardMode, Layer


FP8_KV_DTYPE = torch.float8_e4m3fn  # SGLang's kv_cache_dtype "fp8_e4m3"


def quantize_kv(x: torch.Tensor, buffer_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a buffer of ``buffer_dtype`` stores it: an fp8 buffer holds ``x / scale`` rounded to e4m3 (round
    to nearest even, saturating at +-448, as torch's cast); any other buffer holds ``x`` in its dtype."""
    if buffer_dtype == FP8_KV_DTYPE:
        return (x / scale).to(buffer_dtype)
    return x.to(buffer_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Rows read from a KV buffer, in ``dtype``: fp8 rows are ``stored * scale`` (exact: an e4m3 value times a
    power of two is representable in every compute dtype); other rows are cast."""
    if x.dtype == FP8_KV_DTYPE:
        return x.to(dtype) * scale
    return x.to(dtype)


@dataclass
class KVPool:
    """Paged KV pool, one buffer pair per full-attention layer id.

    MHA layer: ``k_buffer[num_slots, Hk, D]``, ``v_buffer[num_slots, Hk, Dv]``.
    MLA layer: ``k_buffer[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` (ckv then kpe); no v buffer: the
    value is the first kv_lora_rank columns of the same latent row. Slot 0 is reserved padding.

    An fp8 KV cache (``kv_cache_dtype`` fp8_e4m3) holds ``torch.float8_e4m3fn`` buffers: a token's K is stored
    as ``k / k_scale`` rounded to e4m3 and means ``stored * k_scale`` (the layer's scales; SGLang's
    ``MHATokenToKVPool.set_kv_buffer`` with ``k_scale``/``v_scale``). Reading it back is the backend's job.
    """

    page_size: int
    k_buffers: dict[int, torch.Tensor]
    v_buffers: dict[int, torch.Tensor | None]
    # The model's dtype, in which K/V are handed over and queries come (SGLang: model_runner.dtype); None: the
    # buffers' own (a cache in the model's dtype). An fp8 cache's buffers do not tell it.
    model_dtype: torch.dtype | None = None

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor | None:
        return self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write new tokens' K/V at slots ``loc[T]``: ``k[T, Hk, D]``, ``v[T, Hk, Dv]`` (or None for MLA); into an
        fp8 buffer as ``k / k_scale`` (``v / v_scale``) rounded to e4m3."""
        kb = self.k_buffers[layer_id]
        kb[loc] = quantize_kv(k, kb.dtype, k_scale)
        if v is not None:
            vb = self.v_buffers[layer_id]
            vb[loc] = quantize_kv(v, vb.dtype, v_scale)

    def is_fp8(self, layer_id: int) -> bool:
        """Whether layer ``layer_id``'s buffers hold float8 e4m3 (an fp8 KV cache); False for a layer without any."""
        buffer = self.k_buffers.get(layer_id)
        return buffer is not None and buffer.dtype == FP8_KV_DTYPE

    def clone(self) -> "KVPool":
        return KVPool(self.page_size, {i: b.clone() for i, b in self.k_buffers.items()},
                      {i: (None if b is None else b.clone()) for i, b in self.v_buffers.items()}, self.model_dtype)


@dataclass
class MambaPool:
    """Linear-attention state pools, one set per linear layer id, indexed by a request's state slot.

    ``conv_states[layer_id][slots, conv_dim, conv_kernel - 1]`` (last inputs, oldest first) and
    ``ssm_states[layer_id][slots, Hv, K, V]`` (float32). Verification keeps one state per draft position in
    ``intermediate_conv_states[layer_id][slots, D, conv_dim, kernel - 1]`` and
    ``intermediate_ssm_states[layer_id][slots, D, Hv, K, V]``. Slot 0 is reserved padding.
    """

    conv_states: dict[int, torch.Tensor]
    ssm_states: dict[int, torch.Tensor]
    intermediate_conv_states: dict[int, torch.Tensor] = field(default_factory=dict)
    intermediate_ssm_states: dict[int, torch.Tensor] = field(default_factory=dict)

    def clone(self) -> "MambaPool":
        c = lambda d: {i: t.clone() for i, t in d.items()}  # noqa: E731
        return MambaPool(c(self.conv_states), c(self.ssm_states),
                         c(self.intermediate_conv_states), c(self.intermediate_ssm_states))


@dataclass
class SpecInfo:
    """Speculative inputs as tensors (EAGLE verify / draft-extend).

    ``custom_mask``: for each request a ``draft_token_num x (seq_len + draft_token_num)`` boolean block
    (row = draft token, column = key: the cached tokens first, then the drafts), flattened row-major and
    concatenated over requests. ``positions[T]``: seq_len + tree depth. ``accept_length[B]`` int32.
    """

    draft_token_num: int
    topk: int
    spec_steps: int
    custom_mask: torch.Tensor | None
    positions: torch.Tensor | None
    parents: torch.Tensor  # [B, draft_token_num] int64, -1 for the root
    accept_length: torch.Tensor
    accept_length_cpu: list[int]
    algorithm: str = "eagle"  # whose verify input (batch.spec.VERIFY_ALGORITHMS)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    extend_seq_lens: torch.Tensor  # [B] int32
    extend_prefix_lens: torch.Tensor  # [B] int32
    extend_start_loc: torch.Tensor  # [B] int32, exclusive cumsum of extend_seq_lens
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_num_tokens: int
    positions: torch.Tensor  # [T] int64
    mrope_positions: torch.Tensor | None  # [3, T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_to_token: torch.Tensor  # [max_reqs, context_len] int32; row 0 is padding
    req_to_state_slot: torch.Tensor  # [max_reqs] int64: a request row's slot in the linear-attention pools
    state_slots: torch.Tensor  # [B] int64: req_to_state_slot[req_pool_indices]
    token_to_kv_pool: KVPool
    mamba_pool: MambaPool | None
    spec_info: SpecInfo | None
    device: torch.device
    num_token_non_padded: int | None = None
    # A graph runner's static batch at replay: its last rows are padding (SGLang's replay view carries it, and
    # a backend must not guess it from the lengths: a real row may have the padding's length).
    num_padding: int = 0
    tbo_split_seq_index: int | None = None
    tbo_split_token_index: int | None = None
    tbo_children: Optional[list["ForwardBatch"]] = None

    @property
    def page_size(self) -> int:
        return self.token_to_kv_pool.page_size


@dataclass
class ModelRunner:
    """What a backend is constructed with (SGLang passes its ModelRunner): the memory pools and sizes that
    outlive one batch, and the model's layers (SGLang's ``model_config``). CUDA-graph hooks receive only
    lengths and indices, so they plan from these."""

    req_to_token: torch.Tensor
    req_to_state_slot: torch.Tensor
    token_to_kv_pool: KVPool
    mamba_pool: MambaPool | None
    device: torch.device
    layers: tuple[Layer, ...] = ()

    @property
    def page_size(self) -> int:
        return self.token_to_kv_pool.page_size

    @property
    def context_len(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def max_requests(self) -> int:
        """Requests the pool holds: row 0 of ``req_to_token`` is the padding row (SGLang's ``ReqToTokenPool.size``)."""
        return self.req_to_token.shape[0] - 1

    @classmethod
    def of(cls, fb: "ForwardBatch", layers: tuple[Layer, ...]) -> "ModelRunner":
        """The runner whose pools ``fb`` lives in, for a model of ``layers``."""
        return cls(fb.req_to_token, fb.req_to_state_slot, fb.token_to_kv_pool, fb.mamba_pool, fb.device,
                   tuple(layers))


@dataclass
class LayerInputs:
    """The per-token inputs of one layer, before RoPE; per-token tensors are sliced by TBO.

    mha: ``q[T, Hq, D]``, ``k[T, Hk, D]``, ``v[T, Hk, Dv]``.
    mla: ``q[T, H, nope + rope]`` (q_nope then q_pe), ``ckv[T, kv_lora_rank]``, ``kpe[T, rope]``.
    linear: ``mixed_qkv[T, conv_dim]``, ``a[T, Hv]``, ``b[T, Hv]``.
    short_conv: ``bcx[T, 3 * hidden]`` (B, C, x).
    mamba2: ``zxbcdt[T, I + conv_dim + H]`` (z, xBC, dt).
    kda: ``mixed_qkv[T, conv_dim]``, ``a[T, H * K]`` (the raw forget gate, per channel), ``b[T, H]``.
    """

    tensors: dict[str, torch.Tensor]

    def slice_tokens(self, start: int, end: int) -> "LayerInputs":
        return LayerInputs({name: t[start:end] for name, t in self.tensors.items()})


@dataclass
class LayerWeights:
    """Per-layer parameters that are not per-token (MLA up-projections, linear conv and gating)."""

    tensors: dict[str, torch.Tensor]
