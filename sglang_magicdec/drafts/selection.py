"""The draft selection the server runs: the policy `--magicdec-draft` names, configured from
`MagicDecConfig`."""

from __future__ import annotations

import torch

from sglang_magicdec.drafts.snapkv import SnapKVDraft, SnapKVSelection
from sglang_magicdec.drafts.streaming import StreamingDraft, StreamingSelection

DraftSelection = StreamingSelection | SnapKVSelection


def make_selection(config, model: torch.nn.Module) -> DraftSelection:
    """The selection `--magicdec-draft` names, configured from `MagicDecConfig`."""
    # Summaries are selected at the largest budget; a round may draft with any smaller one.
    budget = config.max_budget
    streaming = StreamingSelection(StreamingDraft(budget=budget, sinks=config.sinks))
    if config.draft == "streaming":
        return streaming
    snapkv = SnapKVDraft(
        budget=budget,
        obs_window=config.obs_window,
        pool=config.pool,
        pool_kernel=config.pool_kernel,
    )
    return SnapKVSelection(
        snapkv,
        fallback=streaming,
        model=model,
        share_min_len=config.share_min_len,
        min_context=config.dense_below,
        report_heads=config.debug,
    )
