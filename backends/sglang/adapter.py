"""SGLang's real attention backends as leaves of the harness's matrix.

Each leaf wraps one ``ATTENTION_BACKENDS[name](runner)`` of the installed SGLang. The harness's engine drives
the leaf as a model would; the leaf translates each batch into SGLang's ``ForwardBatch`` (pools shared with the
harness's, see :mod:`backends.sglang.runtime`), plans it with SGLang's ``init_forward_metadata`` and runs each
layer as SGLang's ``RadixAttention`` runs it (``layer(q, k, v, forward_batch)`` under SGLang's forward context,
which dispatches to ``get_attn_backend().forward``). What SGLang planned is exposed in the harness's
inspectable form (:class:`backends.base.PlannedMetadata`).

Mode names: the harness's DRAFT_EXTEND is SGLang's DRAFT_EXTEND_V2; the others are the same.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from backends.base import AttentionBackend, Capabilities, PlannedMetadata
from backends.sglang import runtime
from batch.spec import ForwardMode
from batch.tbo_split import TboSplit, slice_spec_info

# The modes whose batches this adapter translates into SGLang's today. DRAFT_EXTEND needs SGLang's
# EagleDraftExtendInput (not built yet). IDLE is left out until triaged: an empty batch planned eagerly makes
# Triton divide by the batch size (triton_backend.py:441, get_num_kv_splits); whether SGLang's own runner
# ever plans an empty IDLE batch that way is the open question.
ADAPTED_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY})
_SGLANG_MODE = {ForwardMode.EXTEND: "EXTEND", ForwardMode.DECODE: "DECODE", ForwardMode.MIXED: "MIXED",
                ForwardMode.TARGET_VERIFY: "TARGET_VERIFY", ForwardMode.DRAFT_EXTEND: "DRAFT_EXTEND_V2",
                ForwardMode.IDLE: "IDLE"}
# SGLang's TBO splitter cuts a MIXED batch's tokens with the two-chunk rule but its requests without it
# (docs/findings/sglang-tbo-mixed-two-chunk.md): Triton kernels then read and write past the halves' buffers,
# which aborts the process (interpreted: heap corruption; CUDA: an illegal access), so the row is not run.
TBO_MIXED_GAP = ("tbo", ForwardMode.MIXED, "SGLang's splitter corrupts MIXED halves (docs/findings/"
                                           "sglang-tbo-mixed-two-chunk.md) and Triton then writes out of bounds")


def retrieve_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """EAGLE's tree links from a parent list: each node's first child and its next sibling (-1: none)."""
    first_child, next_sibling = [-1] * len(parents), [-1] * len(parents)
    last_child: dict[int, int] = {}
    for node, parent in enumerate(parents):
        if parent < 0:
            continue
        if parent in last_child:
            next_sibling[last_child[parent]] = node
        else:
            first_child[parent] = node
        last_child[parent] = node
    return first_child, next_sibling


class _SglangObject(AttentionBackend):
    """What an adapter answers straight from the SGLang object it holds (``inner``): SGLang's own answers."""

    inner = None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value() if self.inner is not None else 1

    @property
    def verify_mask(self):
        return None if self.inner is None else self.inner.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        self.inner.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)


