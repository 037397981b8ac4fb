"""Linear-attention backend on flash-linear-attention (fla) kernels: the gated delta rule layer with conv and
SSM state pools, as SGLang's hybrid linear-attention backend runs Qwen3-Next style layers.

Semantics are those of :mod:`backends.linear_torch` and ``reference/gdn.py`` (DESIGN.md section 3):
``mixed_qkv [T, 2*Hk*K + Hv*V]`` -> causal depthwise conv1d + SiLU (conv state = the last ``W - 1`` inputs,
oldest first) -> q | k | v -> gated delta rule with L2-normalised q and k, ``g = -exp(A_log) * softplus(a +
dt_bias)``, ``beta = sigmoid(b)``, ``scale = layer.scaling``. A request with ``extend_prefix_lens == 0`` starts
from zero states, any other from its pool slot ``forward_batch.state_slots[i]``; final states go back to that
slot. Output ``[T, Hv, V]`` in ``mixed_qkv``'s dtype.

Kernels:

* conv: ``fla.modules.causal_conv1d.causal_conv1d`` (varlen, ``cu_seqlens``) for extend-like modes and
  ``causal_conv1d_update`` for decode. fla keeps ``W`` columns of conv state where the pool keeps ``W - 1``:
  the kernels read only the last ``W - 1`` columns of the state they are given, so the pool state goes in
  left-padded with a zero column and the last ``W - 1`` columns of fla's final state come back.
* EXTEND, MIXED, DRAFT_EXTEND: ``chunk_gated_delta_rule`` over all requests at once (batch dim 1,
  ``cu_seqlens``), ``initial_state`` gathered from the pool (zeros for fresh requests), ``output_final_state``.
* DECODE: ``fused_recurrent_gated_delta_rule`` with one token per request (the batch dim), every argument
  after ``v`` by keyword (its fifth positional parameter is ``gk``, not ``beta``).
* TARGET_VERIFY (chain trees, D draft tokens each): the conv runs over the D tokens from the pool state and the
  state after each draft position (a window of raw inputs) goes to ``intermediate_conv_states[slot, :D]``; the
  SSM runs ``fused_recurrent_gated_delta_rule`` one position at a time, storing each state in
  ``intermediate_ssm_states[slot, :D]``. The pool's own states are left alone until
  :meth:`FlaBackend.update_mamba_state_after_mtp_verify` commits the last accepted position.

The gating (``g``, ``beta``) is computed in float32 PyTorch, as SGLang's ``fused_gdn_gating`` does in one
Triton kernel.

On the CPU: fla's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported) with
two shims that :func:`install_interpreter_shims` applies only there: (1) Triton's autotuner asks the (absent) GPU
driver for a benchmarker, so on a CPU-only host every config is run once and timed equal; (2) the interpreter
runs a kernel's builtin ``range`` loops with Python ints, and fla's ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``
calls ``.to(tl.int64)`` on its loop variable, so that module's ``range`` yields interpreter tensors (as compiled
Triton's loop variables are). On the GPU nothing is patched. One more CPU-only difference: the interpreter
mis-computes ``chunk_gated_delta_rule`` with bfloat16 inputs (relative error ~1e10, numpy overflow warnings; float16
and float32 are right), so on the CPU bfloat16 q/k/v enter that kernel as float32 (after the conv has rounded
them to bfloat16, as on the GPU).
"""

from __future__ import annotations

import builtins

import torch

from backends.base import SERVING_MODES, AttentionBackend, Capabilities, PlannedMetadata, env_flag
from backends.linear_torch import gating
from backends.planner import exclusive_cumsum
from batch.spec import ForwardMode

_SHIMS_INSTALLED = False


