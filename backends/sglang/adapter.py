"""SGLang's real attention backends as leaves of the harness's matrix.

Each leaf wraps one ``ATTENTION_BACKENDS[name](runner)`` of the installed SGLang. The harness's engine drives
the leaf as a model would; the leaf translates each batch into SGLang's ``ForwardBatch`` (pools shared with the
harness's, see :mod:`backends.sglang.runtime`), plans it with SGLang's ``init_forward_metadata`` and runs each
layer as SGLang's ``RadixAttention`` runs it (``layer(q, k, v, forward_batch)`` under SGLang's forward context,
which dispatches to ``get_attn_backend().forward``). What SGLang planned is exposed in the harness's
inspectable form (:class:`backends.base.PlannedMetadata`).

Mode names: the harness's DRAFT_EXTEND is SGLang's DRAFT_EXTEND_V2 (with an ``EagleDraftExtendInput``); the
others are the same. An IDLE batch without requests is never planned: SGLang's eager runner drops the
backend's plan instead (``runner/eager_runner.py:445-456``, ``_execute_idle``), and every layer returns an empty
output (``base_attn_backend.py:332``). A graph() term drives SGLang's own three-method contract
(``init_cuda_graph_state``, ``init_forward_metadata_out_graph(fb, in_capture)``, ``init_forward_metadata_in_graph``)
from the harness's graph runner, over SGLang ForwardBatches that view the runner's static buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

import torch

from backends.base import (DRAFTING_MODES, AttentionBackend, Capabilities, EngineBrokeInvariant, PlannedMetadata,
                           call_accepting)
from backends.sglang import compat, handover, runtime
from batch.spec import ForwardMode
from batch.tbo_split import TboSplit, slice_spec_info

# The modes whose batches this adapter translates into SGLang's: all that a backend serves.
ADAPTED_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                           ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE})
_SGLANG_MODE = {ForwardMode.EXTEND: "EXTEND", ForwardMode.DECODE: "DECODE", ForwardMode.MIXED: "MIXED",
                ForwardMode.TARGET_VERIFY: "TARGET_VERIFY", ForwardMode.DRAFT_EXTEND: "DRAFT_EXTEND_V2",
                ForwardMode.IDLE: "IDLE"}
# SGLang's TBO splitter cuts a MIXED batch's tokens with the two-chunk rule but its requests without it
# (docs/findings/sglang-tbo-mixed-two-chunk.md): Triton kernels then read and write past the halves' buffers,
# which aborts the process (interpreted: heap corruption; CUDA: an illegal access), so the row is not run.
TBO_MIXED_GAP = ("tbo", ForwardMode.MIXED, "SGLang's splitter corrupts MIXED halves (docs/findings/"
                                           "sglang-tbo-mixed-two-chunk.md) and Triton then writes out of bounds")
# SGLang plans a draft extend on the draft worker with its own draft-extend backend
# (speculative/draft_utils.py, DraftBackendFactory.create_draft_extend_backend), never a TboAttnBackend, and
# TboForwardBatchPreparer.prepare skips draft workers: no TBO composition of SGLang's serves DRAFT_EXTEND_V2.
TBO_DRAFT_EXTEND_GAP = ("tbo", ForwardMode.DRAFT_EXTEND, "SGLang's draft worker plans draft extends with its own "
                                                         "backend, never under TboAttnBackend")


class LayerBuildError(RuntimeError):
    """SGLang's layer object (a RadixAttention, a model's mixer) could not be built where the adapter builds it: in
    place of the model's constructor, outside a server's start-up (its parallel groups, its loader). Raised from the
    adapter's frame, so the crash is the harness's (an adapter error), never counted as the engine's bug; an engine
    that cannot build its own backends (``make_inner``) is still a finding."""


@contextlib.contextmanager
def _building(what: str):
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure here is the adapter's stand-in for the model's construction
        raise LayerBuildError(f"building SGLang's {what} in place of the model's: {type(e).__name__}: {e}") from e


class _Identity(torch.nn.Module):
    """A projection that hands its input through, as SGLang's linear layers return it: ``(output, bias)``."""

    def forward(self, x):
        return x, None


class _Ungated(torch.nn.Module):
    """An output norm that hands its input through, ignoring its gate (``o_norm(x, gate)``)."""

    def forward(self, x, gate):
        return x


class _Embed(torch.nn.Module):
    """An output projection that keeps its input's channels and pads them with zeros to ``width``: ``(output,
    bias)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x):
        return torch.nn.functional.pad(x, (0, self.width - x.shape[-1])), None


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


def draft_trees(fb) -> torch.Tensor | None:
    """A target verify's draft trees (``[batch, draft tokens]`` parents, the real rows' first in a graph's static
    batch), which its positions follow; None for any other batch."""
    info = fb.spec_info if fb.forward_mode.is_target_verify() else None
    return None if info is None else info.parents


def _check_prefill_graph_scope(sgl, sfb) -> None:
    """The engine's own predicates, read inside the prefill-graph scope the adapter entered: the ones its layers ask
    before they break out of the graph. A layer that took no break because this scope did not take hold on the
    installed release is the adapter's error (raised here, so reported as one), never the engine's finding."""
    wrong = [what for what, held in (
        ("is_in_breakable_cuda_graph()", sgl.is_in_breakable_cuda_graph()),
        ("the piecewise forward context's batch", getattr(sgl.get_tc_piecewise_forward_context(), "forward_batch",
                                                          None) is sfb),
        ("get_forward_batch()", sgl.get_forward_batch() is sfb),
        ("is_in_prefill_graph_scope()", sgl.is_in_prefill_graph_scope is None or sgl.is_in_prefill_graph_scope()),
    ) if not held]
    if wrong:
        raise RuntimeError(f"the adapter's prefill-graph scope did not take hold on this release: {', '.join(wrong)} "
                           f"read otherwise inside it")


@contextlib.contextmanager
def host_break_capture(sgl, graph):
    """SGLang's breakable-graph capture with nothing captured, for a machine without CUDA graphs: inside it,
    SGLang's ``eager_on_graph`` decorator sees a capture in progress (its context variable holds a
    ``BreakableCUDAGraphCapture``), ends the segment, runs the decorated call and records it in ``graph`` as a
    break, exactly as in a real capture; the segment ends and starts do nothing (no CUDA graph is begun). A layer
    whose call is not a graph break (the decorator missing) runs straight through and records nothing, as its
    kernels would be frozen into a segment on a GPU."""

    class HostCapture(sgl.BreakableCUDAGraphCapture):
        def _begin_new_segment(self) -> None:
            pass

        def _end_current_segment(self) -> None:
            pass

    capture = HostCapture(graph)
    token = sgl.breakable_capture_var.set(capture)
    try:
        yield capture
    finally:
        sgl.breakable_capture_var.reset(token)


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

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices: torch.Tensor,
                                            mamba_track_indices: torch.Tensor | None = None,
                                            mamba_steps_to_track: torch.Tensor | None = None, model=None,
                                            req_pool_indices: torch.Tensor | None = None) -> None:
        """SGLang's verify commit, with its arguments (the harness's backends take the same): each request's last
        accepted step, the radix cache's tracked copies (the harness's state slots are SGLang's mamba indices:
        StateSync copies the map), and, as spec_utils passes them, the planned batch's request rows; then the
        committed states come back into the harness's pools."""
        planned = self.planned_sglang_batch()
        if req_pool_indices is None and planned is not None:
            req_pool_indices = planned.req_pool_indices[:planned.batch_size]
        states = self.state_sync()
        if states is not None and states.harness is None:
            states = None  # a model without linear layers: no states to copy
        if states is not None:
            states.push_states()  # the harness's pools may have been reset to the verified states since
        # SGLang's caller (speculative/spec_utils.py, after verify) guards the call with hasattr and passes keywords,
        # those of its release (compat.COMMIT_RENAMES: 0.5.10 names the same indices accepted_steps; before
        # 0.5.17 there are no request rows to pass).
        commit = getattr(self.inner, "update_mamba_state_after_mtp_verify", None)
        if commit is not None:
            with torch.no_grad():
                commit(**compat.accepted(commit, dict(
                    last_correct_step_indices=last_correct_step_indices.to(torch.int64),
                    mamba_track_indices=mamba_track_indices, mamba_steps_to_track=mamba_steps_to_track,
                    model=model, req_pool_indices=req_pool_indices), compat.COMMIT_RENAMES))
        for layer_id in (states.harness.conv_states if states is not None else ()):
            states.pull(layer_id)

    def state_sync(self) -> "runtime.StateSync | None":
        """Where this adapter's linear-attention states are copied between the harness and SGLang."""
        return None

    def _capture_or_check(self, forward_batch, in_capture: bool) -> None:
        """At capture: SGLang's backend built and its graph state allocated (once: a graph keeps the backend it
        was captured with). At replay: that backend must be the one captured."""
        if in_capture:
            self._ensure_built(forward_batch)
            max_bs, max_num_tokens = self.graph_state
            self.inner.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_num_tokens)
            self.graph_inner = self.inner
        elif getattr(self, "graph_inner", None) is None or self.inner is not self.graph_inner:
            raise RuntimeError("graph replay before capture: init_forward_metadata_out_graph(in_capture=True) "
                               "must plan the static batch first")

    def engine_probed_members(self) -> tuple[str, ...]:
        """Protocol beyond the base class: the members SGLang's callers probe for with ``hasattr``."""
        return runtime.probed_members()

    def engine_probed_on_full_backend(self) -> frozenset[str]:
        """Probed members whose callers also look on a hybrid wrapper's ``full_attn_backend``: not owed by it."""
        return runtime.probed_on_full_backend()

    def engine_children(self, obj) -> list:
        """The SGLang backends an SGLang wrapper object holds (none for a leaf): a hybrid's
        ``attn_backend_list``, a prefill/decode split's two."""
        if getattr(obj, "attn_backend_list", None):
            return list(obj.attn_backend_list)
        if self.sgl.HybridAttnBackend is not None and isinstance(obj, self.sgl.HybridAttnBackend):
            return [obj.prefill_backend, obj.decode_backend]
        return []

    def probe_owners(self, wrapper, children: list) -> list:
        """The children whose hasattr-probed members ``wrapper`` owes its callers. A prefill/decode split owes its
        prefill child's only: every probed member is read on the prefill or verify path (the scheduler's prefill
        tile budget, managers/scheduler.py ``extend_attention_block_m``; the MLA prefill's
        ``init_mha_chunk_metadata``; the verify commit, which the split routes to its prefill child under
        ``--speculative-attention-mode prefill``). Any other wrapper owes every child's."""
        if self.sgl.HybridAttnBackend is not None and isinstance(wrapper, self.sgl.HybridAttnBackend):
            return [wrapper.prefill_backend]
        return children

    def planned_sglang_batch(self):
        """The SGLang ForwardBatch this adapter planned last (None before the first)."""
        batches = getattr(self, "batches", None)
        return next(iter(batches.values())) if batches else None

    def mha_chunk_call_batch(self):
        """The planned batch as SGLang's MLA model code hands it to ``init_mha_chunk_metadata``: with its prefix
        chunk count set first (``num_prefix_chunks = 0`` on the one-shot path, forward_mha.py:406-409; the
        chunked path sets it in ``prepare_chunked_prefix_cache_info`` just before, :366-373)."""
        sfb = self.planned_sglang_batch()
        if sfb is not None and sfb.num_prefix_chunks is None:
            sfb.num_prefix_chunks = 0
        return sfb


