"""CUDA-graph capture and replay of a backend composition, as SGLang 0.5.23's graph runners do it.

Modes: DECODE and TARGET_VERIFY (SGLang's ``DecodeCudaGraphRunner``), DRAFT_EXTEND (its
``EAGLEDraftExtendCudaGraphRunner``, mode DRAFT_EXTEND_V2), and IDLE: an idle rank's batch replays the captured
DECODE graph with every row padding (``build_replay_fb_view``: ``forward_mode`` is the capture mode while
the batch's own mode is IDLE). A graph holds a fixed number of tokens per request, the *width*: 1 in decode,
``draft_token_num`` in verify and draft extend; a batch of another width is not replayed (SGLang's
``can_run_graph`` sends it to eager), so draft-extend graphs take the fixed-width batches EAGLE v2 makes.

Capture happens once per padded batch size over a static ForwardBatch with dummy lengths (the fill value):
``init_cuda_graph_state``, ``init_forward_metadata_out_graph(fb, in_capture=True)`` outside the graph, then,
inside the capture, ``init_forward_metadata_in_graph(fb)`` and the layers. Each replay copies the real batch
into the static buffers, pads the rest as SGLang pads it (``req_pool_indices`` 0, ``seq_lens`` the backend's
fill value, ``out_cache_loc`` and positions 0, per-token inputs ``pad_value``), calls
``init_forward_metadata_out_graph(fb, in_capture=False)`` (which must refresh every host-planned buffer the
graph reads) and replays (the recorded in-graph metadata ops first). One graph per layer; linear-attention
layers run eagerly between them (piecewise: their kernels plan on the host and must not be frozen into a graph)
unless the composition declares them graph-safe (``capture_linear``: SGLang's decode graphs capture its GDN and
lightning layers, planned on static buffers); the in-graph metadata step is its own graph.

Two-batch overlap: as SGLang's ``TboCudaGraphRunnerPlugin``, the runner splits the static batch at capture
(``split_tbo``) and the layers run each half through the wrapper's child backends; at replay the wrapper
receives the batch without children and derives its halves' plans from the padded batch itself, as SGLang's
``TboAttnBackend`` does from the replay view. A wrapper that splits with an engine's own splitter attaches
the children itself.

On the CPU there are no graphs: the same planning calls run (capture plans the dummy batch but runs no layer:
SGLang's warm-up forward only compiles kernels), and "replay" calls ``in_graph`` and re-runs the layers over
the static buffers. That
exercises the planning logic (a buffer out_graph forgets to refresh gives a wrong answer there too); only
host-side values frozen by a real capture need the GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace

import torch

from batch.forward_batch import ForwardBatch, LayerInputs, LayerWeights, ModelRunner, SpecInfo
from batch.spec import BatchSpec, ForwardMode, is_recurrent
from batch.tbo_split import attach_tbo_children
from engine.model import prepare_batch, run_layer_overlapped

# SGLang's default decode capture sizes up to 256 requests (arg_groups/cuda_graph_hook.py:510-515, without
# speculative decoding); the gpu profile's widest batches (160 requests) fit.
CAPTURE_SIZES = (1, 2, 4, 8, 12) + tuple(range(16, 257, 8))
CAPTURE_LINEAR_LAYERS = False  # piecewise: linear-attention layers stay eager
# Every mode a graph can be captured for, and the mode each is captured as.
GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE})


def capture_sizes(max_requests: int) -> tuple[int, ...]:
    """The batch sizes captured for a request pool of ``max_requests``, as SGLang's
    ``get_batch_sizes_to_capture`` picks them (runner/base_cuda_graph_runner.py:77-102): none larger than the
    pool, and the pool's size itself when the configured sizes go past it (backends size their graph buffers
    by the pool: a larger capture overruns them)."""
    sizes = {size for size in CAPTURE_SIZES if size <= max_requests}
    if CAPTURE_SIZES[-1] > max_requests:
        sizes.add(max_requests)
    return tuple(sorted(sizes))


def _smallest_fitting(sizes: tuple[int, ...], n: int, what: str) -> int:
    """The first of the ascending ``sizes`` that holds ``n``."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{what} of {n} is larger than the largest capture size {sizes[-1]}")


