"""Profiles: the kernel configuration a run is fixed to, and how hard Hypothesis searches.

Axes that cost a GPU compile (dtype, head configurations) are fixed per profile; everything else (batch sizes,
ragged lengths, prefixes, page sizes and layouts, draft trees, split points, positions) is fuzzed.

Head configurations: each profile has a small fixed set, drawn in every run, and may have more that *rotate*:
a run draws the fixed set plus one rotating configuration, chosen by ``--profile NAME@K`` or, by default, by
the day (UTC) plus the run's shard index, so a nightly run of two shards compiles three configurations and
covers all of them within a week. The chosen rotation is part of the profile's name (``gpu@3``), which the
reports, the case files and the sweep's metadata record.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings


SHRINK_ROWS_PER_RUN = 4

HeadConfig = tuple[int, int, int, int]  # num_q_heads, num_kv_heads, head_dim, v_head_dim


class ProfileError(ValueError):
    """An unknown profile name or rotation."""


@dataclass(frozen=True)
class Profile:
    name: str
    dtype: str
    head_configs: tuple[HeadConfig, ...]  # MHA layers: drawn in every run (the first is the shrink target)
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
    # Head configurations of which one joins head_configs per run (see the module docstring), and which.
    rotating_head_configs: tuple[HeadConfig, ...] = ()
    rotation: int = 0
    # Cached lengths at the backends' kernel boundaries (Capabilities.length_boundaries) are drawn up to this
    # even past max_prefix (new-token counts stay within max_extend): small shapes that still cross them.
    max_boundary: int = 0
    # Long contexts: a few requests whose cached lengths lie in [lo, hi], in about one case in 16.
    long_context: tuple[int, int] | None = None
    # Wide batches: (lo, hi) requests with short extends, in about one case in 16 (split-KV decode paths).
    wide_batch: tuple[int, int] | None = None
    # Rows whose backends refuse ``dtype`` run in this one instead (SGLang's GDN kernels refuse float32: the
    # CPU profiles run them in float16, with float16's bounds); None: such rows do not run.
    fallback_dtype: str | None = None
    # Rows that declare a slow CPU path (Capabilities.slow_on_cpu) draw at most this many examples on a CPU
    # (None: the profile's max_examples), so one interpreted engine does not take over a CI run.
    slow_row_examples: int | None = None
    # Rows of the harness's own backends only (no engine's class among them) draw at most this many examples in a run
    # (None: the profile's max_examples): a control sample that shows the references and properties sound, the
    # examples going to the engine's compositions, which are what users test
    control_examples: int | None = None
    # KV cache storages drawn where a composition declares them (the first is where shrinking goes).
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8_e4m3")
    # Lightning layers (num_heads, head_dim): Ling's head dim, 128, whatever the profile (SGLang's seg_la decode
    # splits the key dim in blocks of 128, and Bailing configs have head_dim 128).
    lightning: tuple[int, int] = (2, 128)
    # Short-convolution layers: the hidden size (LFM2-350M's is 1024), and the kernel widths drawn (a model's one
    # width; LFM2's checkpoints use 3, SGLang's causal_conv1d kernels take 2 to 4).
    short_conv_hidden: int = 32
    short_conv_kernels: tuple[int, ...] = (2, 3, 4)
    # Mamba-2 layers (num_heads, head_dim, state_size, conv_kernel; Nemotron-H's per GPU of TP 8: 16, 64, 128, 4),
    # with the groups and the SSD chunk sizes drawn (one of each per model; a chunk shorter than a request's tokens
    # makes the chunked scan pass states between chunks, and across a cached prefix's boundary)
    mamba2: tuple[int, int, int, int] = (4, 8, 16, 4)
    mamba2_groups: tuple[int, ...] = (1, 2)
    mamba2_chunks: tuple[int, ...] = (16, 32)
    # KDA layers (num_heads, head_k_dim, head_v_dim, conv_kernel; Kimi Linear's per GPU of TP 8: 4, 128, 128, 4), the
    # gate drawn (standard or safe, one per model)
    kda: tuple[int, int, int, int] = (2, 16, 16, 4)

    @property
    def heads(self) -> tuple[HeadConfig, ...]:
        """The head configurations this run draws: the fixed set, then the rotation's one."""
        if not self.rotating_head_configs:
            return self.head_configs
        return self.head_configs + (self.rotating_head_configs[self.rotation % len(self.rotating_head_configs)],)

    @property
    def base_name(self) -> str:
        return self.name.split("@")[0]


