"""SGLang's multi-step draft decode as the harness's draft loop drives it (engine/draft_loop.py).

The container is the one the server builds: ``DraftBackendFactory(draft_runner, topk, num_steps)
.create_decode_backend()`` (speculative/draft_utils.py) over an SGLang runner configured with the leaf's backend,
so the factory's choice (``TritonMultiStepDraftBackend``, ``FlashInferMultiStepDraftBackend``, ...) is SGLang's.
The draft batch is built as ``prepare_for_draft`` builds it (speculative/eagle_worker_common.py, the path without
a KV location plan: a draft tree, or a chain on a CPU): mode DECODE, ``seq_lens`` the committed lengths,
``out_cache_loc`` every request's ``topk * num_steps`` draft slots (the slots ``assign_draft_cache_locs_contiguous``
copies from its cache row, here the harness batch's write slots: ``draft_out_cache_loc``), the positions each
branch's step-0 token sits at, and an ``EagleDraftInput``. The container plans every step once
(``init_forward_metadata``); for step i the batch carries that step's write slots (SGLang's
``per_step_draft_out_cache_loc(...)[i]``) and positions one further per step, as ``EagleWorkerV2.draft_forward`` moves
it on; step i's layers run under a forward context whose backend is ``attn_backends[i]``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from backends.sglang import compat, handover, runtime
from batch.spec import draft_region


def draft_out_cache_loc(fb, topk: int, num_steps: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[B * topk * num_steps]``, request by request, branch by branch, step by step: the slots SGLang's
    ``assign_draft_cache_locs_contiguous`` copies from each request's cache row (prepare_for_draft), here the harness
    batch's write slots (its rows hold steps 0..num_steps-2 of each branch, in that order) and, for the last step, which
    no step writes or reads, the slot its cache row holds there (the next column of the branch's region,
    batch.spec.draft_region). Older releases read the whole window (0.5.10's FlashAttention graph replay counts each
    branch's distinct pages over every step's slot, flashattention_backend.py:1801-1811), so a stand-in slot there is
    a page no server hands it. A graph's padded rows read request row 0, which holds the padding slot 0 (SGLang's
    runner zeroes their slots)."""
    B = fb.batch_size
    loc = torch.zeros(B, topk, num_steps, dtype=torch.int64, device=fb.device) if out is None else \
        out.view(B, topk, num_steps)
    loc[:, :, :num_steps - 1] = fb.out_cache_loc.view(B, topk, num_steps - 1)
    # the last step's column in each branch's region (batch.spec.draft_region: its first column and its tail)
    last = torch.tensor([[sum(draft_region(int(p), fb.page_size, topk, num_steps, j)) + num_steps - 1
                          for j in range(topk)] for p in fb.seq_lens_cpu.tolist()], dtype=torch.int64, device=fb.device)
    loc[:, :, num_steps - 1] = fb.req_to_token[fb.req_pool_indices.to(torch.int64)[:, None], last]
    return loc.reshape(-1)


class _SglangStep:
    """Draft step i as the draft model's layers reach it: the container's ``attn_backends[i]`` under SGLang's forward
    context, on the draft batch with step i's write slots."""

    def __init__(self, draft: "SglangMultiStepDraft", index: int) -> None:
        self.draft = draft
        self.index = index

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.draft.run_step(self.index, q, k, v, layer, forward_batch, save_kv_cache)


