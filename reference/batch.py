"""The reference over a whole materialized batch: one dense computation per request, in float64.

It reads only the pure specification (lengths, positions, trees), the pool snapshots taken before the
forward, the token slots, and the layer inputs; never the backend's metadata nor ``forward_batch.positions``,
so a wrong position, slot or split on the backend side shows up as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.materialize import Case, tree_mask
from reference import gdn, mha, mla
from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin


@dataclass
class LinearStates:
    """Expected linear-attention states of one layer for each request (float64).

    ``conv[i]`` ``[conv_dim, W-1]`` and ``ssm[i]`` ``[Hv, K, V]`` are the final states; in TARGET_VERIFY
    ``conv_steps[i]`` ``[D, conv_dim, W-1]`` and ``ssm_steps[i]`` ``[D, Hv, K, V]`` hold the state after
    each draft position.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    conv_steps: list[torch.Tensor] | None = None
    ssm_steps: list[torch.Tensor] | None = None


@dataclass
class ReferenceResult:
    outputs: list[torch.Tensor]  # one per layer, [T, H, Dv] in the reference dtype
    linear_states: dict[int, LinearStates]  # by layer id


def _rope(x: torch.Tensor, case: Case, rows: slice, rotary_dim: int, theta: float) -> torch.Tensor:
    spec = case.spec
    if spec.mrope is not None:
        pos = torch.tensor(spec.mrope_positions(), dtype=torch.int64)[:, rows]
        cos, sin = mrope_cos_sin(pos, rotary_dim, spec.mrope.sections, theta=theta, dtype=x.dtype)
    else:
        pos = torch.tensor(spec.positions(), dtype=torch.int64)[rows]
        cos, sin = rope_cos_sin(pos, rotary_dim, theta=theta, dtype=x.dtype)
    return apply_rope(x, cos.to(x.device), sin.to(x.device))


def _mask(case: Case, i: int) -> torch.Tensor | None:
    """Explicit [Lq, Lk] mask for verification; None means 'causal, aligned to the end'."""
    spec = case.spec
    if not spec.mode.is_target_verify():
        return None
    tree = tree_mask(spec.spec.parents[i])
    return torch.cat([torch.ones(tree.shape[0], spec.prefix_lens[i], dtype=torch.bool), tree], dim=1)


def reference_outputs(case: Case, dtype: torch.dtype = torch.float64) -> ReferenceResult:
    spec = case.spec
    outputs: list[torch.Tensor] = []
    linear_states: dict[int, LinearStates] = {}
    starts = [0]
    for e in spec.extend_lens:
        starts.append(starts[-1] + e)
    for layer, inp, w in zip(spec.layers, case.inputs, case.weights):
        t = {n: x.to(dtype) for n, x in inp.tensors.items()}
        wt = {n: x.to(dtype) for n, x in w.tensors.items()}
        per_request: list[torch.Tensor] = []
        states = LinearStates([], [], [] if spec.mode.is_target_verify() else None,
                              [] if spec.mode.is_target_verify() else None)
        for i in range(spec.batch_size):
            rows = slice(starts[i], starts[i + 1])
            prefix = spec.prefix_lens[i]
            prefix_slots = case.token_slots[i][:prefix].to(case.device)
            mask = _mask(case, i)
            causal = mask is None
            if layer.kind == "mha":
                q = _rope(t["q"][rows], case, rows, layer.head_dim, layer.rope_theta)
                k_new = _rope(t["k"][rows], case, rows, layer.head_dim, layer.rope_theta)
                k = torch.cat([case.kv_pool_before.k_buffers[layer.layer_id][prefix_slots].to(dtype), k_new])
                v = torch.cat([case.kv_pool_before.v_buffers[layer.layer_id][prefix_slots].to(dtype), t["v"][rows]])
                per_request.append(mha.attention(q, k, v, sm_scale=layer.sm_scale, causal=causal, mask=mask,
                                                 sliding_window=layer.sliding_window, logit_cap=layer.logit_cap))
            elif layer.kind == "mla":
                N, R, C = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank
                q = t["q"][rows]
                q_pe = _rope(q[..., N:], case, rows, R, layer.rope_theta)
                kpe_new = _rope(t["kpe"][rows][:, None, :], case, rows, R, layer.rope_theta)[:, 0]
                cached = case.kv_pool_before.k_buffers[layer.layer_id][prefix_slots, 0].to(dtype)
                ckv = torch.cat([cached[:, :C], t["ckv"][rows]])
                kpe = torch.cat([cached[:, C:], kpe_new])
                per_request.append(mla.attention_absorbed(q[..., :N], q_pe, ckv, kpe, wt["w_kc"], wt["w_vc"],
                                                          sm_scale=layer.sm_scale, causal=causal, mask=mask))
            else:
                slot = int(case.forward_batch.state_slots[i])
                mp = case.mamba_pool_before
                has_state = prefix > 0
                res = gdn.linear_attention_layer(
                    t["mixed_qkv"][rows], t["a"][rows], t["b"][rows],
                    conv_weight=wt["conv_weight"], A_log=wt["A_log"], dt_bias=wt["dt_bias"],
                    num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads,
                    head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, scale=layer.scale,
                    conv_state=mp.conv_states[layer.layer_id][slot].to(dtype) if has_state else None,
                    ssm_state=mp.ssm_states[layer.layer_id][slot].to(dtype) if has_state else None,
                    keep_states=spec.mode.is_target_verify())
                per_request.append(res.o)
                states.conv.append(res.conv_state)
                states.ssm.append(res.ssm_state)
                if spec.mode.is_target_verify():
                    states.conv_steps.append(res.conv_states)
                    states.ssm_steps.append(res.ssm_states)
        if layer.kind == "linear":
            linear_states[layer.layer_id] = states
        outputs.append(torch.cat(per_request) if per_request else _empty(layer, dtype, case.device))
    return ReferenceResult(outputs, linear_states)


def _empty(layer, dtype, device) -> torch.Tensor:
    if layer.kind == "mha":
        return torch.zeros(0, layer.num_q_heads, layer.v_head_dim, dtype=dtype, device=device)
    if layer.kind == "mla":
        return torch.zeros(0, layer.num_heads, layer.v_head_dim, dtype=dtype, device=device)
    return torch.zeros(0, layer.num_v_heads, layer.head_v_dim, dtype=dtype, device=device)
