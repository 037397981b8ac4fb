"""The backend protocol (DESIGN.md section 2), the capability declaration and the planned metadata.

Every backend and wrapper implements the methods of :class:`AttentionBackend` under these names and
argument names. The base raises :class:`NotImplementedError` naming the class and the method, except for
``forward``, which dispatches by mode as SGLang's base does; a *wrapper* must still define ``forward``
itself (linear-attention layers call it with keywords only), and the conformance property checks that.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from batch.spec import BatchSpec, ForwardMode

# The modes a backend of SGLang 0.5.23 serves, named one by one: a mode added to ForwardMode later joins no
# backend's declaration until someone declares it.
SERVING_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                           ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE})


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "False")

# Methods every backend and wrapper must provide (init_mha_chunk_metadata is optional: callers use hasattr).
PROTOCOL_METHODS = (
    "init_forward_metadata",
    "forward",
    "forward_extend",
    "forward_decode",
    "init_cuda_graph_state",
    "init_forward_metadata_capture_cuda_graph",
    "init_forward_metadata_replay_cuda_graph",
    "get_cuda_graph_seq_len_fill_value",
    "get_verify_buffers_to_fill_after_draft",
    "update_verify_buffers_to_fill_after_draft",
)


def call_accepting(fn, *args, **kwargs):
    """Call ``fn`` with only the keyword arguments its signature accepts."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class Capabilities:
    """What one backend supports; the test matrix is derived from these declarations."""

    attention_kinds: frozenset[str]
    modes: frozenset[ForwardMode]  # declared explicitly: a new mode joins no backend by default
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    head_dims: Optional[frozenset[int]] = None  # qk head dims (MHA) it compiles for; None = any
    page_sizes: Optional[frozenset[int]] = None  # None = any
    custom_mask: bool = True
    sliding_window: bool = True
    logit_cap: bool = True
    mrope: bool = True
    cuda_graph_modes: frozenset[ForwardMode] = frozenset()  # modes whose capture/replay hooks it implements
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    requires: tuple[str, ...] = ()  # importable module names
    cpu_needs_env: str | None = None  # an environment flag the CPU path needs (Triton's interpreter)
    cpu_dtypes: frozenset[str] | None = None  # where the CPU path supports fewer dtypes (None: all of dtypes)
    engine: str = "harness"  # whose classes run: "harness" (ours) or a serving engine's, through its adapter
    gaps: tuple[tuple[str, str], ...] = ()  # (property, why it does not apply to this backend)
    # (wrapper, mode, why): a mode not run when this backend is under that wrapper (e.g. a known engine bug
    # whose symptom would take the process down instead of failing a check)
    wrapped_gaps: tuple[tuple[str, ForwardMode, str], ...] = ()
    # Unit roundoff of the kernel's matrix products for float32 inputs (TF32 tensor cores: 2**-11).
    fp32_matmul_roundoff: float = 2.0**-24

    def unavailable_reason(self, device: str) -> str | None:
        """Why this backend cannot run on ``device`` here, or None."""
        if device not in self.devices:
            return f"needs a {' or '.join(sorted(self.devices))} device (this run uses {device})"
        if device == "cuda" and not torch.cuda.is_available():
            return "needs a CUDA GPU; none is visible"
        if device == "cpu" and self.cpu_needs_env and not env_flag(self.cpu_needs_env):
            return f"on the CPU it needs {self.cpu_needs_env}=1 (set before triton is imported)"
        if self.engine == "sglang":
            from backends.sglang.runtime import unavailable_reason

            reason = unavailable_reason()
            if reason:
                return reason
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"package '{module}' is not installed"
        return None


