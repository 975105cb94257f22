"""SnapKV draft (Li et al., 2024), per layer and KV head, as MagicDec uses it.

The last `obs_window` prompt queries already "know" what the answer will need: the prompt
positions they attend to most. Per layer: their softmax attention over the earlier prompt keys,
summed over the window, pooled along positions (neighbours of a hit matter too), summed over the
query heads of each GQA group; each KV head keeps its own top `budget - obs_window` positions,
plus the window itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.nn.functional import avg_pool1d, max_pool1d

from magicdec_kernels.snapkv_scores import snapkv_window_scores
from sglang_magicdec import radix_events
from sglang_magicdec.drafts.streaming import StreamingSelection
from sglang_magicdec.observer import PendingWindow, WindowObserver
from sglang_magicdec.spec_info import DraftPositions, host_copy
from sglang_magicdec.summaries import Summary, SummaryStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapKVDraft:
    """Keep, per layer and KV head, the prompt positions the observation window attends to.

    budget       prompt positions kept per (layer, KV head), window included
    obs_window   the last prompt tokens whose queries do the scoring
    pool         "avg" or "max" pooling of the window-summed scores along positions
    pool_kernel  pooling width (odd; stride 1, same length)
    """

    budget: int
    obs_window: int = 32
    pool: str = "avg"
    pool_kernel: int = 5

    def scores(self, window_attention: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """[Hq, P] window-summed attention over the P pre-window positions → [Hkv, P] pooled,
        GQA-summed scores."""
        pool = avg_pool1d if self.pool == "avg" else max_pool1d
        pooled = pool(
            window_attention[:, None, :],
            kernel_size=self.pool_kernel,
            stride=1,
            padding=self.pool_kernel // 2,
        )[:, 0]
        num_q_heads, prefix_len = pooled.shape
        return pooled.view(num_kv_heads, num_q_heads // num_kv_heads, prefix_len).sum(dim=1)

    @property
    def margin(self) -> int:
        """Ranked positions kept past the top-k, to refill a selection that a prompt sharing
        only part of the summarised one cannot use (its window, a question of its own)."""
        return self.budget

    def select_layer(
        self,
        q_window: torch.Tensor,
        k_cache: torch.Tensor,
        key_slots: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's selection of an L-token prompt, given its window queries [W, Hq, D] and
        the pool slots of its keys [L]: the positions kept [Hkv, min(budget, L)], ranked (the
        window first, then best first: its first b are the selection at budget b), and the
        margin [Hkv, ≤ margin], the next-best pre-window positions, best first (int64)."""
        prompt_len = key_slots.numel()
        window = q_window.shape[0]
        num_kv_heads = k_cache.shape[1]
        prefix_len = prompt_len - window
        keep = min(self.budget - window, prefix_len)
        window_attention = snapkv_window_scores(q_window, k_cache, key_slots, scale)
        scores = self.scores(window_attention.float(), num_kv_heads).cpu()
        top = scores.topk(keep, dim=-1).indices
        rest = scores.scatter(-1, top, float("-inf"))
        margin = rest.topk(min(self.margin, prefix_len - keep), dim=-1).indices
        window_positions = torch.arange(prefix_len, prompt_len).expand(num_kv_heads, window)
        return torch.cat([window_positions, top], dim=-1), margin

    def recent(
        self, summary_len: int, committed_len: int, prompt_len: int, budget: int | None = None
    ) -> list[range]:
        """Positions read besides a summary of the first `summary_len` prompt tokens: the rest of
        the prompt (a reuser's own suffix), then the generated tokens, of which the last
        `budget` (None: this policy's) are kept (rolling) so a long generation does not grow
        the draft."""
        budget = self.budget if budget is None else budget
        generated_start = max(prompt_len, committed_len - budget)
        return [range(summary_len, prompt_len), range(generated_start, committed_len)]