class SglangBackend(_SglangObject):
    """One SGLang attention backend, built over the harness runner's pools on the first batch it plans
    (SGLang sizes speculative buffers from the draft token count, which a runner does not know)."""

    sglang_name: ClassVar[str]

    def __init__(self, model_runner) -> None:
        self.model_runner = model_runner
        self.sgl = runtime.load()
        self.inner = None  # the SGLang backend
        self.sgl_runner = None
        self.draft_tokens = 0
        self.batches: dict[int, object] = {}  # id(harness batch) -> its SGLang ForwardBatch
        self.radix: dict[int, object] = {}

    # ---- building ----
    def _ensure_built(self, fb) -> None:
        draft = fb.spec_info.draft_token_num if fb.spec_info is not None else 0
        if self.inner is not None and draft <= self.draft_tokens:
            return
        topk = fb.spec_info.topk if fb.spec_info is not None else 0
        self.sgl_runner = runtime.make_runner(self.model_runner, self.sglang_name, draft, topk)
        self.inner = self.sgl.ATTENTION_BACKENDS[self.sglang_name](self.sgl_runner)
        self.draft_tokens = draft
        self.radix.clear()

    def _layer(self, layer):
        """SGLang's RadixAttention for a harness layer (cached per layer id)."""
        radix = self.radix.get(layer.layer_id)
        if radix is None:
            radix = self.sgl.RadixAttention(
                num_heads=layer.tp_q_head_num, head_dim=layer.head_dim, scaling=layer.scaling,
                num_kv_heads=layer.tp_k_head_num, layer_id=layer.layer_id, logit_cap=layer.logit_cap,
                v_head_dim=layer.v_head_dim, sliding_window_size=layer.sliding_window_size)
            self.radix[layer.layer_id] = radix
        return radix

    def translate(self, fb):
        """The harness batch as SGLang's ForwardBatch (the same tensors where the layouts agree)."""
        sgl = self.sgl
        mode = getattr(sgl.ForwardMode, _SGLANG_MODE[fb.forward_mode])
        T = fb.extend_num_tokens
        dev = fb.device
        out = sgl.ForwardBatch(
            forward_mode=mode, batch_size=fb.batch_size, input_ids=torch.zeros(T, dtype=torch.int64, device=dev),
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens.to(torch.int32),
            seq_lens_cpu=fb.seq_lens_cpu.to(torch.int32), out_cache_loc=fb.out_cache_loc,
            seq_lens_sum=fb.seq_lens_sum, positions=fb.positions)
        out.mrope_positions = fb.mrope_positions  # [3, T]: SGLang's TBO splitter cuts it on dim 1
        self.sgl_runner.kv_index_translator.bind_own_plan(out)  # as every batch of SGLang's scheduler
        if mode.is_extend(include_draft_extend_v2=True):
            out.extend_prefix_lens = fb.extend_prefix_lens
            out.extend_prefix_lens_cpu = list(fb.extend_prefix_lens_cpu)
            out.extend_seq_lens = fb.extend_seq_lens
            out.extend_seq_lens_cpu = list(fb.extend_seq_lens_cpu)
            out.extend_start_loc = fb.extend_start_loc
            out.extend_num_tokens = T
        if fb.forward_mode.is_target_verify():
            info = fb.spec_info
            D = info.draft_token_num
            links = [retrieve_links(p) for p in info.parents.tolist()]
            out.spec_info = sgl.EagleVerifyInput(
                draft_token=out.input_ids, custom_mask=info.custom_mask, positions=fb.positions,
                retrieve_index=torch.arange(fb.batch_size * D, device=dev).reshape(fb.batch_size, D),
                retrieve_next_token=torch.tensor([l[0] for l in links], dtype=torch.int64, device=dev),
                retrieve_next_sibling=torch.tensor([l[1] for l in links], dtype=torch.int64, device=dev),
                retrieve_cum_len=torch.arange(fb.batch_size + 1, dtype=torch.int32, device=dev) * D,
                spec_steps=info.spec_steps, topk=info.topk, draft_token_num=D,
                capture_hidden_mode=sgl.CaptureHiddenMode.FULL, seq_lens_sum=out.seq_lens_sum,
                seq_lens_cpu=out.seq_lens_cpu)
            out.spec_algorithm = sgl.SpeculativeAlgorithm.EAGLE
        return out

    # ---- the protocol ----
    def init_forward_metadata(self, forward_batch) -> None:
        self._ensure_built(forward_batch)
        sfb = self.translate(forward_batch)
        self.batches = {id(forward_batch): sfb}
        with self.sgl.forward_context(self.sgl.ForwardContext(attn_backend=self.inner)):
            self.inner.init_forward_metadata(sfb)

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> o ``[T, Hq, Dv]`` through SGLang's layer."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("forward before init_forward_metadata planned this batch")
        T = q.shape[0]
        with torch.no_grad(), self.sgl.forward_context(self.sgl.ForwardContext(attn_backend=self.inner)):
            o = self._layer(layer)(q.reshape(T, layer.tp_q_head_num * layer.head_dim),
                                   k.reshape(T, layer.tp_k_head_num * layer.head_dim),
                                   v.reshape(T, layer.tp_v_head_num * layer.v_head_dim), sfb, save_kv_cache=save_kv_cache)
        return o.reshape(T, layer.tp_q_head_num, layer.v_head_dim)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    # ---- inspection ----
    def engine_objects(self) -> tuple[object | None, list[object], type]:
        """(SGLang wrapper or None, the SGLang backends under it, SGLang's base class): what conformance reads."""
        return None, [self.inner], self.sgl.AttentionBackend

    def planned_metadata(self) -> PlannedMetadata:
        """SGLang's ``forward_metadata`` where it keeps one (Triton: token-level indptrs and slots)."""
        meta = getattr(self.inner, "forward_metadata", None)
        if meta is None:
            return PlannedMetadata()
        decode = next(iter(self.batches.values())).forward_mode.is_decode_or_idle()
        return PlannedMetadata(qo_indptr=getattr(meta, "qo_indptr", None), kv_indptr=meta.kv_indptr,
                               kv_indices=meta.kv_indices, kv_includes_new_tokens=decode,
                               custom_mask=getattr(meta, "custom_mask", None),
                               mask_indptr=getattr(meta, "mask_indptr", None))


