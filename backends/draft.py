"""EAGLE's multi-step draft decode over one of our backends (DESIGN.md: the draft loop).

A draft worker runs ``spec_steps - 1`` forward steps per iteration; step i decodes one token for each of a request's
``topk`` branches. SGLang serves the loop with a container of one backend per step (``TritonMultiStepDraftBackend``,
``FlashInferMultiStepDraftBackend``: built by ``DraftBackendFactory.create_decode_backend``), planned once before
the loop (``init_forward_metadata``), each step then run by its own backend (``attn_backends[i]``).

:class:`MultiStepDraft` is that container for our backends, written from the loop's definition rather than from
SGLang's index kernel: step i of branch j of request r is a decode whose keys are r's cached prefix, then the branch's
own draft slots for steps 0..i (``BatchSpec.new_token_columns``: branch j's step s sits at column
``seq_len + j * spec_steps + s`` of r's cache row); under the server's draft window, only the prefix's sinks and its
recent window (``SpecInput.draft_prefix_columns``). Each step's backend plans that decode as an ordinary DECODE batch
of ``B * topk`` requests over a scratch request table holding one row per branch, so the planners under test are our
backends' own decode planners.
"""

from __future__ import annotations

import dataclasses

import torch

from batch.forward_batch import ForwardBatch, ModelRunner
from batch.spec import ForwardMode, draft_prefix_columns, draft_region, draft_step_rows


def branch_table(fb: ForwardBatch, topk: int, steps: int, window: int = 0, sink: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A request table with one row per branch (row 0 the padding row, branch ``r * topk + j`` at row
    ``1 + r * topk + j``): what the draft reads of request r's cached prefix (all of it, or under a draft window of
    ``window`` tokens and ``sink`` sinks, ``batch.spec.draft_prefix_columns``), then branch j's ``steps - 1`` draft
    slots; and the branches' read prefix lengths ``[B * topk]``."""
    seq = fb.seq_lens_cpu.tolist()
    rows = fb.req_to_token[fb.req_pool_indices]
    table = torch.zeros(1 + len(seq) * topk, fb.req_to_token.shape[1], dtype=fb.req_to_token.dtype, device=fb.device)
    read = []
    for r, n in enumerate(seq):
        cols = torch.tensor(draft_prefix_columns(n, window, sink), dtype=torch.int64, device=fb.device)
        read.append(cols.numel())
        for j in range(topk):
            row = table[1 + r * topk + j]
            row[:cols.numel()] = rows[r, cols]
            start, tail = draft_region(n, fb.page_size, topk, steps, j)  # the branch's slots follow its region's tail
            row[cols.numel():cols.numel() + steps - 1] = rows[r, start + tail:start + tail + steps - 1]
    prefix = torch.tensor(read, dtype=torch.int64).repeat_interleave(topk)
    return table, prefix


