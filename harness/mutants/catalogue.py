"""A catalogue of real bug classes, injected at run time into our own backends, wrappers and batch
construction (no file is edited: each mutant is a context manager that patches and restores).

Each entry names the bug and its real-world symptom in one line, and the compositions whose search should
catch it. ``python -m harness mutants`` runs each mutant's compositions under a profile until the first
failing property, and reports which were killed, how fast, and how small the shrunk reproducer was.
Mutants marked ``crashes`` kill or hang the whole process (as an illegal memory access or a deadlocked
kernel does); they only ever run in a child process, where the death or the stall is the catch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import ContextManager
from unittest import mock

import torch

from harness.options import UsageError

CPU_HYBRID = "hybrid(torch_native,linear_torch)"


@dataclass(frozen=True)
class Mutant:
    name: str
    doc: str  # the bug, then the symptom users saw
    targets: tuple[str, ...]  # composition terms to search
    properties: tuple[str, ...] | None = None  # restrict the search (None: every property)
    modes: tuple[str, ...] | None = None  # and to these modes (None: every mode)
    needs_device: str | None = None  # the fault only exists on this device type (e.g. real graph capture)
    crashes: bool = False  # kills or hangs the process: run only in a child process (see harness.mutants.run)
    engine: str = "harness"  # whose code the fault is patched into: ours, or an engine's real classes

    def patch(self) -> ContextManager:
        """The fault, active inside the returned context: the module function named after the mutant (built now: one
        the installed release lacks raises MutantUnavailable here). Inside it, a case replayed alone in a fresh process
        runs under the mutant too (``search.search_row.REPLAY_MUTANT``): its own failure replayed without it would
        pass, and be counted away."""
        return _replayed_under(self.name, globals()[self.name]())


@contextlib.contextmanager
def _replayed_under(name: str, fault: ContextManager):
    from search import search_row

    before, search_row.REPLAY_MUTANT = search_row.REPLAY_MUTANT, name
    try:
        with fault:
            yield
    finally:
        search_row.REPLAY_MUTANT = before


class MutantUnavailable(UsageError):
    """The code a mutant patches is not in the installed release: ``harness mutants`` reports the mutant
    unavailable there, ``harness run --mutant`` says so in one line (exit 2)."""


def _replace(obj, attr, new):
    return mock.patch.object(obj, attr, new)


# ---- wrappers ---------------------------------------------------------------------------------------
def tbo_lacks_forward():
    from backends.base import AttentionBackend
    from backends.tbo import TboAttnBackend
    return _replace(TboAttnBackend, "forward", AttentionBackend.forward)


def tbo_mrope_dim0():
    import batch.tbo_split as tbo
    original = tbo.sub_batch

    def sub_batch(fb, req, tok, prefix, extend, mode=None):
        child = original(fb, req, tok, prefix, extend, mode)
        if fb.mrope_positions is not None:
            child.mrope_positions = fb.mrope_positions[tok]  # sliced on dim 0, not the token dim
        return child
    return _replace(tbo, "sub_batch", sub_batch)


def hybrid_lacks_mha_chunk():
    from backends.hybrid import HybridLinearAttnBackend
    return _without(HybridLinearAttnBackend, "init_mha_chunk_metadata")


def hybrid_extra_kwarg():
    from backends.hybrid import HybridLinearAttnBackend

    def init_mha_chunk_metadata(self, forward_batch, **kwargs):
        self.full_attn_backend.init_mha_chunk_metadata(forward_batch, disable_flashinfer_ragged=False)
    return _replace(HybridLinearAttnBackend, "init_mha_chunk_metadata", init_mha_chunk_metadata)


def backend_lacks_update_verify():
    from backends.base import AttentionBackend
    from backends.torch_native import TorchNativeBackend
    return _replace(TorchNativeBackend, "update_verify_buffers_to_fill_after_draft",
                    AttentionBackend.update_verify_buffers_to_fill_after_draft)


def hybrid_dispatch_by_type():
    from backends.hybrid import HybridLinearAttnBackend
    from batch.layers import AttentionLayer

    def _backend_for(self, layer):
        return self.full_attn_backend if isinstance(layer, AttentionLayer) else self.linear_attn_backend
    return _replace(HybridLinearAttnBackend, "_backend_for", _backend_for)


def draft_worker_target_layout():
    import backends.registry as registry
    from batch.spec import BatchSpec

    def layout(spec: BatchSpec):
        # The target model's layout (full attention every 4th layer), kept by the draft worker.
        return (3, 7, 11, 15) if spec.draft_worker else spec.full_attn_layers
    return _replace(registry, "hybrid_full_attn_layers", layout)


def tbo_verify_split_token():
    import batch.tbo_split as tbo
    from batch.spec import ForwardMode
    original = tbo.compute_split

    def compute_split(mode, extend_lens, draft_token_num=None):
        split = original(mode, extend_lens, draft_token_num)
        if split is not None and mode is ForwardMode.TARGET_VERIFY:
            return tbo.TboSplit(split.split_seq, split.split_seq)  # forgot * draft_token_num
        return split
    return _replace(tbo, "compute_split", compute_split)


def two_chunk_prefix_not_grown():
    import batch.tbo_split as tbo
    original = tbo.split_forward_batch

    def split_forward_batch(fb, split):
        if not split.two_chunk:
            return original(fb, split)
        prefix, extend = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        s, t = split.split_seq, split.split_token
        part_a = t - sum(extend[:s])
        a = tbo.sub_batch(fb, slice(0, s + 1), slice(0, t), prefix[: s + 1], extend[:s] + [part_a])
        b = tbo.sub_batch(fb, slice(s, len(extend)), slice(t, fb.extend_num_tokens),
                          prefix[s:], [extend[s] - part_a] + extend[s + 1:])  # prefix of request s not grown
        return [a, b]
    return _replace(tbo, "split_forward_batch", split_forward_batch)


# ---- backends ---------------------------------------------------------------------------------------
def gqa_modulo_mapping():
    import backends.torch_native as tn
    original = tn.sdpa

    def sdpa(q, k, v, mask, scale):
        group = q.shape[1] // k.shape[1]
        return original(q, k.repeat(1, group, 1), v.repeat(1, group, 1), mask, scale)  # head h -> h % Hk
    return _replace(tn, "sdpa", sdpa)


def kv_written_one_slot_off():
    from batch.forward_batch import KVPool
    original = KVPool.set_kv_buffer

    def set_kv_buffer(self, layer_id, loc, k, v, *args, **kwargs):  # the fp8 scales pass through
        original(self, layer_id, loc + 1, k, v, *args, **kwargs)
    return _replace(KVPool, "set_kv_buffer", set_kv_buffer)


def soft_cap_silently_dropped():
    import backends.torch_native as tn
    return _replace(tn, "refuse_logit_cap", lambda layer: None)


def draft_branches_read_first_branch():
    import backends.draft as draft
    table_of = draft.branch_table

    def branch_table(fb, topk, steps, *window):
        table, prefix = table_of(fb, topk, steps, *window)
        for r in range(fb.batch_size):  # every branch of a request keyed by its first branch's draft slots
            table[1 + r * topk + 1:1 + (r + 1) * topk] = table[1 + r * topk]
        return table, prefix
    return _replace(draft, "branch_table", branch_table)


def draft_graph_table_kept_from_capture():
    import backends.draft as draft
    plan = draft.MultiStepDraft.init_forward_metadata_out_graph

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if in_capture:
            return plan(self, forward_batch, in_capture=True)
        static = self.graph_table
        self.graph_table = static.clone()  # the replay's branch table written where no step reads it
        try:
            plan(self, forward_batch, in_capture=False)
        finally:
            self.graph_table = static
    return _replace(draft.MultiStepDraft, "init_forward_metadata_out_graph", init_forward_metadata_out_graph)


def plan_cached_by_shape():
    import backends.torch_native as tn
    plan = tn.TorchNativeBackend.init_forward_metadata

    def init_forward_metadata(self, forward_batch):
        key = (forward_batch.forward_mode, forward_batch.batch_size, forward_batch.extend_num_tokens)
        plans = self.__dict__.setdefault("plans_by_shape", {})
        if key not in plans:  # planned once per shape, then reused for every batch of that shape
            plan(self, forward_batch)
            plans[key] = self.forward_metadata
        self.forward_metadata = plans[key]
    return _replace(tn.TorchNativeBackend, "init_forward_metadata", init_forward_metadata)


def sm_scale_wrong():
    import backends.torch_native as tn
    original = tn.sdpa

    def sdpa(q, k, v, mask, scale):
        return original(q, k, v, mask, 1.0 / q.shape[-1])
    return _replace(tn, "sdpa", sdpa)


def prefix_drops_last_token():
    import backends.planner as planner
    original = planner.token_kv_indices

    def token_kv_indices(req_to_token, req_pool_indices, kv_lens):
        return original(req_to_token, req_pool_indices, (kv_lens - 1).clamp(min=0))
    return _replace(planner, "token_kv_indices", token_kv_indices)


def verify_mask_transposed():
    import backends.planner as planner
    from batch.masks import tree_mask
    original = planner.plan_token_level

    def plan_token_level(fb):
        meta = original(fb)
        if fb.forward_mode.is_target_verify():
            blocks = []
            for i, seq_len in enumerate(fb.seq_lens_cpu.tolist()):
                tree = tree_mask(tuple(fb.spec_info.parents[i].tolist())).t()  # descendants instead of ancestors
                blocks.append(torch.cat([torch.ones(tree.shape[0], seq_len, dtype=torch.bool), tree], 1).reshape(-1))
            meta.custom_mask = torch.cat(blocks).to(fb.device)
        return meta
    return _patch_token_plans(plan_token_level)


def draft_positions_by_index():
    import engine.materialize as materialize

    def tree_depths(parents):
        return torch.arange(parents.shape[1]).expand_as(parents).clone()  # index in the tree, not depth
    return _replace(materialize, "tree_depths", tree_depths)


def stale_graph_replay():
    from backends.triton import TritonBackend
    original = TritonBackend.init_forward_metadata_out_graph

    def out_graph(self, forward_batch, in_capture=False):
        if in_capture:
            return original(self, forward_batch, in_capture=True)
        return None  # before a replay: keeps the capture-time plan
    return _replace(TritonBackend, "init_forward_metadata_out_graph", out_graph)


def graph_verify_mask_stale():
    from backends.triton import TritonBackend
    original = TritonBackend._plan_graph

    def _plan_graph(self, fb):
        buffers = self.graph_buffers
        mask = buffers["custom_mask"].clone() if buffers.get("mask_planned") else None
        original(self, fb)
        if mask is not None:  # a replay: the tree mask (a verify-only buffer) keeps what the capture planned
            buffers["custom_mask"].copy_(mask)
        buffers["mask_planned"] = fb.forward_mode.is_target_verify()
    return _replace(TritonBackend, "_plan_graph", _plan_graph)


def decode_ignores_sliding_window():
    import backends.triton_kernels.decode_attention as dec
    original = dec.decode_attention_fwd

    def decode_attention_fwd(*args, **kwargs):
        kwargs["sliding_window"] = -1
        return original(*args, **kwargs)
    return _replace(dec, "decode_attention_fwd", decode_attention_fwd)


def extend_drops_logit_cap():
    import backends.triton_kernels.extend_attention as ext
    original = ext.extend_attention_fwd

    def extend_attention_fwd(*args, **kwargs):
        kwargs["logit_cap"] = 0.0
        return original(*args, **kwargs)
    return _replace(ext, "extend_attention_fwd", extend_attention_fwd)


def mla_last_chunk_dropped():
    import backends.torch_native as tn
    original = tn.TorchNativeBackend.init_mha_chunk_metadata

    def init_mha_chunk_metadata(self, forward_batch):
        original(self, forward_batch)
        if len(self.mha_chunk["chunks"]) > 1:
            self.mha_chunk["chunks"] = self.mha_chunk["chunks"][:-1]
    return _replace(tn.TorchNativeBackend, "init_mha_chunk_metadata", init_mha_chunk_metadata)


# ---- axes of the generator: each mutant below is reachable only through one axis of batch_specs ----------
def _patch_token_plans(plan):
    """Patch the token-level planner where torch_native and triton look it up (both import it by name)."""
    import backends.torch_native as torch_native
    import backends.triton as triton

    @contextlib.contextmanager
    def patched():
        with _replace(torch_native, "plan_token_level", plan), _replace(triton, "plan_token_level", plan):
            yield
    return patched()


def contiguous_pages_read_as_one_run():
    import backends.planner as planner
    original = planner.plan_token_level

    def plan_token_level(fb):
        meta = original(fb)
        ps, B = fb.page_size, fb.batch_size
        if ps == 1 or B < 2 or meta.kv_indices is None or fb.forward_mode.is_idle():
            return meta
        lens = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).tolist()
        idx = meta.kv_indices.tolist()
        pages, start = [], 0
        for n in lens:
            if n <= ps:  # the fast path is for requests spread over several pages
                return meta
            pages += [s // ps for s in idx[start:start + n:ps]]
            start += n
        if pages == list(range(pages[0], pages[0] + len(pages))):  # one run of pages: read it as one run of slots
            first = idx[0]
            meta.kv_indices = torch.arange(first, first + len(idx), dtype=meta.kv_indices.dtype,
                                           device=meta.kv_indices.device)
        return meta
    return _patch_token_plans(plan_token_level)


def decode_merge_drops_last_split():
    import backends.triton_kernels.decode_attention as dec
    real = dec._decode_merge_kernel

    class MergeAllButLast:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kwargs):
                kwargs["NUM_SPLITS"] = max(kwargs["NUM_SPLITS"] - 1, 1)  # the merge loop stops one split short
                return launch(*args, **kwargs)
            return run
    return _replace(dec, "_decode_merge_kernel", MergeAllButLast())


def verify_window_by_row():
    from backends.torch_native import TorchNativeBackend
    original = TorchNativeBackend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        fb = forward_batch
        if fb.spec_info is None or fb.spec_info.custom_mask is None:
            return original(self, q, k, v, layer, fb, *args, **kwargs)
        # The window reads each draft's row (prefix + row index) as its position, not prefix + tree depth.
        real = fb.positions
        lens = fb.extend_seq_lens.to(torch.int64)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        fb.positions = torch.repeat_interleave(fb.extend_prefix_lens.to(torch.int64), lens) + \
            torch.arange(int(lens.sum()), device=real.device) - starts
        try:
            return original(self, q, k, v, layer, fb, *args, **kwargs)
        finally:
            fb.positions = real
    return _replace(TorchNativeBackend, "forward_extend", forward_extend)


def empty_extend_shifts_requests():
    import backends.planner as planner
    original = planner.plan_token_level

    def plan_token_level(fb):
        meta = original(fb)
        if fb.forward_mode.is_decode() or fb.forward_mode.is_idle() or fb.spec_info is not None:
            return meta
        # Per-request counts taken from per-token request ids: a request with no token has no count, and the
        # indptr is padded at the end to the batch size.
        owner = torch.repeat_interleave(torch.arange(fb.batch_size, device=fb.device), fb.extend_seq_lens.to(torch.int64))
        counts = torch.unique_consecutive(owner, return_counts=True)[1]
        indptr = planner.exclusive_cumsum(counts)
        meta.qo_indptr = torch.cat([indptr, indptr[-1:].expand(fb.batch_size + 1 - indptr.numel())])
        return meta
    return _patch_token_plans(plan_token_level)


def sglang_mha_decode_drops_logit_cap():
    from backends.sglang.runtime import load
    load()
    import sglang.kernels.ops.attention.decode_attention as dec
    original = dec.decode_attention_fwd_normal

    def decode_attention_fwd_normal(*args, **kwargs):
        kwargs["logit_cap"] = 0.0  # the grouped (GQA/MQA) branch passes it; this one forgot
        return original(*args, **kwargs)
    return _replace(dec, "decode_attention_fwd_normal", decode_attention_fwd_normal)


# ---- process killers (crashes=True) --------------------------------------------------------------------
def _kv_pages(forward_batch) -> int:
    """Pages in the batch's page table (every request's context, rounded up to whole pages)."""
    return sum(-(-n // forward_batch.page_size) for n in forward_batch.seq_lens_cpu.tolist())


def decode_segfault_past_page_table():
    from backends.torch_native import TorchNativeBackend
    original = TorchNativeBackend.forward_decode

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if _kv_pages(forward_batch) > 2:
            os.kill(os.getpid(), signal.SIGSEGV)  # what an out-of-bounds page-table read does to the process
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    return _replace(TorchNativeBackend, "forward_decode", forward_decode)


def decode_illegal_address_past_page_table():
    from backends.torch_native import TorchNativeBackend
    original = TorchNativeBackend.forward_decode

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if _kv_pages(forward_batch) > 2:
            _store_far_past(q)  # the page table's end read past on the GPU itself: the context faults
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    return _replace(TorchNativeBackend, "forward_decode", forward_decode)


_WILD_STORE = []


def _store_far_past(x: torch.Tensor) -> None:
    """One Triton store 2^40 elements past ``x``: an address no allocation maps, so the GPU raises a fatal fault
    (an illegal memory access) asynchronously, as a kernel reading past its page table does."""
    if not _WILD_STORE:
        import triton
        import triton.language as tl

        @triton.jit
        def wild_store(ptr, offset):
            tl.store(ptr + offset, tl.load(ptr))

        _WILD_STORE.append(wild_store)
    _WILD_STORE[0][(1,)](x, 1 << 40)


def extend_hangs_past_two_pages():
    from backends.torch_native import TorchNativeBackend
    original = TorchNativeBackend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.value == "extend" and _kv_pages(forward_batch) > 2:
            while True:  # a kernel waiting on a barrier no other block reaches
                time.sleep(3600)
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    return _replace(TorchNativeBackend, "forward_extend", forward_extend)


# ---- linear attention ---------------------------------------------------------------------------------
def state_slot_is_request_row():
    import backends.linear_torch as lt
    original = lt.LinearTorchBackend.init_forward_metadata

    def init_forward_metadata(self, forward_batch):
        original(self, forward_batch)
        self.forward_metadata.state_slots = forward_batch.req_pool_indices.clone()  # the row, not its slot
    return _replace(lt.LinearTorchBackend, "init_forward_metadata", init_forward_metadata)


def conv_state_not_saved():
    import backends.linear_torch as lt
    original = lt.conv_with_state

    def conv_with_state(x, weight, state):
        y, steps = original(x, weight, state)
        return y, steps * 0 + state[None]  # the state never advances
    return _replace(lt, "conv_with_state", conv_with_state)


def fresh_request_reads_pool():
    import backends.linear_torch as lt

    @contextlib.contextmanager
    def cm():
        saved = lt.LinearTorchBackend.forward

        def forward(self, *args, **kwargs):
            fb = kwargs["forward_batch"]
            real = fb.extend_prefix_lens_cpu
            fb.extend_prefix_lens_cpu = [1] * len(real)  # every request 'has' a prefix
            try:
                return saved(self, *args, **kwargs)
            finally:
                fb.extend_prefix_lens_cpu = real
        lt.LinearTorchBackend.forward = forward
        try:
            yield
        finally:
            lt.LinearTorchBackend.forward = saved
    return cm()


def commit_wrong_position():
    import backends.linear_torch as lt
    original = lt.LinearTorchBackend.update_mamba_state_after_mtp_verify

    def update(self, last_correct_step_indices, *args, **kwargs):
        return original(self, (last_correct_step_indices - 1).clamp(min=0), *args, **kwargs)
    return _replace(lt.LinearTorchBackend, "update_mamba_state_after_mtp_verify", update)


def state_slot_bound_by_request_rows():
    import backends.linear_torch as lt
    original = lt.LinearTorchBackend.init_forward_metadata

    def init_forward_metadata(self, forward_batch):
        original(self, forward_batch)
        # Slots are bounds-checked against the request-row count, not the state pool's size: a slot past it is
        # taken for padding (slot 0), so that request reads and writes the padding slot.
        slots, rows = self.forward_metadata.state_slots, forward_batch.req_to_token.shape[0]
        self.forward_metadata.state_slots = torch.where(slots < rows, slots, torch.zeros_like(slots))
    return _replace(lt.LinearTorchBackend, "init_forward_metadata", init_forward_metadata)


def commit_skips_tracked_copy():
    import backends.linear_torch as lt
    original = lt.LinearTorchBackend.update_mamba_state_after_mtp_verify

    def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None, model=None,
               req_pool_indices=None):
        return original(self, last_correct_step_indices, None, None, model, req_pool_indices)
    return _replace(lt.LinearTorchBackend, "update_mamba_state_after_mtp_verify", update)


def fp8_dequant_ignores_scale():
    import backends.torch_native as tn
    original = tn.dequantize_kv

    def dequantize_kv(x, dtype, scale=1.0):
        return original(x, dtype)  # the e4m3 payload taken for the value
    return _replace(tn, "dequantize_kv", dequantize_kv)


def graph_drops_mrope():
    import engine.graph_runner as gr
    original = gr.GraphRunner.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.mrope_positions = self.fb.mrope_positions = None  # replays rotate by the 1-D positions
    return _replace(gr.GraphRunner, "__init__", __init__)


# ---- SGLang's own classes (harness mutants --engine sglang): bugs of the PRs this project started from ----
def sglang_tbo_mrope_dim0():
    from backends.sglang.runtime import load
    load()  # SGLang imported the adapter's way (an inert torchvision where the real one is absent)
    from sglang.srt.batch_overlap.two_batch_overlap import TboForwardBatchPreparer as preparer
    original = preparer.filter_batch.__func__

    def filter_batch(cls, batch, *, start_token_index, end_token_index, **kwargs):
        child = original(cls, batch, start_token_index=start_token_index, end_token_index=end_token_index, **kwargs)
        if batch.mrope_positions is not None:  # sliced on dim 0 (the 3 rotary rows), not the token dim 1
            child.mrope_positions = batch.mrope_positions[start_token_index:end_token_index]
        return child
    return _replace(preparer, "filter_batch", classmethod(filter_batch))


def sglang_triton_lacks_update_verify():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as base
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    return _replace(TritonAttnBackend, "update_verify_buffers_to_fill_after_draft",
                    base.update_verify_buffers_to_fill_after_draft)


def sglang_tbo_lacks_forward():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as base
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    return _replace(TboAttnBackend, "forward", base.forward)


def sglang_draft_target_layout():
    from backends.sglang.runtime import load
    sgl = load()
    registry = sgl.attention_registry
    original = registry.attn_backend_wrapper

    def attn_backend_wrapper(runner, full_attn_backend):
        backend = original(runner, full_attn_backend)
        if runner.is_draft_worker and isinstance(backend, sgl.HybridLinearAttnBackend):
            # the draft worker keeps the target model's full-attention layer ids (before #27120)
            backend.full_attn_layers = registry.mambaish_config(runner.model_config).full_attention_layer_ids
        return backend
    return _replace(registry, "attn_backend_wrapper", attn_backend_wrapper)


def sglang_hybrid_dispatch_by_type():
    from backends.sglang.runtime import load
    sgl = load()

    def _is_full_attn(self, layer, layer_id=None):
        # sgl-project/sglang#23331's shortcut (reverted to id dispatch by #27120): the layer object's type first
        if isinstance(layer, sgl.RadixLinearAttention):
            return False
        if isinstance(layer, sgl.RadixAttention):
            return True
        return (layer.layer_id if layer_id is None else layer_id) in self.full_attn_layers
    return _replace(sgl.HybridLinearAttnBackend, "_is_full_attn", _is_full_attn)


@contextlib.contextmanager
def _without(cls, name):
    """``cls`` without its own ``name`` (hasattr turns False, unlike patching it to None)."""
    original = cls.__dict__[name]
    delattr(cls, name)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _cpu_full_child_with_mha_chunk(method):
    """SGLang's CPU backends plan no chunked prefix; the seeds' CPU form gives TorchNative the method that
    FlashInferMLA / TRT-LLM MLA have (the GPU form needs an MLA hybrid)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    return mock.patch.object(TorchNativeAttnBackend, "init_mha_chunk_metadata", method, create=True)


