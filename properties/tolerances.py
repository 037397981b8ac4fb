"""Every tolerance the harness uses, in one place, each with its reason.

Outputs are compared with a float64 reference computed from the same (dtype-rounded) inputs, so the only
error a correct backend may show is its own rounding. Let u be the unit roundoff of the input dtype
(2**-p for p bits of precision): bfloat16 2**-8, float16 2**-11, float32 2**-24. A kernel whose float32
matrix products run on TF32 tensor cores declares 2**-10 for them (``Capabilities.fp32_matmul_roundoff``: TF32
keeps 10 explicit mantissa bits, and Triton truncates an fp32 operand to them, triton-lang/triton#4574),
one using three-pass TF32 ("tf32x3": a = hi + lo, a.b ~ hi.hi + hi.lo + lo.hi, dropping lo.lo of relative
size 2**-22) declares 2**-21, and we use the larger of the two. These are the GPU's; on the CPU, Triton's
interpreter runs tl.dot as an exact float32 product, and a backend may declare that finer precision there
(``Capabilities.cpu_fp32_matmul_roundoff``), so CPU CI keeps its sensitivity instead of inheriting TF32's.

* Relative L2 error of a layer's output <= ``REL_L2_FACTOR * u + sqrt(L) * 2**-24``. Four roundings of
  relative size u sit between the reference and a correct kernel: q and k are rounded to the dtype after
  RoPE (the reference rotates in float64), the probabilities are rounded before the P.V product, and the
  output is rounded; each contributes at most u relative error to an output that is a convex combination
  of value rows. The second term is float32 accumulation in two chained reductions, with the sqrt(n)
  growth of random rounding: over the dot-product length D of each score (the head dim; the key dim of
  a recurrent state), then over the reduction length L (keys, or tokens of a recurrence). Without the D
  term float32 cases with one key failed by a hair (3.7e-7 against 3.0e-7) though every step rounded
  correctly: at u = 2**-24 the accumulation is the whole budget, so it must be counted in full. Measured on an H100 with bf16 inputs, correct
  kernels stay at 1.9e-3 .. 3.3e-3 (DESIGN.md), well inside 4u = 1.6e-2.
* A lightning (linear-attention) layer is handed float32 q/k/v by its model, so its bound is float32's whatever
  the batch's dtype (``input_dtype``), with its kernels' matrix-product precision (SGLang's seg_la: TF32 on
  NVIDIA GPUs, declared as 2**-10 because tensor cores truncate an fp32 operand to TF32). Its output is not a
  convex combination (scores are not normalised), but each path to it chains the same four operand roundings as
  softmax attention (q and k before the score product, the score and v before the value product; the carried
  state and the query for the state read), each a relative error of at most u of its term. For a signed sum
  that bounds the error relative to the terms' sizes, not to the sum. Independent roundings grow as the root
  sum of squares of the terms, as the sum itself does when nothing cancels, so 4u holds as it does for softmax
  attention; where the terms cancel (a short request whose q.k scores nearly vanish), the output is small beside
  them, and the bound is widened by ||RSS of the terms|| / ||output|| (``widen_for_cancellation``; the reference
  computes the RSS, ``term_magnitudes``), never narrowed. Without it a one-token request failed on the CPU at 1.06
  of float32's bound: its output 0.4e-6 off, and 10 times smaller than its terms (widened: 0.10). Measured on an
  H100: at most 1.1e-3 (80 lightning-only batches of every mode) against 4 * 2**-10 = 3.9e-3. A gated-delta-rule
  output is the same kind of signed sum, its state read ``scale * sum_k q_t[k] S_t[k, v]``, and is widened by
  the RSS of that read's terms (``read_magnitudes``): a float32 GDN token with no state, whose output
  ``beta (q.k) v`` cancels in q.k, came within 0.84 of its bound on the CPU (nightly sweep, seed 11).
  A short convolution (LFM2) is the smallest such sum, ``C * sum_j w_j (B x)_{t-j}`` over the kernel's W taps:
  three roundings in the model's dtype (``B * x`` before the conv, which is also what its state stores; the conv's
  output; the product with ``C``), each at most u of its term, and W float32 products accumulated (``D`` = W in the
  bound). Its terms' RSS (``reference/short_conv.py``, ``magnitudes``) widens it where the taps cancel.
  A Mamba-2 mixer (SSD) is held to the same operand roundings, widened by its state read's terms through the gate
  and the norm (``reference/mamba2.py``, ``magnitudes``), plus one term of its own: its chunked-scan kernels sum each
  chunk's decay exponents ``dt * A`` in float32 (a cumulative sum over up to ``chunk_size`` tokens) and take the
  exponential of their differences, so every decay factor carries an absolute exponent error, hence a relative
  error, of the float32 accumulation of up to ``chunk_size`` terms of size at most ``MAMBA2_MAX_DT_A`` (the draws'
  bound, batch/spec.py): with the sqrt(n) growth of random rounding, ``sqrt(chunk) * chunk * max|dt A| * 2**-24``,
  added to both bounds (``mamba2_decay_term``), states included. In bf16 it is a hundredth of u; in float32 on the
  CPU it is what lets a correct chunked scan pass (before it: outputs at 0.73 of float32's bound and a final SSM
  state at 1.14 of it, ci profile, chunks of 16 and 32 tokens, 25 examples a row). And the time steps: SGLang's SSD
  kernels take ``softplus(x) = log(exp(x) + 1)`` in float32 (kernels/ops/mamba/triton_ops/mamba_ssm.py:22-25, the
  form for Triton 3; ``log1p`` only before), and rounding ``exp(x) + 1`` leaves an absolute error of 2^-24 in the
  log: a relative error of ``2**-24 / dt`` in each token's time step, hence in its contribution to the state. With
  the draws' smallest step (``MAMBA2_MIN_DT``, 0.0486) that is 1.2e-6, added to both bounds; without it a one-token
  state came out 4.85e-8 off against a bound of 4.34e-8 (CPU, float32, the test suite's matrix row).
* Kimi Delta Attention (KDA) is held to the gated delta rule's bound, widened by its state read's terms as it is
  (``reference/kda.py``, ``read_magnitudes``), with one difference: SGLang's KDA chunk kernels cast their blocks
  to bfloat16 before the dots whatever the model's dtype (``fla/chunk_intra.py``, ``.to(tl.bfloat16)``), so a
  float16 model's KDA layers carry bfloat16's operand roundings. A backend declares that
  (``Capabilities.operand_roundoff``, 2**-8) and u is the larger of the two. Measured before the rows existed,
  fla's ``chunk_kda`` under the interpreter in float16 (one request, 17 to 130 tokens, K = V = 16 and 32): 5e-4 to
  7.9e-4 relative L2, above float16's u = 4.9e-4 and well inside bfloat16's.
* A kernel that computes the soft-cap's tanh as ``2*sigmoid(2x) - 1`` (declared:
  ``Capabilities.softcap_via_sigmoid``; SGLang's Triton kernels do) loses the small scores to cancellation:
  ``1 - ...`` of two float32 numbers near 1 leaves an absolute error of about 2u(float32) in tanh, so
  ``cap * tanh(s / cap)`` carries an absolute score error of about ``2 * cap * 2**-24``, and the output,
  a softmax average, inherits it as relative error. That term is added for soft-capped layers. It matters
  only for float32 inputs (cap 50: 6e-6 against 4u = 1.9e-6); in bf16 it is 600 times below u. Seen:
  SGLang's Triton at 2.5e-6 on a verify batch with cap 50, where TorchNative-style float32 attention is at
  1e-7.
* Each element's error <= ``(ELEMENT_FACTOR * u + (sqrt(L) + sqrt(D)) * 2**-24) * m``, where ``m`` is the
  magnitude of what that element is computed from. For softmax attention, ``o = sum_j p_j v_j`` and
  ``m = sum_j p_j |v_j|``, the probability-weighted magnitude of the values it averages, computed by the
  reference in float64 (``ReferenceResult.element_scales``). Every rounding scales with it, not with ``|o|``:
  the probabilities rounded before P.V move ``o`` by ``|sum_j p_j d_j v_j| <= u m`` (``|d_j| <= u``); the
  output's own rounding by ``u |o| <= u m``; q and k rounded after RoPE move each score by ``ds_j``, at most
  ``2u |q| |k| sm_scale`` (about 6u for the drawn scores, up to ~3), and so each ``p_j`` by
  ``p_j (ds_j - sum_i p_i ds_i)``, which moves ``o`` by at most ``2 max|ds| m`` (12u); float32 accumulation
  over L keys and D dims grows as sqrt(n) times 2**-24 of the terms summed, which are again ``p_j |v_j|``.
  That is at most 14u + the accumulation, within ``ELEMENT_FACTOR`` = 16. For MLA the values are
  ``v_j = ckv_j . w_vc`` and an absorbed kernel sums ``(sum_j p_j ckv_j) . w_vc``: ``m = sum_c (sum_j p_j
  |ckv_j[c]|) |w_vc[c]|``, the size of the terms of both products (never below the expanded form's
  ``sum_j p_j |v_j|``). Why not ``max|o|``, as before: over thousands of keys the output averages towards zero
  (values of random sign: ``|o| ~ m / sqrt(L)``) while each element's roundings stay of size ``u m``; a float32
  MLA batch over a 4096-token prefix (``tests/properties/test_precision.py``) failed that bound with a correct
  backend, though its relative L2 error was within its own. The relative L2 bound keeps ``||o||`` as its scale:
  independent roundings average out over the L terms as the output does (``~ u m / sqrt(L)`` per element), so
  its ``4u`` holds at every length, and only the accumulation grows, as its ``sqrt(L)`` term says. Where no
  reference magnitudes exist (linear-attention outputs and states, whose cancellation ``widen_for_cancellation``
  handles; a draft-tree node against its branch), ``m`` is ``max|expected|`` of the compared tensor.
  **Plus the scores' own rounding** (``Bound.score``, softmax layers): each score ``s_j = sm_scale * q . k_j`` is
  accumulated over D products in the kernel's float32 matrix arithmetic (``u``: its roundoff, 2**-24 in full float32,
  coarser where a GPU's dots run as TF32; whatever the model's dtype, since bf16 products are exact in float32).
  Recursive summation with independent roundings: ``|ds_j| <= lambda sqrt(D) u sm_scale sum_i |q_i k_ji|`` except with
  probability ``2 exp(-lambda^2 / 2)`` (Hoeffding over the D roundings, each at most ``u`` times a partial sum, itself
  at most ``sum_i |q_i k_ji| <= |q| |k_j|``). A score error moves each probability by ``p_j (ds_j - sum_i p_i ds_i)``
  and so an element by ``|sum_j p_j ds_j (v_j - o)| <= max_j |ds_j| sum_j p_j |v_j - o| <= 2 max_j |ds_j| m``. Hence
  ``+ 2 lambda sqrt(D) u S m``, with ``S = sm_scale |q| max_j |k_j|`` over the keys the row sees
  (``ReferenceResult.score_sizes``, float64) and ``lambda = SCORE_TAIL = 8`` (2.5e-14 a score: a union over 1e11
  scores, a campaign's worth, stays below 1e-2). Why it is needed: the term above counted the accumulation as
  ``sqrt(D) 2**-24`` of ``m``, as if every score were of size 1; scores are of size ``S`` (3 to 30 for the drawn
  q and k), and correct float32 code went past the old bound (a CPU campaign, 51,427 cases: our torch_native over
  D = 128, element error 7.3e-8 against 7.29e-8; before it, near misses at 0.5 to 0.86 of the bound in earlier sweeps
  ). The partial sums of random data grow as sqrt(D), not as D, so correct code now sits far below this term
  (that case: 0.005 of its bound). The relative L2 bound does not count this term yet: correct float32 code with
  scores of size ~30 (q and keys aligned) sits at 1.7 of it (``tests/properties/test_precision.py``), where the
  drawn batches never passed 0.42 in 63,444 CPU cases; the worst-case term above would loosen it a hundredfold, and
  a tight one (score errors common to every key cancel in the softmax) is still to be derived.
* Two backend runs that must agree (TBO split vs unsplit, graph replay vs eager, chunked vs whole
  prefill, verify of a chain vs extend) are each held to the reference bound; exact equality is not
  required since a split changes the kernels' tiling and so their rounding order.
* A draft-tree node and the same node at the end of its root-to-node chain (``tree_branch``,
  properties/tree.py) are two runs of one backend on bit-identical inputs: the same query and key rows
  rotated by the same positions, so the roundings of q and k after RoPE are shared and cancel. What is left
  is the order of each run's own work, which the tree's shape changes (which keys share a block, the
  running maximum when each block is folded in): the probabilities rounded to the dtype before the P.V
  product (each run within u of the exact ones, so within 2u of each other) and the output's rounding (u
  each, 2u apart), plus each run's float32 accumulation. Hence ``rel_l2 <= 2u + 2u + 2(sqrt(L) + sqrt(D))
  * 2**-24`` (the 4u has other terms than the reference bound's 4u: two roundings of two runs, not four of
  one), and the element bound ``ELEMENT_FACTOR * u`` as above with the accumulation counted twice. A kernel
  whose soft-cap tanh cancels (above) may round two scores that differ in their last bit differently: its
  ``2 * cap * 2**-24`` term is counted for each run.
* Cache writes are compared exactly: storing a tensor into a buffer of the same dtype must not change it.

An fp8 KV cache (``kv_cache_dtype`` fp8_e4m3) adds no tolerance: the rounding of storing is part of the
contract, not an error. e4m3 keeps 3 mantissa bits (unit roundoff u8 = 2**-4; normals from 2**-6 to 448,
subnormals spaced 2**-9), so rounding K and V to it moves each element by up to 6% and the output by several
percent: far above any dtype's u, and, as an allowance, wide enough to hide most bugs. So the reference
attends over exactly the values the cache holds, and the error a correct backend may show stays its own
arithmetic, under the bound above:

* The prefix the cache holds was rounded once, when the case was made; the reference reads those e4m3 values
  times the layer's scale, in float64.
* The new tokens: the model hands over K/V already on the e4m3 grid (``engine.model.on_fp8_grid``). Backends
  legitimately differ in whether a batch's new tokens are attended from the call's k/v (SGLang's Triton
  extend, FlashInfer's ragged path) or read back from the cache just written (TorchNative, FlashInfer's paged
  paths); on the grid both readings are the same numbers, so one reference serves every backend, and the
  chunked, split and graph equivalences (where a token moves from "new" to "cached") hold as they are. The
  reference computes those grid values itself: RoPE in float32 rounded to the dtype, as the model does, then
  rounded to e4m3; the cache property compares the stored bytes with them exactly.
* Scales are powers of two in [2**-6, 2**4] (batch.spec.KV_SCALE_RANGE): dividing by one and multiplying back
  is exact in every dtype, so the stored byte is unique whatever precision a backend divides in, dequantizing
  is exact, and no drawn value (|k| <= 6.2 after RoPE) reaches e4m3's saturation at 448.

A kernel that also *computes* in e4m3 (rounds q and the softmax probabilities P to e4m3 for its dot products,
as SGLang's Triton GQA decode and extend-prefix kernels do) is outside that contract: its q and P roundings are
of size u8 instead of u. With the four roundings of the bound above all at e4m3 precision the relative L2
error is at most ``REL_L2_FACTOR * u8 = 0.25`` (:data:`E4M3_ARITHMETIC_REL_L2`), for probabilities in e4m3's
normal range; a probability under 2**-6 (a key more than 4.2 nats below its row's maximum) rounds with an
absolute error up to 2**-10 instead, i.e. relative error up to 50% or a flush to zero, which no relative bound
covers. That envelope is what the known-failure ledger accepts as "e4m3 arithmetic" for SGLang's Triton
(docs/findings/sglang-triton-fp8-e4m3-arithmetic.md); it is never a tolerance of a row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from backends.registry import Composition
from batch.spec import (MAMBA2_MAX_DT_A, MAMBA2_MIN_DT, BatchSpec, Layer, LightningLayer, Mamba2Layer, MHALayer, MLALayer,
                        ShortConvLayer)

SCORE_TAIL = 8.0  # lambda: P(one score's rounding beyond lambda sqrt(D) u S) <= 2 exp(-lambda^2 / 2) ~ 2.5e-14
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
ACCUMULATION_ROUNDOFF = 2.0**-24  # float32 accumulators in every kernel and in the PyTorch backends
REL_L2_FACTOR = 4.0
ELEMENT_FACTOR = 16.0
E4M3_UNIT_ROUNDOFF = 2.0**-4  # 3 mantissa bits
E4M3_ARITHMETIC_REL_L2 = REL_L2_FACTOR * E4M3_UNIT_ROUNDOFF  # see the module docstring


@dataclass(frozen=True)
class Bound:
    rel_l2: float
    element: float  # multiplied by each element's magnitude m (module docstring), or max|expected| without one
    reason: str
    # Softmax layers: times each query row's score size S (ReferenceResult.score_sizes), added to ``element``
    # before both multiply m: the rounding of the scores themselves (module docstring)
    score: float = 0.0


def output_bound(dtype: str, reduction_len: int, fp32_matmul_roundoff: float = 2.0**-24,
                 inner_dim: int = 1, operand_roundoff: float = 0.0) -> Bound:
    """``reduction_len`` L: keys (or recurrence tokens) summed over; ``inner_dim`` D: the dot-product
    length of each score (the head dim, or the state's key dim of a recurrence); ``operand_roundoff``: operands the
    kernels round coarser than ``dtype`` whatever it is (module docstring)."""
    u = max(UNIT_ROUNDOFF[dtype], operand_roundoff)
    if dtype == "float32":
        u = max(u, fp32_matmul_roundoff)
    acc = (math.sqrt(max(reduction_len, 1)) + math.sqrt(max(inner_dim, 1))) * ACCUMULATION_ROUNDOFF
    return Bound(REL_L2_FACTOR * u + acc, ELEMENT_FACTOR * u + acc,
                 f"{dtype}: u={u:.3g}, L={reduction_len}, D={inner_dim}: rel_l2 <= {REL_L2_FACTOR:g}u + "
                 f"(sqrt(L)+sqrt(D))*2^-24, element <= ({ELEMENT_FACTOR:g}u + (sqrt(L)+sqrt(D))*2^-24) * m")


def with_score_term(bound: Bound, dot_len: int, roundoff: float) -> Bound:
    """``bound`` with each element's score term, ``2 SCORE_TAIL sqrt(D) u S`` times m (module docstring); ``u``: the
    kernels' float32 matrix-product roundoff, in which every score is accumulated whatever the model's dtype."""
    score = 2 * SCORE_TAIL * math.sqrt(max(dot_len, 1)) * roundoff
    return dataclasses.replace(bound, score=score, reason=f"{bound.reason} + {2 * SCORE_TAIL:g} sqrt(D) u_dot S * m "
                                                         f"(u_dot={roundoff:.3g})")


def layer_bound(composition: Composition, spec: BatchSpec, layer: Layer, device: str) -> Bound:
    """The output bound of one layer on ``device``: its dtype, the longest reduction, the kernels' matmul
    precision there."""
    support = composition.support()
    reduction = max(spec.keys_seen, default=1)
    roundoff = support.matmul_roundoff(layer.kind, device)
    bound = output_bound(input_dtype(spec, layer), reduction, roundoff, inner_dim=score_dot_len(layer),
                         operand_roundoff=support.operand_roundoff(layer.kind))
    if layer.kind in ("mha", "mla"):
        bound = with_score_term(bound, score_dot_len(layer), roundoff)
    if isinstance(layer, Mamba2Layer):
        extra = mamba2_decay_term(layer)
        bound = dataclasses.replace(bound, rel_l2=bound.rel_l2 + extra, element=bound.element + extra,
                                    reason=f"{bound.reason}; + (sqrt(chunk)*chunk*max|dt A| + 1/min dt)*2^-24 = "
                                           f"{extra:.2g} (the chunked scan's float32 decay exponents, chunk "
                                           f"{layer.chunk_size}, and its float32 softplus)")
    cap = getattr(layer, "logit_cap", None)
    if cap and support.softcap_via_sigmoid:
        extra = 2 * cap * ACCUMULATION_ROUNDOFF
        bound = dataclasses.replace(bound, rel_l2=bound.rel_l2 + extra, element=bound.element + extra,
                                    reason=f"{bound.reason}; + 2*cap*2^-24 = {extra:.2g} (soft-cap tanh via sigmoid, "
                                           f"cap {cap:g})")
    return bound


def mamba2_decay_term(layer: Mamba2Layer) -> float:
    """The float32 accumulation of a chunk's decay exponents, and the float32 softplus of each time step (module
    docstring)."""
    return (math.sqrt(layer.chunk_size) * layer.chunk_size * MAMBA2_MAX_DT_A + 1 / MAMBA2_MIN_DT) \
        * ACCUMULATION_ROUNDOFF


def widen_for_cancellation(bound: Bound, expected: torch.Tensor, magnitudes: torch.Tensor | None) -> Bound:
    """``bound`` times ||magnitudes|| / ||expected|| where that exceeds 1 (module docstring): ``magnitudes`` is
    the root sum of squares of the terms each element of ``expected`` sums (None: a layer whose outputs are
    convex combinations, which cannot cancel)."""
    if magnitudes is None or expected.numel() == 0:
        return bound
    size, norm = torch.stack([torch.linalg.vector_norm(magnitudes.to(torch.float64)),
                              torch.linalg.vector_norm(expected.to(torch.float64))]).tolist()
    if norm == 0.0 or size <= norm:
        return bound
    factor = size / norm
    return Bound(bound.rel_l2 * factor, bound.element * factor,
                 f"{bound.reason}; x{factor:.3g}: the terms' RSS over the output (cancellation)")


def input_dtype(spec: BatchSpec, layer: Layer) -> str:
    """The precision a layer's inputs reach the backend in: the batch's dtype, except for lightning layers,
    whose model hands q/k/v over in float32 (Bailing casts its projections, engine/model.py). The reference reads
    the same values (drawn in the batch's dtype), so only the backend's float32 arithmetic is left."""
    return getattr(layer, "compute_dtype", spec.dtype)


def score_dot_len(layer: Layer) -> int:
    """Length of the dot product behind each attention score (or each state read of a recurrence)."""
    if isinstance(layer, (MHALayer, LightningLayer)):
        return layer.head_dim
    if isinstance(layer, MLALayer):
        return layer.kv_lora_rank + layer.qk_rope_head_dim
    if isinstance(layer, ShortConvLayer):  # each output sums its kernel's taps
        return layer.conv_kernel
    if isinstance(layer, Mamba2Layer):  # the state read sums state_size products, the conv its taps
        return max(layer.state_size, layer.conv_kernel)
    return max(layer.head_k_dim, layer.conv_kernel)


BRANCH_ROUNDINGS = 2  # per run: the probabilities before P.V and the output (q, k are shared by both runs)


def branch_bound(composition: Composition, spec: BatchSpec, layer: Layer, device: str) -> Bound:
    """The bound between a draft-tree node's output and its branch's as a chain (module docstring): two
    runs of one backend on the same rotated inputs."""
    support = composition.support()
    dtype = input_dtype(spec, layer)
    u = max(UNIT_ROUNDOFF[dtype], support.operand_roundoff(layer.kind))
    if dtype == "float32":
        u = max(u, support.matmul_roundoff(layer.kind, device))
    runs = 2
    acc = runs * (math.sqrt(max(max(spec.keys_seen, default=1), 1)) + math.sqrt(score_dot_len(layer))) \
        * ACCUMULATION_ROUNDOFF
    rel = runs * BRANCH_ROUNDINGS * u + acc
    element = ELEMENT_FACTOR * u + acc
    reason = (f"{dtype}: u={u:.3g}: rel_l2 <= 2 runs x {BRANCH_ROUNDINGS} roundings x u + 2(sqrt(L)+sqrt(D))"
              f"*2^-24, element <= ({ELEMENT_FACTOR:g}u + the same accumulation) * max|out|")
    cap = getattr(layer, "logit_cap", None)
    if cap and support.softcap_via_sigmoid:
        extra = runs * 2 * cap * ACCUMULATION_ROUNDOFF
        rel, element = rel + extra, element + extra
        reason += f"; + 2 x 2*cap*2^-24 = {extra:.2g} (soft-cap tanh via sigmoid, cap {cap:g})"
    return Bound(rel, element, reason)
