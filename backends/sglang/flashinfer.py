"""SGLang's FlashInfer backends as leaves: ``FlashInferAttnBackend`` (MHA) and ``FlashInferMLAAttnBackend`` (MLA); its
subclasses TRT-LLM MHA and MLA, CuTe DSL MLA and FlashMLA.

SGLang registers both under one name, "flashinfer": its registry builds the MLA one when the runner uses an
MLA model (``attention_registry.py``, ``create_flashinfer_backend``), which :func:`runtime.make_runner` sets
from the model's layers. Both plan token-level indices (FlashInfer page size 1) whatever the pool's page
size, and keep their plans inside FlashInfer's wrappers, which :func:`wrapper_plan` reads back.

Its MLA leaves (FlashInfer MLA, FlashMLA; the TRT-LLM and CuTe DSL MLA planners) are driven as SGLang's DeepSeek
attention drives them: :class:`backends.sglang.mla.DeepseekMla`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import types
from dataclasses import replace

import torch

from backends.base import Capabilities, PlannedMetadata
from backends.sglang import features
from backends.sglang.adapter import TBO_DRAFT_EXTEND_GAP, SglangBackend, page_table_lists, unread_fields
from backends.sglang.classes import ReadsEngineClasses, class_level
from backends.sglang.mla import DeepseekMla
from backends.sglang.plans import SglangPlanOnly, asked_as
from batch.spec import ForwardMode

FLASHINFER_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                              ForwardMode.IDLE})
# What each class plans graphs for (init_forward_metadata_out_graph, 0.5.23; capture/replay_cuda_graph before): the MHA
# backend decode and idle (decode wrappers), target_verify and draft_extend_v2 (paged prefill wrappers,
# flashinfer_backend.py:764-826); the MLA backend decode/idle and target_verify only (any other mode raises,
# flashinfer_mla_backend.py:349-393). The draft worker's containers capture their steps' decode plans
# (FlashInferMultiStepDraftBackend.init_forward_metadata_out_graph, and the MLA ones below).
FLASHINFER_GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY,
                                    ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE})
# The MLA leaves' draft worker: DraftBackendFactory builds FlashInfer MLA's, FlashMLA's or TRT-LLM MLA's multi-step
# container (FlashInferMLAMultiStepDraftBackend and its subclasses, FlashMLAMultiStepDraftBackend), each a step backend
# of the leaf's class per draft step, captured by the draft graph runner (init_cuda_graph_state, out_graph, in_graph).
# Each refuses topk > 1 when built ("only supports topk=1"); none hands the kernel that lays out each step's keys the
# server's draft window (--speculative-draft-window-size: flashinfer_mla_backend.py common_template; FlashMLA's and
# TRT-LLM MLA's steps plan as a plain decode), so a server with that window runs their draft steps over the whole
# prefix, unwarned (speculative_hook.py names the Triton and FlashInfer draft backends as those that honour it).
MLA_DRAFT = dict(draft_loop_trees=False, draft_prefix_window=False)
FLASHINFER_MLA_MODES = FLASHINFER_MODES | {ForwardMode.DRAFT_DECODE}
FLASHINFER_MLA_GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY,
                                        ForwardMode.DRAFT_DECODE})
# FlashInfer has no float32 attention kernels; SGLang serves bf16 and fp16 models with it.
FLASHINFER_DTYPES = frozenset({"bfloat16", "float16"})


def wrapper_plan(wrapper, *, kv_includes_new_tokens: bool) -> PlannedMetadata:
    """What a planned FlashInfer wrapper holds, as :class:`PlannedMetadata` (page size 1: token slots).

    Paged prefill/decode wrappers keep ``_qo_indptr_buf``, ``_paged_kv_indptr_buf``, ``_paged_kv_indices_buf``
    and ``_paged_kv_last_page_len_buf``; the MLA wrapper ``_qo_indptr_buf``, ``_kv_indptr_buf``,
    ``_kv_indices_buf``; a ragged wrapper only its indptrs (its keys are the new tokens, no cache slots).
    SGLang allocates prefill indices with slack (``paged_kernel_lens_sum + 256``): only the first
    ``kv_indptr[-1]`` are the plan. The last-page lengths are not reported: with pages of one token they are
    SGLang's constant buffer of ones, which FlashInfer reads only for requests with at least one page (a
    request without keys has length 0 from its indptr). Absent buffers give None fields, which the metadata
    checks skip.
    """
    get = lambda name: getattr(wrapper, name, None)  # noqa: E731
    unread = unread_fields(wrapper, WRAPPER_READ)
    qo = get("_qo_indptr_buf")
    indptr = get("_paged_kv_indptr_buf")
    indices = get("_kv_indices_buf") if indptr is None else get("_paged_kv_indices_buf")
    if indptr is None:
        indptr = get("_kv_indptr_buf")
    if indptr is None or indices is None:
        return PlannedMetadata(qo_indptr=qo, unread=unread)
    B = indptr.numel() - 1
    return PlannedMetadata(qo_indptr=None if qo is None else qo[:B + 1], kv_indptr=indptr,
                           kv_indices=indices[:int(indptr[-1])], kv_includes_new_tokens=kv_includes_new_tokens,
                           unread=unread)


# The buffers of a FlashInfer wrapper that wrapper_plan reads; the metadata verdicts name the rest (its workspaces, a
# verify's custom mask and mask indptr, the last-page lengths, a ragged wrapper's kv indptr, ...): planned, not checked
WRAPPER_READ = frozenset({"_qo_indptr_buf", "_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_kv_indptr_buf",
                          "_kv_indices_buf"})


def graph_wrappers(backend, sfb) -> list | None:
    """The wrappers a graph of ``sfb``'s size and mode replays with (the last one the full-attention one), or None
    when none was captured for it. SGLang keeps one set per captured size: ``decode_cuda_graph_metadata`` (decode,
    idle), ``prefill_cuda_graph_metadata`` (verify; draft extend too up to 0.5.22), ``draft_extend_cuda_graph_metadata``
    (draft extend, 0.5.23). It points ``forward_metadata`` at a set only while capturing it, so after a replay
    ``forward_metadata`` names the last size captured, not necessarily the one replayed. The MLA backend keeps one
    wrapper per size, not a list."""
    mode, bs = sfb.forward_mode, sfb.batch_size
    if mode.is_decode_or_idle():
        tables = ("decode_cuda_graph_metadata",)
    elif mode.name == "DRAFT_EXTEND_V2":
        tables = ("draft_extend_cuda_graph_metadata", "prefill_cuda_graph_metadata")
    else:
        tables = ("prefill_cuda_graph_metadata",)
    for name in tables:
        found = (getattr(backend, name, None) or {}).get(bs)
        if found is not None:
            return found if isinstance(found, list) else [found]
    return None


def graph_plan(backend, sfb, window: int | None = None) -> PlannedMetadata | None:
    """The plan a replayed graph of ``sfb`` runs with (None: none captured for its size and mode): its full-attention
    wrapper's, over every key (graphs plan paged wrappers only). An MLA decode replay plans from host indptrs
    (``fast_mla_decode_plan``, handed ``fast_decode_kwargs`` by ``_apply_cuda_graph_metadata``) and refills only the
    index buffer: the wrapper's device kv_indptr keeps the capture's values and no kernel reads it (FlashInfer's MLA
    run takes the plan and ``_kv_indices_buf`` alone), so that plan is the host indptrs over that buffer; a DFlash
    verify replay likewise. (The MHA backend keeps no ``fast_decode_kwargs``.)"""
    wrappers = graph_wrappers(backend, sfb)
    if wrappers is None:
        return None
    host = getattr(backend, "fast_decode_kwargs", None) or {}
    if not sfb.forward_mode.is_decode_or_idle():
        # A DFlash verify replays through the same sync-free MLA plan, from host indptrs SGLang builds from the
        # batch's widened host lengths and keeps nowhere (_build_fast_verify_plan_kwargs, handed to
        # fast_mla_decode_plan by the prefill updater): rebuilt here by SGLang's own function, over the same buffer
        fast_verify = getattr(backend, "_build_fast_verify_plan_kwargs", None)
        host = {}
        if fast_verify is not None and sfb.spec_info is not None:
            host = fast_verify(bs=sfb.batch_size, spec_info=sfb.spec_info, seq_lens_cpu=sfb.seq_lens_cpu,
                               in_capture=False) or {}
    if "kv_indptr_cpu" in host:
        kv_indptr = host["kv_indptr_cpu"]
        return PlannedMetadata(qo_indptr=host["qo_indptr_cpu"], kv_indptr=kv_indptr,
                               kv_indices=wrappers[-1]._kv_indices_buf[:int(kv_indptr[-1])],
                               kv_includes_new_tokens=True)
    return with_window(wrapper_plan(wrappers[-1], kv_includes_new_tokens=True), wrappers, window)


def with_window(plan: PlannedMetadata, wrappers, window: int | None) -> PlannedMetadata:
    """``plan`` (the full-attention wrapper's) with the sliding-window wrapper's key lists, where the model has a
    ``window`` (the runner's sliding_window_size) and SGLang plans two wrappers (``_get_wrapper_idx``: the first for
    window layers): the window layers read those, each request's last keys of the same range."""
    if len(wrappers) < 2 or not window or window <= 0:
        return plan
    own = wrapper_plan(wrappers[0], kv_includes_new_tokens=plan.kv_includes_new_tokens)
    return replace(plan, window_kv_indptr=own.kv_indptr, window_kv_indices=own.kv_indices, window=window,
                   unread=tuple(sorted(set(plan.unread) | {f"window wrapper.{name}" for name in own.unread})))


class SglangFlashInfer(SglangBackend):
    """SGLang's ``FlashInferAttnBackend`` (MHA): ragged prefill over the new tokens merged with a paged
    prefill over the prefix (extend), paged prefill under the tree mask (verify), paged decode; its draft worker's
    ``FlashInferMultiStepDraftBackend`` (draft decode)."""

    sglang_name = "flashinfer"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        modes=FLASHINFER_MODES | {ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE},
        cuda_graph_modes=FLASHINFER_GRAPH_MODES,
        prefill_graph=True,  # RadixAttention breaks SGLang's breakable prefill graph (radix_attention.py:133-165)
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        # FlashInferMultiStepDraftBackend builds each step's FlashInferAttnBackend over one shared kv_indptr row,
        # which asserts a single wrapper (flashinfer_backend.py:482, `assert self.num_wrappers == 1`); a window
        # model has two (window and full): the container refuses it with a bare AssertionError when it is built
        # (seen on the H200, harness-out/gpu21.sh)
        draft_window=False,
        # FlashInferMultiStepDraftBackend hands the server's draft window to generate_draft_decode_kv_indices
        # (flashinfer_backend.py, common_template), where the release has it (features.py, draft_prefix_window)
        engine_limits=(("draft_prefix_window", "draft_prefix_window", False),),
        dtypes=FLASHINFER_DTYPES,
        head_dims=frozenset({64, 128, 256}),  # the head dims FlashInfer's attention kernels are built for
        devices=frozenset({"cuda"}),
        requires=("sglang", "flashinfer"),
        engine="sglang",
        one_shape_per_kind=True,  # one KV pool per model (runtime.py)
    )

    def planned_metadata(self) -> PlannedMetadata:
        """The plan of the wrapper full-attention layers run: FlashInfer's decode wrapper, or its paged prefill
        wrapper (over the prefix when the new tokens go through the ragged wrapper, else over every key).
        With a sliding window SGLang plans two wrappers; the second is the full-attention one
        (``_get_wrapper_idx``), the first the window layers' (:func:`with_window`)."""
        window = self.sgl_runner.sliding_window_size
        plan = graph_plan(self.inner, next(iter(self.batches.values())), window) if self.planned_graph else None
        if plan is not None:
            return plan
        meta = getattr(self.inner, "forward_metadata", None)
        if meta is None:
            return PlannedMetadata()
        if hasattr(meta, "decode_wrappers"):
            return with_window(wrapper_plan(meta.decode_wrappers[-1], kv_includes_new_tokens=True),
                               meta.decode_wrappers, window)
        return with_window(wrapper_plan(meta.prefill_wrappers[-1], kv_includes_new_tokens=not meta.use_ragged),
                           meta.prefill_wrappers, window)


