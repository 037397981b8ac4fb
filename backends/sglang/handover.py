"""What SGLang's scheduler guarantees of every eager ForwardBatch, checked on the batch the adapter hands over.

SGLang's backends trust their batch: a ForwardBatch whose host and device lengths disagree, whose ``extend_start_loc``
is not the running sum of its extends, or whose write slots are not the request table's, is one the scheduler never
builds (``ScheduleBatch`` -> ``ModelWorkerBatch`` -> ``ForwardBatch.init_new``). Handed such a batch, a backend
crashes inside its own code or answers wrong, and the harness would report the engine's bug where the adapter's
translation was at fault. So the adapter checks its translation before any SGLang backend plans or runs over it,
once per harness batch, and a violation is raised from the project's code: an adapter error
(``properties/blame.py``), never a finding. The write slots checked are the ones the adapter chose, not what SGLang's
KV-index translator (0.5.22 on) rebinds them to: a fault there is SGLang's.

Written from the scheduler's side, not from any backend's reading of the fields: the request table's row holds the
prefix's slots then the extend's write slots (``mem_cache/allocation.py:97-104`` in 0.5.23), positions are
``prefix + i`` for an extend and ``seq_lens - 1`` for a decode (``ForwardBatch.init_new``,
``model_executor/forward_batch_info.py:1228``), host lists mirror the device tensors. Graph runners' static
batches' padded rows follow the runners' own fill rules, which the graph properties check; their real rows, the batch
the scheduler handed the runner, are checked at each decode, target-verify, draft-extend and draft-loop replay
(:func:`check_replay`; the request table at a static batch's first replay only, as it is not restored between
replays): a graph runner that loaded them wrong would have its replay differ from the eager run, which the graph
properties would otherwise report as SGLang's.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from batch.masks import tree_depths


class BrokenHandover(RuntimeError):
    """The adapter translated a batch into a ForwardBatch that SGLang's scheduler never builds."""