def padded_size(bs: int, max_requests: int) -> int:
    """The capture size a batch of ``bs`` requests replays at, over a request pool of ``max_requests`` (an idle
    batch: the smallest)."""
    return _smallest_fitting(capture_sizes(max_requests), bs, "batch")


def replay_size(spec: BatchSpec, max_requests: int) -> int:
    """The capture size ``spec``'s batch replays at: the smallest that holds its requests and the padded rows it
    asks for (``BatchSpec.graph_padding``)."""
    return padded_size(spec.batch_size + spec.graph_padding, max_requests)


def capture_mode(mode: ForwardMode) -> ForwardMode:
    """The mode a graph serving ``mode`` batches is captured in: an idle batch replays the decode graph."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"no CUDA graph is captured for {mode.value} batches "
                         f"(graphs: {', '.join(sorted(m.value for m in GRAPH_MODES))})")
    return ForwardMode.DECODE if mode.is_idle() else mode


def graph_width(mode: ForwardMode, spec_info: SpecInfo | None) -> int:
    """Tokens per request in a graph of ``mode``: 1 for decode, the draft token count for verify and draft
    extend."""
    mode = capture_mode(mode)
    return 1 if mode.is_decode() else spec_info.draft_token_num


def load_token_rows(runner, fb: ForwardBatch, inputs: list[LayerInputs], t: int) -> None:
    """Copy the real batch's ``t`` token rows into a graph runner's static token buffers (``positions``,
    ``out_cache_loc``, ``mrope_positions``, ``inputs``) and pad the rest: positions and slots 0 (slot 0 is the
    padding slot), per-token inputs the runner's ``pad_value``."""
    runner.out_cache_loc.zero_()
    runner.out_cache_loc[:t].copy_(fb.out_cache_loc)
    runner.positions.zero_()
    runner.positions[:t].copy_(fb.positions)
    if runner.mrope_positions is not None:
        runner.mrope_positions.zero_()
        runner.mrope_positions[:, :t].copy_(fb.mrope_positions)
    for static, real in zip(runner.inputs, inputs):
        for name, x in static.tensors.items():
            x.fill_(runner.pad_value if x.is_floating_point() else 0)
            x[:t].copy_(real.tensors[name])


def capture_graph(fn):
    """Warm ``fn`` up on a side stream (kernels compile and allocate outside the graph), then capture it; returns the
    graph and what ``fn`` returned in it (the tensors a replay refills)."""
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


