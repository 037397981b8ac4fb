"""Two-batch-overlap wrapper: a primary backend for the whole batch and two children for its halves.

Every protocol method goes to the primary (``forward`` included: layers that do not overlap run on the
whole batch); batch metadata and CUDA-graph metadata are also planned for each child on its half. Graph
metadata (``init_forward_metadata_out_graph`` / ``_in_graph``) is split from the padded static batch the graph
runner gives: each child gets a view of its requests' rows of the static buffers.
"""

from __future__ import annotations

import dataclasses

from backends.base import AttentionBackend, PlannedMetadata, call_accepting
from batch.tbo_split import compute_split, slice_spec_info


class TboAttnBackend(AttentionBackend):
    is_wrapper = True

    def __init__(self, primary: AttentionBackend, children: list[AttentionBackend]) -> None:
        if len(children) != 2:
            raise ValueError(f"TBO needs exactly 2 children, got {len(children)}")
        self.primary = primary
        self.children = children

    def init_forward_metadata(self, forward_batch) -> None:
        """The primary plans the whole batch; each child its half (``tbo_children``), if not empty."""
        self.primary.init_forward_metadata(forward_batch)
        for child, child_fb in zip(self.children, forward_batch.tbo_children or ()):
            if child_fb.batch_size > 0:
                child.init_forward_metadata(child_fb)

    def init_mha_chunk_metadata(self, forward_batch, **kwargs) -> None:
        """The chunk plan of the primary (whole batch) and each child (its half), where they have one."""
        pairs = [(self.primary, forward_batch)] + list(zip(self.children, forward_batch.tbo_children or ()))
        for backend, fb in pairs:
            if hasattr(backend, "init_mha_chunk_metadata") and fb.batch_size > 0:
                call_accepting(backend.init_mha_chunk_metadata, fb, **kwargs)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        """The primary, on the whole batch."""
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The primary, on the whole batch."""
        return self.primary.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The primary, on the whole batch."""
        return self.primary.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The primary and both children, each for the full ``max_bs``."""
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)
        for child in self.children:
            child.init_cuda_graph_state(max_bs, max_num_tokens)

    def _graph_split(self, bs: int, forward_mode, spec_info) -> int | None:
        D = spec_info.draft_token_num if spec_info is not None and forward_mode.is_target_verify() else 1
        split = compute_split(forward_mode, [D] * bs, D)
        return None if split is None else split.split_seq

    def replay_split(self, forward_batch) -> int | None:
        """The request a graph replay of the padded ``forward_batch`` cuts it at (None: it does not split)."""
        return self._graph_split(forward_batch.batch_size, forward_batch.forward_mode, forward_batch.spec_info)

    def _graph_children(self, forward_batch) -> list:
        """(child backend, child batch) for the two halves of the padded graph batch, or [] when it does not
        split. A child batch views its requests' rows (and their tokens) of the parent's static buffers."""
        fb = forward_batch
        bs, mode = fb.batch_size, fb.forward_mode
        s = self._graph_split(bs, mode, fb.spec_info)
        if s is None:
            return []
        per_req = fb.spec_info.draft_token_num if fb.spec_info is not None and mode.is_target_verify() else 1
        lens_cpu = fb.seq_lens_cpu
        out = []
        for child, req in zip(self.children, (slice(0, s), slice(s, bs))):
            n = req.stop - req.start
            tok = slice(req.start * per_req, req.stop * per_req)
            child_fb = dataclasses.replace(
                fb, batch_size=n, req_pool_indices=fb.req_pool_indices[req], seq_lens=fb.seq_lens[req],
                seq_lens_cpu=lens_cpu[req], seq_lens_sum=int(lens_cpu[req].sum()),
                extend_seq_lens=fb.extend_seq_lens[req], extend_prefix_lens=fb.extend_prefix_lens[req],
                extend_start_loc=fb.extend_start_loc[req] - fb.extend_start_loc[req][:1],
                extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu[req]),
                extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu[req]), extend_num_tokens=n * per_req,
                positions=fb.positions[tok],
                mrope_positions=None if fb.mrope_positions is None else fb.mrope_positions[:, tok],
                out_cache_loc=fb.out_cache_loc[tok], state_slots=fb.state_slots[req],
                spec_info=slice_spec_info(fb.spec_info, lens_cpu.tolist(), req), num_token_non_padded=n * per_req,
                tbo_split_seq_index=None, tbo_split_token_index=None, tbo_children=None)
            out.append((child, child_fb))
        return out

    def _graph_pairs(self, forward_batch) -> list:
        """(child backend, child batch) for the non-empty halves: the batch's own ``tbo_children`` where the
        graph runner split it (capture), else derived from the padded batch (replay), as SGLang's
        ``TboAttnBackend`` does from its replay view."""
        if forward_batch.tbo_children is not None:
            pairs = list(zip(self.children, forward_batch.tbo_children))
        else:
            pairs = self._graph_children(forward_batch)
        return [(child, child_fb) for child, child_fb in pairs if child_fb.batch_size > 0]

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """The primary plans the padded static batch; each child its half, viewing its rows of the static
        buffers (no child when the batch does not split)."""
        self.primary.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        for child, child_fb in self._graph_pairs(forward_batch):
            child.init_forward_metadata_out_graph(child_fb, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """As :meth:`init_forward_metadata_out_graph`: the primary on the whole batch, each child on its half."""
        self.primary.init_forward_metadata_in_graph(forward_batch)
        for child, child_fb in self._graph_pairs(forward_batch):
            child.init_forward_metadata_in_graph(child_fb)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The primary's value; RuntimeError if a child pads differently."""
        value = self.primary.get_cuda_graph_seq_len_fill_value()
        children = {c.get_cuda_graph_seq_len_fill_value() for c in self.children}
        if children != {value}:
            raise RuntimeError(f"TBO children pad seq_lens with {children}, the primary with {value}")
        return value

    @property
    def verify_mask(self):
        """The primary's."""
        return self.primary.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """The primary's."""
        self.primary.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices=None,
                                            mamba_steps_to_track=None, model=None, req_pool_indices=None) -> None:
        """The primary's."""
        self.primary.update_mamba_state_after_mtp_verify(last_correct_step_indices, mamba_track_indices,
                                                         mamba_steps_to_track, model, req_pool_indices)

    def planned_metadata(self) -> PlannedMetadata:
        """The primary's plan of the whole batch."""
        return self.primary.planned_metadata()
