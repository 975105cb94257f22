"""What `--magicdec-debug` checks each round: a census of live KV and cross-rank agreement, too
costly for a production server, there for tests."""

from __future__ import annotations

import torch

from sglang_magicdec.gamma import first_rank_values


def check_selection(draft, allocator, req, row: torch.Tensor, length: int, slots: torch.Tensor):
    """Every slot the draft selected for `req` belongs to its live committed KV, none is free,
    and the draft's own state (SnapKV's summary) describes allocated KV."""
    live = row[:length].to(torch.int64)
    selected = slots.unique()
    assert bool(torch.isin(selected, live).all()), "draft selection points outside live KV"
    free = allocator.get_all_free_pages()
    if free is None or not free.numel():
        return
    free = free.to(torch.int64)
    if bool(torch.isin(selected // allocator.page_size, free).any()):
        bad = torch.nonzero(torch.isin(live // allocator.page_size, free)).flatten()
        raise AssertionError(
            f"draft selection points at freed KV: rid={req.rid} length={length} "
            f"prompt={len(req.origin_input_ids)} freed positions={bad.tolist()[:20]} "
            f"n={bad.numel()} retractions={getattr(req, 'retraction_count', None)} "
            f"output={len(req.output_ids)}"
        )
    draft.check(req, row, free, allocator.page_size)


def check_ranks_agree(tp_group, target: torch.Tensor, accept_lens: torch.Tensor) -> None:
    """Under TP, every rank committed the same tokens this round (they sample from the same
    gathered logits with the same uniforms, so only a rank-local decision differs)."""
    mine = torch.cat([accept_lens.to(torch.int64).cpu(), target.reshape(-1).cpu()])
    first = first_rank_values(tp_group, mine.clone())
    if not torch.equal(first, mine):
        raise AssertionError(
            f"TP rank {tp_group.rank_in_group} committed {mine.tolist()} where the first "
            f"rank committed {first.tolist()}"
        )
