"""How a round proposes draft tokens and accepts a verified chain: one acceptor per decode batch,
chosen by its sampling (`acceptor_for`), so the round itself has no sampling branches.

- `GreedyAcceptor` (every request greedy): a draft token is the draft's argmax; drafts are kept
  while the target's argmax agrees, then the target's own token follows.
- `SampledAcceptor` (anything else): a draft token is drawn from the draft's distribution q, the
  chain is accepted by exact rejection sampling against the target's p (`sampling.py`); greedy
  rows of the batch are one-hot, where this reduces to greedy acceptance. Rows with a
  `sampling_seed` take `SeededRows`' coupled draws instead, so their output is a function of
  the seed whatever γ was.

`AcceptanceStats` counts what was accepted over the server's lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch

from sglang_magicdec.sampling import (
    Filters,
    chain_rejection_sample,
    filtered_probs,
    greedy_accept,
    sample_from,
    sampling_probs,
    seeded_sample,
)
from sglang_magicdec.spec_info import to_device


class Acceptor(Protocol):
    def propose(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """[B] draft tokens of draft step `step` from its [B, V] logits."""

    def accept(
        self, tokens: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The verified chain: `tokens` [B, γ+1] are x0 and the drafts, `logits` [B·(γ+1), V]
        the target's after each prefix. Returns (target [B, γ+1], accept_lens [B]): request b
        commits target[b, :accept_lens[b]]."""


def acceptor_for(
    batch: ScheduleBatch,
    gamma: int,
    committed: torch.Tensor,
    rng: torch.Generator,
    device: torch.device | str,
) -> Acceptor:
    """The acceptor of a round of `gamma` drafts from committed lengths `committed` [B]."""
    if batch.sampling_info.is_all_greedy:
        return GreedyAcceptor()
    # [B, 2γ+1]: γ draft draws, γ acceptance tests, the last draw. Drawn on the host from a
    # generator every TP rank seeds and consumes alike, so ranks accept the same tokens.
    uniforms = torch.rand(len(batch.reqs), 2 * gamma + 1, generator=rng)
    info = batch.sampling_info
    return SampledAcceptor(
        temperatures=info.temperatures.view(-1),
        filters=batch_filters(batch),
        uniforms=to_device(uniforms, device),
        committed=committed,
        seeded=SeededRows.of(batch, device),
    )


def batch_filters(batch: ScheduleBatch) -> Filters | None:
    """The rows' filters from a batch's `SamplingBatchInfo`, or None when no row filters
    (SGLang's host flags say so; no device read)."""
    info = batch.sampling_info
    if info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling:
        candidates = max(req.sampling_params.top_k for req in batch.reqs)
        return Filters(info.top_ks, info.top_ps, info.min_ps, candidates)
    return None


