"""torch-native backend: MHA and MLA over the paged cache with ``scaled_dot_product_attention``.

Runs on CPU and GPU. One request at a time, like SGLang's torch-native backend: slow, simple, and the
CPU twin of the GPU kernels for every property.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.base import DRAFTING_MODES, AttentionBackend, Capabilities, PlannedMetadata
from backends.latent import latent_to_heads
from backends.lse import attention_with_lse, merge_attention_states
from backends.planner import exclusive_cumsum, plan_token_level
from batch.forward_batch import dequantize_kv

MLA_PREFIX_CHUNK = 16  # prefix tokens expanded per chunk in the MLA MHA path (small: CI prefixes span several)


def kv_from_cache(forward_batch, layer, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[L, Hk, D]`` and V ``[L, Hk, Dv]`` at slots ``idx`` in ``dtype``, an fp8 cache's rows times the layer's
    scales; for MLA the value is the latent's head."""
    pool = forward_batch.token_to_kv_pool
    k = dequantize_kv(pool.get_key_buffer(layer.layer_id)[idx], dtype, layer.k_scale)
    vb = pool.get_value_buffer(layer.layer_id)
    v = dequantize_kv(vb[idx], dtype, layer.v_scale) if vb is not None else k[..., : layer.v_head_dim]
    return k, v