class SnapKVSelection(radix_events.RadixCacheListener):
    """The SnapKV draft inside the server: its summaries' whole lifecycle.

    Before a prefill forward (`before_extend`), each request starting its prompt either reuses
    a shared summary of a prefix of its prompt or has its observation window watched (the
    observer's attention hooks); after the forward (`after_extend`), prompts whose window is
    complete are scored and hold their summary (a window some layer's hook missed drafts with the
    streaming fallback, counted). Each round, `positions` gives the request's summary
    positions (read through its own `req_to_token` row), plus its recent tokens. Summaries are
    released with the request's KV and dropped when the radix cache frees their prompt.
    A prompt that will compute its own summary keeps its window out of the radix match
    (`max_prefix_len`), so every prompt of at least `min_context` tokens drafts with a summary.
    """

    def __init__(
        self,
        policy: SnapKVDraft,
        *,
        fallback: StreamingSelection,
        model: torch.nn.Module,
        share_min_len: int,
        min_context: int,
        report_heads: bool = False,
    ):
        self.policy = policy
        self.report_heads = report_heads  # each head's digest in the report (--magicdec-debug)
        self.fallback = fallback
        self.min_context = min_context
        self.store = SummaryStore(share_min_len=share_min_len)
        self.without_summary = 0  # long prompts that drafted with the streaming fallback
        self.observer = WindowObserver(model)
        self.layers = sorted(self.observer.layers, key=lambda layer: layer.layer_id)
        radix_events.subscribe(self)

    # -- prefill: plan, observe, score --------------------------------------------------------

    def max_prefix_len(self, req, limit: int) -> int:
        """How much of `req`'s prompt SGLang may take from the radix cache (asked before it
        matches, `limit` being its own bound): a prompt that will compute its own summary
        prefills at least its observation window, whose queries only a forward produces. What
        it costs is recomputing at most `obs_window` cached tokens."""
        prompt = req.origin_input_ids
        if (
            len(prompt) < max(self.min_context, self.policy.obs_window + 1)
            or req.rid in self.observer.pending
            or self.store.held_by(req.rid) is not None
            or self._reusable(prompt) is not None
        ):
            return limit
        return min(limit, len(prompt) - self.policy.obs_window)

    def before_extend(self, batch, req_to_token: torch.Tensor) -> None:
        """Per request starting its prefill: reuse a summary sharing a prefix of its prompt,
        or watch its prompt's observation window to compute one; arm the observer."""
        window = self.policy.obs_window
        for req, row, prefix_len in zip(
            batch.reqs, batch.req_pool_indices.tolist(), batch.prefix_lens, strict=True
        ):
            rid = req.rid
            if rid in self.observer.pending or self.store.held_by(rid) is not None:
                continue  # a later chunk of a prompt already planned
            prompt = req.origin_input_ids
            prompt_len = len(prompt)
            if prompt_len < self.min_context:
                continue  # drafts with its whole context
            reusable = self._reusable(prompt)
            if reusable is not None:
                summary, shared_len = reusable
                cached_slots = req_to_token[row, :prefix_len].to(torch.int64)
                self.store.acquire(
                    rid, summary, computed=False, shared_len=shared_len, cached_slots=cached_slots
                )
                _report(req, "reused", summary, shared_len, heads=self.report_heads)
            elif prefix_len <= prompt_len - window:
                self.observer.pending[rid] = PendingWindow(prompt_len, window)
            else:
                # `max_prefix_len` keeps the window out of the radix match; this is a summary
                # evicted between the scheduler's match and this forward.
                logger.info("request %s: no summary and its window is cached: streaming", rid)
                self.without_summary += 1
                _report(req, "none", None)
        self.observer.observe([req.rid for req in batch.reqs], batch.prefix_lens, batch.extend_lens)

    def _reusable(self, prompt: list[int]) -> tuple[Summary, int] | None:
        """A stored summary sharing a prefix with `prompt`, and the prefix's length, if the
        prompt's own suffix past it is short enough to be read whole as recent tokens."""
        found = self.store.find(prompt)
        if found is not None and len(prompt) - found[1] <= self.policy.budget:
            return found
        return None

    def after_extend(self, batch, req_to_token: torch.Tensor, kv_pool, failed: bool) -> None:
        """Disarm the hooks (always: kvpress removes its hooks in `finally` too); unless the
        forward failed, score the prompts whose whole window has been seen (their KV is in the
        pool in every layer now) and hand each its summary, or one that an earlier of them just
        computed over a prefix they share."""
        self.observer.disarm()
        if failed:
            return
        layer_ids = [layer.layer_id for layer in self.layers]
        for req, row, prefix_len, extend_len in zip(
            batch.reqs,
            batch.req_pool_indices.tolist(),
            batch.prefix_lens,
            batch.extend_lens,
            strict=True,
        ):
            pending = self.observer.pending.get(req.rid)
            if pending is None:
                continue
            missing = pending.missing_layers(layer_ids)
            if missing and prefix_len + extend_len < pending.prompt_len:
                continue  # later chunks bring the rest of the window
            del self.observer.pending[req.rid]
            if missing:
                logger.warning(
                    "request %s: the observation window's queries were not captured in layers "
                    "%s (their attention ran without the module's hooks); drafting with the "
                    "streaming fallback",
                    req.rid,
                    missing[:8],
                )
                self.without_summary += 1
                _report(req, "none", None)
                continue
            reusable = self._reusable(req.origin_input_ids)
            if reusable is not None:
                # A prompt prefilled alongside the one that just computed a summary of their
                # shared prefix (one forward or chunk, no radix hit between them): share it too.
                summary, shared_len = reusable
                self.store.acquire(req.rid, summary, computed=False, shared_len=shared_len)
                _report(req, "reused", summary, shared_len, heads=self.report_heads)
                continue
            prompt_slots = req_to_token[row, : pending.prompt_len].to(torch.int64)
            ranked, margins = zip(
                *(
                    self.policy.select_layer(
                        pending.queries[layer.layer_id],
                        kv_pool.get_key_buffer(layer.layer_id),
                        prompt_slots,
                        layer.scaling,
                    )
                    for layer in self.layers
                ),
                strict=True,
            )
            ranked = torch.stack(ranked).to(torch.int32)
            summary = Summary(
                tokens=tuple(req.origin_input_ids),
                positions=ranked.sort(dim=-1).values,
                margin=torch.stack(margins).to(torch.int32),
                prompt_slots=prompt_slots[:-1].to("cpu", copy=True),  # not a view of the row
                ranked=ranked,
            )
            self.store.acquire(req.rid, summary, computed=True)
            _report(req, "computed", summary, heads=self.report_heads)

    # -- decode: the draft's slots ------------------------------------------------------------

    def positions(
        self, req, committed_len: int, row: torch.Tensor, budget: int | None = None
    ) -> DraftPositions:
        """The positions `req`'s draft reads this round at `budget` (None: the policy's): its
        summary's, on the device since its first round at that budget, then its recent tokens
        (the streaming fallback's without a summary). `row` is its `req_to_token` row."""
        holding = self.store.held_by(req.rid)
        if holding is None:
            return self.fallback.positions(req, committed_len, budget=budget)
        prompt_len = len(req.origin_input_ids)
        recent = self.policy.recent(holding.shared_len, committed_len, prompt_len, budget)
        return DraftPositions(holding.device_positions(budget, row.device), recent)

    def check(self, req, row: torch.Tensor, free_pages, page_size) -> None:
        """Debug mode: a summary of the request's own prompt is anchored on the KV the request
        holds (its `req_to_token` row), and none of that KV is free. A summary whose anchor
        went stale (KV the request no longer holds) fails here."""
        holding = self.store.held_by(req.rid)
        if holding is None:
            return
        summary = holding.summary
        if not holding.shared_len == summary.length == len(req.origin_input_ids):
            return
        held = row[: summary.prompt_slots.numel()].to(torch.int64).cpu()
        assert torch.equal(summary.prompt_slots, held), (
            f"request {req.rid}: its summary is anchored on KV slots it does not hold"
        )
        if free_pages is not None and free_pages.numel():
            summary_pages = summary.prompt_slots // page_size
            assert not bool(torch.isin(summary_pages, free_pages.cpu()).any()), (
                "a held summary refers to freed KV slots"
            )

    # -- radix cache events -------------------------------------------------------------------

    def request_released(self, rid: str) -> None:
        self.store.release(rid)
        self.observer.pending.pop(rid, None)

    def tokens_cached(self, req, row: torch.Tensor) -> None:
        """A summary is anchored on its prompt's KV where the radix cache holds it: once the
        prompt computing it is in the tree (its first insert after that prefill), on the row,
        which SGLang has moved onto the tree's copy (a prompt another request cached first
        gives its own slots back as duplicates, which may have cut the summary's live prefix)."""
        holding = self.store.held_by(req.rid)
        if holding is None or holding.anchored:
            return
        summary = holding.summary
        holding.anchored = True
        if holding.shared_len == summary.length == len(req.origin_input_ids):
            summary.prompt_slots = host_copy(row[: summary.length - 1])
            summary.live_len = summary.length

    def kv_freed(self, slots: torch.Tensor) -> None:
        """Summaries stay shareable up to their first freed position (`SummaryStore.drop_freed`)."""
        if len(self.store):
            self.store.drop_freed(slots.to(torch.int64).cpu())

    def cache_reset(self) -> None:
        self.store.clear_unheld()

    def info(self) -> dict:
        return {**self.store.info(), "drafts_without_summary": self.without_summary}


def _report(
    req,
    status: str,
    summary: Summary | None,
    shared_len: int | None = None,
    heads: bool = False,
) -> None:
    """The request's `meta_info["magicdec_summary"]`, through SGLang's per-request
    `customized_info` channel (a one-entry list: it rides with the first output token):
    prefix_len is how many prompt tokens the summary covers (the shared part for a reuser);
    with `heads`, each (layer, KV head) selection's own digest too."""
    info = {"status": status}
    if summary is not None:
        shared_len = summary.length if shared_len is None else shared_len
        info.update(prefix_len=shared_len, digest=summary.digest)
        if heads:
            info["head_digests"] = summary.head_digests
    req.customized_info = {"magicdec_summary": [info]}