PROFILES: dict[str, Profile] = {p.name: p for p in [
    # MLA: 4 heads, nope 16, MiniCPM3's latent (256 + rope 32, one of the two SGLang's Triton MLA decode takes), v 16
    Profile("ci", "float32", ((4, 2, 32, 32), (4, 4, 32, 32), (4, 1, 32, 32)), (4, 16, 32, 256, 16), (2, 4, 16, 16),
            (1, 4, 16, 32, 64), max_requests=4, max_prefix=40, max_extend=20, max_layers=3, max_examples=4,
            shrink_seconds=10.0, max_boundary=65, fallback_dtype="float16", slow_row_examples=1,
            description="CPU CI: float32, tiny heads (GQA 2, MHA, MQA), few examples per row"),
    Profile("dev", "float32", ((4, 2, 32, 32), (4, 4, 32, 32), (4, 1, 32, 32), (8, 1, 64, 64)), (4, 16, 32, 256, 16),
            (2, 4, 16, 16), (1, 4, 16, 32, 64), max_requests=6, max_prefix=80, max_extend=40, max_layers=4,
            max_examples=25, max_boundary=257, fallback_dtype="float16",
            description="a developer's machine: the ci shapes and a group-8 MQA, more examples"),
    Profile("nightly", "float32", ((8, 2, 64, 64),), (8, 32, 32, 256, 32), (2, 4, 32, 32), (1, 4, 16, 32, 64),
            max_requests=8, max_prefix=300, max_extend=120, max_layers=4, max_examples=200, max_boundary=300,
            fallback_dtype="float16", control_examples=50,
            rotating_head_configs=((8, 8, 64, 64), (8, 1, 64, 64), (16, 2, 128, 128), (16, 8, 128, 128),
                                   (4, 1, 256, 256), (8, 2, 256, 256)),
            long_context=(4096, 16384), wide_batch=(64, 128),
            description="long sweeps: bigger shapes, many examples, rotating head configurations"),
    Profile("gpu", "bfloat16", ((8, 2, 128, 128),), (16, 128, 64, 512, 128), (4, 8, 128, 128), (1, 16, 32, 64),
            max_requests=16, max_prefix=600, max_extend=200, max_layers=4, max_examples=20, max_boundary=600,
            control_examples=5, rotating_head_configs=((8, 8, 128, 128), (8, 1, 128, 128), (16, 8, 128, 128), (16, 2, 64, 64),
                                   (8, 8, 64, 64), (8, 2, 256, 256), (8, 1, 256, 256)),
            long_context=(16384, 32768), wide_batch=(64, 160), lightning=(8, 128), short_conv_hidden=1024,
            mamba2=(16, 64, 128, 4), mamba2_groups=(1, 8), mamba2_chunks=(64, 256), kda=(4, 128, 128, 4),
            description="GPU runners: bf16, serving head dims (64/128/256, MHA to MQA), 16k-32k contexts"),
]}


def profile(name: str, shard_index: int = 0, today: datetime.date | None = None) -> Profile:
    """The profile called ``name``, with its head rotation: ``NAME@K`` picks rotation K; a plain ``NAME`` of a
    profile with rotating head configurations takes the day's (UTC) plus ``shard_index``."""
    base, _, rot = name.partition("@")
    if base not in PROFILES:
        raise ProfileError(f"unknown profile {base!r}; profiles: {', '.join(PROFILES)}")
    p = PROFILES[base]
    n = len(p.rotating_head_configs)
    if rot:
        if not rot.isdigit():
            raise ProfileError(f"profile {name!r}: write NAME@K with K a rotation number, e.g. {base}@0")
        if not n:
            raise ProfileError(f"profile {base!r} has no rotating head configurations; write {base}")
        k = int(rot) % n
    elif n:
        k = ((today or datetime.datetime.now(datetime.timezone.utc).date()).toordinal() + shard_index) % n
    else:
        return p
    return dataclasses.replace(p, name=f"{base}@{k}", rotation=k)


def hypothesis_settings(profile: Profile, *, database=None, max_examples: int | None = None,
                        shrink: bool = True) -> settings:
    """``shrink=False`` reports a failure as found (no shrink phase)."""
    return settings(
        phases=tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink),
        max_examples=max_examples or profile.max_examples,
        deadline=None,  # kernels compile on first use; speed belongs in benchmarks
        database=database,
        # filter_too_much: a row steered off a known bug rejects every later batch that has what the bug needs
        # (search/search_row.py), which can be most of what is drawn; that is the point, not a slow generator
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture,
                               HealthCheck.filter_too_much],
        derandomize=False,
        print_blob=True,
    )


for _p in PROFILES.values():
    settings.register_profile(_p.name, hypothesis_settings(_p))