def causal_mask(q_len: int, k_len: int, sliding_window: int, device) -> torch.Tensor:
    """``[q_len, k_len]`` bool, causal aligned to the end, with an optional window_left."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window >= 0:
        mask &= k_pos >= q_pos - sliding_window
    return mask


def refuse_logit_cap(layer) -> None:
    """Raise for a soft-capped layer: scaled_dot_product_attention has no soft-cap, and computing the layer
    without it would answer a different function (properties/refusal.py)."""
    if layer.kind == "mha" and layer.logit_cap:
        raise ValueError(f"TorchNativeBackend: layer {layer.layer_id} has logit_cap={layer.logit_cap}; "
                         "scaled_dot_product_attention has no soft-cap")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[Lq, H, D]``, k ``[Lk, Hk, D]``, v ``[Lk, Hk, Dv]``, mask ``[Lq, Lk]`` -> ``[Lq, H, Dv]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=scale)
    return o[0].transpose(0, 1)


class TorchNativeBackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha", "mla"}),
        modes=DRAFTING_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16", "float64"}),
        logit_cap=False,  # scaled_dot_product_attention has no soft-cap
        # No CUDA graphs: its forward walks the requests on the host (.tolist(), one SDPA per request), which a
        # graph capture cannot record; declaring graph modes would claim what a GPU run could not do.
        cuda_graph_modes=frozenset(),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),  # fp8 rows are dequantized (times the scale) on read
        verify_window=True,
        empty_extend=True,
        # MLA's chunked-prefix path expands the prefix MLA_PREFIX_CHUNK keys at a time: one chunk, two.
        length_boundaries=frozenset({MLA_PREFIX_CHUNK, 2 * MLA_PREFIX_CHUNK}),
    )

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.forward_metadata: PlannedMetadata | None = None
        self.mha_chunk: dict | None = None

    # ---- planning ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Token-level plan (:func:`backends.planner.plan_token_level`): prefix slots for extend-like modes, all
        ``seq_lens`` slots for decode, and the tree mask for TARGET_VERIFY."""
        self.forward_metadata = plan_token_level(forward_batch)

    def init_mha_chunk_metadata(self, forward_batch) -> None:
        """Plan the MLA prefill's MHA path: ragged new tokens plus the prefix in chunks of latent slots."""
        fb = forward_batch
        prefix = fb.extend_prefix_lens.to(torch.int64)
        chunks = []
        max_prefix = int(prefix.max()) if prefix.numel() else 0
        for start in range(0, max_prefix, MLA_PREFIX_CHUNK):
            lens = (prefix - start).clamp(0, MLA_PREFIX_CHUNK)
            indptr = exclusive_cumsum(lens)
            rows = [fb.req_to_token[r, start:start + n] for r, n in zip(fb.req_pool_indices.tolist(), lens.tolist())]
            chunks.append((indptr, torch.cat(rows).to(torch.int64)))
        self.mha_chunk = {"qo_indptr": exclusive_cumsum(fb.extend_seq_lens), "chunks": chunks,
                          "chunk_size": MLA_PREFIX_CHUNK}

    def planned_metadata(self) -> PlannedMetadata:
        """The token-level plan, with the MLA chunk plan under ``chunk`` once ``init_mha_chunk_metadata`` ran."""
        meta = self.forward_metadata
        if self.mha_chunk is not None:
            meta.chunk = self.mha_chunk
        return meta

    # ---- per layer ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Per request, :func:`sdpa` of the new tokens over the cached prefix then themselves (causal with the
        window, or the tree mask); an MLA layer in expanded form takes the chunked MHA path instead."""
        if layer.kind == "mla" and not layer.absorbed:
            return self._mla_expanded(q, k, v, layer, forward_batch)
        refuse_logit_cap(layer)
        fb, meta = forward_batch, self.forward_metadata
        if save_kv_cache:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v if layer.kind == "mha" else None,
                                              layer.k_scale, layer.v_scale)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for i in range(fb.batch_size):
            kc, vc = kv_from_cache(fb, layer, meta.kv_indices[kv[i]:kv[i + 1]], q.dtype)
            k_i = torch.cat([kc, k[qo[i]:qo[i + 1]]])
            v_i = torch.cat([vc, v[qo[i]:qo[i + 1], :, : layer.v_head_dim]])
            q_len, k_len = qo[i + 1] - qo[i], k_i.shape[0]
            if meta.custom_mask is not None:
                m0, m1 = int(meta.mask_indptr[i]), int(meta.mask_indptr[i + 1])
                mask = meta.custom_mask[m0:m1].view(q_len, k_len).bool()
                if layer.sliding_window_size >= 0:  # by positions: a draft's row is not its position
                    q_pos = fb.positions[qo[i]:qo[i + 1]]
                    k_pos = torch.cat([torch.arange(k_len - q_len, device=q.device), q_pos])
                    mask = mask & (k_pos[None, :] >= q_pos[:, None] - layer.sliding_window_size)
            else:
                mask = causal_mask(q_len, k_len, layer.sliding_window_size, q.device)
            out[qo[i]:qo[i + 1]] = sdpa(q[qo[i]:qo[i + 1]], k_i, v_i, mask, layer.scaling)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Per request, :func:`sdpa` of the new token over its ``seq_lens`` cached slots, with the layer's window."""
        refuse_logit_cap(layer)
        fb, meta = forward_batch, self.forward_metadata
        if save_kv_cache:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v if layer.kind == "mha" else None,
                                              layer.k_scale, layer.v_scale)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        kv = meta.kv_indptr.tolist()
        for i in range(fb.batch_size):
            k_i, v_i = kv_from_cache(fb, layer, meta.kv_indices[kv[i]:kv[i + 1]], q.dtype)
            mask = causal_mask(1, k_i.shape[0], layer.sliding_window_size, q.device)
            out[i:i + 1] = sdpa(q[i:i + 1], k_i, v_i, mask, layer.scaling)
        return out

    def _mla_expanded(self, q, k, v, layer, forward_batch):
        """MLA prefill as MHA: new tokens causally, plus prefix chunks expanded from the latent cache."""
        chunk = self.mha_chunk
        if chunk is None or int(chunk["qo_indptr"][-1]) != q.shape[0]:
            planned = None if chunk is None else int(chunk["qo_indptr"][-1])
            raise RuntimeError(f"MLA prefill got {q.shape[0]} query rows but init_mha_chunk_metadata planned "
                               f"{planned}: the chunk plan is missing or stale")
        fb = forward_batch
        C = layer.spec.kv_lora_rank
        latent = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)
        qo = chunk["qo_indptr"].tolist()
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        for i in range(fb.batch_size):
            rows = slice(qo[i], qo[i + 1])
            n = qo[i + 1] - qo[i]
            # The partial outputs stay in float32 until the last merge: with chunks of MLA_PREFIX_CHUNK keys a
            # 16k-token prefix takes a thousand merges, and rounding each to bfloat16 (as an engine's merge_state
            # does over its few 128k-token chunks) grew the error to 8u.
            # So does the running log-sum-exp, in float64: each chunk's own LSE is float32 as an engine's, but the
            # running one is rounded again at every merge, and each rounding of size u*|lse| (|lse| ~ 10) rescales
            # everything merged so far. Over a thousand merges that doubled the relative error (0.6 of the bound at
            # an 8k prefix in float32, against 0.28 for the single-pass MHA path): an error of our chunk count, not
            # of the arithmetic an engine does over its few chunks.
            q_i = q[rows].float()
            o, lse = attention_with_lse(q_i, k[rows], v[rows], sm_scale=layer.scaling,
                                        mask=causal_mask(n, n, -1, q.device))
            lse = lse.double()
            for indptr, indices in chunk["chunks"]:
                idx = indices[int(indptr[i]):int(indptr[i + 1])]
                if idx.numel() == 0:
                    continue
                k_c, v_c = latent_to_heads(latent[idx, 0], C, layer.weights["w_kc"], layer.weights["w_vc"])
                o_c, lse_c = attention_with_lse(q_i, k_c.to(q.dtype), v_c.to(q.dtype), sm_scale=layer.scaling)
                o, lse = merge_attention_states(o, lse, o_c, lse_c)
            out[rows] = o
        return out

    # ---- CUDA graphs: not supported (declared), but the protocol surface exists ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Raises: torch_native captures no CUDA graphs."""
        raise NotImplementedError("torch_native does not support CUDA graphs (its capabilities declare no cuda_graph_modes)")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Raises: torch_native captures no CUDA graphs."""
        raise NotImplementedError("torch_native does not support CUDA graphs (its capabilities declare no cuda_graph_modes)")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1 (torch_native captures no CUDA graphs)."""
        return 1

    @property
    def verify_mask(self):
        """The planned tree mask (complete after init_forward_metadata), or None."""
        return None if self.forward_metadata is None else self.forward_metadata.custom_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the verify plan is complete after init_forward_metadata."""
        return None  # the verify plan needs no fix-up after drafting
