"""SGLang's registered backends whose planning runs here though their kernels do not: plan-level leaves.

FlashAttention 3 is what SGLang's server picks by default on Hopper, and its kernels come with ``sgl_kernel`` (the
sglang-kernel wheel, hundreds of MB, tied to SGLang's torch), which the harness's machines lack. Its planning is
SGLang's own torch and Triton code (``FlashAttentionBackend.init_forward_metadata``: ``cu_seqlens_q/k``,
``cache_seqlens``, the page table), and that is where an indexing bug would live. A plan-level leaf is built over
the harness's pools as every adapted leaf is (adapter.py), by SGLang's own ``--attention-backend`` factory asked as on
the hardware the server runs it on, and runs ``init_forward_metadata`` on every batch the metadata property draws;
its plan is read into the harness's inspectable form and held to the invariants every other plan is
(properties/metadata.py). Its kernels are ``sgl_kernel``'s stand-ins (runtime.py), which raise when called; no
layer runs (``Capabilities.plan_only``: only conformance and metadata apply).

The one kernel on the planning path, FA3's decode scheduler (``sgl_kernel.flash_attn.get_scheduler_metadata``,
flashattention_backend.py:409-436), is answered as SGLang answers it itself when the precompute is off (under
attention data parallelism: ``_should_disable_scheduler_metadata_precompute``): no precomputed schedule, which the
kernel then builds per call.

Where the real ``sgl_kernel`` is installed on a CUDA machine, these leaves are not plan-level: every property runs.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import ClassVar

import torch

from backends.base import Capabilities
from batch.spec import ForwardMode
from backends.sglang import features
from backends.sglang.adapter import ADAPTED_MODES, TBO_DRAFT_EXTEND_GAP, SglangBackend
from backends.sglang.classes import ReadsEngineClasses


def kernels_installed() -> bool:
    """Whether FlashAttention's kernels can run here: the real ``sgl_kernel`` (not the adapter's stand-in, which
    ``find_spec`` finds too once a process has loaded SGLang) and a CUDA GPU."""
    return features.really_installed("sgl_kernel") and torch.cuda.is_available()


@contextlib.contextmanager
def asked_as(capability: tuple[int, int]):
    """SGLang's factories and backends asked the GPU's compute capability as on the hardware the server runs the
    backend on (fa3's factory refuses any other: attention_registry.py, create_flashattention_v3_backend). The
    names are those each release asks through: SGLang's ``get_device_capability`` where a module imported it, and
    torch's (0.5.10 to 0.5.1x ask torch directly)."""
    patched = []
    for module in ("sglang.srt.layers.attention.attention_registry",
                   "sglang.srt.layers.attention.flashattention_backend"):
        mod = importlib.import_module(module)
        if hasattr(mod, "get_device_capability"):
            patched.append((mod, "get_device_capability", mod.get_device_capability))
    patched.append((torch.cuda, "get_device_capability", torch.cuda.get_device_capability))
    try:
        for obj, name, _ in patched:
            setattr(obj, name, lambda *args, **kwargs: capability)
        yield
    finally:
        for obj, name, old in patched:
            setattr(obj, name, old)


class SglangPlanOnly(ReadsEngineClasses, SglangBackend):
    """A registered SGLang backend built and planned, never run (module docstring)."""

    capabilities: ClassVar[Capabilities]

    @classmethod
    def built_without_kernels(cls):
        """What SGLang's factory needs to build this leaf where its kernels are absent (a context)."""
        return contextlib.nullcontext()

    @classmethod
    @contextlib.contextmanager
    def engine_build_scope(cls):
        """Where its kernels are absent, SGLang's constructors (its backend's, its draft container's) run inside
        :meth:`built_without_kernels`, where the server never builds them: whatever they lack there is the stand-ins'
        gap, the harness's to mend, so an exception from them is marked as such (properties/blame.py)."""
        if not cls.capabilities.plan_only:
            yield
            return
        with cls.built_without_kernels():
            try:
                yield
            except Exception as e:
                e.harness_built_without_kernels = f"sglang.{cls.sglang_name} built without its kernels " \
                                                  f"({cls.__module__}.{cls.__name__}.built_without_kernels)"
                raise

    @classmethod
    def engine_backend(cls, sgl, sgl_runner):
        if not cls.capabilities.plan_only:
            return super().engine_backend(sgl, sgl_runner)
        with cls.engine_build_scope():
            inner = super().engine_backend(sgl, sgl_runner)
        if getattr(inner, "_get_scheduler_metadata", None) is not None:
            inner._get_scheduler_metadata = lambda **kwargs: None  # module docstring: SGLang's own answer
        return inner

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, via=None) -> torch.Tensor:
        if self.capabilities.plan_only:
            raise RuntimeError(f"sglang.{self.sglang_name} is a plan-level leaf, its kernels are not run here: "
                               f"{self.capabilities.plan_only}")
        # Named, not super(): a TBO half (adapter._TboChild) runs its leaf's _run as its own
        return SglangBackend._run(self, q, k, v, layer, forward_batch, save_kv_cache, via)


_WHY = "FlashAttention's kernels come with sgl_kernel (the sglang-kernel wheel), not installed here with a CUDA GPU"


def _capabilities(name: str, why: str, **draft) -> Capabilities:
    return Capabilities(
        attention_kinds=frozenset({"mha"}),
        # and its draft worker's loop (FlashAttentionMultiStepBackend: each step backend adds its speculative_step_id
        # to the committed lengths, flashattention_backend.py:911-929; over draft trees it attends the prefix and each
        # branch's own keys apart, :944-993), which hands its steps no server draft window
        modes=ADAPTED_MODES | {ForwardMode.DRAFT_DECODE},
        draft_prefix_window=False,
        **draft,
        dtypes=frozenset({"bfloat16", "float16"}),  # FlashAttention 3 takes 16-bit inputs only
        cpu_dtypes=frozenset({"bfloat16", "float16"}),
        requires=("sglang",),
        engine="sglang",
        one_shape_per_kind=True,
        engine_classes=name,
        plan_only=None if kernels_installed() else why,
        wrapped_gaps=(TBO_DRAFT_EXTEND_GAP,),
        # Its out_graph plans decode and idle, target_verify and draft_extend_v2 into static buffers
        # (flashattention_backend.py:563-577, _init_full_cg_decode_metadata, _apply_cuda_graph_metadata), and its
        # in_graph refreshes verify and draft-extend tables (:478-530)
        cuda_graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                    ForwardMode.IDLE, ForwardMode.DRAFT_DECODE}),
    )


# SGLang's FlashAttentionBackend: fa3 and fa4 build the same class, fa_impl_ver apart; its plan is read by
# adapter.flash_attention_plan.
class _FlashAttention(SglangPlanOnly):
    device_capability: ClassVar[tuple[int, int]]  # the compute capability its factory is asked as

    @classmethod
    def built_without_kernels(cls):
        return asked_as(cls.device_capability)


class SglangFa3(_FlashAttention):
    sglang_name = "fa3"
    device_capability = (9, 0)  # Hopper, where the server picks it by default
    capabilities = _capabilities("fa3", _WHY)


class SglangFa4(_FlashAttention):
    sglang_name = "fa4"
    device_capability = (10, 0)  # Blackwell
    # The server takes draft trees over pages of more than one token on fa3, flashinfer and triton only
    # (arg_groups/speculative_hook.py, _PAGE_TREE_SPEC_BACKENDS)
    capabilities = _capabilities("fa4", _WHY + "; FlashAttention 4's run on Blackwell", paged_draft_trees=False)
