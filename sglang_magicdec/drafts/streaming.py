"""StreamingLLM draft: attention sinks plus a recent window (Xiao et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StreamingDraft:
    """Keep the first `sinks` positions and a window of the most recent ones.

    budget  draft KV tokens for the prompt part, sinks included: the window holds the last
            `budget - sinks` prompt tokens, then grows with every generated token, up to
            `budget` generated tokens; past that it rolls, so a draft step reads at most
            `2 * budget` committed tokens however long the generation.
    sinks   the first tokens of the context, kept always (they soak up attention mass).
    """

    budget: int
    sinks: int

    def select(self, committed_len: int, prompt_len: int) -> torch.Tensor:
        """Positions (sorted, int64) among [0, committed_len) that the draft attends to."""
        generated = max(0, committed_len - prompt_len)
        window = self.budget - self.sinks + min(generated, self.budget)
        sink_end = min(self.sinks, committed_len)
        recent_start = max(sink_end, committed_len - window)
        return torch.cat([torch.arange(0, sink_end), torch.arange(recent_start, committed_len)]).to(
            torch.int64
        )
