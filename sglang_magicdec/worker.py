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
import time
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

from sglang_magicdec import summaries as summaries_module
from sglang_magicdec.config import MagicDecConfig
from sglang_magicdec.cost_model import CostModel, StepCosts
from sglang_magicdec.drafts import SnapKVDraft, StreamingDraft
from sglang_magicdec.observer import PendingWindow, WindowObserver
from sglang_magicdec.sampling import chain_rejection_sample, sample_from, sampling_probs
from sglang_magicdec.summaries import Summary, SummaryStore

logger = logging.getLogger(__name__)


class MagicDecInput(SpecInput):
    """What a MagicDec forward hands SGLang: token positions and, for draft steps, each
    request's KV slots: `kv_indptr/kv_indices` shared by all heads (the path SGLang's decode
    backends read), or `head_kv_indices` [layers, Hkv, total] when every layer and KV head reads
    its own slots (SnapKV). Nothing is carried between rounds, so filtering and merging batches
    is a no-op."""

    def __init__(
        self,
        draft_token_num: int,
        positions: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        head_kv_indices: torch.Tensor | None = None,
    ):
        is_draft = kv_indptr is not None
        super().__init__(SpecInputType.EAGLE_DRAFT if is_draft else SpecInputType.NGRAM_VERIFY)
        self.draft_token_num = draft_token_num
        self.num_tokens_per_req = draft_token_num
        self.num_tokens_for_logprob_per_req = draft_token_num
        self.positions = positions
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.head_kv_indices = head_kv_indices

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
    drafted: int = 0

    def record(self, accept_lens: torch.Tensor, gamma: int) -> None:
        self.request_rounds += accept_lens.numel()
        accepted = int(accept_lens.sum())
        self.accepted_tokens += accepted
        self.correct_drafts += accepted - accept_lens.numel()
        self.drafted += gamma * accept_lens.numel()

    def summary(self) -> dict:
        rounds = max(self.request_rounds, 1)
        return {
            "verify_rounds": self.request_rounds,
            "avg_accept_length": self.accepted_tokens / rounds,
            "draft_acceptance_rate": self.correct_drafts / max(self.drafted, 1),
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
        self._on_cuda = torch.device(self.device).type == "cuda"
        self.config = MagicDecConfig.from_env()
        self.gamma: int = get_spec().speculative_num_steps
        self.num_draft_tokens: int = get_spec().speculative_num_draft_tokens
        assert self.num_draft_tokens == self.gamma + 1
        config = self.config
        # Streaming is also SnapKV's fallback for prompts it could not summarise.
        self.streaming = StreamingDraft(budget=config.budget, sinks=config.sinks)
        self.snapkv: SnapKVDraft | None = None
        if config.draft == "snapkv":
            self.snapkv = SnapKVDraft(
                budget=config.budget,
                obs_window=config.obs_window,
                pool=config.pool,
                pool_kernel=config.pool_kernel,
            )
            self.summaries = SummaryStore(share_min_len=config.share_min_len)
            self.observer = WindowObserver(self.model_runner.model)
            self.num_layers = len(self.observer.layers)
        self.stats = AcceptanceStats()
        self.cost_model = CostModel(gamma_max=self.gamma) if config.gamma == "auto" else None
        summaries_module.ACTIVE = self
        logger.info(
            "MagicDec: %s, gamma=%d, dense below %d tokens", config, self.gamma, config.dense_below
        )

    def server_info(self) -> dict:
        """What `/get_server_info` shows under `magicdec` (see `plugin.add_server_info`)."""
        return {
            "draft": self.config.draft,
            "budget": self.config.budget,
            "sinks": self.config.sinks,
            "gamma": self.gamma,
            **self.stats.summary(),
            **self._gamma_info(),
            **(self.summaries.info() if self.snapkv else {}),
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
            gamma = self._choose_gamma(batch) if self._can_speculate(batch) else 0
            if gamma > 0:
                return self._speculate(batch, on_publish, gamma)
            return self._plain_decode(batch, on_publish)
        return self._extend(batch, on_publish, pp_proxy_tensors)

    def _choose_gamma(self, batch: ScheduleBatch) -> int:
        """γ for this round: fixed, or the cost model's pick for this batch (0 = plain step)."""
        if self.cost_model is None:
            return self.gamma
        previous = self.cost_model.last
        mean_context = self._mean_context(batch)
        decision = self.cost_model.choose([req.rid for req in batch.reqs], mean_context)
        if previous is None or previous.gamma != decision.gamma:
            logger.info(
                "MagicDec γ %s -> %d (batch %d, mean context %d, %s, predicted %.2fx)",
                "-" if previous is None else previous.gamma,
                decision.gamma,
                len(batch.reqs),
                mean_context,
                decision.reason,
                decision.predicted_speedup,
            )
        return decision.gamma

    def _gamma_info(self) -> dict:
        if self.cost_model is None:
            return {"gamma_mode": "fixed", "current_gamma": self.gamma}
        last = self.cost_model.last
        return {
            "gamma_mode": "auto",
            "current_gamma": None if last is None else last.gamma,
            "predicted_speedup": None if last is None else last.predicted_speedup,
            "gamma_reason": None if last is None else last.reason,
            # The latest decision per (batch size, mean context) bucket, both rounded up to
            # powers of two.
            "gamma_by_bucket": {
                f"batch<={batch},context<={context}": {
                    "gamma": decision.gamma,
                    "predicted_speedup": decision.predicted_speedup,
                    "reason": decision.reason,
                    **self.cost_model.costs.get((batch, context), StepCosts()).milliseconds(),
                }
                for (batch, context), decision in sorted(self.cost_model.decisions.items())
            },
        }

    def _bucket(self, batch: ScheduleBatch) -> tuple[int, int]:
        return CostModel.bucket(len(batch.reqs), self._mean_context(batch))

    @staticmethod
    def _mean_context(batch: ScheduleBatch) -> float:
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        return float(seq_lens.sum()) / max(len(batch.reqs), 1)

    # -- extend: the target as usual -------------------------------------------------------

    def _extend(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        if self.snapkv is not None:
            self._plan_summaries(batch)
        try:
            result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors
            )
        finally:
            if self.snapkv is not None:
                self.observer.disarm()
        if self.snapkv is not None:
            self._compute_summaries(batch)
        if on_publish is not None:
            on_publish(batch.seq_lens)
        # Extend results carry one token per request, unpadded (the prefill's first token).
        result.accept_lens = torch.ones_like(batch.seq_lens, dtype=torch.int32)
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = MagicDecInput(draft_token_num=self.num_draft_tokens)
        result.speculative_num_draft_tokens = self.num_draft_tokens
        return result

    # -- SnapKV summaries: planned before a prefill forward, computed after it ---------------

    def _plan_summaries(self, batch: ScheduleBatch) -> None:
        """Per request starting its prefill: reuse a shared summary of a prefix of its prompt,
        or watch its prompt's observation window to compute one; arm the observer."""
        req_to_token = self.req_to_token_pool.req_to_token
        window = self.snapkv.obs_window
        for req, row, prefix_len in zip(
            batch.reqs, batch.req_pool_indices.tolist(), batch.prefix_lens, strict=True
        ):
            rid = req.rid
            if rid in self.observer.pending or self.summaries.held_by(rid) is not None:
                continue  # a later chunk of a prompt already planned
            prompt = req.origin_input_ids
            prompt_len = len(prompt)
            if prompt_len < self.config.dense_below:
                continue  # drafts with its whole context
            shared = self.summaries.find(prompt)
            # A reuser keeps its own suffix as recent tokens: only worth it while that is short.
            if shared is not None and prompt_len - shared.length <= self.config.budget:
                cached_slots = req_to_token[row, :prefix_len].to(torch.int64)
                self.summaries.acquire(rid, shared, computed=False, cached_slots=cached_slots)
                self._report(req, "reused", shared)
            elif prefix_len <= prompt_len - window:
                self.observer.pending[rid] = PendingWindow(prompt_len, window)
            else:  # window already cached and no summary of it: streaming draft
                self._report(req, "none", None)
        self.observer.observe([req.rid for req in batch.reqs], batch.prefix_lens, batch.extend_lens)

    def _compute_summaries(self, batch: ScheduleBatch) -> None:
        """Score the prompts whose whole observation window has been seen (their KV is in the
        pool in every layer now) and hand each its summary."""
        req_to_token = self.req_to_token_pool.req_to_token
        kv_pool = self.model_runner.token_to_kv_pool
        for req, row in zip(batch.reqs, batch.req_pool_indices.tolist(), strict=True):
            pending = self.observer.pending.get(req.rid)
            if pending is None or not pending.complete:
                continue
            del self.observer.pending[req.rid]
            prompt_slots = req_to_token[row, : pending.prompt_len].to(torch.int64)
            positions = torch.stack(
                [
                    self.snapkv.select_layer(
                        pending.queries[layer.layer_id],
                        kv_pool.get_key_buffer(layer.layer_id),
                        prompt_slots,
                        layer.scaling,
                    )
                    for layer in sorted(self.observer.layers, key=lambda layer: layer.layer_id)
                ]
            )
            summary = Summary(
                tokens=tuple(req.origin_input_ids),
                positions=positions.to(torch.int32),
                prompt_slots=prompt_slots[:-1].to("cpu", copy=True),  # not a view of the row
            )
            self.summaries.acquire(req.rid, summary, computed=True)
            self._report(req, "computed", summary)

    @staticmethod
    def _report(req, status: str, summary: Summary | None) -> None:
        """The request's `meta_info["magicdec_summary"]`, through SGLang's per-request
        `customized_info` channel (a one-entry list: it rides with the first output token)."""
        info = {"status": status}
        if summary is not None:
            info.update(prefix_len=summary.length, digest=summary.digest)
        req.customized_info = {"magicdec_summary": [info]}

    def request_released(self, rid: str) -> None:
        """SGLang freed the request's KV (finished, aborted or retracted): drop what we keep."""
        if self.cost_model is not None:
            self.cost_model.forget(rid)
        if self.snapkv is not None:
            self.summaries.release(rid)
            self.observer.pending.pop(rid, None)

    def kv_freed(self) -> None:
        """The radix cache evicted: drop unheld summaries whose prompt KV is gone."""
        if self.snapkv is None:
            return
        allocator = self.token_to_kv_pool_allocator
        free = allocator.get_all_free_pages().to(torch.int64).cpu()
        if allocator.page_size > 1:
            free = free[:, None] * allocator.page_size + torch.arange(allocator.page_size)
            free = free.reshape(-1)
        self.summaries.drop_freed(free)

    def cache_reset(self) -> None:
        if self.snapkv is not None:
            self.summaries.clear_unheld()

    # -- decode: draft, verify, accept, commit ----------------------------------------------

    def _can_speculate(self, batch: ScheduleBatch) -> bool:
        """Greedy and sampled requests speculate. Whatever rewrites the target's logits per
        token (penalties, logit bias, custom logit processors, grammars) takes a plain decode
        step, and so does sampling with logprobs: SGLang reports those from its own sampler."""
        info = batch.sampling_info
        penalties = info.penalizer_orchestrator
        return (
            not batch.has_grammar
            and info.logit_bias is None
            and not info.has_custom_logit_processor
            and (penalties is None or not penalties.is_required)
            and (info.is_all_greedy or not batch.return_logprob)
        )

    def _speculate(self, batch: ScheduleBatch, on_publish, gamma: int) -> GenerationBatchResult:
        bucket = self._bucket(batch) if self.cost_model is not None else None
        # The round's bookkeeping (slots, draft selections, uniforms) is part of its cost: the
        # cost model counts it in the draft steps.
        started = self._clock()
        rids = [req.rid for req in batch.reqs]
        committed = batch.seq_lens.to(torch.int64)
        round_slots = self._round_slots(batch, committed, self.num_draft_tokens)
        draft_slots = self._draft_slots(batch, committed)
        tokens = self._last_tokens(batch)
        greedy = batch.sampling_info.is_all_greedy
        if not greedy:
            params = self._sampling_params(batch)
            uniforms = self._uniforms(batch, committed, gamma)  # draft draws, tests, last draw
            draft_probs = []

        for step in range(gamma):
            logits = self._draft_step(batch, committed, step, tokens, draft_slots, round_slots)
            if greedy:
                next_tokens = logits.argmax(dim=-1)
            else:
                draft_probs.append(sampling_probs(logits, *params))
                next_tokens = sample_from(draft_probs[-1], uniforms[:, step])
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)

        drafted = self._clock()
        verify = self._verify(batch, committed, tokens, round_slots)
        verified = self._clock()
        logits = verify.logits_output.next_token_logits
        if greedy:
            # `target[b, j]`: the target's token after tokens[b, :j+1]; it commits the agreeing
            # prefix of the drafts, then its own token.
            target = logits.argmax(dim=-1).view(tokens.shape)
            agrees = (tokens[:, 1:] == target[:, :-1]).to(torch.int32)
            accept_lens = agrees.cumprod(dim=1).sum(dim=1, dtype=torch.int32) + 1
        else:
            width = gamma + 1
            target_probs = sampling_probs(
                logits, *(param.repeat_interleave(width) for param in params)
            ).view(len(batch.reqs), width, -1)
            target, accept_lens = chain_rejection_sample(
                tokens[:, 1:],
                torch.stack(draft_probs, dim=1),
                target_probs,
                uniforms[:, gamma : 2 * gamma],
                uniforms[:, 2 * gamma],
            )
        self.stats.record(accept_lens, gamma)
        if self.cost_model is not None:
            self.cost_model.record_round(
                bucket, gamma, (drafted - started) / gamma, verified - drafted
            )
            self.cost_model.record_acceptance(rids, accept_lens.tolist(), gamma)
        if batch.return_logprob:
            # Verify row b·(γ+1)+j is the target's distribution of target[b, j].
            compute_spec_logprobs(
                batch, verify.logits_output, target.reshape(-1), chain_stride=gamma + 1
            )
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(verify, target, accept_lens, new_seq_lens)

    def _plain_decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """One ordinary decode step (γ = 0) in the round's first reserved slot."""
        bucket = self._bucket(batch) if self.cost_model is not None else None
        started = self._clock()
        committed = batch.seq_lens.to(torch.int64)
        batch.input_ids = self._last_tokens(batch)[:, 0]
        batch.out_cache_loc = self._round_slots(batch, committed, 1)[:, 0]
        self._set_lens(batch, committed + 1)
        batch.spec_info = None
        result = self.target_worker.forward_batch_generation(batch)
        if self.cost_model is not None:
            self.cost_model.record_decode(bucket, self._clock() - started)
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
        this_round = round_slots[:, : step + 1]
        if self.snapkv is None:
            kv_lists = [torch.cat([slots, this_round[i]]) for i, slots in enumerate(draft_slots)]
        else:  # [layers, Hkv, n] per request: the round's tokens are read by every head
            kv_lists = [
                torch.cat([slots, this_round[i].expand(*slots.shape[:2], -1)], dim=-1)
                for i, slots in enumerate(draft_slots)
            ]
        # int32 offsets, int64 slots: the dtypes SGLang's triton/flashinfer decode backends use.
        kv_indptr = torch.zeros(len(kv_lists) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor([slots.shape[-1] for slots in kv_lists]).cumsum(0)
        all_slots = torch.cat(kv_lists, dim=-1).to(self.device)
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = tokens[:, step].contiguous()
        batch.out_cache_loc = round_slots[:, step].contiguous()
        self._set_lens(batch, committed + step + 1)
        batch.spec_info = MagicDecInput(
            draft_token_num=1,
            positions=(committed + step).to(self.device),
            kv_indptr=kv_indptr.to(self.device),
            kv_indices=all_slots if self.snapkv is None else None,
            head_kv_indices=all_slots if self.snapkv is not None else None,
        )
        result = self.target_worker.forward_batch_generation(batch, is_verify=True)
        return result.logits_output.next_token_logits

    def _verify(self, batch, committed, tokens, round_slots) -> GenerationBatchResult:
        """TARGET_VERIFY over [x0, d1..dγ] at S..S+γ, full attention, exact KV into the slots."""
        width = tokens.shape[1]
        offsets = torch.arange(width, dtype=torch.int64)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tokens.reshape(-1).contiguous()
        batch.out_cache_loc = round_slots[:, :width].reshape(-1).contiguous()
        self._set_lens(batch, committed)
        batch.spec_info = MagicDecInput(
            draft_token_num=width,
            positions=(committed[:, None] + offsets).reshape(-1).to(self.device),
        )
        return self.target_worker.forward_batch_generation(batch, is_verify=True)

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _sampling_params(batch: ScheduleBatch) -> tuple[torch.Tensor, ...]:
        info = batch.sampling_info
        return info.temperatures.view(-1), info.top_ks, info.top_ps, info.min_ps

    def _clock(self) -> float:
        """Wall time after the device has finished what was queued (step costs)."""
        if self._on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _uniforms(self, batch: ScheduleBatch, committed: torch.Tensor, gamma: int) -> torch.Tensor:
        """[batch, 2γ+1] uniforms for one round: γ draft draws, γ acceptance tests, the final
        draw. A request with `sampling_seed` draws from a generator seeded by its seed and
        position, so the same request gives the same output; the others share torch's RNG."""
        width = 2 * gamma + 1
        rows = []
        for req, position in zip(batch.reqs, committed.tolist(), strict=True):
            seed = req.sampling_params.sampling_seed
            if seed is None:
                rows.append(torch.rand(width))
            else:
                generator = torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63)
                rows.append(torch.rand(width, generator=generator))
        return torch.stack(rows).to(self.device)

    def _draft_slots(self, batch: ScheduleBatch, committed: torch.Tensor) -> list[torch.Tensor]:
        """Pool slots of each request's draft selection among its committed positions: [n] per
        request, or [layers, Hkv, n] with SnapKV (each layer and KV head its own)."""
        req_to_token = self.req_to_token_pool.req_to_token
        all_slots = []
        for req, row, length in zip(
            batch.reqs, batch.req_pool_indices.tolist(), committed.tolist(), strict=True
        ):
            prompt_len = len(req.origin_input_ids)
            summary = self.summaries.held_by(req.rid) if self.snapkv is not None else None
            if length < self.config.dense_below:
                positions = torch.arange(length)
            elif summary is None:
                positions = self.streaming.select(length, prompt_len)
            else:
                positions = self.snapkv.recent(summary.length, length, prompt_len)
            slots = req_to_token[row, positions.to(req_to_token.device)].to(torch.int64)
            if self.snapkv is not None:
                shape = (self.num_layers, self.observer.layers[0].tp_k_head_num, -1)
                slots = slots.expand(shape)
                if summary is not None and length >= self.config.dense_below:
                    chosen = req_to_token[row][summary.positions.to(req_to_token.device).long()]
                    slots = torch.cat([chosen.to(torch.int64), slots], dim=-1)
                    # Follow the prompt's KV where the holder has it now: SGLang moves a row
                    # onto the radix tree's copy when it caches a prompt another request
                    # already cached (and frees the duplicate).
                    summary.prompt_slots = req_to_token[row, : summary.length - 1].to(
                        "cpu", copy=True
                    )
            if self.config.debug:
                self._check_selection(row, length, slots, summary, req)
            all_slots.append(slots)
        return all_slots

    def _check_selection(
        self, row: int, length: int, selected: torch.Tensor, summary: Summary | None, req=None
    ) -> None:
        """Debug mode: every selected slot belongs to the request's live committed KV, and the
        request's summary still describes KV that is allocated."""
        live = self.req_to_token_pool.req_to_token[row, :length].to(torch.int64)
        selected = selected.unique()
        assert bool(torch.isin(selected, live).all()), "draft selection points outside live KV"
        allocator = self.token_to_kv_pool_allocator
        free = allocator.get_all_free_pages()
        if free is not None and free.numel():
            free = free.to(torch.int64)
            pages = selected // allocator.page_size
            if bool(torch.isin(pages, free).any()):
                row_slots = self.req_to_token_pool.req_to_token[row, :length].to(torch.int64)
                bad = torch.nonzero(torch.isin(row_slots // allocator.page_size, free)).flatten()
                raise AssertionError(
                    f"draft selection points at freed KV: rid={getattr(req, 'rid', None)} "
                    f"length={length} prompt={len(req.origin_input_ids) if req else None} "
                    f"freed positions={bad.tolist()[:20]} n={bad.numel()} "
                    f"retractions={getattr(req, 'retraction_count', None)} "
                    f"protected={getattr(getattr(req, 'kv', None), 'cache_protected_len', None)} "
                    f"output={len(req.output_ids) if req else None} summary={summary is not None}"
                )
            if summary is not None:
                summary_pages = summary.prompt_slots // allocator.page_size
                assert not bool(torch.isin(summary_pages, free).any()), (
                    "a held summary refers to freed KV slots"
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
