"""SnapKV selection against a plain reference of the algorithm, and the summary store."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_magicdec.drafts.snapkv import SnapKVDraft
from sglang_magicdec.summaries import Holding, Summary, SummaryStore


def reference_selection(q_window, keys, budget, pool, kernel) -> torch.Tensor:
    """SnapKV written out plainly in float64: full causal attention of the window queries,
    summed over the window, pooled per query head, summed per GQA group, top-k per KV head."""
    window, prompt_len = q_window.shape[0], keys.shape[0]
    grouped = reference_scores(q_window, keys, pool, kernel)
    num_kv_heads, prefix_len = grouped.shape
    keep = min(budget - window, prefix_len)
    top = grouped.topk(keep, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(prefix_len, prompt_len).expand(num_kv_heads, -1)], dim=-1)


def reference_scores(q_window, keys, pool, kernel) -> torch.Tensor:
    """[Hkv, prefix_len] float64: each pre-window position's pooled, GQA-summed score."""
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
    return pooled.view(num_kv_heads, group, prefix_len).sum(dim=1)


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

    chosen, margin = draft.select_layer(q_window, k_cache, key_slots, 1 / math.sqrt(head_dim))

    expected = reference_selection(q_window, k_cache[key_slots], budget, pool, kernel)
    assert chosen.shape == (num_kv_heads, min(budget, prompt_len))
    assert torch.equal(chosen.sort(dim=-1).values, expected)
    # Ranked: the window first, then best first, so that every smaller budget's selection is
    # a prefix (what a round drafting at that budget reads, `Summary.positions_within`).
    prefix_len = prompt_len - window
    window_positions = torch.arange(prefix_len, prompt_len).expand(num_kv_heads, window)
    assert torch.equal(chosen[:, :window], window_positions)
    # With ties (max pooling spreads one maximum over its neighbours) a top-k is any set of k
    # positions holding the k best scores: compare scores.
    scores = reference_scores(q_window, k_cache[key_slots], pool, kernel)
    for smaller in range(window + 1, min(budget, prompt_len)):
        picked = scores.gather(-1, chosen[:, window:smaller])
        best = scores.topk(smaller - window, dim=-1).values
        assert torch.allclose(picked.sort(dim=-1, descending=True).values, best, rtol=1e-5)
    # The margin: the best pre-window positions not kept, best first.
    assert margin.shape == (
        num_kv_heads,
        min(budget, prefix_len - min(budget - window, prefix_len)),
    )
    for head in range(num_kv_heads):
        assert not set(margin[head].tolist()) & set(chosen[head].tolist())
        assert all(0 <= position < prefix_len for position in margin[head].tolist())


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
    chosen, _ = draft.select_layer(q_window, k_cache, torch.arange(prompt_len), 1.0)
    assert 10 in chosen[0].tolist() and 70 not in chosen[0].tolist()
    assert 70 in chosen[1].tolist() and 10 not in chosen[1].tolist()


def test_recent_keeps_suffix_and_rolls_generated():
    draft = SnapKVDraft(budget=8, obs_window=2)
    assert [p for r in draft.recent(20, 25, 23) for p in r] == [20, 21, 22, 23, 24]
    # 30 generated tokens: only the last `budget` stay.
    assert [p for r in draft.recent(20, 53, 23) for p in r] == [20, 21, 22, *range(45, 53)]


def summary(tokens: list[int], first_slot: int = 0) -> Summary:
    return Summary(
        tokens=tuple(tokens),
        positions=torch.zeros(1, 1, 1, dtype=torch.int32),
        margin=torch.zeros(1, 1, 0, dtype=torch.int32),
        prompt_slots=torch.arange(first_slot, first_slot + len(tokens) - 1),
    )


