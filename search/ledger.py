"""The known-failure ledger: disagreements with an engine that are triaged and reported upstream.

One reviewed file, ``docs/findings/known-failures.toml``. Each entry names a composition (a glob over the
term), the properties and modes where it shows, and a *condition*: a named predicate over the failing batch
and verdict, narrow enough that an unrelated failure in the same row is never taken for it. A failing case
that matches an entry is counted as known and the search goes on (so a second, new bug in the same row is
still found); every other failure fails as before. Each entry also names the shrunk case file that shows
it: when that case passes, the bug is fixed and the entry is stale, which fails the run
(``tests/test_ledger.py``, ``harness run``), so a fixed bug loses its entry.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

from batch.spec import BatchSpec, ForwardMode, is_recurrent
from batch.tbo_split import compute_split, two_chunk_split_enabled
from properties.tolerances import E4M3_ARITHMETIC_REL_L2, E4M3_UNIT_ROUNDOFF
from properties.verdict import Verdict

LEDGER = Path(__file__).resolve().parents[1] / "docs" / "findings" / "known-failures.toml"


def _layer_named(spec: BatchSpec, text: str):
    """The layer of ``spec`` that ``text`` names first ("layer N"), or None."""
    m = re.search(r"layer (\d+)", text)
    if m is None:
        return None
    return next((layer for layer in spec.layers if layer.layer_id == int(m.group(1))), None)


def _failing_layer(spec: BatchSpec, verdict: Verdict):
    return _layer_named(spec, verdict.where or "")


def _window_cuts_keys(spec: BatchSpec, verdict: Verdict) -> bool:
    """The worst element is in a layer whose sliding window is shorter than some request's keys."""
    layer = _failing_layer(spec, verdict)
    return (layer is not None and getattr(layer, "sliding_window", None) is not None
            and max(spec.keys_seen, default=0) > layer.sliding_window)


def _failing_token(verdict: Verdict) -> tuple[int, int] | None:
    """(request, token row within it) of the worst element, or None where the verdict names none."""
    m = re.search(r"request (\d+), (?:token|draft node) (\d+)", verdict.where or "")
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def _tree_window_by_row(spec: BatchSpec, verdict: Verdict) -> bool:
    """TARGET_VERIFY: the worst element is a draft token whose row in its tree is past its depth (a node off
    the tree's first chain), in a layer with a sliding window."""
    layer = _failing_layer(spec, verdict)
    found = _failing_token(verdict)
    if not spec.mode.is_target_verify() or found is None or getattr(layer, "sliding_window", None) is None:
        return False
    request, node = found
    return spec.spec.depths(request)[node] < node


def _failing_window_token(spec: BatchSpec, verdict: Verdict) -> tuple[int, int, int] | None:
    """(request, offset, window) of a verify or draft extend whose worst element is in a sliding-window layer: the
    failing token's offset past its request's prefix (a draft token's depth in its tree, an extend token's index),
    or None."""
    window = getattr(_failing_layer(spec, verdict), "sliding_window", None)
    found = _failing_token(verdict)
    if window is None or found is None or spec.spec is None:
        return None
    request, token = found
    if spec.mode.is_target_verify():
        return request, spec.spec.depths(request)[token], window
    if spec.mode is ForwardMode.DRAFT_EXTEND:
        return request, token, window
    return None


def _spec_window_unplanned(spec: BatchSpec, verdict: Verdict) -> bool:
    """A speculative batch on FlashInfer whose window was planned out (docs/findings/sglang-flashinfer-spec-window-
    unplanned.md), failing at a token its window does not hold all of: a tree-mask verify (EAGLE's, frozen-KV MTP's,
    n-gram's verify input) or a graphed draft extend is handed no start index for its request's trimmed keys, so any
    token, the first too, is wrong once its request's prefix and its offset pass the window. Its plan shows the same:
    a trimmed request's window list is not the last keys of its range (:func:`_window_list_not_last`)."""
    if spec.spec is not None and spec.spec.algorithm != "dflash" and _window_list_not_last(spec, verdict):
        return True
    found = _failing_window_token(spec, verdict)
    if found is None or spec.spec.algorithm == "dflash":
        return False
    request, offset, window = found
    return spec.prefix_lens[request] + offset > window


def _window_list_not_last(spec: BatchSpec, verdict: Verdict) -> bool:
    """A plan's window list of a request trimmed to fewer keys than its range holds, its range's first keys instead
    of its last (the metadata properties' words, properties/metadata.py: what a plan handed no start index lists), in
    a batch with a sliding-window layer."""
    return "window_kv_indices hold" in verdict.reason and "(its first ones)" in verdict.reason and \
        _has_window_layer(spec)


def _has_window_layer(spec: BatchSpec) -> bool:
    return any(getattr(layer, "sliding_window", None) is not None for layer in spec.layers)


def _dflash_verify_window_by_request(spec: BatchSpec, verdict: Verdict) -> bool:
    """DFlash's verify of a block under a window on FlashInfer: exactly the request-granular trim (the last
    ``min(prefix, window)`` cached keys, then the block causally): the block's root sees its own window; a token at
    depth d >= 1 sees up to d keys before it, once prefix + d > window."""
    found = _failing_window_token(spec, verdict)
    if found is None or spec.spec.algorithm != "dflash" or not spec.mode.is_target_verify():
        return False
    request, depth, window = found
    return depth >= 1 and spec.prefix_lens[request] + depth > window


def _mixed_two_chunk(spec: BatchSpec, verdict: Verdict) -> bool:
    """A MIXED batch whose extend lengths make SGLang's splitter choose a two-chunk cut."""
    return spec.mode is ForwardMode.MIXED and bool(spec.extend_lens) and two_chunk_split_enabled(list(spec.extend_lens))


def _tbo_linear_plain_cut(spec: BatchSpec) -> bool:
    """An extend batch with linear layers (GDN, lightning, ...) that SGLang's splitter cuts between requests (not
    two-chunk): its second half's linear kernels index their tokens with start locations that were not rebased."""
    if spec.mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or spec.batch_size < 2:
        return False
    if not any(is_recurrent(layer) for layer in spec.layers):
        return False
    if not two_chunk_split_enabled(list(spec.extend_lens)):
        return True
    # The two-chunk rule, but its cut falls between two requests (one-token extends, [1, 1, 1]: seen on the CPU,
    # the second half's query_start_loc [2, 3]): no request is chunked, and nothing rebases the half either
    split = compute_split(ForwardMode.EXTEND, list(spec.extend_lens))
    return split is not None and not split.two_chunk


