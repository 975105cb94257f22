"""Draft KV selections: which committed KV slots the draft attends to.

Each draft is a small policy dataclass with one selecting method (`StreamingDraft.select`,
`SnapKVDraft.select_layer`) and a *selection* that applies it inside the server and answers the
worker's one question, once per round and request: `positions(...)`, the committed positions the
draft reads (`DraftPositions`: SnapKV's per-layer, per-KV-head summary positions, already on the
device, then ranges every layer and head reads), which the round resolves into pool slots through
the request's own `req_to_token` row. The selection also owns whatever state the policy keeps
across requests (SnapKV's shared summaries) and hears about prefill forwards and released KV.
"""

from __future__ import annotations

import torch

from sglang_magicdec.drafts.snapkv import SnapKVDraft, SnapKVSelection
from sglang_magicdec.drafts.streaming import StreamingDraft, StreamingSelection

__all__ = [
    "DraftSelection",
    "SnapKVDraft",
    "SnapKVSelection",
    "StreamingDraft",
    "StreamingSelection",
    "make_selection",
]

DraftSelection = StreamingSelection | SnapKVSelection


def make_selection(config, model: torch.nn.Module) -> DraftSelection:
    """The selection `--magicdec-draft` names, configured from `MagicDecConfig`."""
    streaming = StreamingSelection(StreamingDraft(budget=config.budget, sinks=config.sinks))
    if config.draft == "streaming":
        return streaming
    snapkv = SnapKVDraft(
        budget=config.budget,
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
    )