# The compute capabilities whose TRT-LLM MHA kernels SGLang calls through FlashInfer (trtllm_mha_backend.py, 0.5.23):
# XQA decode and fmha_v2 prefill on SM90 and SM120 (``is_xqa_impl``, ``use_fmha_v2``), TRT-LLM-gen on SM100/SM103.
TRTLLM_MHA_ARCHS = (9, 10, 12)
TRTLLM_MHA_KERNELS = ("its kernels (FlashInfer's TRT-LLM MHA: XQA decode and fmha_v2 prefill on Hopper, TRT-LLM-gen "
                      "on Blackwell) need FlashInfer and an SM90, SM100 or SM120 GPU")


def trtllm_mha_unrunnable() -> str | None:
    """Why SGLang's TRT-LLM MHA backend cannot be built and run here (None: it can)."""
    return kernels_unrunnable(TRTLLM_MHA_KERNELS, (("flashinfer", "FlashInfer is not installed"),), TRTLLM_MHA_ARCHS)


def kernels_unrunnable(kernels: str, packages: tuple[tuple[str, str], ...], archs: tuple[int, ...]) -> str | None:
    """Why ``kernels`` cannot run here (None: they can): a package of ``packages`` (name, what its absence means) not
    really installed (an adapter's stand-in is not the package), no CUDA GPU, or one of none of the compute capability
    majors ``archs``. Read without initializing CUDA in this process (the sweep forks its workers after the matrix is
    read): the GPU's compute capability from NVML."""
    for package, absent in packages:
        if not features.really_installed(package):
            return f"{kernels}; {absent}"
    if not torch.cuda.is_available():
        return f"{kernels}; no CUDA GPU is visible"
    try:
        major, minor = _compute_capability()
    except Exception as e:  # noqa: BLE001 - any failure leaves the capability unknown, said as such
        return f"{kernels}; the GPU's compute capability could not be read ({type(e).__name__}: {e})"
    if major not in archs:
        return f"{kernels}; this GPU is SM{major}{minor}"
    return None