def _tbo_linear_plain_split(spec: BatchSpec, verdict: Verdict) -> bool:
    """A plainly cut batch with linear layers (``_tbo_linear_plain_cut``), and the failure is in a linear layer: an
    out-of-bounds access by its kernels (GDN's conv, lightning's seg_la; the interpreter's bounds checker on the
    CPU, an illegal memory access on CUDA), its outputs, or Mamba-2's planning of the chunked scan over those start
    locations (an IndexError in Mamba2Metadata's chunk offsets, where a request carries a prefix)."""
    if not _tbo_linear_plain_cut(spec):
        return False
    layer = _failing_layer(spec, verdict)
    out_of_bounds = "OutOfBounds" in verdict.reason or "illegal memory access" in verdict.reason
    chunk_plan = "IndexError" in verdict.reason and "_query_start_loc_to_chunk_indices_offsets" in verdict.reason
    return out_of_bounds or chunk_plan or (layer is not None and is_recurrent(layer))


def _tbo_linear_stray_writes(spec: BatchSpec, verdict: Verdict) -> bool:
    """A plainly cut batch with linear layers (``_tbo_linear_plain_cut``) failing as stray writes make a batch fail
    on CUDA, wherever they land: a crash, a non-finite value, or a pool slot the case did not write changed (an
    H100 showed one of each). A wrong but finite output of a full layer is not taken for it."""
    if not _tbo_linear_plain_cut(spec):
        return False
    nonfinite = verdict.worst_error is not None and not math.isfinite(verdict.worst_error)
    return nonfinite or any(s in verdict.reason for s in ("crashed", "non-finite", "changed", "illegal memory access"))


def _layer_has_logit_cap(spec: BatchSpec, verdict: Verdict) -> bool:
    """The worst element is in a layer with a logit soft-cap."""
    layer = _failing_layer(spec, verdict)
    return layer is not None and getattr(layer, "logit_cap", None) is not None


def _layer_kv_scaled(spec: BatchSpec, verdict: Verdict) -> bool:
    """An fp8 KV cache, the worst element in a layer whose K or V scale is not 1."""
    layer = _failing_layer(spec, verdict)
    return spec.kv_cache_dtype != "auto" and layer is not None and layer.kind == "mha" \
        and (layer.k_scale != 1.0 or layer.v_scale != 1.0)


def _window_inside_extend(spec: BatchSpec, verdict: Verdict) -> bool:
    """The worst element is in a sliding-window layer and some request's new tokens reach further back than
    the window (a query at offset j of an extend sees new keys j - window .. j only if j > window)."""
    layer = _failing_layer(spec, verdict)
    window = getattr(layer, "sliding_window", None) if layer is not None else None
    return window is not None and max(spec.extend_lens, default=0) - 1 > window


def _draft_extend_window_layer(spec: BatchSpec, verdict: Verdict) -> bool:
    """A draft extend whose worst element is in a sliding-window layer, or whose plan has no window list: SGLang
    0.5.22's Triton draft-extend graph builds no window KV list
    (docs/findings/sglang-triton-draft-extend-graph-window.md). Compiled on a GPU, the kernel is handed that list as
    None and fails to compile at its window branch's index load (CompilationError: 'NoneType' object has no attribute
    'type'; an H200, 0.5.14), before any output exists."""
    if spec.mode is not ForwardMode.DRAFT_EXTEND:
        return False
    if "CompilationError" in verdict.reason and "SLIDING_WINDOW_SIZE" in verdict.reason:
        return _has_window_layer(spec)
    return _window_list_unplanned(spec, verdict) or \
        getattr(_failing_layer(spec, verdict), "sliding_window", None) is not None


def _window_list_unplanned(spec: BatchSpec, verdict: Verdict) -> bool:
    """The plan of a batch with sliding-window layers has a window indptr but no window list (the metadata properties'
    words, properties/metadata.py): the same missing list the outputs of a window layer show."""
    return "window_kv_indptr planned without window_kv_indices" in verdict.reason and _has_window_layer(spec)


def _tree_not_chain(spec: BatchSpec, verdict: Verdict) -> bool:
    """A verify batch with a draft tree that is not a chain (some node is not its predecessor's child)."""
    return spec.spec is not None and not spec.spec.is_chain()


def _leaf_lacks_verify_refresh(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on a leaf only because it leaves update_verify_buffers_to_fill_after_draft to the
    base class."""
    return list(verdict.details.get("hidden", ())) == ["update_verify_buffers_to_fill_after_draft"]


def _rel_l2(verdict: Verdict) -> float | None:
    """The failing comparison's relative L2 error, whichever check failed (an envelope of whole-tensor error, as the
    e4m3 ones below, is one of relative L2 error)."""
    return verdict.rel_l2 if verdict.rel_l2 is not None else verdict.worst_error


def _in_e4m3_kernel(spec: BatchSpec, verdict: Verdict) -> bool:
    """An fp8 KV cache and the worst element in a layer whose SGLang Triton kernel computes in e4m3 (it rounds q and P
    to e4m3 in its extend kernel and its GQA decode kernel; its decode kernel for one q head per kv head computes in
    q's dtype)."""
    layer = _failing_layer(spec, verdict)
    if spec.kv_cache_dtype != "fp8_e4m3" or layer is None or layer.kind != "mha" or _rel_l2(verdict) is None:
        return False
    # (a draft loop's steps run the same decode kernels)
    return not (spec.mode in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE)
                and layer.num_q_heads == layer.num_kv_heads)


def _e4m3_arithmetic(spec: BatchSpec, verdict: Verdict) -> bool:
    """In an e4m3 kernel (:func:`_in_e4m3_kernel`), an error within what e4m3 arithmetic explains
    (properties/tolerances.py)."""
    return _in_e4m3_kernel(spec, verdict) and _rel_l2(verdict) <= E4M3_ARITHMETIC_REL_L2