class SglangTorchNative(SglangBackend):
    sglang_name = "torch_native"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        modes=ADAPTED_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # TorchNativeAttnBackend reads seq_lens as the key length and never the custom mask: verify crashes
        # (torch_native_backend.py, _run_sdpa_forward_extend). Declared, so the rows skip with this reason.
        custom_mask=False,
        logit_cap=False,  # it never reads layer.logit_cap
        requires=("sglang",),
        engine="sglang",
        empty_extend=True,  # its per-request SDPA loop takes a request with no new tokens
    )


# Where SGLang's Triton kernels change shape. Decode (kernels/ops/attention/decode_attention.py:308): each split
# holds kv_len_per_split = cdiv(cdiv(L, splits), MIN_BLOCK_KV=32) * 32 keys of at most
# triton_attention_num_kv_splits = 8 splits (all 8 on a CPU, where the device core count is 0,
# triton_backend.py:448): split k is non-empty past 32 * k, and every split grows past 8 * 32 = 256. Extend
# (extend_attention.py:75-138): BLOCK_M x BLOCK_N of 64 x 64 on a CPU, 128/64/32 x 64 on an H100.
SGLANG_TRITON_BOUNDARIES = frozenset({32 * k for k in range(1, 9)} | {128})


class SglangTriton(SglangBackend):
    sglang_name = "triton"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        modes=ADAPTED_MODES,
        dtypes=frozenset({"float32", "bfloat16", "float16"}),  # on the CPU only float32/16: see cpu_dtypes
        cpu_dtypes=frozenset({"float32", "float16"}),  # the interpreter's bf16 tl.dot is broken (error ~1e10)
        requires=("sglang", "triton"),
        cpu_needs_env="TRITON_INTERPRET",
        # tanh as 2*sigmoid(2x) - 1 (kernels/ops/attention/extend_attention.py:208, decode_attention.py:229)
        softcap_via_sigmoid=True,
        fp32_matmul_roundoff=2.0**-21,  # float32 dots on NVIDIA GPUs run as tf32x3
        engine="sglang",
        wrapped_gaps=(TBO_MIXED_GAP,),
        length_boundaries=SGLANG_TRITON_BOUNDARIES,
        verify_window=True,  # declared, so a disagreement is a finding (see docs/findings/)
        empty_extend=True,  # its extend grid counts max(0, extend_len) tiles (extend_attention.py:191)
    )


class _TboChild(SglangBackend):
    """One of SGLang's TBO child backends, as the engine sees it: it runs a child batch's layers under a
    forward context whose backend is that child (``batch_overlap/operations.py``)."""

    def __init__(self, parent: "SglangTbo", index: int) -> None:  # noqa: D107 - shares the parent's runner
        self.model_runner, self.sgl, self.sgl_runner = parent.model_runner, parent.sgl, parent.primary.sgl_runner
        self.inner = parent.inner.children[index]
        self.radix = parent.primary.radix  # the model's layer objects are the same for both halves
        self.batches = {}

    def init_forward_metadata(self, forward_batch) -> None:
        raise RuntimeError("a TBO child is planned by its wrapper (TboAttnBackend.init_forward_metadata)")

    def planned_metadata(self) -> PlannedMetadata:
        """An empty half is neither planned (TboAttnBackend skips it) nor run: whatever its backend kept
        from an earlier batch is no plan of this one."""
        if not self.batches or next(iter(self.batches.values())).batch_size == 0:
            return PlannedMetadata()
        return super().planned_metadata()