def step_batch(fb: ForwardBatch, table: torch.Tensor, prefix: torch.Tensor, steps: int, step: int) -> ForwardBatch:
    """Step ``step`` of the draft loop as a plain DECODE batch of one request per branch: each branch decodes the token
    at position ``prefix + step`` into the write slot the draft batch gives it (its row of that step:
    ``draft_step_rows``), over ``prefix + step + 1`` keys."""
    n = prefix.shape[0]
    dev = fb.device
    seq = prefix + step + 1
    rows = torch.arange(1, n + 1, dtype=torch.int64)
    loc = fb.out_cache_loc[torch.tensor(draft_step_rows(fb.batch_size, n // fb.batch_size, steps, step), device=dev)]
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=n, req_pool_indices=rows.to(dev), seq_lens=seq.to(dev),
        seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()), extend_seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
        extend_prefix_lens=(seq - 1).to(torch.int32).to(dev), extend_start_loc=torch.arange(n, dtype=torch.int32,
                                                                                           device=dev),
        extend_seq_lens_cpu=[1] * n, extend_prefix_lens_cpu=(seq - 1).tolist(), extend_num_tokens=n,
        positions=(prefix + step).to(dev), mrope_positions=None, out_cache_loc=loc, req_to_token=table,
        req_to_state_slot=torch.zeros(table.shape[0], dtype=torch.int64, device=dev),
        state_slots=torch.zeros(n, dtype=torch.int64, device=dev), token_to_kv_pool=fb.token_to_kv_pool,
        mamba_pool=None, spec_info=None, device=dev, num_token_non_padded=n)


def refill(static: ForwardBatch, new: ForwardBatch) -> None:
    """``static``'s tensors refilled in place from ``new`` (a batch of the same shape), its host-side fields set."""
    for name in ("req_pool_indices", "seq_lens", "extend_prefix_lens", "positions", "out_cache_loc"):
        getattr(static, name).copy_(getattr(new, name))
    static.seq_lens_cpu, static.seq_lens_sum = new.seq_lens_cpu, new.seq_lens_sum
    static.extend_prefix_lens_cpu, static.num_padding = new.extend_prefix_lens_cpu, new.num_padding


class _Step:
    """Step i's backend as the draft loop's model sees it: ``forward`` runs the layer on the batch this step planned
    (the loop hands every step one draft batch; the step's own plan says whose keys each branch reads)."""

    def __init__(self, backend, index: int) -> None:
        self.backend = backend
        self.index = index
        self.planned: ForwardBatch | None = None

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if self.planned is None:
            raise RuntimeError(f"draft step {self.index} ran before the draft loop was planned")
        return self.backend.forward(q, k, v, layer, self.planned, save_kv_cache=save_kv_cache, **kwargs)


class MultiStepDraft:
    """One of our backends per draft step, planned together (see the module docstring)."""

    def __init__(self, backend_cls, model_runner: ModelRunner, topk: int, speculative_num_steps: int,
                 draft_window_size: int = 0, draft_sink_size: int = 0) -> None:
        self.backend_cls = backend_cls
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.window = (draft_window_size, draft_sink_size)  # the server's draft window (batch.spec.SpecInput)
        self.attn_backends: list[_Step] = []

    # ---- CUDA graphs: the draft graph runner's calls (engine/draft_loop.py, DraftGraphRunner) ----
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The padded rows' length: the step backends' own fill value."""
        return self.backend_cls(self.model_runner).get_cuda_graph_seq_len_fill_value()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """One static branch table for the largest graph (``max_bs * topk`` branches), the step backends built over
        it and their graph state sized for one decode per branch."""
        mr, K = self.model_runner, self.topk
        self.graph_table = torch.zeros(1 + max_bs * K, mr.req_to_token.shape[1], dtype=mr.req_to_token.dtype,
                                       device=mr.device)
        runner = dataclasses.replace(mr, req_to_token=self.graph_table,
                                     req_to_state_slot=torch.zeros(self.graph_table.shape[0], dtype=torch.int64,
                                                                   device=mr.device))
        self.attn_backends = [_Step(self.backend_cls(runner), i) for i in range(self.speculative_num_steps - 1)]
        for step in self.attn_backends:
            step.backend.init_cuda_graph_state(max_bs * K, max_bs * K)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """The padded draft batch's branch table written into the static one, then each step's decode planned over it
        (its padded requests' branches counted as padding). A step keeps the batch it was captured with: a replay
        refills that batch's tensors in place, since the captured kernels read them."""
        fb, K = forward_batch, self.topk
        table, prefix = branch_table(fb, K, self.speculative_num_steps, *self.window)
        self.graph_table[:table.shape[0]].copy_(table)
        padding = (getattr(fb, "num_padding", 0) or 0) * K
        for i, step in enumerate(self.attn_backends):
            planned = step_batch(fb, self.graph_table, prefix, self.speculative_num_steps, i)
            planned.num_padding = padding
            if in_capture or step.planned is None:
                step.planned = planned
            else:
                refill(step.planned, planned)
            step.backend.init_forward_metadata_out_graph(step.planned, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for step in self.attn_backends:
            step.backend.init_forward_metadata_in_graph(step.planned)

    def step_plans(self) -> list:
        """Each step's plan (:class:`backends.base.PlannedMetadata`), in step order; a graph's cut to what its kernels
        read."""
        return [step.backend.planned_metadata().cut_to_indptrs() for step in self.attn_backends]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan every step before the loop: a branch table, then each step's decode on its own backend (built over a
        runner whose request table is the branch table, as a graph-state hook would read it)."""
        table, prefix = branch_table(forward_batch, self.topk, self.speculative_num_steps, *self.window)
        runner = dataclasses.replace(self.model_runner, req_to_token=table,
                                     req_to_state_slot=torch.zeros(table.shape[0], dtype=torch.int64,
                                                                   device=forward_batch.device))
        self.attn_backends = [_Step(self.backend_cls(runner), i) for i in range(self.speculative_num_steps - 1)]
        for i, step in enumerate(self.attn_backends):
            step.planned = step_batch(forward_batch, table, prefix, self.speculative_num_steps, i)
            step.backend.init_forward_metadata(step.planned)
