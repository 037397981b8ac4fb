"""Pure-data description of one forward batch (DESIGN.md sections 1 and 3).

A :class:`BatchSpec` holds no tensors: it is what Hypothesis draws, what a case file stores and what
materialization turns into a :class:`~batch.forward_batch.ForwardBatch`. It validates itself on
construction, so an impossible batch fails with one line naming the field, before any tensor exists.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Union

SCHEMA_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16", "float64")
# The KV cache's storage: "auto" stores K/V in the batch's dtype; "fp8_e4m3" stores ``k / k_scale`` rounded to
# float8 e4m3 (SGLang's --kv-cache-dtype fp8_e4m3), read back as ``stored * k_scale``.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# Per-layer KV scales are powers of two in this range: then ``k / k_scale`` is exact in every dtype, so the
# stored e4m3 value is unique whatever precision a backend divides in (properties/tolerances.py); and the
# drawn K/V (|x| <= 4.33, RoPE'd keys <= 6.2) divided by 2^-6 stay inside e4m3's +-448 (no saturation).
KV_SCALE_RANGE = (2.0**-6, 2.0**4)
# Where the batch's requests keep their linear-attention states (their state slots, in batch order):
# "shuffled": a random permutation of 1..N (N = the request rows); "compact": 1..B in order; "reversed": B..1;
# "gapped": spread over a pool twice as large, with unused slots (holding other requests' states) between them.
STATE_SLOT_LAYOUTS = ("shuffled", "compact", "reversed", "gapped")
# Where a batch's KV pages lie in the pool (SGLang's own test kit names the same four, attention_unittest/
# attention_methods/dense_attention.py make_loc_fn). Token j of a request always sits at offset j % page_size
# of its (j // page_size)-th page; a layout only decides which physical page that is.
#   shuffled_pages        every page of the batch drawn at random from the pool (the default; what the harness
#                         always drew before layouts were an axis, so older case files replay unchanged)
#   contiguous            each request's pages one ascending run, the requests back to back (a fresh allocator)
#   interleaved_pages     page k of request i is physical page k * B + i: neighbouring pages belong to
#                         different requests (requests that grew a page at a time, side by side)
#   non_monotonic_extend  the prefix's pages ascending; the pages that hold only new tokens in descending
#                         order, so out_cache_loc goes down inside an extend (at every token when page_size is 1)
KV_LAYOUTS = ("shuffled_pages", "contiguous", "interleaved_pages", "non_monotonic_extend")

# A CUDA graph replays a batch of B requests at the smallest captured size that holds it, the rows past B padding.
# ``BatchSpec.graph_padding`` asks for at least that many padded rows (the replay runs at the smallest captured size
# >= B + graph_padding, as on a server whose --cuda-graph-bs skips B): SGLang's defaults capture 1, 2, 4, 8, ..., so
# most small batches replay unpadded, and padding is where replay code has its own branches. The batch's request
# pool holds this many rows beside its requests, so the padded size always fits.
MAX_GRAPH_PADDING = 2


class SpecError(ValueError):
    """A batch specification or case file that cannot describe a real batch."""


class ForwardMode(str, Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    # EAGLE's multi-step draft decode: spec_steps - 1 forward steps of the draft model, each decoding one token per
    # branch (topk per request) over the request's cached prefix and its branch's own draft tokens so far
    DRAFT_DECODE = "draft_decode"
    IDLE = "idle"

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND

    def is_draft_decode(self) -> bool:
        return self is ForwardMode.DRAFT_DECODE

    def drafts_tree(self) -> bool:
        """The batch's new tokens are draft tokens placed by ``spec.parents`` (a verify tree, the draft loop's
        branches): each sits at seq_len + its depth and sees the cached tokens, itself and its ancestors."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)


def draft_forest(topk: int, steps: int) -> tuple[int, ...]:
    """The draft tokens of one request in a DRAFT_DECODE batch as a parent list: ``topk`` branches of
    ``steps - 1`` tokens each, branch by branch (token ``j * (steps - 1) + s`` is branch j's step s; each branch's
    first token is a root, -1). A draft step's query sees the cached prefix and its own branch's tokens up to
    itself (SGLang: ``generate_draft_decode_kv_indices`` gives branch j the prefix plus its step slots)."""
    n = steps - 1
    return tuple(-1 if s == 0 else j * n + s - 1 for j in range(topk) for s in range(n))


def draft_region(prefix_len: int, page_size: int, topk: int, steps: int, branch: int) -> tuple[int, int]:
    """(first column, tail length) of draft branch ``branch``'s region in a request's cache row, SGLang's layout
    (``prepare_for_draft``, eagle_worker_common.py; ``generate_draft_decode_kv_indices``' paged read): with pages of
    one token, or one branch, the branches' ``steps`` slots follow the prefix one after the other (no tail). With
    larger pages and several branches each branch gets page-aligned pages of its own, from ``prefix - prefix %
    page_size`` on, whose first ``prefix % page_size`` slots (the tail) repeat the prefix's last partial page
    (``duplicate_prefix_tail_to_draft_branches``; branch 0's tail is that page itself), then its ``steps`` slots."""
    if page_size == 1 or topk == 1:
        return prefix_len + branch * steps, 0
    tail = prefix_len % page_size
    pages = -(-(tail + steps) // page_size)
    return prefix_len - tail + branch * pages * page_size, tail


def draft_step_rows(batch_size: int, topk: int, steps: int, step: int) -> list[int]:
    """The rows of draft step ``step`` in a DRAFT_DECODE batch of ``batch_size`` requests (each ``topk`` branches of
    ``steps - 1`` tokens, :func:`draft_forest`): for each request, each branch's token of that step."""
    n = steps - 1
    return [(r * topk + j) * n + step for r in range(batch_size) for j in range(topk)]


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise SpecError(msg)


class _Shaped:
    """A layer's ``shape``: the values of its ``SHAPE`` fields, what sizes its pools and weights (an engine that
    builds one pool and one config per model needs every layer of a kind to share it)."""

    SHAPE: ClassVar[tuple[str, ...]] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.SHAPE)


