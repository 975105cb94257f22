"""The MagicDec speculative worker, run by the scheduler for `--speculative-algorithm MAGICDEC`.

Extend batches go to the target model as usual. Each decode round, per request with committed
length S and last sampled token x0 (its KV not computed yet):

1. draft: γ DECODE forwards of the target model itself, whose attention reads only the request's
   draft slots (the draft policy's selection of committed positions, plus this round's tokens),
   writing draft KV into the round's reserved slots S..S+γ-1;
2. verify: one TARGET_VERIFY forward over [x0, d1..dγ] at positions S..S+γ with full attention,
   which overwrites those slots with exact KV;
3. accept: the longest prefix of drafts the target agrees with, plus the target's next token;
4. commit: S += accepted + 1. Rejected slots stay reserved for the next round; the scheduler
   trims outputs at EOS, stop strings and max_new_tokens inside the accepted run.

Drafts are index lists into SGLang's KV pool, never copies. The scheduler reserves the round's
slots (spec v2 decode allocation) and restores every ScheduleBatch field this worker edits when
the forward returns (`Scheduler._forward_isolation`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from sglang_magicdec.config import MagicDecConfig
from sglang_magicdec.drafts import StreamingDraft

logger = logging.getLogger(__name__)


class MagicDecInput(SpecInput):
    """What a MagicDec forward hands SGLang: token positions and, for draft steps, each
    request's KV slots (`kv_indptr`/`kv_indices`, the path SGLang's decode backends read).
    Nothing is carried between rounds, so filtering and merging batches is a no-op."""

    def __init__(
        self,
        draft_token_num: int,
        positions: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
    ):
        is_draft = kv_indices is not None
        super().__init__(SpecInputType.EAGLE_DRAFT if is_draft else SpecInputType.NGRAM_VERIFY)
        self.draft_token_num = draft_token_num
        self.num_tokens_per_req = draft_token_num
        self.num_tokens_for_logprob_per_req = draft_token_num
        self.positions = positions
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu=None) -> None:
        pass

    def merge_batch(self, spec_info: SpecInput) -> None:
        pass


@dataclass
class AcceptanceStats:
    """Server-lifetime counters of verified rounds, per request."""

    request_rounds: int = 0  # (request, verify pass) pairs
    accepted_tokens: int = 0  # tokens those passes committed, the target's bonus token included
    correct_drafts: int = 0

    def record(self, accept_lens: torch.Tensor) -> None:
        self.request_rounds += accept_lens.numel()
        accepted = int(accept_lens.sum())
        self.accepted_tokens += accepted
        self.correct_drafts += accepted - accept_lens.numel()

    def summary(self, gamma: int) -> dict:
        rounds = max(self.request_rounds, 1)
        return {
            "verify_rounds": self.request_rounds,
            "avg_accept_length": self.accepted_tokens / rounds,
            "draft_acceptance_rate": self.correct_drafts / (rounds * gamma),
        }


class MagicDecWorker(BaseSpecWorker):
    """Self-speculation: the target model drafts on a sparse view of its own KV cache."""

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int,
        nccl_port: int,
        target_worker: TpModelWorker,
    ):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.config = MagicDecConfig.from_env()
        self.gamma: int = get_spec().speculative_num_steps
        self.num_draft_tokens: int = get_spec().speculative_num_draft_tokens
        assert self.num_draft_tokens == self.gamma + 1
        self.draft_policy = StreamingDraft(budget=self.config.budget, sinks=self.config.sinks)
        self.stats = AcceptanceStats()
        logger.info(
            "MagicDec: draft=%s budget=%d sinks=%d gamma=%d dense below %d tokens",
            self.config.draft,
            self.config.budget,
            self.config.sinks,
            self.gamma,
            self.config.dense_below,
        )

    def server_info(self) -> dict:
        """What `/get_server_info` shows under `magicdec` (see `plugin.add_server_info`)."""
        return {
            "draft": self.config.draft,
            "budget": self.config.budget,
            "sinks": self.config.sinks,
            "gamma": self.gamma,
            **self.stats.summary(self.gamma),
        }

    @property
    def draft_worker(self) -> None:
        return None  # the draft is the target model itself

    def alloc_memory_pool(self, **kwargs) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = (
            self._target_worker.get_memory_pool()
        )

    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            if self._can_speculate(batch):
                return self._speculate(batch, on_publish)
            return self._plain_decode(batch, on_publish)
        return self._extend(batch, on_publish, pp_proxy_tensors)

    # -- extend: the target as usual -------------------------------------------------------

    def _extend(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors
        )
        if on_publish is not None:
            on_publish(batch.seq_lens)
        # Extend results carry one token per request, unpadded (the prefill's first token).
        result.accept_lens = torch.ones_like(batch.seq_lens, dtype=torch.int32)
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = MagicDecInput(draft_token_num=self.num_draft_tokens)
        result.speculative_num_draft_tokens = self.num_draft_tokens
        return result

    # -- decode: draft, verify, accept, commit ----------------------------------------------

    def _can_speculate(self, batch: ScheduleBatch) -> bool:
        """Greedy only, for now: anything that changes the target's choice per token (sampling,
        penalties, logit bias, grammars) takes a plain decode step."""
        info = batch.sampling_info
        penalties = info.penalizer_orchestrator
        return (
            info.is_all_greedy
            and not batch.has_grammar
            and info.logit_bias is None
            and (penalties is None or not penalties.is_required)
        )

    def _speculate(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        committed = batch.seq_lens.to(torch.int64)
        round_slots = self._round_slots(batch, committed, self.num_draft_tokens)
        draft_slots = self._draft_slots(batch, committed)
        tokens = self._last_tokens(batch)

        for step in range(self.gamma):
            logits = self._draft_step(batch, committed, step, tokens, draft_slots, round_slots)
            tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)

        verify = self._verify(batch, committed, tokens, round_slots)
        target = verify.logits_output.next_token_logits.argmax(dim=-1).view(tokens.shape)
        agrees = (tokens[:, 1:] == target[:, :-1]).to(torch.int32)
        accept_lens = agrees.cumprod(dim=1).sum(dim=1, dtype=torch.int32) + 1
        self.stats.record(accept_lens)
        if batch.return_logprob:
            # Verify row b·(γ+1)+j is the target's distribution of target[b, j].
            compute_spec_logprobs(
                batch, verify.logits_output, target.reshape(-1), chain_stride=self.num_draft_tokens
            )
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(verify, target, accept_lens, new_seq_lens)

    def _plain_decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """One ordinary decode step (γ = 0) in the round's first reserved slot."""
        committed = batch.seq_lens.to(torch.int64)
        batch.input_ids = self._last_tokens(batch)[:, 0]
        batch.out_cache_loc = self._round_slots(batch, committed, 1)[:, 0]
        self._set_lens(batch, committed + 1)
        batch.spec_info = None
        result = self.target_worker.forward_batch_generation(batch)
        if batch.return_logprob:
            # Sampling computed them (its logits are probabilities by now); the scheduler reads a
            # speculative batch's logprobs as one row per request.
            output = result.logits_output
            output.next_token_logprobs = output.next_token_logprobs.view(-1, 1)
        new_seq_lens = committed.to(torch.int32) + 1
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(
            result, result.next_token_ids.view(-1, 1), torch.ones_like(new_seq_lens), new_seq_lens
        )

    def _draft_step(self, batch, committed, step, tokens, draft_slots, round_slots) -> torch.Tensor:
        """DECODE of token `step` at position S+step over the draft slots; returns logits."""
        kv_lists = [
            torch.cat([selected, round_slots[i, : step + 1]])
            for i, selected in enumerate(draft_slots)
        ]
        # int32 offsets, int64 slots: the dtypes SGLang's triton/flashinfer decode backends use.
        kv_indptr = torch.zeros(len(kv_lists) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor([len(slots) for slots in kv_lists]).cumsum(0)
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = tokens[:, step].contiguous()
        batch.out_cache_loc = round_slots[:, step].contiguous()
        self._set_lens(batch, committed + step + 1)
        batch.spec_info = MagicDecInput(
            draft_token_num=1,
            positions=(committed + step).to(self.device),
            kv_indptr=kv_indptr.to(self.device),
            kv_indices=torch.cat(kv_lists).to(self.device),
        )
        result = self.target_worker.forward_batch_generation(batch, is_verify=True)
        return result.logits_output.next_token_logits

    def _verify(self, batch, committed, tokens, round_slots) -> GenerationBatchResult:
        """TARGET_VERIFY over [x0, d1..dγ] at S..S+γ, full attention, exact KV into the slots."""
        offsets = torch.arange(self.num_draft_tokens, dtype=torch.int64)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tokens.reshape(-1).contiguous()
        batch.out_cache_loc = round_slots.reshape(-1).contiguous()
        self._set_lens(batch, committed)
        batch.spec_info = MagicDecInput(
            draft_token_num=self.num_draft_tokens,
            positions=(committed[:, None] + offsets).reshape(-1).to(self.device),
        )
        return self.target_worker.forward_batch_generation(batch, is_verify=True)

    # -- helpers ----------------------------------------------------------------------------

    def _draft_slots(self, batch: ScheduleBatch, committed: torch.Tensor) -> list[torch.Tensor]:
        """Pool slots of each request's draft selection among its committed positions."""
        req_to_token = self.req_to_token_pool.req_to_token
        slots = []
        for req, row, length in zip(
            batch.reqs, batch.req_pool_indices.tolist(), committed.tolist(), strict=True
        ):
            if length < self.config.dense_below:
                positions = torch.arange(length)
            else:
                positions = self.draft_policy.select(length, len(req.origin_input_ids))
            selected = req_to_token[row, positions.to(req_to_token.device)].to(torch.int64)
            if self.config.debug:
                self._check_selection(row, length, selected)
            slots.append(selected)
        return slots

    def _check_selection(self, row: int, length: int, selected: torch.Tensor) -> None:
        """Debug mode: every selected slot belongs to the request's live committed KV."""
        live = self.req_to_token_pool.req_to_token[row, :length].to(torch.int64)
        assert bool(torch.isin(selected, live).all()), "draft selection points outside live KV"
        free = self.token_to_kv_pool_allocator.free_pages
        if free is not None and free.numel():
            assert not bool(torch.isin(selected, free.to(torch.int64)).any()), (
                "draft selection points at freed KV slots"
            )

    def _round_slots(
        self, batch: ScheduleBatch, committed: torch.Tensor, width: int
    ) -> torch.Tensor:
        """[batch, width] pool slots reserved for positions S..S+width-1."""
        positions = committed[:, None] + torch.arange(width, dtype=torch.int64)
        rows = batch.req_pool_indices.to(torch.int64)[:, None]
        return self.req_to_token_pool.req_to_token[rows, positions].to(torch.int64)

    def _last_tokens(self, batch: ScheduleBatch) -> torch.Tensor:
        """[batch, 1] the last sampled token of each request: the round's x0."""
        return torch.tensor(
            [[req.output_ids[-1]] for req in batch.reqs], dtype=torch.int64, device=self.device
        )

    @staticmethod
    def _set_lens(batch: ScheduleBatch, seq_lens: torch.Tensor) -> None:
        batch.seq_lens = seq_lens.to(torch.int32)
        batch.seq_lens_cpu = batch.seq_lens.cpu()
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.orig_seq_lens = batch.seq_lens

    def _result(self, forward, accepted, accept_lens, new_seq_lens) -> GenerationBatchResult:
        """Pad each request's accepted tokens to the round's stride, as the scheduler reads them."""
        stride = self.num_draft_tokens
        padded = torch.zeros(accepted.shape[0], stride, dtype=torch.int64, device=accepted.device)
        padded[:, : accepted.shape[1]] = accepted
        accept_lens = accept_lens.to(torch.int32)
        return GenerationBatchResult(
            logits_output=forward.logits_output,
            next_token_ids=padded.reshape(-1),
            can_run_cuda_graph=False,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens.to(torch.int32),
            next_draft_input=MagicDecInput(draft_token_num=stride),
            speculative_num_draft_tokens=stride,
        )
