"""Two-batch-overlap wrapper: a primary backend for the whole batch and two children for its halves.

Every protocol method goes to the primary (``forward`` included: layers that do not overlap run on the
whole batch); batch metadata and CUDA-graph metadata are also planned for each child on its half.
"""

from __future__ import annotations

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
        self.primary.init_forward_metadata(forward_batch)
        for child, child_fb in zip(self.children, forward_batch.tbo_children or ()):
            if child_fb.batch_size > 0:
                child.init_forward_metadata(child_fb)

    def init_mha_chunk_metadata(self, forward_batch, **kwargs) -> None:
        pairs = [(self.primary, forward_batch)] + list(zip(self.children, forward_batch.tbo_children or ()))
        for backend, fb in pairs:
            if hasattr(backend, "init_mha_chunk_metadata") and fb.batch_size > 0:
                call_accepting(backend.init_mha_chunk_metadata, fb, **kwargs)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.primary.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)
        for child in self.children:
            child.init_cuda_graph_state(max_bs, max_num_tokens)

    def _graph_split(self, bs: int, forward_mode, spec_info) -> int | None:
        D = spec_info.draft_token_num if spec_info is not None and forward_mode.is_target_verify() else 1
        split = compute_split(forward_mode, [D] * bs, D)
        return None if split is None else split.split_seq

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        self.primary.init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens,
                                                              encoder_lens, forward_mode, spec_info)
        s = self._graph_split(bs, forward_mode, spec_info)
        if s is None:
            return
        per_req = num_tokens // bs
        for child, req in zip(self.children, (slice(0, s), slice(s, bs))):
            n = req.stop - req.start
            child.init_forward_metadata_capture_cuda_graph(
                n, n * per_req, req_pool_indices[req], seq_lens[req], None, forward_mode,
                slice_spec_info(spec_info, seq_lens.tolist(), req))

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu) -> None:
        self.primary.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                             encoder_lens, forward_mode, spec_info, seq_lens_cpu)
        s = self._graph_split(bs, forward_mode, spec_info)
        if s is None:
            return
        for child, req in zip(self.children, (slice(0, s), slice(s, bs))):
            lens_cpu = seq_lens_cpu[req]
            child.init_forward_metadata_replay_cuda_graph(
                req.stop - req.start, req_pool_indices[req], seq_lens[req], int(lens_cpu.sum()), None,
                forward_mode, slice_spec_info(spec_info, seq_lens_cpu.tolist(), req), lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        value = self.primary.get_cuda_graph_seq_len_fill_value()
        children = {c.get_cuda_graph_seq_len_fill_value() for c in self.children}
        if children != {value}:
            raise RuntimeError(f"TBO children pad seq_lens with {children}, the primary with {value}")
        return value

    def get_verify_buffers_to_fill_after_draft(self):
        return self.primary.get_verify_buffers_to_fill_after_draft()

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        self.primary.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def update_mamba_state_after_mtp_verify(self, accepted_length, model=None) -> None:
        self.primary.update_mamba_state_after_mtp_verify(accepted_length, model)

    def planned_metadata(self) -> PlannedMetadata:
        return self.primary.planned_metadata()