def install_interpreter_shims() -> None:
    """Make fla's kernels run in Triton's CPU interpreter (see the module docstring). Idempotent; call it only
    for CPU tensors under ``TRITON_INTERPRET=1``."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    import triton.language as tl
    from triton.runtime import autotuner

    original = autotuner.Autotuner.__dict__.get("do_bench")
    original_fn = getattr(original, "func", None) or getattr(original, "fget", None)
    if original_fn is not None:
        def do_bench(self):
            """``Autotuner.do_bench`` (a property): the original benchmarker, or :func:`run_once` where asking the
            driver for one fails (no GPU)."""
            try:
                return original_fn(self)
            except RuntimeError:  # "0 active drivers": nothing to time on a CPU-only host
                def run_once(kernel_call, quantiles=None, **kwargs):
                    """Run the config once and report 1.0 (per quantile): every config times equal."""
                    kernel_call()
                    return [1.0] * len(quantiles) if quantiles else 1.0
                return run_once

        autotuner.Autotuner.do_bench = property(do_bench)

    def tensor_range(*args):
        """``range`` yielding int32 interpreter scalars (``tl.full``), as compiled Triton's loop variables are."""
        for i in builtins.range(*(int(a) for a in args)):
            yield tl.full((), i, tl.int32)

    import fla.ops.common.chunk_delta_h as chunk_delta_h

    chunk_delta_h.range = tensor_range
    _SHIMS_INSTALLED = True


def _prepare_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu":
        if not env_flag("TRITON_INTERPRET"):
            raise RuntimeError("FlaBackend on the CPU needs TRITON_INTERPRET=1, set before triton is imported")
        install_interpreter_shims()


