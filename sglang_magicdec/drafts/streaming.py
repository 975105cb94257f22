"""StreamingLLM draft: attention sinks plus a recent window (Xiao et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_magicdec.spec_info import DraftPositions


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

    def select(self, committed_len: int, prompt_len: int, budget: int | None = None) -> list[range]:
        """The positions among [0, committed_len) that the draft attends to at `budget` (None:
        this policy's), as sorted ranges: the sinks, then the recent window."""
        budget = self.budget if budget is None else budget
        generated = max(0, committed_len - prompt_len)
        window = budget - self.sinks + min(generated, budget)
        sink_end = min(self.sinks, committed_len)
        recent_start = max(sink_end, committed_len - window)
        return [range(0, sink_end), range(recent_start, committed_len)]


class StreamingSelection:
    """The streaming draft inside the server: stateless, the same positions for every layer
    and head."""

    def __init__(self, policy: StreamingDraft):
        self.policy = policy

    def positions(
        self, req, committed_len: int, row: torch.Tensor | None = None, budget: int | None = None
    ) -> DraftPositions:
        """The positions `req`'s draft reads this round at `budget` (None: the policy's; host
        side: nothing waits on a device); `row` (its `req_to_token` row) is not needed."""
        prompt_len = len(req.origin_input_ids)
        return DraftPositions(None, self.policy.select(committed_len, prompt_len, budget))

    # Nothing kept across requests, nothing needed from the prefill.
    def before_extend(self, batch, req_to_token: torch.Tensor) -> None:
        pass

    def after_extend(self, batch, req_to_token: torch.Tensor, kv_pool, failed: bool) -> None:
        pass

    def check(self, req, row: torch.Tensor, free_pages, page_size) -> None:
        pass

    def info(self) -> dict:
        return {}
