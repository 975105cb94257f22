"""MagicDec's native CPU kernels (C++ in csrc/): attention over lists of KV-pool slots, products
of a few rows with a weight matrix (`few_rows_linear`, below), and a decoder layer's per-token ops
(`rms_norm`, `rotary_embedding`, `silu_and_mul`, `store_kv`, below).

Slot attention (csrc/slot_attention.cpp).

One entry point serves plain decode, target verification and the sparse draft: request b's query
rows attend over the pool slots its list names, per KV head or shared by all heads. At long
context the cost of all three is reading K and V once, so the kernel reads each (request, KV
head)'s keys and values once for all of the request's query rows times the query heads of the GQA
group, straight from the pool by slot index (never gathered into a per-request copy), with an
online softmax over blocks of keys. Long lists are split into key chunks spread over torch's
threads and merged exactly by their log-sum-exps, so one long request still uses every core.

Layout:
    q           [Nq, Hq, D]          float32 or bfloat16; the requests' query rows back to back
    k_cache     [slots, Hkv, D]      float32 or bfloat16 (v_cache alike, head dim Dv); any
                                     strides with the last dim contiguous: our CPU pool is a
                                     head-major [Hkv, slots, D] store viewed this way
    q_indptr    [B + 1] int64 (CPU)  query rows of request b are q[q_indptr[b]:q_indptr[b + 1]]
    head_slots  [B, Hkv or 1, W] int64
                                     KV head h of request b reads slots head_slots[b, h, :n_b]
                                     (dim 1 of size 1: every head reads the same list)
    kv_lens     [B] int64 (CPU)      n_b
    out         [Nq, Hq, Dv]         q's dtype, written in place and returned

Query head j reads KV head j // (Hq // Hkv). Causality is aligned to the end of each list: query
row i of a request with q_len rows sees the first `n_b - q_len + i + 1` keys of its list (decode,
q_len 1, sees them all; in verification the last γ+1 entries are the query tokens themselves).
A row that sees no key gets zeros. Softmax and accumulation run in float32. Query rows outside
every request's range are not written. With bf16 q and KV (head dim a multiple of 32) on a CPU
with AVX512-BF16, both products are bf16 pair dot products (exact products, float32 sums), and
the probabilities are rounded to bf16 for the value product, as GPU flash attention does.

`native()` builds (once; later loads only check the sources) and loads the extension, or says in
one warning why it cannot and returns None; `slot_attention` takes the native kernel when it is
loaded and supports the shapes, `slot_attention_torch` (the reference) otherwise.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

BUILD_DIR = Path(__file__).parent / "_native"
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("module.cpp", "slot_attention.cpp", "few_rows_linear.cpp", "layer_ops.cpp")
]
EXTENSION_NAME = "magicdec_cpu_kernels"


def build(verbose: bool = False) -> ModuleType:
    """Compile (if the sources changed) and load the extension module."""
    cpp_extension = _import_cpp_extension()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # at::parallel_for is inline: under torch's OpenMP backend its `omp parallel` is compiled into
    # the extension, which then shares torch's libgomp (already loaded) and thread count.
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(source.resolve()) for source in SOURCES],
        build_directory=str(BUILD_DIR),
        # No -march=native: the source picks AVX-512 / AVX2 per function at run time.
        extra_cflags=["-O3", *openmp],
        extra_ldflags=openmp,
        is_python_module=True,
        verbose=verbose,
    )


def _import_cpp_extension() -> ModuleType:
    # Its import warns "No CUDA runtime is found" on CPU machines that have a CUDA_HOME: noise in
    # every server process here, where only the host compiler is used.
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)
    return cpp_extension


@functools.cache
def native() -> ModuleType | None:
    """The loaded extension, or None (with one warning saying why) where it cannot run well."""
    try:
        module = build()
    except Exception as error:  # a missing compiler, headers, a read-only tree...
        logger.warning("native CPU kernels unavailable (build failed: %s)", _reason(error))
        return None
    if module.best_isa() == "scalar":
        logger.warning("native CPU kernels unavailable (this CPU has neither AVX2 nor AVX-512)")
        return None
    return module


def _reason(error: Exception) -> str:
    """One line of a build error: the compiler's first error, else the message's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    compiler_errors = [line for line in lines if "error:" in line]
    return (compiler_errors[0] if compiler_errors else lines[-1])[:300]


