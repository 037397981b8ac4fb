"""The model's side of an SGLang MLA backend's call, as SGLang's DeepSeek attention makes it
(``models/deepseek_common/``; :class:`DeepseekMla`), and the MLA leaves driven that way without FlashInfer (SGLang's
Triton backend over an MLA model). FlashInfer's MLA leaves (backends/sglang/flashinfer.py) are driven the same way.

Per batch a leaf asks SGLang's own dispatcher for its backend (``handle_attention_flashinfer``,
``handle_attention_flashmla``, ``handle_attention_triton``) which form a layer runs in, then calls the backend through
that form's ``RadixAttention``:

* ``MLA`` (decode, verify, and extend batches with a cached prefix under SGLang's chunked-prefix threshold):
  the absorbed layer ``attn_mqa`` (``num_kv_heads=1``, ``head_dim = kv_lora_rank + rope``, ``v_head_dim =
  kv_lora_rank``) called as ``attn_mqa(q_nope_out, k_nope, k_nope, fb, q_rope=q_pe, k_rope=k_pe)`` for the backends
  SGLang lists in ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` (FlashInfer's), else with both parts concatenated
  (forward_mla.py, ``forward_absorb_core``); the backend writes the latent rows.
* ``MHA`` (Triton's choice for an extend without a cached prefix): the expanded layer over the new tokens.
* ``MHA_ONE_SHOT`` (extend batches without a prefix, or with one at or above the threshold): the expanded
  layer ``attn_mha`` over every key of the batch, the prefix's re-expanded from the latent cache
  (forward_mha.py, ``forward_normal_one_shot_*``).
* ``MHA_CHUNKED_KV`` (prefixes longer than ``SGLANG_MAX_KV_CHUNK_CAPACITY``, 128k tokens): not adapted;
  it merges chunk states with ``sgl_kernel``, which is not installed beside the harness.

The harness's model hands an expanded extend layer its new tokens' ``q [T, H, nope + rope]``, ``k``, ``v``
(latent rows already written) and an absorbed layer ``q [T, H, C + R]`` and the new latent rows; the
up-projections (``w_kc``, ``w_vc``: the model's ``kv_b_proj``) are the model's, from :mod:`backends.latent`.
"""

from __future__ import annotations

import importlib

import torch

from backends.base import DRAFTING_MODES, Capabilities
from backends.latent import latent_to_heads, latent_to_output, query_to_latent
from backends.sglang import compat
from backends.sglang.adapter import SGLANG_TRITON_BOUNDARIES, TBO_DRAFT_EXTEND_GAP, TBO_MIXED_GAP, SglangBackend
from batch.spec import ForwardMode


def _mla_radix(backend, layer, absorbed: bool):
    """The layer's ``attn_mqa`` (absorbed) or ``attn_mha`` (expanded) as DeepSeek builds them (cached)."""
    spec = layer.spec
    key = ("mla", layer.layer_id, absorbed)
    radix = backend.radix.get(key)
    if radix is None:
        C, R, N = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim
        if absorbed:
            radix = backend.sgl.RadixAttention(num_heads=spec.num_heads, head_dim=C + R, scaling=spec.sm_scale,
                                               num_kv_heads=1, layer_id=layer.layer_id, v_head_dim=C)
        else:
            radix = backend.sgl.RadixAttention(num_heads=spec.num_heads, head_dim=N + R, scaling=spec.sm_scale,
                                               num_kv_heads=spec.num_heads, layer_id=layer.layer_id,
                                               v_head_dim=spec.v_head_dim)
        backend.radix[key] = radix
    return radix


def forward_method(sgl, sfb, spec, backend_name: str = "flashinfer"):
    """SGLang's choice for one MLA layer of this batch (DeepSeek with the ``backend_name`` backend), from its own
    dispatcher (``handle_attention_<backend_name>``, beside ``handle_attention_flashinfer``) and the server settings
    the layer reads at construction."""
    attn = type("DeepseekAttention", (), {})()
    attn.flashinfer_mla_disable_ragged = compat.server_setting(sgl, "kernel", "flashinfer_mla_disable_ragged")
    attn.disable_chunked_prefix_cache = compat.server_setting(sgl, "schedule", "disable_chunked_prefix_cache")
    attn.chunked_prefix_cache_threshold = sgl.envs.SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD.get()
    attn.qk_rope_head_dim = spec.qk_rope_head_dim
    handlers = importlib.import_module(sgl.handle_attention_flashinfer.__module__)
    return getattr(handlers, f"handle_attention_{backend_name}")(attn, sfb)


