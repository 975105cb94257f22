"""SnapKV draft (Li et al., 2024), per layer and KV head, as MagicDec uses it.

The last `obs_window` prompt queries already "know" what the answer will need: the prompt
positions they attend to most. Per layer: their softmax attention over the earlier prompt keys,
summed over the window, pooled along positions (neighbours of a hit matter too), summed over the
query heads of each GQA group; each KV head keeps its own top `budget - obs_window` positions,
plus the window itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import avg_pool1d, max_pool1d

from magicdec_kernels.snapkv_scores import snapkv_window_scores
from sglang_magicdec.drafts.streaming import StreamingSelection
from sglang_magicdec.observer import PendingWindow, WindowObserver
from sglang_magicdec.summaries import Summary, SummaryStore


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

    def select_layer(
        self,
        q_window: torch.Tensor,
        k_cache: torch.Tensor,
        key_slots: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Positions [Hkv, min(budget, L)] (sorted, int64) one layer's draft keeps of an L-token
        prompt, given its window queries [W, Hq, D] and the pool slots of its keys [L]."""
        prompt_len = key_slots.numel()
        window = q_window.shape[0]
        num_kv_heads = k_cache.shape[1]
        prefix_len = prompt_len - window
        keep = min(self.budget - window, prefix_len)
        window_attention = snapkv_window_scores(q_window, k_cache, key_slots, scale)
        scores = self.scores(window_attention.float(), num_kv_heads).cpu()
        top = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
        window_positions = torch.arange(prefix_len, prompt_len).expand(num_kv_heads, window)
        return torch.cat([top, window_positions], dim=-1)

    def recent(self, summary_len: int, committed_len: int, prompt_len: int) -> torch.Tensor:
        """Positions read besides a summary of the first `summary_len` prompt tokens: the rest of
        the prompt (a reuser's own suffix), then the generated tokens, of which the last
        `budget` are kept (rolling) so a long generation does not grow the draft."""
        generated_start = max(prompt_len, committed_len - self.budget)
        return torch.cat(
            [torch.arange(summary_len, prompt_len), torch.arange(generated_start, committed_len)]
        )


class SnapKVSelection:
    """The SnapKV draft inside the server: its summaries' whole lifecycle.

    Before a prefill forward (`before_extend`), each request starting its prompt either reuses
    a shared summary of a prefix of its prompt or has its observation window watched (the
    observer's attention hooks); after the forward (`after_extend`), prompts whose window is
    complete are scored and hold their summary. Each round, `slots` resolves the request's
    summary positions through its own `req_to_token` row, plus its recent tokens. Summaries are
    released with the request's KV and dropped when the radix cache frees their prompt.
    Requests without a summary (the window was already cached) draft with the streaming policy.
    """

    def __init__(
        self,
        policy: SnapKVDraft,
        *,
        fallback: StreamingSelection,
        model: torch.nn.Module,
        share_min_len: int,
        min_context: int,
    ):
        self.policy = policy
        self.fallback = fallback
        self.min_context = min_context
        self.store = SummaryStore(share_min_len=share_min_len)
        self.observer = WindowObserver(model)
        self.layers = sorted(self.observer.layers, key=lambda layer: layer.layer_id)

    # -- prefill: plan, observe, score --------------------------------------------------------

    def before_extend(self, batch, req_to_token: torch.Tensor) -> None:
        """Per request starting its prefill: reuse a shared summary of a prefix of its prompt,
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
            shared = self.store.find(prompt)
            # A reuser keeps its own suffix as recent tokens: only worth it while that is short.
            if shared is not None and prompt_len - shared.length <= self.policy.budget:
                cached_slots = req_to_token[row, :prefix_len].to(torch.int64)
                self.store.acquire(rid, shared, computed=False, cached_slots=cached_slots)
                _report(req, "reused", shared)
            elif prefix_len <= prompt_len - window:
                self.observer.pending[rid] = PendingWindow(prompt_len, window)
            else:  # window already cached and no summary of it: streaming draft
                _report(req, "none", None)
        self.observer.observe([req.rid for req in batch.reqs], batch.prefix_lens, batch.extend_lens)

    def after_extend(self, batch, req_to_token: torch.Tensor, kv_pool, failed: bool) -> None:
        """Disarm the hooks (always: kvpress removes its hooks in `finally` too); unless the
        forward failed, score the prompts whose whole window has been seen (their KV is in the
        pool in every layer now) and hand each its summary."""
        self.observer.disarm()
        if failed:
            return
        for req, row in zip(batch.reqs, batch.req_pool_indices.tolist(), strict=True):
            pending = self.observer.pending.get(req.rid)
            if pending is None or not pending.complete:
                continue
            del self.observer.pending[req.rid]
            prompt_slots = req_to_token[row, : pending.prompt_len].to(torch.int64)
            positions = torch.stack(
                [
                    self.policy.select_layer(
                        pending.queries[layer.layer_id],
                        kv_pool.get_key_buffer(layer.layer_id),
                        prompt_slots,
                        layer.scaling,
                    )
                    for layer in self.layers
                ]
            )
            summary = Summary(
                tokens=tuple(req.origin_input_ids),
                positions=positions.to(torch.int32),
                prompt_slots=prompt_slots[:-1].to("cpu", copy=True),  # not a view of the row
            )
            self.store.acquire(req.rid, summary, computed=True)
            _report(req, "computed", summary)

    # -- decode: the draft's slots ------------------------------------------------------------

    def slots(self, req, row: torch.Tensor, committed_len: int) -> torch.Tensor:
        """[layers, Hkv, n] pool slots of `req`'s draft ([1, 1, n] without a summary)."""
        summary = self.store.held_by(req.rid)
        if summary is None:
            return self.fallback.slots(req, row, committed_len)
        recent = self.policy.recent(summary.length, committed_len, len(req.origin_input_ids))
        chosen = row[summary.positions.to(row.device).long()]
        recent_slots = row[recent.to(row.device)].expand(*chosen.shape[:2], -1)
        # Follow the prompt's KV where the holder has it now: SGLang moves a row onto the radix
        # tree's copy when it caches a prompt another request already cached (and frees the
        # duplicate).
        summary.prompt_slots = row[: summary.length - 1].to("cpu", copy=True)
        return torch.cat([chosen, recent_slots], dim=-1).to(torch.int64)

    def check(self, req, row: torch.Tensor, committed_len: int, free_pages, page_size) -> None:
        """Debug mode: the request's summary still describes KV that is allocated."""
        summary = self.store.held_by(req.rid)
        if summary is not None and free_pages is not None and free_pages.numel():
            summary_pages = summary.prompt_slots // page_size
            assert not bool(torch.isin(summary_pages, free_pages.cpu()).any()), (
                "a held summary refers to freed KV slots"
            )

    # -- radix cache events -------------------------------------------------------------------

    def request_released(self, rid: str) -> None:
        self.store.release(rid)
        self.observer.pending.pop(rid, None)

    def kv_freed(self, free_slots: torch.Tensor) -> None:
        self.store.drop_freed(free_slots)

    def cache_reset(self) -> None:
        self.store.clear_unheld()

    def info(self) -> dict:
        return self.store.info()


def _report(req, status: str, summary: Summary | None) -> None:
    """The request's `meta_info["magicdec_summary"]`, through SGLang's per-request
    `customized_info` channel (a one-entry list: it rides with the first output token)."""
    info = {"status": status}
    if summary is not None:
        info.update(prefix_len=summary.length, digest=summary.digest)
    req.customized_info = {"magicdec_summary": [info]}