@contextlib.contextmanager
def sglang_hybrid_lacks_mha_chunk():
    from backends.sglang.runtime import load
    sgl = load()
    with _cpu_full_child_with_mha_chunk(lambda self, forward_batch, disable_flashinfer_ragged=False: None), \
            _without(sgl.HybridLinearAttnBackend, "init_mha_chunk_metadata"):
        yield


def sglang_one_arg_mha_chunk():
    from backends.sglang.runtime import load
    load()
    return _cpu_full_child_with_mha_chunk(lambda self, forward_batch: None)


def sglang_trtllm_mla_one_arg_mha_chunk():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.trtllm_mla_backend import TRTLLMMLABackend
    return mock.patch.object(TRTLLMMLABackend, "init_mha_chunk_metadata", lambda self, forward_batch: None)


def sglang_fa3_replay_keeps_capture_plan():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend
    planned = FlashAttentionBackend.init_forward_metadata_out_graph

    def out_graph(self, forward_batch, in_capture=False):
        if in_capture:  # the capture plans; a replay leaves the captured plan in place
            planned(self, forward_batch, in_capture)
    return _replace(FlashAttentionBackend, "init_forward_metadata_out_graph", out_graph)


def sglang_triton_replay_pads_real_rows():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    planned = TritonAttnBackend.init_forward_metadata_out_graph

    def out_graph(self, forward_batch, in_capture=False):
        if not in_capture and forward_batch.forward_mode.is_decode_or_idle():
            # the padding's fill value written over every row's length, real ones included
            forward_batch.seq_lens.fill_(self.get_cuda_graph_seq_len_fill_value())
        planned(self, forward_batch, in_capture)
    return _replace(TritonAttnBackend, "init_forward_metadata_out_graph", out_graph)