def supports_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (else `slot_attention` uses torch)."""
    floats = (torch.float32, torch.bfloat16)
    return (
        not q.is_cuda
        and q.dtype in floats
        and k_cache.dtype in floats
        and v_cache.dtype == k_cache.dtype
        and q.shape[-1] % 16 == 0
        and v_cache.shape[-1] % 16 == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def slot_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The native kernel (raises if `native()` is None). Returns out, [Nq, Hq, Dv]."""
    module = native()
    if module is None:
        raise RuntimeError("the native slot attention extension is not available")
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])
    return module.slot_attention(
        q, k_cache, v_cache, q_indptr, head_slots, kv_lens, float(scale), out
    )


def slot_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain torch, one request at a time (the reference path)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    if out is None:
        out = q.new_empty(q.shape[0], num_q_heads, v_dim)
    keys_by_head, values_by_head = k_cache.permute(1, 0, 2), v_cache.permute(1, 0, 2)
    heads = torch.arange(num_kv_heads, device=q.device)[:, None]
    bounds, lens = q_indptr.tolist(), kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q_start, q_end = bounds[b], bounds[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if kv_len == 0:
            out[q_start:q_end] = 0
            continue
        slots = head_slots[b, :, :kv_len].expand(num_kv_heads, kv_len)
        keys = keys_by_head[heads, slots].float()  # [Hkv, n, D]
        values = values_by_head[heads, slots].float()
        # [Hkv, group, q_len, D]: the query heads of one KV head share its keys.
        queries = q[q_start:q_end].reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(queries.float(), keys.transpose(1, 2)[:, None]).mul_(scale)
        rows = torch.arange(q_len, device=q.device)[:, None]
        hidden = torch.arange(kv_len, device=q.device)[None, :] >= kv_len - q_len + rows + 1
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row seeing nothing: zeros
        result = torch.matmul(probs, values[:, None])  # [Hkv, group, q_len, Dv]
        out[q_start:q_end] = result.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, v_dim)
    return out


def slot_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`slot_attention_native` where it is loaded and takes these tensors, else the torch one."""
    if supports_native(q, k_cache, v_cache) and native() is not None:
        return slot_attention_native(q, k_cache, v_cache, q_indptr, head_slots, kv_lens, scale, out)
    return slot_attention_torch(q, k_cache, v_cache, q_indptr, head_slots, kv_lens, scale, out)


def _cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# Rows up to which the native few-row product beats torch's (`benchmark/bench_cpu_backend.py
# --kernels`). Float32 stays about at the weight's bytes floor to 8 rows and at the FMA rate past
# that. bf16's `vdpbf16ps` is compute-bound past ~8 rows: on an Intel CPU with AMX, oneDNN's bf16
# path is faster from there; without AMX (AMD EPYC, 2026-12-02: SmolLM2's 30 layers at 8 / 16 /
# 24 / 32 rows, native 12.5 / 18.8 / 25.0 / 37.1 ms, F.linear 29.6 / 33.2 / 31.2 / 35.4) up to
# 24 rows.
FEW_ROWS_MAX = {torch.float32: 64, torch.bfloat16: 8 if _cpu_has_amx() else 24}


def few_rows_linear_native(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x·weightᵀ by the native kernel (raises if `native()` is None): x [M, K] contiguous,
    weight [N, K] with contiguous rows, both float32 or both bfloat16; out [M, N], x's dtype.

    Each output is one float32 dot product in a fixed order whatever M is, so a row's result does
    not depend on the rows sharing the call; bf16 results are rounded once, to nearest even."""
    module = native()
    if module is None:
        raise RuntimeError("the native CPU kernel extension is not available")
    if out is None:
        out = x.new_empty(x.shape[0], weight.shape[0])
    return module.few_rows_linear(x, weight, out)


