"""Triton backend: our own kernels for MHA extend (paged prefix + causal new tokens, custom masks) and
paged decode, with CUDA-graph planning for decode (``init_forward_metadata_out_graph``).

On a GPU the kernels compile; on the CPU they run in Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), which is how CI exercises them.
"""

from __future__ import annotations

import torch

from backends.base import DRAFTING_MODES, AttentionBackend, Capabilities, PlannedMetadata
from backends.planner import exclusive_cumsum, plan_token_level
from batch.spec import ForwardMode

DECODE_KV_SPLITS = 4
# Where the kernels change shape (Capabilities.length_boundaries). Decode splits each request's keys
# DECODE_KV_SPLITS ways in whole blocks of BLOCK_N keys (16 interpreted; 32 or 64 compiled, see
# decode_attention._launch_config): a second block past BLOCK_N, the last split non-empty past
# (splits - 1) * BLOCK_N, every split growing past splits * BLOCK_N. Extend walks BLOCK_M query rows against
# BLOCK_N keys (16 interpreted; 32, 64, 128 compiled).
_DECODE_BLOCK_N = (16, 32, 64)
_EXTEND_BLOCKS = (16, 32, 64, 128)
LENGTH_BOUNDARIES = frozenset({n * m for n in _DECODE_BLOCK_N for m in (1, DECODE_KV_SPLITS - 1, DECODE_KV_SPLITS)}
                              | set(_EXTEND_BLOCKS))


class TritonBackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        modes=DRAFTING_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # Graph planning (out_graph) for these; idle batches replay the decode graph, all rows padding.
        # (draft_decode: its draft loop's container, backends/draft.py, plans each step's decode graph)
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                    ForwardMode.IDLE, ForwardMode.DRAFT_DECODE}),
        requires=("triton",),
        cpu_needs_env="TRITON_INTERPRET",
        # On NVIDIA GPUs float32 dots use three-pass TF32 ("tf32x3"); see properties/tolerances.py.
        fp32_matmul_roundoff=2.0**-21,
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),  # the kernels dequantize e4m3 rows times the scales
        length_boundaries=LENGTH_BOUNDARIES,
        verify_window=True,
        empty_extend=True,
        # Interpreted (TRITON_INTERPRET=1) a random case takes 2-6 s under the ci profile: the rows of this
        # backend and its wrappers were 720 of the suite's 1560 worker-seconds at 4 examples a row (25 s at one).
        # On a CPU they draw the profile's slow_row_examples; what that leaves out is covered elsewhere there:
        # the kernels on ragged batches by tests/triton_kernels/, the wrappers and graph replay over random
        # batches by the same wrappers over torch_native, linear_torch and sglang.triton (full count), and the
        # detection of faults by the mutants. A GPU runs every row at full count.
        slow_on_cpu="interpreted Triton kernels take seconds a case",
    )

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.forward_metadata: PlannedMetadata | None = None
        self.graph_buffers: dict[str, torch.Tensor] | None = None
        self.graph_width: int | None = None  # tokens per request of the graph plan in use (None: eager plan)

    # ---- planning ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Token-level plan (:func:`backends.planner.plan_token_level`) for the extend and decode kernels."""
        self.forward_metadata = plan_token_level(forward_batch)
        self.graph_width = None

    def planned_metadata(self) -> PlannedMetadata:
        """The current plan; a graph plan's ``kv_indices`` and ``custom_mask`` cut to the entries its ``kv_indptr``
        and ``mask_indptr`` count (the static buffers are sized for the largest batch)."""
        meta = self.forward_metadata
        return meta.cut_to_indptrs() if self.graph_width is not None else meta

    # ---- per layer ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Writes k/v to the pool, then :func:`~backends.triton_kernels.extend_attention.extend_attention_fwd`
        over the prefix slots and the new tokens (causal, or the tree mask in TARGET_VERIFY)."""
        from backends.triton_kernels.extend_attention import extend_attention_fwd

        fb, meta = forward_batch, self.forward_metadata
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        o = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        extend_attention_fwd(q, k, v, o, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                             meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.custom_mask, meta.mask_indptr,
                             sm_scale=layer.scaling, logit_cap=layer.logit_cap,
                             sliding_window=layer.sliding_window_size, causal=meta.custom_mask is None,
                             max_extend_len=self.graph_width, k_descale=layer.k_scale,
                             v_descale=layer.v_scale,
                             positions=fb.positions)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Writes k/v to the pool, then :func:`~backends.triton_kernels.decode_attention.decode_attention_fwd`
        over all ``seq_lens`` slots, split ``DECODE_KV_SPLITS`` ways."""
        from backends.triton_kernels.decode_attention import decode_attention_fwd

        fb, meta = forward_batch, self.forward_metadata
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        o = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        bs = q.shape[0]
        decode_attention_fwd(q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), o,
                             meta.kv_indptr[: bs + 1], meta.kv_indices, sm_scale=layer.scaling,
                             logit_cap=layer.logit_cap, sliding_window=layer.sliding_window_size,
                             num_kv_splits=DECODE_KV_SPLITS, k_descale=layer.k_scale, v_descale=layer.v_scale)
        return o

    # ---- CUDA graphs (decode, target_verify, draft_extend; idle batches replay the decode graph) ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static plan for graphs of up to ``max_bs`` requests and ``max_num_tokens`` tokens:
        ``qo_indptr``/``kv_indptr``/``mask_indptr`` ``[max_bs+1]`` int32, ``kv_indices[max_bs * context_len]``
        int64 and the tree mask ``custom_mask[max_num_tokens * (context_len + max_num_tokens)]`` bool."""
        mr = self.model_runner
        self.graph_buffers = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=mr.device),
            "kv_indices": torch.zeros(max_bs * mr.context_len, dtype=torch.int64, device=mr.device),
            "qo_indptr": torch.arange(max_bs + 1, dtype=torch.int32, device=mr.device),
            "mask_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=mr.device),
            "custom_mask": torch.ones(max_num_tokens * (mr.context_len + max_num_tokens), dtype=torch.bool,
                                      device=mr.device),
            "bs": max_bs,
        }

    def _plan_graph(self, fb) -> None:
        """Refresh the static buffers in place from the padded batch's lengths and rows (and, in verify, its
        tree mask); the kernels captured in the graph read only these. Decode reads all ``seq_lens`` keys;
        verify reads the ``seq_lens`` cached keys; draft extend the ``seq_lens - width`` prefix, clamped at 0
        for padded rows (as SGLang's ``_update_draft_extend_buffers``)."""
        buf, mode, bs = self.graph_buffers, fb.forward_mode, fb.batch_size
        width = 1 if mode.is_decode() else fb.spec_info.draft_token_num
        seq_lens = fb.seq_lens[:bs].to(torch.int64)
        kv_lens = (seq_lens - width).clamp(min=0) if mode.is_draft_extend() else seq_lens
        buf["kv_indptr"][: bs + 1].copy_(exclusive_cumsum(kv_lens))
        max_len = int(kv_lens.max()) if bs else 0
        rows = self.model_runner.req_to_token[fb.req_pool_indices[:bs], :max_len]
        keep = torch.arange(max_len, device=rows.device)[None, :] < kv_lens[:, None]
        flat = rows[keep].to(torch.int64)
        buf["kv_indices"][: flat.numel()].copy_(flat)
        buf["qo_indptr"][: bs + 1].copy_(torch.arange(bs + 1, dtype=torch.int32, device=rows.device) * width)
        buf["bs"], self.graph_width = bs, width
        meta = PlannedMetadata(qo_indptr=buf["qo_indptr"][: bs + 1], kv_indptr=buf["kv_indptr"][: bs + 1],
                               kv_indices=buf["kv_indices"], kv_includes_new_tokens=mode.is_decode())
        if mode.is_target_verify():
            mask = fb.spec_info.custom_mask
            buf["custom_mask"][: mask.numel()].copy_(mask)
            buf["mask_indptr"][: bs + 1].copy_(exclusive_cumsum(width * (seq_lens + width)))
            meta.custom_mask, meta.mask_indptr = buf["custom_mask"], buf["mask_indptr"][: bs + 1]
        self.forward_metadata = meta

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Graph planning, at capture and before every replay alike: the padded batch's plan into the static
        buffers. Host-side (lengths, row gathers of dynamic size), so all of it runs here and
        ``init_forward_metadata_in_graph`` has nothing to record. Eager batches plan in init_forward_metadata."""
        fb = forward_batch
        if fb.forward_mode not in self.capabilities.cuda_graph_modes or fb.forward_mode.is_idle() \
                or fb.forward_mode.is_draft_decode():
            raise NotImplementedError(f"triton captures no {fb.forward_mode.value} graph (idle batches replay "
                                      f"the decode graph; a draft loop's steps are decodes its container plans)")
        if self.graph_buffers is None:
            raise RuntimeError("TritonBackend: init_cuda_graph_state must run before graph planning")
        self._plan_graph(fb)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: padding rows of a graph batch have one key."""
        return 1

    @property
    def verify_mask(self):
        """The planned tree mask (complete after init_forward_metadata), or None."""
        return None if self.forward_metadata is None else self.forward_metadata.custom_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the verify plan is complete after init_forward_metadata."""
        return None  # the verify plan is complete after init_forward_metadata
