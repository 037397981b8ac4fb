"""FlashInfer backend for MHA layers, modelled on SGLang's ``FlashInferAttnBackend``.

Kernels per mode (all over the paged KV pool viewed as ``[num_pages, page_size, Hk, D]``, slot =
page * page_size + offset):

* EXTEND, MIXED, DRAFT_EXTEND: ``BatchPrefillWithRaggedKVCacheWrapper`` over the new tokens (causal) and, when
  some request has a cached prefix, ``BatchPrefillWithPagedKVCacheWrapper`` over the prefix pages
  (non-causal), merged with ``flashinfer.merge_state`` -- SGLang's ``use_ragged`` path. A layer with a sliding
  window instead runs one causal paged prefill over prefix + new tokens: FlashInfer places query i of a
  request at ``kv_len - qo_len + i``, which is right only when the keys end with the new tokens (the split
  path would place the prefix part's queries ``extend_len`` positions too early).
* DECODE: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores) over ``seq_lens`` keys, the new one written
  first. A layer with ``v_head_dim != head_dim`` (which the decode kernel cannot do) uses the paged prefill.
* TARGET_VERIFY: paged prefill over ``seq_len + draft_token_num`` keys with the draft tree's custom mask
  (``SpecInfo.custom_mask`` is exactly FlashInfer's flattened ``[qo_len, kv_len]`` boolean layout).
* IDLE: an empty output.

An fp8 KV cache (``float8_e4m3fn`` buffers) is planned with ``kv_data_type`` fp8 for the paged wrappers (the
ragged one reads the new tokens in q's dtype) and run with the layer's ``k_scale``/``v_scale``.

Planning is once per batch, running once per layer. FlashInfer bakes the layer's head counts, head dims,
``sm_scale``, logit cap and window into ``plan()``, so there is one wrapper per (role, layer key): keys known
from the ``model_runner``'s layers are planned in ``init_forward_metadata``; a layer with a key not seen there is
planned on its first call in this batch (each wrapper records the plan generation it was planned for).

CUDA graphs (DECODE): ``init_cuda_graph_state`` allocates fixed ``kv_indptr``/``kv_indices``/``kv_last_page_len``
buffers; graph decode wrappers (``use_cuda_graph=True``) are built over them on the warm-up call that precedes
capture and re-planned by ``init_forward_metadata_out_graph`` before each replay, which reads ``req_to_token``
from the ``model_runner`` the backend was built with (or, without one, from ``self.req_to_token``, which
``init_forward_metadata`` keeps from the last batch and a runner may set).

flashinfer is imported lazily, so this module imports on machines without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from backends.base import DRAFTING_MODES, AttentionBackend, Capabilities, PlannedMetadata
from backends.planner import exclusive_cumsum, page_kv_indices
from batch.spec import ForwardMode, is_recurrent

WORKSPACE_BYTES = 128 * 1024 * 1024  # float workspace per backend instance, as FlashInfer recommends
MERGE_STATE_MAX_THREADS = 1024  # merge_state launches (head_dim / vec_size) x num_heads threads per block


# ---- shared with backends.flashinfer_mla ------------------------------------------------------------

def make_workspace(device: torch.device) -> torch.Tensor:
    """A zeroed uint8 float-workspace buffer (FlashInfer asks for zeros before first use)."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class WrapperCache:
    """FlashInfer wrappers by name, each planned at most once per plan generation.

    ``new_batch()`` starts a generation; ``get(name, make, plan)`` creates the wrapper on first use and plans
    it if it has not been planned in this generation. Plan per batch, run per layer.
    """

    def __init__(self) -> None:
        self.wrappers: dict[Hashable, Any] = {}
        self.planned: dict[Hashable, int] = {}
        self.generation = 0

    def new_batch(self) -> None:
        """Start a new plan generation: each wrapper is planned again on its next :meth:`get`."""
        self.generation += 1

    def get(self, name: Hashable, make: Callable[[], Any], plan: Callable[[Any], None]) -> Any:
        """The wrapper ``name``, made with ``make()`` on first use and planned with ``plan(wrapper)`` unless
        already planned in this generation."""
        wrapper = self.wrappers.get(name)
        if wrapper is None:
            wrapper = self.wrappers[name] = make()
        if self.planned.get(name) != self.generation:
            plan(wrapper)
            self.planned[name] = self.generation
        return wrapper

    def replan(self, select: Callable[[Hashable], bool], plan: Callable[[Hashable, Any], None]) -> None:
        """Plan again, in this generation, every existing wrapper whose name ``select`` accepts."""
        for name, wrapper in self.wrappers.items():
            if select(name):
                plan(name, wrapper)
                self.planned[name] = self.generation


