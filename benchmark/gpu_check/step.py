"""A decoder step at a model's shape, with the attention kernels of `attention.py`, timed.

Random weights; every layer does what a Llama layer's step costs in memory traffic: RMSNorm,
QKV projection, writing the new K/V into the pool, attention, output projection, gated MLP, then
the LM head. RoPE is left out (elementwise on a few rows). Weights are distinct per layer (a
small model's layer fits in L2, so reusing one would flatter the draft); KV buffers cycle over as
many layers as fit in memory, each far larger than any cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmark.gpu_check.attention import Attend

RMS_EPS = 1e-5


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

    def layer_weight_elements(self) -> int:
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.q_heads * self.head_dim * self.hidden + 3 * self.hidden * self.mlp

    def kv_layer_bytes(self, slots: int, element_size: int) -> int:
        return 2 * slots * self.kv_heads * self.head_dim * element_size


MODEL_SHAPES = {
    "llama8b": ModelShape("llama8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "smollm2": ModelShape("smollm2", 30, 576, 9, 3, 64, 1536, 49152),
}
# The same GQA groups (4 and 3) in miniature, for the CPU run.
TINY_SHAPES = {
    "llama8b": ModelShape("llama8b-tiny", 2, 64, 4, 1, 16, 128, 256),
    "smollm2": ModelShape("smollm2-tiny", 2, 48, 3, 1, 16, 96, 128),
}


class Decoder:
    def __init__(self, shape: ModelShape, kv_layers: int, slots: int, dtype, device):
        self.shape = shape

        def weight(*size: int) -> torch.Tensor:
            return (torch.randn(*size, device=device) * size[0] ** -0.5).to(dtype)

        qkv_width = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
        self.layers = [
            (
                weight(shape.hidden, qkv_width),
                weight(shape.q_heads * shape.head_dim, shape.hidden),
                weight(shape.hidden, 2 * shape.mlp),
                weight(shape.mlp, shape.hidden),
            )
            for _ in range(shape.layers)
        ]
        self.lm_head = weight(shape.hidden, shape.vocab)
        self.kv = [
            tuple(
                torch.randn(slots, shape.kv_heads, shape.head_dim, device=device).to(dtype)
                for _ in range(2)
            )
            for _ in range(kv_layers)
        ]

    def step(self, x: torch.Tensor, new_slots: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [rows, hidden], one row per new token -> logits [rows, vocab]."""
        shape = self.shape
        q_width, kv_width = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
        for layer, (w_qkv, w_o, w_gate_up, w_down) in enumerate(self.layers):
            k_buffer, v_buffer = self.kv[layer % len(self.kv)]
            q, k, v = (_rms_norm(x) @ w_qkv).split([q_width, kv_width, kv_width], dim=-1)
            k_buffer[new_slots] = k.view(-1, shape.kv_heads, shape.head_dim)
            v_buffer[new_slots] = v.view(-1, shape.kv_heads, shape.head_dim)
            attn = attend(layer, q.view(-1, shape.q_heads, shape.head_dim), k_buffer, v_buffer)
            x = x + attn.reshape(x.shape[0], -1) @ w_o
            gate, up = (_rms_norm(x) @ w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        return _rms_norm(x) @ self.lm_head


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + RMS_EPS).to(x.dtype)


@dataclass
class Timing:
    eager_ms: float
    graph_ms: float | None = None
    graph_error: str | None = None

    @property
    def ms(self) -> float:
        """Eager: MAGICDEC runs with CUDA graphs off today (README, "CPU and GPU")."""
        return self.eager_ms


def time_step(run: Callable[[], object], device: torch.device, iters: int) -> Timing:
    """Median ms per call: eager, and on CUDA also replayed as one CUDA graph (what the step
    would cost once MAGICDEC's steps are graphed)."""
    for _ in range(2):
        run()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        return Timing(statistics.median(times))
    timing = Timing(statistics.median(_cuda_times(run, iters)))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        timing.graph_ms = statistics.median(_cuda_times(graph.replay, iters))
    except Exception as error:  # the eager figure stands
        timing.graph_error = f"{type(error).__name__}: {error}"[:200]
    torch.cuda.synchronize()
    return timing


def _cuda_times(run: Callable[[], object], iters: int) -> list[float]:
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]