class SglangMultiStepDraft:
    """SGLang's multi-step draft backend for one leaf (see the module docstring). Under a graph it is driven as
    ``EAGLEDraftCudaGraphRunner`` drives it (speculative/eagle_draft_cuda_graph_runner.py): ``init_cuda_graph_state``
    once, the static batch planned at capture (``init_forward_metadata_out_graph(fb, in_capture=True)``), each replay
    re-planned over the same static SGLang batch (``in_capture=False``, with the padded rows counted), and the
    in-graph step recorded before the steps."""

    def __init__(self, leaf_cls, model_runner, topk: int, speculative_num_steps: int, draft_window_size: int = 0,
                 draft_sink_size: int = 0) -> None:
        self.leaf = leaf_cls(model_runner)  # builds SGLang's layers (RadixAttention) and runs them
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.draft_window = (draft_window_size, draft_sink_size)  # the server's flags, read when SGLang builds it
        self.inner = None  # SGLang's container
        self.sfb = None
        self.per_step_loc: torch.Tensor | None = None
        self.step0_positions: torch.Tensor | None = None
        self.attn_backends: list[_SglangStep] = []
        self.graph = False  # the last plan was a graph's (over the static batch)

    def _build(self) -> None:
        sgl = self.leaf.sgl
        K, S = self.topk, self.speculative_num_steps
        # The server's draft token count for a tree is its own flag; any count >= num_steps + 1 sizes the same
        # container (the draft decode reads topk and num_steps)
        runner = runtime.make_runner(self.model_runner, self.leaf.sglang_name, K * (S - 1) + 1, K, num_steps=S,
                                     draft_window=self.draft_window)
        self.leaf.sgl_runner = runner
        # Up to 0.5.1x the factory also takes the server args first (it reads the draft backend flag there)
        factory = sgl.DraftBackendFactory(**compat.accepted(sgl.DraftBackendFactory, dict(
            server_args=runner.server_args, draft_model_runner=runner, topk=K, speculative_num_steps=S)))
        with type(self.leaf).engine_build_scope():
            self.inner = factory.create_decode_backend()

    def _translate(self, fb, graph: bool):
        """The draft batch as ``prepare_for_draft`` builds it (eager) or as the draft graph runner's static batch
        (``graph``: lengths viewing the static int64 buffer, SGLang's own write slots zero on padded rows)."""
        sgl, K, S = self.leaf.sgl, self.topk, self.speculative_num_steps
        loc = draft_out_cache_loc(fb, K, S)
        positions = fb.seq_lens.repeat_interleave(K)
        # int64 lengths, as prepare_for_draft hands over the scheduler's (ScheduleBatch.seq_lens, schedule_batch.py:
        # 2786; ForwardBatch.init_new keeps them): FlashAttention's paged tree steps subtract each request's last
        # partial page in place from `seq_lens.to(torch.int32)` (flashattention_backend.py:1335-1338), which an int32
        # batch would alias, so that each later step planned over lengths the first had cut
        sfb = sgl.ForwardBatch(
            forward_mode=sgl.ForwardMode.DECODE, batch_size=fb.batch_size,
            input_ids=torch.zeros(fb.batch_size * K, dtype=torch.int64, device=fb.device),
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens.to(torch.int64),
            seq_lens_cpu=fb.seq_lens_cpu.to(torch.int64), out_cache_loc=loc, seq_lens_sum=fb.seq_lens_sum,
            positions=positions)
        sfb.global_num_token_non_padded_cpu = fb.batch_size * K
        compat.bind_kv_indices(self.leaf.sgl_runner, sfb, graph)
        compat.attach_pools(sfb, self.leaf.sgl_runner)
        info = sgl.EagleDraftInput()
        info.num_tokens_per_req = K
        info.num_tokens_for_logprob_per_req = K
        info.positions = positions
        info.capture_hidden_mode = sgl.CaptureHiddenMode.LAST
        sfb.spec_info = info
        sfb.spec_algorithm = sgl.SpeculativeAlgorithm.EAGLE
        if not graph and handover.first_handover(fb, "draft"):  # a batch prepare_for_draft never builds: the adapter's error
            handover.check(sfb, None, loc)
        self.sfb, self.loc, self.step0_positions = sfb, loc, positions
        # The write slots step by step, as draft_forward slices them: [num_steps, B * topk]
        self.per_step_loc = torch.empty(S, fb.batch_size * K, dtype=torch.int64, device=fb.device)
        self._slice_steps()
        self.attn_backends = [_SglangStep(self, i) for i in range(S - 1)]
        return sfb

    def _slice_steps(self) -> None:
        """Each step's write slots, as ``draft_forward`` slices the window: SGLang's ``per_step_draft_out_cache_loc``
        where the release has it (0.5.23), else the reshape its older draft_forward makes inline."""
        K, S = self.topk, self.speculative_num_steps
        B = self.per_step_loc.shape[1] // K
        slices = self.leaf.sgl.per_step_draft_out_cache_loc
        if slices is not None:
            self.per_step_loc.copy_(slices(self.loc, B, K, S))
        else:
            self.per_step_loc.copy_(self.loc.view(B, K, S).permute(2, 0, 1).reshape(S, -1))

    def init_forward_metadata(self, forward_batch) -> None:
        if self.inner is None:
            self._build()
        sfb = self._translate(forward_batch, graph=False)
        self.graph = False
        with compat.backend_scope(self.leaf.sgl, self.inner, sfb):
            self.inner.init_forward_metadata(sfb)

    # ---- CUDA graphs, as EAGLEDraftCudaGraphRunner drives the container ----
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The padded rows' length: the first step backend's (the runner asks ``attn_backends[0]``)."""
        if self.inner is None:
            self._build()
        return self.inner.attn_backends[0].get_cuda_graph_seq_len_fill_value()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.inner is None:
            self._build()
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """At capture the static batch is translated once (the graph holds its tensors); before each replay its
        buffers are refreshed in place from the harness's static batch and SGLang's replay plan runs over it."""
        fb, sgl = forward_batch, self.leaf.sgl
        if in_capture or self.sfb is None or not self.graph:
            sfb = self._translate(fb, graph=True)
        else:
            # The runner's replay: the static buffers refilled in place (the graph reads them), the batch's write
            # slots and positions back to the whole draft window and step 0 (draft_forward's backups)
            sfb = self.sfb
            draft_out_cache_loc(fb, self.topk, self.speculative_num_steps, out=self.loc)
            self._slice_steps()
            self.step0_positions.copy_(fb.seq_lens.repeat_interleave(self.topk))
            sfb.out_cache_loc, sfb.positions = self.loc, self.step0_positions
            sfb.seq_lens_cpu = fb.seq_lens_cpu
            sfb.seq_lens_sum = fb.seq_lens_sum
        self.graph = True
        padded = getattr(fb, "num_padding", 0) or 0
        if not in_capture:  # the real rows as prepare_for_draft builds them, or the harness's runner loaded them wrong
            handover.check_replay(sfb, padded, self.loc, None)
        with compat.backend_scope(sgl, self.inner, sfb):
            if features_three_method():
                # The runner hands its replay a view carrying num_padding (eagle_draft_cuda_graph_runner.py:738)
                view = sfb if in_capture else SimpleNamespace(**vars(sfb), num_padding=padded)
                self.inner.init_forward_metadata_out_graph(view, in_capture=in_capture)
            elif in_capture:
                self.inner.init_forward_metadata_capture_cuda_graph(sfb)
            else:
                self.inner.init_forward_metadata_replay_cuda_graph(sfb, sfb.batch_size)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        if features_three_method():
            with compat.backend_scope(self.leaf.sgl, self.inner, self.sfb):
                self.inner.init_forward_metadata_in_graph(self.sfb)

    def step_plans(self) -> list:
        """Each step's plan as the leaf reads its backend's (``planned_metadata``), in step order (a graph's cut to
        what its kernels read). A replayed step is read as the leaf reads a replayed plan (``planned_graph``): FlashInfer
        MLA's replay plans from host indptrs and leaves its wrapper's device kv_indptr at the capture's values, which
        no kernel reads (flashinfer.graph_plan)."""
        leaf, plans = self.leaf, []
        saved = leaf.inner, leaf.batches, leaf.planned_graph
        try:
            for step in self.inner.attn_backends:
                leaf.inner, leaf.batches, leaf.planned_graph = step, {0: self.sfb}, self.graph
                plan = leaf.planned_metadata()
                if self.graph and plan.kv_indices is not None:
                    # A captured step keeps the capture's slice of the container's static index row: its kernels read
                    # that row through the slice's pointer as far as the replayed kv_indptr says, so the plan is the row
                    plan = dataclasses.replace(plan, kv_indices=to_end_of_storage(plan.kv_indices)).cut_to_indptrs()
                elif plan.kv_indices is not None and self.draft_window[0] > 0:
                    # An eager step's slice is as long as the unwindowed prefixes would need (draft_kv_indices_used_len
                    # from seq_lens_sum, "over-estimate is safe"); under a draft window its kernels read less of it,
                    # as far as kv_indptr says
                    plan = plan.cut_to_indptrs()
                # A step's window list is its row of the container's window rail, as wide as every branch's whole
                # window (_fill_window_rail: bs x window); its kernels read it as far as its indptr says
                plans.append(plan.cut_window())
        finally:
            leaf.inner, leaf.batches, leaf.planned_graph = saved
        return plans

    def run_step(self, index: int, q, k, v, layer, forward_batch, save_kv_cache: bool):
        sfb = self.sfb
        if sfb is None:
            raise RuntimeError(f"draft step {index} ran before the draft loop was planned")
        # Step i writes its own slots and sits i positions past step 0, as draft_forward moves the batch on; after the
        # layer the batch is the whole window at step 0 again, as the draft graph runner restores it after the loop
        # (eagle_draft_cuda_graph_runner.py run_once), so whatever plans after the loop sees what it planned
        sfb.out_cache_loc = self.per_step_loc[index]
        sfb.positions = self.step0_positions + index
        leaf = self.leaf
        leaf.batches = {id(forward_batch): sfb}
        try:
            return leaf._run(q, k, v, layer, forward_batch, save_kv_cache, via=self.inner.attn_backends[index])
        finally:
            sfb.out_cache_loc, sfb.positions = self.loc, self.step0_positions


def to_end_of_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view ``t`` widened to the end of the storage it views (what a kernel handed its pointer may
    read)."""
    remaining = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.as_strided(t, (remaining,), (1,), t.storage_offset())


def features_three_method() -> bool:
    """Whether the installed SGLang's containers take the three-method graph contract (0.5.14 on)."""
    from backends.sglang import features

    return features.chosen("graph_contract") == "three_method_graph_contract"