def split_qkv(layer, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output ``[..., conv_dim]`` -> q, k ``[..., Hk, K]`` and v ``[..., Hv, V]`` (views)."""
    Hk, Hv, K, V = layer.tp_k_head_num, layer.tp_v_head_num, layer.head_dim, layer.v_head_dim
    qk = Hk * K
    return (y[..., :qk].unflatten(-1, (Hk, K)), y[..., qk:2 * qk].unflatten(-1, (Hk, K)),
            y[..., 2 * qk:2 * qk + Hv * V].unflatten(-1, (Hv, V)))


def padded_conv_state(state: torch.Tensor) -> torch.Tensor:
    """Pool conv state ``[N, C, W-1]`` -> fla's ``[N, C, W]`` (a zero column first; fla reads the last W-1)."""
    return torch.cat([state.new_zeros(state.shape[0], state.shape[1], 1), state], dim=-1).contiguous()


class FlaBackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"linear"}),
        modes=SERVING_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        cuda_graph_modes=frozenset({ForwardMode.DECODE}),  # graph planning (out_graph) for decode batches
        devices=frozenset({"cpu", "cuda"}),
        requires=("fla", "einops", "triton"),  # fla.ops imports einops
        cpu_needs_env="TRITON_INTERPRET",
        fp32_matmul_roundoff=2.0**-10,  # fla's chunk kernels run float32 dots as Triton's TF32 (truncated operands)
        # chunk_gated_delta_rule walks each request's new tokens in chunks of 64 (BT): one chunk, two, three.
        length_boundaries=frozenset({64, 128}),
    )

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.forward_metadata: PlannedMetadata | None = None
        self.mamba_pool = None
        self.req_to_state_slot: torch.Tensor | None = None

    # ---- planning ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan ``qo_indptr[B+1]`` int32 (the kernels' ``cu_seqlens``) and ``state_slots[B]`` int64, and keep
        the batch's mamba pool and ``req_to_state_slot`` (for the verify commit and graph planning)."""
        fb = forward_batch
        qo = (torch.zeros(1, dtype=torch.int32, device=fb.device) if fb.forward_mode.is_idle()
              else exclusive_cumsum(fb.extend_seq_lens))
        self.forward_metadata = PlannedMetadata(qo_indptr=qo, state_slots=fb.state_slots.clone())
        self.mamba_pool = fb.mamba_pool
        self.req_to_state_slot = fb.req_to_state_slot

    def planned_metadata(self) -> PlannedMetadata:
        """``qo_indptr`` and ``state_slots`` only (linear layers read no KV cache)."""
        return self.forward_metadata

    # ---- per layer ----
    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, *,
                mixed_qkv=None, a=None, b=None, **kwargs):
        """mixed_qkv ``[T, conv_dim]``, a, b ``[T, Hv]`` -> o ``[T, Hv, V]`` in mixed_qkv's dtype."""
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_idle() or mixed_qkv.shape[0] == 0:
            return mixed_qkv.new_empty(0, layer.tp_v_head_num, layer.v_head_dim)
        _prepare_device(mixed_qkv)
        with torch.no_grad():
            if mode.is_decode():
                return self._decode(layer, fb, mixed_qkv, a, b)
            if mode.is_target_verify():
                return self._verify(layer, fb, mixed_qkv, a, b)
            return self._extend(layer, fb, mixed_qkv, a, b)

    def forward_extend(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kwargs):
        """:meth:`forward`, which serves every mode."""
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kwargs):
        """:meth:`forward`, which serves every mode."""
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _pools(self, layer, fb):
        pool = fb.mamba_pool
        return pool, pool.conv_states[layer.layer_id], pool.ssm_states[layer.layer_id]

    def _extend(self, layer, fb, mixed_qkv, a, b):
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        _, conv_pool, ssm_pool = self._pools(layer, fb)
        meta = self.forward_metadata
        slots = meta.state_slots
        cu_seqlens = meta.qo_indptr.to(torch.int64)
        has_state = torch.tensor([p > 0 for p in fb.extend_prefix_lens_cpu], dtype=torch.bool,
                                 device=mixed_qkv.device)
        conv0 = torch.where(has_state[:, None, None], conv_pool[slots], torch.zeros_like(conv_pool[slots]))
        ssm0 = torch.where(has_state[:, None, None, None], ssm_pool[slots], torch.zeros_like(ssm_pool[slots]))
        y, conv_final = causal_conv1d(x=mixed_qkv[None].contiguous(), weight=layer.weights["conv_weight"].contiguous(),
                                      initial_state=padded_conv_state(conv0.to(mixed_qkv.dtype)),
                                      output_final_state=True, activation="silu", cu_seqlens=cu_seqlens)
        q, k, v = split_qkv(layer, y)
        if y.device.type == "cpu" and y.dtype == torch.bfloat16:
            q, k, v = q.float(), k.float(), v.float()  # the interpreter mis-computes this kernel in bf16
        g, beta = gating(layer, a, b)
        o, ssm_final = chunk_gated_delta_rule(q, k, v, g[None], beta[None], scale=layer.scaling,
                                              initial_state=ssm0.float().contiguous(), output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        conv_pool[slots] = conv_final[..., 1:].to(conv_pool.dtype)
        ssm_pool[slots] = ssm_final.to(ssm_pool.dtype)
        return o[0].to(mixed_qkv.dtype)

    def _decode(self, layer, fb, mixed_qkv, a, b):
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        _, conv_pool, ssm_pool = self._pools(layer, fb)
        slots = self.forward_metadata.state_slots
        cache = padded_conv_state(conv_pool[slots].to(mixed_qkv.dtype))
        y, cache = causal_conv1d_update(x=mixed_qkv.contiguous(), cache=cache,
                                        weight=layer.weights["conv_weight"].contiguous(), activation="silu")
        q, k, v = split_qkv(layer, y[:, None, :])  # [B, 1, ...]: one token per request
        g, beta = gating(layer, a, b)
        o, ssm_final = fused_recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g[:, None], beta=beta[:, None], scale=layer.scaling,
            initial_state=ssm_pool[slots].float().contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        conv_pool[slots] = cache[..., 1:].to(conv_pool.dtype)
        ssm_pool[slots] = ssm_final.to(ssm_pool.dtype)
        return o[:, 0].to(mixed_qkv.dtype)

    def _verify(self, layer, fb, mixed_qkv, a, b):
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        pool, conv_pool, ssm_pool = self._pools(layer, fb)
        meta = self.forward_metadata
        slots = meta.state_slots
        B, D = fb.batch_size, fb.spec_info.draft_token_num
        C, W1 = conv_pool.shape[1], conv_pool.shape[2]
        state = conv_pool[slots].to(mixed_qkv.dtype)  # [B, C, W-1]
        y, _ = causal_conv1d(x=mixed_qkv[None].contiguous(), weight=layer.weights["conv_weight"].contiguous(),
                             initial_state=padded_conv_state(state), output_final_state=False, activation="silu",
                             cu_seqlens=meta.qo_indptr.to(torch.int64))
        # Conv state after draft position d: the W-1 inputs ending at d (state then drafts, oldest first).
        xpad = torch.cat([state, mixed_qkv.view(B, D, C).transpose(1, 2)], dim=2)  # [B, C, W-1+D]
        steps = xpad.unfold(2, W1, 1)[:, :, 1:]  # [B, C, D, W-1]
        inter_conv = pool.intermediate_conv_states[layer.layer_id]
        inter_conv[slots, :D] = steps.permute(0, 2, 1, 3).to(inter_conv.dtype)

        q, k, v = split_qkv(layer, y[0].view(B, D, -1))
        g, beta = gating(layer, a, b)
        g, beta = g.view(B, D, -1), beta.view(B, D, -1)
        ssm = ssm_pool[slots].float().contiguous()
        inter_ssm = pool.intermediate_ssm_states[layer.layer_id]
        outs = []
        for d in range(D):
            o_d, ssm = fused_recurrent_gated_delta_rule(
                q=q[:, d:d + 1], k=k[:, d:d + 1], v=v[:, d:d + 1], g=g[:, d:d + 1], beta=beta[:, d:d + 1],
                scale=layer.scaling, initial_state=ssm, output_final_state=True, use_qk_l2norm_in_kernel=True)
            inter_ssm[slots, d] = ssm.to(inter_ssm.dtype)
            outs.append(o_d)
        return torch.cat(outs, dim=1).reshape(B * D, layer.tp_v_head_num, layer.v_head_dim).to(mixed_qkv.dtype)

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices: torch.Tensor,
                                            mamba_track_indices: torch.Tensor | None = None,
                                            mamba_steps_to_track: torch.Tensor | None = None, model=None,
                                            req_pool_indices: torch.Tensor | None = None) -> None:
        """Commit the verified states, as :meth:`backends.linear_torch.LinearTorchBackend.update_mamba_state_after_mtp_verify`
        (SGLang's signature): request ``i``'s slot gets the states after draft position
        ``last_correct_step_indices[i]``; tracked copies go to ``mamba_track_indices`` where
        ``mamba_steps_to_track >= 0``. Only the first ``len(last_correct_step_indices)`` planned rows are real (a
        CUDA-graph plan pads)."""
        pool = self.mamba_pool
        steps = last_correct_step_indices.to(device=self.forward_metadata.state_slots.device, dtype=torch.int64)
        slots = self.forward_metadata.state_slots[:steps.numel()]
        src, dst = slots, slots
        if mamba_track_indices is not None:
            tracked = mamba_steps_to_track.to(steps.device, torch.int64) >= 0
            src = torch.cat([slots, slots[tracked]])
            dst = torch.cat([slots, mamba_track_indices.to(steps.device, torch.int64)[tracked]])
            steps = torch.cat([steps, mamba_steps_to_track.to(steps.device, torch.int64)[tracked]])
        for layer_id, inter_ssm in pool.intermediate_ssm_states.items():
            pool.ssm_states[layer_id][dst] = inter_ssm[src, steps].to(pool.ssm_states[layer_id].dtype)
            inter_conv = pool.intermediate_conv_states[layer_id]
            pool.conv_states[layer_id][dst] = inter_conv[src, steps].to(pool.conv_states[layer_id].dtype)

    # ---- CUDA graphs: fla's kernels plan on the host (cu_seqlens, chunk indices), so linear layers run eagerly
    # between captured segments; out_graph plans the padded batch's state slots from the request rows ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate: linear layers run eagerly between captured segments."""
        return None

    def _plan_graph(self, bs: int, req_pool_indices: torch.Tensor) -> None:
        table = self.model_runner.req_to_state_slot if self.model_runner is not None else self.req_to_state_slot
        if table is None:
            raise RuntimeError("FlaBackend needs req_to_state_slot to plan CUDA-graph batches: build it with a "
                               "model_runner or run init_forward_metadata first")
        slots = table[req_pool_indices[:bs]]
        qo = torch.arange(bs + 1, dtype=torch.int32, device=slots.device)
        self.forward_metadata = PlannedMetadata(qo_indptr=qo, state_slots=slots)
        if self.model_runner is not None:
            self.mamba_pool = self.model_runner.mamba_pool

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Graph planning (decode), at capture and before every replay alike: the padded batch's state slots
        from its request rows. Eager batches plan in init_forward_metadata."""
        self._plan_graph(forward_batch.batch_size, forward_batch.req_pool_indices)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1 (linear layers do not read ``seq_lens``)."""
        return 1

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the plan (state slots) does not depend on the draft tree."""
        return None