def _compute_capability() -> tuple[int, int]:
    """The first GPU's compute capability from NVML, which does not initialize CUDA (pynvml: a FlashInfer dependency,
    so present wherever the question is asked)."""
    import pynvml

    pynvml.nvmlInit()
    return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0)))


class _AbsentFlashInferWrapper:
    """A FlashInfer wrapper class where FlashInfer is not installed: built (FlashInferAttnBackend's constructor makes
    its wrappers), never planned or run: any attribute read raises, naming what would have run."""

    wrapper_class: str

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        raise RuntimeError(f"FlashInfer's {self.wrapper_class}.{name} was called, but FlashInfer is not installed: "
                           f"its wrapper here is an inert stand-in for a plan-level leaf, never planned or run")


FLASHINFER_WRAPPER_CLASSES = ("BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                              "BatchDecodeWithPagedKVCacheWrapper")
FLASHINFER_MLA_WRAPPER_CLASSES = ("BatchMLAPagedAttentionWrapper", "BatchPrefillWithRaggedKVCacheWrapper")


def _no_counter_buffer(device, num_q_heads, max_batch_size):
    """The TRT-LLM-gen kernels' multi-CTA counter workspace, sized by FlashInfer from the GPU's SM count: empty where
    no such kernel runs (a plan-level leaf's ``_run`` raises before any could)."""
    return torch.zeros(0, dtype=torch.uint8, device=device)


def _no_jit_module(*args, **kwargs):
    """A CUDA JIT module SGLang builds ahead of its first use (TRT-LLM MLA's zero-KV fixup): none where no kernel
    runs."""
    return None


class _UnpinnedTorch(types.ModuleType):
    """``torch`` as a module of SGLang's sees it while a plan-level leaf is built on a machine without CUDA: its
    pinned host buffers (``pin_memory=True``, which torch refuses there) made unpinned; pinning only lets a copy to
    the device run asynchronously (runtime.py's ``_host_pinning_on_cpu`` answers ``Tensor.pin_memory`` alike)."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("zeros", "empty", "ones", "full", "tensor", "arange"):
            setattr(self, name, self._unpinned(getattr(torch, name)))

    @staticmethod
    def _unpinned(factory):
        return lambda *args, pin_memory=False, **kwargs: factory(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def flashinfer_absent():
    """What a subclass of SGLang's FlashInfer backends reads of FlashInfer while it is built, where FlashInfer is not
    installed (SGLang imports it only ``if is_flashinfer_available()``): the wrapper classes their constructors make,
    as inert stand-ins (:class:`_AbsentFlashInferWrapper`); the TRT-LLM kernels' workspace (sized by asking FlashInfer
    the GPU's SM count, ``make_persistent_multi_ctas_kv_counter_buffer``), empty; TRT-LLM MLA's prebuilt CUDA module,
    none; and, without CUDA, the MLA backend's pinned host buffers unpinned. Nothing that plans is replaced;
    everything is restored afterwards."""
    attention = "sglang.srt.layers.attention."
    modules = {name: importlib.import_module(attention + name)
               for name in ("flashinfer_backend", "flashinfer_mla_backend", "trtllm_mha_backend", "trtllm_mla_backend")}
    patches = [(modules[module], name, type(name, (_AbsentFlashInferWrapper,), {"wrapper_class": name}))
               for module, names in (("flashinfer_backend", FLASHINFER_WRAPPER_CLASSES),
                                     ("flashinfer_mla_backend", FLASHINFER_MLA_WRAPPER_CLASSES))
               for name in names if not hasattr(modules[module], name)]
    for module, name, value in (  # each where the release has it (0.5.2x; 0.5.10 has none of them)
            ("trtllm_mha_backend", "make_persistent_multi_ctas_kv_counter_buffer", _no_counter_buffer),
            ("trtllm_mla_backend", "make_persistent_multi_ctas_kv_counter_buffer", _no_counter_buffer),
            ("trtllm_mla_backend", "_jit_fixup_module", _no_jit_module)):
        if hasattr(modules[module], name):
            patches.append((modules[module], name, value))
    if not torch.cuda.is_available():
        patches.append((modules["flashinfer_mla_backend"], "torch", _UnpinnedTorch()))
    saved = [(module, name, getattr(module, name, None)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, old in saved:
            if old is None:
                delattr(module, name)
            else:
                setattr(module, name, old)


# Its graphs (init_cuda_graph_state, _build_cuda_graph_metadata, _apply_cuda_graph_metadata: :706-1047): decode and
# idle over static buffers, target verify where the server speculates; one fused Triton kernel
# (update_trtllm_mha_graph_metadata) refills them at capture and before each replay
TRTLLM_MHA_GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE})


def _trtllm_mha_capabilities(unrunnable: str | None, arch: int | None = None) -> Capabilities:
    """Where its kernels run, every property; elsewhere its planning (torch and SGLang's Triton page-table kernels,
    interpreted on a CPU) over FlashInfer's wrapper classes as inert stand-ins: the plan-level leaf."""
    return Capabilities(
        attention_kinds=frozenset({"mha"}),
        # What it plans is its FlashInfer base's modes (init_forward_metadata, trtllm_mha_backend.py:1238-1398, 0.5.23):
        # decode (draft decode included), target verify and extends; mixed batches are extends whose one-token tail
        # it notes. Its draft worker's container (TRTLLMHAAttnMultiStepDraftBackend) gives each step backend its
        # speculative_step_id, which it adds to the committed lengths (:979, :1251), eager and under the draft graph
        # runner; it hands its steps no server draft window. Its step backends are built over the container's shared
        # kv_indptr row, which FlashInferAttnBackend.__init__ takes for one wrapper only (flashinfer_backend.py:482,
        # `assert self.num_wrappers == 1`): a model with a sliding window (two wrappers) is refused when the container
        # is built (seen on the H200, harness-out/gpu94.sh), as FlashInfer's own container refuses it
        modes=FLASHINFER_MODES | {ForwardMode.DRAFT_DECODE},
        cuda_graph_modes=TRTLLM_MHA_GRAPH_MODES | {ForwardMode.DRAFT_DECODE},
        draft_prefix_window=False,
        draft_window=False,
        # "Only support topk <= 1 for now" (its __init__): a verify of chains; the server routes topk > 1 elsewhere
        draft_trees=False,
        # It never reads layer.logit_cap (no soft-cap reaches its kernels; trtllm_mha_backend.py, 0.5.23): declared, so
        # its rows draw no soft-capped layer and refuse_or_correct checks that such a model is refused (it is not:
        # ledger sglang-trtllm-mha-ignores-logit-cap)
        logit_cap=False,
        dtypes=FLASHINFER_DTYPES,
        cpu_dtypes=FLASHINFER_DTYPES,
        # The server sets any page size but 16, 32, 64 and 128 to 64 for it (arg_groups/overrides.py:1183, 0.5.23); the
        # three the GPU profile draws are the ones run on the H200 (harness-out/gpu77.sh to gpu80.sh)
        page_sizes=frozenset({16, 32, 64}),
        # An fp8 e4m3 cache (--kv-cache-dtype fp8_e4m3) where it has been run: on SM90 (the H200, harness-out/gpu84.sh
        # to gpu87.sh: its fused fp8 cache write, extends, verifies and graph replays pass; its decodes run FlashInfer's
        # XQA kernel in e4m3, 2-3% off, ledger sglang-trtllm-mha-xqa-fp8-e4m3-arithmetic), and in its planning.
        # Blackwell's TRT-LLM-gen kernels and SM120's have not been run over one.
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}) if unrunnable is not None or arch == 9 else frozenset({"auto"}),
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        devices=frozenset({"cuda"}) if unrunnable is None else frozenset({"cpu", "cuda"}),
        requires=("sglang", "flashinfer") if unrunnable is None else ("sglang",),
        cpu_needs_env="TRITON_INTERPRET",  # its page tables are built by SGLang's Triton kernels
        engine="sglang",
        one_shape_per_kind=True,
        engine_classes="trtllm_mha",
        plan_only=unrunnable,
    )


