"""benchmark.long_context's table, as `--table` rebuilds it from a saved run's JSON."""

from __future__ import annotations

from benchmark.common import accept_length_between
from benchmark.long_context import table


def row(tok_s: float, needle: str, **extra) -> dict:
    return {"prefill_s": 250.0, "decode_tok_s": tok_s, "accept_length": extra.pop("accept", None),
            "needle_answers": [needle], **extra}  # fmt: skip


def test_the_table_counts_a_capitalised_needle_and_compares_each_mode_with_ar() -> None:
    rows = {
        "ar": row(40.0, "violet-harbor-42"),
        "fixed": row(
            30.0,
            "Violet-harbor-42\nmore",
            accept=2.5,
            identical_to_ar=7,
            summaries_computed=0,
            summaries_reused=16,
        ),  # fmt: skip
        "streaming": row(20.0, "I do not know", accept=2.0, identical_to_ar=8),
    }
    lines = table(rows, floor_tok_s=80.0, prompts=8).splitlines()
    cells = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines[2:]}
    assert cells["ar"][3:5] == ["1.00", "0.50"] and cells["ar"][-1] == "1 of 1 |"
    assert cells["fixed"][3:8] == ["0.75", "0.38", "2.50", "0 / 16", "7 of 8"]
    assert cells["fixed"][-1] == "1 of 1 |"  # the model opened its answer with a capital
    assert cells["streaming"][6] == "-" and cells["streaming"][-1] == "0 of 1 |"


def test_accept_length_counts_the_speculative_rounds_only() -> None:
    """γ = auto's plain steps are decode batches SGLang counts as verifies of one token each
    (`spec_verify_ct`); the accept length is the speculative rounds' own (the server's counters
    between two `/server_info`s), or None where no round ran."""
    before = {"verify_rounds": 10, "avg_accept_length": 2.0}
    after = {"verify_rounds": 30, "avg_accept_length": 2.5}
    assert accept_length_between(before, after) == (30 * 2.5 - 10 * 2.0) / 20
    assert accept_length_between({}, before) == 2.0
    assert accept_length_between(before, before) is None


def test_later_batches_are_a_column_of_their_own_against_ars() -> None:
    """--repeats: each server's later batches (past γ = auto's calibration), their median
    against AR's."""
    rows = {
        "ar": row(40.0, "violet-harbor-42", repeat_tok_s=[44.0, 46.0, 50.0]),
        "auto": row(30.0, "violet-harbor-42", accept=2.0, repeat_tok_s=[45.0, 36.0, 40.0]),
    }
    lines = table(rows, floor_tok_s=80.0, prompts=8).splitlines()
    assert lines[0].endswith(" later batches tok/s (× AR) |")
    assert lines[2].endswith(" 46.0 (1.00) |") and lines[3].endswith(" 40.0 (0.87) |")
    assert "later" not in table({"ar": row(40.0, "x")}, floor_tok_s=80.0, prompts=8)
