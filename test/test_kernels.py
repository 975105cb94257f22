"""SnapKV window scores and per-KV-head sparse decode (the draft step's attention): torch against a
float64 loop oracle, Triton against torch. The sparse decode's torch reference is
`slot_attention_torch` with one query row per request.

The Triton kernels run on CUDA when there is a GPU; otherwise under Triton's CPU interpreter
(TRITON_INTERPRET=1), which only takes effect for kernels decorated while it is set, so the
fixture imports the *_triton modules (and a private copy of Triton) with it set and then restores
the environment and sys.modules: servers that other tests start must not inherit it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from magicdec_kernels.cpu_native import slot_attention_torch
from magicdec_kernels.snapkv_scores import snapkv_window_scores_torch

TRITON_MODULES = ("magicdec_kernels.snapkv_scores_triton", "magicdec_kernels.sparse_decode_triton")
HEAD_DIM = 64

# (prompt length L, window W, KV heads, GQA group)
SNAPKV_CASES = [
    (300, 16, 2, 4),  # long prefix, several key blocks, group 4
    (100, 64, 2, 3),  # the largest window
    (9, 8, 4, 1),  # L just above W: a single prefix key
    (120, 1, 3, 3),  # W = 1: one query row
    (70, 5, 1, 4),  # a single KV head
]
# (per-request slot counts, KV heads, GQA group); total slots stay <= 200 for the interpreter.
SPARSE_CASES = [
    ([0, 1, 37, 100, 5], 2, 1),  # empty and one-slot requests among ragged ones
    ([64, 1, 0, 33], 2, 3),
    ([17, 90, 2], 3, 4),
    ([0], 2, 4),  # a batch whose only request has no slots
]


# ---------------------------------------------------------------------------------------------
# Cases and float64 oracles
# ---------------------------------------------------------------------------------------------


def _snapkv_case(seq_len, window, num_kv_heads, group, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    pool_slots = seq_len * 2 + 11
    k_cache = torch.randn(pool_slots, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    # A random permutation: the prompt's slots are scattered over the pool.
    key_slots = torch.randperm(pool_slots, generator=gen)[:seq_len]
    q_window = torch.randn(window, num_kv_heads * group, HEAD_DIM, generator=gen)
    return q_window, k_cache, key_slots


def _sparse_case(lengths, num_kv_heads, group, seed, v_dim=HEAD_DIM, head_major=False):
    """Per-request, per-KV-head scattered slots padded to one width; the padding holds real
    slots too, so reading it would change the result."""
    gen = torch.Generator().manual_seed(seed)
    pool_slots = sum(lengths) * 2 + 13
    if head_major:  # our CPU pool: [Hkv, slots, D] storage seen as [slots, Hkv, D]
        k_cache = torch.randn(num_kv_heads, pool_slots, HEAD_DIM, generator=gen).permute(1, 0, 2)
        v_cache = torch.randn(num_kv_heads, pool_slots, v_dim, generator=gen).permute(1, 0, 2)
    else:
        k_cache = torch.randn(pool_slots, num_kv_heads, HEAD_DIM, generator=gen)
        v_cache = torch.randn(pool_slots, num_kv_heads, v_dim, generator=gen)
    q = torch.randn(len(lengths), num_kv_heads * group, HEAD_DIM, generator=gen)
    width = max(lengths) + 3
    # Each KV head draws its own scattered slots, as a per-head SnapKV selection does.
    head_slots = torch.stack(
        [
            torch.stack([torch.randperm(pool_slots, generator=gen)[:width] for _ in lengths])
            for _ in range(num_kv_heads)
        ],
        dim=1,
    )
    return q, k_cache, v_cache, head_slots, torch.tensor(lengths)


def sparse_decode_torch(q, k_cache, v_cache, head_slots, kv_lens, scale, out=None):
    """`slot_attention_torch` at one query row per request: `sparse_decode_triton`'s signature."""
    q_indptr = torch.arange(q.shape[0] + 1)
    return slot_attention_torch(q, k_cache, v_cache, q_indptr, head_slots, kv_lens, scale, out)