def _trtllm_mha_declared() -> Capabilities:
    """This machine's declaration: its kernels' level, and where they run the GPU's compute capability major."""
    unrunnable = trtllm_mha_unrunnable()
    return _trtllm_mha_capabilities(unrunnable, None if unrunnable else _compute_capability()[0])


class SglangTrtllmMha(SglangPlanOnly):
    """SGLang's ``TRTLLMHAAttnBackend`` (``--attention-backend trtllm_mha``, the server's default for MHA models on
    Blackwell): a ``FlashInferAttnBackend`` subclass that plans FlashAttention-style metadata (``TRTLLMMHAMetadata``:
    ``cache_seqlens_int32``, ``cu_seqlens_q/k``, a page table of pages, read by ``adapter.flash_attention_plan``) and
    runs FlashInfer's TRT-LLM kernels over SGLang's paged cache. Where those kernels cannot run (no FlashInfer, no GPU
    of their architectures), it is a plan-level leaf (plans.py): built with FlashInfer's wrapper classes as inert
    stand-ins (it plans none of them) and planned, eagerly and for graphs, as on a Blackwell GPU (the platform
    answers neither SM90 nor SM120 there, so no Hopper fmha_v2 page lists are planned)."""

    sglang_name = "trtllm_mha"
    capabilities = _trtllm_mha_declared()

    @classmethod
    def built_without_kernels(cls):
        return flashinfer_absent()