def violations(sfb, req_to_token: torch.Tensor | None, out_cache_loc: torch.Tensor | None = None,
               page_size: int = 1, parents: torch.Tensor | None = None) -> list[str]:
    """Every way ``sfb`` breaks the scheduler's guarantees (empty when none). ``req_to_token``: the request table
    the batch's ``req_pool_indices`` index (None: its slots are not checked). ``out_cache_loc``: the write slots the
    adapter chose (default: the batch's own). ``page_size``: the pool's; a paged allocator puts each token at its
    position's offset in a page (``mem_cache/allocator/paged.py:41-133`` in 0.5.23: from the last slot, or a free
    page at the position's offset). ``parents``: a target verify's draft trees, ``[batch, draft tokens]`` (each
    token's parent, -1 for a root), as the draft worker built them (None: its positions are not checked)."""
    mode = sfb.forward_mode
    loc = sfb.out_cache_loc if out_cache_loc is None else out_cache_loc
    bs = int(sfb.batch_size)
    wrong: list[str] = []

    def same(what: str, got, want) -> None:
        if got != want:
            wrong.append(f"{what} is {_short(got)}, the scheduler's would be {_short(want)}")

    seq = sfb.seq_lens.tolist()
    seq_cpu = [int(x) for x in sfb.seq_lens_cpu.tolist()] if sfb.seq_lens_cpu is not None else None
    same("len(req_pool_indices)", int(sfb.req_pool_indices.numel()), bs)
    same("len(seq_lens)", len(seq), bs)
    draft = getattr(getattr(sfb, "spec_info", None), "draft_token_num", None)
    algorithm = getattr(sfb, "spec_algorithm", None)
    widened = mode.is_target_verify() and bool(getattr(algorithm, "is_dflash", lambda: False)())
    if seq_cpu is not None:
        # DFlash's verify widens the host lengths by its block, the device lengths stay the committed prefix: the
        # adapter's reading of speculative/dflash_worker_v2.py (SGLang bounds the host lengths from above)
        same("seq_lens_cpu", seq_cpu, [s + draft for s in seq] if widened else seq)
        same("seq_lens_sum", int(sfb.seq_lens_sum), sum(seq_cpu))
    tokens = int(loc.numel())
    draft_topk = getattr(getattr(sfb, "spec_info", None), "num_tokens_per_req", None) if mode.is_decode() else None
    if sfb.positions is not None:
        same("len(positions)", int(sfb.positions.numel()), tokens if draft_topk is None else bs * draft_topk)

    starts: list[int] | None = None  # each request's first new position
    if mode.is_target_verify():
        if draft is not None:
            same("len(out_cache_loc)", tokens, bs * int(draft))
        if parents is not None and sfb.positions is not None and not wrong:
            # Each draft token sits at its request's committed length plus its depth in the tree
            # (speculative/eagle_utils.py:207-210, build_tree_kernel_efficient in 0.5.23); DFlash's block is a chain
            depths = tree_depths(parents[:bs].cpu()).tolist()
            same("positions", sfb.positions.tolist(), [s + d for s, row in zip(seq, depths) for d in row])
    elif mode.is_extend(include_draft_extend_v2=True):
        prefix, extend = sfb.extend_prefix_lens.tolist(), sfb.extend_seq_lens.tolist()
        same("extend_prefix_lens_cpu", list(sfb.extend_prefix_lens_cpu), prefix)
        same("extend_seq_lens_cpu", list(sfb.extend_seq_lens_cpu), extend)
        same("extend_prefix_lens + extend_seq_lens", [p + e for p, e in zip(prefix, extend)], seq)
        same("extend_start_loc", sfb.extend_start_loc.tolist(), [sum(extend[:i]) for i in range(len(extend))])
        same("extend_num_tokens", int(sfb.extend_num_tokens), sum(extend))
        same("len(out_cache_loc)", tokens, sum(extend))
        if sfb.positions is not None and not wrong:
            same("positions", sfb.positions.tolist(), [p + i for p, e in zip(prefix, extend) for i in range(e)])
        starts = prefix
    elif mode.is_decode() and draft_topk is not None:
        # EAGLE's draft decode (prepare_for_draft): topk branches a request, each from the committed length, writing
        # a window of steps a branch into slots past the request table's (eagle_info.py, assign_draft_cache_locs)
        if bs and tokens % (bs * draft_topk):
            wrong.append(f"len(out_cache_loc) is {tokens}, not a draft window of {bs} requests x topk {draft_topk} "
                         f"x steps")
        window = loc.tolist()
        if any(slot <= 0 for slot in window) or len(set(window)) != len(window):
            wrong.append(f"the draft window {_short(window)} is not distinct real slots (slot 0 is padding): the "
                         f"scheduler allocates every step's, the last one's too")
        if sfb.positions is not None:
            same("positions", sfb.positions.tolist(), [s for s in seq for _ in range(draft_topk)])
    elif mode.is_decode():
        same("len(out_cache_loc)", tokens, bs)
        if sfb.positions is not None and not wrong:
            same("positions", sfb.positions.tolist(), [s - 1 for s in seq])
        starts = [s - 1 for s in seq]

    if page_size > 1 and starts is not None and sfb.positions is not None and not wrong:
        off = [(i, s, p) for i, (s, p) in enumerate(zip(loc.tolist(), sfb.positions.tolist()))
               if s % page_size != p % page_size]
        if off:
            i, s, p = off[0]
            wrong.append(f"{len(off)} write slot(s) at another offset in their page than their position's "
                         f"(page size {page_size}): token {i} at slot {s}, position {p}")

    if req_to_token is not None and starts is not None and not wrong:
        rows = sfb.req_pool_indices.tolist()
        # Bounds first: an index past the table raises on a CPU and is a device-side assert on a GPU, which the
        # blame rules give the engine (an asynchronous device error)
        if any(r <= 0 or r >= req_to_token.shape[0] for r in rows):
            wrong.append(f"req_pool_indices {_short(rows)} reach row 0 (the harness's padding row) or past the "
                         f"table's {req_to_token.shape[0]} rows")
        else:
            table = req_to_token[rows, :max(seq, default=0)].tolist() if rows else []
            written = [slot for r, start, end in zip(table, starts, seq) for slot in r[start:end]]
            same("out_cache_loc", loc.tolist(), written)
            for i, (r, end) in enumerate(zip(table, seq)):
                kept = r[:end]
                if any(slot <= 0 for slot in kept) or len(set(kept)) != len(kept):
                    wrong.append(f"request {i}'s slots req_to_token[{rows[i]}, :{end}] = {_short(kept)} are not "
                                 f"distinct real slots (slot 0 is padding)")
    return wrong