def merge_running(o_run: torch.Tensor, lse_run: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one more partial attention into a running float32 one (lse base 2, FlashInfer's convention): the
    running output stays in float32 over any number of chunks, so a long prefix is rounded to the model's dtype
    once, at the end, rather than once per chunk (``flashinfer.merge_state`` returns the inputs' dtype)."""
    m = torch.maximum(lse_run, lse_b)
    w_a, w_b = torch.exp2(lse_run - m), torch.exp2(lse_b - m)
    o = (o_run.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return o, m + torch.log2(w_a + w_b)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint keys: o ``[T, H, Dv]``, lse ``[T, H]`` float32 in base 2
    (FlashInfer's convention). Uses ``flashinfer.merge_state`` unless its thread block would exceed 1024
    threads (many heads), where the same formula runs in PyTorch."""
    heads, dim = o_a.shape[1], o_a.shape[2]
    vec = max(16 // o_a.element_size(), dim // 32)
    if heads * max(dim // vec, 1) <= MERGE_STATE_MAX_THREADS:
        from flashinfer.cascade import merge_state

        return merge_state(o_a, lse_a, o_b, lse_b)
    o, lse = merge_running(o_a, lse_a, o_b, lse_b)
    return o.to(o_a.dtype), lse


def req_to_token_of(backend) -> torch.Tensor:
    """The ``req_to_token`` table for CUDA-graph planning (``init_forward_metadata_out_graph``)."""
    mr = getattr(backend, "model_runner", None)
    if mr is not None and getattr(mr, "req_to_token", None) is not None:
        return mr.req_to_token
    if getattr(backend, "req_to_token", None) is not None:
        return backend.req_to_token
    raise RuntimeError(f"{type(backend).__name__} needs req_to_token to plan CUDA-graph batches: build it with a "
                       "model_runner, or set backend.req_to_token (init_forward_metadata keeps the last batch's)")


def layers_with_kv(layers) -> int:
    """The id of the first layer that has KV buffers (MHA or MLA), or -1."""
    return next((l.layer_id for l in layers if not is_recurrent(l)), -1)


def layer_kv_dtype(forward_batch, layer_id: int) -> torch.dtype:
    """The dtype of layer ``layer_id``'s key buffer in the batch's KV pool."""
    return forward_batch.token_to_kv_pool.get_key_buffer(layer_id).dtype


# ---- the MHA backend ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerKey:
    """Everything a FlashInfer plan depends on besides the batch: one set of wrappers per key."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sm_scale: float
    logit_cap: float  # 0.0 = off
    window_left: int  # -1 = off
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


def layer_key(layer, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> LayerKey:
    """Key of an ``AttentionLayer`` (``engine.model``) whose queries have ``q_dtype``."""
    return LayerKey(layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim, layer.v_head_dim,
                    float(layer.scaling), float(layer.logit_cap or 0.0), int(layer.sliding_window_size),
                    q_dtype, kv_dtype)


@dataclass
class BatchPlan:
    """Index tensors of one batch (int32, on the batch's device); page plans as ``page_kv_indices`` makes them.

    ``prefix``: pages of the cached prefix only (extend-like modes). ``full``: pages of every key the batch's
    queries see, new tokens included (decode: ``seq_lens``; verify: ``seq_lens + draft_token_num``; extend:
    prefix + new tokens). Each is ``(kv_indptr[B+1], kv_indices, kv_last_page_len[B])``.
    """

    mode: ForwardMode
    batch_size: int
    page_size: int
    qo_indptr: torch.Tensor  # [B+1]
    num_tokens: int
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    full: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    has_prefix: bool = False
    custom_mask: torch.Tensor | None = None  # flat bool, TARGET_VERIFY
    mask_indptr: torch.Tensor | None = None  # [B+1]


def plan_batch(forward_batch) -> BatchPlan:
    """The page plans of ``forward_batch`` (see :class:`BatchPlan`)."""
    fb = forward_batch
    mode, ps, dev = fb.forward_mode, fb.page_size, fb.device
    if mode.is_idle():
        empty = (torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev),
                 torch.zeros(0, dtype=torch.int32, device=dev))
        return BatchPlan(mode, 0, ps, empty[0], 0, prefix=empty, full=empty)
    rt, rows = fb.req_to_token, fb.req_pool_indices
    if mode.is_decode():
        qo = torch.arange(fb.batch_size + 1, dtype=torch.int32, device=dev)
        full = page_kv_indices(rt, rows, fb.seq_lens.to(torch.int64), ps)
        return BatchPlan(mode, fb.batch_size, ps, qo, fb.batch_size, full=full)
    prefix_lens = fb.extend_prefix_lens.to(torch.int64)
    kv_lens = prefix_lens + fb.extend_seq_lens.to(torch.int64)
    plan = BatchPlan(mode, fb.batch_size, ps, exclusive_cumsum(fb.extend_seq_lens), fb.extend_num_tokens,
                     prefix=page_kv_indices(rt, rows, prefix_lens, ps), full=page_kv_indices(rt, rows, kv_lens, ps),
                     has_prefix=any(p > 0 for p in fb.extend_prefix_lens_cpu))
    if mode.is_target_verify():
        D = fb.spec_info.draft_token_num
        plan.custom_mask = fb.spec_info.custom_mask.to(torch.bool).contiguous()
        plan.mask_indptr = exclusive_cumsum(D * (fb.seq_lens.to(torch.int64) + D))
    return plan


def decode_graph_plan(backend, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      page_size: int) -> BatchPlan:
    """A DECODE plan of the first ``bs`` rows from lengths alone (CUDA-graph capture and replay)."""
    rows = req_pool_indices[:bs]
    full = page_kv_indices(req_to_token_of(backend), rows, seq_lens[:bs].to(torch.int64), page_size)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=rows.device)
    return BatchPlan(ForwardMode.DECODE, bs, page_size, qo, bs, full=full)


def kv_scales(pool, layer) -> dict[str, float]:
    """``run()``'s ``k_scale``/``v_scale`` for the layer's paged cache: its scales when the cache is fp8 (FlashInfer
    multiplies the scores by k_scale and the output by v_scale), else nothing."""
    return {"k_scale": layer.k_scale, "v_scale": layer.v_scale} if pool.is_fp8(layer.layer_id) else {}


def paged_cache(pool, layer_id: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V buffers as FlashInfer's NHD pages ``[num_pages, page_size, Hk, D]`` (views)."""
    k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    return (k.view(-1, page_size, k.shape[1], k.shape[2]), v.view(-1, page_size, v.shape[1], v.shape[2]))


class FlashInferBackend(AttentionBackend):
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        modes=DRAFTING_MODES,
        dtypes=frozenset({"bfloat16", "float16"}),  # FlashInfer's prefill/decode kernels have no fp32 path
        head_dims=frozenset({64, 128, 256}),  # the head dims FlashInfer's FA2/FA3 kernels are instantiated for
        page_sizes=None,  # page_size is a plan() argument of the paged kernels, not a compiled one
        # Its decode reads whole pages of the branch table our draft container builds (backends/draft.py): under a
        # draft window over the prefix that table keeps the sinks and the recent tokens, not whole pages
        paged_draft_prefix_window=False,
        # ... and a branch table of a paged draft tree: its pages would be the prefix's, while SGLang's layout reads
        # each branch's own first page (the prefix's last partial page repeated, batch.spec.draft_region)
        paged_draft_trees=False,
        custom_mask=True,
        sliding_window=True,
        logit_cap=True,
        mrope=True,  # RoPE is applied by the model before attention
        # graph planning (out_graph) for decode batches; the draft loop's graph runner plans each step as one
        # (backends/draft.py MultiStepDraft over a branch table)
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.DRAFT_DECODE}),
        devices=frozenset({"cuda"}),
        requires=("flashinfer",),
        # fp8 e4m3 paged caches with k_scale/v_scale at run(): wired, and run only by the gpu profile (no CPU path)
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
    )
    ragged_backend = "auto"  # as SGLang: FA3 on Hopper where the head dims allow, else FA2
    paged_backend = "fa2"  # as SGLang's prefill_backend / decode_backend (FA3 has no custom mask)

    def __init__(self, model_runner=None) -> None:
        self.model_runner = model_runner
        self.req_to_token: torch.Tensor | None = None
        self.workspace: torch.Tensor | None = None
        self.cache = WrapperCache()
        self.plan: BatchPlan | None = None
        self.graph_buffers: dict[str, torch.Tensor] | None = None
        self.graph_bs: int | None = None  # set while the plan is a CUDA-graph decode plan

    # ---- wrappers ----
    def _workspace(self, device) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = make_workspace(torch.device(device))
        return self.workspace

    def _roles(self, key: LayerKey, mode: ForwardMode) -> list[str]:
        """Which planned wrappers a layer with ``key`` runs in ``mode``."""
        if mode.is_idle():
            return []
        if mode.is_decode():
            return ["decode"] if key.head_dim == key.v_head_dim else ["whole"]
        if mode.is_target_verify():
            return ["verify"]
        if key.window_left >= 0:
            return ["whole"]
        return ["ragged", "prefix"] if self.plan.has_prefix else ["ragged"]

    def _make(self, role: str, device):
        import flashinfer

        ws = self._workspace(device)
        if role == "ragged":
            return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=self.ragged_backend)
        if role == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True,
                                                                 backend=self.paged_backend)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=self.paged_backend)

    def _plan_role(self, wrapper, role: str, key: LayerKey) -> None:
        p = self.plan
        common = dict(logits_soft_cap=key.logit_cap, sm_scale=key.sm_scale, q_data_type=key.q_dtype,
                      kv_data_type=key.kv_dtype)
        if role == "ragged":  # the new tokens' k/v: in q's dtype, whatever the cache stores
            wrapper.plan(p.qo_indptr, p.qo_indptr, key.num_qo_heads, key.num_kv_heads, key.head_dim,
                         head_dim_vo=key.v_head_dim, causal=True, window_left=-1,
                         **(common | {"kv_data_type": key.q_dtype}))
        elif role == "decode":
            kv_indptr, kv_indices, last = p.full
            wrapper.plan(kv_indptr, kv_indices, last, key.num_qo_heads, key.num_kv_heads, key.head_dim, p.page_size,
                         window_left=key.window_left, **common)
        else:
            kv_indptr, kv_indices, last = p.prefix if role == "prefix" else p.full
            wrapper.plan(p.qo_indptr, kv_indptr, kv_indices, last, key.num_qo_heads, key.num_kv_heads, key.head_dim,
                         p.page_size, head_dim_vo=key.v_head_dim,
                         custom_mask=p.custom_mask if role == "verify" else None,
                         causal=role == "whole",
                         window_left=-1 if role == "prefix" else key.window_left, **common)

    def _wrapper(self, role: str, key: LayerKey, device):
        if self.graph_bs is not None:
            if role != "decode":
                raise NotImplementedError(f"FlashInfer CUDA graphs cover decode layers with head_dim == v_head_dim; "
                                          f"this layer needs the {role!r} wrapper")
            return self.cache.get(("decode_graph", key, self.graph_bs), lambda: self._make_graph_decode(device),
                                  lambda w: self._plan_role(w, "decode", key))
        return self.cache.get((role, key), lambda: self._make(role, device), lambda w: self._plan_role(w, role, key))

    # ---- planning ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Start a plan generation with the batch's page plans (:func:`plan_batch`) and plan the wrappers of every
        MHA layer of the ``model_runner`` for this mode (without a runner, layers plan on their first call)."""
        fb = forward_batch
        self.req_to_token = fb.req_to_token
        self.graph_bs = None
        self.cache.new_batch()
        self.plan = plan_batch(fb)
        layers = self.model_runner.layers if self.model_runner is not None else ()
        if not layers or fb.forward_mode.is_idle() or fb.token_to_kv_pool.is_fp8(layers_with_kv(layers)):
            return  # layers plan on their first call (an fp8 cache's dtype says nothing of the queries')
        from batch.forward_batch import LayerWeights
        from batch.layers import make_layer

        for spec_layer in layers:
            if spec_layer.kind != "mha":
                continue
            layer = make_layer(spec_layer, LayerWeights({}), fb.forward_mode)
            kv_dtype = layer_kv_dtype(fb, layer.layer_id)
            key = layer_key(layer, kv_dtype, kv_dtype)
            for role in self._roles(key, fb.forward_mode):
                self._wrapper(role, key, fb.device)

    def planned_metadata(self) -> PlannedMetadata:
        """The page plan: every key (new tokens included) for decode and verify, the prefix pages for the other
        extend-like modes; the tree mask in TARGET_VERIFY."""
        p = self.plan
        new_tokens = p.mode.is_decode() or p.mode.is_target_verify()
        kv_indptr, kv_indices, last = p.full if new_tokens else p.prefix
        return PlannedMetadata(qo_indptr=p.qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                               kv_last_page_len=last, kv_indices_are_pages=True, kv_includes_new_tokens=new_tokens,
                               custom_mask=p.custom_mask, mask_indptr=p.mask_indptr)

    # ---- per layer ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> ``[T, Hq, Dv]`` (EXTEND, MIXED, DRAFT_EXTEND,
        TARGET_VERIFY)."""
        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        key = layer_key(layer, q.dtype, layer_kv_dtype(fb, layer.layer_id))
        roles = self._roles(key, fb.forward_mode)
        q = q.contiguous()
        scales = kv_scales(pool, layer)
        if roles[0] == "ragged":
            ragged = self._wrapper("ragged", key, q.device)
            if len(roles) == 1:
                return ragged.run(q, k.contiguous(), v.contiguous())
            o_new, lse_new = ragged.run(q, k.contiguous(), v.contiguous(), return_lse=True)
            o_prefix, lse_prefix = self._wrapper("prefix", key, q.device).run(
                q, paged_cache(pool, layer.layer_id, self.plan.page_size), return_lse=True, **scales)
            return merge_states(o_new, lse_new, o_prefix, lse_prefix)[0]
        if not save_kv_cache:
            raise ValueError(f"FlashInfer's {roles[0]!r} path reads the new tokens from the KV cache: "
                             "call it with save_kv_cache=True")
        return self._wrapper(roles[0], key, q.device).run(q, paged_cache(pool, layer.layer_id, self.plan.page_size),
                                                          **scales)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """q ``[B, Hq, D]`` (one token per request) -> ``[B, Hq, Dv]`` over all ``seq_lens`` keys."""
        fb = forward_batch
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        key = layer_key(layer, q.dtype, layer_kv_dtype(fb, layer.layer_id))
        (role,) = self._roles(key, ForwardMode.DECODE)
        wrapper = self._wrapper(role, key, q.device)
        return wrapper.run(q.contiguous(), paged_cache(pool, layer.layer_id, self.plan.page_size),
                           **kv_scales(pool, layer))

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static decode page plan the graph wrappers are built over: ``kv_indptr[max_bs+1]``,
        ``kv_indices[max_bs * max_pages]`` and ``kv_last_page_len[max_bs]``, all int32."""
        rt = req_to_token_of(self)
        ps = self.model_runner.page_size if self.model_runner is not None else self._page_size_hint()
        max_pages = math.ceil(rt.shape[1] / ps)
        dev = rt.device
        self.graph_buffers = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(max_bs * max_pages, dtype=torch.int32, device=dev),
            "kv_last_page_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }

    def _page_size_hint(self) -> int:
        if self.plan is None:
            raise RuntimeError("FlashInferBackend without a model_runner learns the page size from a batch: "
                               "run init_forward_metadata once before init_cuda_graph_state")
        return self.plan.page_size

    def _make_graph_decode(self, device):
        import flashinfer

        if self.graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state must run before CUDA-graph capture")
        bs, buf = self.graph_bs, self.graph_buffers
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace(device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=buf["kv_indptr"][: bs + 1], paged_kv_indices_buffer=buf["kv_indices"],
            paged_kv_last_page_len_buffer=buf["kv_last_page_len"][:bs], backend=self.paged_backend)

    def _plan_graph(self, bs: int, req_pool_indices, seq_lens, forward_mode) -> None:
        if forward_mode not in self.capabilities.cuda_graph_modes:
            raise NotImplementedError(f"FlashInfer captures CUDA graphs for decode only, not {forward_mode.value}")
        ps = self.model_runner.page_size if self.model_runner is not None else self._page_size_hint()
        self.cache.new_batch()
        self.plan = decode_graph_plan(self, bs, req_pool_indices, seq_lens, ps)
        self.graph_bs = bs
        # Wrappers captured earlier at this size read the fixed buffers: re-plan them now (plan() copies the new
        # indices into those buffers). Wrappers not created yet are built and planned on the warm-up call.
        self.cache.replan(lambda name: name[0] == "decode_graph" and name[2] == bs,
                          lambda name, w: self._plan_role(w, "decode", name[1]))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Graph planning (decode), at capture and before every replay alike: ``plan()`` runs on the host, so
        all of it is here (``init_forward_metadata_in_graph`` records nothing). Eager batches plan in
        init_forward_metadata."""
        fb = forward_batch
        self._plan_graph(fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.forward_mode)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: padding rows of a graph batch have one key."""
        return 1

    # ---- speculative decoding ----
    @property
    def verify_mask(self):
        """The planned tree mask (complete after init_forward_metadata), or None."""
        return None if self.plan is None else self.plan.custom_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to redo: the verify plan is complete after init_forward_metadata."""
        return None  # the verify plan (indices and tree mask) is complete after init_forward_metadata