@dataclass(frozen=True)
class MHALayer(_Shaped):
    """Full attention with GQA: q head h reads kv head h // (num_q_heads // num_kv_heads)."""

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    # window_left: position p sees keys in [p - w, p]. A model has one window (SGLang's
    # runner.sliding_window_size), which each layer uses or not; 0 is not a window (SGLang reads 0 as none).
    # Positions, not row indices: in TARGET_VERIFY a draft token at tree depth d sits at seq_len + d, and
    # so do its ancestors at theirs (a sibling's row index is no position).
    sliding_window: int | None = None
    logit_cap: float | None = None
    rope_theta: float = 10000.0
    # An fp8 KV cache stores k / k_scale and v / v_scale (SGLang: RadixAttention.k_scale / v_scale).
    k_scale: float = 1.0
    v_scale: float = 1.0
    kind: str = field(default="mha", init=False)
    SHAPE = ("num_q_heads", "num_kv_heads", "head_dim", "v_head_dim")

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        for name in self.SHAPE:
            _require(getattr(self, name) >= 1, f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        _require(self.num_q_heads % self.num_kv_heads == 0,
                 f"{where}: num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, f"{where}.head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.sliding_window is None or self.sliding_window >= 1,
                 f"{where}.sliding_window must be >= 1 or null (no window), got {self.sliding_window}")
        _require(self.logit_cap is None or self.logit_cap > 0,
                 f"{where}.logit_cap must be > 0 or null, got {self.logit_cap}")
        lo, hi = KV_SCALE_RANGE
        for name in ("k_scale", "v_scale"):
            x = float(getattr(self, name))
            _require(lo <= x <= hi and math.frexp(x)[0] == 0.5,
                     f"{where}.{name} must be a power of two in [2^-6, 2^4] (so k / scale is exact), got {x}")


@dataclass(frozen=True)
class MLALayer(_Shaped):
    """DeepSeek multi-head latent attention; the cache holds ckv[kv_lora_rank] and kpe[qk_rope_head_dim]."""

    layer_id: int
    num_heads: int
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    kv_lora_rank: int = 512
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    kind: str = field(default="mla", init=False)
    SHAPE = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim")

    @property
    def sm_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        for name in self.SHAPE:
            _require(getattr(self, name) >= 1, f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        _require(self.qk_rope_head_dim % 2 == 0, f"{where}.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")


@dataclass(frozen=True)
class LinearLayer(_Shaped):
    """Gated delta rule layer; value head j reads q/k head j // (num_v_heads // num_k_heads)."""

    layer_id: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    kind: str = field(default="linear", init=False)
    SHAPE = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def scale(self) -> float:
        return self.head_k_dim**-0.5

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            _require(getattr(self, name) >= 1, f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        _require(self.num_v_heads % self.num_k_heads == 0,
                 f"{where}: num_v_heads={self.num_v_heads} is not a multiple of num_k_heads={self.num_k_heads}")
        _require(self.conv_kernel >= 2, f"{where}.conv_kernel must be >= 2, got {self.conv_kernel}")


@dataclass(frozen=True)
class LightningLayer(_Shaped):
    """Lightning attention (Bailing/Ling's linear layers, reference/lightning.py): per head a state ``(K, V)``
    decayed by a fixed per-head rate, no softmax; q, k and v have ``num_heads`` heads each (no grouping).

    The decay rates are the model's: ALiBi slopes for ``num_heads``, scaled by the layer's depth in a model of
    :attr:`BatchSpec.num_model_layers` layers. The model hands the backend q, k, v in float32 (Bailing casts
    its projections before attention), without RoPE (``linear_rope`` off: RoPE is the model's, not attention's).
    """

    layer_id: int
    num_heads: int
    head_dim: int = 128
    kind: str = field(default="lightning", init=False)
    SHAPE = ("num_heads", "head_dim")

    # The dtype the model hands q/k/v over in, and the layer computes in, whatever the batch's dtype
    compute_dtype = "float32"

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        _require(self.num_heads >= 1, f"{where}.num_heads must be >= 1, got {self.num_heads}")
        _require(self.head_dim >= 1, f"{where}.head_dim must be >= 1, got {self.head_dim}")


@dataclass(frozen=True)
class ShortConvLayer(_Shaped):
    """A gated short convolution (LFM2's conv layers, reference/short_conv.py): each token's ``B``, ``C`` and ``x``
    (``hidden`` each, as the model's input projection emits them), ``C * conv(B * x)`` causal and depthwise over
    ``conv_kernel`` tokens; its state per request is the last ``conv_kernel - 1`` values of ``B * x``. A model has
    one kernel width and one bias setting for all its conv layers (LFM2's ``conv_L_cache``, ``conv_bias``)."""

    layer_id: int
    hidden: int
    conv_kernel: int = 3
    conv_bias: bool = False
    kind: str = field(default="short_conv", init=False)
    SHAPE = ("hidden", "conv_kernel", "conv_bias")

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        _require(self.hidden >= 1, f"{where}.hidden must be >= 1, got {self.hidden}")
        _require(self.conv_kernel >= 2, f"{where}.conv_kernel must be >= 2, got {self.conv_kernel}")
        _require(isinstance(self.conv_bias, bool), f"{where}.conv_bias must be true or false, got {self.conv_bias!r}")


@dataclass(frozen=True)
class Mamba2Layer(_Shaped):
    """A Mamba-2 mixer (SSD; Nemotron-H's, Falcon-H1's, Granite 4's mamba layers; reference/mamba2.py): ``num_heads``
    heads of ``head_dim`` reading ``n_groups`` groups of B and C of ``state_size``, a causal conv of ``conv_kernel``
    over x, B and C, a gated RMS norm by groups. Its input is the model's input projection's output (z, xBC, dt per
    token), its output what goes into the output projection. ``chunk_size`` is the model's ``mamba_chunk_size``,
    the block length of its SSD kernels' chunked scan. One setting of all of these per model."""

    layer_id: int
    num_heads: int
    head_dim: int
    n_groups: int = 1
    state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 16
    conv_bias: bool = True
    kind: str = field(default="mamba2", init=False)
    SHAPE = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "chunk_size", "conv_bias")

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @property
    def input_width(self) -> int:
        """z, xBC and dt side by side, as the input projection emits them."""
        return self.intermediate + self.conv_dim + self.num_heads

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        for name in ("num_heads", "head_dim", "n_groups", "state_size", "chunk_size"):
            _require(getattr(self, name) >= 1, f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        _require(self.num_heads % self.n_groups == 0,
                 f"{where}: num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")
        _require(self.conv_kernel >= 2, f"{where}.conv_kernel must be >= 2, got {self.conv_kernel}")
        _require(isinstance(self.conv_bias, bool), f"{where}.conv_bias must be true or false, got {self.conv_bias!r}")


@dataclass(frozen=True)
class KdaLayer(_Shaped):
    """Kimi Delta Attention (Kimi Linear's linear layers, reference/kda.py): the gated delta rule with a forget gate
    per key channel. q, k and v have ``num_heads`` heads each (of ``head_k_dim``, ``head_k_dim``, ``head_v_dim``), a
    causal conv of ``conv_kernel`` over them; ``lower_bound`` is the safe gate's bound (each token's log-decay in
    [lower_bound, 0], Ling V3's and Kimi K3's), None for Kimi Linear's standard gate; ``sharp_decay``: the model's
    decay rates ``A = exp(A_log)`` are drawn from Kimi Linear's initialisation range (``KDA_SHARP_NEG_A``), where a
    channel can forget most of its history in a token, instead of the mild range. Its inputs are what the model's
    projections emit: ``mixed_qkv`` (q|k|v), the raw forget gate ``a`` (``[T, H * K]``) and the raw step size ``b``
    (``[T, H]``). One setting of all of these per model."""

    layer_id: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    lower_bound: float | None = None
    sharp_decay: bool = False
    kind: str = field(default="kda", init=False)
    SHAPE = ("num_heads", "head_k_dim", "head_v_dim", "conv_kernel", "lower_bound", "sharp_decay")

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)

    @property
    def scale(self) -> float:
        return self.head_k_dim**-0.5

    def validate(self) -> None:
        where = f"layers[id={self.layer_id}]"
        for name in ("num_heads", "head_k_dim", "head_v_dim"):
            _require(getattr(self, name) >= 1, f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        _require(self.conv_kernel >= 2, f"{where}.conv_kernel must be >= 2, got {self.conv_kernel}")
        _require(self.lower_bound is None or (isinstance(self.lower_bound, (int, float)) and self.lower_bound < 0),
                 f"{where}.lower_bound must be a negative number or null, got {self.lower_bound!r}")
        _require(isinstance(self.sharp_decay, bool),
                 f"{where}.sharp_decay must be true or false, got {self.sharp_decay!r}")


# The draws of a KDA layer's gates (engine/materialize.py): A = exp(A_log) in [0.02, 0.5] per head, dt_bias ~ N(0, 0.5)
# and the raw gate ~ N(0, 1) per channel (as the gated delta rule's draws: decays near one, so a carried state
# matters), and the safe gate's bound the one Ling V3 and Kimi K3 ship. Sharp decays: A in Kimi Linear's initialisation
# range, [1, 16] (its A_log is log(uniform(1, 16))), where one token's log-decay reaches -16 * softplus(a + dt_bias).
KDA_NEG_A = (0.02, 0.5)
KDA_SHARP_NEG_A = (1.0, 16.0)
KDA_LOWER_BOUND = -5.0


# The draws of a Mamba-2 layer's time steps and decays (engine/materialize.py): raw dt in [-2, 0], dt_bias in [-1, 0],
# A in [-0.5, -0.02]. So a time step lies in [softplus(-3), softplus(0)] = [0.0486, 0.6931] and a token's decay
# exponent |dt * A| is at most 0.3466 (the tolerances read both). Trained models' time steps are smaller
# (dt_bias initialised for dt in [0.001, 0.1]); the float32 softplus of the kernels loses 2^-24 / dt of each
# (properties/tolerances.py), so the harness's smallest is kept where float32 can still be held to a tight bound.
MAMBA2_DT_RAW = (-2.0, 0.0)
MAMBA2_DT_BIAS = (-1.0, 0.0)
MAMBA2_NEG_A = (0.02, 0.5)
MAMBA2_MIN_DT = 0.048587
MAMBA2_MAX_DT_A = 0.3466

Layer = Union[MHALayer, MLALayer, LinearLayer, LightningLayer, ShortConvLayer, Mamba2Layer, KdaLayer]
_LAYER_TYPES = {"mha": MHALayer, "mla": MLALayer, "linear": LinearLayer, "lightning": LightningLayer,
                "short_conv": ShortConvLayer, "mamba2": Mamba2Layer, "kda": KdaLayer}
# Layers with a recurrent state per request (linear attention) instead of a KV cache: the gated delta rule
# ("linear", Qwen3-Next's GDN), lightning attention, the short convolution (a conv state only), the Mamba-2 mixer and
# Kimi Delta Attention. A hybrid model has one of them beside its full layers.
RECURRENT_KINDS = frozenset({"linear", "lightning", "short_conv", "mamba2", "kda"})


def is_recurrent(layer: Layer) -> bool:
    return layer.kind in RECURRENT_KINDS


def draft_prefix_columns(prefix_len: int, window: int, sink: int) -> list[int]:
    """The columns of a committed prefix of ``prefix_len`` tokens a draft step reads under a draft window of
    ``window`` tokens and ``sink`` attention sinks: every one without a window (0); with one, the first ``sink`` and
    the last ``window``, or every one where the prefix holds no more than both together."""
    if window <= 0 or prefix_len <= window + sink:
        return list(range(prefix_len))
    return list(range(sink)) + list(range(prefix_len - window, prefix_len))


# The speculative algorithms whose target verify a batch can carry (SGLang's SpeculativeAlgorithm): each hands the
# attention backend its own verify input (EagleVerifyInput, FrozenKVMTPVerifyInput, NgramVerifyInput,
# DFlashVerifyInput), which backends branch on; the attention they ask for is the same, a tree's (DFlash: a chain's).
VERIFY_ALGORITHMS = ("eagle", "frozen_kv_mtp", "ngram", "dflash")


@dataclass(frozen=True)
class SpecInput:
    """Speculative-decoding inputs.

    ``parents[i][j]`` is the parent of draft token j of request i in its draft tree (-1 for the root,
    which is token 0; a parent always precedes its child; in DRAFT_DECODE the forest of
    :func:`draft_forest`). ``accept_lens[i]`` is how many draft tokens
    verification accepted (a chain from the root): TARGET_VERIFY commits the linear-attention state at that
    position; DRAFT_EXTEND extends by exactly that many tokens.

    ``draft_window_size`` and ``draft_sink_size`` (DRAFT_DECODE only; SGLang's ``--speculative-draft-window-size``
    and ``--speculative-draft-sink-size``): with a window, each draft step reads of the committed prefix only its
    first ``draft_sink_size`` tokens and its last ``draft_window_size``, then its own branch's draft tokens, all of
    them (:meth:`draft_prefix_columns`); 0 reads the whole prefix. The target's verify is unaffected.

    ``algorithm`` (TARGET_VERIFY only; one of :data:`VERIFY_ALGORITHMS`): whose verify input the batch is. EAGLE and
    frozen-KV MTP verify topk-shaped trees; n-gram verifies the trees its corpus matches give (up to ``topk``
    children a node, as deep as the draft tokens allow: ``spec_steps`` is then ``draft_token_num - 1``); DFlash
    verifies one block, a chain, under the plain causal mask (no custom mask).
    """

    draft_token_num: int
    topk: int
    spec_steps: int
    parents: tuple[tuple[int, ...], ...]
    accept_lens: tuple[int, ...]
    draft_window_size: int = 0
    draft_sink_size: int = 0
    algorithm: str = "eagle"

    def draft_prefix_columns(self, prefix_len: int) -> list[int]:
        """The columns of a committed prefix of ``prefix_len`` tokens a draft step reads
        (:func:`draft_prefix_columns`)."""
        return draft_prefix_columns(prefix_len, self.draft_window_size, self.draft_sink_size)

    def depths(self, request: int) -> tuple[int, ...]:
        out: list[int] = []
        for p in self.parents[request]:
            out.append(0 if p < 0 else out[p] + 1)
        return tuple(out)

    def is_chain(self) -> bool:
        return all(tree == tuple(range(-1, len(tree) - 1)) for tree in self.parents)


@dataclass(frozen=True)
class ImageSpan:
    """An image of t x h x w tokens placed at token ``offset`` of request ``request``'s full sequence."""

    request: int
    offset: int
    t: int
    h: int
    w: int

    @property
    def num_tokens(self) -> int:
        return self.t * self.h * self.w


@dataclass(frozen=True)
class MropeLayout:
    """Multimodal RoPE: ``sections`` split rotary_dim // 2 into temporal, height and width parts."""

    sections: tuple[int, int, int]
    images: tuple[ImageSpan, ...] = ()


@dataclass(frozen=True)
class BatchSpec:
    """One forward batch, as pure data.

    ``prefix_lens[i]`` tokens of request i are already cached; ``extend_lens[i]`` new query rows follow.
    DECODE has extend_lens all 1; TARGET_VERIFY has extend_lens all ``spec.draft_token_num`` (the cached
    length is then what SGLang calls ``seq_lens``); DRAFT_EXTEND has extend_lens == ``spec.accept_lens``.
    EXTEND and MIXED batches may hold requests with an empty extend (``extend_lens[i] == 0`` after a cached
    prefix): engines' kernels expect them (SGLang's extend kernel counts ``max(0, extend_len)`` query tiles,
    kernels/ops/attention/extend_attention.py:191; its FlashInfer backend skips ``extend_len == 0`` rows,
    flashinfer_backend.py:2131), and a backend declares whether it takes them (``Capabilities.empty_extend``).
    ``kv_layout`` is one of :data:`KV_LAYOUTS`.
    DRAFT_DECODE runs the draft loop's ``spec.spec_steps - 1`` steps over one plan: extend_lens all
    ``topk * (spec_steps - 1)`` (every branch's token of every step, branch by branch, :func:`draft_forest`), and
    each request's cache row holds ``topk * spec_steps`` draft slots after its prefix, branch j's step s at column
    ``prefix + j * spec_steps + s`` (SGLang's layout; the last step's slots are allocated but never written).
    """

    mode: ForwardMode
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    layers: tuple[Layer, ...]
    page_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    context_len: int = 4096
    spec: SpecInput | None = None
    mrope: MropeLayout | None = None
    draft_worker: bool = False
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    state_slot_layout: str = "shuffled"  # one of STATE_SLOT_LAYOUTS
    kv_layout: str = "shuffled_pages"
    graph_padding: int = 0  # padded rows a CUDA-graph replay of this batch adds at least (MAX_GRAPH_PADDING)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ForwardMode(self.mode))
        object.__setattr__(self, "prefix_lens", tuple(int(x) for x in self.prefix_lens))
        object.__setattr__(self, "extend_lens", tuple(int(x) for x in self.extend_lens))
        object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def kv_lens(self) -> tuple[int, ...]:
        """Keys each request attends to once its new tokens are written (prefix + new)."""
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def keys_seen(self) -> tuple[int, ...]:
        """The most keys one query of each request attends to: its keys, or in a draft loop its prefix and one
        branch's tokens (a step sees its own branch only)."""
        if self.mode.is_draft_decode():
            return tuple(p + self.spec.spec_steps - 1 for p in self.prefix_lens)
        return self.kv_lens

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """SGLang's ``seq_lens``: cached + new, except in TARGET_VERIFY and DRAFT_DECODE, where drafts are not
        counted."""
        if self.mode.drafts_tree():
            return self.prefix_lens
        return self.kv_lens

    @property
    def cache_lens(self) -> tuple[int, ...]:
        """Tokens each request's cache row (``req_to_token``) holds once the batch's slots are allocated: its keys,
        or in DRAFT_DECODE the prefix and every branch's ``spec_steps`` draft slots."""
        if self.mode.is_draft_decode():
            s = self.spec
            return tuple(draft_region(p, self.page_size, s.topk, s.spec_steps, s.topk)[0] for p in self.prefix_lens)
        return self.kv_lens

    def new_token_columns(self, request: int) -> list[int]:
        """The cache-row column of each of ``request``'s new tokens, in row order: after its prefix in turn, or in
        DRAFT_DECODE branch j's step s after its region's tail (:func:`draft_region`: ``prefix + j * spec_steps + s``
        with pages of one token or one branch)."""
        p, e = self.prefix_lens[request], self.extend_lens[request]
        if not self.mode.is_draft_decode():
            return list(range(p, p + e))
        n, steps, topk = self.spec.spec_steps - 1, self.spec.spec_steps, self.spec.topk
        regions = [draft_region(p, self.page_size, topk, steps, j) for j in range(topk)]
        return [regions[r // n][0] + regions[r // n][1] + r % n for r in range(e)]

    def draft_tail_columns(self, request: int) -> list[tuple[list[int], list[int]]]:
        """(the prefix's last partial page's columns, a branch's tail columns that repeat it) for each draft branch
        past the first under SGLang's paged tree layout (:func:`draft_region`); empty elsewhere."""
        if not self.mode.is_draft_decode():
            return []
        p, s = self.prefix_lens[request], self.spec
        out = []
        for j in range(1, s.topk):
            start, tail = draft_region(p, self.page_size, s.topk, s.spec_steps, j)
            if tail:
                out.append((list(range(p - tail, p)), list(range(start, start + tail))))
        return out

    @property
    def full_attn_layers(self) -> tuple[int, ...]:
        """Layer ids that go to the full-attention backend of a hybrid model."""
        if self.draft_worker:
            return (0,)
        return tuple(layer.layer_id for layer in self.layers if not is_recurrent(layer))

    @property
    def num_model_layers(self) -> int:
        """Layers of the model the batch's layers belong to: ids run from 0 to the largest."""
        return max((layer.layer_id for layer in self.layers), default=0) + 1

    @property
    def mrope_sections(self) -> tuple[int, int, int] | None:
        """The model's mrope sections (None: plain RoPE)."""
        return None if self.mrope is None else self.mrope.sections

    @property
    def attention_kinds(self) -> frozenset[str]:
        return frozenset(layer.kind for layer in self.layers)

    def positions(self) -> list[int]:
        """Absolute position of each query row, computed from lengths alone (the reference's view)."""
        return list(self._positions)

    # A spec is frozen, so what is derived from it by Python loops over every token is computed once.
    @functools.cached_property
    def _positions(self) -> tuple[int, ...]:
        out: list[int] = []
        for i, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            if self.mode.drafts_tree():
                out.extend(p + d for d in self.spec.depths(i))
            else:
                out.extend(range(p, p + e))
        return tuple(out)

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        B = len(self.prefix_lens)
        _require(len(self.extend_lens) == B,
                 f"extend_lens has {len(self.extend_lens)} entries but prefix_lens has {B}")
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _require(self.state_slot_layout in STATE_SLOT_LAYOUTS,
                 f"state_slot_layout must be one of {', '.join(STATE_SLOT_LAYOUTS)}, got {self.state_slot_layout!r}")
        _require(self.kv_layout in KV_LAYOUTS,
                 f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {_show(self.kv_layout)}")
        _require(0 <= self.graph_padding <= MAX_GRAPH_PADDING,
                 f"graph_padding must be in [0, {MAX_GRAPH_PADDING}], got {self.graph_padding}")
        empty_ok = self.mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
        for i, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            _require(p >= 0, f"prefix_lens[{i}] must be >= 0, got {p}")
            if empty_ok:
                _require(e >= 0, f"extend_lens[{i}] must be >= 0, got {e}")
                _require(e >= 1 or p >= 1, f"request {i} has neither cached nor new tokens "
                                           f"(an empty extend needs prefix_lens[{i}] >= 1)")
            else:
                _require(e >= 1, f"extend_lens[{i}] must be >= 1 in {self.mode.value} batches, got {e}")
            _require(p + e <= self.context_len,
                     f"request {i}: prefix_lens + extend_lens = {p + e} exceeds context_len={self.context_len}")
        _require(len(self.layers) >= 1, "layers must name at least one layer")
        for layer in self.layers:
            layer.validate()
        self._validate_kv_cache()
        recurrent = sorted(self.attention_kinds & RECURRENT_KINDS)
        _require(len(recurrent) <= 1, f"layers of kinds {recurrent}: a hybrid model has one kind of linear attention")
        windows = sorted({l.sliding_window for l in self.layers if l.kind == "mha" and l.sliding_window})
        _require(len(windows) <= 1, f"layers use sliding windows {windows}: a model has one sliding window, "
                                    f"which each layer uses or not")
        ids = [layer.layer_id for layer in self.layers]
        if self.draft_worker:
            _require(all(i == 0 for i in ids) and not any(is_recurrent(l) for l in self.layers),
                     "draft_worker batches have only full-attention layers, all with layer_id 0")
        else:
            _require(len(set(ids)) == len(ids), f"layer ids must be distinct, got {ids}")
            _require(all(i >= 0 for i in ids), f"layer ids must be >= 0, got {ids}")
        self._validate_mode(B)
        if self.mrope is not None:
            self._validate_mrope()

    def _validate_kv_cache(self) -> None:
        if self.kv_cache_dtype == "auto":
            scaled = [l.layer_id for l in self.layers if l.kind == "mha" and (l.k_scale != 1.0 or l.v_scale != 1.0)]
            _require(not scaled, f"layers {scaled} have KV scales, which only an fp8 KV cache uses "
                                 f"(set kv_cache_dtype to fp8_e4m3, or the scales to 1)")
        else:
            _require(all(l.kind != "mla" for l in self.layers),
                     f"kv_cache_dtype {self.kv_cache_dtype} is modelled for MHA layers only (this batch has MLA layers)")

    def _validate_mode(self, B: int) -> None:
        m = self.mode
        if m.is_idle():
            _require(B == 0, f"an idle batch has no requests, got {B}")
            return
        _require(B >= 1, f"mode {m.value} needs at least one request")
        _require(self.num_tokens >= 1, f"a {m.value} batch needs at least one new token (every extend is empty)")
        if m.is_decode():
            _require(all(e == 1 for e in self.extend_lens), "decode batches have extend_lens all 1")
        if m.is_decode() or m.drafts_tree():
            # Decoding and verification always follow a prefill, so something is cached already.
            _require(all(p >= 1 for p in self.prefix_lens), f"{m.value} batches need prefix_lens >= 1")
        needs_spec = m.drafts_tree() or m.is_draft_extend()
        _require(needs_spec == (self.spec is not None),
                 f"spec (speculative inputs) is required for target_verify/draft_extend/draft_decode and only there; "
                 f"mode is {m.value}")
        if self.spec is None:
            return
        s = self.spec
        _require(s.draft_token_num >= 1 and s.topk >= 1 and s.spec_steps >= 1,
                 "spec.draft_token_num, spec.topk and spec.spec_steps must be >= 1")
        _require(len(s.parents) == B, f"spec.parents has {len(s.parents)} trees for {B} requests")
        _require(len(s.accept_lens) == B, f"spec.accept_lens has {len(s.accept_lens)} entries for {B} requests")
        _require(s.algorithm in VERIFY_ALGORITHMS,
                 f"spec.algorithm must be one of {', '.join(VERIFY_ALGORITHMS)}, got {_show(s.algorithm)}")
        _require(s.algorithm == "eagle" or m.is_target_verify(),
                 f"spec.algorithm {s.algorithm} is a target_verify batch's; the draft modes are EAGLE's (mode is "
                 f"{m.value})")
        if m.is_draft_decode():
            self._validate_draft_decode()
            return
        _require(s.algorithm != "dflash" or s.is_chain(),
                 "spec.algorithm dflash verifies one block, a chain: spec.parents must be chains (topk 1)")
        _require(s.draft_window_size == 0 and s.draft_sink_size == 0,
                 f"spec.draft_window_size and spec.draft_sink_size are the draft loop's (draft_decode batches); "
                 f"mode is {m.value}")
        for i, tree in enumerate(s.parents):
            _require(len(tree) == s.draft_token_num,
                     f"spec.parents[{i}] has {len(tree)} nodes, expected draft_token_num={s.draft_token_num}")
            _require(len(tree) >= 1 and tree[0] == -1, f"spec.parents[{i}] is not a tree: node 0 must be the root (-1)")
            for j, p in enumerate(tree[1:], start=1):
                _require(0 <= p < j, f"spec.parents[{i}][{j}]={p} is not a tree: a parent must be an earlier node")
            _require(max(s.depths(i)) <= s.spec_steps,
                     f"spec.parents[{i}] is deeper than spec_steps={s.spec_steps}")
        for i, a in enumerate(s.accept_lens):
            _require(1 <= a <= s.spec_steps + 1, f"spec.accept_lens[{i}]={a} must be in 1..spec_steps+1")
            if m.is_target_verify():
                _require(a <= max(s.depths(i)) + 1, f"spec.accept_lens[{i}]={a} is longer than the tree is deep")
        if m.is_target_verify():
            _require(all(e == s.draft_token_num for e in self.extend_lens),
                     "target_verify batches have extend_lens all equal to spec.draft_token_num")
            if self.attention_kinds & RECURRENT_KINDS:
                _require(s.is_chain(), "linear-attention layers verify chains only (topk=1): spec.parents must be chains")
        if m.is_draft_extend():
            _require(self.extend_lens == s.accept_lens, "draft_extend batches have extend_lens == spec.accept_lens")
            # EAGLE's draft extend after a verify (DRAFT_EXTEND_V2) extends what earlier steps cached, the prompt at
            # least (prepare_for_draft_extend: prefix_lens = seq_lens); the draft extend after a prefill is an EXTEND
            # batch (eagle_worker_v2.py _draft_extend_for_prefill). Not modelled: the window widened below the
            # boundary (num_front_tokens, the MTP boundary-KV fix), whose prefix seq_lens - front is clamped at 0
            _require(min(self.prefix_lens, default=1) >= 1,
                     "draft_extend batches extend a cached prefix in every request (the prompt at least): "
                     "prefix_lens >= 1")

    def _validate_draft_decode(self) -> None:
        s = self.spec
        _require(s.spec_steps >= 2, f"draft_decode batches need spec.spec_steps >= 2 (the draft loop runs "
                                    f"spec_steps - 1 steps), got {s.spec_steps}")
        forest = draft_forest(s.topk, s.spec_steps)
        _require(s.draft_token_num == len(forest),
                 f"draft_decode batches have spec.draft_token_num == topk * (spec_steps - 1) = {len(forest)}, "
                 f"got {s.draft_token_num}")
        _require(all(e == len(forest) for e in self.extend_lens),
                 f"draft_decode batches have extend_lens all topk * (spec_steps - 1) = {len(forest)}")
        for i, tree in enumerate(s.parents):
            _require(tuple(tree) == forest, f"spec.parents[{i}] must be draft_forest(topk, spec_steps): "
                                            f"{s.topk} branches of {s.spec_steps - 1} tokens each")
        _require(all(a == 1 for a in s.accept_lens), "draft_decode batches accept nothing: spec.accept_lens all 1")
        _require(s.draft_window_size >= 0 and s.draft_sink_size >= 0,
                 "spec.draft_window_size and spec.draft_sink_size must be >= 0")
        _require(s.draft_sink_size == 0 or s.draft_window_size > 0,
                 "spec.draft_sink_size needs spec.draft_window_size > 0 (SGLang's sink flag requires the window flag)")
        # SGLang turns the draft window off for a draft model with a sliding window of its own, whose window its
        # backends apply per layer (speculative/spec_utils.py resolve_draft_decode_window)
        _require(s.draft_window_size == 0 or all(getattr(l, "sliding_window", None) is None for l in self.layers),
                 "spec.draft_window_size applies to draft models without a sliding window of their own (SGLang "
                 "ignores the flag for one)")
        _require(not (self.attention_kinds & RECURRENT_KINDS),
                 "draft_decode batches have full-attention layers only (a draft model's)")
        _require(self.mrope is None, "mrope layouts are not modelled for draft_decode batches")
        for i, n in enumerate(self.cache_lens):
            _require(n <= self.context_len, f"request {i}: prefix_lens + topk * spec_steps draft slots = {n} exceeds "
                                            f"context_len={self.context_len}")

    def _validate_mrope(self) -> None:
        _require(not self.mode.is_target_verify(), "mrope layouts are not modelled for target_verify batches")
        sections = self.mrope.sections
        _require(len(sections) == 3 and all(x >= 0 for x in sections), f"mrope.sections must be 3 counts, got {sections}")
        for layer in self.layers:
            rot = layer.head_dim if layer.kind == "mha" else layer.qk_rope_head_dim if layer.kind == "mla" else None
            if rot is not None:
                _require(sum(sections) == rot // 2,
                         f"mrope.sections {sections} sum to {sum(sections)}, layer {layer.layer_id} needs {rot // 2}")
        for n, img in enumerate(self.mrope.images):
            _require(0 <= img.request < self.batch_size, f"mrope.images[{n}].request={img.request} out of range")
            _require(min(img.t, img.h, img.w) >= 1, f"mrope.images[{n}] must have t, h, w >= 1")
            _require(img.offset >= 0 and img.offset + img.num_tokens <= self.kv_lens[img.request],
                     f"mrope.images[{n}] does not fit inside request {img.request}'s sequence")
        spans = sorted((img.request, img.offset, img.offset + img.num_tokens) for img in self.mrope.images)
        for (r0, _, end0), (r1, start1, _) in zip(spans, spans[1:]):
            _require(r0 != r1 or start1 >= end0, f"mrope.images overlap in request {r1}")

    def mrope_positions(self) -> tuple[list[int], list[int], list[int]]:
        """The three mRoPE position rows (temporal, height, width) of each query row (Qwen2-VL rule).

        Text tokens take the next position on all three rows; an image of t x h x w tokens starting where
        the next position is s takes (s + ti, s + hi, s + wi), and the text after it resumes at
        s + max(t, h, w).
        """
        t, h, w = self._mrope_positions
        return list(t), list(h), list(w)

    @functools.cached_property
    def _mrope_positions(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        rows: tuple[list[int], list[int], list[int]] = ([], [], [])
        images = self.mrope.images if self.mrope is not None else ()
        for i, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            starts = {img.offset: img for img in images if img.request == i}
            seq: list[tuple[int, int, int]] = []
            nxt = 0
            while len(seq) < p + e:
                img = starts.get(len(seq))
                if img is None:
                    seq.append((nxt, nxt, nxt))
                    nxt += 1
                    continue
                for ti in range(img.t):
                    for hi in range(img.h):
                        for wi in range(img.w):
                            seq.append((nxt + ti, nxt + hi, nxt + wi))
                nxt += max(img.t, img.h, img.w)
            for r in range(3):
                rows[r].extend(pos[r] for pos in seq[p:p + e])
        return tuple(rows[0]), tuple(rows[1]), tuple(rows[2])

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        d["schema_version"] = SCHEMA_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), sort_keys=True)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "BatchSpec":
        """Decode a batch from JSON, checking every field's JSON type first, so a wrong type is one line
        naming the field (never a Python error from deeper down, nor a silently truncated number)."""
        if not isinstance(d, dict):
            raise SpecError(f"a batch specification is a JSON object, got {_json_type(d)}")
        d = dict(d)
        version = d.pop("schema_version", None)
        _require(version == SCHEMA_VERSION,
                 f"schema_version {version!r} is not supported (this harness reads version {SCHEMA_VERSION})")
        layers = []
        for n, ld in enumerate(_field(d, "layers", list)):
            _require(isinstance(ld, dict), f"layers[{n}] must be a JSON object, got {_json_type(ld)}")
            ld = dict(ld)
            kind = ld.pop("kind", None)
            _require(isinstance(kind, str) and kind in _LAYER_TYPES,
                     f"layers[{n}].kind must be one of {', '.join(_LAYER_TYPES)}, got {_show(kind)}")
            layers.append(_build(_LAYER_TYPES[kind], ld, f"layers[{n}]"))
        d["layers"] = tuple(layers)
        if d.get("spec") is not None:
            s = dict(_field(d, "spec", dict))
            s.setdefault("parents", [])
            s.setdefault("accept_lens", [])
            d["spec"] = _build(SpecInput, s, "spec")
        if d.get("mrope") is not None:
            m = dict(_field(d, "mrope", dict))
            m.setdefault("sections", [])
            images = m.get("images", [])
            _require(isinstance(images, list), f"mrope.images must be a JSON list, got {_json_type(images)}")
            for k, im in enumerate(images):
                _require(isinstance(im, dict), f"mrope.images[{k}] must be a JSON object, got {_json_type(im)}")
            m["images"] = tuple(_build(ImageSpan, dict(im), f"mrope.images[{k}]") for k, im in enumerate(images))
            d["mrope"] = _build(MropeLayout, m, "mrope")
        mode = d.get("mode")
        if not isinstance(mode, str) or mode not in {m.value for m in ForwardMode}:
            raise SpecError(f"mode must be one of {', '.join(m.value for m in ForwardMode)}, got {_show(mode)}")
        d["mode"] = ForwardMode(mode)
        return _build(cls, d, "batch")

    @classmethod
    def from_json(cls, text: str) -> "BatchSpec":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"not valid JSON: {e}") from None
        return cls.from_json_dict(d)


def _json_type(value: Any) -> str:
    """A value's type as JSON names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", tuple: "list", dict: "object"}.get(type(value), type(value).__name__)


def _show(value: Any, limit: int = 40) -> str:
    """A value for an error message, cut short (a bad field may hold a million entries)."""
    text = json.dumps(value) if value is None or isinstance(value, bool) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _field(d: dict, name: str, typ: type) -> Any:
    value = d.get(name)
    json_name = {list: "list", dict: "object"}.get(typ, typ.__name__)
    _require(isinstance(value, typ), f"{name} must be a JSON {json_name}, got {_json_type(value)}")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(value: Any, hint: Any, where: str) -> Any:
    """Check a JSON value against a field's annotation; JSON lists become tuples. Values already decoded
    (layers, spec, mrope, mode) pass through."""
    if hint is int:
        _require(isinstance(value, int) and not isinstance(value, bool),
                 f"{where} must be an integer, got {_show(value)}")
        return value
    if hint is float:
        _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                 f"{where} must be a number, got {_show(value)}")
        return value
    if hint is bool:
        _require(isinstance(value, bool), f"{where} must be true or false, got {_show(value)}")
        return value
    if hint is str:
        _require(isinstance(value, str), f"{where} must be a string, got {_show(value)}")
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        return _decode(value, options[0], where) if len(options) == 1 else value
    if origin is tuple:
        _require(isinstance(value, (list, tuple)), f"{where} must be a JSON list, got {_show(value)}")
        item = (lambda i: args[0]) if len(args) == 2 and args[1] is Ellipsis else \
            (lambda i: args[min(i, len(args) - 1)])
        return tuple(_decode(x, item(i), f"{where}[{i}]") for i, x in enumerate(value))
    return value


def _build(cls: type, d: dict, where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(d) - names - {"kind"})
    _require(not unknown, f"{where}: unknown field(s) {', '.join(unknown)}")
    hints = _hints(cls)
    d = {k: _decode(v, hints[k], f"{where}.{k}") for k, v in d.items() if k in names}
    try:
        return cls(**d)
    except TypeError as e:
        raise SpecError(f"{where}: {e}") from None
