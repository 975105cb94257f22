"""One-shot GPU check of the MagicDec kernels and of the step-time ratios its speedup rests on.

Made for a bare GPU machine that has only torch, triton and this repository (no sglang, no
flashinfer, no network) and runs it from the repository root in a few minutes:

    OUT=benchmark/results/gpu bash benchmark/gpu_check.sh          # or: python3 this file

1. Correctness: each Triton kernel of `magicdec_kernels` against its torch reference on CUDA
   (ragged lengths, GQA groups 1/4/8, bf16 and fp32 pools, a 32K-key SnapKV case and the
   16 x 544-slot draft shape), and the dense attention that times plain decode and verify against
   a float32 reference (it must apply the verify's causal mask bottom-right).
2. Step times of a minimal decoder with random bf16 weights at two model shapes (Llama-3.1-8B and
   SmolLM2-135M), batch 16 at 32K context: plain decode (dense attention over the whole
   context), draft decode (`sparse_decode_triton` over budget + 32 slots per KV head, the SnapKV
   draft) and verify (γ + 1 tokens over the whole context, causal among themselves).
3. What the times predict: Ω(γ, α)·T_decode / (γ·T_draft + T_verify(γ)), best γ in 1..6.

Writes $OUT/gpu_check.json and $OUT/gpu_check.md (default OUT: benchmark/results/gpu) and prints
the summary table last. Exits 1 if a correctness check failed or a model shape could not be
timed; a failed check does not stop the timing.

`--device cpu --tiny` runs the same code paths at toy sizes with the torch references, in seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
# Run as `python3 benchmark/gpu_check.py`, sys.path starts at benchmark/, not at the repo root.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from magicdec_kernels.snapkv_scores import snapkv_window_scores_torch  # noqa: E402
from magicdec_kernels.sparse_decode import sparse_decode_torch  # noqa: E402
from sglang_magicdec.cost_model import expected_tokens_per_round, round_time  # noqa: E402

# The SnapKV draft keeps the last 32 tokens of every request besides its `budget` chosen ones.
RECENT_WINDOW = 32
ALPHAS = (0.8, 0.84, 0.9)
RMS_EPS = 1e-5
# Activations, logits and CUDA-graph pools on top of weights and KV; generous on purpose.
MEMORY_HEADROOM_BYTES = 6 * 2**30
MIN_CONTEXT = 1024

# q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]. The T queries are the last T of the S positions, so
# query t sees keys 0 .. S - T + t (the verify's causal mask, aligned bottom-right).
DenseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# Called per layer with (layer index, q [N, Hq, D], new k [N, Hkv, D], new v); returns [N, Hq, D].
StepAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied_embeddings: bool

    def weight_bytes(self, element_size: int) -> int:
        attention = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        attention += self.q_heads * self.head_dim * self.hidden
        per_layer = attention + 3 * self.hidden * self.mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return element_size * (self.layers * per_layer + embeddings + self.hidden)

    def kv_bytes(self, slots: int, element_size: int) -> int:
        return element_size * 2 * self.layers * slots * self.kv_heads * self.head_dim


MODEL_SHAPES = {
    "llama8b": ModelShape("llama8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "smollm2": ModelShape("smollm2", 30, 576, 9, 3, 64, 1536, 49152, True),
}
# Same GQA structure in miniature (groups 4 and 3), for the CPU smoke run.
TINY_SHAPES = {
    "llama8b": ModelShape("llama8b-tiny", 2, 64, 4, 1, 16, 128, 256, False),
    "smollm2": ModelShape("smollm2-tiny", 2, 48, 3, 1, 16, 96, 128, True),
}


def predicted_speedup(
    gamma: int, alpha: float, t_decode: float, t_draft: float, t_verify: float
) -> float:
    """Tokens per second of speculation over plain decode: Ω·T_decode / (γ·T_draft + T_verify),
    with the server's own cost model (no second copy of Ω or the round time)."""
    tokens = expected_tokens_per_round(gamma, alpha)
    return tokens * t_decode / round_time(gamma, t_draft, t_verify)


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL, ERROR or SKIP
    max_abs_error: float | None = None
    tolerance: float | None = None
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "ERROR")


def compare(name: str, got: torch.Tensor, expected: torch.Tensor, rel_tol: float) -> CheckResult:
    """PASS when max |got - expected| <= rel_tol · max |expected| (outputs differ in scale)."""
    if got.shape != expected.shape:
        return CheckResult(name, "FAIL", detail=f"shape {tuple(got.shape)} != {expected.shape}")
    if expected.numel() == 0:
        return CheckResult(name, "PASS", 0.0, 0.0, "empty result")
    error = (got.float() - expected.float()).abs().max().item()
    tolerance = rel_tol * max(expected.float().abs().max().item(), 1e-6)
    # NaN compares false, so a NaN anywhere fails.
    status = "PASS" if error <= tolerance else "FAIL"
    return CheckResult(name, status, error, tolerance)


