"""Draft KV-selection policies, on their own."""

import pytest

from sglang_magicdec.drafts.streaming import StreamingDraft


def positions(ranges: list[range]) -> list[int]:
    return [position for positions in ranges for position in positions]


def test_streaming_keeps_sinks_and_the_prompt_window():
    draft = StreamingDraft(budget=64, sinks=4)
    selected = positions(draft.select(committed_len=1000, prompt_len=1000))
    assert selected == [0, 1, 2, 3, *range(1000 - 60, 1000)]
    assert len(selected) == 64  # exactly the budget for a prompt-only context


def test_streaming_window_grows_with_generation_then_rolls():
    draft = StreamingDraft(budget=64, sinks=4)
    grown = positions(draft.select(committed_len=1030, prompt_len=1000))
    assert len(grown) == 64 + 30 and grown[-1] == 1029
    for generated in [64, 65, 500, 5000]:
        rolled = positions(draft.select(committed_len=1000 + generated, prompt_len=1000))
        assert len(rolled) == 2 * 64  # bounded however long the generation
        assert rolled[:4] == [0, 1, 2, 3]
        assert rolled[-1] == 1000 + generated - 1


def test_streaming_at_a_round_budget_below_its_own():
    """Budget = auto: a round drafting at 16 keeps the sinks and the last 12 prompt tokens, and
    rolls its generated tokens at 16."""
    draft = StreamingDraft(budget=64, sinks=4)
    assert positions(draft.select(1000, 1000, budget=16)) == [0, 1, 2, 3, *range(988, 1000)]
    rolled = positions(draft.select(1500, 1000, budget=16))
    assert len(rolled) == 2 * 16 and rolled[-1] == 1499


@pytest.mark.parametrize("committed_len", [0, 1, 3, 10, 63, 64])
def test_streaming_short_context_reads_everything_once(committed_len):
    selected = StreamingDraft(budget=64, sinks=4).select(committed_len, prompt_len=committed_len)
    assert positions(selected) == list(range(committed_len))


def test_draft_round_resolves_each_requests_positions_through_its_own_row():
    """Summaries per (layer, KV head) first, then the shared ranges, then the round's slots;
    ragged counts, requests with and without a summary."""
    import torch

    from sglang_magicdec.spec_info import DraftPositions, DraftRound

    generator = torch.Generator().manual_seed(0)
    req_to_token = torch.randperm(6 * 100, generator=generator).view(6, 100)
    req_pool_indices = torch.tensor([4, 1, 2])
    summary = torch.tensor([[[0, 5, 9], [1, 2, 8]], [[3, 4, 7], [0, 6, 9]]])  # [L=2, H=2, 3]
    positions = [
        DraftPositions(summary, [range(10, 14), range(20, 22)]),
        DraftPositions(None, [range(0, 2), range(30, 40)]),
        DraftPositions(summary[:, :, :2], []),
    ]
    gamma = 2
    round_slots = torch.arange(3 * (gamma + 1)).view(3, gamma + 1) + 1000
    built = DraftRound.build(positions, req_to_token, req_pool_indices, round_slots)
    assert built.selected.tolist() == [9, 12, 2]
    assert built.head_slots.shape == (2, 3, 2, 12 + gamma)
    for b, p in enumerate(positions):
        row = req_to_token[req_pool_indices[b]]
        shared = [position for r in p.ranges for position in r]
        for layer in range(2):
            for head in range(2):
                chosen = [] if p.summary is None else p.summary[layer, head].tolist()
                expected = row[chosen + shared].tolist() + round_slots[b, :gamma].tolist()
                got = built.head_slots[layer, b, head, : p.count + gamma].tolist()
                assert got == expected