class GraphRunner:
    """Captures ``backend`` for batches like ``template`` (its mode and speculative shape) at ``bs`` requests
    over ``model_runner``'s pools. ``pad_value`` fills the padded rows' per-token inputs (a property passes
    NaN, so that a padded row leaking into a real one shows). ``capture_linear``: the linear layers are
    captured too (``Support.graph_captures_linear``)."""

    def __init__(self, backend, model_runner: ModelRunner, template: ForwardBatch, layer_specs,
                 weights: list[LayerWeights], inputs_like: list[LayerInputs], bs: int,
                 mrope_sections: tuple[int, int, int] | None = None, *, split_tbo: bool = False,
                 pad_value: float = 0.0, capture_linear: bool = False) -> None:
        self.backend, self.mr, self.bs = backend, model_runner, bs
        self.capture_linear = capture_linear
        self.mrope_sections = mrope_sections
        self.layer_specs, self.weights = list(layer_specs), weights
        self.split_tbo, self.pad_value = split_tbo, pad_value
        self.use_cuda_graph = model_runner.device.type == "cuda"
        self.mode = capture_mode(template.forward_mode)
        spec_template = template.spec_info if self.mode is not ForwardMode.DECODE else None
        self.width = W = graph_width(self.mode, spec_template)
        n = bs * W
        dev = model_runner.device
        fill = backend.get_cuda_graph_seq_len_fill_value()
        self.fill = fill
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((bs,), fill, dtype=torch.int64, device=dev)
        self.extend_prefix_lens = self._padded_prefix(self.seq_lens).to(torch.int32)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)  # slot 0: padding
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.state_slots = torch.zeros(bs, dtype=torch.int64, device=dev)  # state slot 0: padding
        # Multimodal models rotate by the three mrope rows; a graph must read them from a static buffer too.
        self.mrope_positions = (None if template.mrope_positions is None
                                else torch.zeros(3, n, dtype=template.mrope_positions.dtype, device=dev))
        self.inputs = [LayerInputs({name: torch.zeros((n,) + t.shape[1:], dtype=t.dtype, device=dev)
                                    for name, t in li.tensors.items()}) for li in inputs_like]
        self.spec_template = spec_template
        seq_cpu = self.seq_lens.cpu()
        self.fb = replace(template, forward_mode=self.mode, batch_size=bs,
                          req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
                          seq_lens_cpu=seq_cpu, seq_lens_sum=int(seq_cpu.sum()),
                          extend_seq_lens=torch.full((bs,), W, dtype=torch.int32, device=dev),
                          extend_prefix_lens=self.extend_prefix_lens,
                          extend_start_loc=torch.arange(bs, dtype=torch.int32, device=dev) * W,
                          extend_seq_lens_cpu=[W] * bs, extend_prefix_lens_cpu=self.extend_prefix_lens.tolist(),
                          extend_num_tokens=n, positions=self.positions, mrope_positions=self.mrope_positions,
                          out_cache_loc=self.out_cache_loc, state_slots=self.state_slots,
                          spec_info=self._padded_spec_info(None), num_token_non_padded=n,
                          tbo_split_seq_index=None, tbo_split_token_index=None, tbo_children=None)
        self.metadata_graph: torch.cuda.CUDAGraph | None = None  # init_forward_metadata_in_graph, recorded
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self.outputs: list[torch.Tensor | None] = []

    # ---- the static batch ----
    def _padded_prefix(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Cached tokens before a row's new ones, from its ``seq_lens`` (a padded row: from the fill value)."""
        if self.mode.is_target_verify():
            return seq_lens.clone()  # verify's seq_lens count the cached tokens only
        return (seq_lens - self.width).clamp(min=0)

    def _padded_spec_info(self, real: SpecInfo | None) -> SpecInfo | None:
        """The speculative inputs of the padded batch: the real requests' then, for each padded row, a chain
        of ``width`` drafts whose mask block (over ``fill`` cached tokens) lets it see everything."""
        t = self.spec_template
        if t is None:
            return None
        W, bs, dev = self.width, self.bs, self.mr.device
        n_real = 0 if real is None else real.parents.shape[0]
        pad = bs - n_real
        chain = torch.arange(-1, W - 1, dtype=torch.int64, device=dev).expand(pad, W)
        parents = chain if real is None else torch.cat([real.parents.to(dev), chain])
        accept = torch.full((pad,), W, dtype=torch.int32, device=dev)
        accept = accept if real is None else torch.cat([real.accept_length.to(dev), accept])
        accept_cpu = ([] if real is None else list(real.accept_length_cpu)) + [W] * pad
        mask = None
        if self.mode.is_target_verify():
            pad_mask = torch.ones(pad * W * (self.fill + W), dtype=torch.bool, device=dev)
            mask = pad_mask if real is None else torch.cat([real.custom_mask.to(dev), pad_mask])
        positions = self.positions if self.mode.is_target_verify() else None
        return SpecInfo(W, t.topk, t.spec_steps, mask, positions, parents, accept, accept_cpu, t.algorithm)

    def _refresh_host_fields(self) -> None:
        """Host-side copies of the lengths, as a replayed batch carries them."""
        seq_cpu = self.seq_lens.cpu()
        self.fb.seq_lens_cpu = seq_cpu
        self.fb.seq_lens_sum = int(seq_cpu.sum())
        self.extend_prefix_lens.copy_(self._padded_prefix(self.seq_lens).to(torch.int32))
        self.fb.extend_prefix_lens_cpu = self.extend_prefix_lens.tolist()

    def _split(self) -> None:
        """Attach the TBO halves of the static batch (SGLang's TboCudaGraphRunnerPlugin), if it splits."""
        self.fb.tbo_children = None
        if self.split_tbo:
            attach_tbo_children(self.fb)

    @property
    def captured(self) -> str:
        """The captured shape, requests x tokens per request."""
        return f"at {self.bs} x {self.width}"

    # ---- capture ----
    def _captured(self, spec) -> bool:
        return not is_recurrent(spec) or self.capture_linear or CAPTURE_LINEAR_LAYERS

    def _layer_fn(self, i: int):
        return lambda: run_layer_overlapped(self.backend, self.layer_specs[i], self.inputs[i], self.weights[i],
                                            self.fb, self.mrope_sections)

    def _capture_graph(self, fn):
        return capture_graph(fn)

    def _in_graph(self) -> None:
        self.backend.init_forward_metadata_in_graph(self.fb)

    def _plan_capture(self) -> None:
        self.backend.init_cuda_graph_state(self.bs, self.bs * self.width)
        self._split()
        self.backend.init_forward_metadata_out_graph(self.fb, in_capture=True)

    def capture_plan(self) -> None:
        """The capture's planning alone, as a model runner makes it before it records the layers: the graph state,
        the fill-value batch's out_graph plan, and its in_graph plan (run here, not recorded)."""
        self._plan_capture()
        self._in_graph()

    def capture(self) -> None:
        self._plan_capture()
        if not self.use_cuda_graph:  # nothing to record: each replay runs in_graph and the layers
            self.graphs = [None] * len(self.layer_specs)
            self.outputs = [None] * len(self.layer_specs)
            return
        self.metadata_graph, _ = self._capture_graph(self._in_graph)
        for i, spec in enumerate(self.layer_specs):
            if not self._captured(spec):
                self.graphs.append(None)
                self.outputs.append(None)
                continue
            graph, out = self._capture_graph(self._layer_fn(i))
            self.graphs.append(graph)
            self.outputs.append(out)

    # ---- replay ----
    def load(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> int:
        """Copy the real batch ``fb`` into the static buffers and pad the rest; returns its token count."""
        if capture_mode(fb.forward_mode) is not self.mode:
            raise ValueError(f"a {self.mode.value} graph cannot replay a {fb.forward_mode.value} batch")
        n, W = fb.batch_size, self.width
        if n > self.bs:
            raise ValueError(f"a batch of {n} requests does not fit a graph captured for {self.bs}")
        if any(e != W for e in fb.extend_seq_lens_cpu[:n]) and not fb.forward_mode.is_decode():
            raise ValueError(f"a graph of {W} tokens per request cannot replay extend lengths "
                             f"{fb.extend_seq_lens_cpu} (SGLang runs such a batch eagerly)")
        t = n * W
        self.req_pool_indices.zero_()
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens.fill_(self.fill)
        self.seq_lens[:n].copy_(fb.seq_lens)
        load_token_rows(self, fb, inputs, t)
        self.state_slots.copy_(self.mr.req_to_state_slot[self.req_pool_indices])
        self._refresh_host_fields()
        self.fb.num_padding = self.bs - n
        self.fb.spec_info = self._padded_spec_info(fb.spec_info if fb.batch_size else None)
        return t

    def replay_plan(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> int:
        """A replay's planning: the real batch ``fb`` loaded into the static batch (``self.fb``) and padded, then
        out_graph and in_graph over it; returns the real token count. The plan covers the padded rows too."""
        t = self.load(fb, inputs)
        self.fb.tbo_children = None  # the wrapper derives its halves from the padded batch (SGLang's replay view)
        self.backend.init_forward_metadata_out_graph(self.fb, in_capture=False)
        if self.split_tbo:
            self._split()  # the halves the captured layers run (the same static rows at every replay)
        if self.metadata_graph is not None:
            self.metadata_graph.replay()
        else:
            self._in_graph()  # no recorded metadata graph (CPU, or only planned): run what capture would record
        return t

    def replay(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> list[torch.Tensor]:
        """Run the real batch ``fb`` (at most ``bs`` requests of the graph's width; an IDLE batch has none)
        through the captured graphs; returns each layer's output rows of the real tokens."""
        t = self.replay_plan(fb, inputs)
        outs = []
        for i, spec in enumerate(self.layer_specs):
            graph = self.graphs[i]
            if graph is not None:
                graph.replay()
                outs.append(self.outputs[i][:t].clone())
            else:
                outs.append(self._layer_fn(i)()[:t].clone())
        return outs


def eager_run(backend, fb: ForwardBatch, layer_specs, inputs, weights, mrope_sections=None,
              split_tbo: bool = False) -> list[torch.Tensor]:
    """The same batch run eagerly (split for two-batch overlap when ``split_tbo``), as graph replay must
    reproduce it."""
    if split_tbo:
        attach_tbo_children(fb)
    prepare_batch(backend, fb, layer_specs)
    return [run_layer_overlapped(backend, s, i, w, fb, mrope_sections)
            for s, i, w in zip(layer_specs, inputs, weights)]


# ---- prefill graphs ----------------------------------------------------------------------------------
# Token buckets an EXTEND batch pads to (SGLang reads its own from cuda_graph_config.prefill.bs; the bucket
# only decides how many padded tokens a replay carries).
PREFILL_GRAPH_MODES = frozenset({ForwardMode.EXTEND})  # modes a composition with Support.prefill_graph captures
PREFILL_CAPTURE_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_bucket(num_tokens: int) -> int:
    """The token bucket an EXTEND batch of ``num_tokens`` replays at."""
    return _smallest_fitting(PREFILL_CAPTURE_TOKENS, num_tokens, "an extend (tokens)")


class PrefillGraphRunner:
    """An EXTEND batch through a breakable prefill graph, as SGLang 0.5.23's ``PrefillCudaGraphRunner`` runs it
    with its breakable backend: one graph per token bucket, captured over a dummy batch (one request of the
    bucket's tokens, no prefix: ``capture_prepare``); a replay pads the tokens only (requests are the live
    batch's), plans the live batch eagerly (``init_forward_metadata``) and replays. Attention layers break the
    graph: the engine's layer objects run them eagerly on the live plan between captured segments, over the real
    tokens (``global_num_token_non_padded_cpu``); what runs between them (RoPE, the harness's per-layer glue) is
    captured. The backend provides the engine's scope and capture (``prefill_graph_scope(fb)``,
    ``capture_prefill_graph(fn, stream)``, ``prefill_graph_breaks()``: the breaks the capture in progress has
    recorded): a composition declares ``Support.prefill_graph``. At capture each layer's breaks are counted
    (``breaks``, ``unbroken_layers``): a layer that does not break is frozen into a segment.

    A backend may capture a layer kind's extend on purpose, over static tables it refreshes before each replay
    (SGLang's captured-metadata contract, 0.5.22 on, prefill_cuda_graph_runner.py ``_init_forward_metadata_for_capture``
    and ``_prepare_forward_metadata_for_replay``: its hybrid over KDA). The backend plans the capture batch with
    ``init_forward_metadata_for_prefill_capture`` (what it returns is the bucket's metadata), each replay with
    ``prepare_forward_metadata_for_prefill_replay`` (a batch of more requests than ``prefill_graph_max_requests``
    runs eagerly, as the engine's runner votes), and names the layer kinds it runs inside the graph
    (``prefill_graph_layers_in_graph``, asked right after the capture's plan): those layers take no break, and
    whether their replays are right is what the replay-against-eager comparison judges.

    On the CPU nothing is captured: the dummy batch is planned as at capture and its layers run once under the
    engine's capture machinery with no graph begun (``capture_prefill_graph(fn, None)``), which counts the breaks
    as a capture does; each replay runs the layers under the same scope, which exercises the padding and the
    engine's routing (its graph breaks run straight through without a capture)."""

    def __init__(self, backend, model_runner: ModelRunner, template: ForwardBatch, layer_specs,
                 weights: list[LayerWeights], inputs_like: list[LayerInputs], num_tokens: int,
                 mrope_sections: tuple[int, int, int] | None = None, *, pad_value: float = 0.0) -> None:
        if template.forward_mode is not ForwardMode.EXTEND:
            raise ValueError(f"a prefill graph runs extend batches, not {template.forward_mode.value}")
        self.backend, self.mr = backend, model_runner
        self.layer_specs, self.weights, self.mrope_sections = list(layer_specs), weights, mrope_sections
        self.pad_value = pad_value
        self.use_cuda_graph = model_runner.device.type == "cuda"
        self.mode, self.bs = ForwardMode.EXTEND, prefill_bucket(num_tokens)
        T, dev = self.bs, model_runner.device
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(T, dtype=torch.int64, device=dev)  # slot 0: padding
        self.mrope_positions = (None if template.mrope_positions is None
                                else torch.zeros(3, T, dtype=template.mrope_positions.dtype, device=dev))
        self.inputs = [LayerInputs({name: torch.zeros((T,) + t.shape[1:], dtype=t.dtype, device=dev)
                                    for name, t in li.tensors.items()}) for li in inputs_like]
        self.template = template
        self.graph = None
        self.outputs: list[torch.Tensor] = []
        self.breaks: list[int] = []  # each layer's eager graph breaks at capture
        self.captured_plan = None  # the bucket's metadata, where the backend captures a layer kind's extend
        self.in_graph: frozenset[str] = frozenset()  # the layer kinds the backend runs inside the graph

    def _static(self, fb: ForwardBatch, raw_tokens: int) -> ForwardBatch:
        """``fb``'s requests over the static token buffers (``raw_tokens`` of them real)."""
        return replace(fb, positions=self.positions, out_cache_loc=self.out_cache_loc,
                       mrope_positions=self.mrope_positions, num_token_non_padded=raw_tokens,
                       tbo_split_seq_index=None, tbo_split_token_index=None, tbo_children=None)

    def _dummy(self) -> ForwardBatch:
        """SGLang's capture batch: one request of the bucket's tokens, no cached prefix, in request row 0 and state
        slot 0 (the padding row and slot)."""
        T, dev, fb = self.bs, self.mr.device, self.template
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        self.positions.copy_(torch.arange(T, device=dev))
        return replace(self._static(fb, T), batch_size=1, req_pool_indices=zero,
                       seq_lens=torch.full((1,), T, dtype=fb.seq_lens.dtype, device=dev),
                       seq_lens_cpu=torch.full((1,), T, dtype=fb.seq_lens_cpu.dtype), seq_lens_sum=T,
                       extend_seq_lens=torch.full((1,), T, dtype=torch.int32, device=dev),
                       extend_prefix_lens=torch.zeros(1, dtype=torch.int32, device=dev),
                       extend_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
                       extend_seq_lens_cpu=[T], extend_prefix_lens_cpu=[0], extend_num_tokens=T,
                       state_slots=zero, spec_info=None)

    def _layers(self, fb: ForwardBatch) -> list[torch.Tensor]:
        """The layers over the static buffers, each running its Python: SGLang's warm-up runs before a capture, and a
        replay on a CPU, where nothing was captured. A layer of a kind the backend runs inside the graph does so with
        the host values its capture recorded (``prefill_graph_captured_host``; at warm-up the capture batch's own),
        as its replayed kernels would; the others break out and run on the live batch, as they do between a real
        replay's segments."""
        outs = []
        for s, i, w in zip(self.layer_specs, self.inputs, self.weights):
            with self.backend.prefill_graph_captured_host(fb) if s.kind in self.in_graph else contextlib.nullcontext():
                outs.append(run_layer_overlapped(self.backend, s, i, w, fb, self.mrope_sections))
        return outs

    def _captured_layers(self, fb: ForwardBatch) -> list[torch.Tensor]:
        """The layers under a capture, each one's graph breaks counted (``self.breaks``)."""
        outs, self.breaks = [], []
        for s, i, w in zip(self.layer_specs, self.inputs, self.weights):
            before = self.backend.prefill_graph_breaks()
            outs.append(run_layer_overlapped(self.backend, s, i, w, fb, self.mrope_sections))
            self.breaks.append(self.backend.prefill_graph_breaks() - before)
        return outs

    @property
    def captured(self) -> str:
        return f"for {self.bs} tokens"

    def capture(self) -> None:
        dummy = self._dummy()
        self.captured_plan = self.backend.init_forward_metadata_for_prefill_capture(dummy)
        self.in_graph = self.backend.prefill_graph_layers_in_graph()
        if not self.use_cuda_graph:
            # No graph: the layers run once over the dummy batch under the engine's capture machinery with nothing
            # captured, so each layer's graph breaks are counted as a capture counts them
            with self.backend.prefill_graph_scope(dummy):
                self.backend.capture_prefill_graph(lambda: self._captured_layers(dummy), None)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self.backend.prefill_graph_scope(dummy):
            for _ in range(2):  # SGLang's warm-up runs (kernels compile and allocate outside the graph)
                self._layers(dummy)
            self.graph, self.outputs = self.backend.capture_prefill_graph(lambda: self._captured_layers(dummy),
                                                                          stream)
        torch.cuda.current_stream().wait_stream(stream)

    def expected_breaks(self, layer) -> int:
        """The eager breaks ``layer`` takes at capture: none where the backend runs its kind inside the graph, else
        1."""
        return 0 if layer.kind in self.in_graph else 1

    def unbroken_layers(self) -> list[tuple[object, int]]:
        """(layer, breaks) for each layer that did not break out of the graph as it must at capture
        (:meth:`expected_breaks`). A layer whose attention (or linear attention) plans per batch on the host breaks
        exactly once: a kernel captured into a segment would replay the capture batch's plan and state slots on
        every batch."""
        return [(s, n) for s, n in zip(self.layer_specs, self.breaks) if n != self.expected_breaks(s)]

    def replay(self, fb: ForwardBatch, inputs: list[LayerInputs]) -> list[torch.Tensor]:
        t = fb.extend_num_tokens
        if t > self.bs:
            raise ValueError(f"an extend of {t} tokens does not fit a prefill graph captured for {self.bs}")
        limit = self.backend.prefill_graph_max_requests()
        if limit is not None and fb.batch_size > limit:
            # The engine's vote: a batch of more requests than the captured tables hold runs eagerly, outside the graph
            # (SGLang's prefill runner, can_replay_locally)
            return eager_run(self.backend, fb, self.layer_specs, inputs, self.weights, self.mrope_sections)
        load_token_rows(self, fb, inputs, t)
        static = self._static(fb, t)
        prepare_batch(self.backend, static, self.layer_specs,
                      plan=lambda b: self.backend.prepare_forward_metadata_for_prefill_replay(self.captured_plan, b))
        with self.backend.prefill_graph_scope(static):
            if self.graph is None:
                outs = self._layers(static)
            else:
                self.graph.replay()
                outs = self.outputs
        return [o[:t].clone() for o in outs]
