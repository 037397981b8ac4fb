"""A metamorphic property of speculative verification: every draft-tree node's output equals the output of
the chain along its root-to-node branch (no reference needed, so it also holds for backends with numerics of
their own).

A node at depth d sees the cached prefix, its ancestors and itself, at positions seq_len + depth: exactly
what token d of its branch sees when the branch is extended causally after the same prefix. Every node lies
on a root-to-leaf path, so each request's tree is re-run as its leaf paths: EXTEND batches of one path per
request (round k holds every request's k-th leaf path), each after its request's cached prefix and starting
from the linear-attention states the verify started from (a request's state slot holds one branch at a time).
The path tokens are the tree's own rows (inputs, positions and slots), so both runs read the same values, and
each node is compared where its first path reaches it.
"""

from __future__ import annotations

import dataclasses

import torch

from backends.registry import Composition
from batch.forward_batch import ForwardBatch, LayerInputs, ModelRunner
from batch.spec import BatchSpec, ForwardMode
from engine.execute import execute
from engine.materialize import materialize
from engine.model import run_layers
from properties.tolerances import branch_bound
from properties.verdict import Verdict, Worst, compare

NAME = "tree_branch"


def leaf_paths(spec: BatchSpec) -> list[tuple[int, list[int]]]:
    """[(request, root-to-leaf path of draft indices)] for every leaf of every request's tree."""
    out = []
    for i, parents in enumerate(spec.spec.parents):
        has_child = {p for p in parents if p >= 0}
        for leaf in (n for n in range(len(parents)) if n not in has_child):
            path, k = [], leaf
            while k >= 0:
                path.append(k)
                k = parents[k]
            out.append((i, path[::-1]))
    return out


def path_batch(fb: ForwardBatch, spec: BatchSpec, paths: list[tuple[int, list[int]]]) -> tuple[ForwardBatch, torch.Tensor]:
    """An EXTEND batch whose requests are ``paths`` after their requests' cached prefixes, over the tree batch
    ``fb``'s pools, and the tree rows its tokens are (``[sum of path lengths]`` int64).

    As a scheduler's extend, each path writes its tokens at the slots its request's row lists after the prefix
    (``req_to_token[row, prefix + depth]``), not at its nodes' own: the verify's row lists the tree's nodes in draft
    order, so a backend that reads the new tokens' keys back through the row (TorchNative) would read the tree's
    nodes, not the path's. Those slots sit at their columns' page offsets (the verify's row is laid out as pages),
    so the batch holds at any page size. The tree's outputs are computed before: overwriting its cached keys there
    loses nothing. At most one path of a request per batch (:func:`path_rounds`): two would write the same slots."""
    dev, D = fb.device, spec.spec.draft_token_num
    req = torch.tensor([i for i, _ in paths], dtype=torch.int64, device=dev)
    tok = torch.tensor([i * D + j for i, path in paths for j in path], dtype=torch.int64, device=dev)
    prefix = [spec.prefix_lens[i] for i, _ in paths]
    extend = [len(path) for _, path in paths]
    if len({i for i, _ in paths}) != len(paths):
        raise ValueError("two paths of one request in one batch: they would write the same slots")
    rows = fb.req_pool_indices[req].tolist()
    slots = torch.cat([fb.req_to_token[row, p:p + e] for row, p, e in zip(rows, prefix, extend)]).to(
        fb.out_cache_loc.dtype)
    seq = torch.tensor([p + e for p, e in zip(prefix, extend)], dtype=torch.int64)
    n, T = len(paths), sum(extend)
    batch = dataclasses.replace(
        fb, forward_mode=ForwardMode.EXTEND, batch_size=n, req_pool_indices=fb.req_pool_indices[req],
        seq_lens=seq.to(dev, fb.seq_lens.dtype), seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()),
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=dev),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
        extend_start_loc=torch.tensor([sum(extend[:k]) for k in range(n)], dtype=torch.int32, device=dev),
        extend_seq_lens_cpu=extend, extend_prefix_lens_cpu=prefix, extend_num_tokens=T,
        positions=fb.positions[tok], mrope_positions=None, out_cache_loc=slots,
        state_slots=fb.state_slots[req], spec_info=None, num_token_non_padded=T,
        tbo_split_seq_index=None, tbo_split_token_index=None, tbo_children=None)
    return batch, tok


def path_rounds(paths: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
    """``paths`` in batches holding at most one path of each request: round k has every request's k-th leaf
    path. A linear layer's state lives in its request's slot, which two paths of one batch would both advance."""
    rounds: list[list[tuple[int, list[int]]]] = []
    taken: dict[int, int] = {}
    for i, path in paths:
        k = taken.get(i, 0)
        taken[i] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append((i, path))
    return rounds


def _linear_states(fb: ForwardBatch) -> list[torch.Tensor]:
    pool = fb.mamba_pool
    return [] if pool is None else [*pool.conv_states.values(), *pool.ssm_states.values()]


def tree_branch_equals_chain(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    case = materialize(spec, device)
    fb, D = case.forward_batch, spec.spec.draft_token_num
    before = [t.clone() for t in _linear_states(fb)]  # the committed states every branch starts from
    tree = execute(composition, case)
    worst = Worst()
    paths, seen = leaf_paths(spec), set()
    for group in path_rounds(paths):
        # A verify may advance the committed states in place (SGLang's GDN advances the conv state, see
        # Capabilities.verify_advances_conv_state), and each round's extends advance them: every round starts
        # from the states before the verify, as each branch did in the tree.
        for t, saved in zip(_linear_states(fb), before):
            t.copy_(saved)
        batch, tok = path_batch(fb, spec, group)
        inputs = [LayerInputs({k: t[tok.to(t.device)] for k, t in inp.tensors.items()}) for inp in case.inputs]
        backend = composition.build(spec, ModelRunner.of(fb, spec.layers))
        outs = run_layers(backend, batch, spec.layers, inputs, case.weights, spec.mrope_sections)
        # Each node once, in the first path that reaches it: (row in this batch, request, node, path).
        rows, row = [], 0
        for i, path in group:
            for depth, node in enumerate(path):
                if (i, node) not in seen:
                    seen.add((i, node))
                    rows.append((row + depth, i, node, path[:depth + 1]))
            row += len(path)
        if not rows:
            continue
        mine = torch.tensor([r for r, *_ in rows], dtype=torch.int64)
        nodes = torch.tensor([i * D + node for _, i, node, _ in rows], dtype=torch.int64)
        for layer, out_tree, out_path in zip(spec.layers, tree.outputs, outs):
            bound = branch_bound(composition, spec, layer, device)
            c = compare(out_path[mine.to(out_path.device)], out_tree[nodes.to(out_tree.device)].to(torch.float64),
                        bound)
            if c.index:  # row k of the comparison is rows[k]: name its request and node
                _, i, node, branch = rows[c.index[0]]
                head = f", head {c.index[1]}" if len(c.index) > 1 else ""
                c.where = f"layer {layer.layer_id}: request {i}, draft node {node} (branch {branch}){head}"
            worst.add(c, bound)
    return worst.verdict(NAME, f"each of {len(seen)} tree nodes vs its branch extended as a chain")
