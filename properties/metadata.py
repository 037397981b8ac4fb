"""Invariants of every leaf backend's planned metadata (DESIGN.md section 5), checked without knowing
the backend: indptrs start at 0 and do not decrease, they end at the right totals, indices are exactly
the requests' ``req_to_token`` slots (or pages), last-page lengths agree with the lengths, masks have the
verify length, state slots are the batch's, a sliding-window layer's own key lists are the last keys of each
request's range (at least the window's worth). The fields of an engine's plan that no invariant reads are listed in
the verdict."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from backends.base import PlannedMetadata
from backends.registry import Composition
from batch.forward_batch import ForwardBatch, ModelRunner
from batch.masks import verify_mask
from batch.spec import BatchSpec, ForwardMode, draft_region
from engine.materialize import materialize
from engine.model import prepare_batch
from properties.run import run_case
from properties.verdict import Verdict

NAME = "metadata"


def planned_leaves(backend, fb: ForwardBatch) -> list[tuple[object, ForwardBatch]]:
    """Each leaf backend with the batch it planned (TBO children planned their halves)."""
    if hasattr(backend, "primary"):
        out = planned_leaves(backend.primary, fb)
        for child, child_fb in zip(backend.children, fb.tbo_children or ()):
            out += planned_leaves(child, child_fb)
        return out
    if hasattr(backend, "full_attn_backend"):
        return planned_leaves(backend.full_attn_backend, fb) + planned_leaves(backend.linear_attn_backend, fb)
    return [(backend, fb)]


def _indptr_problem(name: str, indptr: torch.Tensor, total: int | None, B: int) -> str | None:
    x = indptr.to("cpu", torch.int64)
    if x.numel() != B + 1:
        return f"{name} has {x.numel()} entries for {B} requests"
    if int(x[0]) != 0:
        return f"{name}[0] = {int(x[0])}, expected 0"
    if bool((x[1:] < x[:-1]).any()):
        return f"{name} decreases"
    if total is not None and int(x[-1]) != total:
        return f"{name}[-1] = {int(x[-1])}, expected {total}"
    return None


def _sizes_problem(name: str, indptr: torch.Tensor, sizes: list[int], real: int, what: str) -> str | None:
    """``indptr`` as the prefix sum of per-request ``sizes``: a valid indptr, its total and steps those of the first
    ``real`` requests (padded rows after them: only a valid indptr)."""
    B = len(sizes)
    problem = _indptr_problem(name, indptr, sum(sizes) if real == B else None, B)
    if problem:
        return problem
    steps = indptr.to("cpu", torch.int64).diff().tolist()
    if steps[:real] != sizes[:real]:
        return f"{name} steps {steps[:8]}..., expected {what}{sizes[:8]}..."
    return None


def _window_problem(meta: PlannedMetadata, fb: ForwardBatch, keys: list[int], real: int) -> str | None:
    """A sliding-window layer's own key lists (token slots): a valid indptr over them; each real request's list the
    last keys of the range its full list covers (``keys``), at least min(keys, window) of them and at most all;
    where a backend says where each list starts (``window_kv_offsets``), that is where it starts. The lower bound is
    the weakest every backend's contract meets: it takes no side on whether a window query reads W keys or W + 1
    (its own among them), which SGLang's Triton decode and FlashInfer answer differently; the outputs properties
    settle that against the reference (the ledger's sglang-triton-swa-decode-one-key-short)."""
    B = fb.batch_size
    if meta.window_kv_indices is None:
        return "window_kv_indptr planned without window_kv_indices"
    if meta.window is None:  # the reader's fault, not the engine's: an adapter error, never a finding
        raise ValueError("a PlannedMetadata with window lists but no window: the harness's plan reader is wrong")
    problem = _indptr_problem("window_kv_indptr", meta.window_kv_indptr, meta.window_kv_indices.numel(), B)
    if problem:
        return problem
    indptr = meta.window_kv_indptr.tolist()
    indices = meta.window_kv_indices.to("cpu", torch.int64)
    offsets = None if meta.window_kv_offsets is None else meta.window_kv_offsets.to("cpu", torch.int64).tolist()
    for i in range(real):
        n, got = keys[i], indices[indptr[i]:indptr[i + 1]]
        least = min(n, meta.window)
        if not least <= got.numel() <= n:
            return (f"request {i}: {got.numel()} window keys, expected at least min({n} keys, window {meta.window}) "
                    f"= {least} and at most {n}")
        row = fb.req_to_token[fb.req_pool_indices[i]].to("cpu", torch.int64)
        expected = row[n - got.numel():n]
        if not torch.equal(got, expected):
            # (a list that is the range's first keys, not its last, is named so: a plan handed no start index)
            first = " (its first ones)" if got.numel() < n and torch.equal(got, row[:got.numel()]) else ""
            return (f"request {i}: window_kv_indices hold {got.tolist()[:8]}...{first}, expected the last "
                    f"{got.numel()} of its {n} keys' slots {expected.tolist()[:8]}...")
        if offsets is not None and offsets[i] != n - got.numel():
            return (f"request {i}: window_kv_offsets {offsets[i]}, expected {n - got.numel()} (its window's "
                    f"{got.numel()} keys end its {n})")
    return None


def check_plan(meta: PlannedMetadata, fb: ForwardBatch) -> str | None:
    """The first violated invariant of one plan, or None.

    A graph replay's batch ends in padded rows (``fb.num_padding``): their lengths come from the backend's fill value
    and their slots from the padding row, and the kernels' results for them are dropped. They are held to what
    SGLang's own kit holds every replayed plan to (test/kits/attention_unittest/runner_modes/metadata_invariants.py):
    indptrs that start at 0 and do not decrease, lengths that are not negative. The real rows are held to the batch.
    """
    B, T = fb.batch_size, fb.extend_num_tokens
    real = B - (getattr(fb, "num_padding", None) or 0)
    if meta.qo_indptr is not None:
        # every row, padded ones included: their new tokens are the graph's fixed width
        problem = _sizes_problem("qo_indptr", meta.qo_indptr, list(fb.extend_seq_lens_cpu), B,
                                 "each request's new tokens ")
        if problem:
            return problem
    if meta.state_slots is not None and meta.state_slots.tolist() != fb.state_slots.tolist():
        return f"state_slots {meta.state_slots.tolist()} != the batch's {fb.state_slots.tolist()}"
    keys = [fb.extend_prefix_lens_cpu[i] + (fb.extend_seq_lens_cpu[i] if meta.kv_includes_new_tokens else 0)
            for i in range(B)]
    if meta.key_lens is not None:
        lens = meta.key_lens.to("cpu", torch.int64).tolist()
        if lens[:real] != keys[:real] or len(lens) != B or min(lens, default=0) < 0:
            return f"key lengths {lens[:8]}..., expected {keys[:8]}..."
    if meta.key_indptr is not None:
        problem = _sizes_problem("key indptr", meta.key_indptr, keys, real, "")
        if problem:
            return problem
    if meta.kv_indptr is not None:
        problem = _indptr_problem("kv_indptr", meta.kv_indptr, meta.kv_indices.numel(), B)
        if problem:
            return problem
        ps = fb.page_size if meta.kv_indices_are_pages else 1
        indptr = meta.kv_indptr.tolist()
        indices = meta.kv_indices.to("cpu", torch.int64)
        for i in range(real):
            n = keys[i]
            row = fb.req_to_token[fb.req_pool_indices[i]].to("cpu", torch.int64)
            expected = row[:n:ps] // ps
            got = indices[indptr[i]:indptr[i + 1]]
            if got.numel() != expected.numel() or not torch.equal(got, expected):
                unit = "pages" if ps > 1 else "slots"
                return (f"request {i}: kv_indices hold {got.tolist()[:8]}..., expected its req_to_token {unit} "
                        f"{expected.tolist()[:8]}... ({expected.numel()} of them)")
            if meta.kv_last_page_len is not None:
                last = int(meta.kv_last_page_len[i])
                want = (n - 1) % ps + 1 if n > 0 else 0
                if last != want or (n > 0 and not 1 <= last <= ps):
                    return f"request {i}: kv_last_page_len {last}, expected {want} for {n} keys in pages of {ps}"
    if fb.forward_mode.is_target_verify() and meta.custom_mask is not None and meta.mask_indptr is not None:
        # Request i's tree mask is D x (seq_len + D) entries: where each request's mask starts in the flat one
        D = fb.spec_info.draft_token_num
        sizes = [D * (n + D) for n in fb.seq_lens_cpu.tolist()]
        problem = _sizes_problem("mask_indptr", meta.mask_indptr, sizes, real, "D*(seq_len+D) per request ")
        if problem:
            return problem
    if fb.forward_mode.is_target_verify() and meta.custom_mask is not None:
        expected = verify_mask(fb.seq_lens_cpu.tolist()[:real], fb.spec_info.parents.tolist()[:real])
        expected = expected.to(meta.custom_mask.device)
        got = meta.custom_mask.bool()
        if got.numel() < expected.numel() or (real == B and got.numel() != expected.numel()):
            return f"custom_mask has {got.numel()} entries, expected sum(D*(seq_len+D)) = {expected.numel()}"
        if not torch.equal(got[:expected.numel()], expected):
            first = int(torch.nonzero(got[:expected.numel()] != expected)[0])
            return f"custom_mask differs from the draft trees at flat entry {first}"
    if meta.window_kv_indptr is not None:
        problem = _window_problem(meta, fb, keys, real)
        if problem:
            return problem
    chunk = meta.chunk or {}
    if "qo_indptr" in chunk:
        problem = _indptr_problem("mha chunk qo_indptr", chunk["qo_indptr"], T, B)
        if problem:
            return problem
        for i in range(real):
            row = fb.req_to_token[fb.req_pool_indices[i]].to("cpu", torch.int64)
            got = torch.cat([idx[int(p[i]):int(p[i + 1])].cpu() for p, idx in chunk["chunks"]] or [torch.zeros(0)])
            expected = row[:fb.extend_prefix_lens_cpu[i]]
            if got.numel() != expected.numel() or not torch.equal(got.to(torch.int64), expected):
                return f"request {i}: MLA prefix chunks do not cover exactly its {expected.numel()} prefix slots"
    return None


def planned_case(composition: Composition, spec: BatchSpec, device: str):
    """(the built composition, its materialized case) after it planned ``spec``: a plan-level composition
    (``Support.plan_only``) only plans, as an engine's model runner does before its first layer; any other runs
    every layer, so a plan that layers change is read as the last layer left it."""
    if composition.support().plan_only:
        case = materialize(spec, device)
        backend = composition.build(spec, ModelRunner.of(case.forward_batch, spec.layers))
        prepare_batch(backend, case.forward_batch, spec.layers)
        return backend, case
    run = run_case(composition, spec, device)
    return run.execution.backend, run.case


def planned(composition: Composition, spec: BatchSpec, device: str):
    """(the built composition, its batch) after it planned ``spec`` (:func:`planned_case`)."""
    backend, case = planned_case(composition, spec, device)
    return backend, case.forward_batch


def rows_changed(case) -> str | None:
    """Whether the batch's ``req_to_token`` rows no longer hold the slots its materialization put there. Nothing in a
    forward pass writes them (the scheduler does, before it), so a change is a stray write by some kernel (on CUDA,
    where nothing checks bounds), and a plan checked against them would be judged against what that write left (seen
    on an H200: a TBO-over-GDN batch's row read page 0, which the harness reserves, harness-out/gpu95.sh, gpu96.sh)."""
    fb = case.forward_batch
    rows = fb.req_pool_indices.tolist()
    for i, slots in enumerate(case.token_slots):
        held = fb.req_to_token[rows[i], :slots.numel()].to("cpu", torch.int64)
        differs = (held != slots.to(torch.int64)).nonzero()
        if differs.numel():
            c = int(differs[0, 0])
            return f"request {i}'s req_to_token row changed during the forward pass (column {c} holds {int(held[c])}, " \
                   f"materialized {int(slots[c])}): a stray write; no plan is checked against it"
    return None


def draft_step_batch(spec: BatchSpec, fb: ForwardBatch, step: int, padded_requests: int = 0,
                     tails_from_branch: bool = False) -> SimpleNamespace:
    """What draft step ``step``'s plan must describe, read from the specification and the batch's cache rows alone:
    one decode request per branch (request by request, branch by branch), its keys what the draft reads of the
    request's cached prefix (all of it, or under a draft window its sinks and recent tokens:
    ``SpecInput.draft_prefix_columns``) then the branch's draft tokens of steps 0..step (their columns:
    ``BatchSpec.new_token_columns``), the last of them the step's own new token. A graph replay's
    ``padded_requests`` add their branches last, held only to valid indptrs. ``tails_from_branch``: the plan reads a
    paged tree's prefix tail from each branch's own copy (``PlannedMetadata.draft_tails_from_branch``): the prefix up
    to its last partial page, then the branch's region from its tail on."""
    K, n = spec.spec.topk, spec.spec.spec_steps - 1
    keys = []
    for r, row in enumerate(fb.req_pool_indices.tolist()):
        cols, p = spec.new_token_columns(r), spec.prefix_lens[r]
        for j in range(K):
            prefix = spec.spec.draft_prefix_columns(p)
            if tails_from_branch:
                start, tail = draft_region(p, spec.page_size, K, spec.spec.spec_steps, j)
                prefix = prefix[:p - tail] + list(range(start, start + tail))
            mine = prefix + cols[j * n:j * n + step + 1]
            keys.append(fb.req_to_token[row, mine].to("cpu", torch.int64))
    table = torch.zeros(len(keys), max((k.numel() for k in keys), default=0), dtype=torch.int64)
    for i, k in enumerate(keys):
        table[i, :k.numel()] = k
    padding = padded_requests * K
    keys += [torch.zeros(1, dtype=torch.int64)] * padding
    prefix = [k.numel() - 1 for k in keys]
    B = len(keys)
    return SimpleNamespace(batch_size=B, extend_num_tokens=B, num_padding=padding, extend_seq_lens_cpu=[1] * B,
                           extend_prefix_lens_cpu=prefix, seq_lens_cpu=torch.tensor(prefix) + 1,
                           state_slots=torch.zeros(B, dtype=torch.int64), req_to_token=table,
                           req_pool_indices=torch.arange(B), page_size=fb.page_size, forward_mode=ForwardMode.DECODE,
                           spec_info=None)


def draft_plans_read(plans, spec: BatchSpec, fb: ForwardBatch, padded_requests: int = 0) -> str | None:
    """What a draft loop's step plans read, against the mechanism of SGLang's MLA draft containers (docs/findings/
    sglang-mla-draft-steps-read-committed-prefix.md): ``"committed prefix"`` where every step's plan is exactly a
    decode of each branch over its request's committed prefix alone (none of its chain's draft tokens, not its own);
    ``"committed prefix lengths"`` where every step's key counts are those but its indices are not; else None. The
    ledger reads it from a failing verdict's details (``draft_step_reads``)."""
    if not plans:
        return None
    prefix_only = draft_step_batch(spec, fb, -1, padded_requests=padded_requests)
    if all(check_plan(plan, prefix_only) is None for plan in plans):
        return "committed prefix"
    real = prefix_only.batch_size - padded_requests
    keys = [n + 1 for n in prefix_only.extend_prefix_lens_cpu[:real]]

    def counts(plan) -> list[int] | None:
        if plan.key_lens is not None:
            return plan.key_lens.to("cpu", torch.int64).tolist()[:real]
        if plan.kv_indptr is None:
            return None
        n = plan.kv_indptr.to("cpu", torch.int64).diff().tolist()[:real]
        return n if not plan.kv_indices_are_pages else None  # pages do not count keys
    if all(counts(plan) == keys for plan in plans):
        return "committed prefix lengths"
    return None


def unread_note(named_plans) -> str:
    """What a passing verdict adds about ``(owner, plan)`` pairs: the fields of the engine's plans no invariant read
    (``PlannedMetadata.unread``), each named once, so that what is not checked is said."""
    names = sorted({f"{owner}.{name}" for owner, plan in named_plans for name in plan.unread})
    return f"; fields no invariant reads: {', '.join(names)}" if names else ""


def metadata_invariants(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    if spec.mode.is_draft_decode():  # the draft loop: every step's plan, each a decode of every branch
        drafter, case = planned_case(composition, spec, device)
        fb = case.forward_batch
        changed = rows_changed(case)
        if changed:
            return Verdict(NAME, False, changed)
        plans = drafter.step_plans()
        for step, plan in enumerate(plans):
            expected = draft_step_batch(spec, fb, step, tails_from_branch=plan.draft_tails_from_branch)
            problem = check_plan(plan, expected)
            if problem:
                return Verdict(NAME, False, f"draft step {step}: {problem}", where=f"draft step {step}",
                               details={"draft_step_reads": draft_plans_read(plans, spec, fb)})
        return Verdict(NAME, True, f"{len(plans)} draft step plan(s) satisfy every invariant" +
                       unread_note(("draft step", plan) for plan in plans))
    backend, case = planned_case(composition, spec, device)
    changed = rows_changed(case)
    if changed:
        return Verdict(NAME, False, changed)
    leaves = planned_leaves(backend, case.forward_batch)
    named = []
    for backend, fb in leaves:
        plan = backend.planned_metadata()
        problem = check_plan(plan, fb)
        if problem:
            return Verdict(NAME, False, f"{type(backend).__name__}: {problem}")
        named.append((type(backend).__name__, plan))
    return Verdict(NAME, True, f"{len(leaves)} plan(s) satisfy every invariant" + unread_note(named))
