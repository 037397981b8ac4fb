"""What a backend receives as ``layer``: the attention layer object of a model (DESIGN.md section 3).

SGLang passes its ``RadixAttention`` (or its linear-attention module); this is the same surface, made from
a layer specification. The form of an MLA layer depends on the mode: absorbed over the latent cache for
decode, verify and draft-extend, expanded heads for extend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batch.forward_batch import LayerWeights
from batch.spec import ForwardMode, Layer


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
    # An fp8 KV cache holds k / k_scale and v / v_scale (SGLang's RadixAttention.k_scale / v_scale); 1 otherwise.
    k_scale: float = 1.0
    v_scale: float = 1.0
    spec: Layer | None = None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    absorbed: bool = False  # MLA: latent (absorbed) form rather than expanded heads


def mla_uses_absorbed(mode: ForwardMode) -> bool:
    """MLA decode, verify, draft-extend and the draft loop's steps (each a decode) run absorbed over the latent cache;
    extend runs expanded (MHA)."""
    return mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE)


def make_layer(spec: Layer, weights: LayerWeights, mode: ForwardMode) -> AttentionLayer:
    if spec.kind == "mha":
        return AttentionLayer(spec.layer_id, "mha", spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads,
                              spec.head_dim, spec.v_head_dim, spec.sm_scale,
                              logit_cap=spec.logit_cap or 0.0,
                              sliding_window_size=-1 if spec.sliding_window is None else spec.sliding_window,
                              k_scale=spec.k_scale, v_scale=spec.v_scale, spec=spec)
    if spec.kind == "mla":
        C, R = spec.kv_lora_rank, spec.qk_rope_head_dim
        if mla_uses_absorbed(mode):
            return AttentionLayer(spec.layer_id, "mla", spec.num_heads, 1, 1, C + R, C, spec.sm_scale,
                                  spec=spec, weights=weights.tensors, absorbed=True)
        return AttentionLayer(spec.layer_id, "mla", spec.num_heads, spec.num_heads, spec.num_heads,
                              spec.qk_nope_head_dim + R, spec.v_head_dim, spec.sm_scale,
                              spec=spec, weights=weights.tensors, absorbed=False)
    if spec.kind == "lightning":  # Bailing's linear layers are plain RadixAttention objects of H heads
        return AttentionLayer(spec.layer_id, "lightning", spec.num_heads, spec.num_heads, spec.num_heads,
                              spec.head_dim, spec.head_dim, spec.scale, spec=spec)
    if spec.kind == "kda":  # as SGLang's RadixLinearAttention for it: q, k and v heads alike
        return AttentionLayer(spec.layer_id, "kda", spec.num_heads, spec.num_heads, spec.num_heads, spec.head_k_dim,
                              spec.head_v_dim, spec.scale, spec=spec, weights=weights.tensors)
    if spec.kind == "mamba2":  # its heads: the output [T, H, P] before the output projection
        return AttentionLayer(spec.layer_id, "mamba2", spec.num_heads, spec.n_groups, spec.num_heads, spec.state_size,
                              spec.head_dim, 1.0, spec=spec, weights=weights.tensors)
    if spec.kind == "short_conv":  # one "head" over the hidden size: LFM2's conv layers have no heads
        return AttentionLayer(spec.layer_id, "short_conv", 1, 1, 1, spec.hidden, spec.hidden, 1.0, spec=spec,
                              weights=weights.tensors)
    return AttentionLayer(spec.layer_id, "linear", spec.num_v_heads, spec.num_k_heads, spec.num_v_heads,
                          spec.head_k_dim, spec.head_v_dim, spec.scale, spec=spec, weights=weights.tensors)
