"""benchmark.long_context's table, as `--table` rebuilds it from a saved run's JSON."""

from __future__ import annotations

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