@dataclass(frozen=True)
class Support:
    """What a composition of backends supports: its leaves' declarations combined, read in one place by the
    matrix, the strategies (to draw only batches inside it) and ``repro`` (to refuse a case outside it).

    Modes, dtypes, page sizes and mrope must hold for every leaf; head dims, sliding window and logit cap for
    the leaves that own full-attention layers (a linear backend never sees those layers).
    """

    attention_kinds: frozenset[str]
    modes: frozenset[ForwardMode]
    dtypes: frozenset[str]
    head_dims: Optional[frozenset[int]]
    page_sizes: Optional[frozenset[int]]
    sliding_window: bool
    logit_cap: bool
    mrope: bool
    cuda_graph_modes: frozenset[ForwardMode]
    fp32_matmul_roundoff: float
    cpu_dtypes: frozenset[str]
    gaps: dict[str, str]  # property -> why it does not apply

    @classmethod
    def of(cls, caps: list[Capabilities]) -> "Support":
        full = [c for c in caps if c.attention_kinds & {"mha", "mla"}]

        def meet(values):  # None (any) is the identity
            values = [v for v in values if v is not None]
            return frozenset.intersection(*values) if values else None

        modes = frozenset.intersection(*(c.modes for c in caps))
        if not all(c.custom_mask for c in caps):
            modes -= {ForwardMode.TARGET_VERIFY}
        return cls(attention_kinds=frozenset().union(*(c.attention_kinds for c in caps)), modes=modes,
                   dtypes=frozenset.intersection(*(c.dtypes for c in caps)),
                   head_dims=meet([c.head_dims for c in full]), page_sizes=meet([c.page_sizes for c in caps]),
                   sliding_window=all(c.sliding_window for c in full), logit_cap=all(c.logit_cap for c in full),
                   mrope=all(c.mrope for c in caps),
                   cuda_graph_modes=frozenset.intersection(*(c.cuda_graph_modes for c in caps)),
                   fp32_matmul_roundoff=max(c.fp32_matmul_roundoff for c in caps),
                   cpu_dtypes=frozenset.intersection(*((c.cpu_dtypes or c.dtypes) for c in caps)),
                   gaps={prop: why for c in caps for prop, why in c.gaps})

    def unsupported_reason(self, spec: BatchSpec) -> str | None:
        """Why a batch of ``spec`` is outside this support, or None."""
        if spec.mode not in self.modes:
            why = "custom (tree) masks not supported" if spec.mode.is_target_verify() else "not supported"
            return f"mode {spec.mode.value}: {why}"
        if spec.dtype not in self.dtypes:
            return f"dtype {spec.dtype} not supported"
        if self.page_sizes is not None and spec.page_size not in self.page_sizes:
            return f"page_size {spec.page_size} not supported"
        if spec.mrope is not None and not self.mrope:
            return "mrope not supported"
        for layer in spec.layers:
            if layer.kind != "mha":
                continue
            if self.head_dims is not None and layer.head_dim not in self.head_dims:
                return f"head_dim {layer.head_dim} not supported"
            if layer.sliding_window is not None and not self.sliding_window:
                return "sliding window not supported"
            if layer.logit_cap is not None and not self.logit_cap:
                return "logit cap not supported"
        return None


@dataclass
class PlannedMetadata:
    """A backend's planned metadata in one inspectable form (DESIGN.md section 2).

    Indices are token slots unless ``kv_indices_are_pages``. ``kv_*`` describe the keys read from the
    paged cache (for extend: the prefix; for decode: everything); None where a backend has no such plan.
    """

    qo_indptr: torch.Tensor | None = None  # [B+1]
    kv_indptr: torch.Tensor | None = None  # [B+1]
    kv_indices: torch.Tensor | None = None  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor | None = None  # [B], pages only
    kv_indices_are_pages: bool = False
    kv_includes_new_tokens: bool = False  # decode plans read the new token back from the cache
    custom_mask: torch.Tensor | None = None  # flat bool
    mask_indptr: torch.Tensor | None = None  # [B+1]
    state_slots: torch.Tensor | None = None  # [B], linear attention
    chunk: dict[str, Any] = field(default_factory=dict)  # MLA chunked-prefix plan


class AttentionBackend:
    """Base of every backend and wrapper; see DESIGN.md section 2 for when each method is called."""

    capabilities: ClassVar[Capabilities]
    is_wrapper: ClassVar[bool] = False

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not implement {method}()")

    # ---- per batch ----
    def init_forward_metadata(self, forward_batch) -> None:
        raise self._missing("init_forward_metadata")

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        """Run one layer. q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> o ``[T, Hq, Dv]``."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(0, layer.tp_q_head_num, layer.v_head_dim)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise self._missing("forward_extend")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise self._missing("forward_decode")

    # ---- CUDA graphs ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise self._missing("init_cuda_graph_state")

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        raise self._missing("init_forward_metadata_capture_cuda_graph")

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu) -> None:
        raise self._missing("init_forward_metadata_replay_cuda_graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        raise self._missing("get_cuda_graph_seq_len_fill_value")

    # ---- speculative decoding (overlap plan stream) ----
    def get_verify_buffers_to_fill_after_draft(self):
        raise self._missing("get_verify_buffers_to_fill_after_draft")

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        raise self._missing("update_verify_buffers_to_fill_after_draft")

    # ---- inspection (harness only) ----
    def planned_metadata(self) -> PlannedMetadata:
        raise self._missing("planned_metadata")