def test_margin_ranks_the_positions_after_the_top_k():
    """Scores rising with position: the top-k is the latest pre-window positions (after the
    window, best first), the margin the ones just before them, best (latest) first."""
    prompt_len, window, head_dim = 64, 4, 8
    k_cache = torch.zeros(prompt_len, 1, head_dim)
    k_cache[:, 0, 0] = torch.linspace(0, 3, prompt_len)
    q_window = torch.zeros(window, 1, head_dim)
    q_window[:, 0, 0] = 5
    draft = SnapKVDraft(budget=window + 6, obs_window=window, pool="max", pool_kernel=1)
    chosen, margin = draft.select_layer(q_window, k_cache, torch.arange(prompt_len), 1.0)
    assert chosen[0].tolist() == [*range(60, 64), *range(59, 53, -1)]
    assert margin[0].tolist() == list(range(53, 43, -1))


def test_partial_share_refills_from_the_margin_then_the_latest_positions():
    positions = torch.tensor([[[2, 5, 9, 12, 14, 15]], [[1, 3, 4, 13, 14, 15]]], dtype=torch.int32)
    margin = torch.tensor([[[11, 0, 7]], [[12, 2, 5]]], dtype=torch.int32)
    doc = Summary(tuple(range(16)), positions, margin, torch.arange(15))
    assert doc.positions_within(16) is positions
    # Sharing 12 tokens: positions 12.. drop out; layer 0 refills 11, 0, 7 (its whole margin);
    # layer 1's margin has 2 and 5 before 12, then the latest free position before 12: 11.
    within = doc.positions_within(12)
    assert within.tolist() == [[[0, 2, 5, 7, 9, 11]], [[1, 2, 3, 4, 5, 11]]]
    # Sharing fewer tokens than the selection holds: all of them.
    assert doc.positions_within(4).tolist() == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]


def test_a_smaller_budget_reads_a_prefix_of_the_ranking_refilled_from_its_rest():
    """Selected at 6 positions, ranked (window 14, 15 first, then best first): budget 4 reads
    the first 4; sharing 12 tokens, its positions past 12 drop out and the rest of the ranking
    refills them, best first, before the margin does."""
    ranked = torch.tensor([[[14, 15, 9, 2, 12, 5]]], dtype=torch.int32)
    margin = torch.tensor([[[11, 0]]], dtype=torch.int32)
    doc = Summary(
        tuple(range(16)), ranked.sort(dim=-1).values, margin, torch.arange(15), ranked=ranked
    )
    assert doc.positions_within(16, budget=4).tolist() == [[[2, 9, 14, 15]]]
    assert doc.positions_within(16, budget=6).tolist() == [[[2, 5, 9, 12, 14, 15]]]
    assert doc.positions_within(16).tolist() == [[[2, 5, 9, 12, 14, 15]]]
    # 14 and 15 drop out; 12 (next in the ranking) is past the share too; 5, then 11.
    assert doc.positions_within(12, budget=4).tolist() == [[[2, 5, 9, 11]]]
    unranked = Summary(tuple(range(16)), ranked.sort(dim=-1).values, margin, torch.arange(15))
    with pytest.raises(ValueError, match="without its ranking"):
        unranked.positions_within(16, budget=4)


def test_a_request_keeps_two_budgets_positions_on_its_device():
    """The running budget's positions and one explored stay; a third budget evicts the one used
    longest ago, which a later round at it recomputes alike."""
    ranked = torch.tensor([[[14, 15, 9, 2, 12, 5]]], dtype=torch.int32)
    doc = Summary(
        tuple(range(16)),
        ranked.sort(dim=-1).values,
        torch.zeros(1, 1, 0, dtype=torch.int32),
        torch.arange(15),
        ranked=ranked,
    )
    holding = Holding(doc, shared_len=16)
    at_4 = holding.device_positions(4, "cpu")
    holding.device_positions(6, "cpu")
    holding.device_positions(4, "cpu")  # 4 used last: 6 goes next
    assert holding.device_positions(3, "cpu").tolist() == [[[9, 14, 15]]]
    assert list(holding.by_budget) == [4, 3]
    assert holding.device_positions(4, "cpu") is at_4
    assert holding.device_positions(6, "cpu").tolist() == [[[2, 5, 9, 12, 14, 15]]]