def _e4m3_decode_replay(spec: BatchSpec, verdict: Verdict) -> bool:
    """A decode replay against its eager twin in an e4m3 kernel: q rounded to e4m3 alike, the probabilities rounded
    to e4m3 within each KV split, and on a GPU the splits differ (get_num_kv_splits sizes them by the batch: a padded
    replay's, or a TBO child's, is not the eager batch's; triton_backend.py:431-480 in 0.5.23; on the CPU, without a
    device core count, they are fixed, and verify and extend replays run no split kernel, num_kv_splits None at
    :1059). Held to one e4m3 rounding (u), as XQA's replays are (:func:`_xqa_e4m3_decode`): 1.93e-2 measured at
    32769 keys (H200, harness-out/gpu109.sh), where the eager run was itself 3.5e-2 off the exact attention."""
    return (spec.mode in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE) and _in_e4m3_kernel(spec, verdict)
            and _rel_l2(verdict) <= E4M3_UNIT_ROUNDOFF)


def _xqa_e4m3_decode(spec: BatchSpec, verdict: Verdict) -> bool:
    """An fp8 KV cache, the worst element in an MHA layer of a decode (or of the decode step of a prefill-then-decode
    check), and an error within what e4m3 arithmetic explains: FlashInfer's XQA decode kernel, which SGLang's TRT-LLM
    MHA backend runs on SM90, computes q.K with q rounded to e4m3 and P.V with the probabilities scaled to e4m3's range
    and rounded, whatever the head grouping (docs/findings/sglang-trtllm-mha-xqa-fp8-e4m3-arithmetic.md)."""
    layer = _failing_layer(spec, verdict)
    if spec.kv_cache_dtype != "fp8_e4m3" or layer is None or layer.kind != "mha" or _rel_l2(verdict) is None:
        return False
    if spec.mode not in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE):  # a draft step is a decode, as XQA runs it
        # a chunked check's decode step is each request's last token; its first chunk ran fmha_v2, exact over the cache
        found = _failing_token(verdict)
        if "then decode" not in verdict.reason or found is None or found[1] != spec.extend_lens[found[0]] - 1:
            return False
    if verdict.property == "graph_replay":
        # A replay against its eager twin: the same inputs, q rounded to e4m3 alike in both, only the probabilities'
        # e4m3 roundings (scaled per split) differ: each within u of the exact, so the two within 2u at the very worst,
        # their signs independent. Held to u, not to the 0.25 envelope of either against the exact attention: 4 times
        # the largest gap measured (1.55e-2, H200, harness-out/gpu97.sh, gpu99.sh), and below what a replay that drops
        # one of each request's n keys moves it by (about 1/sqrt(n)) up to n ~ 256, which stays a finding
        return _rel_l2(verdict) <= E4M3_UNIT_ROUNDOFF
    return _rel_l2(verdict) <= E4M3_ARITHMETIC_REL_L2


def _flashmla_mixed_decode_kernel(spec: BatchSpec, verdict: Verdict) -> bool:
    """A MIXED batch that crashed in FlashMLA's forward_extend on the decode kernel's branch: its extend path is taken
    for ``ForwardMode.EXTEND`` only, so a mixed batch (planned by its FlashInfer MLA parent, a prefill plan) goes to
    the fixed-query decode branch, which first shapes the queries as ``bs`` equal windows (a ragged batch fails
    there) and then reads a block table the prefill plan has not (docs/findings/sglang-flashmla-mixed-crash.md)."""
    reason = verdict.reason
    crashed = ("object has no attribute 'block_kv_indices'" in reason
               or ("is invalid for input of size" in reason and "q.view(bs, -1, layer.tp_q_head_num" in reason))
    return (spec.mode is ForwardMode.MIXED and crashed and "flashmla_backend.py:" in reason
            and "in forward_extend" in reason)


def _draft_decode_window_layer(spec: BatchSpec, verdict: Verdict) -> bool:
    """A draft loop whose worst element is in a sliding-window layer, or whose step plans have no window list: up to
    0.5.22 SGLang's Triton draft steps plan no window KV list (docs/findings/sglang-triton-draft-decode-window.md), so
    a window layer reads an empty or stale one."""
    window_layer = getattr(_failing_layer(spec, verdict), "sliding_window", None) is not None
    return spec.mode is ForwardMode.DRAFT_DECODE and (window_layer or _window_list_unplanned(spec, verdict))


def _draft_steps_read_committed_prefix(spec: BatchSpec, verdict: Verdict) -> bool:
    """A draft loop whose every step was planned as exactly a decode over the committed prefix alone: SGLang's MLA
    draft containers plan each step as a plain decode over the draft batch's seq_lens (the lengths before the
    iteration's draft tokens), so every step misses its own key and its chain's earlier ones (docs/findings/
    sglang-mla-draft-steps-read-committed-prefix.md). Read from the step plans the failing property had
    (``draft_step_reads``, properties/metadata.py ``draft_plans_read``): a plan that reads anything else, a crash, or
    a property that kept no plans stays a finding."""
    return spec.mode is ForwardMode.DRAFT_DECODE and verdict.details.get("draft_step_reads") == "committed prefix"


def _draft_steps_cut_to_committed_prefix(spec: BatchSpec, verdict: Verdict) -> bool:
    """A replayed draft loop whose steps' key counts are the committed prefix's, their indices another layout's where
    a request's row starts after another's: FlashInfer MLA's replay plans host lengths from seq_lens_cpu over the
    container's per-step indices (docs/findings/sglang-mla-draft-steps-read-committed-prefix.md); the first request's
    row, or a lone request's, is exactly its committed prefix."""
    return spec.mode is ForwardMode.DRAFT_DECODE and \
        verdict.details.get("draft_step_reads") in ("committed prefix lengths", "committed prefix")


def _lightning_fp8_decode(spec: BatchSpec, verdict: Verdict) -> bool:
    """An fp8 KV cache, the worst element in a lightning layer of a decode batch (or of the decode step of a
    chunked or prefill-then-decode check), and an error within two e4m3 roundings: SGLang's lightning decode
    casts q to the KV cache's e4m3 and seg_la then writes its output in q's dtype (docs/findings/
    sglang-lightning-fp8-decode.md): q and the output each round with relative error up to 2^-4."""
    layer = _failing_layer(spec, verdict)
    if spec.kv_cache_dtype != "fp8_e4m3" or layer is None or layer.kind != "lightning" or _rel_l2(verdict) is None:
        return False
    decoding = spec.mode is ForwardMode.DECODE or "then decode" in verdict.reason
    state = any(s in (verdict.where or "") for s in ("ssm", "conv"))  # the cast leaves the state alone
    return decoding and not state and _rel_l2(verdict) <= 2 * E4M3_UNIT_ROUNDOFF


