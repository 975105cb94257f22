"""The extend path of our CPU backends (`index_attention_torch`, planned) against plain softmax
attention."""

import pytest
import torch

from magicdec_kernels import index_attention
from magicdec_kernels.index_attention import (
    MAX_PLANNED_Q_LEN,
    MIN_SPLIT_RUN,
    MIN_VIEW_RUN,
    index_attention_torch,
    plan_requests,
)
from test.references import reference_attention


def _ragged_case(
    q_lens, kv_lens, num_q_heads=9, num_kv_heads=3, head_dim=64, seed=0, layout="mixed"
):
    """Random pool and per-request slot lists; `layout` says how slots lie in the pool."""
    gen = torch.Generator().manual_seed(seed)
    pool_slots = sum(kv_lens) * 3 + 64
    k_cache = torch.randn(pool_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool_slots, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(pool_slots, generator=gen)
    slot_lists, cursor = [], 0
    for kv_len in kv_lens:
        if layout == "random":
            slots = free[cursor : cursor + kv_len]
            cursor += kv_len
        else:
            # A contiguous prompt range followed by scattered decode slots, as SGLang allocates.
            prompt = kv_len * 2 // 3
            start = cursor * 3
            tail = torch.randperm(pool_slots, generator=gen)[: kv_len - prompt]
            slots = torch.cat([torch.arange(start, start + prompt), tail])
            cursor += kv_len
        slot_lists.append(slots)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen)
    q_indptr = torch.tensor([0, *q_lens]).cumsum(0)
    kv_indptr = torch.tensor([0, *kv_lens]).cumsum(0)
    return q, k_cache, v_cache, q_indptr, kv_indptr, torch.cat(slot_lists)


@pytest.mark.parametrize("layout", ["mixed", "random"])
@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [
        ([1], [1]),  # first decode step after a one-token prompt
        ([1, 1, 1, 1], [7, 300, 45, 1000]),  # ragged decode batch
        ([4, 4, 4], [4, 260, 90]),  # target verify: γ+1 = 4 rows per request
        ([1, 4, 200], [500, 37, 200]),  # decode, verify and a whole prefill together
        ([150, 3], [700, 64]),  # a chunked-prefill chunk over a cached prefix
    ],
)
def test_matches_softmax_reference(q_lens, kv_lens, layout):
    case = _ragged_case(q_lens, kv_lens, layout=layout, seed=sum(kv_lens))
    scale = 0.125
    expected = reference_attention(*case, scale)
    got = index_attention_torch(*case, scale)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gqa_groups_and_head_dims(group):
    case = _ragged_case([1, 3], [120, 80], num_q_heads=2 * group, num_kv_heads=2, head_dim=32)
    torch.testing.assert_close(
        index_attention_torch(*case, 0.3).double(),
        reference_attention(*case, 0.3),
        atol=2e-5,
        rtol=1e-4,
    )


def test_arbitrary_slot_subset_is_what_is_attended():
    """A draft-style selection (sinks + recent window) attends to exactly those slots."""
    q, k_cache, v_cache, _, _, _ = _ragged_case([1], [400])
    sinks, window = torch.arange(0, 16), torch.arange(300, 400)
    selection = torch.cat([sinks, window])
    q_indptr, kv_indptr = torch.tensor([0, 1]), torch.tensor([0, selection.numel()])
    got = index_attention_torch(q, k_cache, v_cache, q_indptr, kv_indptr, selection, 0.125)
    dense = index_attention_torch(
        q, k_cache, v_cache, q_indptr, torch.tensor([0, 400]), torch.arange(400), 0.125
    )
    expected = reference_attention(q, k_cache, v_cache, q_indptr, kv_indptr, selection, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got, dense), "a subset must not read the slots left out"


def test_plan_reads_long_runs_in_place_and_gathers_the_rest():
    """Visible contiguous runs are read in place (split in two when long); short pieces and the
    query tokens themselves are gathered."""
    long_run = torch.arange(5000, 5000 + MIN_SPLIT_RUN + 1)  # odd: one key left to gather
    short_run = torch.arange(100, 100 + MIN_VIEW_RUN - 1)
    queries = torch.tensor([7, 3])  # a verify pass of 2 tokens in scattered slots
    slots = torch.cat([long_run, short_run, queries])
    plan = plan_requests(torch.tensor([0, 2]), torch.tensor([0, slots.numel()]), slots)
    assert plan.runs == [(0, 5000, MIN_SPLIT_RUN, 2)]
    assert plan.run_owner.tolist() == [0, 0]
    gathered = plan.gather_slots[0].tolist()
    assert gathered == [5000 + MIN_SPLIT_RUN, *short_run.tolist(), 7, 3]
    # The first query row must not see the second query token; the second sees everything.
    assert plan.gather_hidden[0, 0].tolist() == [False] * (len(gathered) - 1) + [True]
    assert not plan.gather_hidden[0, 1].any()


def test_head_major_pool_reads_the_same_keys():
    """Our CPU pool stores [Hkv, slots, D] and hands out the [slots, Hkv, D] view."""
    q, k_cache, v_cache, q_indptr, kv_indptr, kv_indices = _ragged_case(
        [1, 4], [MIN_SPLIT_RUN + 300, 700]
    )
    k_head_major = k_cache.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    v_head_major = v_cache.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    case = (q, k_head_major, v_head_major, q_indptr, kv_indptr, kv_indices)
    torch.testing.assert_close(
        index_attention_torch(*case, 0.125).double(),
        reference_attention(q, k_cache, v_cache, q_indptr, kv_indptr, kv_indices, 0.125),
        atol=2e-5,
        rtol=1e-4,
    )


def test_long_query_takes_the_fused_path(monkeypatch):
    """Prefill chunks above the planned size take the SDPA path (and only they do); both paths
    agree with the oracle in one batch."""
    calls = []
    fused = index_attention._fused_sdpa

    def counting(q, *args):
        calls.append(q.shape[0])
        return fused(q, *args)

    monkeypatch.setattr(index_attention, "_fused_sdpa", counting)
    q_len = MAX_PLANNED_Q_LEN + 1
    case = _ragged_case([q_len, MAX_PLANNED_Q_LEN, 1], [q_len + 40, 300, 90])
    torch.testing.assert_close(
        index_attention_torch(*case, 0.125).double(),
        reference_attention(*case, 0.125),
        atol=2e-5,
        rtol=1e-4,
    )
    assert calls == [q_len]