# TRT-LLM MLA (``--attention-backend trtllm_mla``, the server's default MLA backend on Blackwell): a
# FlashInferMLAAttnBackend subclass whose decode, verify and draft-extend plans are its own (TRTLLMMLADecodeMetadata: a
# page table built by SGLang's Triton kernel, padded with -1, and each request's key count) and whose extends plan the
# new tokens' ragged prefill (TRTLLMMLAPrefillMetadata), the prefix read in chunks (init_mha_chunk_metadata)
TRTLLM_MLA_KERNELS = ("its kernels (FlashInfer's TRT-LLM-gen MLA decode and DeepSeek ragged prefill) run on Blackwell "
                      "(SM100) only, and the harness has run none")


class SglangTrtllmMla(SglangPlanOnly):
    """SGLang's ``TRTLLMMLABackend`` at plan level (plans.py): built through SGLang's factory as on Blackwell (its
    constructor asks the GPU's capability), FlashInfer's MLA wrappers as inert stand-ins (:func:`flashinfer_absent`),
    its ``init_forward_metadata`` run on every drawn batch and read here."""

    sglang_name = "trtllm_mla"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mla"}),
        engine_features=("deepseek_mla",),
        modes=FLASHINFER_MLA_MODES | {ForwardMode.DRAFT_EXTEND},
        **MLA_DRAFT,
        fixed_width_draft_extend=True,
        # Its graphs plan decode, idle and verify outside the graph (init_forward_metadata_out_graph,
        # _apply_cuda_graph_metadata: trtllm_mla_backend.py:604-772) on state its FlashInfer MLA base allocates on
        # "cuda" by name (flashinfer_mla_backend.py:506): planned on a GPU (built as on Blackwell there too), not on a
        # CPU
        # draft extend's too (_apply_cuda_graph_metadata's DRAFT_EXTEND_V2 branch, a fixed query window)
        cuda_graph_modes=FLASHINFER_MLA_GRAPH_MODES | {ForwardMode.DRAFT_EXTEND},
        cpu_gaps=(("graph_metadata", "its graph state is allocated on 'cuda' by name (FlashInferMLAAttnBackend."
                                     "init_cuda_graph_state, flashinfer_mla_backend.py:506)"),),
        # DeepSeek's bf16, and fp16, which the CPU profile draws: its planning does not read the model's dtype (no
        # kernel of it runs here to tell what its kernels take)
        dtypes=FLASHINFER_DTYPES,
        cpu_dtypes=FLASHINFER_DTYPES,
        # TRT-LLM-gen MLA reads pages of 32 or 64 tokens (the server sets 64 for any other, arg_groups/overrides.py)
        page_sizes=frozenset({32, 64}),
        requires=("sglang",),
        cpu_needs_env="TRITON_INTERPRET",  # its page table is built by SGLang's Triton kernel
        engine="sglang",
        one_shape_per_kind=True,
        engine_classes=sglang_name,
        plan_only=TRTLLM_MLA_KERNELS,
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        # Its draft container plans on a CPU where it plans its steps itself; where it inherits FlashInfer MLA's
        # planning (0.5.10), that allocates the steps' index rows on "cuda" by name: no draft loop declared there
        engine_limits=(("trtllm_mla_draft_plans_steps", "modes", FLASHINFER_MODES),),
    )

    @classmethod
    def built_without_kernels(cls):
        stack = contextlib.ExitStack()
        stack.enter_context(asked_as((10, 0)))  # Blackwell, where the server runs it
        stack.enter_context(flashinfer_absent())
        return stack

    def planned_metadata(self) -> PlannedMetadata:
        """An extend's ragged query indptr (its keys: the new tokens, the prefix read in chunks); a decode's or a
        verify's page table and key counts (every key, the new ones included)."""
        sfb = next(iter(self.batches.values()))
        mode = sfb.forward_mode
        if mode.is_extend() and not mode.is_target_verify() and not mode.is_draft_extend_v2():
            meta = self.inner.forward_prefill_metadata
            return PlannedMetadata() if meta is None else PlannedMetadata(qo_indptr=meta.cum_seq_lens)
        meta = self.inner.forward_decode_metadata
        if meta is None or meta.block_kv_indices is None:
            return PlannedMetadata()
        return trtllm_mla_plan(meta, self.sgl_runner.page_size, sfb.seq_lens)


