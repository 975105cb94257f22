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
