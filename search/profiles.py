"""Profiles: the kernel configuration a run is fixed to, and how hard Hypothesis searches.

Axes that cost a GPU compile (dtype, head dims) are fixed per profile; everything else (batch sizes,
ragged lengths, prefixes, page tables, draft trees, split points, positions) is fuzzed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings


SHRINK_ROWS_PER_RUN = 4


@dataclass(frozen=True)
class Profile:
    name: str
    dtype: str
    mha: tuple[int, int, int, int]  # num_q_heads, num_kv_heads, head_dim, v_head_dim
    mla: tuple[int, int, int, int, int]  # num_heads, qk_nope, qk_rope, kv_lora_rank, v_head_dim
    linear: tuple[int, int, int, int]  # num_k_heads, num_v_heads, head_k_dim, head_v_dim
    page_sizes: tuple[int, ...]
    max_requests: int
    max_prefix: int
    max_extend: int
    max_layers: int
    max_examples: int  # per matrix row
    description: str
    # Shrinking a failure takes at most this long per row, and SHRINK_ROWS_PER_RUN times it over a whole
    # ``harness run`` (failures found after that are reported as found), so a failing run ends about as fast
    # as a passing one.
    shrink_seconds: float = 30.0
    # Rows whose backends refuse ``dtype`` run in this one instead (SGLang's GDN kernels refuse float32: the
    # CPU profiles run them in float16, with float16's bounds); None: such rows do not run.
    fallback_dtype: str | None = None
    # Rows that declare a slow CPU path (Capabilities.slow_on_cpu) draw at most this many examples on a CPU
    # (None: the profile's max_examples), so one interpreted engine does not take over a CI run.
    slow_row_examples: int | None = None
    # KV cache storages drawn where a composition declares them (the first is where shrinking goes).
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8_e4m3")


PROFILES: dict[str, Profile] = {p.name: p for p in [
    Profile("ci", "float32", (4, 2, 32, 32), (4, 16, 8, 32, 16), (2, 4, 16, 16), (1, 4, 16),
            max_requests=4, max_prefix=40, max_extend=20, max_layers=3, max_examples=4, shrink_seconds=10.0,
            fallback_dtype="float16", slow_row_examples=1, description="CPU CI: float32, tiny heads, few examples per row"),
    Profile("dev", "float32", (4, 2, 32, 32), (4, 16, 8, 32, 16), (2, 4, 16, 16), (1, 4, 16),
            max_requests=6, max_prefix=80, max_extend=40, max_layers=4, max_examples=25, fallback_dtype="float16",
            description="a developer's machine: the ci shapes, more examples"),
    Profile("nightly", "float32", (8, 2, 64, 64), (8, 32, 16, 64, 32), (2, 4, 32, 32), (1, 4, 16, 64),
            max_requests=8, max_prefix=300, max_extend=120, max_layers=4, max_examples=200, fallback_dtype="float16",
            description="long sweeps: bigger shapes and many examples"),
    Profile("gpu", "bfloat16", (8, 2, 128, 128), (16, 128, 64, 512, 128), (4, 8, 128, 128), (1, 16),
            max_requests=16, max_prefix=600, max_extend=200, max_layers=4, max_examples=20,
            description="GPU runners: bf16 and the head dims serving models ship (FlashInfer, fla compile these)"),
]}


def hypothesis_settings(profile: Profile, *, database=None, max_examples: int | None = None,
                        shrink: bool = True) -> settings:
    """``shrink=False`` reports a failure as found (no shrink phase)."""
    return settings(
        phases=tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink),
        max_examples=max_examples or profile.max_examples,
        deadline=None,  # kernels compile on first use; speed belongs in benchmarks
        database=database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
        derandomize=False,
        print_blob=True,
    )


for _p in PROFILES.values():
    settings.register_profile(_p.name, hypothesis_settings(_p))