class SglangCutedslMla(SglangTrtllmMla):
    """SGLang's ``CuteDslMLABackend`` (``--attention-backend cutedsl_mla``, 0.5.2x): a ``TRTLLMMLABackend`` that
    overrides its kernels only (FlashInfer's CuTe DSL MLA decode, cutedsl_mla_backend.py), so its plans are TRT-LLM
    MLA's, held to the same invariants at the same level."""

    sglang_name = "cutedsl_mla"
    capabilities = replace(
        SglangTrtllmMla.capabilities, engine_classes=sglang_name,
        plan_only="its kernels (FlashInfer's CuTe DSL MLA decode) run on Blackwell (SM100) only, and the harness "
                  "has run none")


TRTLLM_MLA_READ = frozenset({"block_kv_indices", "seq_lens_k", "cu_seqlens_q"})


def trtllm_mla_plan(meta, page_size: int, batch_seq_lens: torch.Tensor) -> PlannedMetadata:
    """TRT-LLM MLA's decode-side plan (``TRTLLMMLADecodeMetadata``) in the inspectable form: per request
    ``seq_lens_k`` keys read from the cache (the new tokens included: SGLang writes them first) and the first
    ``ceil(keys / page_size)`` entries of its ``block_kv_indices`` row, the rest padding the kernel never reads. Up to
    the 0.5.1x releases a decode plans no ``seq_lens_k`` (its kernel reads the batch's ``seq_lens``, 0.5.10
    trtllm_mla_backend.py:876): the rows are cut at those, and no planned length is checked."""
    planned = meta.seq_lens_k
    indptr, indices = page_table_lists(meta.block_kv_indices, planned if planned is not None else batch_seq_lens,
                                       page_size)
    # A draft extend's query layout (cu_seqlens_q over seq_lens_q, each request's accepted window: EAGLE v2's fixed
    # width); a decode's and a verify's queries are the batch's fixed rows, planned nowhere
    qo = meta.cu_seqlens_q if getattr(meta, "max_seq_len_q", None) is not None else None
    return PlannedMetadata(qo_indptr=qo, kv_indptr=indptr, kv_indices=indices, kv_indices_are_pages=page_size > 1,
                           kv_includes_new_tokens=True, key_lens=planned,
                           unread=unread_fields(meta, TRTLLM_MLA_READ))



