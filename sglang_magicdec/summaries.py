"""SnapKV summaries of prompts, shared by every request whose prompt shares a long prefix.

A summary is the draft's selection over one prompt: per layer and KV head, the positions kept
(the SnapKV top-k plus the observation window) and a ranked margin of the next-best positions.
It is computed once, when a prompt is prefilled, at the largest budget the server drafts with;
the kept positions are ranked too, so the selection at any smaller budget is a prefix of them.
A later request whose prompt shares at least `share_min_len` tokens with it (a document or system
prompt sent with different questions, the earlier turns of a conversation) reuses the positions
inside the shared part, refilled from the margin where positions past the shared part drop out, so
that every layer and KV head keeps as many positions as the summary has; the request's own suffix
becomes recent tokens.

Finding the longest shared prefix: each summary's prompt is indexed by the chained hashes of its
whole blocks of `block` tokens (as vLLM keys its prefix-cache blocks); a lookup hashes the
request's prompt block by block, one dict access per block, however many summaries are stored,
and stops at the first block no summary has. Dropping a summary deletes its keys; nothing to
rebalance, which a token trie would need, and SGLang's radix tree splits and evicts its nodes on
its own schedule, so summaries do not live on them.

Positions, not slots: a request resolves positions through its own `req_to_token` row, so a
draft never reads a slot the request does not hold. A summary also remembers the pool slots its
prompt had in the radix cache: when the cache evicts some of them, the summary stays shareable
only up to the first freed position (`live_len`), and an unheld summary whose live part falls
below `share_min_len` is dropped.

Lifetime: requests hold a summary from their prefill until SGLang releases their KV
(`release`: finished, aborted or retracted); at most `max_idle` unheld summaries are kept (least
recently used go first), so caches that never evict cannot grow it without bound.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sglang_magicdec.spec_info import to_device

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 64


@dataclass(eq=False)
class Summary:
    """One prompt's draft selection.

    tokens        the prompt's token ids
    positions     [layers, Hkv, kept] sorted positions in [0, len(tokens)), int32
    margin        [layers, Hkv, M] the next-best pre-window positions, best first, int32
    ranked        [layers, Hkv, kept] the same positions as `positions`, the observation window
                  first, then best first (None: only the whole selection is ever read)
    prompt_slots  pool slots of the prompt's tokens but the last, where the radix cache holds
                  them (SGLang never matches a whole prompt: a request repeating it recomputes
                  the last token in a slot of its own, which nobody keeps)
    live_len      the prefix whose KV the radix cache still holds (shareable up to there)
    holders       rids of the requests drafting with it
    """

    tokens: tuple[int, ...]
    positions: torch.Tensor
    margin: torch.Tensor
    prompt_slots: torch.Tensor
    live_len: int = -1
    ranked: torch.Tensor | None = None
    holders: set[str] = field(default_factory=set)
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.live_len < 0:
            self.live_len = len(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def digest(self) -> str:
        """Short fingerprint of the selection (tests compare selections across servers)."""
        return hashlib.sha1(self.positions.numpy().tobytes()).hexdigest()[:16]

    @property
    def head_digests(self) -> list[str]:
        """One short fingerprint per (layer, KV head) selection, layer-major: where two
        selections part, and how many of them (one rounding tie moves one head's, a wrong
        observation window moves nearly all)."""
        return [
            hashlib.sha1(head.numpy().tobytes()).hexdigest()[:8]
            for head in self.positions.flatten(0, 1)
        ]

    def positions_within(self, shared_len: int, budget: int | None = None) -> torch.Tensor:
        """The selection at `budget` (None: the whole one) for a prompt sharing only the first
        `shared_len` tokens: the positions before `shared_len`, each (layer, KV head) refilled
        to min(kept, shared_len) positions from the rest of its ranking, best first, then from
        the latest positions before `shared_len` not yet kept. Sorted, int32,
        [layers, Hkv, min(kept, shared_len)], kept being min(budget, the whole selection)."""
        layers, kv_heads, kept = self.positions.shape
        positions, margin = self.positions, self.margin
        if budget is not None and budget < kept:
            if self.ranked is None:
                raise ValueError(f"a summary selected at {kept} without its ranking: no {budget}")
            positions = self.ranked[..., :budget].sort(dim=-1).values
            margin = torch.cat([self.ranked[..., budget:], margin], dim=-1)
            kept = budget
        if shared_len >= self.length:
            return positions
        width = min(kept, shared_len)
        rows = []
        for position_row, margin_row in zip(
            positions.reshape(-1, kept),
            margin.reshape(layers * kv_heads, -1),
            strict=True,
        ):
            keep = position_row[position_row < shared_len]
            missing = width - keep.numel()
            if missing:
                refill = margin_row[margin_row < shared_len][:missing]
                keep = torch.cat([keep, refill])
                missing -= refill.numel()
            if missing:
                taken = torch.zeros(shared_len, dtype=torch.bool)
                taken[keep.long()] = True
                latest = torch.nonzero(~taken).flatten().flip(0)[:missing]
                keep = torch.cat([keep, latest.to(keep.dtype)])
            rows.append(keep.sort().values)
        return torch.stack(rows).view(layers, kv_heads, width)


@dataclass
class Holding:
    """What one request drafts with: a summary and the prefix it shares with it. Its positions
    within that prefix at a budget (the summary's own when it shares all of it) are computed
    at the first round drafting with that budget and copied to the request's device once
    (`device_positions`, read every round)."""

    # Budgets whose positions a request keeps on its device: the running one and one explored.
    # Each is up to layers x KV heads x 4,096 int64 per request; others are recomputed.
    KEPT_BUDGETS: ClassVar[int] = 2

    summary: Summary
    shared_len: int
    anchored: bool = False  # the radix cache has taken the prompt in since (`tokens_cached`)
    by_budget: OrderedDict[int | None, torch.Tensor] = field(default_factory=OrderedDict)

    def device_positions(self, budget: int | None, device) -> torch.Tensor:
        """[layers, Hkv, kept] int64 positions at `budget` (None: the whole selection), on
        `device`."""
        positions = self.by_budget.get(budget)
        if positions is None:
            host = self.summary.positions_within(self.shared_len, budget).long()
            positions = self.by_budget[budget] = to_device(host, device)
            while len(self.by_budget) > self.KEPT_BUDGETS:
                self.by_budget.popitem(last=False)
        else:
            self.by_budget.move_to_end(budget)
        return positions


class SummaryStore:
    """Summaries indexed by prompt prefix, reference-counted by rid; see the module docstring."""

    def __init__(self, share_min_len: int, max_idle: int = 256):
        self.share_min_len = share_min_len
        self.max_idle = max_idle
        # Whole blocks only, so any shared prefix of share_min_len tokens spans at least one.
        self.block = min(BLOCK_TOKENS, share_min_len)
        self._stored: OrderedDict[int, Summary] = OrderedDict()  # id -> summary, LRU order
        self._by_block: dict[int, dict[int, Summary]] = {}  # chained block hash -> summaries
        self._held: dict[str, Holding] = {}
        self.computed = 0
        self.reused = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._stored)

    def summaries(self) -> list[Summary]:
        return list(self._stored.values())

    def held_by(self, rid: str) -> Holding | None:
        return self._held.get(rid)

    def find(self, prompt: list[int]) -> tuple[Summary, int] | None:
        """The stored summary sharing the longest prefix with `prompt` (at least
        `share_min_len` tokens, within its live part), and that prefix's length."""
        candidates: dict[int, Summary] = {}
        blocks = 0
        for block_hash in self._block_hashes(prompt):
            found = self._by_block.get(block_hash)
            if not found:
                break
            candidates, blocks = found, blocks + 1
        best, best_len = None, 0
        matched = blocks * self.block
        for summary in reversed(candidates.values()):  # latest first
            shared = matched
            limit = min(len(prompt), summary.length, matched + self.block)
            while shared < limit and prompt[shared] == summary.tokens[shared]:
                shared += 1
            shared = min(shared, summary.live_len)
            if shared > best_len:
                best, best_len = summary, shared
        if best is None or best_len < self.share_min_len:
            return None
        return best, best_len

    def acquire(
        self,
        rid: str,
        summary: Summary,
        *,
        computed: bool,
        shared_len: int | None = None,
        cached_slots: torch.Tensor | None = None,
    ) -> Holding:
        """`rid` drafts with `summary` (sharing its first `shared_len` tokens; all of them if
        None) from now until `release(rid)`. A reuser passes the pool slots of its cached prefix:
        the radix copy it locks, which the summary's shared part is re-anchored on (it may
        differ from the computer's slots if two requests prefilled the same prompt at once and
        the tree kept the other copy)."""
        self.release(rid)
        shared_len = summary.length if shared_len is None else shared_len
        if cached_slots is not None:
            anchored = min(cached_slots.numel(), shared_len, summary.prompt_slots.numel())
            # A new tensor, never written in place: slots may come as views of req_to_token.
            summary.prompt_slots = torch.cat(
                [cached_slots[:anchored].cpu(), summary.prompt_slots[anchored:]]
            )
        holding = Holding(summary, shared_len)
        summary.holders.add(rid)
        self._held[rid] = holding
        if computed:
            self.computed += 1
            if summary.length >= self.share_min_len:
                self._store(summary)
        else:
            self.reused += 1
            if id(summary) in self._stored:
                self._stored.move_to_end(id(summary))
        self._trim_idle()
        return holding

    def release(self, rid: str) -> None:
        holding = self._held.pop(rid, None)
        if holding is None:
            return
        summary = holding.summary
        summary.holders.discard(rid)
        if not summary.holders and summary.live_len < self.share_min_len:
            if id(summary) in self._stored:  # evicted below sharing length while held
                self._remove(summary)
                self.dropped += 1
        self._trim_idle()

    def drop_freed(self, free_slots: torch.Tensor) -> int:
        """The radix cache freed `free_slots`: each summary stays shareable up to its first
        freed position; unheld ones shorter than share_min_len then go. Returns how many."""
        dropped = 0
        for summary in list(self._stored.values()):
            live = summary.prompt_slots[: max(summary.live_len - 1, 0)]
            freed = torch.nonzero(torch.isin(live, free_slots))
            if freed.numel():
                summary.live_len = int(freed[0, 0])
            if summary.live_len < self.share_min_len and not summary.holders:
                self._remove(summary)
                dropped += 1
        self.dropped += dropped
        return dropped

    def clear_unheld(self) -> None:
        for summary in list(self._stored.values()):
            if not summary.holders:
                self._remove(summary)

    def info(self) -> dict:
        return {
            "summaries_computed": self.computed,
            "summaries_reused": self.reused,
            "summaries_dropped": self.dropped,
            "summaries_stored": len(self._stored),
            "summaries_held": sum(1 for s in self._stored.values() if s.holders),
        }

    def _block_hashes(self, tokens) -> Iterator[int]:
        """The chained hash of each whole block of `tokens`, in order (lazily: a lookup stops
        at the first block no summary has)."""
        previous = 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            previous = hash((previous, tuple(tokens[start : start + self.block])))
            yield previous

    def _store(self, summary: Summary) -> None:
        for block_hash in self._block_hashes(summary.tokens):
            summary.block_hashes.append(block_hash)
            self._by_block.setdefault(block_hash, {})[id(summary)] = summary
        self._stored[id(summary)] = summary

    def _remove(self, summary: Summary) -> None:
        del self._stored[id(summary)]
        for block_hash in summary.block_hashes:
            entries = self._by_block[block_hash]
            del entries[id(summary)]
            if not entries:
                del self._by_block[block_hash]
        summary.block_hashes.clear()

    def _trim_idle(self) -> None:
        idle = [s for s in self._stored.values() if not s.holders]
        for summary in idle[: max(0, len(idle) - self.max_idle)]:
            self._remove(summary)
