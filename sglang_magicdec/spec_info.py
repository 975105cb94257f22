"""What a MagicDec forward hands SGLang besides the batch (SGLang's `spec_info`), and one round's
draft slots. The worker (`worker.py`) builds them; attention backends read them, telling a draft
step by `draft_slots(forward_batch)` and reading a layer's lists with `HeadSlots.for_layer`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


@dataclass
class HeadSlots:
    """Padded lists of KV-pool slots per layer, request and KV head: request b's KV head h in
    layer l reads head_slots[l, b, h, :kv_lens[b]] (a dim of size 1 is shared by every layer, or
    every head). A draft step's slots; our CPU backend reads plain decode and verify this way too.

    head_slots  [layers or 1, B, Hkv or 1, W] int64
    kv_lens     [B] int64
    """

    head_slots: torch.Tensor
    kv_lens: torch.Tensor

    def for_layer(self, layer_id: int) -> torch.Tensor:
        """[B, Hkv or 1, W]: the lists of layer `layer_id`."""
        return self.head_slots[layer_id if self.head_slots.shape[0] > 1 else 0]

    @property
    def per_layer(self) -> bool:
        return self.head_slots.shape[0] > 1


def draft_slots(forward_batch) -> HeadSlots | None:
    """A MagicDec draft step's slots, or None: the one test of "this forward is a draft step"
    (a DECODE whose spec input carries draft slots)."""
    spec_info = forward_batch.spec_info
    if forward_batch.forward_mode.is_decode() and isinstance(spec_info, MagicDecInput):
        return spec_info.draft
    return None


class MagicDecInput(SpecInput):
    """What a MagicDec forward hands SGLang: token positions and, for draft steps, each
    request's draft slots for this round (`draft`: our backends read them; SGLang's own never see
    a draft step). Nothing is carried between rounds, so filtering and merging batches is a no-op.

    The verify contract: what SGLang 0.5.23's dense backends read of a TARGET_VERIFY forward
    (`init_forward_metadata`, eager; MAGICDEC runs no graphs), and what serves each read.
    - triton: `num_tokens_per_req` (the chain's width, `draft_token_num`) sizes `qo_indptr`,
      `custom_mask` (SpecInput's class default None: causal within the chain), and the batch's
      `seq_lens`, `seq_lens_sum`, `req_pool_indices`, `kv_loc_plan` (set by the worker).
    - flashinfer: `ragged_verify_layout` (class default None: uniform width),
      `spec_input_type` (NGRAM_VERIFY: neither DFLASH's nor EAGLE's paths), then
      `generate_attn_arg_prefill` below for (kv_indices, kv_indptr, qo_indptr, mask), and
      `num_tokens_per_req`; plus the batch's `seq_lens`, `seq_lens_cpu`, `seq_lens_sum`.
    - fa3 (topk 1): `ragged_verify_layout` (None), then its own `speculative_num_draft_tokens`
      for the width, which `MagicDecAttnBackend` sets to `draft_token_num` for that call only;
      the batch's `seq_lens`, `seq_lens_cpu` (the eager page-table bound), `req_pool_indices`.
    Positions come from `positions` ([B·width], S..S+γ per request) on every backend."""

    # SGLang pads a draft input's hidden states where it pads a batch (`_pad_inputs_to_size`:
    # DP attention, MLP sync); a MagicDec draft has none.
    hidden_states = None

    def __init__(
        self,
        draft_token_num: int,
        positions: torch.Tensor | None = None,
        head_slots: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
    ):
        is_draft = head_slots is not None
        super().__init__(SpecInputType.EAGLE_DRAFT if is_draft else SpecInputType.NGRAM_VERIFY)
        self.draft_token_num = draft_token_num
        self.num_tokens_per_req = draft_token_num
        self.num_tokens_for_logprob_per_req = draft_token_num
        self.positions = positions
        self.draft = HeadSlots(head_slots, kv_lens) if is_draft else None

    def generate_attn_arg_prefill(
        self,
        *,
        req_pool_indices: torch.Tensor,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        translator,
        plan,
        kind=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """FlashInfer's TARGET_VERIFY arguments (kv_indices, kv_indptr, qo_indptr, custom_mask):
        each request reads its committed slots and then its `draft_token_num` verify slots.
        No custom mask: a chain is causal, which FlashInfer's verify then applies."""
        from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind

        batch = req_pool_indices.numel()
        device = req_pool_indices.device
        width = self.draft_token_num
        kv_lens = paged_kernel_lens + width
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = kv_lens.cumsum(0)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * width
        kv_indices = torch.empty(
            paged_kernel_lens_sum + width * batch, dtype=torch.int32, device=device
        )
        translator.pack_read_stream(
            plan,
            req_pool_indices=req_pool_indices,
            seq_lens=kv_lens,
            indptr=kv_indptr,
            out=kv_indices,
            kind=IdSpaceKind.FULL if kind is None else kind,
        )
        return kv_indices, kv_indptr, qo_indptr, None

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu=None) -> None:
        pass

    def merge_batch(self, spec_info: SpecInput) -> None:
        pass


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: on CUDA, staged in pinned
    memory and copied asynchronously (a copy from pageable memory waits for the stream)."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_seq_lens(batch) -> torch.Tensor:
    """The batch's committed lengths on the host: the scheduler keeps a host copy for every
    batch the worker sees; else one copy."""
    return batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()


def host_copy(device_tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that does not wait for the device: on CUDA, an asynchronous copy into
    pinned memory, complete once the stream has run past this point (the scheduler waits for
    each round's tokens, so by its next host-side event, e.g. an eviction, it has)."""
    host = torch.empty(
        device_tensor.shape,
        dtype=device_tensor.dtype,
        pin_memory=device_tensor.device.type == "cuda",
    )
    return host.copy_(device_tensor, non_blocking=True)


@dataclass
class DraftPositions:
    """The committed positions one request's draft reads in a round, read through its own
    `req_to_token` row: the summary's first (per layer and KV head), then the ranges (every
    layer and head).

    summary  [layers, Hkv, kept] int64 positions on the device, or None
    ranges   position ranges, host side (the streaming window, a summary's recent tokens)
    """

    summary: torch.Tensor | None
    ranges: list[range]

    @property
    def range_count(self) -> int:
        return sum(len(positions) for positions in self.ranges)

    @property
    def count(self) -> int:
        return (0 if self.summary is None else self.summary.shape[-1]) + self.range_count


@dataclass
class DraftRound:
    """One round's draft slots, built once and read by all γ draft steps: request b's
    selection (`selected[b]` slots) followed by the round's reserved slots, padded.

    head_slots  [layers or 1, B, Hkv or 1, selected.max() + γ] int64 pool slots
    selected    [B] slots of each request's selection; step j reads selected + j + 1
    """

    head_slots: torch.Tensor
    selected: torch.Tensor

    @classmethod
    def build(
        cls,
        positions: list[DraftPositions],
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        round_slots: torch.Tensor,
    ) -> DraftRound:
        """Resolve every request's positions into pool slots on the device, with one host
        copy of the ranges for the whole batch and no wait on the device: the sizes all come
        from the host (ranges, summary shapes)."""
        device = round_slots.device
        gamma = round_slots.shape[1] - 1
        summaries = [p.summary for p in positions if p.summary is not None]
        layers = max((summary.shape[0] for summary in summaries), default=1)
        heads = max((summary.shape[1] for summary in summaries), default=1)
        range_counts = [p.range_count for p in positions]
        host = torch.zeros(len(positions), max(range_counts, default=0) + 1, dtype=torch.int64)
        for b, p in enumerate(positions):
            if p.ranges:
                host[b, : range_counts[b]] = torch.cat(
                    [torch.arange(r.start, r.stop) for r in p.ranges]
                )
        counts = [p.count for p in positions]
        range_slots = req_to_token[req_pool_indices[:, None], to_device(host, device)]
        head_slots = torch.zeros(
            layers, len(positions), heads, max(counts) + gamma, dtype=torch.int64, device=device
        )
        for b, p in enumerate(positions):
            start = 0
            if p.summary is not None:
                start = p.summary.shape[-1]
                head_slots[:, b, :, :start] = req_to_token[req_pool_indices[b], p.summary]
            stop = start + range_counts[b]
            head_slots[:, b, :, start:stop] = range_slots[b, : range_counts[b]]
            head_slots[:, b, :, stop : stop + gamma] = round_slots[b, :gamma]
        selected = to_device(torch.tensor(counts, dtype=torch.int64), device)
        return cls(head_slots, selected)

    def step_input(self, step: int, positions: torch.Tensor) -> MagicDecInput:
        return MagicDecInput(
            draft_token_num=1,
            positions=positions,
            head_slots=self.head_slots,
            kv_lens=self.selected + step + 1,
        )