class SglangBackend(_SglangObject):
    """One SGLang attention backend, built over the harness runner's pools on the first batch it plans
    (SGLang sizes speculative buffers from the draft token count, which a runner does not know)."""

    sglang_name: ClassVar[str]
    planned_graph: bool = False  # the last plan was a graph's (its buffers sized for the largest capture)
    # Built for a server whose extends run through the breakable prefill graph (set by the prefill graph's capture)
    prefill_graph: bool = False
    hybrid: runtime.HybridModel | None = None  # set for SGLang's hybrid wrapper (SglangHybrid)
    decode_name: str | None = None  # set for SGLang's prefill/decode split (SglangPrefillDecode)

    def __init__(self, model_runner) -> None:
        self.model_runner = model_runner
        self.sgl = runtime.load()
        self.inner = None  # the SGLang backend
        self.sgl_runner = None
        self.states: runtime.StateSync | None = None
        self.draft_tokens = 0
        self.algorithm = "eagle"  # the server's --speculative-algorithm it was built for (batch.spec.SpecInput)
        self.batches: dict[int, object] = {}  # id(harness batch) -> its SGLang ForwardBatch
        self.radix: dict[int, object] = {}

    def state_sync(self) -> "runtime.StateSync | None":
        return self.states

    # ---- building ----
    @classmethod
    def multi_step_draft(cls, model_runner, topk: int, speculative_num_steps: int, draft_window_size: int = 0,
                         draft_sink_size: int = 0):
        """SGLang's own multi-step draft backend for this leaf, as its draft worker builds it for a server with
        that draft window (backends/sglang/draft.py)."""
        from backends.sglang.draft import SglangMultiStepDraft

        return SglangMultiStepDraft(cls, model_runner, topk, speculative_num_steps, draft_window_size,
                                    draft_sink_size)

    @classmethod
    def engine_build_scope(cls):
        """What SGLang's constructors of this leaf's backends need around them here (a context): nothing, but for a
        plan-level leaf (plans.py), whose kernels' modules are stand-ins; the draft worker's container is built in
        it too (backends/sglang/draft.py)."""
        return contextlib.nullcontext()

    @classmethod
    def engine_backend(cls, sgl, sgl_runner):
        """SGLang's backend object for this leaf over ``sgl_runner``, as the server's ``--attention-backend``
        factory builds it (every wrapper builds its children this way)."""
        return sgl.ATTENTION_BACKENDS[cls.sglang_name](sgl_runner)

    def make_inner(self, sgl_runner):
        """A new SGLang backend object over ``sgl_runner`` (a TBO wrapper asks for its children this way)."""
        return self.engine_backend(self.sgl, sgl_runner)

    def _ensure_built(self, fb) -> None:
        draft = fb.spec_info.draft_token_num if fb.spec_info is not None else 0
        # A batch without speculative inputs runs on whatever server the backend was built for
        algorithm = fb.spec_info.algorithm if fb.spec_info is not None else self.algorithm
        if self.inner is not None and draft <= self.draft_tokens and algorithm == self.algorithm:
            return
        topk = fb.spec_info.topk if fb.spec_info is not None else 0
        self.sgl_runner = runtime.make_runner(self.model_runner, self.sglang_name, draft, topk, hybrid=self.hybrid,
                                              decode_backend_name=self.decode_name, algorithm=algorithm,
                                              prefill_graph=self.prefill_graph)
        self.algorithm = algorithm
        if self.hybrid is not None:
            self.states = runtime.StateSync(self.sgl_runner, self.model_runner)
        self.inner = self.make_inner(self.sgl_runner)
        self.draft_tokens = draft
        self.radix.clear()

    def _layer(self, layer):
        """SGLang's RadixAttention for a harness layer (cached per layer id)."""
        radix = self.radix.get(layer.layer_id)
        if radix is None:
            with _building("RadixAttention"):
                radix = self.sgl.RadixAttention(
                    num_heads=layer.tp_q_head_num, head_dim=layer.head_dim, scaling=layer.scaling,
                    num_kv_heads=layer.tp_k_head_num, layer_id=layer.layer_id, logit_cap=layer.logit_cap,
                    v_head_dim=layer.v_head_dim, sliding_window_size=layer.sliding_window_size)
            if self.sgl_runner.kv_cache_dtype == torch.float8_e4m3fn and layer.kind != "lightning":
                # What SGLang's BaseKVCacheMethod leaves on the layer after loading a checkpoint's KV scales
                # (layers/quantization/kv_cache.py, process_weights_after_loading). A lightning layer has no KV
                # cache and keeps k_scale None, as in a bf16 checkpoint served with --kv-cache-dtype fp8_e4m3.
                # On the model's device, where create_weights makes them (the model is built under its device):
                # TRT-LLM MHA's fused fp8 cache write takes them as device tensors.
                dev = self.sgl_runner.device
                radix.k_scale = torch.nn.Parameter(torch.tensor(float(layer.k_scale), device=dev), requires_grad=False)
                radix.v_scale = torch.nn.Parameter(torch.tensor(float(layer.v_scale), device=dev), requires_grad=False)
                radix.k_scale_float, radix.v_scale_float = float(layer.k_scale), float(layer.v_scale)
            self.radix[layer.layer_id] = radix
        return radix

    def _linear_layer(self, layer):
        """SGLang's RadixLinearAttention for a harness linear layer (cached per layer id)."""
        radix = self.radix.get(layer.layer_id)
        if radix is None:
            s, w = layer.spec, layer.weights
            with _building("RadixLinearAttention"):
                radix = self.sgl.RadixLinearAttention(
                    layer_id=layer.layer_id, num_q_heads=s.num_k_heads, num_k_heads=s.num_k_heads,
                    num_v_heads=s.num_v_heads, head_q_dim=s.head_k_dim, head_k_dim=s.head_k_dim,
                    head_v_dim=s.head_v_dim, conv_weights=w["conv_weight"], bias=None, activation="silu",
                    A_log=w["A_log"], dt_bias=w["dt_bias"])
            self.radix[layer.layer_id] = radix
        return radix

    def _conv_layer(self, layer):
        """SGLang's own LFM2 conv layer (``Lfm2ShortConv``) for a harness short-conv layer (cached per layer id),
        with the drawn conv weights and its two projections the identity: the harness hands it the input
        projection's output (B, C, x side by side) and reads its output before the output projection. Its forward is
        then the model's, whatever the release: the kernel calls, the state it asks the backend for."""
        conv = self.radix.get(layer.layer_id)
        if conv is None:
            sgl, w = self.sgl, layer.weights
            with _building("Lfm2ShortConv"):
                conv = sgl.Lfm2ShortConv.__new__(sgl.Lfm2ShortConv)
                torch.nn.Module.__init__(conv)  # no __init__: it would build TP-sharded projections and load nothing
                conv.layer_idx, conv.conv_kernel = layer.layer_id, layer.spec.conv_kernel
                conv.hidden_size = conv.hidden_size_per_partition = layer.spec.hidden
                conv.use_bias = layer.spec.conv_bias
                conv.in_proj = conv.out_proj = _Identity()
                # In the model's dtype, as a checkpoint loads them (the drawn values lie on its grid: exact)
                dtype = self.sgl_runner.dtype
                conv.conv_weight = torch.nn.Parameter(w["conv_weight"].to(dtype), requires_grad=False)
                conv.conv_bias = torch.nn.Parameter(w["conv_bias"].to(dtype), requires_grad=False) \
                    if "conv_bias" in w else None
                if sgl.register_shortconv_verify_buffers is not None:
                    sgl.register_shortconv_verify_buffers(conv)
                    conv.to(w["conv_weight"].device)
            self.radix[layer.layer_id] = conv
        return conv

    def _kda_layer(self, layer):
        """SGLang's own KDA layer module of the hybrid's KDA leaf's model for a harness KDA layer (cached per layer id):
        ``build_layer`` of :class:`SglangKda` (Kimi Linear's ``KimiDeltaAttention``) or of a variant."""
        block = self.radix.get(layer.layer_id)
        if block is None:
            block = self.linear.build_layer(self.sgl, layer)
            self.radix[layer.layer_id] = block
        return block

    def _mamba2_layer(self, layer):
        """A Nemotron-H mamba decoder layer of SGLang's own, for a harness Mamba-2 layer (cached per layer id): its
        ``MambaMixer2`` built by SGLang for the model's config, with the drawn parameters, its input projection the
        identity (the harness hands it z, xBC and dt) and its output projection a fixed embedding of its I channels
        into that width (zeros after them: a release whose layer sizes its output buffer like its input, 0.5.10's,
        gets one that fits); the decoder layer's ``_forward_mamba`` is then the model's call, whatever the release."""
        block = self.radix.get(layer.layer_id)
        if block is None:
            sgl, s, w = self.sgl, layer.spec, layer.weights
            config = self.sgl_runner.model_config.hf_config
            dtype = self.sgl_runner.dtype  # as a checkpoint loads them (the drawn values lie on its grid: exact)
            with _building("MambaMixer2"), torch.device(w["A"].device), torch.no_grad():
                mixer = sgl.MambaMixer2(cache_params=config.mamba2_cache_params, hidden_size=s.input_width,
                                        use_conv_bias=s.conv_bias, use_bias=False, n_groups=s.n_groups,
                                        rms_norm_eps=config.layer_norm_epsilon, activation="silu",
                                        prefix=f"layers.{s.layer_id}.mixer")
                mixer.in_proj, mixer.out_proj = _Identity(), _Embed(s.input_width)
                mixer.conv1d.weight = torch.nn.Parameter(w["conv_weight"].to(dtype)[:, None, :], requires_grad=False)
                mixer.conv1d.bias = torch.nn.Parameter(w["conv_bias"].to(dtype), requires_grad=False) \
                    if "conv_bias" in w else None
                mixer.A = torch.nn.Parameter(w["A"].float(), requires_grad=False)  # float32, as SGLang keeps it
                for name, value in (("D", w["D"]), ("dt_bias", w["dt_bias"])):
                    setattr(mixer, name, torch.nn.Parameter(value.to(dtype), requires_grad=False))
                mixer.norm.weight = torch.nn.Parameter(w["norm_weight"].to(dtype), requires_grad=False)
                block = sgl.NemotronHMambaDecoderLayer.__new__(sgl.NemotronHMambaDecoderLayer)
                torch.nn.Module.__init__(block)  # no __init__: it would build the mixer from a checkpoint's shapes
                block.config, block.layer_id, block.mixer = config, s.layer_id, mixer
            self.radix[layer.layer_id] = block
        return block

    def translate(self, fb, graph: bool = False, static: bool = False):
        """The harness batch as SGLang's ForwardBatch (the same tensors where the layouts agree). ``graph``: the
        graph runner's static batch, translated as SGLang's graph runners build theirs (int64 ``seq_lens``
        viewing the static buffer, the runner's own write slots). Any other batch must be one SGLang's scheduler
        builds (``handover``), unless ``static``: a graph runner's own batch planned eagerly (a prefill graph's
        capture batch, on dummy request rows as SGLang's runner captures, and its replays' batches over the padded
        token buffers)."""
        sgl = self.sgl
        mode = getattr(sgl.ForwardMode, _SGLANG_MODE[fb.forward_mode])
        T = fb.extend_num_tokens
        dev = fb.device
        # int64 lengths, as the scheduler hands them (ScheduleBatch.seq_lens, schedule_batch.py:2786; prepare_for_decode
        # adds 1; ForwardBatch.init_new keeps them), where SGLang's unit-test kit builds int32: a backend that casts
        # them with .to(torch.int32) gets a copy, as in the server (a graph's view the static int64 buffer too)
        out = sgl.ForwardBatch(
            forward_mode=mode, batch_size=fb.batch_size,
            input_ids=torch.zeros(fb.positions.shape[0], dtype=torch.int64, device=dev),  # a prefill graph: padded
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens.to(torch.int64),
            seq_lens_cpu=fb.seq_lens_cpu.to(torch.int64), out_cache_loc=fb.out_cache_loc,
            seq_lens_sum=fb.seq_lens_sum, positions=fb.positions)
        out.mrope_positions = fb.mrope_positions  # [3, T]: SGLang's TBO splitter cuts it on dim 1
        # The real tokens (SGLang sets it on every batch, forward_batch_info.py:1382; a prefill graph's static
        # batch carries more token rows than that, and attention runs on the real ones only)
        out.global_num_token_non_padded_cpu = T if fb.num_token_non_padded is None else fb.num_token_non_padded
        if graph:  # as SGLang's replay view (decode_cuda_graph_runner.py:216, build_replay_fb_view)
            out.num_padding = fb.num_padding
        chosen = out.out_cache_loc  # the adapter's write slots (SGLang's KV-index translator may rebind them)
        compat.bind_kv_indices(self.sgl_runner, out, graph)
        compat.attach_pools(out, self.sgl_runner)
        # A verify batch carries no extend_* fields, as SGLang's own ForwardBatch.init_new builds it (decode and
        # target_verify take their positions from seq_lens or the spec info and skip the extend branch,
        # model_executor/forward_batch_info.py:1226-1247): Mamba2AttnBackend plans a verify as one when its
        # extend_num_tokens is None (Mamba2Metadata.prepare_mixed), as a prefill otherwise.
        if mode.is_extend(include_draft_extend_v2=True) and not mode.is_target_verify():
            out.extend_prefix_lens = fb.extend_prefix_lens
            out.extend_prefix_lens_cpu = list(fb.extend_prefix_lens_cpu)
            out.extend_seq_lens = fb.extend_seq_lens
            out.extend_seq_lens_cpu = list(fb.extend_seq_lens_cpu)
            out.extend_start_loc = fb.extend_start_loc
            out.extend_num_tokens = T
        if fb.forward_mode.is_target_verify():
            out.spec_info = self._verify_input(fb, out)
            out.spec_algorithm = getattr(sgl.SpeculativeAlgorithm, runtime.SERVER_ALGORITHMS[fb.spec_info.algorithm])
        if fb.forward_mode.is_draft_extend():
            out.spec_info = self._draft_extend_input(fb, out)
            out.spec_algorithm = sgl.SpeculativeAlgorithm.EAGLE
        if not (graph or static) and handover.first_handover(fb):
            # before any SGLang backend plans over it: a batch its scheduler never builds is the adapter's error
            handover.check(out, getattr(getattr(self.sgl_runner, "req_to_token_pool", None), "req_to_token", None),
                           chosen, getattr(self.sgl_runner, "page_size", 1), draft_trees(fb))
        return out

    def _verify_input(self, fb, out):
        """The verify input the batch's speculative algorithm hands the target model, built as its worker builds it:
        EAGLE's and frozen-KV MTP's (eagle_worker_common.py; a subclass of EAGLE's) and n-gram's (ngram_worker.py)
        carry the tree mask and its links; DFlash's (dflash_worker_v2.py, verify) a block under the causal mask, no
        custom mask, and the batch's host lengths widened by the block (``seq_lens_cpu`` the committed prefix plus
        the block, ``seq_lens_sum`` likewise; the device ``seq_lens`` stay the committed lengths)."""
        sgl, info, dev = self.sgl, fb.spec_info, fb.device
        D = info.draft_token_num
        if info.algorithm == "dflash":
            out.seq_lens_cpu = out.seq_lens_cpu + D
            out.seq_lens_sum = int(out.seq_lens_cpu.sum())
            return sgl.DFlashVerifyInput(draft_token=out.input_ids, positions=fb.positions, draft_token_num=D,
                                         custom_mask=None, capture_hidden_mode=sgl.CaptureHiddenMode.FULL)
        links = [retrieve_links(p) for p in info.parents.tolist()]
        tree = dict(draft_token=out.input_ids, custom_mask=info.custom_mask, positions=fb.positions,
                    retrieve_index=torch.arange(fb.batch_size * D, device=dev).reshape(fb.batch_size, D),
                    retrieve_next_token=torch.tensor([l[0] for l in links], dtype=torch.int64, device=dev),
                    retrieve_next_sibling=torch.tensor([l[1] for l in links], dtype=torch.int64, device=dev),
                    draft_token_num=D)
        if info.algorithm == "ngram":
            return sgl.NgramVerifyInput(**compat.accepted(sgl.NgramVerifyInput, tree, compat.NGRAM_RENAMES))
        cls = sgl.FrozenKVMTPVerifyInput if info.algorithm == "frozen_kv_mtp" else sgl.EagleVerifyInput
        return cls(**compat.accepted(cls, tree | dict(
            retrieve_cum_len=torch.arange(fb.batch_size + 1, dtype=torch.int32, device=dev) * D,
            spec_steps=info.spec_steps, topk=info.topk, capture_hidden_mode=sgl.CaptureHiddenMode.FULL,
            seq_lens_sum=out.seq_lens_sum, seq_lens_cpu=out.seq_lens_cpu), compat.VERIFY_RENAMES))

    def _draft_extend_input(self, fb, out):
        """SGLang's ``EagleDraftExtendInput`` for a draft extend of ``extend_seq_lens`` accepted tokens per
        request (``seq_lens`` already counts them), built as SGLang's kit builds it
        (speculative_draft_extend_runner.py:119-146) and its graph runner at capture (one fixed width)."""
        accept = fb.extend_seq_lens.to(torch.int32)
        accept_cpu = [int(a) for a in fb.extend_seq_lens_cpu]
        info = self.sgl.EagleDraftExtendInput(
            hidden_states=None, num_correct_drafts=accept - 1, num_accept_tokens=accept,
            num_accept_tokens_cpu=accept_cpu, input_ids=out.input_ids, seq_lens=out.seq_lens,
            seq_lens_cpu=out.seq_lens_cpu, req_pool_indices=fb.req_pool_indices, positions=fb.positions,
            capture_hidden_mode=self.sgl.CaptureHiddenMode.LAST, num_tokens_per_req=max(accept_cpu, default=0),
            num_tokens_for_logprob_per_req=1)
        info.extend_seq_lens_tensor = accept
        info.extend_seq_lens_cpu = accept_cpu
        return info

    # ---- the protocol ----
    def init_forward_metadata(self, forward_batch) -> None:
        self._plan(forward_batch, lambda sfb: self.inner.init_forward_metadata(sfb))

    def _plan(self, forward_batch, plan, static: bool = False):
        """SGLang's view of ``forward_batch``, the linear states pushed into its pools, then ``plan(sfb)`` under the
        backend's forward context; returns what it returns (None for an empty idle batch, which is not planned).
        ``static``: a graph runner's own batch (``translate``)."""
        self._ensure_built(forward_batch)
        sfb = self.translate(forward_batch, static=static)
        self.batches = {id(forward_batch): sfb}
        self.planned_graph = False
        if self.states is not None:
            self.states.push(forward_batch)
        if sfb.forward_mode.is_idle() and sfb.batch_size == 0:
            # SGLang's eager runner never plans an empty idle batch: it drops the stale plan instead
            # (runner/eager_runner.py:451-456), and every layer then returns an empty output.
            self.inner.forward_metadata = None
            return None
        with compat.backend_scope(self.sgl, self.inner, sfb):
            return plan(sfb)

    # ---- CUDA graphs: SGLang's three-method contract, over the graph runner's static batch ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Kept until the first graph batch builds SGLang's backend (its speculative buffers are sized from the
        draft token count, which only the batch tells), then passed to SGLang's ``init_cuda_graph_state``."""
        self.graph_state = (max_bs, max_num_tokens)
        self.graph_inner = None

    def _graph_batch(self, forward_batch, in_capture: bool):
        """SGLang's view of the static batch; at capture, SGLang's backend built and its graph state allocated
        first (once: a graph keeps the backend it was captured with). Linear states go in before each replay
        (outside the graph) and come back inside it (whole-pool copies, which a graph can hold)."""
        self._capture_or_check(forward_batch, in_capture)
        sfb = self.translate(forward_batch, graph=True)
        self.check_replay(forward_batch, sfb, in_capture)
        self.batches = {id(forward_batch): sfb}
        self.planned_graph = True
        if self.states is not None:
            self.states.push(forward_batch)
        return sfb

    def check_replay(self, forward_batch, sfb, in_capture: bool) -> None:
        """Before SGLang plans a decode, target-verify or draft-extend replay over ``sfb``: its real rows must be a
        batch the scheduler builds (``handover.check_replay``; a verify's positions follow its draft trees), or the
        harness's graph runner loaded them wrong, the adapter's error."""
        mode = forward_batch.forward_mode
        if not in_capture and (mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend()):
            # The rows are loaded afresh at every replay; the request table is the harness's, shared by every replay
            # of the static batch and not restored between them: read at the first replay only, so that SGLang's own
            # write into it (a bug of its) is never read back as the adapter's
            table = getattr(getattr(self.sgl_runner, "req_to_token_pool", None), "req_to_token", None)
            handover.check_replay(sfb, forward_batch.num_padding, forward_batch.out_cache_loc,
                                  table if handover.first_handover(forward_batch, "replay") else None,
                                  getattr(self.sgl_runner, "page_size", 1), draft_trees(forward_batch))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        sfb = self._graph_batch(forward_batch, in_capture)
        with compat.backend_scope(self.sgl, self.inner, sfb):
            compat.plan_out_graph(self.inner, sfb, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("init_forward_metadata_in_graph before init_forward_metadata_out_graph")
        with compat.backend_scope(self.sgl, self.inner, sfb):
            compat.plan_in_graph(self.inner, sfb)

    # ---- SGLang's breakable prefill graph (engine.graph_runner.PrefillGraphRunner) ----
    def _captures_prefill_metadata(self) -> bool:
        """Whether SGLang's backend takes the captured-metadata contract of the breakable prefill graph, as it decided
        at construction (``use_captured_forward_metadata_for_breakable_cuda_graph``: the hybrid over a linear backend
        whose extend runs on static tables, KDA's from 0.5.22; a release without the attribute has no such
        contract)."""
        return bool(getattr(self.inner, "use_captured_forward_metadata_for_breakable_cuda_graph", False))

    def init_forward_metadata_for_prefill_capture(self, forward_batch):
        """How SGLang's prefill runner plans a bucket's capture batch (``_init_forward_metadata_for_capture``,
        prefill_cuda_graph_runner.py:1236-1255 in 0.5.23), on a backend built for a server whose extends run through
        the breakable graph: where the backend takes the captured-metadata contract, its
        ``init_forward_metadata_for_breakable_cuda_graph_capture`` (the bucket's metadata is returned, each replay
        refreshes it); elsewhere the eager plan (None)."""
        if not self.prefill_graph:  # built (if at all) for eager extends: built again, for the graph's server
            self.prefill_graph, self.inner = True, None
        return self._plan(forward_batch, lambda sfb: (
            self.inner.init_forward_metadata_for_breakable_cuda_graph_capture(sfb) if self._captures_prefill_metadata()
            else self.inner.init_forward_metadata(sfb)), static=True)

    def prepare_forward_metadata_for_prefill_replay(self, captured, forward_batch) -> None:
        """How SGLang's prefill runner plans a replay (``_prepare_forward_metadata_for_replay``, :1257-1318): the
        captured-metadata contract's refresh of the bucket's metadata (the harness's static batch is SGLang's static
        batch too), else the eager plan."""
        if self.inner is None or not self.prefill_graph:
            raise RuntimeError("a prefill graph replay before its capture built the backend for the graph")
        if not self._captures_prefill_metadata():  # the live requests over the runner's padded token buffers
            self._plan(forward_batch, lambda sfb: self.inner.init_forward_metadata(sfb), static=True)
            return
        self._plan(forward_batch, lambda sfb: self.inner.prepare_forward_metadata_for_breakable_cuda_graph_replay(
            captured, sfb, static_forward_batch=sfb), static=True)

    def prefill_graph_max_requests(self) -> int | None:
        """The most requests a replay of the prefill graph takes, as SGLang's prefill runner votes
        (``can_replay_locally``, prefill_cuda_graph_runner.py:1365-1369 in 0.5.23: a larger batch runs eagerly): under
        the captured-metadata contract the backend's ``prefill_cuda_graph_max_batch_size`` (for KDA,
        ``SGLANG_KDA_PREFILL_GRAPH_MAX_SEQS``, default 128), else no limit."""
        if not self._captures_prefill_metadata():
            return None
        return getattr(self.inner, "prefill_cuda_graph_max_batch_size", None)

    def prefill_graph_layers_in_graph(self) -> frozenset[str]:
        """The layer kinds SGLang's backend runs inside the prefill graph being captured (no eager break): none here
        (a hybrid's linear kinds where it says so)."""
        return frozenset()

    @contextlib.contextmanager
    def prefill_graph_captured_host(self, forward_batch):
        """For a CPU's replay, where nothing was captured and a layer run inside the graph runs its Python again: the
        host values that layer's capture recorded. The capture batch's tokens were all real, so SGLang's linear layer
        trimmed nothing there (``_linear_attention_with_output_impl`` reads ``global_num_token_non_padded_cpu``,
        radix_linear_attention.py:177-179 in 0.5.23, :174-176 in 0.5.22), and a replayed graph hands its kernels every
        padded row: the live batch's count is the bucket's while the layer runs."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("a captured layer's replay before the replay planned the batch")
        live = sfb.global_num_token_non_padded_cpu
        sfb.global_num_token_non_padded_cpu = sfb.input_ids.shape[0]  # the static batch's rows: the bucket
        try:
            yield
        finally:
            sfb.global_num_token_non_padded_cpu = live

    @contextlib.contextmanager
    def prefill_graph_scope(self, forward_batch):
        """What SGLang's prefill runner enters around a capture or replay of the planned ``forward_batch``
        (``_prefill_forward_context``, prefill_cuda_graph_runner.py:809-839 in 0.5.23, :780-805 in 0.5.22, inside the
        breakable backend's ``enable_breakable_cuda_graph``): its layers see a breakable prefill graph, the live
        batch, and the piecewise forward context with the model's layers by id (through which 0.5.22's layers reach
        their graph-break ops, and Nemotron-H's mamba split op its layer in both releases; 0.5.23's attention and
        linear-attention layers read the prefill-graph scope's flags instead)."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("a prefill graph scope before init_forward_metadata planned the batch")
        sgl, raw = self.sgl, sfb.global_num_token_non_padded_cpu
        with sgl.enable_breakable_cuda_graph(), compat.prefill_graph_flags(sgl, raw), sgl.set_forward_batch(sfb), \
                compat.backend_scope(sgl, self.inner, sfb), \
                compat.piecewise_forward_context(sgl, sfb, self.radix, num_tokens=sfb.input_ids.shape[0],
                                                 raw_num_tokens=raw):
            _check_prefill_graph_scope(sgl, sfb)
            yield

    def capture_prefill_graph(self, fn, stream):
        """``fn`` captured as SGLang's ``BreakableCUDAGraph`` (segments between its layers' graph breaks) on
        ``stream``; returns the graph and what ``fn`` returned (the tensors a replay refills). With ``stream``
        None (a CPU: no graphs) ``fn`` runs once under SGLang's capture machinery with nothing captured
        (:func:`host_break_capture`): each graph break is recorded as in a capture, so what breaks is seen there too.
        """
        graph = self.sgl.BreakableCUDAGraph()
        if stream is None:
            with host_break_capture(self.sgl, graph):
                return graph, fn()
        # One memory pool for every segment, as SGLang's breakable backend gives them (a break's weakly held
        # inputs live in the pool of the segment that produced them)
        with self.sgl.BreakableCUDAGraphCapture(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            out = fn()
        return graph, out

    def prefill_graph_breaks(self) -> int:
        """How many eager breaks the prefill-graph capture in progress has recorded so far: one per call that
        SGLang's ``eager_on_graph`` took out of the graph (``BreakableCUDAGraph._break_fns``, what every replay
        runs eagerly between the captured segments)."""
        capture = self.sgl.breakable_capture_var.get()
        if capture is None:
            raise RuntimeError("prefill_graph_breaks outside a prefill-graph capture")
        return len(capture.cuda_graph._break_fns)

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, via=None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> o ``[T, Hq, Dv]`` through SGLang's layer, under a
        forward context whose backend is ``via`` (a wrapper the layer reaches this backend through) or this one."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("forward before init_forward_metadata planned this batch")
        T = q.shape[0]
        with torch.no_grad(), compat.backend_scope(self.sgl, via or self.inner, sfb):
            # Models hand their RadixAttention q flat, except Bailing's lightning layers, which pass [T, H, D]
            # (models/bailing_moe_linear.py:577-581; seg_la reads the heads from q's shape)
            o = self._layer(layer)(q if layer.kind == "lightning" else q.reshape(T, layer.tp_q_head_num * layer.head_dim),
                                   k.reshape(T, layer.tp_k_head_num * layer.head_dim),
                                   v.reshape(T, layer.tp_v_head_num * layer.v_head_dim), sfb, save_kv_cache=save_kv_cache)
        if layer.kind == "lightning":  # a linear layer all the same: its states come back into the harness's pools
            self.states.pull(layer.layer_id, forward_batch.state_slots,
                             verify=forward_batch.forward_mode.is_target_verify())
        return o.reshape(T, layer.tp_q_head_num, layer.v_head_dim)

    def _run_recurrent(self, layer, forward_batch, via, call) -> torch.Tensor:
        """A linear-attention layer as its model runs it: ``call(sfb)`` (the model's call into SGLang's layer object)
        under the forward context of ``via`` or this backend; then the layer's states come back into the harness's
        pools."""
        sfb = self.batches.get(id(forward_batch))
        if sfb is None:
            raise RuntimeError("forward before init_forward_metadata planned this batch")
        with torch.no_grad(), compat.backend_scope(self.sgl, via or self.inner, sfb):
            o = call(sfb)
        self.states.pull(layer.layer_id, forward_batch.state_slots,
                         verify=forward_batch.forward_mode.is_target_verify())
        return o

    def _run_linear(self, layer, forward_batch, mixed_qkv, a, b, via=None) -> torch.Tensor:
        """mixed_qkv ``[T, conv_dim]``, a, b ``[T, Hv]`` -> o ``[T, Hv, V]`` through SGLang's linear layer."""
        s = layer.spec
        o = self._run_recurrent(layer, forward_batch, via,
                                lambda sfb: self._linear_layer(layer)(sfb, mixed_qkv=mixed_qkv, a=a, b=b))
        return o.reshape(mixed_qkv.shape[0], s.num_v_heads, s.head_v_dim)

    def _run_kda(self, layer, forward_batch, mixed_qkv, a, b, via=None) -> torch.Tensor:
        """mixed_qkv ``[T, conv_dim]``, a ``[T, H * K]``, b ``[T, H]`` -> o ``[T, H, V]`` through SGLang's KDA layer
        module, called as its model calls it (the leaf's ``call_layer``: the gates as the installed release hands them
        to the backend)."""
        s, T = layer.spec, mixed_qkv.shape[0]
        norm_gate = mixed_qkv.new_zeros(T, s.num_heads * s.head_v_dim)  # the output norm's gate, unread (_Ungated)
        block = self._kda_layer(layer)
        o = self._run_recurrent(layer, forward_batch, via,
                                lambda sfb: self.linear.call_layer(block, (mixed_qkv, b, a, norm_gate), sfb))
        return o.reshape(T, s.num_heads, s.head_v_dim)

    def _run_short_conv(self, layer, forward_batch, bcx, via=None) -> torch.Tensor:
        """bcx ``[T, 3 * hidden]`` -> o ``[T, 1, hidden]`` through SGLang's LFM2 conv layer, which asks the forward
        context's backend for its state (``conv_state_metadata``, 0.5.22 on) and runs its own conv kernels."""
        hidden = layer.spec.hidden
        o = self._run_recurrent(layer, forward_batch, via, lambda sfb: self._conv_layer(layer)(bcx, sfb))
        return o[:, :hidden].reshape(bcx.shape[0], 1, hidden)

    def _run_mamba2(self, layer, forward_batch, zxbcdt, via=None) -> torch.Tensor:
        """zxbcdt ``[T, I + conv_dim + H]`` -> o ``[T, H, P]`` through SGLang's Nemotron-H mamba layer, its mixer handed
        to the hybrid's Mamba2AttnBackend as the model's layer does (the Mamba-2 leaf's ``hand_over``)."""
        T, s = zxbcdt.shape[0], layer.spec
        if forward_batch.forward_mode.is_idle():  # Nemotron-H's decoder layers skip idle batches before their mixer
            return zxbcdt.new_empty(0, s.num_heads, s.head_dim)  # (models/nemotron_h.py:616)
        block = self._mamba2_layer(layer)
        hand_over = self.linear.hand_over  # the hybrid's Mamba-2 leaf: how its model's layer calls the mixer
        o = self._run_recurrent(layer, forward_batch, via,
                                lambda sfb: hand_over(block, zxbcdt, sfb, via or self.inner))
        return o[:T, :s.intermediate].reshape(T, s.num_heads, s.head_dim)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, *,
                mixed_qkv=None, a=None, b=None, bcx=None, zxbcdt=None, via=None, **kwargs):
        if layer.kind == "linear":  # the model calls its RadixLinearAttention, which SGLang's hybrid dispatches
            return self._run_linear(layer, forward_batch, mixed_qkv, a, b, via)
        if layer.kind == "kda":  # Kimi Linear's layer, which calls its RadixLinearAttention
            return self._run_kda(layer, forward_batch, mixed_qkv, a, b, via)
        if layer.kind == "short_conv":  # the model calls its conv layer, which never goes through forward
            return self._run_short_conv(layer, forward_batch, bcx, via)
        if layer.kind == "mamba2":  # the model hands its mixer to the hybrid's Mamba-2 backend itself
            return self._run_mamba2(layer, forward_batch, zxbcdt, via)
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, via)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


    # ---- inspection ----
    def engine_objects(self) -> tuple[object | None, list[object], type]:
        """(SGLang wrapper or None, the SGLang backends under it, SGLang's base class): what conformance reads."""
        return None, [self.inner], self.sgl.AttentionBackend

    def _planner(self):
        """The SGLang object whose ``forward_metadata`` is this adapter's plan."""
        return self.inner

    def planned_metadata(self) -> PlannedMetadata:
        """SGLang's ``forward_metadata`` where it keeps one, read by its shape (whichever class planned it, under
        any wrapper): Triton's token-level indptrs and slots, or FlashAttention's per-request key counts and page
        table."""
        planner = self._planner()
        meta = getattr(planner, "forward_metadata", None)
        sfb = next(iter(self.batches.values()))
        mode = sfb.forward_mode
        if meta is not None and hasattr(meta, "kv_indptr"):
            # A sliding-window layer reads its own lists (window_kv_*) where the backend has a window; without one
            # they are unplanned and no layer reads them
            window = getattr(planner, "sliding_window_size", None) or 0
            windowed = {name: getattr(meta, name, None) if window > 0 else None for name in TRITON_WINDOW_FIELDS}
            plan = PlannedMetadata(qo_indptr=getattr(meta, "qo_indptr", None), kv_indptr=meta.kv_indptr,
                                   kv_indices=meta.kv_indices, kv_includes_new_tokens=mode.is_decode_or_idle(),
                                   custom_mask=getattr(meta, "custom_mask", None),
                                   mask_indptr=getattr(meta, "mask_indptr", None), **windowed,
                                   window=window or None, unread=unread_fields(meta, TRITON_READ))
            # A graph's buffers are sized for its largest capture; a DFlash verify's kv_indices from the host lengths
            # its worker widened by the block (seq_lens_sum, triton_backend.py: "over-allocate is safe"). Either is
            # read as far as its kv_indptr says.
            dflash = self.sgl.DFlashVerifyInput
            widened = dflash is not None and isinstance(sfb.spec_info, dflash)
            return plan.cut_to_indptrs() if self.planned_graph or widened else plan
        expand = getattr(planner, "forward_metadata_spec_decode_expand", None)
        if meta is not None and expand is not None and mode.is_decode_or_idle() and sfb.spec_info is not None \
                and (getattr(planner, "topk", 0) or 0) > 1:
            return flash_attention_draft_tree_plan(meta, expand, self.sgl_runner.page_size, planner.topk)
        if meta is not None and getattr(meta, "cache_seqlens_int32", None) is not None:
            # A verify of draft trees (topk > 1) plans the cached prefix here and the tree's own keys apart
            # (forward_metadata_spec_decode_expand, flashattention_backend.py:1083-1150), merged after both run
            tree = mode.is_target_verify() and (getattr(planner, "topk", 0) or 0) > 1
            return flash_attention_plan(meta, self.sgl_runner.page_size, includes_new_tokens=not tree,
                                        graph=self.planned_graph)
        return PlannedMetadata()


def page_row_tokens(row: torch.Tensor, count: int, page_size: int) -> torch.Tensor:
    """The first ``count`` token slots a page-table row names (its entries are slots where pages hold one token)."""
    row = row.to("cpu", torch.int64)
    if page_size == 1:
        return row[:count]
    pages = row[:-(-count // page_size)]
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:count]


def flash_attention_draft_tree_plan(meta, expand, page_size: int, topk: int) -> PlannedMetadata:
    """A draft step of FlashAttention's over draft trees (topk > 1, ``FlashAttentionMultiStepBackend``): each
    request's ``topk`` branch queries attend its cached prefix (``meta``: one row a request; with pages of more than one
    token, the prefix up to its last partial page), and each branch attends its own keys apart (``expand``,
    ``forward_metadata_spec_decode_expand``: one row a branch, its copy of that partial page then its draft tokens so
    far, the step's own included: flashattention_backend.py:944-993, :1335-1369), the two states merged. Read as the
    decode of one request per branch it amounts to: the prefix's token slots, then the branch's."""
    prefix = meta.cache_seqlens_int32.to("cpu", torch.int64)
    own = expand.cache_seqlens_int32.to("cpu", torch.int64)
    indptr, indices = flat_lists([torch.cat([page_row_tokens(meta.page_table[b // topk], int(prefix[b // topk]),
                                                             page_size),
                                             page_row_tokens(expand.page_table[b], int(own[b]), page_size)])
                                  for b in range(own.numel())])
    return PlannedMetadata(qo_indptr=torch.arange(own.numel() + 1), kv_indptr=indptr, kv_indices=indices,
                           kv_includes_new_tokens=True, key_lens=indptr.diff(), draft_tails_from_branch=page_size > 1,
                           unread=tuple(sorted(set(unread_fields(meta, DRAFT_TREE_READ))
                                               | {f"expand.{n}" for n in unread_fields(expand, DRAFT_TREE_READ)})))


# What the draft-tree form above reads of either half: the key counts and page tables (each half's cu_seqlens_q/k,
# which its kernel is handed too, are not merged into the per-branch form: listed as unread)
DRAFT_TREE_READ = frozenset({"cache_seqlens_int32", "page_table"})


# Triton's ForwardMetadata (triton_backend.py): the fields its inspectable form reads (the window's under a window)
TRITON_WINDOW_FIELDS = ("window_kv_indptr", "window_kv_indices", "window_kv_offsets")
TRITON_READ = frozenset({"qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", *TRITON_WINDOW_FIELDS})


# FlashAttention's FlashAttentionMetadata (flashattention_backend.py): the fields its inspectable form reads (its
# sliding-window tables, swa_page_table and pa_swa_*, are among those listed as unread)
FLASH_ATTENTION_READ = frozenset({"cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"})


def unread_fields(meta, read) -> tuple[str, ...]:
    """The tensor fields of an engine's plan object that its inspectable form does not read: the metadata property
    lists them (scratch buffers such as Triton's attn_logits among them), so what no invariant checks is said."""
    fields = vars(meta) if hasattr(meta, "__dict__") else {}
    return tuple(sorted(name for name, value in fields.items() if isinstance(value, torch.Tensor) and name not in read))


def page_table_lists(table: torch.Tensor, key_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A page table (a row of page ids per request, padded past its pages) and each request's key count as one flat
    list of the pages the kernel reads (the first ``ceil(keys / page_size)`` of each row) and its indptr. A table
    narrower than a request's pages gives a shorter row, which the invariant reports as such."""
    lens = key_lens.to("cpu", torch.int64)
    table = table.to("cpu", torch.int64)
    return flat_lists([table[i, :int((lens[i] + page_size - 1) // page_size)] for i in range(lens.numel())])


def flat_lists(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request lists (int64, on the CPU) as one flat list and its indptr, the form the plans are checked in."""
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor([row.numel() for row in rows], dtype=torch.int64), 0)
    return indptr, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def flash_attention_plan(meta, page_size: int, includes_new_tokens: bool = True, graph: bool = False) -> PlannedMetadata:
    """FlashAttention's plan (``FlashAttentionMetadata``, flashattention_backend.py:75-130) in the inspectable form:
    ``cu_seqlens_q`` over the batch's query rows; per request ``cache_seqlens`` keys read from the cache (its prefix
    and, ``includes_new_tokens``, its new tokens, which SGLang writes before the kernel reads them) and their prefix
    sum ``cu_seqlens_k``;
    ``page_table[i, j]`` the j-th page of request i's keys (token slots when pages hold one token). A graph's plan
    (``graph``) keeps ``cu_seqlens_k`` only where its kernel reads it ("metadata.cu_seqlens_k is not needed",
    flashattention_backend.py:3113): the paged kernel reads ``cache_seqlens`` and the page table, which are checked."""
    indptr, indices = page_table_lists(meta.page_table, meta.cache_seqlens_int32, page_size)
    return PlannedMetadata(qo_indptr=meta.cu_seqlens_q, kv_indptr=indptr, kv_indices=indices,
                           kv_indices_are_pages=page_size > 1, kv_includes_new_tokens=includes_new_tokens,
                           key_lens=meta.cache_seqlens_int32, key_indptr=None if graph else meta.cu_seqlens_k,
                           unread=unread_fields(meta, FLASH_ATTENTION_READ))


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
        # No CUDA graphs: TorchNativeAttnBackend keeps the base's init_cuda_graph_state and
        # get_cuda_graph_seq_len_fill_value, which raise NotImplementedError (base_attn_backend.py:256-288).
        cuda_graph_modes=frozenset(),
        # An fp8 e4m3 cache works with unit scales only: TorchNativeAttnBackend never reads layer.k_scale /
        # v_scale; it stores k unscaled (set_kv_buffer without scales, torch_native_backend.py:299, :367) and reads
        # the e4m3 rows back cast, not descaled (:143-146, :244-247).
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
        kv_scales=False,
        requires=("sglang",),
        # SGLang's EAGLE v2 draft extend runs every request over the whole draft window (triton_backend.py:700,
        # num_tokens_per_req = num_draft_tokens): the batches the adapter translates are drawn that way.
        fixed_width_draft_extend=True,
        engine="sglang",
        one_shape_per_kind=True,  # one KV pool / one linear config per model (runtime.py)
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        empty_extend=True,  # its per-request SDPA loop takes a request with no new tokens
        # _run_sdpa_forward_extend pads each request's queries to its whole key length (per_req_query_redudant,
        # torch_native_backend.py:128-134) and runs one SDPA of keys x keys per request and layer: a 10,576-key
        # prefix ran past the CPU's 120 s case timeout in a sweep of 62 processes on 64 cores (reported as a
        # hang, 2026-11-26). Correct, only slow: on a GPU it still draws them.
        no_long_context_on_cpu="SGLang's torch_native extend computes a keys x keys SDPA per request and layer",
    )


class SglangFlexAttention(SglangBackend):
    """SGLang's ``TorchFlexAttnBackend`` (``--attention-backend flex_attention``): PyTorch's flex_attention under
    ``torch.compile``, one request at a time. Its first call in a process compiles a kernel (a C++ one on a CPU,
    about a minute); later shapes reuse it (``dynamic=True``)."""

    sglang_name = "flex_attention"
    capabilities = Capabilities(
        attention_kinds=frozenset({"mha"}),
        # It plans block masks for extend batches (is_extend: extend, mixed, verify) and decode ones
        # (torch_flex_backend.py:40-71); a draft extend (DRAFT_EXTEND_V2) gets no mask and its forward indexes an
        # empty list. Verify takes no custom (tree) mask: its extend mask is plain causal.
        modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        custom_mask=False,
        sliding_window=False,  # its masks know no window (_causal_mask, _decode_mask)
        logit_cap=False,  # it never reads layer.logit_cap
        # It reads the cache as stored (no k_scale/v_scale) and hands flex_attention q and the cache as they are,
        # which must share a dtype: an fp8 cache is out.
        kv_cache_dtypes=frozenset({"auto"}),
        cuda_graph_modes=frozenset(),  # it keeps the base's graph methods, which raise
        requires=("sglang",),
        engine_features=("flex_static_masks",),  # before 0.5.13 its mask functions are bound methods (features.py)
        engine="sglang",
        one_shape_per_kind=True,
        empty_extend=True,
        slow_on_cpu="torch.compile builds flex_attention's C++ kernel on its first call in a process (about a minute)",
        no_long_context_on_cpu="SGLang's flex_attention extend, like its torch_native one, pads each request's "
                               "queries to its key count (torch_flex_backend.py:128-136): keys x keys per request",
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
        modes=DRAFTING_MODES,  # its draft worker's container too (backends/sglang/draft.py)
        dtypes=frozenset({"float32", "bfloat16", "float16"}),  # on the CPU only float32/16: see cpu_dtypes
        cpu_dtypes=frozenset({"float32", "float16"}),  # the interpreter's bf16 tl.dot is broken (error ~1e10)
        requires=("sglang", "triton"),
        cpu_needs_env="TRITON_INTERPRET",
        # tanh as 2*sigmoid(2x) - 1 (kernels/ops/attention/extend_attention.py:208, decode_attention.py:229)
        softcap_via_sigmoid=True,
        # Its kernels call tl.dot without an input precision (kernels/ops/attention/decode_attention.py:690-762,
        # extend_attention.py): Triton's default on NVIDIA GPUs, TF32, whose operands keep 10 mantissa bits. Measured on
        # an H200 (2026-11-26, harness-out/gpu18.sh): float32 decode of 2 keys and extend of 1 token, rel_l2 5.3e-4 and
        # 4.5e-4, 225x and 154x the tf32x3 bound declared before (our own Triton asks for tf32x3; SGLang's does not).
        fp32_matmul_roundoff=2.0**-10,
        # The interpreter's dots are exact float32; held to the bound CPU CI has kept since the adapter began (tf32x3)
        cpu_fp32_matmul_roundoff=2.0**-21,
        # TritonAttnBackend's out_graph plans decode (and idle, which replays the decode graph), target_verify
        # and draft_extend_v2 (triton_backend.py:1396-1438, _apply_cuda_graph_metadata).
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                    ForwardMode.IDLE, ForwardMode.DRAFT_DECODE}),  # draft: the draft loop's runner
        prefill_graph=True,  # RadixAttention breaks SGLang's breakable prefill graph (radix_attention.py:133-165)
        # fp8 e4m3 cache: set_kv_buffer divides by layer.k_scale, the kernels multiply by k_scale_float
        # (triton_backend.py:1720-1745, :1835-1840, :2326-2370)
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
        fixed_width_draft_extend=True,  # EAGLE v2's draft extend, as for SglangTorchNative
        engine="sglang",
        one_shape_per_kind=True,  # one KV pool / one linear config per model (runtime.py)
        wrapped_gaps=(TBO_MIXED_GAP, TBO_DRAFT_EXTEND_GAP),
        length_boundaries=SGLANG_TRITON_BOUNDARIES,
        verify_window=True,  # declared, so a disagreement is a finding (see docs/findings/)
        empty_extend=True,  # its extend grid counts max(0, extend_len) tiles (extend_attention.py:191)
        # TritonMultiStepDraftBackend hands the server's draft window to generate_draft_decode_kv_indices
        # (triton_backend.py, common_template), where the release has it (features.py, draft_prefix_window)
        engine_limits=(("draft_prefix_window", "draft_prefix_window", False),),
    )


# What SGLang's hybrid wrapper does with any linear-attention child (hybrid_linear_attn_backend.py). An MTP draft
# model runs full-attention layers only: the hybrid plans no linear metadata for DRAFT_EXTEND_V2
# (init_forward_metadata), so no linear layer runs there. Its out_graph refills the linear layers' state indices
# (padded rows PAD_SLOT_ID) and query_start_loc in static buffers for decode/idle and target_verify (:368-384,
# _replay_metadata :747-943; other modes raise at :911), so its decode graphs capture them. Its commit after
# verify (fused_mamba_state_scatter_with_mask, kernels/ops/mamba/mamba_state_scatter_triton.py) refuses CPU
# tensors; the gpu profile runs it.
LINEAR_CHILD_MODES = ADAPTED_MODES - {ForwardMode.DRAFT_EXTEND}
LINEAR_CHILD_GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE})
LINEAR_CHILD_CPU_GAPS = (("verify_chain", "SGLang's state commit after verify runs on CUDA/XPU tensors only"),
                         ("verify_commit", "SGLang's state commit after verify runs on CUDA/XPU tensors only"))


def _linear_child_capabilities(prefill_graph: bool = True, **own) -> Capabilities:
    """A linear child's declaration: what every one shares (above), its own facts in ``own``. A child whose layers
    break out of a breakable prefill graph declares ``prefill_graph`` (GDN's RadixLinearAttention goes eager,
    radix_linear_attention.py:97-121, 159-165, sgl-project/sglang#25110; lightning's layers are RadixAttention
    objects, where the graph breaks anyway)."""
    return Capabilities(modes=LINEAR_CHILD_MODES, cuda_graph_modes=LINEAR_CHILD_GRAPH_MODES,
                        graph_captures_linear=True, prefill_graph=prefill_graph, requires=("sglang", "triton"),
                        cpu_needs_env="TRITON_INTERPRET", cpu_gaps=LINEAR_CHILD_CPU_GAPS, engine="sglang",
                        one_shape_per_kind=True, **own)


class _LinearChild(SglangBackend):
    """A linear-attention backend of SGLang's, which SGLang builds only inside its hybrid wrapper
    (``attn_backend_wrapper``): it runs as the second argument of ``hybrid(sglang.X, sglang.<name>)``, never
    alone."""

    def make_inner(self, sgl_runner):
        raise RuntimeError(f"SGLang builds its {self.sglang_name} backend inside the hybrid wrapper: use "
                           f"hybrid(sglang.X,sglang.{self.sglang_name})")


class SglangGdn(_LinearChild):
    """SGLang's GDN linear-attention backend (``GDNAttnBackend``); its base-class ``forward`` cannot take the
    linear layer's keyword call either."""

    sglang_name = "gdn"
    capabilities = _linear_child_capabilities(
        attention_kinds=frozenset({"linear"}),
        engine_features=("hybrid_linear", "gdn_model"),
        cpu_engine_features=("fla_kernels_path",),  # the interpreter shims patch the vendored fla kernels there
        # The vendored fla chunk kernels refuse float32 (they assert a half-precision input).
        dtypes=frozenset({"bfloat16", "float16"}),
        cpu_dtypes=frozenset({"float16"}),  # the interpreter's bf16 tl.dot is broken
        # The verify conv kernel advances the request's conv state through the draft tokens in place
        # (kernels/ops/mamba/causal_conv1d_triton.py, _causal_conv1d_update_kernel); the commit rewrites it.
        verify_advances_conv_state=True,
        slow_on_cpu="the interpreted fla chunk kernels take seconds a case",
    )


class SglangLightning(_LinearChild):
    """SGLang's lightning linear-attention backend (``LightningAttentionBackend``, seg_la kernels), the linear
    layers of Bailing/Ling models. Its layers are plain ``RadixAttention`` objects
    (models/bailing_moe_linear.py:485), so SGLang's hybrid must tell them from full layers by layer id."""

    sglang_name = "lightning"
    # Its own out_graph plans decode/idle and target_verify over MambaAttnBackendBase._replay_metadata
    # (lightning_backend.py, init_forward_metadata_out_graph), as the hybrid's does for GDN.
    capabilities = _linear_child_capabilities(
        attention_kinds=frozenset({"lightning"}),
        engine_features=("hybrid_linear", "lightning_model"),
        # The model hands q/k/v in float32 whatever its dtype, and seg_la computes in float32: every model dtype
        # runs, on the CPU too (no half-precision tl.dot).
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # seg_la's tl.dot on float32 runs as TF32 on NVIDIA GPUs (Triton's default input precision; seg_la.py
        # passes none), whose operands Triton truncates: 2^-10 (properties/tolerances.py). Measured on the H100
        # (2026-11-24): rel_l2 at most 1.1e-3 over 80 lightning-only batches of every mode, 9.6e-4 in verify_chain.
        fp32_matmul_roundoff=2.0**-10,
        # The interpreter's dots are exact float32: held to float32's own bound on the CPU. Measured there
        # (2026-11-24, ~250 ci-profile cases of every mode and property over hybrid, tbo and
        # graph compositions): at most 0.29 of that bound, once the ledger's known fp8 decode cases are set aside.
        cpu_fp32_matmul_roundoff=2.0**-24,
        # seg_la's decode splits the key dim in blocks of 128 (HEAD_DIM // 128 of them, seg_la.py:671-682) and its
        # prefill takes tl.arange(0, HEAD_DIM): powers of two from 128. Ling's is 128.
        head_dims=frozenset({128, 256}),
        # Built with speculative_eagle_topk > 1 it raises: seg_la verifies a draft as a chain
        # (lightning_backend.py:82-93). A Bailing model is served with topk 1.
        draft_trees=False,
        slow_on_cpu="the interpreted seg_la kernels take seconds a case (head dim 128, a program per 32x32 block)",
    )


class SglangShortConv(_LinearChild):
    """SGLang's short-convolution backend for LFM2-style hybrids: ``ShortConvAttnBackend`` under
    ``ShortConvHybridAttnBackend`` (0.5.22 on), ``Mamba2AttnBackend`` under ``HybridLinearAttnBackend`` before. It only
    plans: each conv layer asks it for its state (slot indices, ``has_initial_state``, ``query_start_loc``; the
    hybrid's ``conv_state_metadata``) and runs its own causal_conv1d kernels (models/lfm2.py, Lfm2ShortConv), so the
    harness runs SGLang's own conv layer (backends/sglang/adapter.py, ``_conv_layer``)."""

    sglang_name = "short_conv"
    capabilities = _linear_child_capabilities(
        attention_kinds=frozenset({"short_conv"}),
        engine_features=("hybrid_linear", "short_conv_model"),
        # Its kernels convolve elementwise in float32 (no tl.dot): every model dtype runs, on the CPU too.
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # The verify conv kernel advances the request's conv state through the draft tokens in place, as GDN's
        # (causal_conv1d_update with intermediate_conv_window, models/lfm2.py shortconv_target_verify); the commit
        # rewrites it.
        verify_advances_conv_state=True,
        # A server on CUDA runs LFM2's extends through the breakable prefill graph by default (0.5.16 on,
        # cuda_graph_config.py default_prefill_backend; no rule in arg_groups/cuda_graph_hook.py turns it off for
        # LFM2), so graph() extends run here too, and the break count judges the conv layer, which marks no break
        # (models/lfm2.py Lfm2ShortConv.forward, unlike GDN's RadixLinearAttention)
        prefill_graph=True,
    )


class SglangKda(_LinearChild):
    """SGLang's KDA backend (``KDAAttnBackend``, Kimi Delta Attention) under its hybrid wrapper, for a Kimi Linear
    model: the backend plans as GDN's does (state slots, ``query_start_loc``) and runs its Triton kernels (fla's
    chunked KDA for extends, the packed recurrent step for decode, the fused verify step) for the model's KDA layer
    (``KimiDeltaAttention``), which the adapter calls as the model does (``_kda_layer``). The full-attention layers
    are MHA here; a Kimi Linear checkpoint's are MLA (not adapted under this hybrid)."""

    sglang_name = "kda"
    capabilities = _linear_child_capabilities(
        attention_kinds=frozenset({"kda"}),
        engine_features=("hybrid_linear", "kda_model"),
        # The safe gate from 0.5.22 (RadixLinearAttention's lower_bound); before it, standard-gate models only
        engine_limits=(("kda_safe_gate", "kda_safe_gate", False),),
        cpu_engine_features=("fla_kernels_path",),  # the interpreter shims patch the vendored fla kernels there
        # The vendored fla chunk kernels take half-precision inputs, as GDN's
        dtypes=frozenset({"bfloat16", "float16"}),
        cpu_dtypes=frozenset({"float16"}),  # the interpreter's bfloat16 elementwise arithmetic is wrong
        # Its chunk kernels cast their blocks to bfloat16 before the dots whatever the model's dtype
        # (fla/chunk_intra.py, chunk_kda_fwd_kernel_inter_solve_fused: .to(tl.bfloat16)): a float16 model's KDA
        # layers carry bfloat16's operand roundings (properties/tolerances.py)
        operand_roundoff=2.0**-8,
        # The verify conv kernel advances the request's conv state through the draft tokens in place, as GDN's; the
        # commit rewrites it.
        verify_advances_conv_state=True,
        # Under a breakable prefill graph (a CUDA server's default prefill graph from 0.5.22; SGLang keeps it off for
        # KDA models other than GLM-5.3 Flash unless --cuda-graph-backend-prefill breakable is passed,
        # arg_groups/cuda_graph_hook.py), 0.5.22 and 0.5.23's hybrid runs the KDA extend inside the graph over static
        # tables it refreshes before each replay (kda_prefill_graph.py; SglangHybrid.prefill_graph_layers_in_graph):
        # graph() extend rows compare those replays with eager ones
        prefill_graph=True,
        slow_on_cpu="the interpreted fla chunk kernels take seconds a case",
    )

    @staticmethod
    def build_layer(sgl, layer):
        """SGLang's own Kimi Linear KDA layer (``KimiDeltaAttention``) for a harness KDA layer: its
        RadixLinearAttention built as the model's ``__init__`` builds it, with the drawn parameters (conv weights,
        A_log and dt_bias in float32, as the model keeps them); its projections a stand-in that hands over the
        harness's inputs in the order they return theirs (q|k|v, beta, the forget gate, the norm's gate), its output
        norm and projection the identity. Its ``forward`` is then the model's, whatever the release: 0.5.10 applies
        the gate and the step size's sigmoid in the model before the backend's extend (models/kimi_linear.py), later
        releases hand the backend both raw, the gate unflattened to ``[1, T, H, K]`` for an extend."""
        H = layer.spec.num_heads
        block = _bare_kda_layer(sgl, sgl.KimiDeltaAttention, layer, num_heads=H, num_k_heads=H, num_v_heads=H)
        block.forward_qkvbfg = lambda projected: projected
        return block

    @staticmethod
    def call_layer(block, projected, sfb):
        """Kimi Linear's call: ``KimiDeltaAttention.forward(hidden_states, positions, forward_batch, zero_allocator)``
        (its ``forward_qkvbfg`` hands ``projected`` over)."""
        return block(hidden_states=projected, positions=None, forward_batch=sfb, zero_allocator=None)


def _bare_kda_layer(sgl, cls, layer, **fields):
    """A KDA layer module of SGLang's class ``cls`` without its ``__init__`` (it would build TP-sharded projections
    and load nothing): the harness layer's head dims and ``fields``, unfused projections (the caller sets
    ``forward_qkvbfg``), its output norm and projection the identity, and :func:`_kda_parameters`."""
    s = layer.spec
    with _building(cls.__name__), torch.no_grad():
        block = cls.__new__(cls)
        torch.nn.Module.__init__(block)
        block.layer_idx, block.head_dim = s.layer_id, s.head_k_dim
        block.head_k_dim, block.head_v_dim = s.head_k_dim, s.head_v_dim
        for name, value in fields.items():
            setattr(block, name, value)
        block.do_fuse_qkvbfg = False
        block.o_norm, block.o_proj = _Ungated(), _Identity()
        _kda_parameters(sgl, block, layer)
    return block


def _kda_parameters(sgl, block, layer) -> None:
    """A KDA layer module's A_log, dt_bias and RadixLinearAttention, as SGLang's models build them from the drawn
    parameters (A_log and dt_bias in float32, as the models keep them)."""
    s, w = layer.spec, layer.weights
    H, K = s.num_heads, s.head_k_dim
    block.A_log = torch.nn.Parameter(w["A_log"].float().reshape(1, 1, H, 1), requires_grad=False)
    block.dt_bias = torch.nn.Parameter(w["dt_bias"].float(), requires_grad=False)
    # (a safe-gate case never reaches a release without it: kda_safe_gate, Capabilities.engine_limits)
    gate = {} if s.lower_bound is None else {"lower_bound": s.lower_bound}
    block.attn = sgl.RadixLinearAttention(
        layer_id=s.layer_id, num_q_heads=H, num_k_heads=H, num_v_heads=H, head_q_dim=K, head_k_dim=K,
        head_v_dim=s.head_v_dim, conv_weights=w["conv_weight"].float(), bias=None, activation="silu",
        A_log=block.A_log, dt_bias=block.dt_bias, **gate)


class SglangKdaGlm5(SglangKda):
    """The same KDA backend as :class:`SglangKda` (its hybrid built for the same Kimi-Linear-shaped config), its layer
    GLM-5.3 Flash's (``Glm5NextLinearAttention``, models/glm5_next.py), which hands the forget gate flat:
    ``[1, T, H * K]`` for an extend or a verify, where Kimi Linear's is ``[1, T, H, K]`` (extend) and ``[T, H * K]``
    (verify). GLM-5.3 Flash is the one KDA model whose breakable prefill graph SGLang keeps on by default
    (arg_groups/cuda_graph_hook.py, "GLM-5.3 Flash is BCG-validated"), so its graph() extends are what such a server
    runs. Decode hands the gate as Kimi Linear does (``[T, H * K]``): those rows would repeat :class:`SglangKda`'s."""

    capabilities = dataclasses.replace(
        SglangKda.capabilities, modes=frozenset({ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY}),
        cuda_graph_modes=frozenset({ForwardMode.TARGET_VERIFY}),
        engine_features=(*SglangKda.capabilities.engine_features, "glm5_kda_model"))

    @staticmethod
    def build_layer(sgl, layer):
        """SGLang's own ``Glm5NextLinearAttention`` for a harness KDA layer, built as :meth:`SglangKda.build_layer`
        builds Kimi Linear's: no ``__init__``, the drawn parameters, its projections a stand-in (here taking the batch
        too, as GLM's do), its output norm and projection the identity."""
        block = _bare_kda_layer(sgl, sgl.Glm5NextLinearAttention, layer, local_num_heads=layer.spec.num_heads)
        # Its forward reads the hidden states' rows before projecting them: the stand-in is handed q|k|v as the
        # hidden states and answers the call's projections (call_layer)
        block.forward_qkvbfg = lambda hidden_states, forward_batch: block.harness_projected
        return block

    @staticmethod
    def call_layer(block, projected, sfb):
        """GLM-5.3 Flash's call: ``Glm5NextLinearAttention.forward(hidden_states, forward_batch)``."""
        block.harness_projected = projected
        try:
            return block(projected[0], sfb)
        finally:
            block.harness_projected = None


class SglangMamba2(_LinearChild):
    """SGLang's Mamba-2 backend (``Mamba2AttnBackend``) under its hybrid wrapper, for a Nemotron-H-shaped model: the
    backend plans (state slots, ``query_start_loc``, the chunked scan's chunk indices and offsets, the prefix mask)
    and runs the model's ``MambaMixer2`` (its causal conv and SSD kernels, Triton), which the model's mamba layer
    hands it (``_forward_mamba``)."""

    sglang_name = "mamba2"
    capabilities = _linear_child_capabilities(
        attention_kinds=frozenset({"mamba2"}),
        # From 0.5.22 (the selective-state-update dispatch the scheduler installs). Before it the mixer's SSD kernels
        # enter torch.cuda.device(index) and dispatch their state update elsewhere, which the CPU shims do not
        # cover: on 0.5.10 every row crashed in the harness's stand-ins, so the rows are unavailable there instead.
        engine_features=("hybrid_linear", "mamba2_model", "mamba_ssu_backend"),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        cpu_dtypes=frozenset({"float32", "float16"}),  # the interpreter's bf16 tl.dot is broken
        # The SSD kernels' tl.dot take Triton's default input precision on float32 (ssd_bmm.py:161,
        # ssd_chunk_state.py:343/574, ssd_chunk_scan.py:430/447/489 pass none): TF32 on NVIDIA GPUs, 2^-10
        # (properties/tolerances.py). Measured on an H200 (harness-out/gpu61.sh): three float32 Mamba-2 extend tests
        # at rel_l2 8.7e-4 (an SSM state) against float32's 3.2e-6; all four pass with TRITON_F32_DEFAULT=ieee.
        fp32_matmul_roundoff=2.0**-10,
        # The interpreter's dots are exact float32: CPU CI keeps float32's own bound
        cpu_fp32_matmul_roundoff=2.0**-24,
        # The verify conv kernel advances the request's conv state through the draft tokens in place (the mixer's
        # causal_conv1d_update with intermediate_conv_window), as GDN's; the commit rewrites it.
        verify_advances_conv_state=True,
        # Nemotron-H's mamba layer breaks out of the breakable prefill graph through its split op
        # (breakable_nemotron_mamba2_with_output, models/nemotron_h.py), which finds the layer and the batch in the
        # piecewise forward context the adapter's prefill-graph scope sets
        prefill_graph=True,
        # A Nemotron-H MTP draft has no mamba layer: SGLang builds no hybrid for its draft worker
        # (configs/hybrid_arch.py, mamba2_config: a draft model whose pattern has no "M")
        hybrid_draft_worker=False,
        slow_on_cpu="the interpreted SSD chunk-scan kernels take seconds a case",
    )
    @staticmethod
    def hand_over(block, hidden_states, sfb, backend):
        """Nemotron-H's decoder layer's call into its mixer: ``_forward_mixer`` (0.5.21 on), which under a breakable
        prefill graph breaks out of it through the model's split op (models/nemotron_h.py,
        breakable_nemotron_mamba2_with_output) and otherwise runs ``_forward_mamba``, the only call before it. 0.5.21's
        takes ``skip_reduce`` too, the layer's "the next norm sums the tensor-parallel ranks" (its caller passes
        ``mixer_exit.skips_reduction``): False, the reduction done by the mixer, as with one rank it is."""
        return call_accepting(getattr(block, "_forward_mixer", block._forward_mamba), hidden_states, sfb,
                              skip_reduce=False)


class SglangMamba2Granite(SglangMamba2):
    """The same Mamba-2 backend as :class:`SglangMamba2` (its hybrid built for the same Nemotron-H-shaped config), its
    mixer handed over as GraniteMoeHybrid's (Granite 4.0-H) and Falcon-H1's decoder layers hand theirs: they call
    ``get_attn_backend().linear_attn_backend.forward(mixer, ...)`` themselves, with an output buffer
    (models/granitemoehybrid.py:146-157, models/falcon_h1.py:340-353). Neither marks a break for the breakable prefill
    graph, which 0.5.22 and 0.5.23 turn on by default on CUDA with no rule for these models: graph() extends run here
    as a server runs them, and the break count judges the mixer."""

    # Extends only: outside a prefill graph the call is :class:`SglangMamba2`'s (Nemotron-H's ``_forward_mixer`` runs
    # the same ``Mamba2AttnBackend.forward`` there), so its other modes and decode graphs would repeat those rows
    capabilities = dataclasses.replace(SglangMamba2.capabilities, modes=frozenset({ForwardMode.EXTEND}),
                                       cuda_graph_modes=frozenset())

    @staticmethod
    def hand_over(block, hidden_states, sfb, backend):
        """GraniteMoeHybrid's and Falcon-H1's decoder layers: the hybrid from the forward context (``backend``), then
        its Mamba-2 backend's forward with an output buffer, no graph break (models/granitemoehybrid.py:146-157)."""
        if not isinstance(backend, runtime.load().HybridLinearAttnBackend):
            raise RuntimeError(f"a Granite-shaped mamba layer runs under a HybridLinearAttnBackend, not "
                               f"{type(backend).__name__}")
        output = torch.empty_like(hidden_states)
        backend.linear_attn_backend.forward(mixer=block.mixer, layer_id=block.layer_id, hidden_states=hidden_states,
                                            output=output, forward_batch=sfb, use_triton_causal_conv=True)
        return output


class SglangHybrid(SglangBackend):
    """SGLang's ``HybridLinearAttnBackend`` over one of its full-attention backends and a linear-attention one
    (``GDNAttnBackend`` or ``LightningAttentionBackend``), built as SGLang builds it: ``attn_backend_wrapper(runner,
    full)`` on a runner whose model is such a hybrid (a Qwen3-Next- or Bailing-shaped config with the drawn layer
    layout). SGLang picks the full-attention layer ids itself: the config's, or ``[0]`` on a draft worker's
    runner."""

    is_wrapper = True

    def __init__(self, full: type[SglangBackend], linear: type[SglangBackend], model_runner,
                 draft_worker: bool = False) -> None:
        super().__init__(model_runner)
        self.sglang_name, self.full, self.linear = full.sglang_name, full, linear
        (kind,) = linear.capabilities.attention_kinds
        self.hybrid = runtime.HybridModel.of(model_runner, draft_worker, kind)

    def make_inner(self, sgl_runner):
        # Looked up on SGLang's module at call time, as SGLang's own runner setup does.
        wrap = self.sgl.attention_registry.attn_backend_wrapper
        inner = wrap(sgl_runner, self.full.engine_backend(self.sgl, sgl_runner))
        if not isinstance(inner, self.sgl.HybridLinearAttnBackend):
            raise RuntimeError(f"SGLang built {type(inner).__name__} for a hybrid model")
        return inner

    @property
    def children(self) -> tuple:
        return tuple(self.inner.attn_backend_list) if self.inner is not None else ()

    def engine_objects(self) -> tuple[object | None, list[object], type]:
        return self.inner, list(self.inner.attn_backend_list), self.sgl.AttentionBackend

    def _planner(self):
        """The full-attention child (SGLang's hybrid keeps no plan of its own)."""
        return self.inner.full_attn_backend

    def prefill_graph_layers_in_graph(self) -> frozenset[str]:
        """The linear child's kinds where SGLang's hybrid runs its layers' extend inside the prefill graph being
        captured (``linear_extend_in_graph``, hybrid_linear_attn_backend.py:1284-1288 in 0.5.23, :1282 in 0.5.22: the
        KDA extend on static tables; its RadixLinearAttention then takes no eager break, radix_linear_attention.py:115
        in 0.5.23)."""
        in_graph = getattr(self.inner, "linear_extend_in_graph", None)  # 0.5.22 on
        return self.linear.capabilities.attention_kinds if in_graph is not None and in_graph() else frozenset()


class SglangPrefillDecode(SglangBackend):
    """SGLang's ``HybridAttnBackend``: one full-attention backend for prefill and another for decode, as a server
    started with ``--prefill-attention-backend P --decode-attention-backend D`` builds it
    (``attention_backend_setup.py``, ``_build_resolved_backend``). It routes each batch by its mode
    (``_select_backend``): decode and idle to D; target_verify to P (``--speculative-attention-mode prefill``, the
    default); extend, mixed and draft extends to P. Both children share the model's KV pool, so a request
    prefilled by one is decoded by the other from the cache it wrote."""

    is_wrapper = True

    def __init__(self, prefill: type[SglangBackend], decode: type[SglangBackend], model_runner) -> None:
        super().__init__(model_runner)
        self.sglang_name, self.decode_name = prefill.sglang_name, decode.sglang_name
        self.prefill, self.decode = prefill, decode

    def make_inner(self, sgl_runner):
        return self.sgl.HybridAttnBackend(model_runner=sgl_runner,
                                          prefill_backend=self.prefill.engine_backend(self.sgl, sgl_runner),
                                          decode_backend=self.decode.engine_backend(self.sgl, sgl_runner))

    @property
    def children(self) -> tuple:
        return (self.inner.prefill_backend, self.inner.decode_backend) if self.inner is not None else ()

    def engine_objects(self) -> tuple[object | None, list[object], type]:
        return self.inner, list(self.children), self.sgl.AttentionBackend

    def _planner(self):
        """The child SGLang routed the last planned batch to (the split keeps no plan of its own)."""
        planned = self.planned_sglang_batch()
        if planned is None:
            return None
        return self.inner._select_backend(planned.forward_mode)


class _TboChild(SglangBackend):
    """One of SGLang's TBO child backends, as the engine sees it: it runs a child batch's layers under a
    forward context whose backend is that child (``batch_overlap/operations.py``)."""

    def __init__(self, parent: "SglangTbo", index: int) -> None:  # noqa: D107 - shares the parent's runner
        self.model_runner, self.sgl, self.sgl_runner = parent.model_runner, parent.sgl, parent.primary.sgl_runner
        self.parent = parent  # whose whole batch this half is of (harness export reads it)
        self.states = parent.primary.states
        self.inner = parent.inner.children[index]
        self.radix = parent.primary.radix  # the model's layer objects are the same for both halves
        self.linear = getattr(parent.primary, "linear", None)  # a hybrid's linear leaf: how its mixer is handed over
        self.batches = {}
        self.leaf = type(parent.primary)  # the wrapped adapter's class: how its layers are called, its plans read
        self.sglang_name = parent.primary.sglang_name  # the --attention-backend it is (the leaf's messages name it)

    @property
    def capabilities(self):
        """The wrapped leaf's declaration: the leaf's methods this half borrows read it (a plan-level leaf's
        ``_run`` refuses by it)."""
        return self.parent.primary.capabilities

    def init_forward_metadata(self, forward_batch) -> None:
        raise RuntimeError("a TBO child is planned by its wrapper (TboAttnBackend.init_forward_metadata)")

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, via=None) -> torch.Tensor:
        return self.leaf._run(self, q, k, v, layer, forward_batch, save_kv_cache, via)

    def planned_metadata(self) -> PlannedMetadata:
        """An empty half is neither planned (TboAttnBackend skips it) nor run: whatever its backend kept
        from an earlier batch is no plan of this one."""
        if not self.batches or next(iter(self.batches.values())).batch_size == 0:
            return PlannedMetadata()
        return self.leaf.planned_metadata(self)


class SglangTbo(_SglangObject):
    """SGLang's ``TboAttnBackend`` over one SGLang backend, with SGLang's own splitter
    (``compute_split_seq_index`` + ``TboForwardBatchPreparer.prepare``).

    Planning splits the batch as SGLang's scheduler and model runner do, then hands the engine harness-side
    child batches that carry SGLang's split (its token counts, positions and mrope rows, per-request fields),
    so each half's layers run on exactly what SGLang's preparer made of it.
    """

    is_wrapper = True

    def __init__(self, primary: SglangBackend, model_runner) -> None:
        self.model_runner = model_runner
        self.primary = primary  # the adapter of the wrapped composition (a leaf, or SGLang's hybrid)
        self.sgl = self.primary.sgl
        self.inner = None
        self.children: list[_TboChild] = []
        self.split: TboSplit | None = None

    def _ensure_built(self, fb) -> None:
        before = self.primary.inner
        self.primary._ensure_built(fb)
        if self.inner is None or self.primary.inner is not before:
            runner = self.primary.sgl_runner
            self.inner = self.sgl.TboAttnBackend(primary=self.primary.inner,
                                                 children=[self.primary.make_inner(runner),
                                                           self.primary.make_inner(runner)])
            self.children = [_TboChild(self, 0), _TboChild(self, 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        fb, sgl = forward_batch, self.sgl
        self._ensure_built(fb)
        fb.tbo_children, self.split = None, None
        if fb.forward_mode.is_idle() and fb.batch_size == 0:
            self.primary.init_forward_metadata(fb)  # not planned: SGLang's eager runner drops the plan
            return
        sfb = self.primary.translate(fb)
        if self.primary.states is not None:
            self.primary.states.push(fb)
        tbo = sgl.two_batch_overlap
        sfb.tbo_split_seq_index = tbo.compute_split_seq_index(
            forward_mode=sfb.forward_mode, num_tokens=fb.extend_num_tokens,
            extend_lens=sfb.extend_seq_lens_cpu if sfb.forward_mode.is_extend() else None,
            token_num_per_seq=tbo.get_token_num_per_seq(sfb.forward_mode, sfb.spec_info))
        with compat.backend_scope(sgl, self.inner, sfb):
            tbo.TboForwardBatchPreparer.prepare(sfb)  # asserts the active backend is a TboAttnBackend
            self.inner.init_forward_metadata(sfb)
        self.primary.batches = {id(fb): sfb}
        self._attach_children(fb, sfb)
        for planner in (self.primary, *self.children):
            planner.planned_graph = False

    def _attach_children(self, fb, sfb) -> None:
        """Hand the engine harness-side views of SGLang's child batches ``sfb.tbo_children`` (if it split)."""
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

    # ---- CUDA graphs: SGLang's TboAttnBackend under its decode graph runner's TBO plugin ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Kept until the first graph batch builds SGLang's backends (as the leaf adapter does)."""
        self.graph_state = (max_bs, max_num_tokens)
        self.graph_inner, self.graph_children = None, None

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """At capture: SGLang's ``TboCudaGraphRunnerPlugin.capture_one_batch_size`` (split index, then
        ``TboForwardBatchPreparer.prepare_raw`` over the static batch), then ``TboAttnBackend``'s out_graph,
        which plans the primary and each child half. At replay: SGLang's replay view carries no children, and
        ``TboAttnBackend`` splits the padded batch itself; the layers run the halves captured."""
        fb, sgl = forward_batch, self.sgl
        tbo = sgl.two_batch_overlap
        self._capture_or_check(fb, in_capture)
        sfb = self.primary.translate(fb, graph=True)
        self.primary.check_replay(fb, sfb, in_capture)
        self.primary.batches = {id(fb): sfb}
        with compat.backend_scope(sgl, self.inner, sfb):
            if in_capture:
                sfb.tbo_split_seq_index = tbo.compute_split_seq_index(
                    forward_mode=sfb.forward_mode, num_tokens=fb.extend_num_tokens, extend_lens=None,
                    token_num_per_seq=tbo.get_token_num_per_seq(sfb.forward_mode, sfb.spec_info))
                non_padded = torch.zeros(2, dtype=torch.int32, device=fb.device)
                non_padded[...] = tbo.TboForwardBatchPreparer.compute_tbo_children_num_token_non_padded(sfb)
                tbo.TboForwardBatchPreparer.prepare_raw(sfb, tbo_children_num_token_non_padded=non_padded)
            compat.plan_out_graph(self.inner, sfb, in_capture)
        if in_capture:
            fb.tbo_children = None
            self._attach_children(fb, sfb)
            self.graph_children = (fb.tbo_children, [dict(c.batches) for c in self.children])
        else:  # the captured halves: the same static rows (their plans just refreshed by SGLang's split)
            fb.tbo_children = self.graph_children[0]
            for child, batches in zip(self.children, self.graph_children[1]):
                child.batches = batches
        for planner in (self.primary, *self.children):  # the whole batch and each half, into graph buffers
            planner.planned_graph = True
        self.graph_sfb = sfb
        if in_capture:
            self.captured_sfb = sfb

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """What the capture records: ``TboAttnBackend``'s in_graph over the capture's batch, whose halves
        (``prepare_raw``'s slices) are views of the static batch, so a replay's recorded kernels refresh the primary
        and both halves from the rows loaded for it. Run again at each replay where no graph is recorded (a CPU), it
        must be over that batch too: SGLang's replay view carries no halves, and a backend that refreshes its plan
        only in the graph (TRT-LLM MHA's fused metadata kernel) would leave its halves' plans stale."""
        with compat.backend_scope(self.sgl, self.inner, self.captured_sfb):
            compat.plan_in_graph(self.inner, self.captured_sfb)

    def replay_split(self, forward_batch) -> int | None:
        """The request where ``TboAttnBackend`` cuts a replay of the padded ``forward_batch``: SGLang's own
        ``compute_split_indices_for_cuda_graph_replay`` (0.5.10 on), which its replay path calls on the replay view
        (``_dispatch_children_from_replay_view`` under the three-method contract; ``init_forward_metadata_replay_cuda_graph``
        before it)."""
        tbo, sfb = self.sgl.two_batch_overlap, self.graph_sfb
        per_seq = tbo.get_token_num_per_seq(forward_mode=sfb.forward_mode, spec_info=sfb.spec_info)
        seq, _ = tbo.compute_split_indices_for_cuda_graph_replay(
            forward_mode=sfb.forward_mode, cuda_graph_num_tokens=forward_batch.batch_size * per_seq,
            spec_info=sfb.spec_info)
        return None if seq is None or not 0 < seq < forward_batch.batch_size else seq

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
        for name in ("positions", "mrope_positions"):  # what the child's layers read per token (T is out_cache_loc's)
            value = getattr(schild, name)
            if value is not None and value.shape[-1] != T:
                raise EngineBrokeInvariant(
                    f"SGLang's TBO child batch has {T} tokens but its {name} has {value.shape[-1]} "
                    f"(TboForwardBatchPreparer did not slice {name})")
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

    # A batch SGLang did not split runs its layers under a forward context whose backend is the TboAttnBackend
    # itself (its forward goes to the primary): warm-up, graph capture and batches too small to split.
    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache, via=self.inner, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def planned_metadata(self) -> PlannedMetadata:
        return self.primary.planned_metadata()

    def state_sync(self) -> "runtime.StateSync | None":
        return self.primary.states

    def planned_sglang_batch(self):
        return self.primary.planned_sglang_batch()

    def mha_chunk_call_batch(self):
        return self.primary.mha_chunk_call_batch()

    def engine_objects(self) -> tuple[object | None, list[object], type]:
        return self.inner, [self.inner.primary, *self.inner.children], self.sgl.AttentionBackend
