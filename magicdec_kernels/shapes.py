"""Shape rules the torch references and their Triton kernels check alike (one module both import,
so neither imports the other)."""

from __future__ import annotations


def check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    """Query heads come in whole groups per KV head."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")


def check_window(window: int, seq_len: int) -> None:
    """A SnapKV observation window lies within its prompt."""
    if window > seq_len:
        raise ValueError(f"window of {window} queries is longer than the {seq_len} prompt keys")