class SglangTbo(_SglangObject):
    """SGLang's ``TboAttnBackend`` over one SGLang backend, with SGLang's own splitter
    (``compute_split_seq_index`` + ``TboForwardBatchPreparer.prepare``).

    Planning splits the batch as SGLang's scheduler and model runner do, then hands the engine harness-side
    child batches that carry SGLang's split (its token counts, positions and mrope rows, per-request fields),
    so each half's layers run on exactly what SGLang's preparer made of it.
    """

    is_wrapper = True

    def __init__(self, leaf: type[SglangBackend], model_runner) -> None:
        self.model_runner = model_runner
        self.leaf = leaf
        self.primary = leaf(model_runner)
        self.sgl = self.primary.sgl
        self.inner = None
        self.children: list[_TboChild] = []
        self.split: TboSplit | None = None

    def _ensure_built(self, fb) -> None:
        before = self.primary.inner
        self.primary._ensure_built(fb)
        if self.inner is None or self.primary.inner is not before:
            make = lambda: self.sgl.ATTENTION_BACKENDS[self.leaf.sglang_name](self.primary.sgl_runner)  # noqa: E731
            self.inner = self.sgl.TboAttnBackend(primary=self.primary.inner, children=[make(), make()])
            self.children = [_TboChild(self, 0), _TboChild(self, 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        fb, sgl = forward_batch, self.sgl
        self._ensure_built(fb)
        sfb = self.primary.translate(fb)
        tbo = sgl.two_batch_overlap
        sfb.tbo_split_seq_index = tbo.compute_split_seq_index(
            forward_mode=sfb.forward_mode, num_tokens=fb.extend_num_tokens,
            extend_lens=sfb.extend_seq_lens_cpu if sfb.forward_mode.is_extend() else None,
            token_num_per_seq=tbo.get_token_num_per_seq(sfb.forward_mode, sfb.spec_info))
        with sgl.forward_context(sgl.ForwardContext(attn_backend=self.inner)):
            tbo.TboForwardBatchPreparer.prepare(sfb)  # asserts the active backend is a TboAttnBackend
            self.inner.init_forward_metadata(sfb)
        self.primary.batches = {id(fb): sfb}
        fb.tbo_children, self.split = None, None
        if not sfb.tbo_children:
            return
        kids = []
        for child, schild in zip(self.children, sfb.tbo_children):
            n = schild.batch_size
            # The halves overlap in one request when SGLang cuts it in two (a two-chunk split).
            start = 0 if child is self.children[0] else fb.batch_size - n
            kid = self._harness_child(fb, schild, slice(start, start + n))
            child.batches = {id(kid): schild}
            kids.append(kid)
        fb.tbo_children = kids
        t0 = kids[0].extend_num_tokens
        self.split = TboSplit(sfb.tbo_split_seq_index, t0,
                              two_chunk=kids[0].batch_size + kids[1].batch_size > fb.batch_size)

    @staticmethod
    def _harness_child(fb, schild, req: slice):
        """The harness's view of one of SGLang's child batches (what the engine and the properties read)."""
        def cpu_list(x):
            return None if x is None else (list(x) if not isinstance(x, torch.Tensor) else x.tolist())
        T = int(schild.out_cache_loc.shape[0])
        seq = schild.seq_lens_cpu.tolist()
        if fb.forward_mode.is_target_verify():  # SGLang drops a verify child's extend_* fields
            D = fb.spec_info.draft_token_num
            extend, prefix = [D] * schild.batch_size, [int(s) for s in seq]
        else:  # a decode child has none either: one new token after seq_len - 1 cached ones
            extend = cpu_list(schild.extend_seq_lens_cpu) or [1] * schild.batch_size
            prefix = cpu_list(schild.extend_prefix_lens_cpu) or [int(s) - 1 for s in seq]
        return dataclasses.replace(
            fb, batch_size=schild.batch_size, req_pool_indices=schild.req_pool_indices,
            seq_lens=schild.seq_lens.to(fb.seq_lens.dtype), seq_lens_cpu=schild.seq_lens_cpu.to(torch.int64),
            seq_lens_sum=int(schild.seq_lens_cpu.sum()),
            extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=fb.device),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=fb.device),
            extend_start_loc=torch.tensor([sum(extend[:i]) for i in range(len(extend))], dtype=torch.int32,
                                          device=fb.device),
            extend_seq_lens_cpu=extend, extend_prefix_lens_cpu=prefix, extend_num_tokens=T,
            positions=schild.positions, mrope_positions=schild.mrope_positions, out_cache_loc=schild.out_cache_loc,
            state_slots=fb.state_slots[req],
            spec_info=None if fb.spec_info is None else slice_spec_info(fb.spec_info, fb.seq_lens_cpu.tolist(), req),
            num_token_non_padded=T, tbo_split_seq_index=None, tbo_split_token_index=None, tbo_children=None)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def planned_metadata(self) -> PlannedMetadata:
        return self.primary.planned_metadata()

    def engine_objects(self) -> tuple[object | None, list[object], type]:
        return self.inner, [self.inner.primary, *self.inner.children], self.sgl.AttentionBackend