def rope_apart(backend_name: str) -> bool:
    """Whether DeepSeek hands the absorbed layer ``attn_mqa`` its query's and new key's rope parts apart (``q_rope``,
    ``k_rope``) for this backend, or both concatenated (``attn_mqa(cat(q_nope_out, q_pe), cat(k_nope, k_pe),
    k_nope)``): SGLang's own list of the backends of the first kind (``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``,
    forward_mla.py ``forward_absorb_core``), where the release has it."""
    try:
        utils = importlib.import_module("sglang.srt.models.deepseek_common.utils")
    except ImportError:
        return backend_name == "flashinfer"
    return backend_name in getattr(utils, "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS", ("flashinfer",))


def _absorbed(backend, layer, q, k, sfb, save_kv_cache: bool) -> torch.Tensor:
    """The absorbed layer's call as DeepSeek makes it for ``backend`` (a leaf, or a TBO half running the leaf's
    ``_run``; :func:`rope_apart`): ``q [T, H, C + R]`` (the latent query and its rope part), ``k [T, 1, C + R]`` (the
    new latent rows)."""
    C = layer.spec.kv_lora_rank
    radix = _mla_radix(backend, layer, True)
    nope = k[..., :C].contiguous()
    if rope_apart(backend.sglang_name):
        return radix(q[..., :C].contiguous(), nope, nope, sfb, save_kv_cache=save_kv_cache,
                     q_rope=q[..., C:].contiguous(), k_rope=k[..., C:].contiguous())
    return radix(q.contiguous(), k.contiguous(), nope, sfb, save_kv_cache=save_kv_cache)