def real_rows(sfb, padding: int, out_cache_loc: torch.Tensor):
    """The real rows of a graph runner's static decode, target-verify, draft-extend or draft-decode batch ``sfb`` (its
    last ``padding`` rows are the runner's fill): the batch the scheduler handed the runner, with ``out_cache_loc`` the
    static write slots the adapter chose, as :func:`violations` reads a batch. Each row holds the same number of
    tokens (one, the draft's, or a draft decode's window) and of positions."""
    bs = max(1, int(sfb.batch_size))
    n = int(sfb.batch_size) - padding
    per = int(out_cache_loc.numel()) // bs  # (a draft decode writes its steps' window, reads at one position a branch)
    positions = None if sfb.positions is None else sfb.positions[:n * (int(sfb.positions.numel()) // bs)]
    seq_cpu = None if sfb.seq_lens_cpu is None else sfb.seq_lens_cpu[:n]
    rows = SimpleNamespace(
        forward_mode=sfb.forward_mode, batch_size=n, req_pool_indices=sfb.req_pool_indices[:n],
        seq_lens=sfb.seq_lens[:n], seq_lens_cpu=seq_cpu, seq_lens_sum=0 if seq_cpu is None else int(seq_cpu.sum()),
        out_cache_loc=out_cache_loc[:n * per], positions=positions,
        spec_info=getattr(sfb, "spec_info", None), spec_algorithm=getattr(sfb, "spec_algorithm", None))
    if getattr(sfb, "extend_seq_lens", None) is not None:  # a draft extend's: cut to the real rows
        rows.extend_prefix_lens, rows.extend_seq_lens = sfb.extend_prefix_lens[:n], sfb.extend_seq_lens[:n]
        rows.extend_prefix_lens_cpu = list(sfb.extend_prefix_lens_cpu)[:n]
        rows.extend_seq_lens_cpu = list(sfb.extend_seq_lens_cpu)[:n]
        rows.extend_start_loc, rows.extend_num_tokens = sfb.extend_start_loc[:n], n * per
    return rows


# The harness batches already checked: each once, at its first translation, before SGLang has seen any of its
# tensors (a later plan of the same batch would read them after SGLang's code may have written them in place)
_checked: dict[str, weakref.WeakValueDictionary] = {}


def first_handover(fb, as_what: str = "batch") -> bool:
    """Whether the harness batch ``fb`` is translated ``as_what`` (the batch itself, or the draft decode
    ``prepare_for_draft`` builds from it) for the first time; it is now counted."""
    seen = _checked.setdefault(as_what, weakref.WeakValueDictionary())
    if seen.get(id(fb)) is fb:
        return False
    seen[id(fb)] = fb
    return True


def check(sfb, req_to_token: torch.Tensor | None, out_cache_loc: torch.Tensor | None = None,
          page_size: int = 1, parents: torch.Tensor | None = None) -> None:
    """Raise :class:`BrokenHandover` naming every violation, if any."""
    wrong = violations(sfb, req_to_token, out_cache_loc, page_size, parents)
    if wrong:
        raise BrokenHandover(f"the adapter's {sfb.forward_mode.name.lower()} ForwardBatch is not one SGLang's "
                             f"scheduler builds: {'; '.join(wrong)}")


def check_replay(sfb, padding: int, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor | None,
                 page_size: int = 1, parents: torch.Tensor | None = None) -> None:
    """Raise :class:`BrokenHandover` if the real rows of a graph replay's static batch break the scheduler's rules
    (``parents``: a target verify's draft trees, its real rows' first)."""
    wrong = violations(real_rows(sfb, padding, out_cache_loc), req_to_token, None, page_size, parents)
    if wrong:
        raise BrokenHandover(f"the real rows of the graph runner's {sfb.forward_mode.name.lower()} batch are not a "
                             f"batch SGLang's scheduler builds: {'; '.join(wrong)}")


def _short(x, keep: int = 12) -> str:
    if isinstance(x, list) and len(x) > keep:
        return f"[{', '.join(map(str, x[:keep]))}, ... ({len(x)} in all)]"
    return str(x)