class SglangFlashInferMLA(DeepseekMla):
    """SGLang's ``FlashInferMLAAttnBackend``, driven as SGLang's DeepSeek attention drives it (module
    docstring)."""

    sglang_name = "flashinfer"  # the MLA backend: the runner uses an MLA model
    capabilities = Capabilities(
        attention_kinds=frozenset({"mla"}),
        engine_features=("deepseek_mla",),
        # EAGLE v2's draft extend (DeepSeek's MTP draft model): a paged prefill over each request's fixed window,
        # planned from host indptrs (init_forward_metadata's DRAFT_EXTEND_V2 fast plan). A draft extend whose every
        # request had nothing cached would take the ragged wrapper (extend_no_prefix) and come out inf on the H200
        # (harness-out/gpu101.sh, mlade.py). The harness draws none (a draft extend after a verify extends the cached
        # prompt, batch.spec's rule; the boundary-widened window, whose prefix can clamp to 0, is not modelled), and
        # one request with a prefix takes the paged path and passes
        modes=FLASHINFER_MLA_MODES | {ForwardMode.DRAFT_EXTEND},
        fixed_width_draft_extend=True,
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        **MLA_DRAFT,
        cuda_graph_modes=FLASHINFER_MLA_GRAPH_MODES,
        dtypes=FLASHINFER_DTYPES,
        devices=frozenset({"cuda"}),
        requires=("sglang", "flashinfer"),
        engine="sglang",
        one_shape_per_kind=True,  # one KV pool per model (runtime.py)
    )

    def planned_metadata(self) -> PlannedMetadata:
        """The MLA wrapper's plan (decode, verify, absorbed extend: every key, the new ones included), or the
        ragged wrapper's query indptr for an extend that runs as MHA."""
        plan = graph_plan(self.inner, next(iter(self.batches.values()))) if self.planned_graph else None
        if plan is not None:
            return plan
        meta = getattr(self.inner, "forward_metadata", None)
        if meta is None:
            return PlannedMetadata()
        if hasattr(meta, "decode_wrapper"):
            return wrapper_plan(meta.decode_wrapper, kv_includes_new_tokens=True)
        if meta.use_ragged:
            return PlannedMetadata(qo_indptr=getattr(self.inner.prefill_wrapper_ragged, "_qo_indptr_buf", None))
        return wrapper_plan(meta.prefill_wrapper, kv_includes_new_tokens=True)


# FlashMLA (``--attention-backend flashmla``): a FlashInferMLAAttnBackend subclass whose decode, verify and draft-extend
# run FlashMLA's dense decode kernel (the sgl-flash-mla wheel's legacy kernel set, SGLang's pin from 0.5.2x) over pages
# of 64 tokens (flashmla_backend.py ``PAGE_SIZE``; the server sets that page size for it), its extends its FlashInfer
# MLA parent's
FLASHMLA_KERNELS = ("FlashMLA's dense decode kernels (the sgl-flash-mla wheel's flash_mla, or sgl_kernel's before) run "
                    "on Hopper (SM90)")
FLASHMLA_PAGE = 64


def flashmla_unrunnable() -> str | None:
    """Why SGLang's FlashMLA backend cannot be built and run here (None: it can). Its kernels come from flash_mla where
    the installed SGLang has the sgl-flash-mla interface (0.5.2x), from sgl_kernel's flash_mla before; its extends run
    FlashInfer's MLA kernels, so FlashInfer is needed too."""
    root = features.package_root()
    interface = root is not None and (root / "kernels" / "ops" / "attention" / "flash_mla_interface.py").is_file()
    package = "flash_mla" if interface else "sgl_kernel"
    needs = ((package, f"{package} is not installed"),
             ("flashinfer", "its extends run FlashInfer's MLA kernels; FlashInfer is not installed"))
    return kernels_unrunnable(FLASHMLA_KERNELS, needs, (9,))