class DeepseekMla(SglangBackend):
    """An SGLang MLA backend driven as DeepSeek's attention drives it (module docstring): its ``_run`` asks SGLang's
    dispatcher for this backend (``sglang_name``) which form each layer runs in and calls that form's RadixAttention.
    Its leaves declare their capabilities and read their plans."""

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, via=None) -> torch.Tensor:
        """Absorbed layer: q ``[T, H, C + R]``, k the new latent rows ``[T, 1, C + R]`` -> ``[T, H, C]``.
        Expanded layer: q, k ``[T, H, nope + rope]``, v ``[T, H, V]`` of the new tokens -> ``[T, H, V]``."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("forward before init_forward_metadata planned this batch")
        sgl, spec = self.sgl, layer.spec
        C, N, T, H = spec.kv_lora_rank, spec.qk_nope_head_dim, q.shape[0], spec.num_heads
        with torch.no_grad(), compat.backend_scope(sgl, via or self.inner, sfb):
            if layer.absorbed:
                return _absorbed(self, layer, q, k, sfb, save_kv_cache).reshape(T, H, C)
            method = forward_method(sgl, sfb, spec, self.sglang_name)
            w_kc, w_vc = layer.weights["w_kc"], layer.weights["w_vc"]
            latent = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
            if method is sgl.AttnForwardMethod.MLA:
                # The extend runs absorbed: the query projected into the latent space, the new rows (which the
                # model wrote) as k_nope / k_pe, the latent output up-projected by the model.
                rows = latent[forward_batch.out_cache_loc]
                q_latent = torch.cat([query_to_latent(q[..., :N], w_kc).to(q.dtype), q[..., N:]], dim=-1)
                o = _absorbed(self, layer, q_latent, rows, sfb, True)
                return latent_to_output(o.reshape(T, H, C), w_vc).to(q.dtype)
            if method is sgl.AttnForwardMethod.MHA:
                # forward_normal (a backend's choice for an extend without a cached prefix, Triton's): the expanded
                # layer over the new tokens' keys alone, their latent rows written by the model
                o = _mla_radix(self, layer, False)(q.contiguous(), k.contiguous(), v.contiguous(), sfb,
                                                   save_kv_cache=False)
                return o.reshape(T, H, spec.v_head_dim)
            if method is not sgl.AttnForwardMethod.MHA_ONE_SHOT:
                raise NotImplementedError(f"SGLang chose {method.name} for this batch; the adapter runs MLA and "
                                          "MHA_ONE_SHOT (MHA_CHUNKED_KV needs sgl_kernel's merge_state)")
            sfb.mha_one_shot = True
            if any(sfb.extend_prefix_lens_cpu):
                # Every key of the batch, the prefix's expanded again from the latent cache.
                k, v = latent_to_heads(latent[sfb.fetch_mha_one_shot_kv_indices().long(), 0], C, w_kc, w_vc)
                k, v = k.to(q.dtype), v.to(q.dtype)
                if sfb.num_prefix_chunks is None:
                    sfb.num_prefix_chunks = 0
                    self.inner.init_mha_chunk_metadata(sfb)
            sfb.mha_return_lse = False
            sfb.set_attn_attend_prefix_cache(False)
            # The key count DeepSeek's model code passes from 0.5.22 (earlier forward_extend takes no such keyword)
            extra = compat.accepted(type(self.inner).forward_extend, {"key_value_num_tokens": k.shape[0]})
            o = _mla_radix(self, layer, False)(q.contiguous(), k.contiguous(), v.contiguous(), sfb,
                                               save_kv_cache=False, **extra)
            return o.reshape(T, H, spec.v_head_dim)


class SglangTritonMla(DeepseekMla):
    """SGLang's ``TritonAttnBackend`` serving an MLA model (DeepSeek, Kimi, MiniCPM3 with ``--attention-backend
    triton``), driven as DeepSeek drives it: its own dispatcher (``handle_attention_triton``: an extend without a cached
    prefix runs the expanded layer over its new tokens, ``MHA``; every other batch the absorbed layer), the absorbed
    query and key handed over concatenated (triton is not among the backends given the rope parts apart). Its plan is
    Triton's ``ForwardMetadata``, read as the MHA leaf's. Its kernels are the MHA leaf's, interpreted on a CPU."""

    sglang_name = "triton"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mla"}),
        engine_features=("deepseek_mla",),
        modes=DRAFTING_MODES,
        # Its MLA decode splits the absorbed head into the latent and the rope part for two widths only
        # (decode_attention.py:826-834, _decode_grouped_att_m_fwd: 512 + 64, DeepSeek's and Kimi's; 256 + 32,
        # MiniCPM3's); any other is one power-of-two block against the latent's, which the kernel cannot shape
        mla_latents=frozenset({(512, 64), (256, 32)}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        cpu_dtypes=frozenset({"float32", "float16"}),  # the interpreter's bf16 tl.dot is broken (the MHA leaf's)
        requires=("sglang", "triton"),
        cpu_needs_env="TRITON_INTERPRET",
        fp32_matmul_roundoff=2.0**-10,  # TF32 dots on NVIDIA GPUs, as the MHA leaf's kernels
        cpu_fp32_matmul_roundoff=2.0**-21,
        length_boundaries=SGLANG_TRITON_BOUNDARIES,
        engine="sglang",
        one_shape_per_kind=True,
        wrapped_gaps=(TBO_MIXED_GAP, TBO_DRAFT_EXTEND_GAP),
        # The MHA leaf's draft paths, over the absorbed layer (DeepSeek's MTP draft model runs its decode steps and
        # its draft extend absorbed: handle_attention_triton picks MLA for both): EAGLE v2's fixed-width draft
        # extend; the draft worker's TritonMultiStepDraftBackend (one TritonAttnBackend a step, whatever the model's
        # attention) with the server's draft window where the release has it
        fixed_width_draft_extend=True,
        engine_limits=(("draft_prefix_window", "draft_prefix_window", False),),
        # The MHA leaf's graphs (triton_backend.py, _apply_cuda_graph_metadata): decode, idle, verify and draft
        # extend; the draft loop's under the draft graph runner
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                    ForwardMode.IDLE, ForwardMode.DRAFT_DECODE}),
    )