def sglang_triton_verify_replay_mask_without_drafts():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    planned = TritonAttnBackend._update_target_verify_buffers

    def update(self, plan, bs, seq_lens, spec_info, req_pool_indices):
        out = planned(self, plan, bs, seq_lens, spec_info, req_pool_indices)
        # each request's mask taken as D x seq_len, its drafts' own D columns forgotten
        D = self._target_verify_num_tokens_per_req(spec_info)
        self.mask_indptr[1:bs + 1] = torch.cumsum(D * seq_lens[:bs], dim=0)
        return out
    return _replace(TritonAttnBackend, "_update_target_verify_buffers", update)


def sglang_triton_draft_extend_replay_keys_twice():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    planned = TritonAttnBackend._update_draft_extend_buffers

    def update(self, plan, bs, seq_lens, forward_mode, spec_info, req_pool_indices):
        # the accepted tokens' counts not read: the prefix planned as the whole seq_len, new tokens included
        return planned(self, plan, bs, seq_lens, forward_mode, None, req_pool_indices)
    return _replace(TritonAttnBackend, "_update_draft_extend_buffers", update)


def sglang_triton_draft_step_keeps_previous_plan():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend
    planned = TritonMultiStepDraftBackend.init_forward_metadata

    def init_forward_metadata(self, forward_batch):
        planned(self, forward_batch)
        for i in range(len(self.attn_backends) - 1, 0, -1):  # each step left with the step before's plan
            self.attn_backends[i].forward_metadata = self.attn_backends[i - 1].forward_metadata
    return _replace(TritonMultiStepDraftBackend, "init_forward_metadata", init_forward_metadata)