def _flashmla_capabilities(unrunnable: str | None) -> Capabilities:
    """Where its kernels run, every property; elsewhere its classes (its planning asks FlashMLA's scheduler kernel,
    ``get_mla_metadata``, for the split of each request's keys: no plan without the kernel)."""
    if unrunnable is not None:
        return class_level("mla", unrunnable, "flashmla")
    return Capabilities(
        attention_kinds=frozenset({"mla"}),
        engine_features=("deepseek_mla",),
        # Decode and idle, target verify (FlashMLA's decode kernel over each request's fixed query window, causal),
        # extends and mixed batches through its FlashInfer MLA parent (init_forward_metadata's last branch); EAGLE v2's
        # draft extend on its fixed-query decode kernel, every window num_draft_tokens wide
        modes=FLASHINFER_MLA_MODES | {ForwardMode.DRAFT_EXTEND},
        fixed_width_draft_extend=True,
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        **MLA_DRAFT,
        # Its graphs: decode, idle and verify over static page-table and scheduler buffers
        # (_apply_decode_target_verify_metadata, flashmla_backend.py:328-430)
        cuda_graph_modes=FLASHINFER_MLA_GRAPH_MODES,
        # A verify runs the decode kernel causally over each request's window: chains only. The server refuses draft
        # trees with pages of more than one token for it (speculative_hook.py, _PAGE_TREE_SPEC_BACKENDS), and its page
        # is 64
        draft_trees=False,
        page_sizes=frozenset({FLASHMLA_PAGE}),
        dtypes=FLASHINFER_DTYPES,
        devices=frozenset({"cuda"}),
        requires=("sglang", "flashinfer", "flash_mla"),
        engine="sglang",
        one_shape_per_kind=True,
        engine_classes="flashmla",
    )


FLASHMLA_READ = frozenset({"block_kv_indices", "seq_lens_k"})


def flashmla_plan(meta, sfb, num_draft_tokens: int) -> PlannedMetadata:
    """FlashMLA's decode-side plan (``FlashMLADecodeMetadata``) in the inspectable form: per request the first
    ``ceil(keys / 64)`` entries of its ``block_kv_indices`` row, its keys the batch's (a verify's with its draft
    window: the kernel is handed ``seq_lens + num_draft_tokens``), or the planned ``seq_lens_k`` where it plans them
    (a draft extend). The split schedule FlashMLA's kernel plans (``flashmla_metadata``, ``num_splits``) is named,
    not checked."""
    keys = meta.seq_lens_k
    if keys is None:
        keys = sfb.seq_lens[:sfb.batch_size] + (num_draft_tokens if sfb.forward_mode.is_target_verify() else 0)
    indptr, indices = page_table_lists(meta.block_kv_indices, keys, FLASHMLA_PAGE)
    return PlannedMetadata(kv_indptr=indptr, kv_indices=indices, kv_indices_are_pages=True,
                           kv_includes_new_tokens=True, key_lens=meta.seq_lens_k,
                           unread=unread_fields(meta, FLASHMLA_READ))


class SglangFlashMla(ReadsEngineClasses, SglangFlashInferMLA):
    """SGLang's ``FlashMLABackend``, driven as DeepSeek drives it (its own dispatcher, ``handle_attention_flashmla``;
    the absorbed layer handed its query and key concatenated, :func:`rope_apart`). Where FlashMLA cannot run (no
    flash_mla, FlashInfer or Hopper GPU) a class-level leaf: its classes read (flash_mla an inert stand-in where it is
    absent, runtime.py), never built."""

    sglang_name = "flashmla"
    capabilities = _flashmla_capabilities(flashmla_unrunnable())

    def __init__(self, model_runner) -> None:
        if self.capabilities.class_only:
            raise TypeError(f"sglang.{self.sglang_name} is a class-level leaf here: only its classes are checked, it "
                            f"is not built ({self.capabilities.class_only})")
        super().__init__(model_runner)

    def planned_metadata(self) -> PlannedMetadata:
        """Its decode, verify and graph plans (the page table FlashMLA reads); an extend's, its FlashInfer MLA
        parent's wrappers."""
        meta = getattr(self.inner, "forward_metadata", None)
        if meta is not None and getattr(meta, "block_kv_indices", None) is not None:
            # the draft window its verify kernel is handed: the server's, as SGLang built it (num_draft_tokens)
            return flashmla_plan(meta, next(iter(self.batches.values())), self.inner.num_draft_tokens or 0)
        return SglangFlashInferMLA.planned_metadata(self)  # named, not super(): a TBO half borrows this method
