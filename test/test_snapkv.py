"""SnapKV selection against a plain reference of the algorithm, and the summary store."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_magicdec.drafts import SnapKVDraft
from sglang_magicdec.summaries import Summary, SummaryStore


def reference_selection(q_window, keys, budget, pool, kernel) -> torch.Tensor:
    """SnapKV written out plainly in float64: full causal attention of the window queries,
    summed over the window, pooled per query head, summed per GQA group, top-k per KV head."""
    window, num_q_heads, head_dim = q_window.shape
    prompt_len, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    prefix_len = prompt_len - window
    votes = torch.zeros(num_q_heads, prefix_len, dtype=torch.float64)
    for head in range(num_q_heads):
        for i in range(window):
            visible = keys[: prefix_len + i + 1, head // group].double()
            logits = visible @ q_window[i, head].double() / math.sqrt(head_dim)
            votes[head] += torch.softmax(logits, dim=0)[:prefix_len]
    pooled = torch.zeros_like(votes)
    half = kernel // 2
    for pos in range(prefix_len):
        neighbours = votes[:, max(0, pos - half) : pos + half + 1]
        if pool == "avg":  # zero padding counted, as avg_pool1d does by default
            pooled[:, pos] = neighbours.sum(dim=1) / kernel
        else:
            pooled[:, pos] = neighbours.max(dim=1).values
    grouped = pooled.view(num_kv_heads, group, prefix_len).sum(dim=1)
    keep = min(budget - window, prefix_len)
    top = grouped.topk(keep, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(prefix_len, prompt_len).expand(num_kv_heads, -1)], dim=-1)


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,window,budget,pool,kernel,prompt_len",
    [
        (4, 4, 8, 32, "avg", 5, 120),
        (6, 2, 8, 40, "max", 3, 150),
        (9, 3, 16, 48, "avg", 7, 200),
        (8, 2, 1, 20, "max", 1, 60),
        (4, 1, 8, 64, "avg", 5, 50),  # budget above the prompt: everything is kept
    ],
)
def test_selection_matches_reference(
    num_q_heads, num_kv_heads, window, budget, pool, kernel, prompt_len
):
    generator = torch.Generator().manual_seed(prompt_len + budget)
    head_dim = 16
    pool_slots = prompt_len + 37
    k_cache = torch.randn(pool_slots, num_kv_heads, head_dim, generator=generator)
    key_slots = torch.randperm(pool_slots, generator=generator)[:prompt_len]
    q_window = torch.randn(window, num_q_heads, head_dim, generator=generator) * 2
    draft = SnapKVDraft(budget=budget, obs_window=window, pool=pool, pool_kernel=kernel)

    chosen = draft.select_layer(q_window, k_cache, key_slots, 1 / math.sqrt(head_dim))

    expected = reference_selection(q_window, k_cache[key_slots], budget, pool, kernel)
    assert chosen.shape == (num_kv_heads, min(budget, prompt_len))
    assert torch.equal(chosen, expected)


def test_heads_choose_differently():
    """Per KV head: heads whose queries look at different keys keep different positions."""
    torch.manual_seed(0)
    prompt_len, window, head_dim = 100, 4, 8
    k_cache = torch.randn(prompt_len, 2, head_dim)
    k_cache[:, :, 0] = 0
    k_cache[10, 0, 0] = k_cache[70, 1, 0] = 1  # only these keys answer the queries' direction
    q_window = torch.zeros(window, 2, head_dim)
    q_window[:, :, 0] = 30
    draft = SnapKVDraft(budget=window + 3, obs_window=window, pool_kernel=3)
    chosen = draft.select_layer(q_window, k_cache, torch.arange(prompt_len), 1.0)
    assert 10 in chosen[0].tolist() and 70 not in chosen[0].tolist()
    assert 70 in chosen[1].tolist() and 10 not in chosen[1].tolist()


def test_recent_keeps_suffix_and_rolls_generated():
    draft = SnapKVDraft(budget=8, obs_window=2)
    assert draft.recent(20, 25, 23).tolist() == [20, 21, 22, 23, 24]
    # 30 generated tokens: only the last `budget` stay.
    assert draft.recent(20, 53, 23).tolist() == [20, 21, 22, *range(45, 53)]


def summary(tokens: list[int], first_slot: int = 0) -> Summary:
    return Summary(
        tokens=tuple(tokens),
        positions=torch.zeros(1, 1, 1, dtype=torch.int32),
        prompt_slots=torch.arange(first_slot, first_slot + len(tokens) - 1),
    )


def test_store_shares_longest_prefix_and_counts():
    store = SummaryStore(share_min_len=4)
    doc = summary([1, 2, 3, 4, 5])
    turn = summary([1, 2, 3, 4, 5, 6, 7], first_slot=100)
    store.acquire("a", doc, computed=True)
    store.acquire("b", turn, computed=True)
    store.acquire("short", summary([9, 9]), computed=True)  # below share_min_len: not stored
    assert len(store) == 2
    assert store.find([1, 2, 3, 4, 5, 6, 7, 8]) is turn
    assert store.find([1, 2, 3, 4, 5, 9]) is doc
    assert store.find([1, 2, 3, 4]) is None
    store.acquire("c", doc, computed=False, cached_slots=torch.arange(200, 204))
    assert doc.holders == {"a", "c"}
    # Re-anchored on the reuser's cached prefix (the last prompt token is never anchored).
    assert doc.prompt_slots.tolist() == [200, 201, 202, 203]
    assert store.info()["summaries_computed"] == 3 and store.info()["summaries_reused"] == 1


def test_store_drops_only_unheld_freed_summaries():
    store = SummaryStore(share_min_len=2)
    held, idle, kept = summary([1, 2, 3]), summary([4, 5, 6], 10), summary([7, 8, 9], 20)
    for rid, item in (("h", held), ("i", idle), ("k", kept)):
        store.acquire(rid, item, computed=True)
    store.release("i")
    store.release("k")
    freed = torch.tensor([1, 11, 22])  # held's, idle's, and kept's unanchored last slot
    assert store.drop_freed(freed) == 1
    assert store.summaries() == [held, kept]
    store.release("h")
    store.clear_unheld()
    assert len(store) == 0


def test_store_bounds_idle_summaries():
    store = SummaryStore(share_min_len=1, max_idle=2)
    for i in range(5):
        store.acquire(str(i), summary([i, i]), computed=True)
        store.release(str(i))
    assert [s.tokens for s in store.summaries()] == [(3, 3), (4, 4)]
