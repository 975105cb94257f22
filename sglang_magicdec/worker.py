"""The MagicDec speculative worker, run by the scheduler for `--speculative-algorithm MAGICDEC`.

Extend batches go to the target model as usual (the draft selection watches: SnapKV scores the
prompt). Each decode round, per request with committed length S and last sampled token x0 (its
KV not computed yet), once the draft's slots of the whole batch are resolved into one tensor:

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

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_magicdec import round_batches
from sglang_magicdec.acceptance import AcceptanceStats, SeededRows, acceptor_for
from sglang_magicdec.config import MagicDecConfig
from sglang_magicdec.debug_checks import check_ranks_agree, check_selection
from sglang_magicdec.drafts.selection import make_selection
from sglang_magicdec.gamma import GammaController
from sglang_magicdec.metrics import PLAIN_REASONS, MagicDecMetrics
from sglang_magicdec.penalties import RoundPenalties
from sglang_magicdec.round_batches import Committed
from sglang_magicdec.round_clock import RoundClock
from sglang_magicdec.spec_info import DraftPositions, DraftRound, MagicDecInput, to_device

logger = logging.getLogger(__name__)


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
        self._on_cuda = torch.device(self.device).type == "cuda"
        self.config = MagicDecConfig.of(server_args)
        self.gamma: int = get_spec().speculative_num_steps
        self.num_draft_tokens: int = get_spec().speculative_num_draft_tokens
        assert self.num_draft_tokens == self.gamma + 1
        self.draft = make_selection(self.config, self.model_runner.model)
        self.stats = AcceptanceStats()
        # Tensor-parallel ranks must run the same round. Data every rank shares decides it
        # (the batch, the accepted tokens, the store's events), except what each rank times or
        # draws: γ = auto is decided on the first rank and broadcast, and unseeded uniforms come
        # from a generator every rank seeds and consumes alike (SGLang's sampler likewise relies
        # on identical seeds rather than syncing its tokens).
        self.tp_group = get_parallel().tp_group
        auto = self.config.gamma == "auto"
        self.gamma_control = GammaController(
            self.gamma, auto, self.tp_group, budgets=self.config.budgets
        )
        self.clock = RoundClock(timed=auto, on_cuda=self._on_cuda)
        self.latest_gamma = 0  # of the latest decode batch (0: decoded without drafts)
        # Decode batches run as plain steps, by why (`PLAIN_REASONS`).
        self.plain_batches = dict.fromkeys(PLAIN_REASONS, 0)
        self.metrics: MagicDecMetrics | None = None  # created at the first publish
        self.rng = torch.Generator().manual_seed(target_worker.random_seed)
        logger.info(
            "MagicDec: %s, gamma=%d, dense below %d tokens",
            self.config,
            self.gamma,
            self.config.dense_below,
        )

    def server_info(self) -> dict:
        """What `/server_info` shows under `magicdec` (see `plugin.add_server_info`)."""
        return {
            "draft": self.config.draft,
            "budget": self.config.budget,
            "sinks": self.config.sinks,
            "gamma": self.gamma,
            **self.stats.summary(),
            "plain_batches": dict(self.plain_batches),
            **self.gamma_control.info(),
            **self.draft.info(),
        }

    @property
    def draft_worker(self) -> None:
        return None  # the draft is the target model itself

    # SGLang's `sglang:spec_num_steps` / `spec_num_draft_tokens` gauges read these: the γ that
    # is active, which under γ = auto changes from batch to batch.
    @property
    def speculative_num_steps(self) -> int:
        return self.latest_gamma

    @property
    def speculative_num_draft_tokens(self) -> int:
        return self.latest_gamma + 1 if self.latest_gamma else 0

    def publish_metrics(self, labels: dict[str, str]) -> None:
        """After a decode batch, with `--enable-metrics` (`metrics.publish_after_decode`)."""
        if self.metrics is None:
            self.metrics = MagicDecMetrics(labels)
        counts = {"verify_rounds": self.stats.request_rounds, **self.draft.info()}
        self.metrics.publish(counts, self.plain_batches, self.latest_gamma)

    def alloc_memory_pool(self, **kwargs) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = (
            self._target_worker.get_memory_pool()
        )

    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if not batch.forward_mode.is_decode():
            with self.clock.phase("extend"):
                return self._extend(batch, on_publish, pp_proxy_tensors)
        plain_reason = self._cannot_speculate(batch)
        gamma, budget = (0, None) if plain_reason else self.gamma_control.choose(batch)
        self.latest_gamma = gamma
        bucket = self.gamma_control.bucket(batch)
        if gamma == 0:
            self.plain_batches[plain_reason or "cost_model"] += 1
            with self.clock.phase("plain_decode"):
                result = self._plain_decode(batch, on_publish)
            self.gamma_control.record_decode(bucket, self.clock)
            return result
        rids = [req.rid for req in batch.reqs]
        with self.clock.phase("round"):
            result = self._speculate(batch, on_publish, gamma, budget)
        self.gamma_control.record_round(bucket, gamma, rids, result.accept_lens, self.clock, budget)
        return result

    # -- extend: the target as usual (the draft watches) ----------------------------------------

    def _extend(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        req_to_token = self.req_to_token_pool.req_to_token
        self.draft.before_extend(batch, req_to_token)
        failed = True
        try:
            result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors
            )
            failed = False
        finally:
            self.draft.after_extend(
                batch, req_to_token, self.model_runner.token_to_kv_pool, failed=failed
            )
        self._take_seeded_tokens(batch, result, batch.seq_lens.to(torch.int64) - 1)
        if on_publish is not None:
            on_publish(batch.seq_lens)
        # Extend results carry one token per request, unpadded (the prefill's first token).
        result.accept_lens = torch.ones_like(batch.seq_lens, dtype=torch.int32)
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = MagicDecInput(draft_token_num=self.num_draft_tokens)
        result.speculative_num_draft_tokens = self.num_draft_tokens
        return result

    # -- decode: draft, verify, accept, commit ------------------------------------------------

    def _speculate(
        self, batch: ScheduleBatch, on_publish, gamma: int, budget: int
    ) -> GenerationBatchResult:
        committed = Committed.of(batch)
        round_slots = self._round_slots(batch, committed, gamma + 1)
        with self.clock.phase("draft_round"):
            draft_round = self._draft_round(batch, committed, round_slots, budget)
        acceptor = acceptor_for(batch, gamma, committed.device, self.rng, self.device)
        # Each position's logits as SGLang's sampler rewrites them: penalties (for the output and
        # the drafts before it), then the requests' logit bias.
        penalties = RoundPenalties.of(batch, self.device)
        draft_penalties = penalties and penalties.copy()
        bias = batch.sampling_info.logit_bias  # [B, V] or None
        tokens = self._last_tokens(batch)
        for step in range(gamma):
            logits = self._draft_step(batch, committed, step, tokens, draft_round, round_slots)
            if draft_penalties is not None:
                draft_penalties.apply(logits)
            if bias is not None:
                logits.add_(bias)
            proposed = acceptor.propose(logits, step)
            if draft_penalties is not None:
                draft_penalties.advance(proposed)
            tokens = torch.cat([tokens, proposed[:, None]], dim=1)
        with self.clock.phase("verify"):
            verify = self._verify(batch, committed, tokens, round_slots)
        verify_logits = verify.logits_output.next_token_logits  # in place: logprobs read them too
        if penalties is not None:
            penalties.apply_chain(verify_logits, tokens)
        if bias is not None:
            verify_logits.view(*tokens.shape, -1).add_(bias[:, None])
        target, accept_lens = acceptor.accept(tokens, verify_logits)
        with self.clock.phase("commit"):
            return self._commit(batch, verify, target, accept_lens, on_publish)

    def _commit(self, batch, verify, target, accept_lens, on_publish) -> GenerationBatchResult:
        """Request b commits target[b, :accept_lens[b]]: counted and handed back."""
        gamma = target.shape[1] - 1
        if self.config.debug and self.tp_group.world_size > 1:
            check_ranks_agree(self.tp_group, target, accept_lens)
        self.stats.record(accept_lens, gamma * len(batch.reqs))
        if batch.return_logprob:
            # Verify row b·(γ+1)+j is the target's distribution of target[b, j] (penalised and
            # biased; SGLang's EAGLE function divides it by the temperature where a row samples).
            compute_spec_logprobs(
                batch, verify.logits_output, target.reshape(-1), chain_stride=gamma + 1
            )
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(verify, target, accept_lens, new_seq_lens)

    def _plain_decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """One ordinary decode step (γ = 0) in the round's first reserved slot."""
        committed = Committed.of(batch)
        slots = self._round_slots(batch, committed, 1)
        round_batches.plain_decode(batch, committed, self._last_tokens(batch)[:, 0], slots)
        penalties = RoundPenalties.of(batch, self.device)
        if penalties is not None:
            # SGLang's state missed the tokens of earlier rounds but their last (its copy for
            # this forward is ours to rewrite; the scheduler keeps its own).
            batch.sampling_info.acc_additive_penalties = penalties.additive()
            batch.sampling_info.acc_scaling_penalties = penalties.scaling()
        result = self.target_worker.forward_batch_generation(batch)
        self._take_seeded_tokens(batch, result, committed.device)
        if batch.return_logprob:
            # Sampling computed them (its logits are probabilities by now); the scheduler reads a
            # speculative batch's logprobs as one row per request.
            output = result.logits_output
            output.next_token_logprobs = output.next_token_logprobs.view(-1, 1)
        new_seq_lens = committed.device.to(torch.int32) + 1
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(
            result, result.next_token_ids.view(-1, 1), torch.ones_like(new_seq_lens), new_seq_lens
        )

    def _draft_round(
        self, batch: ScheduleBatch, committed: Committed, round_slots: torch.Tensor, budget: int
    ) -> DraftRound:
        """Each request's draft slots for this round, resolved once on the device: the draft
        selection's positions at `budget` (its whole context below `--magicdec-min-context`),
        then the round's slots."""
        req_to_token = self.req_to_token_pool.req_to_token
        positions = []
        for req, length in zip(batch.reqs, committed.lengths, strict=True):
            if length < self.config.dense_below:
                positions.append(DraftPositions(None, [range(length)]))
            else:
                row = req_to_token[req.kv.req_pool_idx]
                positions.append(self.draft.positions(req, length, row, budget))
        draft_round = DraftRound.build(positions, req_to_token, batch.req_pool_indices, round_slots)
        if self.config.debug:
            for b, (req, length) in enumerate(zip(batch.reqs, committed.lengths, strict=True)):
                slots = draft_round.head_slots[:, b, :, : positions[b].count]
                row = req_to_token[req.kv.req_pool_idx]
                allocator = self.token_to_kv_pool_allocator
                check_selection(self.draft, allocator, req, row, length, slots)
        return draft_round

    def _draft_step(self, batch, committed, step, tokens, draft_round, round_slots) -> torch.Tensor:
        """DECODE of token `step` at position S+step over the draft slots; returns logits."""
        with self.clock.phase("draft_step"):
            round_batches.draft_step(batch, committed, step, tokens, draft_round, round_slots)
            result = self.target_worker.forward_batch_generation(batch, is_verify=True)
        return result.logits_output.next_token_logits

    def _verify(self, batch, committed, tokens, round_slots) -> GenerationBatchResult:
        """TARGET_VERIFY over [x0, d1..dγ] at S..S+γ, full attention, exact KV into the slots."""
        round_batches.verify(batch, committed, tokens, round_slots)
        return self.target_worker.forward_batch_generation(batch, is_verify=True)

    # -- γ per batch ---------------------------------------------------------------------------

    @staticmethod
    def _cannot_speculate(batch: ScheduleBatch) -> str | None:
        """Why this batch takes a plain decode step whatever γ would be (`PLAIN_REASONS`), or
        None. Greedy and sampled requests speculate, with penalties, logit bias and logprobs
        (from the verify, `_commit`). What rewrites the target's logits in ways a round does
        not follow does not: grammars and custom logit processors."""
        if batch.has_grammar:
            return "grammar"
        if batch.sampling_info.has_custom_logit_processor:
            return "custom_logit_processor"
        return None

    # -- helpers ------------------------------------------------------------------------------

    def _take_seeded_tokens(self, batch, result, positions: torch.Tensor) -> None:
        """Rows with a `sampling_seed` take `seeded_sample`'s token in steps SGLang's sampler ran
        (the prefill's first token, plain decode steps), as they do in speculative rounds: their
        output is then one function of the seed whatever γ each step had. SGLang's own sampler
        honours the seed only under --enable-deterministic-inference. Batches whose logits
        something rewrites per token (`_cannot_speculate`) or that return logprobs keep SGLang's."""
        if batch.sampling_info.is_all_greedy or batch.return_logprob:
            return
        seeded = SeededRows.of(batch, self.device)
        if seeded is None or self._cannot_speculate(batch):
            return
        # SGLang's sampler has left softmax(logits / temperature) in place of the logits.
        probs = result.logits_output.next_token_logits
        if self.config.debug:
            sums = probs.sum(dim=-1)
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-3), "logits, not probs"
        seeded.take_from_sampler(result.next_token_ids, probs, batch, positions)

    def _round_slots(self, batch: ScheduleBatch, committed: Committed, width: int) -> torch.Tensor:
        req_to_token = self.req_to_token_pool.req_to_token
        return round_batches.round_slots(batch, req_to_token, committed, width)

    def _last_tokens(self, batch: ScheduleBatch) -> torch.Tensor:
        """[batch, 1] the last sampled token of each request: the round's x0."""
        tokens = torch.tensor([[req.output_ids[-1]] for req in batch.reqs], dtype=torch.int64)
        return to_device(tokens, self.device)

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
