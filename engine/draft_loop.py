"""The draft loop as a draft worker runs it (SGLang: ``EagleWorkerV2.draft`` then ``draft_forward``): the multi-step
draft backend plans every step once, then each step runs the draft model's layers on its own step backend,
``topk`` tokens per request, one more position each step.

A DRAFT_DECODE batch holds every step's tokens (``BatchSpec``: each request's branches one after the other, step by
step within a branch); the loop takes step i's rows, request by request and branch by branch (SGLang's order of a
draft step's tokens), and puts each step's outputs back in the batch's row order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from batch.forward_batch import ForwardBatch, LayerInputs, LayerWeights
from batch.spec import BatchSpec, ForwardMode, draft_step_rows
from engine.graph_runner import capture_graph, load_token_rows
from engine.model import run_layer


# Modes a draft graph runner captures (a graph() over a leaf that declares DRAFT_DECODE among its cuda_graph_modes)
DRAFT_GRAPH_MODES = frozenset({ForwardMode.DRAFT_DECODE})


def step_view(fb: ForwardBatch, rows: torch.Tensor) -> ForwardBatch:
    """What the draft model holds at one step: a decode batch (SGLang's draft batch is one) with that step's
    positions and write slots."""
    idx = rows.to(fb.device)
    return dataclasses.replace(fb, forward_mode=ForwardMode.DECODE, positions=fb.positions[idx],
                               out_cache_loc=fb.out_cache_loc[idx],
                               extend_num_tokens=rows.numel(), num_token_non_padded=rows.numel())


def loop_order(drafter, batch_size: int, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each step's rows (on ``device``) and the permutation that puts step-major results back in batch row order."""
    K, steps = drafter.topk, drafter.speculative_num_steps
    by_step = [torch.tensor(draft_step_rows(batch_size, K, steps, step), dtype=torch.int64, device=device)
               for step in range(steps - 1)]
    return by_step, torch.argsort(torch.cat(by_step))


def run_loop(drafter, fb: ForwardBatch, layer_specs, inputs: list[LayerInputs], weights,
             fused_qkv: bool = False, rows=None) -> list[torch.Tensor]:
    """Every step's layers on its step backend, over a planned draft batch; one output per layer, in batch row order.
    ``rows``: :func:`loop_order`'s, made beforehand (a graph records the loop: no host copy may happen inside)."""
    by_step, order = rows or loop_order(drafter, fb.batch_size, fb.device)
    outputs = []
    for layer, inp, w in zip(layer_specs, inputs, weights):
        parts = []
        for step, rows in enumerate(by_step):
            step_inputs = LayerInputs({name: t[rows] for name, t in inp.tensors.items()})
            parts.append(run_layer(drafter.attn_backends[step], layer, step_inputs, w, step_view(fb, rows), None,
                                   fused_qkv))
        outputs.append(torch.cat(parts)[order])
    return outputs


def run_draft_steps(drafter, spec: BatchSpec, fb: ForwardBatch, inputs: list[LayerInputs], weights,
                    fused_qkv: bool = False) -> list[torch.Tensor]:
    """Plan the loop once, then run it (:func:`run_loop`)."""
    drafter.init_forward_metadata(fb)
    return run_loop(drafter, fb, spec.layers, inputs, weights, fused_qkv)


class DraftGraphRunner:
    """The draft loop under a CUDA graph, as SGLang's ``EAGLEDraftCudaGraphRunner`` runs it
    (speculative/eagle_draft_cuda_graph_runner.py): the container's ``init_cuda_graph_state(max_bs, max_bs * topk)``,
    a static batch of ``bs`` requests whose padded rows have the first step backend's fill value as length, request
    row 0 and write slot 0; at capture ``init_forward_metadata_out_graph(fb, in_capture=True)`` outside the graph,
    then ``init_forward_metadata_in_graph`` and every step recorded in one graph; each replay copies the real batch
    into the static buffers, pads the rest, re-plans outside the graph (``in_capture=False``, the padded rows
    counted in ``num_padding``) and replays. On the CPU nothing is recorded: the same planning calls run and each
    replay re-runs the loop over the static buffers (engine/graph_runner.py does the same for the other modes)."""

    def __init__(self, drafter, model_runner, template: ForwardBatch, layer_specs, weights: list[LayerWeights],
                 inputs_like: list[LayerInputs], bs: int, *, pad_value: float = 0.0) -> None:
        self.drafter, self.mr, self.bs = drafter, model_runner, bs
        self.layer_specs, self.weights, self.pad_value = list(layer_specs), weights, pad_value
        self.use_cuda_graph = model_runner.device.type == "cuda"
        self.mode = ForwardMode.DRAFT_DECODE
        K, steps = drafter.topk, drafter.speculative_num_steps
        width = K * (steps - 1)  # rows per request
        n, dev = bs * width, model_runner.device
        self.fill = fill = drafter.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((bs,), fill, dtype=torch.int64, device=dev)
        self.extend_prefix_lens = self.seq_lens.to(torch.int32)  # a draft batch's prefix is its committed length
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)  # slot 0: padding
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.mrope_positions = None
        self.inputs = [LayerInputs({name: torch.zeros((n,) + t.shape[1:], dtype=t.dtype, device=dev)
                                    for name, t in li.tensors.items()}) for li in inputs_like]
        seq_cpu = self.seq_lens.cpu()
        self.fb = replace(template, batch_size=bs, req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
                          seq_lens_cpu=seq_cpu, seq_lens_sum=int(seq_cpu.sum()),
                          extend_seq_lens=torch.full((bs,), width, dtype=torch.int32, device=dev),
                          extend_prefix_lens=self.extend_prefix_lens,
                          extend_start_loc=torch.arange(bs, dtype=torch.int32, device=dev) * width,
                          extend_seq_lens_cpu=[width] * bs, extend_prefix_lens_cpu=seq_cpu.tolist(),
                          extend_num_tokens=n, positions=self.positions, out_cache_loc=self.out_cache_loc,
                          state_slots=torch.zeros(bs, dtype=torch.int64, device=dev), spec_info=None,
                          num_token_non_padded=n, num_padding=0)
        self.rows = loop_order(drafter, bs, dev)
        self.graph = None
        self.outputs: list[torch.Tensor] = []

    @property
    def captured(self) -> str:
        return f"at {self.bs} x {self.drafter.topk} branches x {self.drafter.speculative_num_steps - 1} steps"

    def _loop(self) -> list[torch.Tensor]:
        return run_loop(self.drafter, self.fb, self.layer_specs, self.inputs, self.weights, rows=self.rows)

    def _plan_capture(self) -> None:
        self.drafter.init_cuda_graph_state(self.bs, self.bs * self.drafter.topk)
        self.drafter.init_forward_metadata_out_graph(self.fb, in_capture=True)

    def capture_plan(self) -> None:
        """The capture's planning alone: the graph state, the fill-value batch's out_graph plan and its in_graph step
        (run here, not recorded)."""
        self._plan_capture()
        self.drafter.init_forward_metadata_in_graph(self.fb)

    def capture(self) -> None:
        self._plan_capture()
        if not self.use_cuda_graph:
            return

        def recorded():
            self.drafter.init_forward_metadata_in_graph(self.fb)
            return self._loop()
        self.graph, self.outputs = capture_graph(recorded)

    def replay_plan(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> int:
        """The real batch loaded into the static one and padded, then the replay's planning; returns its rows."""
        n = fb.batch_size
        if n > self.bs:
            raise ValueError(f"a draft batch of {n} requests does not fit a graph captured for {self.bs}")
        t = fb.extend_num_tokens
        self.req_pool_indices.zero_()
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens.fill_(self.fill)
        self.seq_lens[:n].copy_(fb.seq_lens)
        load_token_rows(self, fb, inputs, t)
        self.extend_prefix_lens.copy_(self.seq_lens)
        seq_cpu = self.seq_lens.cpu()
        self.fb.seq_lens_cpu, self.fb.seq_lens_sum = seq_cpu, int(seq_cpu.sum())
        self.fb.extend_prefix_lens_cpu = seq_cpu.tolist()
        self.fb.num_padding = self.bs - n
        self.drafter.init_forward_metadata_out_graph(self.fb, in_capture=False)
        if self.graph is None:  # no recorded graph (CPU, or only planned): run the in-graph step it would replay
            self.drafter.init_forward_metadata_in_graph(self.fb)
        return t

    def replay(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> list[torch.Tensor]:
        """Run the real batch ``fb`` through the captured loop; each layer's output rows of the real tokens."""
        t = self.replay_plan(fb, inputs)
        if self.graph is not None:
            self.graph.replay()
            return [o[:t].clone() for o in self.outputs]
        return [o[:t].clone() for o in self._loop()]