def test_head_digests_tell_which_heads_selected_otherwise():
    """One digest per (layer, KV head), layer-major: moving one position moves one head's."""
    positions = torch.arange(2 * 3 * 4, dtype=torch.int32).view(2, 3, 4)
    margin = torch.zeros(2, 3, 0, dtype=torch.int32)
    doc = Summary(tuple(range(32)), positions, margin, torch.arange(31))
    moved = positions.clone()
    moved[1, 0, 2] = 30
    other = Summary(tuple(range(32)), moved, margin, torch.arange(31))
    assert len(doc.head_digests) == 6 and len(set(doc.head_digests)) == 6
    apart = [a != b for a, b in zip(doc.head_digests, other.head_digests, strict=True)]
    assert apart == [False, False, False, True, False, False]
    assert doc.digest != other.digest


def test_store_finds_the_longest_shared_prefix_block_by_block():
    store = SummaryStore(share_min_len=100)  # blocks of 64 tokens
    document = list(range(1000, 1300))
    doc = summary(document + [1, 2, 3])
    turn = summary(document + [1, 2, 3, 4, 5, 6, 7], first_slot=1000)
    other = summary(list(range(5000, 5300)))
    for rid, item in (("a", doc), ("b", turn), ("c", other)):
        store.acquire(rid, item, computed=True)
    store.acquire("short", summary([9] * 99), computed=True)  # below share_min_len: not stored
    assert len(store) == 3
    assert store.find(document + [1, 2, 3, 4, 5, 6, 7, 8]) == (turn, 307)
    # A different question after the document: it shares the document (and the 1, 2).
    assert store.find(document + [1, 2, 9]) in ((doc, 302), (turn, 302))
    assert store.find(document[:99] + [0] * 200) is None  # shares 99 tokens < share_min_len
    assert store.find(list(range(5000, 5150))) == (other, 150)  # a prefix of the summary's
    assert store.find([7] * 400) is None
    holding = store.acquire(
        "d", doc, computed=False, shared_len=302, cached_slots=torch.arange(200, 500)
    )
    assert doc.holders == {"a", "d"} and holding.shared_len == 302
    # Re-anchored on the reuser's cached prefix, within the shared part.
    assert doc.prompt_slots[:300].tolist() == list(range(200, 500))
    assert store.info()["summaries_computed"] == 4 and store.info()["summaries_reused"] == 1


def test_evicted_tail_shortens_what_a_summary_shares():
    store = SummaryStore(share_min_len=100)
    document = list(range(1000, 1300))
    doc = summary(document + list(range(40)))  # slots 0 .. 338
    store.acquire("a", doc, computed=True)
    store.release("a")
    assert store.drop_freed(torch.tensor([310, 311])) == 0  # the question's KV went first
    assert doc.live_len == 310
    assert store.find(document + list(range(40))) == (doc, 310)
    assert store.drop_freed(torch.tensor([50])) == 1  # the document's: below share_min_len
    assert store.find(document) is None and len(store) == 0


def test_store_drops_only_unheld_freed_summaries():
    store = SummaryStore(share_min_len=2)
    held, idle, kept = summary([1, 2, 3]), summary([4, 5, 6], 10), summary([7, 8, 9], 20)
    for rid, item in (("h", held), ("i", idle), ("k", kept)):
        store.acquire(rid, item, computed=True)
    store.release("i")
    store.release("k")
    freed = torch.tensor([1, 10, 22])  # held's second slot, idle's first, kept's unanchored last
    assert store.drop_freed(freed) == 1
    assert store.summaries() == [held, kept]
    store.release("h")  # held kept only 1 live token: gone once released
    assert store.summaries() == [kept]
    store.clear_unheld()
    assert len(store) == 0