# Scores are float32 whatever the pool; the Triton kernel multiplies bf16 inputs exactly in fp32
# as the reference does, so only summation order differs.
SNAPKV_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-3}
# The bf16 output is rounded to bf16 (2^-8 relative) by both sides, possibly a step apart.
SPARSE_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DENSE_REL_TOL = 2e-2

# (prompt length L, window W, q heads, KV heads, head dim, pool dtype)
SNAPKV_CHECKS = [
    (1000, 32, 8, 8, 128, torch.float32),  # group 1, fp32 pool
    (777, 16, 32, 8, 128, torch.bfloat16),  # group 4, ragged L
    (3001, 32, 64, 8, 64, torch.bfloat16),  # group 8
    (32768, 32, 32, 8, 128, torch.bfloat16),  # long prompt, Llama-3.1-8B heads
]
# (slots per request, q heads, KV heads, head dim, pool dtype)
SPARSE_CHECKS = [
    ([0, 1, 37, 300, 5], 8, 8, 128, torch.float32),  # group 1, an empty request
    ([64, 1, 0, 33, 1000], 32, 8, 128, torch.bfloat16),  # group 4, ragged
    ([17, 900, 2], 64, 8, 64, torch.bfloat16),  # group 8
    ([512 + RECENT_WINDOW] * 16, 32, 8, 128, torch.bfloat16),  # the draft step at batch 16
]


