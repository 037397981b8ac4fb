"""Linear-attention backend in PyTorch: the gated delta rule layer with conv and SSM state pools.

The CPU twin of the fla backend, written independently of ``reference/gdn.py`` (batched decode, conv1d
through ``torch.nn.functional.conv1d``, float32 state arithmetic) so that comparing the two means something.
Semantics (DESIGN.md section 3): a request with no prefix starts from zero states, others from its pool
slot; final states go back to the slot; TARGET_VERIFY keeps the state after each draft position in the
intermediate pools and leaves the committed states alone until ``update_mamba_state_after_mtp_verify``
commits the accepted position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.base import SERVING_MODES, AttentionBackend, Capabilities, PlannedMetadata
from backends.planner import exclusive_cumsum
from batch.spec import ForwardMode

L2NORM_EPS = 1e-6  # as fla's l2norm: x * rsqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, as fla's l2norm; ``x``'s shape and dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def conv_with_state(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU for one sequence: x ``[T, C]``, weight ``[C, W]``, state ``[C, W-1]``.

    Returns y ``[T, C]`` and the states after each token ``[T, C, W-1]`` (last one = final state).
    """
    W = weight.shape[1]
    xpad = torch.cat([state, x.t()], dim=1)  # [C, W-1+T]
    y = F.conv1d(xpad[None], weight[:, None, :], groups=weight.shape[0])[0].t()
    steps = xpad.unfold(1, W - 1, 1)[:, 1:]  # window ending at each token: [C, T, W-1]
    return F.silu(y), steps.permute(1, 0, 2)


