"""What a MagicDec forward hands SGLang besides the batch (SGLang's `spec_info`), and one round's
draft slots. The worker (`worker.py`) builds them; attention backends read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


class MagicDecInput(SpecInput):
    """What a MagicDec forward hands SGLang: token positions and, for draft steps, each
    request's draft slots for this round, `head_slots` [layers or 1, B, Hkv or 1, W] (padded;
    dims of size 1 broadcast) of which request b reads the first `kv_lens[b]`. A selection
    shared by all heads also comes as `kv_indptr/kv_indices`, the path SGLang's own decode
    backends read. Nothing is carried between rounds, so filtering and merging batches is a
    no-op."""

    def __init__(
        self,
        draft_token_num: int,
        positions: torch.Tensor | None = None,
        head_slots: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
    ):
        is_draft = head_slots is not None
        super().__init__(SpecInputType.EAGLE_DRAFT if is_draft else SpecInputType.NGRAM_VERIFY)
        self.draft_token_num = draft_token_num
        self.num_tokens_per_req = draft_token_num
        self.num_tokens_for_logprob_per_req = draft_token_num
        self.positions = positions
        self.head_slots = head_slots
        self.kv_lens = kv_lens
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices

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


@dataclass
class DraftRound:
    """One round's draft slots, built once and read by all γ draft steps: request b's
    selection (`selected[b]` slots) followed by the round's reserved slots, padded.

    head_slots  [layers or 1, B, Hkv or 1, selected.max() + γ] int64 pool slots
    selected    [B] slots of each request's selection; step j reads selected + j + 1
    """

    head_slots: torch.Tensor
    selected: torch.Tensor

    def step_input(self, step: int, positions: torch.Tensor) -> MagicDecInput:
        kv_lens = self.selected + step + 1
        kv_indptr = kv_indices = None
        if self.head_slots.shape[0] == 1 and self.head_slots.shape[2] == 1:
            # One list for every layer and head: also SGLang's ragged kv_indptr/kv_indices
            # (int32 offsets, int64 slots: the dtypes its triton/flashinfer decode backends use).
            slots = self.head_slots[0, :, 0]
            width = torch.arange(slots.shape[1], device=slots.device)
            kv_indices = slots[width[None, :] < kv_lens[:, None]]
            kv_indptr = torch.zeros(kv_lens.numel() + 1, dtype=torch.int32, device=slots.device)
            kv_indptr[1:] = kv_lens.cumsum(0)
        return MagicDecInput(
            draft_token_num=1,
            positions=positions,
            head_slots=self.head_slots,
            kv_lens=kv_lens,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
        )
