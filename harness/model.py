"""The slice of a model that surrounds attention: layer objects, RoPE, MLA projections, the layer loop.

This is the caller's side of the protocol, written the way a serving engine's model code calls a backend,
so that wrapper bugs (a missing ``forward``, a skipped ``init_mha_chunk_metadata``, dispatch by type) show
up here exactly as they would in a model. Backend outputs come back in the layer's output space: MHA
``[T, Hq, Dv]``, MLA ``[T, H, v_head_dim]`` (absorbed outputs are up-projected here), linear ``[T, Hv, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.forward_batch import ForwardBatch, LayerInputs, LayerWeights
from harness.spec import ForwardMode, Layer
from reference import mla as ref_mla
from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin


@dataclass
class AttentionLayer:
    """What a backend receives as ``layer`` (SGLang's RadixAttention, or the linear-attention module).

    Every kind uses this one class on purpose: a wrapper must dispatch by ``layer_id``, never by type.
    """

    layer_id: int
    kind: str
    tp_q_head_num: int
    tp_k_head_num: int
    tp_v_head_num: int
    head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    spec: Layer | None = None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    absorbed: bool = False  # MLA: latent (absorbed) form rather than expanded heads

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim


def mla_uses_absorbed(mode: ForwardMode) -> bool:
    """MLA decode, verify and draft-extend run absorbed over the latent cache; extend runs expanded (MHA)."""
    return mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


def make_layer(spec: Layer, weights: LayerWeights, mode: ForwardMode) -> AttentionLayer:
    if spec.kind == "mha":
        return AttentionLayer(spec.layer_id, "mha", spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads,
                              spec.head_dim, spec.v_head_dim, spec.sm_scale,
                              logit_cap=spec.logit_cap or 0.0,
                              sliding_window_size=-1 if spec.sliding_window is None else spec.sliding_window,
                              spec=spec)
    if spec.kind == "mla":
        C, R = spec.kv_lora_rank, spec.qk_rope_head_dim
        if mla_uses_absorbed(mode):
            return AttentionLayer(spec.layer_id, "mla", spec.num_heads, 1, 1, C + R, C, spec.sm_scale,
                                  spec=spec, weights=weights.tensors, absorbed=True)
        return AttentionLayer(spec.layer_id, "mla", spec.num_heads, spec.num_heads, spec.num_heads,
                              spec.qk_nope_head_dim + R, spec.v_head_dim, spec.sm_scale,
                              spec=spec, weights=weights.tensors, absorbed=False)
    return AttentionLayer(spec.layer_id, "linear", spec.num_v_heads, spec.num_k_heads, spec.num_v_heads,
                          spec.head_k_dim, spec.head_v_dim, spec.scale, spec=spec, weights=weights.tensors)


def rotate(x: torch.Tensor, fb: ForwardBatch, rotary_dim: int, theta: float) -> torch.Tensor:
    """Apply (m)RoPE to ``x[T, H, rotary_dim]`` from the batch's own positions, in float32."""
    if fb.mrope_positions is not None:
        sections = fb.spec.mrope.sections
        cos, sin = mrope_cos_sin(fb.mrope_positions, rotary_dim, sections, theta=theta, dtype=torch.float32)
    else:
        cos, sin = rope_cos_sin(fb.positions, rotary_dim, theta=theta, dtype=torch.float32)
    return apply_rope(x.float(), cos, sin).to(x.dtype)


def needs_mha_chunk_plan(fb: ForwardBatch) -> bool:
    spec = fb.spec
    return (spec is not None and "mla" in spec.attention_kinds and not mla_uses_absorbed(fb.forward_mode)
            and not fb.forward_mode.is_idle())


def prepare_batch(backend: Any, fb: ForwardBatch) -> None:
    """What the model runner does once per batch before the layers."""
    backend.init_forward_metadata(fb)
    # Serving engines guard this call with hasattr: a wrapper that lacks the method silently skips it.
    if needs_mha_chunk_plan(fb) and hasattr(backend, "init_mha_chunk_metadata"):
        backend.init_mha_chunk_metadata(fb)


def mha_qkv(spec: Layer, inputs: LayerInputs, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k after RoPE and v, as the backend receives them (k and v are what the cache must hold)."""
    t = inputs.tensors
    return (rotate(t["q"], fb, spec.head_dim, spec.rope_theta), rotate(t["k"], fb, spec.head_dim, spec.rope_theta),
            t["v"])


def mla_latent(spec: Layer, inputs: LayerInputs, fb: ForwardBatch) -> torch.Tensor:
    """The latent row each new token writes to the cache: ``[T, 1, kv_lora_rank + rope]`` (ckv, roped kpe)."""
    t = inputs.tensors
    kpe = rotate(t["kpe"][:, None, :], fb, spec.qk_rope_head_dim, spec.rope_theta)[:, 0]
    return torch.cat([t["ckv"], kpe], dim=-1)[:, None, :]


def run_layer(backend: Any, spec: Layer, inputs: LayerInputs, weights: LayerWeights,
              fb: ForwardBatch) -> torch.Tensor:
    layer = make_layer(spec, weights, fb.forward_mode)
    t = inputs.tensors
    if spec.kind == "linear":
        return backend.forward(layer=layer, forward_batch=fb, mixed_qkv=t["mixed_qkv"], a=t["a"], b=t["b"])
    if spec.kind == "mha":
        q, k, v = mha_qkv(spec, inputs, fb)
        return backend.forward(q, k, v, layer, fb)
    # MLA
    N, R, C = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    dtype = t["q"].dtype
    q_nope, q_pe = t["q"][..., :N], rotate(t["q"][..., N:], fb, R, spec.rope_theta)
    latent = mla_latent(spec, inputs, fb)
    w_kc, w_vc = weights.tensors["w_kc"], weights.tensors["w_vc"]
    if layer.absorbed:
        q_latent = ref_mla.absorb_query(q_nope.float(), w_kc).to(dtype)
        q_abs = torch.cat([q_latent, q_pe], dim=-1)
        o_latent = backend.forward(q_abs, latent, latent[..., :C], layer, fb)
        return torch.einsum("thc,hcv->thv", o_latent.float(), w_vc).to(dtype)
    # Expanded (MHA) path: the model writes the latent itself and hands the backend expanded heads.
    if fb.out_cache_loc.numel():
        fb.token_to_kv_pool.set_kv_buffer(spec.layer_id, fb.out_cache_loc, latent, None)
    k, v = ref_mla.expand_kv(latent[:, 0, :C].float(), latent[:, 0, C:].float(), w_kc, w_vc)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return backend.forward(q, k.to(dtype), v.to(dtype), layer, fb, save_kv_cache=False)


def run_layers(backend: Any, fb: ForwardBatch, layer_specs, inputs: list[LayerInputs],
               weights: list[LayerWeights]) -> list[torch.Tensor]:
    """Plan the batch, then run every layer; returns one output per layer.

    A batch carrying ``tbo_children`` runs as two-batch overlap does in a model: each child batch, with its
    slice of every per-token input, goes through the wrapper's child backend, and the halves are joined.
    """
    prepare_batch(backend, fb)  # a TBO wrapper plans its children's halves here too
    if fb.tbo_children:
        children = backend.children
        outs = []
        for spec, inp, w in zip(layer_specs, inputs, weights):
            parts, start = [], 0
            for child_fb, child_backend in zip(fb.tbo_children, children):
                end = start + child_fb.extend_num_tokens
                parts.append(run_layer(child_backend, spec, inp.slice_tokens(start, end), w, child_fb))
                start = end
            outs.append(torch.cat(parts, dim=0))
        return outs
    return [run_layer(backend, spec, inp, w, fb) for spec, inp, w in zip(layer_specs, inputs, weights)]