class GreedyAcceptor:
    def propose(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def accept(
        self, tokens: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = logits.argmax(dim=-1).view(tokens.shape)
        return target, greedy_accept(tokens, target)


@dataclass
class SampledAcceptor:
    temperatures: torch.Tensor  # [B]
    filters: Filters | None  # `batch_filters`
    uniforms: torch.Tensor  # [B, 2γ+1]
    committed: torch.Tensor  # [B] S: draft step j samples position S + j
    seeded: SeededRows | None
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q_1.. as proposed

    def propose(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        probs = sampling_probs(logits, self.temperatures, self.filters)
        self.draft_probs.append(probs)
        tokens = sample_from(probs, self.uniforms[:, step])
        if self.seeded is not None:
            tokens = self.seeded.replace(tokens, self.seeded.sample(probs, self.committed + step))
        return tokens

    def accept(
        self, tokens: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, width = tokens.shape
        gamma = width - 1
        filters = self.filters and self.filters.repeat_interleave(width)
        temperatures = self.temperatures.repeat_interleave(width)
        target_probs = sampling_probs(logits, temperatures, filters).view(batch, width, -1)
        target, accept_lens = chain_rejection_sample(
            tokens[:, 1:],
            torch.stack(self.draft_probs, dim=1),
            target_probs,
            self.uniforms[:, gamma : 2 * gamma],
            self.uniforms[:, 2 * gamma],
        )
        if self.seeded is not None:
            # Seeded drafts are kept while they equal the target's seeded draw at their position.
            coupled = self.seeded.sample(target_probs, self.committed)
            target = self.seeded.replace(target, coupled)
            index = self.seeded.index
            accept_lens = self.seeded.replace(
                accept_lens, greedy_accept(tokens.index_select(0, index), coupled)
            )
        return target, accept_lens


@dataclass
class SeededRows:
    """The rows of a batch that sample with a `sampling_seed` (`sampling.seeded_sample`)."""

    index: torch.Tensor  # [n] row indices, on the device
    seeds: torch.Tensor  # [n] their seeds, on the device

    @classmethod
    def of(cls, batch: ScheduleBatch, device: torch.device | str) -> SeededRows | None:
        """The batch's seeded rows, or None (decided on the host). Greedy rows (top-k 1) need
        no seed."""
        rows = [
            (row, req.sampling_params.sampling_seed)
            for row, req in enumerate(batch.reqs)
            if req.sampling_params.sampling_seed is not None and req.sampling_params.top_k != 1
        ]
        if not rows:
            return None
        index, seeds = torch.tensor(rows, dtype=torch.int64).unbind(1)
        return cls(to_device(index, device), to_device(seeds, device))

    def sample(self, probs: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:
        """These rows' seeded tokens from the batch's [B, V] probabilities at positions
        `first_positions` [B] ([n] tokens), or from [B, W, V] at positions first_positions + w
        ([n, W] tokens)."""
        probs = probs.index_select(0, self.index)
        width = probs.shape[1] if probs.dim() == 3 else 1
        offsets = torch.arange(width, device=probs.device)
        positions = first_positions.index_select(0, self.index)[:, None] + offsets
        tokens = seeded_sample(
            probs.reshape(-1, probs.shape[-1]),
            self.seeds.repeat_interleave(width),
            positions.reshape(-1),
        )
        return tokens.view(-1, width) if probs.dim() == 3 else tokens

    def replace(self, values: torch.Tensor, rows_values: torch.Tensor) -> torch.Tensor:
        """`values` of the whole batch with these rows' taken from `rows_values`."""
        return values.index_copy(0, self.index, rows_values.to(values.dtype))

    def take_from_sampler(
        self,
        sampled: torch.Tensor,
        probs: torch.Tensor,
        batch: ScheduleBatch,
        positions: torch.Tensor,
    ) -> None:
        """In a step SGLang's sampler ran (the prefill's first token, a plain decode step):
        these rows' tokens in `sampled` [B] replaced in place by their seeded draws from the
        sampler's probabilities `probs` [B, V] (softmax of logits / temperature), filtered by
        the rows' top-k, top-p and min-p as a speculative round filters them."""
        rows = self.index
        probs = probs.index_select(0, rows)
        filters = batch_filters(batch)
        if filters is not None:
            probs = filtered_probs(probs, filters.index_select(rows))
        tokens = seeded_sample(probs, self.seeds, positions.index_select(0, rows))
        sampled.index_copy_(0, rows, tokens.to(sampled.dtype))


@dataclass
class AcceptanceStats:
    """Server-lifetime counters of verified rounds, per request. Token counts accumulate on
    the device (a round never waits to count) and are read when the server info is asked for."""

    request_rounds: int = 0  # (request, verify pass) pairs
    drafted: int = 0  # drafts in the verified chains
    accepted_tokens: torch.Tensor | int = 0  # committed by those passes, bonus tokens included

    def record(self, accept_lens: torch.Tensor, drafted: int) -> None:
        self.request_rounds += accept_lens.numel()
        self.drafted += drafted
        self.accepted_tokens = self.accepted_tokens + accept_lens.sum(dtype=torch.int64)

    def summary(self) -> dict:
        rounds = max(self.request_rounds, 1)
        accepted = int(self.accepted_tokens)
        return {
            "verify_rounds": self.request_rounds,
            "verified_drafts": self.drafted,
            "avg_accept_length": accepted / rounds,
            "draft_acceptance_rate": (accepted - self.request_rounds) / max(self.drafted, 1),
        }
