"""Capture the SnapKV observation window's queries while SGLang prefills a prompt.

SnapKV scores a prompt with the queries of its last `obs_window` tokens, which exist only inside
the prefill forward. A forward pre-hook on every `RadixAttention` layer (works with any attention
backend) copies those rows of `q` (RoPE applied, exactly what attention sees) for the requests
being summarised. With chunked prefill the window may straddle chunks: rows accumulate per request
until all `obs_window` are in, and scoring runs after that forward, when the pool holds the KV of
the whole prompt in every layer, so chunked and one-shot prefill select the same positions.
A row counts as captured in a layer only once that layer's hook has copied it: whatever skips
the module's Python (a replayed graph) leaves the window incomplete, never half-read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.layers.radix_attention import RadixAttention


@dataclass
class PendingWindow:
    """Window queries of one prompt, filled in as its prefill chunks run."""

    prompt_len: int
    obs_window: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [W, Hq, D]
    captured: dict[int, set[int]] = field(default_factory=dict)  # layer id -> window rows seen

    @property
    def window_start(self) -> int:
        return self.prompt_len - self.obs_window

    def missing_layers(self, layer_ids: list[int]) -> list[int]:
        """The layers whose hook has not seen every window row (a hook that never ran: a
        replayed graph, attention called without the module)."""
        window = set(range(self.obs_window))
        return [layer_id for layer_id in layer_ids if self.captured.get(layer_id) != window]


class WindowObserver:
    """Hooks the model's attention layers; inactive (one attribute check) outside `observe`."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
        self.pending: dict[str, PendingWindow] = {}
        # For the forward in flight: (pending window, batch rows, window rows) per request.
        self._targets: list[tuple[PendingWindow, slice, slice]] = []
        for layer in self.layers:
            layer.register_forward_pre_hook(self._capture, with_kwargs=True)

    def observe(self, rids: list[str], prefix_lens: list[int], extend_lens: list[int]) -> None:
        """Arm the hooks for the next extend forward: capture the window rows of the pending
        requests among `rids` (the batch's requests, tokens back to back)."""
        self._targets = []
        row = 0
        for rid, prefix_len, extend_len in zip(rids, prefix_lens, extend_lens, strict=True):
            pending = self.pending.get(rid)
            if pending is not None:
                first = max(prefix_len, pending.window_start)
                last = min(prefix_len + extend_len, pending.prompt_len)
                if first < last:
                    batch_rows = slice(row + first - prefix_len, row + last - prefix_len)
                    window_rows = slice(first - pending.window_start, last - pending.window_start)
                    self._targets.append((pending, batch_rows, window_rows))
            row += extend_len

    def disarm(self) -> None:
        self._targets = []

    def _capture(self, layer: RadixAttention, args: tuple, kwargs: dict) -> None:
        if not self._targets:
            return
        q = args[0] if args else kwargs["q"]
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        for pending, batch_rows, window_rows in self._targets:
            queries = pending.queries.get(layer.layer_id)
            if queries is None:
                queries = q.new_zeros(pending.obs_window, *q.shape[1:])
                pending.queries[layer.layer_id] = queries
            queries[window_rows] = q[batch_rows]
            rows = pending.captured.setdefault(layer.layer_id, set())
            rows.update(range(window_rows.start, window_rows.stop))
