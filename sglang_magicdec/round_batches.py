"""A decode round's forwards, as the batch SGLang's model runner is handed for each: the one
place that builds them, called by the worker (`worker.py`) and by the bit-exactness check
(`test/decode_forward_check.py`), so the check tests the batches the worker runs.

Each function rewrites the ScheduleBatch fields a forward reads (mode, input ids, the slots its
KV goes to, lengths, spec input); the scheduler restores them when the worker returns
(`Scheduler._forward_isolation`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_magicdec.spec_info import DraftRound, MagicDecInput, host_seq_lens


@dataclass
class Committed:
    """The batch's committed lengths S at a round's start: on the device for the forwards, and
    the scheduler's host copy for everything decided on the host (never copied back)."""

    device: torch.Tensor  # [B] int64
    host: torch.Tensor  # [B] int64
    lengths: list[int]
    total: int

    @classmethod
    def of(cls, batch: ScheduleBatch) -> Committed:
        host = host_seq_lens(batch)
        lengths = host.tolist()
        return cls(batch.seq_lens.to(torch.int64), host.to(torch.int64), lengths, sum(lengths))


def round_slots(
    batch: ScheduleBatch, req_to_token: torch.Tensor, committed: Committed, width: int
) -> torch.Tensor:
    """[B, width] the pool slots the scheduler reserved for positions S..S+width-1."""
    offsets = torch.arange(width, dtype=torch.int64, device=committed.device.device)
    positions = committed.device[:, None] + offsets
    rows = batch.req_pool_indices.to(torch.int64)[:, None]
    return req_to_token[rows, positions].to(torch.int64)


def set_lens(batch: ScheduleBatch, committed: Committed, offset: int) -> None:
    """A forward attends to the committed lengths plus `offset`: set on the device and on the
    host, each from its own copy."""
    batch.seq_lens = (committed.device + offset).to(torch.int32)
    batch.seq_lens_cpu = (committed.host + offset).to(torch.int32)
    batch.seq_lens_sum = committed.total + offset * len(batch.reqs)
    batch.orig_seq_lens = batch.seq_lens


def plain_decode(
    batch: ScheduleBatch, committed: Committed, x0: torch.Tensor, slots: torch.Tensor
) -> None:
    """An ordinary DECODE of x0 [B] at position S into the round's first reserved slot."""
    batch.forward_mode = ForwardMode.DECODE
    batch.input_ids = x0
    batch.out_cache_loc = slots[:, 0]
    set_lens(batch, committed, 1)
    batch.spec_info = None


def draft_step(
    batch: ScheduleBatch,
    committed: Committed,
    step: int,
    tokens: torch.Tensor,
    draft_round: DraftRound,
    slots: torch.Tensor,
) -> None:
    """The DECODE of tokens[:, step] at position S+step, attending to the draft slots only
    (`draft_round`'s lists, then the round's tokens before it), its KV into slot S+step."""
    batch.forward_mode = ForwardMode.DECODE
    batch.input_ids = tokens[:, step].contiguous()
    batch.out_cache_loc = slots[:, step].contiguous()
    set_lens(batch, committed, step + 1)
    batch.spec_info = draft_round.step_input(step, committed.device + step)


def verify(
    batch: ScheduleBatch, committed: Committed, tokens: torch.Tensor, slots: torch.Tensor
) -> None:
    """The TARGET_VERIFY of tokens [B, γ+1] (x0 and the drafts) at positions S..S+γ with full
    attention, their exact KV into the round's slots."""
    width = tokens.shape[1]
    offsets = torch.arange(width, dtype=torch.int64, device=committed.device.device)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.input_ids = tokens.reshape(-1).contiguous()
    batch.out_cache_loc = slots[:, :width].reshape(-1).contiguous()
    set_lens(batch, committed, 0)
    positions = (committed.device[:, None] + offsets).reshape(-1)
    batch.spec_info = MagicDecInput(draft_token_num=width, positions=positions)