def sglang_triton_draft_replay_keeps_capture_plan():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend
    planned = TritonMultiStepDraftBackend.init_forward_metadata_out_graph

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if in_capture:
            planned(self, forward_batch, in_capture=True)
        # a replay plans nothing: every step keeps the capture batch's key lists
    return _replace(TritonMultiStepDraftBackend, "init_forward_metadata_out_graph", init_forward_metadata_out_graph)


def sglang_tbo_replay_right_half_reads_left_lengths():
    from backends.sglang.runtime import load
    load()
    import sglang.srt.layers.attention.tbo_backend as tbo_backend
    built = getattr(tbo_backend, "_build_tbo_child_replay_fb_view", None)
    if built is None:  # releases before the three-method contract split in TboAttnBackend._init_..._cuda_graph_split
        raise MutantUnavailable("sglang_tbo_replay_right_half_reads_left_lengths: this SGLang's TboAttnBackend has no "
                                "_build_tbo_child_replay_fb_view (the three-method graph contract's replay split)")

    def build(fb_view, *, child_bs, seq_slice, tok_slice, token_num_per_seq):
        view = built(fb_view, child_bs=child_bs, seq_slice=seq_slice, tok_slice=tok_slice,
                     token_num_per_seq=token_num_per_seq)
        # every half's lengths sliced from the batch's first rows (the left half's), not its own
        view.seq_lens, view.seq_lens_cpu = fb_view.seq_lens[:child_bs], fb_view.seq_lens_cpu[:child_bs]
        view.seq_lens_sum = int(view.seq_lens_cpu.sum())
        return view
    return _replace(tbo_backend, "_build_tbo_child_replay_fb_view", build)


def sglang_trtllm_mha_verify_replay_drops_last_draft():
    from backends.sglang.runtime import load
    load()
    import sglang.srt.layers.attention.trtllm_mha_backend as trtllm
    update = getattr(trtllm, "update_trtllm_mha_graph_metadata", None)
    if update is None:  # before its fused graph metadata kernel (0.5.2x)
        raise MutantUnavailable("sglang_trtllm_mha_verify_replay_drops_last_draft: this SGLang's TRT-LLM MHA has no "
                                "update_trtllm_mha_graph_metadata (its fused graph metadata kernel)")

    def fused(*, seqlen_offset, **kwargs):
        # a verify graph's key counts one short: each request's last draft token left out of its keys
        offset = seqlen_offset - 1 if seqlen_offset > 1 else seqlen_offset
        return update(seqlen_offset=offset, **kwargs)
    return _replace(trtllm, "update_trtllm_mha_graph_metadata", fused)


def sglang_draft_window_sinks_dropped():
    from backends.sglang.runtime import load
    load()
    import sglang.srt.layers.attention.triton_backend as triton_backend
    resolve = getattr(triton_backend, "resolve_draft_decode_window", None)
    if resolve is None:
        raise MutantUnavailable("sglang_draft_window_sinks_dropped: this SGLang has no draft window over the prefix "
                                "(resolve_draft_decode_window, 0.5.22 on)")

    def without_sinks(model_runner):
        window, _ = resolve(model_runner)
        return window, 0  # --speculative-draft-sink-size read as unset
    return _replace(triton_backend, "resolve_draft_decode_window", without_sinks)


def sglang_triton_verify_plans_from_host_lengths():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    planned = TritonAttnBackend.init_forward_metadata

    def plan_from_host(self, forward_batch):
        if not forward_batch.forward_mode.is_target_verify() or forward_batch.seq_lens_cpu is None:
            return planned(self, forward_batch)
        device_lens = forward_batch.seq_lens
        # the verify planned from the host copy of the lengths, as if it always equalled the device's
        forward_batch.seq_lens = forward_batch.seq_lens_cpu.to(device_lens.device, device_lens.dtype)
        try:
            return planned(self, forward_batch)
        finally:
            forward_batch.seq_lens = device_lens
    return _replace(TritonAttnBackend, "init_forward_metadata", plan_from_host)


