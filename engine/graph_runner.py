"""CUDA-graph capture and replay of a backend composition, as SGLang 0.5.23's graph runner does it.

Capture happens once per padded batch size over a static ForwardBatch with dummy lengths (the fill value):
``init_forward_metadata_out_graph(fb, in_capture=True)`` outside the graph, then, inside the capture,
``init_forward_metadata_in_graph(fb)`` and the layers. Each replay copies the real batch into the static
buffers, pads the rest, calls ``init_forward_metadata_out_graph(fb, in_capture=False)`` (which must refresh
every host-planned buffer the graph reads) and replays (the recorded in-graph metadata ops first). Piecewise:
full-attention layers are captured, one graph per layer, while linear-attention layers run eagerly between
them (their kernels plan on the host and must not be frozen into a graph); the in-graph metadata step is its
own graph, replayed before the layers.

On the CPU there are no graphs: the same out_graph calls run, and "replay" calls ``in_graph`` and re-runs the
captured functions over the static buffers. That exercises the planning logic (a buffer out_graph forgets to
refresh gives a wrong answer there too); only host-side values frozen by a real capture need the GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from batch.forward_batch import ForwardBatch, LayerInputs, LayerWeights, ModelRunner
from batch.spec import ForwardMode
from engine.model import prepare_batch, run_layer

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)
CAPTURE_LINEAR_LAYERS = False  # piecewise: linear-attention layers stay eager


def padded_size(bs: int) -> int:
    for size in CAPTURE_SIZES:
        if size >= bs:
            return size
    raise ValueError(f"batch of {bs} is larger than the largest capture size {CAPTURE_SIZES[-1]}")


class GraphRunner:
    """Captures ``backend`` for DECODE batches of ``max_bs`` rows over ``model_runner``'s pools."""

    def __init__(self, backend, model_runner: ModelRunner, template: ForwardBatch, layer_specs,
                 weights: list[LayerWeights], inputs_like: list[LayerInputs], bs: int,
                 mrope_sections: tuple[int, int, int] | None = None) -> None:
        self.backend, self.mr, self.bs = backend, model_runner, bs
        self.mrope_sections = mrope_sections
        self.layer_specs, self.weights = list(layer_specs), weights
        self.use_cuda_graph = model_runner.device.type == "cuda"
        dev = model_runner.device
        fill = backend.get_cuda_graph_seq_len_fill_value()
        self.fill = fill
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((bs,), fill, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=dev)  # slot 0: padding
        self.positions = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.state_slots = torch.zeros(bs, dtype=torch.int64, device=dev)  # state slot 0: padding
        # Multimodal models rotate by the three mrope rows; a graph must read them from a static buffer too.
        self.mrope_positions = (None if template.mrope_positions is None
                                else torch.zeros(3, bs, dtype=template.mrope_positions.dtype, device=dev))
        self.inputs = [LayerInputs({n: torch.zeros((bs,) + t.shape[1:], dtype=t.dtype, device=dev)
                                    for n, t in li.tensors.items()}) for li in inputs_like]
        self.fb = replace(template, forward_mode=ForwardMode.DECODE, batch_size=bs,
                          req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
                          seq_lens_cpu=self.seq_lens.cpu(), seq_lens_sum=bs * fill,
                          extend_seq_lens=torch.ones(bs, dtype=torch.int32, device=dev),
                          extend_prefix_lens=(self.seq_lens - 1).to(torch.int32),
                          extend_start_loc=torch.arange(bs, dtype=torch.int32, device=dev),
                          extend_seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[fill - 1] * bs,
                          extend_num_tokens=bs, positions=self.positions, mrope_positions=self.mrope_positions,
                          out_cache_loc=self.out_cache_loc, state_slots=self.state_slots, spec_info=None,
                          num_token_non_padded=bs, tbo_children=None)
        self.metadata_graph: torch.cuda.CUDAGraph | None = None  # init_forward_metadata_in_graph, recorded
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self.outputs: list[torch.Tensor | None] = []

    def _captured(self, spec) -> bool:
        return spec.kind != "linear" or CAPTURE_LINEAR_LAYERS

    def _layer_fn(self, i: int):
        return lambda: run_layer(self.backend, self.layer_specs[i], self.inputs[i], self.weights[i], self.fb,
                                 self.mrope_sections)

    def _capture_graph(self, fn):
        """Warm ``fn`` up on a side stream (kernels compile and allocate outside the graph), then capture it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():  # a composition with no in-graph metadata ops records an empty graph
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph):
                out = fn()
        return graph, out

    def _in_graph(self) -> None:
        self.backend.init_forward_metadata_in_graph(self.fb)

    def capture(self) -> None:
        self.backend.init_cuda_graph_state(self.bs, self.bs)
        self.backend.init_forward_metadata_out_graph(self.fb, in_capture=True)
        if self.use_cuda_graph:
            self.metadata_graph, _ = self._capture_graph(self._in_graph)
        for i, spec in enumerate(self.layer_specs):
            if not (self.use_cuda_graph and self._captured(spec)):
                self.graphs.append(None)
                self.outputs.append(None)
                continue
            graph, out = self._capture_graph(self._layer_fn(i))
            self.graphs.append(graph)
            self.outputs.append(out)

    def replay(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> list[torch.Tensor]:
        """Run the real batch ``fb`` (DECODE, at most ``bs`` requests) through the captured graphs."""
        n = fb.batch_size
        self.req_pool_indices.zero_()
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens.fill_(self.fill)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.out_cache_loc.zero_()
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        self.positions.zero_()
        self.positions[:n].copy_(fb.positions)
        if self.mrope_positions is not None:
            self.mrope_positions.zero_()
            self.mrope_positions[:, :n].copy_(fb.mrope_positions)
        self.state_slots.copy_(self.mr.req_to_state_slot[self.req_pool_indices])
        for static, real in zip(self.inputs, inputs):
            for name, t in static.tensors.items():
                t.zero_()
                t[:n].copy_(real.tensors[name])
        seq_cpu = self.seq_lens.cpu()
        # Host-side copies of the lengths, as a replayed batch carries them.
        self.fb.seq_lens_cpu = seq_cpu
        self.fb.seq_lens_sum = int(seq_cpu.sum())
        self.fb.extend_prefix_lens.copy_((self.seq_lens - 1).to(torch.int32))
        self.fb.extend_prefix_lens_cpu = (seq_cpu - 1).tolist()
        self.backend.init_forward_metadata_out_graph(self.fb, in_capture=False)
        if self.metadata_graph is not None:
            self.metadata_graph.replay()
        else:
            self._in_graph()  # no graphs (CPU): run what capture would have recorded
        outs = []
        for i, spec in enumerate(self.layer_specs):
            graph = self.graphs[i]
            if graph is not None:
                graph.replay()
                outs.append(self.outputs[i][:n].clone())
            else:
                outs.append(self._layer_fn(i)()[:n].clone())
        return outs


def eager_decode(backend, fb: ForwardBatch, layer_specs, inputs, weights, mrope_sections=None) -> list[torch.Tensor]:
    """The same DECODE batch run eagerly, as graph replay must reproduce it."""
    prepare_batch(backend, fb, layer_specs)
    return [run_layer(backend, s, i, w, fb, mrope_sections) for s, i, w in zip(layer_specs, inputs, weights)]