def _lightning_single_token_verify(spec: BatchSpec, verdict: Verdict) -> bool:
    """A verify of one token per request, failing in a lightning layer's states: seg_la_fwd picks its kernel from
    the tokens per request (one: the decode kernel), so it advances the committed state in place and records no
    per-step state (docs/findings/sglang-lightning-single-token-verify.md)."""
    if not spec.mode.is_target_verify() or spec.spec.draft_token_num != 1:
        return False
    text = f"{verdict.where or ''} {verdict.reason}"  # a cache verdict names the layer in its reason
    layer = _layer_named(spec, text)
    return layer is not None and layer.kind == "lightning" and "ssm" in text


def _tbo_verify_tensor_token_blocks(spec: BatchSpec, verdict: Verdict) -> bool:
    """A verify under TBO on a long-context server whose KV-index kernel would not compile: a TBO child's
    ``seq_lens_sum`` is a tensor, so the token-block count derived from it is one too, and Triton refuses it as
    the constexpr TOKEN_BLOCK_PARALLEL (docs/findings/sglang-tbo-verify-token-blocks-tensor.md)."""
    return (spec.mode.is_target_verify() and spec.context_len >= 32768
            and "UnsupportedLanguageConstruct" in verdict.reason and "TOKEN_BLOCK_PARALLEL" in verdict.reason)


def _idle_lightning_layer(spec: BatchSpec, verdict: Verdict) -> bool:
    """An idle batch of a model with lightning layers whose run crashed where SGLang's hybrid answers a linear
    layer of an idle batch from ``mixed_qkv``, which only GDN layers pass (docs/findings/
    sglang-hybrid-idle-lightning.md)."""
    # By mechanism, not line number (lines move every release): the AttributeError of ``mixed_qkv.new_empty`` in the
    # hybrid's forward. Its full-attention branch (``q.new_empty``) fails the same way for a different reason.
    reason = verdict.reason
    return (spec.mode is ForwardMode.IDLE and any(layer.kind == "lightning" for layer in spec.layers)
            and "AttributeError: 'NoneType' object has no attribute 'new_empty'" in reason
            and "hybrid_linear_attn_backend.py:" in reason and "mixed_qkv.new_empty(" in reason)


def _triton_reads_layer0_kv(spec: BatchSpec, verdict: Verdict) -> bool:
    """A lightning or LFM2 short-conv hybrid whose layer 0 is a linear layer (the models Triton's check does not
    recognise), crashed where SGLang's Triton backend asks the hybrid KV
    pool for layer 0's value buffer to learn the value head dim (docs/findings/sglang-triton-hybrid-layer0.md): by
    mechanism, the pool's refusal of a layer id that has no KV cache."""
    return (any(layer.layer_id == 0 and layer.kind in ("lightning", "short_conv") for layer in spec.layers)
            and "layer_id=0 not in full attention layers" in verdict.reason
            and "_transfer_full_attention_id" in verdict.reason)


# What SGLang 0.5.23's TboAttnBackend leaves to its base class although a child backend overrides it.
TBO_HIDDEN = {"update_verify_buffers_to_fill_after_draft", "needs_cpu_seq_lens", "support_triton",
              # and over SGLang's hybrid wrapper (docs/findings/sglang-tbo-hides-update-verify-buffers.md)
              "data_type", "kv_cache_dtype", "supports_ragged_verify_graph",
              "init_forward_metadata_for_breakable_cuda_graph_capture",
              "prepare_forward_metadata_for_breakable_cuda_graph_replay"}
HYBRID_HIDDEN = {"support_triton", "extend_attention_block_m"}  # docs/findings/sglang-hybrid-hides-*.md


def _only_known_hidden(verdict: Verdict, known: set[str]) -> set[str] | None:
    """The members conformance found hidden, if every one is in ``known`` and nothing else failed; else None."""
    hidden = set(verdict.details.get("hidden", ()))
    ok = bool(hidden) and hidden <= known and not verdict.details.get("other_problems")
    return hidden if ok else None