def test_store_bounds_idle_summaries():
    store = SummaryStore(share_min_len=1, max_idle=2)
    for i in range(5):
        store.acquire(str(i), summary([i, i]), computed=True)
        store.release(str(i))
    assert [s.tokens for s in store.summaries()] == [(3, 3), (4, 4)]


def small_selection():
    """A SnapKV selection of 8 positions (2 sinks in its fallback), sharing from 4 tokens."""
    from sglang_magicdec.drafts.snapkv import SnapKVSelection
    from sglang_magicdec.drafts.streaming import StreamingDraft, StreamingSelection

    return SnapKVSelection(
        SnapKVDraft(budget=8, obs_window=2),
        fallback=StreamingSelection(StreamingDraft(budget=8, sinks=2)),
        model=torch.nn.Module(),
        share_min_len=4,
        min_context=4,
    )


def computed_by_a(slots: torch.Tensor):
    """A small selection in which request "a" computed and holds the summary of its 10-token
    prompt, held in KV `slots`: (selection, summary, request)."""
    selection = small_selection()
    prompt = list(range(10))
    summary = Summary(
        tokens=tuple(prompt),
        positions=torch.arange(8, dtype=torch.int32).view(1, 1, 8),
        margin=torch.zeros(1, 1, 0, dtype=torch.int32),
        prompt_slots=slots[:-1].clone(),
    )
    selection.store.acquire("a", summary, computed=True)
    return selection, summary, SimpleNamespace(rid="a", origin_input_ids=prompt)


def test_a_summary_is_anchored_where_the_radix_cache_holds_its_prompt():
    """SGLang caches a prompt another request cached first: it gives the request's own slots
    back as duplicates (the summary's anchor: its live prefix is cut to nothing) and points the
    row at the tree's copy, which the summary then follows, whole again. Frees of the tree's
    copy cut it; once unheld and shorter than the sharing length, it goes."""
    own, tree = torch.arange(100, 110), torch.arange(200, 210)
    selection, summary, req = computed_by_a(own)
    prompt = req.origin_input_ids
    selection.kv_freed(own[:-1])  # the duplicates, freed inside the insert
    assert summary.live_len == 0
    row = torch.cat([tree, torch.zeros(6, dtype=torch.int64)])
    selection.tokens_cached(req, row)
    assert torch.equal(summary.prompt_slots, tree[:-1]) and summary.live_len == len(prompt)
    selection.check(req, row, torch.empty(0, dtype=torch.int64), 1)
    selection.tokens_cached(req, torch.zeros(16, dtype=torch.int64))  # later inserts: no move
    assert torch.equal(summary.prompt_slots, tree[:-1])
    selection.kv_freed(torch.tensor([205, 300]))
    assert summary.live_len == 5
    selection.request_released("a")
    assert selection.store.summaries() == [summary]  # 5 tokens still shareable
    selection.kv_freed(torch.tensor([202]))
    assert selection.store.summaries() == []


def test_debug_check_fails_for_a_stale_summary():
    """`--magicdec-debug`'s check of a request drafting with its own prompt's summary: it passes
    while the summary is anchored on the KV the request holds, and fails once the anchor is
    stale (slots the request does not hold) or any of that KV is free."""
    slots = torch.arange(100, 110)
    selection, summary, req = computed_by_a(slots)
    row = torch.cat([slots, torch.zeros(6, dtype=torch.int64)])  # its req_to_token row
    nothing_free = torch.empty(0, dtype=torch.int64)
    selection.check(req, row, nothing_free, 1)
    with pytest.raises(AssertionError, match="freed"):
        selection.check(req, row, torch.tensor([104]), 1)
    summary.prompt_slots = slots[:-1] + 50
    with pytest.raises(AssertionError, match="does not hold"):
        selection.check(req, row, nothing_free, 1)