def sglang_triton_extend_prefix_from_new_lens():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    planned = TritonAttnBackend.init_forward_metadata

    def plan_by_new_lens(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.name not in ("EXTEND", "MIXED"):  # a prefill (or mixed) batch, not a verify or a draft extend
            return planned(self, forward_batch)
        prefix, prefix_cpu = forward_batch.extend_prefix_lens, forward_batch.extend_prefix_lens_cpu
        # each request's cached keys counted by its new tokens (the two length fields mixed up)
        forward_batch.extend_prefix_lens = forward_batch.extend_seq_lens
        forward_batch.extend_prefix_lens_cpu = list(forward_batch.extend_seq_lens_cpu)
        try:
            return planned(self, forward_batch)
        finally:
            forward_batch.extend_prefix_lens, forward_batch.extend_prefix_lens_cpu = prefix, prefix_cpu
    return _replace(TritonAttnBackend, "init_forward_metadata", plan_by_new_lens)


def sglang_linear_replay_pads_into_last_state():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    planned = MambaAttnBackendBase._replay_metadata

    def replay_metadata(self, bs, *args, **kwargs):
        meta = planned(self, bs, *args, **kwargs)
        slots = meta.mamba_cache_indices[:bs]
        padded = slots == self.pad_slot_id
        if bool(padded.any()) and bool((~padded).any()):
            # padded rows given the last real request's state slot instead of the pad slot
            slots[padded] = slots[~padded][-1]
        return meta
    return _replace(MambaAttnBackendBase, "_replay_metadata", replay_metadata)


def _short_conv_backend():
    """SGLang's ShortConvAttnBackend (0.5.22 on: before it, LFM2's conv layer read the pool itself)."""
    from backends.sglang.runtime import load
    load()
    try:
        from sglang.srt.layers.attention.linear.short_conv_backend import ShortConvAttnBackend
    except ImportError:
        raise MutantUnavailable("this SGLang has no ShortConvAttnBackend (0.5.22 on): LFM2's conv layer reads the "
                                "pool itself") from None
    return ShortConvAttnBackend


def sglang_short_conv_drops_initial_state():
    backend = _short_conv_backend()
    planned = backend.init_forward_metadata

    def init_forward_metadata(self, forward_batch):
        planned(self, forward_batch)
        if self._has_initial_state is not None:  # every request treated as fresh: its cached conv window ignored
            self._has_initial_state = torch.zeros_like(self._has_initial_state)
    return _replace(backend, "init_forward_metadata", init_forward_metadata)


def sglang_short_conv_slots_by_request_row():
    backend = _short_conv_backend()
    handed = backend.conv_state_metadata

    def conv_state_metadata(self, layer_id, forward_batch):
        meta = handed(self, layer_id, forward_batch)
        if meta.cache_indices is None:
            return meta
        # the request's row in req_to_token, not its state slot (SGLang's LFM2 layer did this up to 0.5.21)
        rows = forward_batch.req_pool_indices[:meta.cache_indices.shape[0]].to(meta.cache_indices.dtype)
        return meta._replace(cache_indices=rows)
    return _replace(backend, "conv_state_metadata", conv_state_metadata)


def _mamba2_plan_zeroed(field: str):
    """SGLang's Mamba2Metadata.prepare_mixed with one tensor of its extend plan (``MixedMetadata.<field>``) zeroed."""
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata
    planned = Mamba2Metadata.prepare_mixed.__func__

    def prepare_mixed(cls, *args, **kwargs):
        meta = planned(cls, *args, **kwargs)
        plan = getattr(meta, "mixed_metadata", None)
        if plan is not None and getattr(plan, field) is not None:
            getattr(plan, field).zero_()
        return meta
    return _replace(Mamba2Metadata, "prepare_mixed", classmethod(prepare_mixed))


def sglang_mamba2_chunk_offsets_dropped():
    return _mamba2_plan_zeroed("chunk_offsets")  # every logical chunk taken to start at its physical chunk's start


def sglang_mamba2_prefix_states_dropped():
    return _mamba2_plan_zeroed("has_initial_states")  # a cached prefix's SSM and conv states never read


def _kda_backend():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.linear import kda_backend
    return kda_backend


def sglang_kda_safe_gate_dropped():
    dispatcher = _kda_backend().KDAKernelDispatcher
    extend = dispatcher.extend

    def extend_without_bound(self, *args, lower_bound=None, **kwargs):
        return extend(self, *args, lower_bound=None, **kwargs)  # the safe gate's bound never reaches the kernel
    return _replace(dispatcher, "extend", extend_without_bound)


def sglang_kda_prefix_conv_window_dropped():
    backend = _kda_backend().KDAAttnBackend
    if not hasattr(backend, "_convolve_prefill"):
        raise MutantUnavailable("this SGLang's KDAAttnBackend convolves inside forward_extend (no _convolve_prefill)")
    convolve = backend._convolve_prefill

    def convolve_fresh(self, layer, forward_batch, *args, **kwargs):
        prefix = forward_batch.extend_prefix_lens
        forward_batch.extend_prefix_lens = torch.zeros_like(prefix)  # every request's conv starts from zeros
        try:
            return convolve(self, layer, forward_batch, *args, **kwargs)
        finally:
            forward_batch.extend_prefix_lens = prefix
    return _replace(backend, "_convolve_prefill", convolve_fresh)


def sglang_fa3_verify_replay_keys_without_drafts():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend as FA
    plan_graph, plan_pages = FA._init_full_cg_decode_metadata, FA._set_decode_page_metadata
    replaying_verify: list[bool] = []

    def init_graph(self, forward_batch, in_capture):
        replaying_verify.append(forward_batch.forward_mode.is_target_verify() and not in_capture)
        try:
            return plan_graph(self, forward_batch, in_capture)
        finally:
            replaying_verify.pop()

    def set_pages(self, plan, metadata, req_pool_indices, seq_lens, seq_len_delta):
        if replaying_verify and replaying_verify[-1]:
            seq_len_delta = 0  # each request's key count without its own draft tokens
        return plan_pages(self, plan, metadata, req_pool_indices, seq_lens, seq_len_delta)
    stack = contextlib.ExitStack()
    stack.enter_context(_replace(FA, "_init_full_cg_decode_metadata", init_graph))
    stack.enter_context(_replace(FA, "_set_decode_page_metadata", set_pages))
    return stack


def sglang_linear_captured_in_prefill_graph():
    from backends.sglang.runtime import load
    sgl = load()
    layer = sgl.RadixLinearAttention
    # The method without eager_on_graph: under a capture it runs inside the segment instead of breaking out
    return _replace(layer, "_eager_linear_attention", layer.__dict__["_eager_linear_attention"].__wrapped__)


def sglang_mamba_mixer_captured_in_prefill_graph():
    from backends.sglang.runtime import load
    load()
    from sglang.srt.models import nemotron_h
    # Nemotron-H's mixer call without its eager_on_graph op, as Granite 4.0-H's and Falcon-H1's layers make it
    return _replace(nemotron_h, "breakable_nemotron_mamba2_with_output", nemotron_h.nemotron_mamba2_with_output)


def sglang_kda_prefill_graph_tables_not_refreshed():
    from backends.sglang.runtime import load
    sgl = load()
    hybrid = sgl.HybridLinearAttnBackend

    def prepare(self, capture_metadata, forward_batch, *, static_forward_batch=None):
        # the full child planned for the live batch; the linear child's in-graph tables left as the capture built them
        self.full_attn_backend.init_forward_metadata(forward_batch)

    return _replace(hybrid, "prepare_forward_metadata_for_breakable_cuda_graph_replay", prepare)


def graph_captures_linear():
    import engine.graph_runner as gr
    return _replace(gr, "CAPTURE_LINEAR_LAYERS", True)


# One mutant per axis of the generator (issue 14), each reachable only through its axis: proof that the axis
# reaches code, not just that it exists.
AXIS_CATALOGUE: list[Mutant] = [
    Mutant("contiguous_pages_read_as_one_run", "a planner's fast path reads a batch whose pages form one "
           "ascending run (a fresh allocator's contiguous layout) as one run of slots, forgetting the unused tail "
           "of each request's last page; requests after the first read the previous one's page tail as keys "
           "(page layout axis: only contiguous layouts with page_size > 1 reach it)",
           ("torch_native",), ("outputs",), modes=("decode",)),
    Mutant("decode_merge_drops_last_split", "flash-decoding's merge stops one KV split short; a request long "
           "enough to fill its last split loses those keys (length-boundary axis: interpreted, the fourth of "
           "four splits is non-empty only past 48 keys, beyond the ci profile's ordinary lengths)",
           ("triton",), ("outputs",), modes=("decode",)),
    Mutant("verify_window_by_row", "a verify kernel applies the sliding window to row indices instead of "
           "positions; sibling drafts of a tree see a window cut by their row, not their depth (speculative axis: "
           "windows in target_verify with topk > 1; SGLang's Triton backend has this bug, "
           "docs/findings/sglang-triton-verify-window-by-row.md)", ("torch_native",), ("tree_branch", "outputs"),
           modes=("target_verify",)),
    Mutant("empty_extend_shifts_requests", "per-request token counts taken from per-token request ids drop a "
           "request with no new tokens; every later request reads the rows of the one before it (edge axis: "
           "empty extends)", ("torch_native", "triton"), ("outputs",), modes=("extend",)),
]

SGLANG_CATALOGUE: list[Mutant] = [
    Mutant("sglang_mha_decode_drops_logit_cap", "SGLang's MHA decode branch (decode_attention_fwd_normal, "
           "taken when num_kv_heads == num_q_heads) drops the logit soft-cap its grouped branch passes; Gemma-style "
           "MHA models decode with uncapped scores (head-configuration axis: GQA group 1 reaches this branch)",
           ("sglang.triton",), ("outputs",), modes=("decode",), engine="sglang"),
    Mutant("sglang_tbo_mrope_dim0", "SGLang's TboForwardBatchPreparer.filter_batch slices mrope_positions on "
           "dim 0 (sgl-project/sglang#20114 review); multimodal halves rotate by garbage positions",
           ("tbo(sglang.torch_native)",), ("outputs",), engine="sglang"),
    Mutant("sglang_triton_lacks_update_verify", "SGLang's TritonAttnBackend without "
           "update_verify_buffers_to_fill_after_draft (sgl-project/sglang#25925); the overlap plan stream's "
           "call raises NotImplementedError on the first verify", ("sglang.triton",), ("conformance",),
           engine="sglang"),
    Mutant("sglang_tbo_lacks_forward", "SGLang's TboAttnBackend without forward (sgl-project/sglang#20109, fixed "
           "by #20114); a linear layer's keyword call reaches the base dispatch and crashes ('missing q, k, v')",
           ("tbo(hybrid(sglang.torch_native,sglang.gdn))",), ("outputs",), engine="sglang"),
    Mutant("sglang_draft_target_layout", "SGLang's MTP draft worker builds its HybridLinearAttnBackend with the "
           "target model's full-attention layer ids (before sgl-project/sglang#27120); the draft's layer 0 goes "
           "to the GDN backend", ("hybrid(sglang.torch_native,sglang.gdn)",), ("dispatch", "outputs"),
           engine="sglang"),
    Mutant("sglang_hybrid_dispatch_by_type", "SGLang's HybridLinearAttnBackend classifies a layer by its type "
           "before its id (sgl-project/sglang#23331; fixed by #26474/#27120): Bailing/Ling's lightning layers are "
           "plain RadixAttention objects, so they go to the full-attention backend (Ling 2.5/2.6 and Ring-2.5 crashed "
           "at warm-up, #26474, #26623)", ("hybrid(sglang.torch_native,sglang.lightning)",), ("dispatch", "outputs"),
           engine="sglang"),
    Mutant("sglang_hybrid_lacks_mha_chunk", "SGLang's HybridLinearAttnBackend without init_mha_chunk_metadata "
           "(fixed by sgl-project/sglang#27316; CPU form: the full child given the method MLA backends have); "
           "the hasattr-guarded caller skips planning and the next prefix extend runs on a stale plan",
           ("hybrid(sglang.torch_native,sglang.gdn)",), ("conformance",), engine="sglang"),
    Mutant("sglang_linear_captured_in_prefill_graph", "SGLang's RadixLinearAttention without its breakable-graph "
           "break (before sgl-project/sglang#25110): the GDN extend kernels are captured into the prefill graph's "
           "segments and every replay reuses the capture batch's metadata and state slots; Qwen3.5 GSM8K fell from "
           "86.7% to 16.5% with no error (on a CPU, where nothing is captured, the capture's break count sees it)",
           ("graph(hybrid(sglang.triton,sglang.gdn))",), ("graph_replay",), modes=("extend",), engine="sglang"),
    Mutant("sglang_mamba_mixer_captured_in_prefill_graph", "SGLang's Nemotron-H mamba layer calls its mixer "
           "without the eager_on_graph op, as Granite 4.0-H's and Falcon-H1's layers do "
           "(docs/findings/sglang-mamba2-mixer-captured-in-prefill-graph.md): the conv and SSD kernels are captured "
           "into the prefill graph with the capture batch's Mamba-2 metadata; an illegal memory access on an H100, "
           "the break count on a CPU",
           ("graph(hybrid(sglang.triton,sglang.mamba2))",), ("graph_replay",), modes=("extend",), engine="sglang"),
    Mutant("sglang_kda_prefill_graph_tables_not_refreshed", "SGLang's hybrid replays a breakable prefill graph "
           "without refreshing the static tables its KDA extend runs on inside the graph (the captured-metadata "
           "contract, 0.5.22 on); every replayed prefill convolves and scans the capture batch's one sequence from "
           "its state slot (GLM-5.3 Flash's layer, whose in-graph extend is otherwise right)",
           ("graph(hybrid(sglang.triton,sglang.kda_glm5))",), ("graph_replay",), modes=("extend",), engine="sglang"),
    Mutant("sglang_one_arg_mha_chunk", "a full-attention child whose init_mha_chunk_metadata takes only the batch "
           "(TRT-LLM MLA before the #27316 review; CPU form on TorchNative); the hybrid's positional "
           "(forward_batch, disable_flashinfer_ragged) call raises TypeError on the first MLA prefill",
           ("hybrid(sglang.torch_native,sglang.gdn)",), ("conformance",), engine="sglang"),
    Mutant("sglang_fa3_replay_keeps_capture_plan", "SGLang's FlashAttentionBackend plans a graph at capture and "
           "not again at replay (a stale plan: the captured fill-value batch's lengths and page table); every "
           "replayed decode reads the padding row's keys. Caught at plan level, where FA3's kernels cannot run",
           ("graph(sglang.fa3)",), ("graph_metadata",), modes=("decode",), engine="sglang"),
    Mutant("sglang_triton_replay_pads_real_rows", "SGLang's TritonAttnBackend replay writes the padding's fill "
           "value over every row's length, real rows included, before planning; each real request of a replayed "
           "decode reads one key", ("graph(sglang.triton)",), ("graph_metadata",), modes=("decode",),
           engine="sglang"),
    Mutant("sglang_triton_verify_replay_mask_without_drafts", "SGLang's TritonAttnBackend replay of a target_verify "
           "graph offsets each request's tree mask by D x seq_len, forgetting the drafts' own D columns; from the second "
           "request on, every replayed verify reads another request's mask bits (draft trees, topk > 1)",
           ("graph(sglang.triton)",), modes=("target_verify",), engine="sglang"),
    Mutant("sglang_triton_draft_extend_replay_keys_twice", "SGLang's TritonAttnBackend replay of a draft-extend graph "
           "plans the prefix as the whole seq_len, not seq_len less the accepted tokens; each replayed draft extend "
           "attends to its new tokens twice (once from the cache, once as the extend)",
           ("graph(sglang.triton)",), modes=("draft_extend",), engine="sglang"),
    Mutant("sglang_triton_draft_step_keeps_previous_plan", "SGLang's TritonMultiStepDraftBackend leaves each draft "
           "step after the first with the plan of the step before it; from the second step on every branch's query "
           "reads one key too few (its own new token) and the draft tree is proposed from wrong hidden states",
           ("sglang.triton",), modes=("draft_decode",), engine="sglang"),
    Mutant("sglang_triton_draft_replay_keeps_capture_plan", "SGLang's TritonMultiStepDraftBackend plans nothing "
           "before a draft-graph replay; every replayed draft step reads the capture batch's key lists (padding "
           "rows') instead of its requests' prefixes and branches",
           ("graph(sglang.triton)",), modes=("draft_decode",), engine="sglang"),
    Mutant("sglang_tbo_replay_right_half_reads_left_lengths", "SGLang's TboAttnBackend replay view of each half "
           "slices its sequence lengths from the batch's first rows (_build_tbo_child_replay_fb_view), so the right half "
           "plans its requests with the left half's key counts; under TBO every replayed decode or verify graph's "
           "second half attends over too many or too few keys",
           ("graph(tbo(sglang.triton))",), modes=("decode", "target_verify"), engine="sglang"),
    Mutant("sglang_trtllm_mha_verify_replay_drops_last_draft", "SGLang's TRTLLMHAAttnBackend hands its fused graph "
           "metadata kernel a verify's draft count less one; every replayed target_verify graph plans each request's "
           "keys one short, so its last draft token is never attended (a plan-level leaf on a CPU: caught there)",
           ("graph(sglang.trtllm_mha)",), ("graph_metadata",), modes=("target_verify",), engine="sglang"),
    Mutant("sglang_linear_replay_pads_into_last_state", "SGLang's MambaAttnBackendBase replay gives padded rows the "
           "last real request's state slot instead of the pad slot; a padded replay's garbage rows overwrite that "
           "request's conv and SSM states (Qwen3-Next-style hybrids decode from a corrupted state)",
           ("graph(hybrid(sglang.triton,sglang.gdn))",), modes=("decode",), engine="sglang"),
    Mutant("sglang_mamba2_chunk_offsets_dropped", "SGLang's Mamba2Metadata plans the chunked scan's chunk offsets as "
           "zeros; where a request with a cached prefix starts inside a chunk, its initial state is applied at the "
           "chunk's first token, to the request before it (Nemotron-H prefills batched after a prefix-cache hit)",
           ("hybrid(sglang.torch_native,sglang.mamba2)",), ("outputs",), modes=("extend",), engine="sglang"),
    Mutant("sglang_mamba2_prefix_states_dropped", "SGLang's Mamba2Metadata marks no request as having an initial "
           "state; a chunked prefill or a prefix-cache hit restarts the SSM and conv states from zeros (Nemotron-H "
           "forgets everything before the chunk)", ("hybrid(sglang.torch_native,sglang.mamba2)",), ("outputs",),
           modes=("extend",), engine="sglang"),
    Mutant("sglang_short_conv_drops_initial_state", "SGLang's ShortConvAttnBackend plans every extend as a fresh "
           "request (has_initial_state all false); a request that continues a cached prefix (chunked prefill, a "
           "radix-cache hit) convolves zeros where its last tokens were (LFM2 models lose the context's tail)",
           ("hybrid(sglang.torch_native,sglang.short_conv)",), ("outputs",), modes=("extend",), engine="sglang"),
    Mutant("sglang_short_conv_slots_by_request_row", "SGLang's ShortConvAttnBackend hands LFM2's conv layers each "
           "request's req_to_token row as its state slot instead of its mamba index (as LFM2's layer itself did up to "
           "0.5.21); requests read and overwrite each other's conv states",
           ("hybrid(sglang.torch_native,sglang.short_conv)",), ("outputs",), modes=("decode",), engine="sglang"),
    Mutant("sglang_draft_window_sinks_dropped", "SGLang's TritonMultiStepDraftBackend resolves the server's draft "
           "window without its sinks (--speculative-draft-sink-size read as 0); a draft model served with "
           "StreamingLLM-style sinks loses its first tokens from every draft step once a prefix outgrows the window, "
           "and its drafts are accepted less often",
           ("sglang.triton",), ("outputs",), modes=("draft_decode",), engine="sglang"),
    Mutant("sglang_triton_verify_plans_from_host_lengths", "SGLang's TritonAttnBackend plans a target verify from the "
           "batch's host lengths (seq_lens_cpu) instead of its device ones; equal under EAGLE, but a DFlash worker "
           "widens the host lengths by the verify block, so each request reads its block's slots twice, as cached "
           "keys and as new ones",
           ("sglang.triton",), ("outputs",), modes=("target_verify",), engine="sglang"),
    Mutant("sglang_triton_extend_prefix_from_new_lens", "SGLang's TritonAttnBackend plans an extend's cached keys "
           "from each request's new-token count (extend_seq_lens) instead of its cached length (extend_prefix_lens): "
           "its kv_indices list the first new-token-count slots of each request row; a prefill over a cached "
           "prefix (a radix-cache hit, a chunked prefill's later chunk) attends to the wrong keys",
           ("sglang.triton",), ("metadata",), modes=("extend",), engine="sglang"),
    Mutant("sglang_kda_safe_gate_dropped", "SGLang's KDAKernelDispatcher hands its extend kernel no lower_bound; a "
           "safe-gate model's (Ling V3, Kimi K3) prefill decays its state by the standard gate -exp(A) softplus(a + "
           "dt_bias) instead of lower_bound * sigmoid(exp(A) (a + dt_bias))",
           ("hybrid(sglang.torch_native,sglang.kda)",), ("outputs",), modes=("extend",), engine="sglang"),
    Mutant("sglang_kda_prefix_conv_window_dropped", "SGLang's KDAAttnBackend convolves every extend as a fresh "
           "request (has_initial_state all false); a request that continues a cached prefix convolves zeros where "
           "its last W-1 tokens were (Kimi Linear after a prefix-cache hit or a prefill chunk)",
           ("hybrid(sglang.torch_native,sglang.kda)",), ("outputs",), modes=("extend",), engine="sglang"),
    Mutant("sglang_fa3_verify_replay_keys_without_drafts", "SGLang's FlashAttentionBackend replay of a target_verify "
           "graph (draft chains) counts each request's keys without its own draft tokens; every replayed verify's "
           "drafts read none of the drafts before them. Caught at plan level, where FA3's kernels cannot run",
           ("graph(sglang.fa3)",), modes=("target_verify",), engine="sglang"),
    Mutant("sglang_trtllm_mla_one_arg_mha_chunk", "the same bug in its own class: TRTLLMMLABackend's "
           "init_mha_chunk_metadata taking only the batch (before the #27316 review), read at class level where its "
           "Blackwell kernels cannot run; SGLang's hybrid wrappers forward (forward_batch, disable_flashinfer_ragged) "
           "and the first MLA prefill under them raises TypeError",
           ("sglang.trtllm_mla",), ("conformance",), engine="sglang"),
]

CATALOGUE: list[Mutant] = [
    Mutant("tbo_lacks_forward", "TBO wrapper defines only forward_extend/forward_decode; linear layers' "
           "forward(mixed_qkv=...) hits the base dispatch and crashes or goes astray",
           (f"tbo({CPU_HYBRID})",)),
    Mutant("tbo_mrope_dim0", "TBO child batches slice mrope_positions on dim 0, not the token dim 1; "
           "multimodal positions are garbage in both halves", ("tbo(torch_native)",)),
    Mutant("hybrid_lacks_mha_chunk", "Hybrid wrapper lacks init_mha_chunk_metadata; the hasattr guard skips "
           "planning and MLA prefill sees a qo_indptr that does not match q", (CPU_HYBRID,)),
    Mutant("hybrid_extra_kwarg", "Hybrid passes a keyword its child's init_mha_chunk_metadata does not accept; "
           "TypeError on the first MLA prefill", (CPU_HYBRID,)),
    Mutant("backend_lacks_update_verify", "a backend lacks update_verify_buffers_to_fill_after_draft; the "
           "overlap plan stream crashes in speculative decoding", ("torch_native",)),
    Mutant("hybrid_dispatch_by_type", "Hybrid dispatches by the layer object's type, not layer_id in "
           "full_attn_layers; linear layers reach the full backend", (CPU_HYBRID,)),
    Mutant("draft_worker_target_layout", "the MTP draft worker keeps the target's full_attn_layers instead of "
           "[0]; its only layer goes to the linear backend", (CPU_HYBRID,)),
    Mutant("graph_captures_linear", "a linear-attention kernel is captured into the piecewise CUDA graph; "
           "replays return stale output", ("graph(hybrid(flashinfer,fla))", "graph(hybrid(triton,linear_torch))"),
           needs_device="cuda"),
    Mutant("graph_drops_mrope", "the graph runner keeps no static mrope_positions buffer; replayed decode "
           "of a multimodal model rotates by text positions and drifts after images", ("graph(triton)",)),
    Mutant("tbo_verify_split_token", "TBO splits verify batches at split_seq tokens, forgetting "
           "* draft_token_num; children get the wrong draft tokens", ("tbo(torch_native)",)),
    Mutant("two_chunk_prefix_not_grown", "two-chunk TBO split forgets to grow the straddling request's prefix "
           "in child B; its second half ignores the first", ("tbo(torch_native)",)),
    Mutant("gqa_modulo_mapping", "GQA maps q head h to kv head h % Hk instead of h // group; "
           "heads attend with the wrong keys", ("torch_native",)),
    Mutant("kv_written_one_slot_off", "K/V written at out_cache_loc + 1; the next step reads the wrong keys "
           "and a neighbour's cache is clobbered", ("torch_native", "triton")),
    Mutant("sm_scale_wrong", "softmax scale 1/d instead of 1/sqrt(d); attention too flat, quality drops "
           "without an error", ("torch_native",)),
    Mutant("prefix_drops_last_token", "kv_indptr built from kv_lens - 1; the last cached key is never read",
           ("torch_native", "triton")),
    Mutant("verify_mask_transposed", "tree custom mask transposed (descendants instead of ancestors); "
           "speculative acceptance collapses", ("torch_native", "triton")),
    Mutant("draft_positions_by_index", "draft-token positions use the token index instead of its tree depth; "
           "RoPE of sibling drafts is wrong", ("torch_native",)),
    Mutant("stale_graph_replay", "init_forward_metadata_out_graph plans only at capture (in_capture=True) and "
           "keeps that plan before replays; graph replays read stale "
           "indptrs and indices", ("graph(triton)",)),
    Mutant("graph_verify_mask_stale", "the verify graph's planning copies the draft tree's mask into its static "
           "buffer at capture only, so replays read the capture's dummy mask; every verified draft sees all the "
           "others and acceptance collapses under CUDA graphs only", ("graph(triton)",), ("graph_replay",)),
    Mutant("decode_ignores_sliding_window", "decode kernel launched without the layer's sliding window; "
           "long contexts attend too far", ("triton",), modes=("decode",)),
    Mutant("extend_drops_logit_cap", "extend kernel launched without the logit soft-cap; Gemma-style "
           "models drift", ("triton",)),
    Mutant("mla_last_chunk_dropped", "MLA chunked-prefix plan drops the last prefix chunk; long-prefix "
           "prefill forgets the end of the context", ("torch_native",)),
    Mutant("state_slot_is_request_row", "linear-attention states indexed by req_pool_index instead of the "
           "request's state slot; requests read each other's state", ("linear_torch",)),
    Mutant("conv_state_not_saved", "conv state never advances; decode after prefill convolves stale inputs",
           ("linear_torch",)),
    Mutant("fresh_request_reads_pool", "a request with no prefix starts from the pool's stale state instead "
           "of zeros; fresh prompts inherit another request's context", ("linear_torch",)),
    Mutant("commit_wrong_position", "after verify, the state one position before the last accepted token is "
           "committed; every later token of the request decodes from a state one step behind", ("linear_torch",)),
    Mutant("fp8_dequant_ignores_scale", "with an fp8 KV cache, the cached e4m3 rows are read back without "
           "multiplying by the layer's k_scale/v_scale; every cached token's key and value are off by the scale",
           ("torch_native",)),
    Mutant("state_slot_bound_by_request_rows", "a state slot at or past the number of request rows is taken for "
           "padding (bounded by the wrong pool's size): that request starts from zero states and its new "
           "state is dropped; only state pools larger than the request rows (gapped slots) reach it",
           ("linear_torch",)),
    Mutant("commit_skips_tracked_copy", "the verify commit never writes the radix cache's tracked copy "
           "(mamba_track_indices); a later prefix-cache hit resumes from a stale state", ("linear_torch",),
           ("verify_commit",)),
    Mutant("soft_cap_silently_dropped", "a backend without a soft-cap computes a soft-capped layer uncapped "
           "instead of refusing it; a Gemma 2 served there answers a different function with no error",
           ("torch_native",), ("refuse_or_correct",)),
    Mutant("draft_branches_read_first_branch", "the multi-step draft plan keys every branch of a request by its "
           "first branch's draft slots; with topk > 1 each later branch attends to the first branch's tokens, not "
           "its own", ("torch_native",), modes=("draft_decode",)),
    Mutant("draft_graph_table_kept_from_capture", "a draft-graph replay re-plans each step over the branch table "
           "the capture wrote; every replayed step reads the capture batch's keys (padding rows'), not its "
           "requests'", ("graph(triton)",), modes=("draft_decode",)),
    Mutant("plan_cached_by_shape", "plans cached by (mode, batch size, token count) and reused for the next batch "
           "of those shapes; its requests read the previous batch's pages and lengths, with no error",
           ("torch_native",), ("replan",)),
    Mutant("decode_segfault_past_page_table", "paged decode reads past the end of the page table once the batch "
           "spans more than two KV pages; the process dies with SIGSEGV (an illegal memory access on a GPU)",
           ("torch_native",), properties=("outputs",), crashes=True),
    Mutant("decode_illegal_address_past_page_table", "paged decode reads past the end of the page table on the GPU "
           "once the batch spans more than two KV pages; the CUDA context faults (an illegal memory access), and "
           "under MPS the fault reaches every client of the daemon", ("torch_native",), properties=("outputs",),
           needs_device="cuda", crashes=True),
    Mutant("extend_hangs_past_two_pages", "the extend kernel waits on a barrier that batches spanning more than "
           "two KV pages never reach; the process hangs (a deadlocked kernel) and the run never ends",
           ("torch_native",), properties=("outputs",), crashes=True),
] + AXIS_CATALOGUE + SGLANG_CATALOGUE
MUTANTS = {m.name: m for m in CATALOGUE}


def mutant_named(name: str | None) -> Mutant | None:
    """The catalogue's mutant ``name`` (None for None); an unknown name is the user's error, in one line."""
    if name is not None and name not in MUTANTS:
        raise UsageError(f"unknown mutant {name!r}; see `python -m harness mutants --list`")
    return None if name is None else MUTANTS[name]
