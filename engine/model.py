"""The slice of a model that surrounds attention: layer objects, RoPE, MLA projections, the layer loop.

This is the caller's side of the protocol, written the way a serving engine's model code calls a backend,
so that wrapper bugs (a missing ``forward``, a skipped ``init_mha_chunk_metadata``, dispatch by type) show
up here exactly as they would in a model. Backend outputs come back in the layer's output space: MHA
``[T, Hq, Dv]``, MLA ``[T, H, v_head_dim]`` (absorbed outputs are up-projected here), linear ``[T, Hv, V]``,
lightning ``[T, H, D]`` (float32, as Bailing's layers compute it), short conv ``[T, 1, hidden]``, Mamba-2 ``[T, H, P]``, KDA ``[T, H, V]``.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.latent import latent_to_heads, latent_to_output, query_to_latent
from batch.case import TORCH_DTYPES
from batch.forward_batch import FP8_KV_DTYPE, ForwardBatch, LayerInputs, LayerWeights, dequantize_kv, quantize_kv
from batch.layers import make_layer, mla_uses_absorbed
from batch.spec import Layer
from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin


def rotate(x: torch.Tensor, fb: ForwardBatch, rotary_dim: int, theta: float,
           mrope_sections: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Apply (m)RoPE to ``x[T, H, rotary_dim]`` from the batch's own positions, in float32.

    ``mrope_sections`` is the model's (its rotary configuration): a batch with ``mrope_positions`` needs it.
    """
    if fb.mrope_positions is not None:
        if mrope_sections is None:
            raise ValueError("the batch carries mrope_positions but the model has no mrope sections")
        cos, sin = mrope_cos_sin(fb.mrope_positions, rotary_dim, mrope_sections, theta=theta, dtype=torch.float32)
    else:
        cos, sin = rope_cos_sin(fb.positions, rotary_dim, theta=theta, dtype=torch.float32)
    return apply_rope(x.float(), cos, sin).to(x.dtype)


def needs_mha_chunk_plan(fb: ForwardBatch, layer_specs) -> bool:
    """An MLA model runs extend batches through the MHA (chunked-prefix) path, which is planned apart."""
    return (any(s.kind == "mla" for s in layer_specs) and not mla_uses_absorbed(fb.forward_mode)
            and not fb.forward_mode.is_idle())


def prepare_batch(backend: Any, fb: ForwardBatch, layer_specs, plan=None) -> None:
    """What the model runner does once per batch before the layers; ``plan(fb)``: how a graph's replay plans the batch
    instead of ``init_forward_metadata`` (engine.graph_runner.PrefillGraphRunner)."""
    (plan or backend.init_forward_metadata)(fb)
    # Serving engines guard this call with hasattr: a wrapper that lacks the method silently skips it.
    if needs_mha_chunk_plan(fb, layer_specs) and hasattr(backend, "init_mha_chunk_metadata"):
        backend.init_mha_chunk_metadata(fb)