def split_heads(layer, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split conv output ``[T, conv_dim]`` into q, k ``[T, Hk, K]`` and v ``[T, Hv, V]``."""
    s = layer.spec
    qk = s.num_k_heads * s.head_k_dim
    q = y[:, :qk].reshape(-1, s.num_k_heads, s.head_k_dim)
    k = y[:, qk:2 * qk].reshape(-1, s.num_k_heads, s.head_k_dim)
    v = y[:, 2 * qk:].reshape(-1, s.num_v_heads, s.head_v_dim)
    return q, k, v


def gating(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [T, Hv]`` -> ``g`` (log-decay ``-exp(A_log) * softplus(a + dt_bias)``) and ``beta = sigmoid(b)``,
    float32 ``[T, Hv]``."""
    w = layer.weights
    g = -torch.exp(w["A_log"].float()) * F.softplus(a.float() + w["dt_bias"].float())
    return g, torch.sigmoid(b.float())


def delta_rule_steps(q, k, v, g, beta, state, scale):
    """Recurrence over T tokens for one request, float32. q, k ``[T, Hk, K]``; v ``[T, Hv, V]``;
    g, beta ``[T, Hv]``; state ``[Hv, K, V]``. Returns o ``[T, Hv, V]`` and states ``[T, Hv, K, V]``."""
    group = v.shape[1] // q.shape[1]
    q = l2norm(q.float()).repeat_interleave(group, dim=1)
    k = l2norm(k.float()).repeat_interleave(group, dim=1)
    v = v.float()
    outs, states = [], []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
        states.append(state)
    if not outs:
        return v.new_zeros(0, v.shape[1], v.shape[2]), state[None][:0]
    return torch.stack(outs), torch.stack(states)


class LinearTorchBackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"linear"}),
        modes=SERVING_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16", "float64"}),
        # Graph planning (out_graph) for these; its kernels run eagerly between captured segments (piecewise).
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                    ForwardMode.IDLE}),
    )

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.forward_metadata: PlannedMetadata | None = None
        self._fb = None

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan ``qo_indptr[B+1]`` int32 and the requests' ``state_slots[B]`` int64 (no KV plan: linear layers
        read no KV cache), and keep the batch for :meth:`update_mamba_state_after_mtp_verify`."""
        fb = forward_batch
        qo = exclusive_cumsum(fb.extend_seq_lens) if not fb.forward_mode.is_idle() else \
            torch.zeros(1, dtype=torch.int32, device=fb.device)
        self.forward_metadata = PlannedMetadata(qo_indptr=qo, state_slots=fb.state_slots.clone())
        self._fb = fb

    def planned_metadata(self) -> PlannedMetadata:
        """``qo_indptr`` and ``state_slots`` only."""
        return self.forward_metadata

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, *,
                mixed_qkv=None, a=None, b=None, **kwargs):
        """mixed_qkv ``[T, conv_dim]``, a, b ``[T, Hv]`` -> o ``[T, Hv, V]`` in mixed_qkv's dtype."""
        fb = forward_batch
        s = layer.spec
        if fb.forward_mode.is_idle():
            return mixed_qkv.new_empty(0, s.num_v_heads, s.head_v_dim)
        pool = fb.mamba_pool
        conv_pool, ssm_pool = pool.conv_states[layer.layer_id], pool.ssm_states[layer.layer_id]
        verify = fb.forward_mode.is_target_verify()
        # Decode and verify always continue a cached sequence; extend-like modes may start fresh.
        has_state = [True] * fb.batch_size if (fb.forward_mode.is_decode() or verify) else \
            [p > 0 for p in fb.extend_prefix_lens_cpu]
        qo = self.forward_metadata.qo_indptr.tolist()
        slots = self.forward_metadata.state_slots.tolist()
        g, beta = gating(layer, a, b)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], s.num_v_heads, s.head_v_dim)
        weight = layer.weights["conv_weight"].float()
        for i, slot in enumerate(slots):
            rows = slice(qo[i], qo[i + 1])
            conv0 = conv_pool[slot].float() if has_state[i] else torch.zeros_like(conv_pool[slot], dtype=torch.float32)
            ssm0 = ssm_pool[slot].float() if has_state[i] else torch.zeros_like(ssm_pool[slot], dtype=torch.float32)
            y, conv_steps = conv_with_state(mixed_qkv[rows].float(), weight, conv0)
            qh, kh, vh = split_heads(layer, y)
            o, ssm_steps = delta_rule_steps(qh, kh, vh, g[rows], beta[rows], ssm0, layer.scaling)
            out[rows] = o.to(out.dtype)
            if verify:
                n = qo[i + 1] - qo[i]
                pool.intermediate_conv_states[layer.layer_id][slot, :n] = conv_steps.to(conv_pool.dtype)
                pool.intermediate_ssm_states[layer.layer_id][slot, :n] = ssm_steps.to(ssm_pool.dtype)
            else:
                conv_pool[slot] = conv_steps[-1].to(conv_pool.dtype)
                ssm_pool[slot] = ssm_steps[-1].to(ssm_pool.dtype)
        return out

    def forward_extend(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kwargs):
        """:meth:`forward`, which serves every mode."""
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kwargs):
        """:meth:`forward`, which serves every mode."""
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices: torch.Tensor,
                                            mamba_track_indices: torch.Tensor | None = None,
                                            mamba_steps_to_track: torch.Tensor | None = None, model=None,
                                            req_pool_indices: torch.Tensor | None = None) -> None:
        """Commit the verified states (SGLang's ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``).

        Request ``i`` (the first ``len(last_correct_step_indices)`` rows of the last plan; a CUDA-graph plan has
        padding rows after them) gets, in its own slot, the states after draft position
        ``last_correct_step_indices[i]`` (0-based: the accept length minus one). With ``mamba_track_indices``, the
        states after position ``mamba_steps_to_track[i]`` also go to slot ``mamba_track_indices[i]`` (the radix
        cache's tracked copy), unless that step is -1.
        """
        pool = self._fb.mamba_pool
        steps = last_correct_step_indices.tolist()
        slots = self.forward_metadata.state_slots.tolist()[:len(steps)]
        copies = list(zip(slots, slots, steps))
        if mamba_track_indices is not None:
            copies += [(src, dst, step) for src, dst, step in
                       zip(slots, mamba_track_indices.tolist(), mamba_steps_to_track.tolist()) if step >= 0]
        for layer_id in pool.ssm_states:
            for src, dst, step in copies:
                pool.ssm_states[layer_id][dst] = pool.intermediate_ssm_states[layer_id][src, step]
                pool.conv_states[layer_id][dst] = pool.intermediate_conv_states[layer_id][src, step]

    # ---- CUDA graphs: the kernels plan on the host, so they run eagerly between captured segments;
    # init_forward_metadata_out_graph plans the padded batch from the request rows like any other batch ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate: graph batches plan their state slots from the request rows (out_graph)."""
        return None

    def _plan_graph(self, fb) -> None:
        width = 1 if fb.forward_mode.is_decode() else fb.spec_info.draft_token_num
        bs = fb.batch_size
        slots = self.model_runner.req_to_state_slot[fb.req_pool_indices[:bs]]
        qo = torch.arange(bs + 1, dtype=torch.int32, device=slots.device) * width
        self.forward_metadata = PlannedMetadata(qo_indptr=qo, state_slots=slots)
        self._fb = fb

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Graph planning, at capture and before every replay alike: the padded batch's state slots from its
        request rows, and its fixed number of tokens per request (1 in decode, the draft token count in verify
        and draft extend). Eager batches plan in init_forward_metadata."""
        if forward_batch.forward_mode not in self.capabilities.cuda_graph_modes or forward_batch.forward_mode.is_idle():
            raise NotImplementedError(f"linear_torch plans no {forward_batch.forward_mode.value} graph")
        self._plan_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1 (linear layers do not read ``seq_lens``)."""
        return 1

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the plan (state slots) does not depend on the draft tree."""
        return None
