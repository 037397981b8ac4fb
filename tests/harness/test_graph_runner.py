"""The CUDA-graph runner beyond decode (engine/graph_runner.py), on the CPU path: the padded static batch of
each mode, its poisoned padding, the batches it refuses, and two-batch-overlap halves under a graph."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch

from backends.linear_torch import LinearTorchBackend
from backends.registry import parse
from batch.forward_batch import ModelRunner
from batch.spec import BatchSpec, ForwardMode, LinearLayer, MHALayer, SpecInput
from engine.graph_runner import (CAPTURE_SIZES, GRAPH_MODES, GraphRunner, capture_mode, capture_sizes, graph_width,
                                 padded_size, replay_size)
from engine.materialize import materialize
from properties import PROPERTIES

LIN = LinearLayer(0, 2, 4, 16, 16)
MHA = MHALayer(1, 4, 2, 32, 32)
VERIFY = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 7, 2), (3, 3, 3), (MHA,),
                   spec=SpecInput(3, 2, 2, ((-1, 0, 0), (-1, 0, 1), (-1, 0, 0)), (2, 3, 1)), seed=4)
DRAFT_EXTEND = BatchSpec(ForwardMode.DRAFT_EXTEND, (4, 1, 6), (3, 3, 3), (LIN,),
                         spec=SpecInput(3, 1, 2, ((-1, 0, 1),) * 3, (3, 3, 3)), seed=5)


def _runner(spec: BatchSpec, backend_cls=LinearTorchBackend, pad_value: float = math.nan) -> tuple[GraphRunner, object]:
    case = materialize(spec)
    mr = ModelRunner.of(case.forward_batch, spec.layers)
    runner = GraphRunner(backend_cls(mr), mr, case.forward_batch, spec.layers, case.weights, case.inputs,
                         padded_size(spec.batch_size, mr.max_requests), pad_value=pad_value)
    runner.capture()
    return runner, case


def test_modes_widths_and_capture_sizes():
    assert GRAPH_MODES == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE}
    assert capture_mode(ForwardMode.IDLE) is ForwardMode.DECODE  # an idle rank replays the decode graph
    with pytest.raises(ValueError, match="no CUDA graph"):
        capture_mode(ForwardMode.EXTEND)
    assert graph_width(ForwardMode.DECODE, None) == 1
    fb = materialize(VERIFY).forward_batch
    assert graph_width(ForwardMode.TARGET_VERIFY, fb.spec_info) == 3
    assert (padded_size(0, 40), padded_size(3, 40), padded_size(4, 40)) == (1, 4, 4)
    # As SGLang's get_batch_sizes_to_capture: no capture larger than the request pool, the pool's size added
    assert capture_sizes(11) == (1, 2, 4, 8, 11) and padded_size(9, 11) == 11
    assert capture_sizes(40) == (1, 2, 4, 8, 12, 16, 24, 32, 40) and capture_sizes(256) == CAPTURE_SIZES
    assert padded_size(146, 148) == 148 and padded_size(146, 400) == 152


def test_a_batch_asks_for_padded_rows_and_graph_rows_draw_them():
    """SGLang's default sizes (1, 2, 4, 8, ...) replay most small batches unpadded; ``graph_padding`` asks for padded rows
    whatever the size, within the request pool (``MAX_GRAPH_PADDING`` rows beside the batch's), and the graph rows'
    strategy draws it in about two cases of three, one padded row in the simplest batch, so a row's first example
    reaches a padded replay."""
    from hypothesis import HealthCheck, Phase, find, given, settings

    from batch.spec import MAX_GRAPH_PADDING, SpecError
    from search.matrix import Row
    from search.profiles import PROFILES
    from search.search_row import row_strategy

    four = dataclasses.replace(VERIFY, prefix_lens=(4, 7, 2, 5), extend_lens=(3,) * 4,
                               spec=SpecInput(3, 2, 2, VERIFY.spec.parents + ((-1, 0, 0),), (2, 3, 1, 1)))
    mr = ModelRunner.of(materialize(four).forward_batch, four.layers)
    assert mr.max_requests == 4 + MAX_GRAPH_PADDING
    assert [replay_size(dataclasses.replace(four, graph_padding=p), mr.max_requests) for p in range(3)] == [4, 6, 6]
    with pytest.raises(SpecError, match="graph_padding must be in"):
        dataclasses.replace(four, graph_padding=MAX_GRAPH_PADDING + 1)

    graph = Row(parse("graph(triton)"), ForwardMode.DECODE, PROPERTIES["graph_replay"])
    eager = Row(parse("triton"), ForwardMode.DECODE, PROPERTIES["outputs"])
    drawn: dict[str, list[int]] = {"graph": [], "eager": []}
    for kind, row in (("graph", graph), ("eager", eager)):
        @settings(max_examples=60, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(row_strategy(row, PROFILES["ci"]))
        def collect(spec):
            drawn[kind].append(spec.graph_padding)
        collect()
    # the example Hypothesis tries first, and the only one a row searched with one example checks
    simplest = find(row_strategy(graph, PROFILES["ci"]), lambda _: True,
                    settings=settings(database=None, phases=(Phase.generate,)))
    assert simplest.batch_size == 1 and simplest.graph_padding == 1
    assert replay_size(simplest, simplest.batch_size + MAX_GRAPH_PADDING) == 2
    assert set(drawn["eager"]) == {0}
    assert set(drawn["graph"]) == set(range(MAX_GRAPH_PADDING + 1))
    assert sum(p > 0 for p in drawn["graph"]) >= 0.6 * len(drawn["graph"])


def test_padded_rows_are_fill_rows_and_their_inputs_poisoned():
    runner, case = _runner(DRAFT_EXTEND)
    fb = case.forward_batch
    runner.replay(fb, case.inputs)
    s = runner.fb
    assert (runner.bs, runner.width, s.extend_num_tokens) == (4, 3, 12)
    assert s.req_pool_indices[3] == 0 and s.seq_lens[3] == runner.fill and s.out_cache_loc[9:].eq(0).all()
    assert s.seq_lens[:3].tolist() == fb.seq_lens.tolist()
    # draft extend reads seq_lens - width cached keys; a padded row's prefix clamps at 0
    assert s.extend_prefix_lens_cpu == [4, 1, 6, 0]
    assert s.spec_info.accept_length.tolist() == [3, 3, 3, 3] and s.spec_info.parents.shape == (4, 3)
    x = runner.inputs[0].tensors["mixed_qkv"]
    assert torch.isnan(x[9:]).all() and torch.equal(x[:9], case.inputs[0].tensors["mixed_qkv"])


def test_verify_padding_extends_the_tree_mask():
    case = materialize(VERIFY)
    runner = GraphRunner(parse("triton").build(VERIFY, ModelRunner.of(case.forward_batch, VERIFY.layers)),
                         ModelRunner.of(case.forward_batch, VERIFY.layers), case.forward_batch, VERIFY.layers,
                         case.weights, case.inputs, 4)
    runner.load(case.forward_batch, case.inputs)
    real = case.forward_batch.spec_info.custom_mask
    mask = runner.fb.spec_info.custom_mask
    assert mask.numel() == real.numel() + 3 * (runner.fill + 3) and torch.equal(mask[: real.numel()], real)
    assert mask[real.numel():].all()  # the padded request's block lets it see everything (its rows are garbage)


def test_a_graph_refuses_batches_it_cannot_replay():
    runner, case = _runner(DRAFT_EXTEND)
    ragged = BatchSpec(ForwardMode.DRAFT_EXTEND, (4, 1), (3, 1), (LIN,),
                       spec=SpecInput(3, 1, 2, ((-1, 0, 1),) * 2, (3, 1)), seed=6)
    with pytest.raises(ValueError, match="tokens per request"):
        runner.replay(materialize(ragged).forward_batch, materialize(ragged).inputs)
    decode = BatchSpec(ForwardMode.DECODE, (4,), (1,), (LIN,))
    with pytest.raises(ValueError, match="cannot replay a decode batch"):
        runner.replay(materialize(decode).forward_batch, materialize(decode).inputs)


def test_idle_batch_replays_the_decode_graph_all_padding():
    idle = BatchSpec(ForwardMode.IDLE, (), (), (LIN,))
    runner, case = _runner(idle)
    assert (runner.mode, runner.bs, runner.width) == (ForwardMode.DECODE, 1, 1)
    out = runner.replay(case.forward_batch, case.inputs)
    assert out[0].shape == (0, LIN.num_v_heads, LIN.head_v_dim)
    assert runner.fb.req_pool_indices.tolist() == [0] and runner.fb.state_slots.tolist() == [0]


def test_tbo_graph_runs_the_halves_through_the_children(device):
    from backends.tbo import TboAttnBackend
    from backends.triton import TritonBackend
    calls, halves = [], []
    original, forward = TboAttnBackend.init_forward_metadata_out_graph, TritonBackend.forward_extend

    def spy(self, forward_batch, in_capture=False):
        calls.append((in_capture, forward_batch.tbo_children is not None))
        return original(self, forward_batch, in_capture)

    def forward_spy(self, q, *args, **kwargs):
        halves.append(q.shape[0])
        return forward(self, q, *args, **kwargs)
    with mock.patch.object(TboAttnBackend, "init_forward_metadata_out_graph", spy), \
            mock.patch.object(TritonBackend, "forward_extend", forward_spy):
        assert PROPERTIES["graph_replay"].run(parse("graph(tbo(triton))"), VERIFY, device).ok
    # capture: the runner's split (SGLang's TBO plugin); the replay: the wrapper splits the padded batch itself. A
    # captured graph is replayed twice (properties/graph.py: a second replay must not return the first's outputs),
    # and its layers' Python runs once, at capture; on a CPU nothing is captured and each replay reruns it.
    captured = device == "cuda"
    assert calls == [(True, True)] + [(False, False)] * (2 if captured else 1), calls
    # the halves of 2 x 3 padded tokens (the replay's; on a GPU, capture's warm-up and recording, never a replay's);
    # eager split the 3 real requests 1 | 2
    if captured:
        assert set(halves) == {3, 6} and halves[:4] == [6, 6, 6, 6], halves
    else:
        assert halves == [6, 6, 3, 6], halves