def mha_qkv(spec: Layer, inputs: LayerInputs, fb: ForwardBatch, mrope_sections=None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k after RoPE and v, as the backend receives them (k and v are what the cache must hold)."""
    t = inputs.tensors
    q = rotate(t["q"], fb, spec.head_dim, spec.rope_theta, mrope_sections)
    k = rotate(t["k"], fb, spec.head_dim, spec.rope_theta, mrope_sections)
    v = t["v"]
    if fb.token_to_kv_pool.is_fp8(spec.layer_id):
        k, v = on_fp8_grid(k, spec.k_scale), on_fp8_grid(v, spec.v_scale)
    return q, k, v


def on_fp8_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` moved to the nearest value an fp8 cache can hold exactly (``e4m3 * scale``), in x's dtype.

    Under an fp8 KV cache the model hands over K/V already on that grid. Backends legitimately differ in
    whether they attend a batch's new tokens from the call's k/v (SGLang's Triton extend, FlashInfer's ragged
    path) or read them back from the cache they just wrote (TorchNative, FlashInfer's paged paths); on the grid
    both give the same keys, so every correct backend computes one function (properties/tolerances.py).
    """
    return dequantize_kv(quantize_kv(x, FP8_KV_DTYPE, scale), x.dtype, scale)


def mla_latent(spec: Layer, inputs: LayerInputs, fb: ForwardBatch, mrope_sections=None) -> torch.Tensor:
    """The latent row each new token writes to the cache: ``[T, 1, kv_lora_rank + rope]`` (ckv, roped kpe)."""
    t = inputs.tensors
    kpe = rotate(t["kpe"][:, None, :], fb, spec.qk_rope_head_dim, spec.rope_theta, mrope_sections)[:, 0]
    return torch.cat([t["ckv"], kpe], dim=-1)[:, None, :]


def fused_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with the same values, handed over as a model's fused QKV projection hands them: views of one
    ``[T, Hq*D + Hk*D + Hk*Dv]`` buffer (``qkv.split([...], dim=-1)``, then ``.view(-1, heads, dim)`` in
    RadixAttention), so each token's row is strided by the whole width, not by its own."""
    T = q.shape[0]
    fused = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    views, start = [], 0
    for x in (q, k, v):
        width = x.shape[1] * x.shape[2]
        views.append(fused[:, start:start + width].view(x.shape))
        start += width
    return views[0], views[1], views[2]


def run_layer(backend: Any, spec: Layer, inputs: LayerInputs, weights: LayerWeights,
              fb: ForwardBatch, mrope_sections: tuple[int, int, int] | None = None,
              fused_qkv: bool = False) -> torch.Tensor:
    """Run one layer of the model through ``backend``; the output is in the layer's output space. ``fused_qkv``:
    an MHA layer's q, k, v come as views of one buffer (:func:`fused_views`), else each contiguous."""
    layer = make_layer(spec, weights, fb.forward_mode)
    t = inputs.tensors
    if spec.kind in ("linear", "kda"):  # the model's projections: q|k|v, the gates' raw inputs
        return backend.forward(layer=layer, forward_batch=fb, mixed_qkv=t["mixed_qkv"], a=t["a"], b=t["b"])
    if spec.kind == "mha":
        q, k, v = mha_qkv(spec, inputs, fb, mrope_sections)
        if fused_qkv:
            q, k, v = fused_views(q, k, v)
        return backend.forward(q, k, v, layer, fb)
    if spec.kind == "mamba2":  # a Mamba-2 layer: its input projection's output, z, xBC and dt side by side
        return backend.forward(layer=layer, forward_batch=fb, zxbcdt=t["zxbcdt"])
    if spec.kind == "short_conv":  # LFM2's conv layer: its input projection's output, B, C and x side by side
        return backend.forward(layer=layer, forward_batch=fb, bcx=t["bcx"])
    if spec.kind == "lightning":
        # Bailing's linear layer casts its q/k/v projections to float32 and calls its RadixAttention
        # (models/bailing_moe_linear.py, BailingMoELinearAttention.forward): the state and output are float32.
        dtype = TORCH_DTYPES[spec.compute_dtype]
        return backend.forward(t["q"].to(dtype), t["k"].to(dtype), t["v"].to(dtype), layer, fb)
    # MLA
    N, R, C = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    dtype = t["q"].dtype
    q_nope, q_pe = t["q"][..., :N], rotate(t["q"][..., N:], fb, R, spec.rope_theta, mrope_sections)
    latent = mla_latent(spec, inputs, fb, mrope_sections)
    w_kc, w_vc = weights.tensors["w_kc"], weights.tensors["w_vc"]
    if layer.absorbed:
        q_latent = query_to_latent(q_nope, w_kc).to(dtype)
        q_abs = torch.cat([q_latent, q_pe], dim=-1)
        o_latent = backend.forward(q_abs, latent, latent[..., :C], layer, fb)
        return latent_to_output(o_latent, w_vc).to(dtype)
    # Expanded (MHA) path: the model writes the latent itself and hands the backend expanded heads.
    if fb.out_cache_loc.numel():
        fb.token_to_kv_pool.set_kv_buffer(spec.layer_id, fb.out_cache_loc, latent, None)
    k, v = latent_to_heads(latent[:, 0], C, w_kc, w_vc)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return backend.forward(q, k.to(dtype), v.to(dtype), layer, fb, save_kv_cache=False)


def run_layers(backend: Any, fb: ForwardBatch, layer_specs, inputs: list[LayerInputs],
               weights: list[LayerWeights], mrope_sections: tuple[int, int, int] | None = None,
               fused_qkv: bool = False) -> list[torch.Tensor]:
    """Plan the batch, then run every layer; returns one output per layer.

    A batch carrying ``tbo_children`` runs as two-batch overlap does in a model: each child batch, with its
    slice of every per-token input, goes through the wrapper's child backend, and the halves are joined.
    """
    prepare_batch(backend, fb, layer_specs)  # a TBO wrapper plans its children's halves here too
    return [run_layer_overlapped(backend, spec, inp, w, fb, mrope_sections, fused_qkv)
            for spec, inp, w in zip(layer_specs, inputs, weights)]


def run_layer_overlapped(backend: Any, spec: Layer, inputs: LayerInputs, weights: LayerWeights,
                         fb: ForwardBatch, mrope_sections: tuple[int, int, int] | None = None,
                         fused_qkv: bool = False) -> torch.Tensor:
    """:func:`run_layer`, or, for a batch carrying ``tbo_children``, the layer as two-batch overlap runs it:
    each child batch, with its slice of the layer's per-token inputs, through the wrapper's child backend,
    and the halves joined (the eager runner and the CUDA-graph runner alike)."""
    if not fb.tbo_children:
        return run_layer(backend, spec, inputs, weights, fb, mrope_sections, fused_qkv)
    parts, start = [], 0
    for child_fb, child_backend in zip(fb.tbo_children, backend.children):
        end = start + child_fb.extend_num_tokens
        if end > start:  # a half without tokens skips attention, as SGLang's model layers do
            parts.append(run_layer(child_backend, spec, inputs.slice_tokens(start, end), weights, child_fb,
                                   mrope_sections, fused_qkv))
        start = end
    return torch.cat(parts, dim=0) if parts else \
        run_layer(backend, spec, inputs, weights, fb, mrope_sections, fused_qkv)