def few_rows_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same product in torch (the reference path)."""
    return torch.mm(x, weight.t(), out=out)


def supports_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` takes the native kernel for these tensors."""
    return (
        not x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= FEW_ROWS_MAX.get(x.dtype, 0)
        and weight.dtype == x.dtype
        and weight.layout == torch.strided
        and weight.stride(-1) == 1
        and x.is_contiguous()
    )


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`few_rows_linear_native` where it is loaded and takes these tensors, else None."""
    if supports_few_rows(x, weight) and native() is not None:
        return few_rows_linear_native(x, weight)
    return None


# A decoder layer's per-token ops (csrc/layer_ops.cpp): SGLang's torch versions of these are 5-20
# small torch ops each, whose dispatch, not arithmetic, costs 80-270 us per call at decode sizes;
# one native call costs a few. Each takes float32 or bfloat16 rows (2-D, the last dim contiguous)
# and rounds as its torch reference does; each returns None (or False) where the extension is not
# loaded or the tensors are not ones it takes, and the caller then runs the torch version.
LAYER_DTYPES = (torch.float32, torch.bfloat16)


def _takes_rows(*tensors: torch.Tensor) -> bool:
    return all(
        not t.is_cuda and t.dtype in LAYER_DTYPES and t.dim() == 2 and t.stride(-1) == 1
        for t in tensors
    )


def rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(out, residual_out): h = x (+ residual) in float32, residual_out = h in x's dtype, out =
    h / sqrt(mean(h²) + eps) times weight, rounded to x's dtype before the weight product when
    `cast_before_weight` (the weight then in x's dtype), after it otherwise. x [T, H]."""
    rows = (x,) if residual is None else (x, residual)
    if not _takes_rows(*rows) or weight.dtype not in LAYER_DTYPES or weight.dim() != 1:
        return None
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return None
    if cast_before_weight and weight.dtype != x.dtype:
        return None
    module = native()
    if module is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    module.rms_norm(x, residual, weight.contiguous(), eps, cast_before_weight, out, residual_out)
    return out, residual_out


def rms_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same in torch (the reference path)."""
    h = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else h.to(x.dtype)
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if cast_before_weight:
        return weight * normed.to(x.dtype), residual_out
    return (normed * weight).to(x.dtype), residual_out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    neox_style: bool,
) -> bool:
    """Rotates query [T, Hq * head_size] and key [T, Hk * head_size] in place: the first
    rotary_dim = cos_sin_cache.shape[1] dims of every head by cos_sin_cache[positions] (cos, then
    sin: rotary_dim / 2 each), neox style (dim i with i + rotary_dim / 2) or GPT-J style (2i
    with 2i + 1); each product and sum rounded to query's dtype. False where it did nothing."""
    if not _takes_rows(query, key, cos_sin_cache) or query.dtype != key.dtype:
        return False
    if positions.dtype != torch.int64 or positions.dim() != 1 or positions.is_cuda:
        return False
    module = native()
    if module is None:
        return False
    module.rotary_embedding(positions, query, key, cos_sin_cache, head_size, neox_style)
    return True


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    neox_style: bool,
) -> bool:
    """The same in torch (the reference path)."""
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions].to(query.dtype).split(half, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    for rows in (query, key):
        rotated = rows.view(rows.shape[0], -1, head_size)[..., : 2 * half]
        if neox_style:
            x1, x2 = rotated[..., :half].clone(), rotated[..., half:].clone()
            rotated[..., :half], rotated[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        else:
            x1, x2 = rotated[..., 0::2].clone(), rotated[..., 1::2].clone()
            rotated[..., 0::2], rotated[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :d]) * x[:, d:] for x [T, 2d], silu rounded to x's dtype before the product."""
    if not _takes_rows(x) or x.shape[-1] % 2:
        return None
    module = native()
    if module is None:
        return None
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    module.silu_and_mul(x, out)
    return out


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The same in torch (the reference path)."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """k_cache[loc] = k and v_cache[loc] = v: caches [slots, Hkv, D] (any strides, the last dim
    contiguous: the head-major pool's view), k and v [T, Hkv, D] in their cache's dtype. False
    where it did nothing."""
    tensors = (k_cache, v_cache, k, v)
    if any(t.is_cuda or t.dim() != 3 or t.stride(-1) != 1 for t in tensors):
        return False
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or loc.dtype != torch.int64:
        return False
    module = native()
    if module is None:
        return False
    module.store_kv(k_cache, v_cache, loc, k, v)
    return True


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """The same in torch (the reference path)."""
    k_cache[loc] = k
    v_cache[loc] = v
    return True


def _main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m magicdec_kernels.cpu_native build", file=sys.stderr)
        return 2
    start = time.perf_counter()
    module = build()
    seconds = time.perf_counter() - start
    print(f"{EXTENSION_NAME}: ready in {BUILD_DIR} ({module.best_isa()}, {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
