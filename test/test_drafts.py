"""Draft KV-selection policies, on their own."""

import pytest

from sglang_magicdec.drafts import StreamingDraft


def test_streaming_keeps_sinks_and_the_prompt_window():
    draft = StreamingDraft(budget=64, sinks=4)
    selected = draft.select(committed_len=1000, prompt_len=1000).tolist()
    assert selected == [0, 1, 2, 3, *range(1000 - 60, 1000)]
    assert len(selected) == 64  # exactly the budget for a prompt-only context


def test_streaming_window_grows_with_generation_then_rolls():
    draft = StreamingDraft(budget=64, sinks=4)
    grown = draft.select(committed_len=1030, prompt_len=1000)
    assert len(grown) == 64 + 30 and grown[-1] == 1029
    for generated in [64, 65, 500, 5000]:
        rolled = draft.select(committed_len=1000 + generated, prompt_len=1000)
        assert len(rolled) == 2 * 64  # bounded however long the generation
        assert rolled[:4].tolist() == [0, 1, 2, 3]
        assert rolled[-1] == 1000 + generated - 1


@pytest.mark.parametrize("committed_len", [0, 1, 3, 10, 63, 64])
def test_streaming_short_context_reads_everything_once(committed_len):
    selected = StreamingDraft(budget=64, sinks=4).select(committed_len, prompt_len=committed_len)
    assert selected.tolist() == list(range(committed_len))