def snapkv_check_name(
    seq_len: int, window: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str:
    return (
        f"snapkv L={seq_len} W={window} Hq={q_heads} Hkv={kv_heads} D={head_dim} "
        f"{str(dtype).removeprefix('torch.')}"
    )


def check_snapkv(
    seq_len: int,
    window: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CheckResult:
    from magicdec_kernels.snapkv_scores_triton import snapkv_window_scores_triton

    gen = torch.Generator(device=device).manual_seed(seq_len)
    pool_slots = 2 * seq_len + 11
    k_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    # The prompt's slots lie scattered over the pool, as after other requests came and went.
    key_slots = torch.randperm(pool_slots, generator=gen, device=device)[:seq_len]
    q_window = torch.randn(window, q_heads, head_dim, generator=gen, device=device).to(dtype)
    scale = head_dim**-0.5
    expected = snapkv_window_scores_torch(q_window, k_cache, key_slots, scale)
    got = snapkv_window_scores_triton(q_window, k_cache, key_slots, scale)
    name = snapkv_check_name(seq_len, window, q_heads, kv_heads, head_dim, dtype)
    return compare(name, got, expected, SNAPKV_REL_TOL[dtype])


def sparse_check_name(
    lengths: list[int], q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str:
    shown = lengths if len(set(lengths)) > 1 else f"{len(lengths)}x{lengths[0]}"
    return (
        f"sparse_decode slots={shown} Hq={q_heads} Hkv={kv_heads} D={head_dim} "
        f"{str(dtype).removeprefix('torch.')}"
    )


def check_sparse_decode(
    lengths: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CheckResult:
    from magicdec_kernels.sparse_decode_triton import sparse_decode_triton

    gen = torch.Generator(device=device).manual_seed(sum(lengths) + q_heads)
    total = sum(lengths)
    pool_slots = max(4096, 2 * total)
    k_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    q = torch.randn(len(lengths), q_heads, head_dim, generator=gen, device=device).to(dtype)
    kv_lens = torch.tensor(lengths, device=device)
    head_slots = torch.randint(
        pool_slots,
        (len(lengths), kv_heads, max(lengths) + 1),
        generator=gen,
        device=device,
        dtype=torch.int64,
    )
    scale = head_dim**-0.5
    expected = sparse_decode_torch(q, k_cache, v_cache, head_slots, kv_lens, scale)
    got = sparse_decode_triton(q, k_cache, v_cache, head_slots, kv_lens, scale)
    name = sparse_check_name(lengths, q_heads, kv_heads, head_dim, dtype)
    return compare(name, got, expected, SPARSE_REL_TOL[dtype])


def run_kernel_checks(device: torch.device) -> list[CheckResult]:
    """Each Triton kernel against its torch reference; every case runs even if one fails."""
    cases = [(check_snapkv, snapkv_check_name, case) for case in SNAPKV_CHECKS]
    cases += [(check_sparse_decode, sparse_check_name, case) for case in SPARSE_CHECKS]
    if device.type != "cuda":
        reason = "skipped: Triton kernels need CUDA; this run uses the torch references only"
        return [CheckResult(name(*case), "SKIP", detail=reason) for _, name, case in cases]
    results = []
    for check, name, case in cases:
        try:
            result = check(*case, device)
        except Exception as error:  # every check must get its turn
            result = CheckResult(name(*case), "ERROR", detail=describe(error))
        print(format_check(result), flush=True)
        results.append(result)
    return results


def describe(error: BaseException) -> str:
    """Type and first line of an error (torch's dispatch errors run to dozens of lines)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def format_check(result: CheckResult) -> str:
    if result.max_abs_error is None:
        return f"[{result.status}] {result.name}: {result.detail}"
    return (
        f"[{result.status}] {result.name}: max abs error {result.max_abs_error:.3e} "
        f"(tolerance {result.tolerance:.3e})"
    )


# ---------------------------------------------------------------------------------------------
# Dense attention for plain decode and verify
# ---------------------------------------------------------------------------------------------


def lower_right_causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """True where query t (the (keys - queries + t)-th position) may see the key."""
    last_visible = keys - queries + torch.arange(queries, device=device)
    return torch.arange(keys, device=device)[None, :] <= last_visible[:, None]


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Float32 softmax attention with the bottom-right causal mask; the other paths' yardstick."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)).mul_(scale)
    visible = lower_right_causal_mask(q.shape[2], k.shape[2], q.device)
    scores.masked_fill_(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).to(q.dtype)


def sdpa_flash_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unmasked SDPA pinned to FlashAttention (decode: one query, nothing to mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def sdpa_default_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unmasked SDPA, backend left to torch (decode only)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def aten_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """FlashAttention-2 through its aten op, which takes GQA heads as they are.

    With fewer queries than keys FA2 aligns its causal mask bottom-right, the verify mask; public
    SDPA's is_causal means top-left and so refuses flash for such shapes. The probe below checks
    the alignment against the reference before this is used.
    """
    causal = q.shape[2] > 1
    op = torch.ops.aten._scaled_dot_product_flash_attention
    return op(q, k, v, 0.0, causal, False, scale=scale)[0]


def sdpa_causal_lower_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_bool_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    mask = lower_right_causal_mask(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


# Fastest honest dense baseline first. SGLang would run FlashInfer or FA3 here; torch's FA2 (with
# its split-KV decode path) over the contiguous per-request pool is the closest stand-in on a
# machine without them. The float32 reference is the last resort and is flagged in the output.
DECODE_CANDIDATES: list[tuple[str, DenseAttention]] = [
    ("sdpa[flash]", sdpa_flash_backend),
    ("aten flash op", aten_flash_attention),
    ("sdpa[default]", sdpa_default_backend),
    ("float32 reference", attention_reference),
]
VERIFY_CANDIDATES: list[tuple[str, DenseAttention]] = [
    ("aten flash op, causal bottom-right", aten_flash_attention),
    ("sdpa + causal_lower_right", sdpa_causal_lower_right),
    ("sdpa + bool mask", sdpa_bool_mask),
    ("float32 reference", attention_reference),
]


def fused_queries(
    shape: ModelShape, batch: int, tokens: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Random q [B, Hq, T, D] laid out as in the model: sliced from a fused QKV output."""
    width = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    fused = torch.randn(batch * tokens, width, device=device).to(dtype)
    q = fused[:, : shape.q_heads * shape.head_dim]
    return q.view(batch, tokens, shape.q_heads, shape.head_dim).transpose(1, 2)


@dataclass
class DenseChoice:
    name: str
    attend: DenseAttention
    probes: list[CheckResult]
    # Candidate -> median ms of one layer's attention at the timed shape (the choice is fastest).
    layer_ms: dict[str, float] = field(default_factory=dict)


def choose_dense_attention(
    candidates: list[tuple[str, DenseAttention]],
    shape: ModelShape,
    pool: KVPool,
    queries: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DenseChoice:
    """The fastest candidate, at the timed shape, of those that match the reference.

    Correctness is probed on a small problem in the timing's memory layout (q sliced out of a
    fused QKV output, K and V as strided per-request views of a slot pool); speed on layer 0 of
    the real pool. The float32 reference competes only if nothing else matched.
    """
    batch, context = 3, 333
    small = KVPool(replace(shape, layers=1), batch, context, queries + 5, device, dtype)
    length = context + queries
    k, v = small.dense(small.k[0], length), small.dense(small.v[0], length)
    q = fused_queries(shape, batch, queries, device, dtype)
    scale = shape.head_dim**-0.5
    expected = attention_reference(q, k, v, scale)
    probes, matching = [], []
    for name, attend in candidates:
        label = (
            f"dense T={queries} [{name}] Hq={shape.q_heads} Hkv={shape.kv_heads} D={shape.head_dim}"
        )
        try:
            result = compare(label, attend(q, k, v, scale), expected, DENSE_REL_TOL)
        except Exception as error:  # an unsupported path just falls through
            result = CheckResult(label, "SKIP", detail=f"unusable: {describe(error)}")
        if result.status == "FAIL":
            # A wrong mask alignment is a reason to pass this path over, not a kernel failure.
            result.status, result.detail = "SKIP", "rejected: does not match the reference"
        probes.append(result)
        print(format_check(result), flush=True)
        if result.status == "PASS":
            matching.append((name, attend))
    del small, k, v
    fast = [(n, a) for n, a in matching if a is not attention_reference] or matching
    if not fast:
        raise RuntimeError(f"no dense attention path for T={queries} matched the reference")
    length = pool.context + queries
    k, v = pool.dense(pool.k[0], length), pool.dense(pool.v[0], length)
    q = fused_queries(shape, pool.batch, queries, device, dtype)
    layer_ms = {}
    for name, attend in fast:
        try:
            layer_ms[name] = time_step(lambda a=attend: a(q, k, v, scale), device, 2, 10, False).ms
        except Exception as error:  # e.g. out of memory in a math fallback
            print(f"dense T={queries} [{name}] at full shape: {describe(error)}")
    if not layer_ms:
        raise RuntimeError(f"no dense attention path for T={queries} ran at the timed shape")
    best = min(layer_ms, key=layer_ms.__getitem__)
    print(
        f"dense T={queries}: one layer takes "
        + ", ".join(f"{n} {ms:.3f} ms" for n, ms in layer_ms.items())
        + f"; timing with {best}",
        flush=True,
    )
    return DenseChoice(best, dict(fast)[best], probes, layer_ms)


# ---------------------------------------------------------------------------------------------
# Model, KV pool and steps
# ---------------------------------------------------------------------------------------------


class KVPool:
    """Per-layer K and V pools of random values.

    Request b owns slots b·stride .. b·stride + stride - 1: its `context` tokens first, then room
    for the step's new tokens. Contiguous per request, so the dense baseline reads each request's
    keys as a strided [B, Hkv, S, D] view without gathering, while the draft reads the same pool
    through slot lists as SGLang's paged pool would be read.
    """

    def __init__(
        self,
        shape: ModelShape,
        batch: int,
        context: int,
        new_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.batch, self.context, self.stride = batch, context, context + new_tokens
        self.kv_heads, self.head_dim = shape.kv_heads, shape.head_dim
        slots = batch * self.stride
        # One pair per layer, as in a real model: no layer reads another layer's (cached) lines.
        self.k = [self._random(slots, device, dtype) for _ in range(shape.layers)]
        self.v = [self._random(slots, device, dtype) for _ in range(shape.layers)]

    def _random(self, slots: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(
            slots, self.kv_heads, self.head_dim, device=device, dtype=dtype
        ).normal_()

    def dense(self, cache: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` positions of every request: [B, Hkv, length, D], a view."""
        view = cache.view(self.batch, self.stride, self.kv_heads, self.head_dim)
        return view[:, :length].transpose(1, 2)

    def new_token_slots(self, tokens: int, device: torch.device) -> torch.Tensor:
        """Slots of `tokens` new tokens per request right after its context, request-major."""
        starts = torch.arange(self.batch, device=device) * self.stride + self.context
        return (starts[:, None] + torch.arange(tokens, device=device)[None, :]).flatten()


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2·Hkv)·D, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2·mlp, hidden]
    down: torch.Tensor


class DummyDecoder:
    """A Llama-style decoder with random weights: RMSNorm, fused QKV, attention, O, SwiGLU.

    No RoPE: positions do not change the cost of a step, only its values.
    """

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape

        def weight(rows: int, cols: int) -> torch.Tensor:
            # Fan-in scaling keeps the residual stream finite through the layers.
            return torch.empty(rows, cols, device=device, dtype=dtype).normal_(std=cols**-0.5)

        def norm() -> torch.Tensor:
            return torch.ones(shape.hidden, device=device, dtype=dtype)

        qkv_rows = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
        self.layers = [
            LayerWeights(
                input_norm=norm(),
                qkv=weight(qkv_rows, shape.hidden),
                o=weight(shape.hidden, shape.q_heads * shape.head_dim),
                post_norm=norm(),
                gate_up=weight(2 * shape.mlp, shape.hidden),
                down=weight(shape.hidden, shape.mlp),
            )
            for _ in range(shape.layers)
        ]
        self.embed = weight(shape.vocab, shape.hidden)
        self.lm_head = self.embed if shape.tied_embeddings else weight(shape.vocab, shape.hidden)
        self.final_norm = norm()

    def forward(self, tokens: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """Logits [N, vocab] of N request-major tokens."""
        s = self.shape
        q_width, kv_width = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        x = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), layer.input_norm, RMS_EPS)
            q, k, v = F.linear(h, layer.qkv).split([q_width, kv_width, kv_width], dim=-1)
            attended = attention(
                index,
                q.unflatten(-1, (s.q_heads, s.head_dim)),
                k.unflatten(-1, (s.kv_heads, s.head_dim)),
                v.unflatten(-1, (s.kv_heads, s.head_dim)),
            )
            x = x + F.linear(attended.flatten(1), layer.o)
            h = F.rms_norm(x, (s.hidden,), layer.post_norm, RMS_EPS)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(F.rms_norm(x, (s.hidden,), self.final_norm, RMS_EPS), self.lm_head)


def dense_step_attention(
    pool: KVPool, tokens: int, dense: DenseAttention, scale: float, device: torch.device
) -> StepAttention:
    """Plain decode (tokens = 1) or verify (tokens = γ + 1): write the new K/V after the context,
    then attend over context + new tokens, causal among the new ones."""
    new_slots = pool.new_token_slots(tokens, device)
    length = pool.context + tokens

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool.k[layer].index_copy_(0, new_slots, k)
        pool.v[layer].index_copy_(0, new_slots, v)
        heads, head_dim = q.shape[1], q.shape[2]
        queries = q.view(pool.batch, tokens, heads, head_dim).transpose(1, 2)
        out = dense(
            queries, pool.dense(pool.k[layer], length), pool.dense(pool.v[layer], length), scale
        )
        return out.transpose(1, 2).reshape(pool.batch * tokens, heads, head_dim)

    return attend


def draft_slot_lists(
    pool: KVPool, budget: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """head_slots [B, Hkv, budget + 32] and kv_lens [B] of a SnapKV draft.

    Each (request, KV head) keeps `budget` prefix positions of its own, random and sorted (the
    pool order a real selection is read in), plus the last 32 positions, the step's own token
    included. One selection serves every layer: each layer reads its own pool, so nothing is
    shared in cache between layers anyway.
    """
    batch, kv_heads, context = pool.batch, pool.kv_heads, pool.context
    per_head = budget + RECENT_WINDOW
    prefix = context + 1 - RECENT_WINDOW
    chosen = torch.rand(batch, kv_heads, prefix, device=device).topk(budget, dim=-1).indices
    recent = torch.arange(prefix, context + 1, device=device).expand(batch, kv_heads, -1)
    positions = torch.cat([chosen.sort(dim=-1).values, recent], dim=-1)
    slots = positions + (torch.arange(batch, device=device) * pool.stride)[:, None, None]
    kv_lens = torch.full((batch,), per_head, device=device, dtype=torch.int64)
    return slots, kv_lens


def draft_step_attention(
    pool: KVPool, budget: int, scale: float, device: torch.device
) -> StepAttention:
    """Draft decode: write the new K/V, then attend over each KV head's budget + 32 slots."""
    new_slots = pool.new_token_slots(1, device)
    head_slots, kv_lens = draft_slot_lists(pool, budget, device)
    if device.type == "cuda":
        from magicdec_kernels.sparse_decode_triton import sparse_decode_triton as sparse_decode
    else:
        sparse_decode = sparse_decode_torch  # Triton needs CUDA

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool.k[layer].index_copy_(0, new_slots, k)
        pool.v[layer].index_copy_(0, new_slots, v)
        return sparse_decode(q, pool.k[layer], pool.v[layer], head_slots, kv_lens, scale)

    return attend


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class StepTiming:
    ms: float  # the figure the ratios use: CUDA graph if it captured, else eager
    mode: str
    eager_ms: float
    graph_ms: float | None = None
    graph_error: str | None = None
    eager_min_ms: float = 0.0
    eager_max_ms: float = 0.0
    iterations: int = 0


def _cuda_event_times(run: Callable[[], object], iters: int) -> list[float]:
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def time_step(
    run: Callable[[], object], device: torch.device, warmup: int, iters: int, use_graph: bool
) -> StepTiming:
    """Median step time in ms: eager always, and replayed as one CUDA graph on CUDA.

    SGLang decodes under CUDA graphs, so the graph figure is the one that counts; eager shows how
    much Python launch overhead a small model would add without them.
    """
    if device.type != "cuda":
        for _ in range(warmup):
            run()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        eager = statistics.median(times)
        return StepTiming(
            ms=eager,
            mode="cpu perf_counter",
            eager_ms=eager,
            eager_min_ms=min(times),
            eager_max_ms=max(times),
            iterations=iters,
        )

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    eager_times = _cuda_event_times(run, iters)
    eager = statistics.median(eager_times)
    timing = StepTiming(
        ms=eager,
        mode="eager",
        eager_ms=eager,
        eager_min_ms=min(eager_times),
        eager_max_ms=max(eager_times),
        iterations=iters,
    )
    if not use_graph:
        return timing
    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        timing.graph_ms = statistics.median(_cuda_event_times(graph.replay, iters))
        timing.ms, timing.mode = timing.graph_ms, "cuda graph"
    except Exception as error:  # eager timing stands
        timing.graph_error = describe(error)
        torch.cuda.synchronize()
    finally:
        del graph
    return timing


def fit_context(
    shape: ModelShape,
    batch: int,
    context: int,
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[int, str | None]:
    """`context`, halved until weights, KV and headroom fit in free GPU memory."""
    if device.type != "cuda":
        return context, None
    free, _ = torch.cuda.mem_get_info(device)
    element = torch.empty((), dtype=dtype).element_size()

    def need(length: int) -> int:
        kv = shape.kv_bytes(batch * (length + new_tokens), element)
        return shape.weight_bytes(element) + kv + MEMORY_HEADROOM_BYTES

    fitted = context
    while need(fitted) > free and fitted // 2 >= MIN_CONTEXT:
        fitted //= 2
    if fitted == context:
        return context, None
    return fitted, (
        f"context {context} needs {need(context) / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free: "
        f"timed at {fitted}"
    )


def time_model_shape(
    shape: ModelShape, args: argparse.Namespace, device: torch.device, deadline: float
) -> dict:
    """Decode, draft and verify(γ) step times of one model shape, their ratios and speedups."""
    dtype = torch.bfloat16
    gammas = sorted(set(range(1, args.max_gamma + 1)) | {args.gamma})
    new_tokens = max(gammas) + 1
    context, note = fit_context(shape, args.batch, args.context, new_tokens, device, dtype)
    if args.budget + RECENT_WINDOW > context:
        raise ValueError(f"budget {args.budget} + {RECENT_WINDOW} recent exceeds context {context}")
    notes = [note] if note else []
    started = time.perf_counter()
    model = DummyDecoder(shape, device, dtype)
    pool = KVPool(shape, args.batch, context, new_tokens, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{shape.name}: weights and KV pool ready in {time.perf_counter() - started:.1f} s")

    if device.type == "cuda":
        decode = choose_dense_attention(DECODE_CANDIDATES, shape, pool, 1, device, dtype)
        verify_tokens = args.gamma + 1
        verify = choose_dense_attention(
            VERIFY_CANDIDATES, shape, pool, verify_tokens, device, dtype
        )
    else:
        skipped = CheckResult("dense", "SKIP", detail="CPU run: the float32 reference is used")
        decode = verify = DenseChoice("float32 reference", attention_reference, [skipped])
    if device.type == "cuda" and attention_reference in (decode.attend, verify.attend):
        notes.append("dense attention fell back to the float32 reference: T_decode is inflated")
    scale = shape.head_dim**-0.5
    tokens = torch.randint(shape.vocab, (args.batch * new_tokens,), device=device)

    def step(count: int, attention: StepAttention) -> Callable[[], torch.Tensor]:
        step_tokens = tokens[: args.batch * count]
        return lambda: model.forward(step_tokens, attention)

    draft_attention = draft_step_attention(pool, args.budget, scale, device)
    plan: list[tuple[str, int | None, Callable[[], torch.Tensor]]] = [
        ("decode", None, step(1, dense_step_attention(pool, 1, decode.attend, scale, device))),
        ("draft", None, step(1, draft_attention)),
    ]
    for gamma in gammas:
        attention = dense_step_attention(pool, gamma + 1, verify.attend, scale, device)
        plan.append(("verify", gamma, step(gamma + 1, attention)))

    use_graph = device.type == "cuda" and not args.no_cuda_graph
    timings: dict[str, dict] = {"verify": {}}
    for kind, gamma, run in plan:
        if gamma is not None and gamma != args.gamma and time.monotonic() > deadline:
            notes.append(f"verify γ={gamma} skipped: past the time budget")
            continue
        timing = time_step(run, device, args.warmup, args.iters, use_graph)
        label = kind if gamma is None else f"verify γ={gamma}"
        extra = f" (eager {timing.eager_ms:.3f} ms)" if timing.graph_ms is not None else ""
        print(f"{shape.name} {label}: {timing.ms:.3f} ms [{timing.mode}]{extra}", flush=True)
        if timing.graph_error:
            print(f"  CUDA graph failed, eager kept: {timing.graph_error}")
        if gamma is None:
            timings[kind] = asdict(timing)
        else:
            timings["verify"][str(gamma)] = asdict(timing)

    every_step = [timings["decode"], timings["draft"], *timings["verify"].values()]
    if any(t["graph_ms"] is None for t in every_step) and use_graph:
        # Ratios must compare like with like: if one step would not capture, all count eager.
        notes.append("a step did not capture as a CUDA graph: every ratio uses eager times")
        for t in every_step:
            t["ms"], t["mode"] = t["eager_ms"], "eager"

    # One layer's draft attention alone, next to the dense layer times of the choice above.
    q = fused_queries(shape, args.batch, 1, device, dtype)[:, :, 0]
    k_new = torch.zeros(args.batch, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    draft_layer_ms = time_step(lambda: draft_attention(0, q, k_new, k_new), device, 2, 10, False).ms

    t_decode, t_draft = timings["decode"]["ms"], timings["draft"]["ms"]
    t_verify = {int(g): t["ms"] for g, t in timings["verify"].items()}
    speedups: dict[str, dict] = {}
    for alpha in ALPHAS:
        per_gamma = {
            g: predicted_speedup(g, alpha, t_decode, t_draft, t) for g, t in t_verify.items()
        }
        in_range = {g: x for g, x in per_gamma.items() if g <= args.max_gamma} or per_gamma
        best = max(in_range, key=in_range.__getitem__)
        speedups[str(alpha)] = {
            "best_gamma": best,
            "speedup": per_gamma[best],
            "speedup_at_gamma": per_gamma.get(args.gamma),
            "per_gamma": {str(g): x for g, x in per_gamma.items()},
        }
    return {
        "model": asdict(shape),
        "batch": args.batch,
        "context_requested": args.context,
        "context": context,
        "budget": args.budget,
        "draft_slots_per_head": args.budget + RECENT_WINDOW,
        "gamma": args.gamma,
        "dense_attention": {"decode": decode.name, "verify": verify.name},
        "attention_layer_ms": {
            "decode": decode.layer_ms,
            f"verify γ={args.gamma}": verify.layer_ms,
            "draft (sparse_decode)": draft_layer_ms,
        },
        "dense_attention_probes": [asdict(p) for p in decode.probes + verify.probes],
        "memory_gib": {
            "weights": shape.weight_bytes(2) / 2**30,
            "kv_pool": shape.kv_bytes(args.batch * pool.stride, 2) / 2**30,
        },
        "timings": timings,
        "ratios": {
            "draft_over_decode": t_draft / t_decode,
            "verify_over_decode": {str(g): t / t_decode for g, t in t_verify.items()},
        },
        "predicted_speedup": speedups,
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def markdown_report(results: dict) -> str:
    """Correctness line, per-γ detail and notes, then the summary table (printed last)."""
    checks = [CheckResult(**c) for c in results["correctness"]]
    statuses = ("PASS", "FAIL", "ERROR", "SKIP")
    counts = {status: sum(c.status == status for c in checks) for status in statuses}
    env = results["environment"]
    lines = [
        f"# MagicDec GPU check: {env['device_name']}, torch {env['torch']}, triton {env['triton']}",
        "",
        "Correctness (Triton vs torch): "
        + ", ".join(f"{n} {status}" for status, n in counts.items() if n),
    ]
    lines += [f"- {c.status}: {c.name} {c.detail}".rstrip() for c in checks if c.failed]
    alpha_heads = " | ".join(f"α={a}" for a in ALPHAS)
    lines += [
        "",
        "Verify cost and predicted speedup per γ:",
        "",
        f"| shape | γ | T_verify ms | verify/decode | {alpha_heads} |",
        "|---|---|---|---|" + "---|" * len(ALPHAS),
    ]
    timed = {name: shape for name, shape in results["shapes"].items() if "error" not in shape}
    for name, shape in timed.items():
        for gamma, ratio in shape["ratios"]["verify_over_decode"].items():
            cells = " | ".join(
                f"{shape['predicted_speedup'][str(a)]['per_gamma'][gamma]:.2f}×" for a in ALPHAS
            )
            t_verify = shape["timings"]["verify"][gamma]["ms"]
            lines.append(f"| {name} | {gamma} | {t_verify:.3f} | {ratio:.3f} | {cells} |")
    lines.append("")
    for name, shape in results["shapes"].items():
        if "error" in shape:
            lines.append(f"- {name}: FAILED: {shape['error']}")
            continue
        dense = shape["dense_attention"]
        lines.append(
            f"- {name}: dense attention: decode {dense['decode']}, verify {dense['verify']}"
        )
        lines += [f"- {name}: {note}" for note in shape["notes"]]
    best_heads = " | ".join(f"best α={a}" for a in ALPHAS)
    lines += [
        "",
        f"| shape | batch×context | draft slots/head | timing | T_decode ms | T_draft ms | "
        f"draft/decode | verify/decode (γ) | {best_heads} |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS),
    ]
    for name, shape in results["shapes"].items():
        if "error" in shape:
            lines.append(f"| {name} | failed |" + " |" * (6 + len(ALPHAS)))
            continue
        timings, ratios, predicted = shape["timings"], shape["ratios"], shape["predicted_speedup"]
        gamma = str(shape["gamma"])
        best = " | ".join(
            f"{predicted[str(a)]['speedup']:.2f}× @γ={predicted[str(a)]['best_gamma']}"
            for a in ALPHAS
        )
        lines.append(
            f"| {name} | {shape['batch']}×{shape['context']} | {shape['draft_slots_per_head']} | "
            f"{timings['decode']['mode']} | {timings['decode']['ms']:.3f} | "
            f"{timings['draft']['ms']:.3f} | {ratios['draft_over_decode']:.3f} | "
            f"{ratios['verify_over_decode'][gamma]:.3f} ({gamma}) | {best} |"
        )
    return "\n".join(lines) + "\n"


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
        )
    return env


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy shapes for a CPU smoke run")
    parser.add_argument("--context", type=int, help="tokens per request (default 32768; tiny 256)")
    parser.add_argument("--batch", type=int, help="requests (default 16; tiny 2)")
    parser.add_argument("--budget", type=int, help="draft's chosen slots/head (512; tiny 32)")
    parser.add_argument("--gamma", type=int, default=4, help="the γ the summary reports")
    parser.add_argument("--max-gamma", type=int, default=6, help="time verify for γ = 1..this")
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(MODEL_SHAPES), default=["llama8b", "smollm2"]
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="time eager only")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=360.0,
        help="past this, verify is timed only at --gamma (the machine allows about 8 minutes)",
    )
    parser.add_argument("--skip-kernel-checks", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    defaults = (
        {"context": 256, "batch": 2, "budget": 32}
        if args.tiny
        else {"context": 32768, "batch": 16, "budget": 512}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.iters < 10:
        parser.error("--iters must be at least 10 (the median of fewer is too noisy)")
    if args.gamma < 1 or args.max_gamma < 1:
        parser.error("γ must be at least 1")
    return args


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out_dir = Path(os.environ.get("OUT") or REPO_ROOT / "benchmark" / "results" / "gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here; use --device cpu --tiny for a smoke run")
        return 2
    if device.type == "cpu":
        # Toy-sized ops gain nothing from threads, and on a busy machine every intra-op barrier
        # can wait a scheduler slice (~100 ms a step was seen with the default two threads).
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    shapes = TINY_SHAPES if args.tiny else MODEL_SHAPES
    results: dict = {
        "environment": environment(device),
        "args": vars(args),
        "correctness": [],
        "shapes": {},
    }
    timing_failed = False
    with torch.inference_mode():
        if args.skip_kernel_checks:
            checks = [CheckResult("kernel checks", "SKIP", detail="--skip-kernel-checks")]
        else:
            checks = run_kernel_checks(device)
        for check in checks:
            if check.status == "SKIP":
                print(format_check(check))
        release_memory(device)
        for key in args.shapes:
            shape = shapes[key]
            try:
                results["shapes"][shape.name] = time_model_shape(
                    shape, args, device, started + args.time_budget_s
                )
            except Exception as error:  # the other shape still gets timed
                timing_failed = True
                print(f"{shape.name}: FAILED\n{traceback.format_exc()}", flush=True)
                results["shapes"][shape.name] = {"error": describe(error)}
            # The 8B model and its ~69 GB pool must be gone before the next shape allocates.
            release_memory(device)
    results["correctness"] = [asdict(c) for c in checks]
    results["failed"] = any(c.failed for c in checks) or timing_failed
    results["elapsed_s"] = time.monotonic() - started
    report = markdown_report(results)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out_dir / "gpu_check.md").write_text(report)
    print(
        f"\nwrote {out_dir / 'gpu_check.json'} and gpu_check.md in {results['elapsed_s']:.0f} s\n"
    )
    print(report, end="", flush=True)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