def _tbo_hides_known_overrides(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed only on members TboAttnBackend is known to leave to the base class (over SGLang's
    hybrid the case shows the hybrid's own known ones beside TBO's)."""
    hidden = _only_known_hidden(verdict, TBO_HIDDEN | HYBRID_HIDDEN)
    return hidden is not None and bool(hidden & TBO_HIDDEN)


def _hybrid_hides_known_overrides(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed only on members HybridLinearAttnBackend is known to leave to the base class."""
    return _only_known_hidden(verdict, HYBRID_HIDDEN) is not None


def _hybrid_hides_support_triton(spec: BatchSpec, verdict: Verdict) -> bool:
    """As above, support_triton among them (any full child that answers False: TorchNative, flex_attention)."""
    hidden = _only_known_hidden(verdict, HYBRID_HIDDEN)
    return hidden is not None and "support_triton" in hidden


# What SGLang's prefill/decode split (HybridAttnBackend, pd()) leaves to its base class or does not answer although
# a child has it: the same two members as its linear-attention sibling (docs/findings/sglang-pd-hides-*.md).
SPLIT_HIDDEN = {"support_triton", "extend_attention_block_m"}


def _split_hides_block_m(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed only on members the split is known to hide, its prefill Triton's BLOCK_M among them."""
    hidden = _only_known_hidden(verdict, SPLIT_HIDDEN)
    return hidden is not None and "extend_attention_block_m" in hidden


def _split_hides_support_triton(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed only on members the split is known to hide, support_triton among them."""
    hidden = _only_known_hidden(verdict, SPLIT_HIDDEN)
    return hidden is not None and "support_triton" in hidden


# What the wrappers of older releases also leave unreachable, each a ledger entry of its own with the releases it
# lives in (docs/findings/sglang-wrappers-hide-verify-buffers.md, sglang-tbo-hides-forward.md,
# sglang-tbo-lacks-probed-members.md). A verdict often shows several at once; each entry matches it when every
# member it lists is one of these and the entry's own member is among them.
VERIFY_BUFFERS = {"get_verify_buffers_to_fill_after_draft", "update_verify_buffers_to_fill_after_draft"}
TBO_PROBED = {"init_mha_chunk_metadata", "update_mamba_state_after_mtp_verify"}
INDEXER = {"get_indexer_metadata"}  # a sparse (NSA/DSA) child's; docs/findings/sglang-hybrid-hides-indexer-metadata.md
OLDER_HIDDEN = TBO_HIDDEN | HYBRID_HIDDEN | VERIFY_BUFFERS | TBO_PROBED | INDEXER | {"forward", "needs_cpu_seq_lens"}


def _hides_among_older(verdict: Verdict, own: set[str], known: set[str] = OLDER_HIDDEN) -> bool:
    hidden = _only_known_hidden(verdict, known)
    return hidden is not None and bool(hidden & own)


def _wrappers_hide_verify_buffers(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, one of the verify-buffer pair among them (a child
    may override only update_..., as AiterAttnBackend does, read at class level)."""
    return _hides_among_older(verdict, VERIFY_BUFFERS)


def _hybrid_hides_indexer_metadata(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, the sparse child's indexer metadata among them."""
    return _hides_among_older(verdict, INDEXER)


# What SGLang's three wrappers (TboAttnBackend, HybridLinearAttnBackend, HybridAttnBackend) leave to the base class
# although their FlashAttentionBackend child answers otherwise: capability flags and hooks whose base answer is the
# cautious one (docs/findings/sglang-wrappers-hide-flashattention-members.md).
FLASH_ATTENTION_MEMBERS = {"draft_extend_metadata_captured_in_graph", "supports_draft_extend_metadata_staging",
                           "supports_full_cuda_graph_chunked_prefix", "get_fused_kv_write_buffers",
                           "validate_elastic_cuda_graph_recapture"}


def _wrappers_hide_flash_attention_members(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, one of FlashAttention's among them."""
    return _hides_among_older(verdict, FLASH_ATTENTION_MEMBERS, OLDER_HIDDEN | FLASH_ATTENTION_MEMBERS)


def _flex_no_lowering_choice(spec: BatchSpec, verdict: Verdict) -> bool:
    """Inductor found no kernel to lower SGLang's compiled flex_attention to (CUDA, docs/findings/
    sglang-flex-cuda-compile-lowering.md): a crash with NoValidChoicesError whose target is flex_attention."""
    reason = verdict.reason
    return reason.startswith("crashed: InductorError") and "NoValidChoicesError" in reason \
        and "target: flex_attention" in reason


def _hybrid_lacks_mha_chunk(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, among them init_mha_chunk_metadata, which
    HybridLinearAttnBackend lacks before 0.5.13 while an MLA child (TRT-LLM, CUTLASS) has it."""
    return "HybridLinearAttnBackend" in verdict.reason and _hides_among_older(verdict, {"init_mha_chunk_metadata"})


def _tbo_hides_forward(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, ``forward`` among them (TboAttnBackend over
    SGLang's hybrid wrapper); or a linear layer of a batch TBO did not split reached the base class's forward,
    which wants q, k and v (RadixLinearAttention passes mixed_qkv)."""
    reason = verdict.reason
    return _hides_among_older(verdict, {"forward"}) or (
        "AttentionBackend.forward() missing 3 required positional arguments" in reason
        and "radix_linear_attention.py:" in reason)


def _trtllm_one_arg_mha_chunk(spec: BatchSpec, verdict: Verdict) -> bool:
    """A class-level row found TRT-LLM MLA's init_mha_chunk_metadata taking only the batch where SGLang's hybrid
    wrapper passes two; anything else it found hidden (under TBO) is among the wrappers' known ones."""
    hidden = set(verdict.details.get("hidden", ()))
    return ("TRTLLMMLABackend.init_mha_chunk_metadata(forward_batch) does not take the call" in verdict.reason
            and hidden <= OLDER_HIDDEN)


def _tbo_lacks_probed_members(spec: BatchSpec, verdict: Verdict) -> bool:
    """Conformance failed on members wrappers are known to hide, among them a hasattr-probed member that
    TboAttnBackend lacks and its hybrid child has (init_mha_chunk_metadata, update_mamba_state_after_mtp_verify)."""
    return _hides_among_older(verdict, TBO_PROBED)


def _tbo_mrope_unsliced(spec: BatchSpec, verdict: Verdict) -> bool:
    """A batch with M-RoPE positions whose TBO child batch kept the whole batch's (the adapter checks each child's
    per-token tensors against its token count: EngineBrokeInvariant)."""
    return "EngineBrokeInvariant" in verdict.reason and "did not slice mrope_positions" in verdict.reason


def _tbo_mixed_not_implemented(spec: BatchSpec, verdict: Verdict) -> bool:
    """A MIXED batch under TBO crashed in SGLang's splitter, which has no MIXED branch."""
    return (spec.mode is ForwardMode.MIXED and "NotImplementedError" in verdict.reason
            and "in compute_split_seq_index" in verdict.reason)


def _draft_worker_misrouted(spec: BatchSpec, verdict: Verdict) -> bool:
    """A draft worker's batch (its one full-attention layer has id 0) whose layer reached the hybrid's linear
    backend: the GDN backend's assertion on the missing mixed_qkv, the lightning backend's seg_la unpacking the full
    layer's flat q as [T, H, D] (seen on an H200, 0.5.10), an LFM2 hybrid's Mamba2AttnBackend refusing a forward it
    never serves (0.5.10, CPU), the KDA backend reading the full layer's conv weights or q width, which a
    RadixAttention has not (0.5.10, CPU), or dispatch seeing the misroute."""
    reason = verdict.reason
    return spec.draft_worker and ("assert isinstance(mixed_qkv, torch.Tensor)" in reason
                                  or ("'RadixAttention' object has no attribute" in reason
                                      and ("'conv_weights'" in reason or "'q_dim'" in reason))
                                  or ("seg_la" in reason and "not enough values to unpack" in reason)
                                  or "Mamba2AttnBackend's forward is called directly" in reason
                                  or ("reached the wrong backend" in reason and "linear got [0]" in reason))


def _conv_state_by_request_row(spec: BatchSpec, verdict: Verdict) -> bool:
    """The disagreement is in a short-conv layer: its output or its conv state off (the worst element's layer), or
    a conv-state slot outside the batch written (the cache property names the layer). SGLang's LFM2 conv layer up to
    0.5.21 reads and writes the state pool at each request's req_to_token row, not its state slot, and never reads
    a cached prefix's state (docs/findings/sglang-lfm2-conv-state-by-request-row.md)."""
    layer = _failing_layer(spec, verdict)
    if layer is not None:
        return layer.kind == "short_conv"
    m = re.search(r"layer (\d+) conv_states", verdict.reason)
    return m is not None and any(l.layer_id == int(m.group(1)) and l.kind == "short_conv" for l in spec.layers)


def _captured_in_prefill_graph(kind: str) -> Callable[[BatchSpec, Verdict], bool]:
    """A breakable prefill graph's capture counted no eager break for a layer, and every such layer is of ``kind``.
    LFM2's conv layer marks none (models/lfm2.py, Lfm2ShortConv.forward), nor do Granite 4.0-H's and Falcon-H1's
    mamba layers (Mamba2AttnBackend.forward called directly): their kernels are captured with the capture batch's
    metadata and replayed on every batch (docs/findings/sglang-lfm2-conv-captured-in-prefill-graph.md,
    sglang-mamba2-mixer-captured-in-prefill-graph.md). A layer of another kind that does not break, or one that
    breaks twice, is another bug and stays a finding."""
    def condition(spec: BatchSpec, verdict: Verdict) -> bool:
        unbroken = re.findall(r"layer (\d+) \((\w+)\) took (\d+)", verdict.reason)
        return bool(unbroken) and all(k == kind and breaks == "0" for _, k, breaks in unbroken)
    return condition


def _kda_in_graph_beta(spec: BatchSpec, verdict: Verdict) -> bool:
    """A breakable prefill graph whose capture ran the KDA extend inside the graph (``details["in_graph"]``), and
    whose replay of an extend disagrees with the eager run in a KDA layer: its output ("replay layer N") or its
    recurrent state ("replay pool ssmN"; beta never reaches the conv state, which the conv kernel writes before beta
    is read). SGLang 0.5.22 and 0.5.23 run that extend inside the graph (linear/kda_prefill_graph.py,
    ``kda_extend_in_graph``) and tell the chunk kernel beta is raw only where the forget gate comes flat
    (``beta_is_raw=gate_was_flat``, ``a.ndim == 3``); Kimi Linear's layer hands a raw beta with a [1, T, H, K] gate,
    and the eager path says raw always, so replays skip beta's sigmoid
    (docs/findings/sglang-kda-prefill-graph-beta-not-raw.md). Where KDA breaks out of the graph instead (a release
    without the contract, ``SGLANG_DISABLE_KDA_PREFILL_GRAPH_EXTEND``), a disagreement is another bug."""
    if spec.mode is not ForwardMode.EXTEND or "kda" not in verdict.details.get("in_graph", ()):
        return False
    m = re.match(r"replay(?: with new inputs)? (?:layer |pool ssm)(\d+)\b", verdict.where or "")
    return m is not None and any(layer.layer_id == int(m.group(1)) and layer.kind == "kda" for layer in spec.layers)


def _kda_chunk_decay(spec: BatchSpec, verdict: Verdict) -> bool:
    """The disagreement is in a KDA layer of a batch with a request of two or more new tokens (a chunked prefill
    decays them against each other): up to 0.5.21 SGLang's Triton chunk kernels take the chunk's cumulative gate in
    natural-log units in some stages and as base 2 in others (docs/findings/sglang-kda-chunk-mixed-exp-bases.md)."""
    layer = _failing_layer(spec, verdict)
    return layer is not None and layer.kind == "kda" and max(spec.extend_lens, default=0) >= 2


def _kda_sharp_decay_in_chunk(spec: BatchSpec, verdict: Verdict) -> bool:
    """The disagreement is in a KDA layer with sharp decays and the standard gate, in a batch with a request of two or
    more new tokens, on SGLang's fused intra-chunk path (chosen where the chunks times heads, B * NT * H, are at most
    256; chunks of 64 tokens, per request): that kernel clamps its base-2 decay factors at +-126, so a channel that
    decays by more than 2^126 inside a 16-token sub-block reads forgotten keys at full weight (the safe gate keeps
    each token's decay above 2^-7.2; docs/findings/sglang-kda-fused-intra-clamp.md)."""
    layer = _failing_layer(spec, verdict)
    if layer is None or layer.kind != "kda" or not layer.sharp_decay or layer.lower_bound is not None:
        return False
    chunks = sum(-(-n // 64) for n in spec.extend_lens)
    return max(spec.extend_lens, default=0) >= 2 and chunks * layer.num_heads <= 256


def _spec_states_on_cuda(spec: BatchSpec, verdict: Verdict) -> bool:
    """A draft-token batch of a model with GDN or lightning layers crashed building its state pool on a CPU: the
    pool allocates its per-draft-token states on "cuda" (MambaPool.__init__)."""
    frames = verdict.details.get("traceback", ())
    return ("Torch not compiled with CUDA enabled" in verdict.reason
            and any("mem_cache/memory_pool.py" in f and f.endswith("in __init__") for f in frames))


CONDITIONS: dict[str, Callable[[BatchSpec, Verdict], bool]] = {
    "layer_kv_scaled": _layer_kv_scaled,
    "window_cuts_keys": _window_cuts_keys,
    "wrappers_hide_verify_buffers": _wrappers_hide_verify_buffers,
    "hybrid_hides_indexer_metadata": _hybrid_hides_indexer_metadata,
    "hybrid_lacks_mha_chunk": _hybrid_lacks_mha_chunk,
    "tbo_hides_forward": _tbo_hides_forward,
    "tbo_lacks_probed_members": _tbo_lacks_probed_members,
    "tbo_mrope_unsliced": _tbo_mrope_unsliced,
    "tbo_mixed_not_implemented": _tbo_mixed_not_implemented,
    "draft_worker_misrouted": _draft_worker_misrouted,
    "kda_chunk_decay": _kda_chunk_decay,
    "kda_sharp_decay_in_chunk": _kda_sharp_decay_in_chunk,
    "spec_states_on_cuda": _spec_states_on_cuda,
    "mixed_two_chunk": _mixed_two_chunk,
    "tbo_hides_known_overrides": _tbo_hides_known_overrides,
    "hybrid_hides_known_overrides": _hybrid_hides_known_overrides,
    "hybrid_hides_support_triton": _hybrid_hides_support_triton,
    "tbo_linear_plain_split": _tbo_linear_plain_split,
    "trtllm_one_arg_mha_chunk": _trtllm_one_arg_mha_chunk,
    "layer_has_logit_cap": _layer_has_logit_cap,
    "window_inside_extend": _window_inside_extend,
    "spec_window_unplanned": _spec_window_unplanned,
    "dflash_verify_window_by_request": _dflash_verify_window_by_request,
    "tree_not_chain": _tree_not_chain,
    "leaf_lacks_verify_refresh": _leaf_lacks_verify_refresh,
    "wrappers_hide_flash_attention_members": _wrappers_hide_flash_attention_members,
    "flex_no_lowering_choice": _flex_no_lowering_choice,
    "e4m3_arithmetic": _e4m3_arithmetic,
    "e4m3_decode_replay": _e4m3_decode_replay,
    "xqa_e4m3_decode": _xqa_e4m3_decode,
    "flashmla_mixed_decode_kernel": _flashmla_mixed_decode_kernel,
    "tree_window_by_row": _tree_window_by_row,
    "lightning_fp8_decode": _lightning_fp8_decode,
    "idle_lightning_layer": _idle_lightning_layer,
    "lightning_single_token_verify": _lightning_single_token_verify,
    "tbo_verify_tensor_token_blocks": _tbo_verify_tensor_token_blocks,
    "tbo_linear_stray_writes": _tbo_linear_stray_writes,
    "draft_extend_window_layer": _draft_extend_window_layer,
    "draft_decode_window_layer": _draft_decode_window_layer,
    "draft_steps_read_committed_prefix": _draft_steps_read_committed_prefix,
    "draft_steps_cut_to_committed_prefix": _draft_steps_cut_to_committed_prefix,
    "triton_reads_layer0_kv": _triton_reads_layer0_kv,
    "conv_state_by_request_row": _conv_state_by_request_row,
    "conv_layer_captured_in_prefill_graph": _captured_in_prefill_graph("short_conv"),
    "mamba_mixer_captured_in_prefill_graph": _captured_in_prefill_graph("mamba2"),
    "kda_in_graph_beta": _kda_in_graph_beta,
    "split_hides_block_m": _split_hides_block_m,
    "split_hides_support_triton": _split_hides_support_triton,
}


def _extend_with(spec: BatchSpec, kind: str) -> bool:
    return spec.mode is ForwardMode.EXTEND and any(layer.kind == kind for layer in spec.layers)


def _window_layers(spec: BatchSpec) -> list[int]:
    return [w for w in (getattr(layer, "sliding_window", None) for layer in spec.layers) if w is not None]


def _window_offsets_pass(spec: BatchSpec, least_offset: int = 0) -> bool:
    """Some request's prefix and furthest token offset (a verify's deepest draft token, an extend's last token), at
    least ``least_offset``, pass a window layer's window."""
    windows = _window_layers(spec)
    if not windows or spec.spec is None:
        return False
    for r, prefix in enumerate(spec.prefix_lens):
        furthest = max(spec.spec.depths(r), default=0) if spec.mode.is_target_verify() else spec.extend_lens[r] - 1
        if furthest >= least_offset and prefix + furthest > min(windows):
            return True
    return False


# What a batch must have for an entry's bug to show, read from the batch alone (a condition also reads the verdict:
# where the worst element is, what crashed). Once a row has met an entry, the rest of its search steers away from
# batches that have it (search/search_row.py): a known bug then stops taking the row's draws. Conditions without a
# batch-only form are not steered, nor those that bound an error (e4m3 arithmetic): their batches can hold a new,
# larger bug too.
COULD_SHOW = {
    "layer_has_logit_cap": lambda spec: any(getattr(layer, "logit_cap", None) is not None for layer in spec.layers),
    "window_inside_extend": lambda spec: any(max(spec.extend_lens, default=0) - 1 > w for w in _window_layers(spec)),
    "spec_window_unplanned": lambda spec: spec.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
    and spec.spec.algorithm != "dflash" and _window_offsets_pass(spec),
    "dflash_verify_window_by_request": lambda spec: spec.mode.is_target_verify() and spec.spec.algorithm == "dflash"
    and _window_offsets_pass(spec, least_offset=1),
    "draft_extend_window_layer": lambda spec: spec.mode is ForwardMode.DRAFT_EXTEND and bool(_window_layers(spec)),
    "draft_decode_window_layer": lambda spec: spec.mode is ForwardMode.DRAFT_DECODE and bool(_window_layers(spec)),
    "tree_not_chain": lambda spec: spec.spec is not None and not spec.spec.is_chain(),
    "mixed_two_chunk": lambda spec: _mixed_two_chunk(spec, None),
    "tbo_verify_tensor_token_blocks": lambda spec: spec.mode.is_target_verify() and spec.context_len >= 32768,
    "layer_kv_scaled": lambda spec: spec.kv_cache_dtype != "auto" and any(
        layer.kind == "mha" and (layer.k_scale != 1.0 or layer.v_scale != 1.0) for layer in spec.layers),
    "window_cuts_keys": lambda spec: any(max(spec.keys_seen, default=0) > w for w in _window_layers(spec)),
    "tbo_linear_plain_split": lambda spec: _tbo_linear_plain_cut(spec),
    "tbo_linear_stray_writes": lambda spec: _tbo_linear_plain_cut(spec),
    "tbo_mrope_unsliced": lambda spec: spec.mrope is not None,
    # Every extend through a prefill graph with such a layer: once met, the row's other draws are not run
    "conv_layer_captured_in_prefill_graph": lambda spec: _extend_with(spec, "short_conv"),
    "mamba_mixer_captured_in_prefill_graph": lambda spec: _extend_with(spec, "mamba2"),
    "kda_in_graph_beta": lambda spec: _extend_with(spec, "kda"),
}


class LedgerError(ValueError):
    """A malformed ledger entry."""


@dataclass(frozen=True)
class KnownFailure:
    id: str
    composition: str  # glob over composition terms, e.g. "sglang.triton"
    properties: tuple[str, ...]
    modes: tuple[str, ...]  # empty: every mode
    condition: str  # a key of CONDITIONS
    case: str  # the shrunk case file that shows it, relative to the repository root
    upstream: str
    reason: str
    triage: str  # the docs/findings/ page
    devices: tuple[str, ...] = ()  # empty: every device
    # Its kernels write outside their tensors: a matching case leaves the process's memory suspect, so the row goes
    # on in a fresh process (as after a lost CUDA context)
    corrupts_process: bool = False
    # The id of the entry whose case shows this bug fixed, where this entry's own case cannot (its symptom
    # depends on what lies where in GPU memory): tests/test_ledger.py replays that one instead
    stale_with: str | None = None
    # The engine releases its case was seen failing on (a checkout of main is named by the version it reports);
    # empty: not recorded.
    seen_in: tuple[str, ...] = ()
    # The first release where its case passes. On it and later the entry explains nothing (the same failure there
    # is a regression, a finding), and its case must pass: tests/test_ledger.py replays it as the fix's test.
    fixed_in: str | None = None

    def applies_to(self, version: str | None) -> bool:
        """Whether the bug lives in ``version`` of the engine (None: not installed, or not known)."""
        if self.fixed_in is None or version is None:
            return True
        from backends.sglang.features import version_key

        return version_key(version) < version_key(self.fixed_in)

    def covers(self, composition: str, mode: str, prop: str) -> bool:
        return prop in self.properties and self._batches_of(composition, mode)

    def _batches_of(self, composition: str, mode: str) -> bool:
        """Whether ``composition``'s batches of ``mode`` are among this entry's."""
        return fnmatch.fnmatchcase(composition, self.composition) and (not self.modes or mode in self.modes)

    def matches(self, composition: str, mode: str, prop: str, spec: BatchSpec, verdict: Verdict,
                device: str) -> bool:
        return (not verdict.ok and self.covers(composition, mode, prop) and self.applies_to(engine_version())
                and (not self.devices or device in self.devices) and CONDITIONS[self.condition](spec, verdict))

    @property
    def steerable(self) -> bool:
        """Whether a search can steer away from this entry's batches (its condition has a batch-only form)."""
        return self.condition in COULD_SHOW

    def reaches(self, composition: str, mode: str, spec: BatchSpec, device: str) -> bool:
        """Whether running ``spec`` on ``composition`` meets this entry's bug, whichever property ran it and whether
        it failed (a stray write need not fail the property that ran): the entry's compositions, modes, devices and
        releases, and a batch its condition could show (False for an entry that is not steerable)."""
        return (self._batches_of(composition, mode) and (not self.devices or device in self.devices)
                and self.applies_to(engine_version()) and self.could_show(spec))

    def could_show(self, spec: BatchSpec) -> bool:
        """Whether ``spec`` has what this entry's bug needs (False for an entry that is not steerable)."""
        return self.steerable and COULD_SHOW[self.condition](spec)

    @property
    def case_path(self) -> Path:
        return LEDGER.parents[2] / self.case


def parse_ledger(text: str) -> list[KnownFailure]:
    entries = []
    for i, d in enumerate(tomllib.loads(text).get("known", [])):
        optional = {"modes", "devices", "corrupts_process", "stale_with", "seen_in", "fixed_in"}
        fields = {"id", "composition", "properties", "condition", "case", "upstream", "reason", "triage"} | optional
        missing, unknown = fields - optional - set(d), set(d) - fields
        if missing or unknown:
            raise LedgerError(f"known[{i}]: missing {sorted(missing)} / unknown {sorted(unknown)} field(s)")
        devices = d.get("devices", [])
        if not isinstance(devices, list) or not set(devices) <= {"cpu", "cuda"}:
            raise LedgerError(f"known[{i}] ({d['id']}): devices must be a list of cpu/cuda, got {devices!r}")
        if d["condition"] not in CONDITIONS:
            raise LedgerError(f"known[{i}] ({d['id']}): unknown condition {d['condition']!r}; "
                              f"known: {', '.join(CONDITIONS)}")
        seen_in = d.get("seen_in", [])
        from backends.sglang.features import version_key

        fixed_in = d.get("fixed_in")
        for v in seen_in if isinstance(seen_in, list) else [seen_in]:
            try:
                version_key(str(v))
            except ValueError:
                raise LedgerError(f"known[{i}] ({d['id']}): seen_in must list release versions, got {v!r}") from None
        if fixed_in is not None:
            try:
                version_key(str(fixed_in))
            except ValueError:
                raise LedgerError(f"known[{i}] ({d['id']}): fixed_in must be a release version, got {fixed_in!r}") \
                    from None
            if any(version_key(v) >= version_key(fixed_in) for v in seen_in):
                raise LedgerError(f"known[{i}] ({d['id']}): seen_in names a release at or after fixed_in {fixed_in}")
        entries.append(KnownFailure(d["id"], d["composition"], tuple(d["properties"]), tuple(d.get("modes", ())),
                                    d["condition"], d["case"], d["upstream"], d["reason"], d["triage"],
                                    tuple(devices), bool(d.get("corrupts_process", False)), d.get("stale_with"),
                                    tuple(seen_in), fixed_in))
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise LedgerError(f"ledger ids repeat: {ids}")
    for e in entries:
        if e.stale_with is not None and e.stale_with not in ids:
            raise LedgerError(f"{e.id}: stale_with names no entry: {e.stale_with!r}")
    return entries


@cache
def engine_version() -> str | None:
    """The installed SGLang's version (None: not installed), once per process."""
    from backends.sglang.runtime import installed_version

    return installed_version()


@cache
def known_failures() -> tuple[KnownFailure, ...]:
    return tuple(parse_ledger(LEDGER.read_text())) if LEDGER.exists() else ()


def match(composition: str, mode: str, prop: str, spec: BatchSpec, verdict: Verdict,
          device: str) -> KnownFailure | None:
    """The ledger entry that explains this failing case, or None (then it is a finding).

    A verdict that failed several comparisons (properties.verdict.Worst: ``details["failing"]``) is known only if
    an entry explains each of them, judged one at a time as if it were the worst: a known bug in one layer must not
    hide a new one in another layer of the same batch. The entry returned is the one for the worst comparison. A
    crash running the batch a property runs before the drawn one (``details["batch"] == "before"``: replan's) is
    judged by that batch."""
    if verdict.details.get("batch") == "before":  # it failed running the batch the property runs first
        from properties import PROPERTIES

        before = PROPERTIES[prop].before
        if before is None:
            raise AssertionError(f"{prop} marked a failure as its batch before the drawn one but defines no such batch")
        spec = before(spec)

    def explained(part: Verdict) -> KnownFailure | None:
        return next((e for e in known_failures() if e.matches(composition, mode, prop, spec, part, device)), None)
    failing = verdict.details.get("failing", ())
    parts = [dataclasses.replace(verdict, where=where, check=check, worst_error=error, bound=bound, rel_l2=rel_l2)
             for where, check, error, bound, rel_l2 in failing] if len(failing) > 1 else [verdict]
    entries = [explained(part) for part in parts]
    return None if any(e is None for e in entries) else entries[0]
