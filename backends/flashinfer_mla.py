"""FlashInfer MLA backend, modelled on SGLang's ``FlashInferMLAAttnBackend``.

Absorbed form (DECODE, TARGET_VERIFY, DRAFT_EXTEND): ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over the
latent cache. The model passes ``q [T, H, C + R]`` (``q_latent`` then ``q_pe``), ``k`` = the new latent rows
``[T, 1, C + R]`` (written at ``out_cache_loc`` first) and ``v`` = their ``ckv`` part; the kernel gets q split
into ``q_nope [T, H, C]`` / ``q_pe [T, H, R]`` and the pool's latent buffer viewed as pages
``[num_pages, page_size, C + R]`` split into ``ckv`` / ``kpe`` column views. Output ``[T, H, C]`` (latent space),
``sm_scale = layer.scaling``. Decode plans are non-causal over ``seq_lens`` keys; draft extend plans are causal
(FlashInfer aligns query i of a request to ``kv_len - qo_len + i``) over prefix + new tokens.

Verification: the MLA paged kernel has no custom mask, only causal / non-causal. A chain tree is exactly
causal, so chains run as SGLang runs them (causal, over ``seq_len + draft_token_num`` keys). Any other tree
runs each draft token as its own single-query request over page-size-1 indices: the cached slots and the
slots of the draft tokens its mask row allows (itself and its ancestors), non-causal -- still only the
kernel, with exactly the tree mask's semantics. :meth:`FlashInferMLABackend.planned_metadata` then shows the
per-request view (pages of ``seq_len + D`` keys and the tree mask) and the per-row plan the kernel got under
``chunk["verify_rows"]``.

Expanded form (EXTEND, MIXED): ``init_mha_chunk_metadata`` plans a ragged prefill over the new tokens
(causal) and the cached prefix in chunks of ``mla_prefix_chunk`` slots; ``forward_extend`` expands each chunk
from the latent cache with the layer's ``w_kc`` / ``w_vc`` (``backends.latent.latent_to_heads``), runs the ragged
prefill per chunk (non-causal) with log-sum-exp, and merges the chunks into a float32 running state
(``backends.flashinfer.merge_running``: one rounding to the model dtype, at the end). A missing or stale chunk
plan is a RuntimeError, as in torch_native.

CUDA graphs: DECODE, with an MLA wrapper built with ``use_cuda_graph=True`` over fixed ``qo_indptr``,
``kv_indptr``, ``kv_indices`` and ``kv_len_arr`` buffers, re-planned by ``init_forward_metadata_out_graph``
before each replay from ``req_to_token`` (the ``model_runner``'s, or ``self.req_to_token``: see
:mod:`backends.flashinfer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backends.base import SERVING_MODES, AttentionBackend, Capabilities, PlannedMetadata
from backends.flashinfer import (
    BatchPlan,
    WrapperCache,
    decode_graph_plan,
    layer_kv_dtype,
    make_workspace,
    merge_running,
    plan_batch,
    req_to_token_of,
)
from backends.latent import latent_to_heads
from backends.planner import exclusive_cumsum
from batch.spec import ForwardMode


@dataclass(frozen=True)
class MLAKey:
    """What an absorbed MLA plan depends on besides the batch."""

    num_heads: int
    kv_lora_rank: int  # C: ckv columns
    rope_dim: int  # R: kpe columns
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@dataclass(frozen=True)
class RaggedKey:
    """What the expanded (MHA) ragged plan depends on besides the batch."""

    num_heads: int
    qk_head_dim: int  # qk_nope + qk_rope
    v_head_dim: int
    sm_scale: float
    dtype: torch.dtype


def mla_key(layer, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> MLAKey:
    """Key of an absorbed MLA ``AttentionLayer`` (head_dim = C + R, v_head_dim = C)."""
    C = layer.v_head_dim
    return MLAKey(layer.tp_q_head_num, C, layer.head_dim - C, float(layer.scaling), q_dtype, kv_dtype)


def ragged_key(layer, dtype: torch.dtype) -> RaggedKey:
    """Key of the expanded (MHA) ragged plan of MLA ``layer`` whose q, k, v have ``dtype``."""
    return RaggedKey(layer.tp_q_head_num, layer.head_dim, layer.v_head_dim, float(layer.scaling), dtype)


def is_chain(parents: torch.Tensor) -> bool:
    """``parents [B, D]``: every tree is the chain -1, 0, 1, ..."""
    D = parents.shape[1]
    chain = torch.arange(-1, D - 1, device=parents.device)
    return bool((parents == chain).all())


def verify_rows_plan(forward_batch) -> dict[str, torch.Tensor]:
    """Per-draft-token plan of a TARGET_VERIFY batch, over page-size-1 slots.

    Row ``i * D + j`` is draft token j of request i; its keys are request i's first ``seq_len + D`` slots where
    row j of its custom-mask block is True. Returns ``qo_indptr [B*D+1]`` (one query each), ``kv_indptr``,
    ``kv_indices`` (slots) and ``kv_len [B*D]``, all int32.
    """
    fb = forward_batch
    D = fb.spec_info.draft_token_num
    mask = fb.spec_info.custom_mask.to(torch.bool)
    indices, lens, offset = [], [], 0
    for i, (row, seq) in enumerate(zip(fb.req_pool_indices.tolist(), fb.seq_lens.tolist())):
        n = seq + D
        block = mask[offset:offset + D * n].view(D, n)
        offset += D * n
        slots = fb.req_to_token[row, :n]
        for j in range(D):
            indices.append(slots[block[j]])
            lens.append(block[j].sum())
    kv_len = torch.stack(lens).to(torch.int32)
    dev = fb.device
    return {"qo_indptr": torch.arange(len(lens) + 1, dtype=torch.int32, device=dev),
            "kv_indptr": exclusive_cumsum(kv_len), "kv_indices": torch.cat(indices).to(torch.int32),
            "kv_len": kv_len, "page_size": 1}


class FlashInferMLABackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"mla"}),
        modes=SERVING_MODES,
        dtypes=frozenset({"bfloat16", "float16"}),  # the MLA and prefill kernels have no fp32 path
        page_sizes=None,  # page_size is a plan() argument of the MLA kernel
        custom_mask=True,  # non-chain trees run as one-query rows (see the module docstring)
        mrope=True,  # RoPE is applied by the model
        cuda_graph_modes=frozenset({ForwardMode.DECODE}),  # graph planning (out_graph) for decode batches
        devices=frozenset({"cuda"}),
        requires=("flashinfer",),
    )
    mla_backend = "auto"  # as SGLang: FA3 MLA kernel on Hopper, FA2 elsewhere
    ragged_backend = "auto"
    mla_prefix_chunk = 256  # prefix slots expanded per chunk in the MHA path (small: prefixes span several)

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.req_to_token: torch.Tensor | None = None
        self.workspace: torch.Tensor | None = None
        self.cache = WrapperCache()  # absorbed (MLA paged) wrappers
        self.chunk_cache = WrapperCache()  # expanded (ragged) wrappers, planned by init_mha_chunk_metadata
        self.plan: BatchPlan | None = None
        self.kv_len: torch.Tensor | None = None  # [B] int32 keys per request of self.plan
        self.causal = False
        self.rows: dict | None = None  # per-draft-token verify plan (non-chain trees)
        self.mha_chunk: dict | None = None
        self.graph_buffers: dict[str, torch.Tensor] | None = None
        self.graph_bs: int | None = None

    def _workspace(self, device) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = make_workspace(torch.device(device))
        return self.workspace

    # ---- planning ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Start a plan generation: the batch's page plan, keys per request ``kv_len[B]`` int32, causal for
        extend-like modes, the per-row plan of a non-chain verify tree, and the absorbed wrappers of the runner's
        MLA layers (the expanded path plans in :meth:`init_mha_chunk_metadata`)."""
        fb = forward_batch
        self.req_to_token = fb.req_to_token
        self.graph_bs = None
        self.mha_chunk = None  # an MHA-path batch must plan its chunks again (init_mha_chunk_metadata)
        self.rows = None
        self.cache.new_batch()
        self.plan = plan_batch(fb)
        mode = fb.forward_mode
        self.causal = not (mode.is_decode() or mode.is_idle())
        if mode.is_decode():
            self.kv_len = fb.seq_lens.to(torch.int32)
        elif not mode.is_idle():
            self.kv_len = (fb.extend_prefix_lens.to(torch.int64) + fb.extend_seq_lens.to(torch.int64)).to(torch.int32)
        if mode.is_target_verify() and not is_chain(fb.spec_info.parents):
            self.rows = verify_rows_plan(fb)
        layers = self.model_runner.layers if self.model_runner is not None else ()
        if not layers or mode.is_idle():
            return
        from batch.forward_batch import LayerWeights
        from batch.layers import make_layer, mla_uses_absorbed

        if not mla_uses_absorbed(mode):
            return  # the MHA path plans in init_mha_chunk_metadata
        for spec_layer in layers:
            if spec_layer.kind == "mla":
                layer = make_layer(spec_layer, LayerWeights({}), mode)
                kv_dtype = layer_kv_dtype(fb, layer.layer_id)
                self._wrapper(mla_key(layer, kv_dtype, kv_dtype), fb.device)

    def _role(self) -> str:
        if self.graph_bs is not None:
            return "decode_graph"
        if self.rows is not None:
            return "rows"
        return "causal" if self.causal else "decode"

    def _make(self, role: str, device):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        ws = self._workspace(device)
        if role != "decode_graph":
            return BatchMLAPagedAttentionWrapper(ws, backend=self.mla_backend)
        if self.graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state must run before CUDA-graph capture")
        bs, buf = self.graph_bs, self.graph_buffers
        return BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, qo_indptr=buf["qo_indptr"][: bs + 1],
                                             kv_indptr=buf["kv_indptr"][: bs + 1], kv_indices=buf["kv_indices"],
                                             kv_len_arr=buf["kv_len"][:bs], backend=self.mla_backend)

    def _plan_wrapper(self, wrapper, role: str, key: MLAKey) -> None:
        if role == "rows":
            r = self.rows
            qo, kv_indptr, kv_indices, kv_len, ps, causal = (r["qo_indptr"], r["kv_indptr"], r["kv_indices"],
                                                            r["kv_len"], 1, False)
        else:
            p = self.plan
            kv_indptr, kv_indices, _ = p.full
            qo, kv_len, ps, causal = p.qo_indptr, self.kv_len, p.page_size, self.causal
        wrapper.plan(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len,
                     num_heads=key.num_heads, head_dim_ckv=key.kv_lora_rank, head_dim_kpe=key.rope_dim,
                     page_size=ps, causal=causal, sm_scale=key.sm_scale, q_data_type=key.q_dtype,
                     kv_data_type=key.kv_dtype)

    def _wrapper(self, key: MLAKey, device):
        role = self._role()
        name = ("decode_graph", key, self.graph_bs) if role == "decode_graph" else (role, key)
        return self.cache.get(name, lambda: self._make(role, device), lambda w: self._plan_wrapper(w, role, key))

    def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged: bool = False) -> None:
        """Plan the MLA prefill's MHA path: a ragged prefill over the new tokens (causal) and one per chunk of
        ``mla_prefix_chunk`` prefix slots (non-causal). Stores ``self.mha_chunk`` with ``qo_indptr`` (its last
        entry is the batch's extend tokens), ``chunks`` [(kv_indptr, slots)] and ``chunk_size``."""
        if disable_flashinfer_ragged:
            raise NotImplementedError("FlashInferMLABackend's MHA path is the ragged prefill; with ragged disabled "
                                      "SGLang runs prefill absorbed, which this harness's model does not call")
        fb = forward_batch
        prefix = fb.extend_prefix_lens.to(torch.int64)
        chunk_size = self.mla_prefix_chunk
        chunks = []
        for start in range(0, max(fb.extend_prefix_lens_cpu, default=0), chunk_size):
            lens = (prefix - start).clamp(0, chunk_size)
            rows = [fb.req_to_token[r, start:start + n] for r, n in zip(fb.req_pool_indices.tolist(), lens.tolist())]
            chunks.append((exclusive_cumsum(lens), torch.cat(rows).to(torch.int64)))
        self.mha_chunk = {"qo_indptr": exclusive_cumsum(fb.extend_seq_lens), "chunks": chunks,
                          "chunk_size": chunk_size, "num_tokens": fb.extend_num_tokens}
        self.chunk_cache.new_batch()
        layers = self.model_runner.layers if self.model_runner is not None else ()
        from batch.forward_batch import LayerWeights
        from batch.layers import make_layer

        for spec_layer in layers:
            if spec_layer.kind == "mla":
                layer = make_layer(spec_layer, LayerWeights({}), ForwardMode.EXTEND)
                key = ragged_key(layer, layer_kv_dtype(fb, layer.layer_id))
                for c in range(-1, len(chunks)):
                    self._ragged(key, c, fb.device)

    def _ragged(self, key: RaggedKey, c: int, device):
        """The ragged wrapper for the new tokens (``c = -1``, causal) or prefix chunk ``c`` (non-causal)."""
        import flashinfer

        chunk = self.mha_chunk
        qo = chunk["qo_indptr"]
        kv_indptr = qo if c < 0 else chunk["chunks"][c][0]

        def plan(w):
            """Plan ``w``: queries at ``qo_indptr``, keys at chunk ``c``'s ``kv_indptr`` (``c = -1``: the new
            tokens, causal)."""
            w.plan(qo, kv_indptr, key.num_heads, key.num_heads, key.qk_head_dim, head_dim_vo=key.v_head_dim,
                   causal=c < 0, sm_scale=key.sm_scale, q_data_type=key.dtype, kv_data_type=key.dtype)

        return self.chunk_cache.get(("ragged", key, c), lambda: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace(device), "NHD", backend=self.ragged_backend), plan)

    def planned_metadata(self) -> PlannedMetadata:
        """The chunk plan for the expanded path; otherwise the page plan over every key (new tokens included),
        with the tree mask, and a non-chain tree's per-row plan under ``chunk["verify_rows"]``."""
        p = self.plan
        if self.mha_chunk is not None and not (p.mode.is_decode() or p.mode.is_target_verify()
                                               or p.mode.is_draft_extend()):
            # MHA path: the kernels get the chunk plan only.
            return PlannedMetadata(qo_indptr=self.mha_chunk["qo_indptr"], chunk=self.mha_chunk)
        if p.mode.is_idle():
            return PlannedMetadata(qo_indptr=p.qo_indptr, kv_indptr=p.full[0], kv_indices=p.full[1])
        kv_indptr, kv_indices, last = p.full
        meta = PlannedMetadata(qo_indptr=p.qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                               kv_last_page_len=last, kv_indices_are_pages=True, kv_includes_new_tokens=True,
                               custom_mask=p.custom_mask, mask_indptr=p.mask_indptr)
        if self.rows is not None:
            meta.chunk = {"verify_rows": self.rows}
        return meta

    # ---- per layer ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The chunked ragged prefill (expanded path) for a layer not absorbed (EXTEND, MIXED), else the
        absorbed MLA kernel."""
        if not layer.absorbed:
            return self._mla_expanded(q, k, v, layer, forward_batch)
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The absorbed MLA kernel, non-causal over ``seq_lens`` keys (the new latent rows written first)."""
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache)

    def _absorbed(self, q, k, layer, forward_batch, save_kv_cache: bool):
        """q ``[T, H, C + R]``, k (new latent rows) ``[T, 1, C + R]`` -> ``[T, H, C]``."""
        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, None)
        latent = pool.get_key_buffer(layer.layer_id)
        key = mla_key(layer, q.dtype, latent.dtype)
        wrapper = self._wrapper(key, q.device)
        C = key.kv_lora_rank
        ps = 1 if self.rows is not None and self.graph_bs is None else self.plan.page_size
        pages = latent.view(-1, ps, latent.shape[-1])
        out = q.new_empty(q.shape[0], key.num_heads, C)
        return wrapper.run(q[..., :C], q[..., C:], pages[..., :C], pages[..., C:], out=out)

    def _mla_expanded(self, q, k, v, layer, forward_batch):
        """MLA prefill as MHA: q ``[T, H, N + R]``, k ``[T, H, N + R]``, v ``[T, H, V]`` of the new tokens (the
        model wrote their latents) -> ``[T, H, V]``."""
        chunk = self.mha_chunk
        if chunk is None or int(chunk["qo_indptr"][-1]) != q.shape[0]:
            planned = None if chunk is None else int(chunk["qo_indptr"][-1])
            raise RuntimeError(f"MLA prefill got {q.shape[0]} query rows but init_mha_chunk_metadata planned "
                               f"{planned}: the chunk plan is missing or stale")
        key = ragged_key(layer, q.dtype)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        new = self._ragged(key, -1, q.device)
        if not chunk["chunks"]:
            return new.run(q, k, v)
        o, lse = new.run(q, k, v, return_lse=True)
        C = layer.spec.kv_lora_rank
        latent = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        for c, (_, slots) in enumerate(chunk["chunks"]):
            k_c, v_c = latent_to_heads(latent[slots, 0], C, layer.weights["w_kc"], layer.weights["w_vc"])
            o_c, lse_c = self._ragged(key, c, q.device).run(q, k_c.to(q.dtype).contiguous(),
                                                           v_c.to(q.dtype).contiguous(), return_lse=True)
            o, lse = merge_running(o, lse, o_c, lse_c)  # float32 throughout: one rounding, at the end
        return o.to(q.dtype)

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static decode plan the graph wrapper is built over: ``qo_indptr[max_bs+1]`` (``arange``),
        ``kv_indptr[max_bs+1]``, ``kv_indices[max_bs * max_pages]`` and ``kv_len[max_bs]``, all int32."""
        rt = req_to_token_of(self)
        ps = self._page_size()
        dev = rt.device
        self.graph_buffers = {
            "qo_indptr": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(max_bs * math.ceil(rt.shape[1] / ps), dtype=torch.int32, device=dev),
            "kv_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }

    def _page_size(self) -> int:
        if self.model_runner is not None:
            return self.model_runner.page_size
        if self.plan is None:
            raise RuntimeError("FlashInferMLABackend without a model_runner learns the page size from a batch: "
                               "run init_forward_metadata once before CUDA-graph planning")
        return self.plan.page_size

    def _plan_graph(self, bs: int, req_pool_indices, seq_lens, forward_mode) -> None:
        if forward_mode not in self.capabilities.cuda_graph_modes:
            raise NotImplementedError(f"FlashInfer MLA captures CUDA graphs for decode only, not {forward_mode.value}")
        self.cache.new_batch()
        self.plan = decode_graph_plan(self, bs, req_pool_indices, seq_lens, self._page_size())
        self.kv_len = seq_lens[:bs].to(torch.int32)
        self.causal, self.rows, self.graph_bs = False, None, bs
        self.cache.replan(lambda name: name[0] == "decode_graph" and name[2] == bs,
                          lambda name, w: self._plan_wrapper(w, "decode_graph", name[1]))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Graph planning (decode), at capture and before every replay alike: ``plan()`` runs on the host, so
        all of it is here (``init_forward_metadata_in_graph`` records nothing). Eager batches plan in
        init_forward_metadata."""
        fb = forward_batch
        self._plan_graph(fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.forward_mode)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: padding rows of a graph batch have one key."""
        return 1  # padded rows read one valid slot (SGLang's MLA backend pads with 0 keys instead)

    # ---- speculative decoding ----
    # verify_mask: the base's None (the MLA kernel takes no custom mask; non-chain trees run per row).
    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the verify plans are complete after init_forward_metadata."""
        return None
