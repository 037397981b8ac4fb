"""SGLang's multi-step draft decode as the harness's draft loop drives it (engine/draft_loop.py).

The container is the one the server builds: ``DraftBackendFactory(draft_runner, topk, num_steps)
.create_decode_backend()`` (speculative/draft_utils.py) over an SGLang runner configured with the leaf's backend,
so the factory's choice (``TritonMultiStepDraftBackend``, ``FlashInferMultiStepDraftBackend``, ...) is SGLang's.
The draft batch is built as ``prepare_for_draft`` builds it (speculative/eagle_worker_common.py, the path without
a KV location plan: a draft tree, or a chain on a CPU): mode DECODE, ``seq_lens`` the committed lengths,
``out_cache_loc`` every request's ``topk * num_steps`` draft slots read from its cache row (SGLang's
``assign_draft_cache_locs_contiguous``), the positions each branch's step-0 token sits at, and an
``EagleDraftInput``. The container plans every step once (``init_forward_metadata``); before step i the loop sets the
batch's write slots to that step's (``per_step_draft_out_cache_loc(...)[i]``), and after it advances the positions
by one, as ``EagleWorkerV2.draft_forward`` does; step i's layers run under a forward context whose backend is
``attn_backends[i]``.
"""

from __future__ import annotations

import torch

from backends.sglang import compat, runtime


def draft_out_cache_loc(fb, topk: int, num_steps: int) -> torch.Tensor:
    """``[B * topk * num_steps]``: each request's draft slots, ``req_to_token[row, seq_len : seq_len + topk *
    num_steps]`` (branch-major), as SGLang's allocator hands them to ``assign_draft_cache_locs_contiguous``."""
    rows = fb.req_to_token[fb.req_pool_indices]
    width = topk * num_steps
    cols = fb.seq_lens[:, None] + torch.arange(width, device=fb.device)[None, :]
    return rows.gather(1, cols).reshape(-1).to(torch.int64)


class _SglangStep:
    """Draft step i as the draft model's layers reach it: the container's ``attn_backends[i]`` under SGLang's forward
    context, on the draft batch with step i's write slots."""

    def __init__(self, draft: "SglangMultiStepDraft", index: int) -> None:
        self.draft = draft
        self.index = index

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.draft.run_step(self.index, q, k, v, layer, forward_batch, save_kv_cache)


class SglangMultiStepDraft:
    """SGLang's multi-step draft backend for one leaf (see the module docstring)."""

    def __init__(self, leaf_cls, model_runner, topk: int, speculative_num_steps: int) -> None:
        self.leaf = leaf_cls(model_runner)  # builds SGLang's layers (RadixAttention) and runs them
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.inner = None  # SGLang's container
        self.sfb = None
        self.per_step_loc: torch.Tensor | None = None
        self.step_positions: torch.Tensor | None = None
        self.attn_backends: list[_SglangStep] = []
        self.steps_run = 0

    def _build(self) -> None:
        sgl = self.leaf.sgl
        K, S = self.topk, self.speculative_num_steps
        # The server's draft token count for a tree is its own flag; any count >= num_steps + 1 sizes the same
        # container (the draft decode reads topk and num_steps)
        runner = runtime.make_runner(self.model_runner, self.leaf.sglang_name, K * (S - 1) + 1, K, num_steps=S)
        self.leaf.sgl_runner = runner
        # Up to 0.5.1x the factory also takes the server args first (it reads the draft backend flag there)
        factory = sgl.DraftBackendFactory(**compat.accepted(sgl.DraftBackendFactory, dict(
            server_args=runner.server_args, draft_model_runner=runner, topk=K, speculative_num_steps=S)))
        self.inner = factory.create_decode_backend()

    def init_forward_metadata(self, forward_batch) -> None:
        fb, sgl = forward_batch, self.leaf.sgl
        if self.inner is None:
            self._build()
        K, S = self.topk, self.speculative_num_steps
        loc = draft_out_cache_loc(fb, K, S)
        positions = fb.seq_lens.repeat_interleave(K)
        sfb = sgl.ForwardBatch(
            forward_mode=sgl.ForwardMode.DECODE, batch_size=fb.batch_size,
            input_ids=torch.zeros(fb.batch_size * K, dtype=torch.int64, device=fb.device),
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens.to(torch.int32),
            seq_lens_cpu=fb.seq_lens_cpu.to(torch.int32), out_cache_loc=loc, seq_lens_sum=fb.seq_lens_sum,
            positions=positions.clone())
        sfb.global_num_token_non_padded_cpu = fb.batch_size * K
        compat.bind_kv_indices(self.leaf.sgl_runner, sfb, False)
        compat.attach_pools(sfb, self.leaf.sgl_runner)
        info = sgl.EagleDraftInput()
        info.num_tokens_per_req = K
        info.num_tokens_for_logprob_per_req = K
        info.positions = positions
        info.capture_hidden_mode = sgl.CaptureHiddenMode.LAST
        sfb.spec_info = info
        sfb.spec_algorithm = sgl.SpeculativeAlgorithm.EAGLE
        self.sfb = sfb
        # The write slots step by step, as draft_forward slices them: [num_steps, B * topk]
        self.per_step_loc = loc.view(fb.batch_size, K, S).permute(2, 0, 1).reshape(S, -1)
        with compat.backend_scope(sgl, self.inner, sfb):
            self.inner.init_forward_metadata(sfb)
        self.attn_backends = [_SglangStep(self, i) for i in range(S - 1)]
        self.steps_run = 0

    def step_plans(self) -> list:
        """Each step's plan as the leaf reads its backend's (``planned_metadata``), in step order."""
        leaf, plans = self.leaf, []
        saved = leaf.inner, leaf.batches
        try:
            for step in self.inner.attn_backends:
                leaf.inner, leaf.batches = step, {0: self.sfb}
                plans.append(leaf.planned_metadata())
        finally:
            leaf.inner, leaf.batches = saved
        return plans

    def run_step(self, index: int, q, k, v, layer, forward_batch, save_kv_cache: bool):
        sfb = self.sfb
        if sfb is None:
            raise RuntimeError(f"draft step {index} ran before the draft loop was planned")
        while self.steps_run < index:  # the loop moved on: one position further per step, as draft_forward adds
            sfb.positions.add_(1)
            self.steps_run += 1
        sfb.out_cache_loc = self.per_step_loc[index]
        leaf = self.leaf
        leaf.batches = {id(forward_batch): sfb}
        return leaf._run(q, k, v, layer, forward_batch, save_kv_cache, via=self.inner.attn_backends[index])
