"""SnapKV summaries of prompts, one per prompt prefix, shared by every request that extends it.

A summary is the draft's selection over one prompt: per layer and KV head, the positions kept
(the SnapKV top-k plus the observation window). It is computed once, when the prompt is
prefilled, and later requests whose prompts start with exactly those tokens (a shared document
sent first by a frontend `fork`, a system prompt, the previous turn of a conversation) reuse it
for that part and keep their own suffix as recent tokens.

Positions, not slots: a reusing request resolves them through its own `req_to_token` row, so a
draft never reads a slot the request does not hold. A summary also remembers the pool slots its
prompt had when computed: a reuser must hold the very same slots (it matched the prefix in the
radix cache), and a summary whose slots the radix cache frees is dropped, unless requests still
hold it (they lock the prefix, so that does not happen while they run).

Lifetime: requests hold a summary from their prefill until SGLang releases their KV
(`on_release`, finished, aborted or retracted); the radix cache's evictions and resets drop
summaries nobody holds whose prompt KV was freed; at most `max_idle` unheld summaries are kept
(least recently used go first), so caches that never evict cannot grow it without bound.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class Summary:
    """One prompt's draft selection.

    tokens        the prompt's token ids (the key)
    positions     [layers, Hkv, kept] sorted positions in [0, len(tokens)), int32
    prompt_slots  pool slots of the prompt's tokens but the last, where the radix cache holds
                  them (SGLang never matches a whole prompt: a request repeating it recomputes
                  the last token in a slot of its own, which nobody keeps)
    holders       rids of the requests drafting with it
    """

    tokens: tuple[int, ...]
    positions: torch.Tensor
    prompt_slots: torch.Tensor
    holders: set[str] = field(default_factory=set)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def digest(self) -> str:
        """Short fingerprint of the selection (tests compare selections across servers)."""
        return hashlib.sha1(self.positions.numpy().tobytes()).hexdigest()[:16]


class SummaryStore:
    """Summaries by prompt, reference-counted by rid; see the module docstring."""

    def __init__(self, share_min_len: int, max_idle: int = 256):
        self.share_min_len = share_min_len
        self.max_idle = max_idle
        self._by_key: OrderedDict[tuple[int, int], Summary] = OrderedDict()
        self._held: dict[str, Summary] = {}
        self.computed = 0
        self.reused = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def summaries(self) -> list[Summary]:
        return list(self._by_key.values())

    def held_by(self, rid: str) -> Summary | None:
        return self._held.get(rid)

    def find(self, prompt: list[int]) -> Summary | None:
        """The longest shared summary whose prompt starts `prompt`."""
        best = None
        for summary in self._by_key.values():
            n = summary.length
            if n > len(prompt) or (best is not None and n <= best.length):
                continue
            if tuple(prompt[:n]) == summary.tokens:
                best = summary
        return best

    def acquire(
        self,
        rid: str,
        summary: Summary,
        *,
        computed: bool,
        cached_slots: torch.Tensor | None = None,
    ) -> None:
        """`rid` drafts with `summary` from now until `release(rid)`. A reuser passes the pool
        slots of its cached prefix: the radix copy of the prompt it locks, which the summary is
        re-anchored on (it may differ from the first computer's slots if two requests prefilled
        the same prompt at once and the tree kept the other copy)."""
        self.release(rid)
        if cached_slots is not None:
            cached = min(cached_slots.numel(), summary.prompt_slots.numel())
            # A new tensor, never written in place: slots may come as views of req_to_token.
            summary.prompt_slots = torch.cat(
                [cached_slots[:cached].cpu(), summary.prompt_slots[cached:]]
            )
        summary.holders.add(rid)
        self._held[rid] = summary
        if computed:
            self.computed += 1
            key = self._key(summary.tokens)
            if summary.length >= self.share_min_len and key not in self._by_key:
                self._by_key[key] = summary
        else:
            self.reused += 1
            self._by_key.move_to_end(self._key(summary.tokens))
        self._trim_idle()

    def release(self, rid: str) -> None:
        summary = self._held.pop(rid, None)
        if summary is not None:
            summary.holders.discard(rid)
            self._trim_idle()

    def drop_freed(self, free_slots: torch.Tensor) -> int:
        """Drop unheld summaries whose prompt slots were freed; returns how many."""
        dropped = 0
        for key, summary in list(self._by_key.items()):
            if summary.holders:
                continue
            if bool(torch.isin(summary.prompt_slots, free_slots).any()):
                del self._by_key[key]
                dropped += 1
        self.dropped += dropped
        return dropped

    def clear_unheld(self) -> None:
        for key, summary in list(self._by_key.items()):
            if not summary.holders:
                del self._by_key[key]

    def info(self) -> dict:
        return {
            "summaries_computed": self.computed,
            "summaries_reused": self.reused,
            "summaries_dropped": self.dropped,
            "summaries_stored": len(self._by_key),
            "summaries_held": sum(1 for s in self._by_key.values() if s.holders),
        }

    def _trim_idle(self) -> None:
        idle = [key for key, summary in self._by_key.items() if not summary.holders]
        for key in idle[: max(0, len(idle) - self.max_idle)]:
            del self._by_key[key]

    @staticmethod
    def _key(tokens: tuple[int, ...]) -> tuple[int, int]:
        return len(tokens), hash(tokens)