def naive_snapkv_scores(q_window, k_cache, key_slots, scale) -> torch.Tensor:
    """One softmax per (q head, window row), in float64."""
    window, num_q_heads, _ = q_window.shape
    group = num_q_heads // k_cache.shape[1]
    prefix_len = key_slots.numel() - window
    out = torch.zeros(num_q_heads, prefix_len, dtype=torch.float64)
    for head in range(num_q_heads):
        for row in range(window):
            visible = key_slots[: prefix_len + row + 1]
            keys = k_cache[visible, head // group].double()
            probs = torch.softmax(keys @ q_window[row, head].double() * scale, dim=0)
            out[head] += probs[:prefix_len]
    return out


def naive_sparse_decode(q, k_cache, v_cache, head_slots, kv_lens, scale) -> torch.Tensor:
    """One softmax per (request, q head), in float64; empty requests give zeros."""
    batch, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[1]
    out = torch.zeros(batch, num_q_heads, v_cache.shape[2], dtype=torch.float64)
    for request in range(batch):
        for head in range(num_q_heads):
            slots = head_slots[request, head // group, : int(kv_lens[request])]
            if slots.numel() == 0:
                continue
            keys = k_cache[slots, head // group].double()
            values = v_cache[slots, head // group].double()
            probs = torch.softmax(keys @ q[request, head].double() * scale, dim=0)
            out[request, head] = probs @ values
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor, rel_atol: float = 1e-5) -> None:
    """Absolute tolerance scaled by the result's magnitude (SnapKV sums reach W)."""
    assert got.shape == expected.shape
    magnitude = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(
        got.double(), expected.double(), atol=rel_atol * magnitude, rtol=rel_atol
    )


# ---------------------------------------------------------------------------------------------
# Torch versions against the oracles
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,window,num_kv_heads,group", SNAPKV_CASES)
def test_snapkv_torch_matches_oracle(seq_len, window, num_kv_heads, group):
    case = _snapkv_case(seq_len, window, num_kv_heads, group, seed=seq_len + window)
    got = snapkv_window_scores_torch(*case, 0.125)
    assert got.dtype == torch.float32
    assert_close(got, naive_snapkv_scores(*case, 0.125))


def test_snapkv_torch_half_pool_computes_in_float32():
    """A bf16 pool is upcast before the softmax: same result as the oracle on the same values."""
    case = _snapkv_case(150, 8, 2, 3, seed=5, dtype=torch.bfloat16)
    assert_close(snapkv_window_scores_torch(*case, 0.125), naive_snapkv_scores(*case, 0.125))


def test_snapkv_window_as_long_as_prompt_scores_nothing():
    case = _snapkv_case(6, 6, 2, 2, seed=1)
    assert snapkv_window_scores_torch(*case, 0.125).shape == (4, 0)
    with pytest.raises(ValueError, match="longer than"):
        snapkv_window_scores_torch(case[0], case[1], case[2][:5], 0.125)


def test_snapkv_scores_sum_to_the_prefix_share_of_each_row():
    """Each row's probabilities sum to 1, so the scores sum to W minus the window's own share."""
    q_window, k_cache, key_slots = _snapkv_case(40, 4, 1, 1, seed=2)
    # Equal scores everywhere: row i spreads 1 over 36 + i + 1 keys, 36 of them in the prefix.
    flat = torch.ones_like(q_window)
    k_flat = torch.ones_like(k_cache)
    total = snapkv_window_scores_torch(flat, k_flat, key_slots, 0.0).sum().item()
    assert total == pytest.approx(sum(36 / (37 + i) for i in range(4)), rel=1e-6)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("lengths,num_kv_heads,group", SPARSE_CASES)
def test_sparse_decode_torch_matches_oracle(lengths, num_kv_heads, group, head_major):
    seed = sum(lengths) + group
    case = _sparse_case(lengths, num_kv_heads, group, seed=seed, head_major=head_major)
    got = sparse_decode_torch(*case, 0.125)
    assert got.dtype == torch.float32
    assert_close(got, naive_sparse_decode(*case, 0.125))


def test_sparse_decode_torch_writes_into_out_with_other_value_dim():
    case = _sparse_case([3, 0, 50], 2, 3, seed=7, v_dim=32)
    out = torch.full((3, 6, 32), float("nan"))
    got = sparse_decode_torch(*case, 0.2, out=out)
    assert got is out
    assert_close(out, naive_sparse_decode(*case, 0.2))


DISPATCH_CHECK = """
import sys
import torch
from magicdec_kernels.snapkv_scores import snapkv_window_scores
from magicdec_kernels.cpu_native import slot_attention
q = torch.randn(2, 4, 64)
k_cache = torch.randn(30, 2, 64)
snapkv_window_scores(q, k_cache, torch.arange(20), 0.1)
slot_attention(torch.randn(2, 4, 64), k_cache, k_cache, torch.arange(3), torch.zeros(2, 2, 5,
    dtype=torch.int64), torch.tensor([5, 3]), 0.1)
print(sorted(name for name in sys.modules if name.startswith("triton") or name.endswith("_triton")))
"""


def test_dispatchers_do_not_import_triton_for_cpu_tensors():
    """CPU servers never import the Triton kernels (nor Triton): checked in a fresh process,
    since this one may have imported them already."""
    result = subprocess.run(
        [sys.executable, "-c", DISPATCH_CHECK], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


# ---------------------------------------------------------------------------------------------
# Triton versions against the torch versions
# ---------------------------------------------------------------------------------------------

# TRITON_INTERPRET as the run started: the interpreted kernels' imports must leave it so.
INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def _is_triton_python_module(name: str) -> bool:
    # The compiled extension (triton._C) is shared: it holds no decorated kernels.
    return (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")


@contextlib.contextmanager
def _triton_interpreter_imports() -> Iterator[None]:
    """Imports inside build interpreted kernels; afterwards sys.modules and os.environ are back.

    @triton.jit chooses interpreter or compiler when it decorates, and Triton's own library
    (tl.sum, tl.zeros, ...) is decorated when Triton is imported, so a Triton some earlier test
    imported (SGLang does) cannot run interpreted kernels. Inside, a private copy of Triton's
    Python modules is imported with TRITON_INTERPRET=1; the process's own modules are put back
    on exit and the kernels keep their references to the private copy.
    """
    saved_env = os.environ.get("TRITON_INTERPRET")
    watched = [name for name in sys.modules if _is_triton_python_module(name)]
    watched += [name for name in TRITON_MODULES if name in sys.modules]
    saved_modules = {name: sys.modules.pop(name) for name in watched}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        for name in list(sys.modules):
            if _is_triton_python_module(name) or name in TRITON_MODULES:
                del sys.modules[name]
        sys.modules.update(saved_modules)
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


@pytest.fixture(scope="module")
def triton_kernels() -> SimpleNamespace:
    """The *_triton modules and the device their kernels run on: CUDA, else the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the Triton kernels cannot be checked")
    if torch.cuda.is_available():
        snapkv, sparse = (importlib.import_module(name) for name in TRITON_MODULES)
        return SimpleNamespace(snapkv=snapkv, sparse=sparse, device="cuda")
    process_triton = sys.modules.get("triton")
    with _triton_interpreter_imports():
        snapkv, sparse = (importlib.import_module(name) for name in TRITON_MODULES)
    return SimpleNamespace(
        snapkv=snapkv, sparse=sparse, device="cpu", process_triton=process_triton
    )


def test_interpreted_kernels_leave_this_process_triton_as_it_was(triton_kernels):
    """Importing the kernels under the interpreter (`_triton_interpreter_imports`) puts back
    TRITON_INTERPRET and the process's own Triton modules."""
    assert os.environ.get("TRITON_INTERPRET") == INTERPRET_AT_START
    # Only the fixture's namespace holds interpreted kernels; the process's modules are untouched.
    if triton_kernels.device == "cpu":
        interpreted = (triton_kernels.snapkv, triton_kernels.sparse)
        assert not any(sys.modules.get(name) in interpreted for name in TRITON_MODULES)
        # (SGLang's compiled Triton kernels in this process keep running on it.)
        assert sys.modules.get("triton") is triton_kernels.process_triton


@pytest.mark.parametrize("seq_len,window,num_kv_heads,group", SNAPKV_CASES)
def test_snapkv_triton_matches_torch(triton_kernels, seq_len, window, num_kv_heads, group):
    case = _snapkv_case(seq_len, window, num_kv_heads, group, seed=seq_len + window)
    expected = snapkv_window_scores_torch(*case, 0.125)
    on_device = [tensor.to(triton_kernels.device) for tensor in case]
    got = triton_kernels.snapkv.snapkv_window_scores_triton(*on_device, 0.125)
    assert got.dtype == torch.float32
    assert_close(got.cpu(), expected)


def test_snapkv_triton_window_as_long_as_prompt_scores_nothing(triton_kernels):
    case = [tensor.to(triton_kernels.device) for tensor in _snapkv_case(6, 6, 2, 2, seed=1)]
    assert triton_kernels.snapkv.snapkv_window_scores_triton(*case, 0.125).shape == (4, 0)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_snapkv_triton_key_splits_merge_exactly(triton_kernels, num_splits):
    """Pass 1 cut into key ranges: rows that see none of a range must not disturb the merge."""
    case = _snapkv_case(300, 16, 2, 3, seed=11)
    expected = snapkv_window_scores_torch(*case, 0.125)
    on_device = [tensor.to(triton_kernels.device) for tensor in case]
    got = triton_kernels.snapkv.window_scores_with_splits(*on_device, 0.125, num_splits)
    assert_close(got.cpu(), expected)


def test_snapkv_triton_bf16_pool_float32_queries(triton_kernels):
    case = _snapkv_case(130, 8, 2, 2, seed=4, dtype=torch.bfloat16)
    expected = snapkv_window_scores_torch(*case, 0.125)
    on_device = [tensor.to(triton_kernels.device) for tensor in case]
    got = triton_kernels.snapkv.snapkv_window_scores_triton(*on_device, 0.125)
    assert_close(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_snapkv_triton_16bit_queries_and_pool(triton_kernels, dtype):
    """Same 16-bit dtype on both sides takes the native tl.dot (exact products, fp32 sums)."""
    if dtype == torch.bfloat16 and triton_kernels.device == "cpu":
        pytest.skip("Triton's CPU interpreter multiplies bf16 tl.dot operands as raw uint16 bits")
    q_window, k_cache, key_slots = _snapkv_case(130, 8, 2, 2, seed=4, dtype=dtype)
    q_window = q_window.to(dtype)
    expected = snapkv_window_scores_torch(q_window, k_cache, key_slots, 0.125)
    on_device = [tensor.to(triton_kernels.device) for tensor in (q_window, k_cache, key_slots)]
    got = triton_kernels.snapkv.snapkv_window_scores_triton(*on_device, 0.125)
    assert_close(got.cpu(), expected)


@pytest.mark.parametrize("lengths,num_kv_heads,group", SPARSE_CASES)
def test_sparse_decode_triton_matches_torch(triton_kernels, lengths, num_kv_heads, group):
    case = _sparse_case(lengths, num_kv_heads, group, seed=sum(lengths) + group)
    expected = sparse_decode_torch(*case, 0.125)
    on_device = [tensor.to(triton_kernels.device) for tensor in case]
    got = triton_kernels.sparse.sparse_decode_triton(*on_device, 0.125)
    assert got.dtype == torch.float32
    assert_close(got.cpu(), expected)


def test_sparse_decode_triton_writes_into_out_in_q_dtype(triton_kernels):
    case = _sparse_case([3, 0, 50], 2, 3, seed=7, v_dim=32)
    q, k_cache, v_cache, head_slots, kv_lens = case
    device = triton_kernels.device
    half_q = q.to(torch.bfloat16)
    expected = sparse_decode_torch(half_q, k_cache, v_cache, head_slots, kv_lens, 0.2)
    out = torch.full((3, 6, 32), float("nan"), dtype=torch.bfloat16, device=device)
    got = triton_kernels.sparse.sparse_decode_triton(
        half_q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        head_slots.to(device),
        kv_lens.to(device),
        0.2,
        out=out,
    )
    assert got is out
    # Both round the same float32 result to bf16; allow one bf16 step of the output.
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=1e-2, rtol=1e-2)
