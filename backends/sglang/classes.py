"""SGLang's registered attention backends whose kernels the harness cannot run (their packages are not on its
machines, or their hardware is not: Blackwell's TRT-LLM and CuTe DSL kernels, FlashMLA) or has not adapted yet, and whose
planning the harness does not build either (FlashAttention's does: plans.py), checked at the level they reach without
kernels: their classes.

A leaf here is never built. Its one row, ``conformance`` (properties/conformance.py, ``class_conformance``), imports
the classes the server's ``--attention-backend NAME`` factory returns (read from SGLang's registry by features.py)
and checks that each takes every call SGLang makes of it: the base class's declared calls, the calls SGLang's
wrappers forward to a child, and the forward entry points a full-attention backend must define. Two of the five
bugs this project started from were of that kind (a TRT-LLM MLA backend's ``init_mha_chunk_metadata`` taking one
argument where the hybrid wrapper passes two): found here on any machine where the class imports.

The row is unavailable where no class of the backend imports (``harness list --why`` says which package is missing)
and where the installed release registers no backend of that name. One class plus one line in the registry's
``LEAVES`` adds a backend; when its kernels are adapted, its leaf moves to adapter.py and gains every property.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

from backends.base import AttentionBackend, Capabilities
from batch.spec import ForwardMode

CLASS_ONLY = "its kernels are not adapted to run here; its classes are read, never built"


def _capabilities(kind: str, why: str, name: str) -> Capabilities:
    return Capabilities(attention_kinds=frozenset({kind}), modes=frozenset({ForwardMode.EXTEND}), requires=("sglang",),
                        engine="sglang", one_shape_per_kind=True, class_only=why, engine_classes=name)


class SglangClassOnly(AttentionBackend):
    """A registered SGLang backend read at class level (module docstring)."""

    sglang_name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, model_runner) -> None:
        raise TypeError(f"sglang.{self.sglang_name} is a class-level leaf: only its classes are checked, it is "
                        f"never built ({self.capabilities.class_only})")

    @classmethod
    def engine_classes(cls) -> list[type]:
        return registered_classes(cls.sglang_name)


def registered_classes(name: str) -> list[type]:
    """The classes SGLang's ``--attention-backend name`` factory returns that import here."""
    from backends.sglang import features, runtime

    runtime.load()  # the stand-ins a CPU install needs, as every SGLang row has them
    return [getattr(importlib.import_module(module), cls) for module, cls in features.importable_classes(name)]


class SglangTrtllmMla(SglangClassOnly):
    sglang_name = "trtllm_mla"
    capabilities = _capabilities("mla", "TRT-LLM's MLA kernels run on Blackwell only", sglang_name)


class SglangCutedslMla(SglangClassOnly):
    sglang_name = "cutedsl_mla"
    capabilities = _capabilities("mla", "its CuTe DSL MLA kernels run on Blackwell only", sglang_name)


class SglangCutlassMla(SglangClassOnly):
    sglang_name = "cutlass_mla"  # registered up to the releases that replaced it with cutedsl_mla
    capabilities = _capabilities("mla", "its CUTLASS MLA kernels (sgl_kernel) run on Blackwell only", sglang_name)


class SglangFlashMla(SglangClassOnly):
    sglang_name = "flashmla"
    capabilities = _capabilities("mla", "FlashMLA's kernels need the flash_mla package and a Hopper GPU", sglang_name)


class SglangDsa(SglangClassOnly):
    sglang_name = "dsa"
    capabilities = _capabilities("mla", "DeepSeek sparse attention needs its indexer's kernels (deep_gemm, "
                                        "sgl_kernel) and a model's sparse layers, not adapted yet", sglang_name)


class SglangNsa(SglangClassOnly):
    sglang_name = "nsa"
    capabilities = _capabilities("mla", "native sparse attention needs its indexer's kernels and a model's sparse "
                                        "layers, not adapted yet", sglang_name)


# Registered backends for other hardware whose classes import on any machine: read at the same level.
class SglangAiter(SglangClassOnly):
    sglang_name = "aiter"
    capabilities = _capabilities("mha", "AITER's kernels run on AMD Instinct GPUs (ROCm) only", sglang_name)


class SglangWave(SglangClassOnly):
    sglang_name = "wave"
    capabilities = _capabilities("mha", "Wave's kernels run on AMD GPUs (ROCm) only", sglang_name)


class SglangQsa(SglangClassOnly):
    sglang_name = "qsa"
    capabilities = _capabilities("mha", "Qwen sparse attention needs its indexer's kernels and a model's sparse layers, "
                                        "not adapted yet", sglang_name)


class SglangHpcOps(SglangClassOnly):
    sglang_name = "hpc_ops"
    capabilities = _capabilities("mha", "its kernels come with the hpc_ops package, not on the harness's machines",
                                 sglang_name)


class SglangIntelAmx(SglangClassOnly):
    sglang_name = "intel_amx"
    capabilities = _capabilities("mha", "its kernels are sgl_kernel's CPU ops for Intel AMX (the sglang-kernel CPU "
                                        "build)", sglang_name)
