"""The one place every benchmark's floors come from: this machine's read bandwidth and GEMM peaks,
what a decode step of a model must read and compute, and the AR floor.

A step's floor is the larger of its bytes over the read bandwidth and its FLOPs over the GEMM
peak, both measured on this machine in the same run as the servers. A step reads every weight it
multiplies once: every tensor but an untied input embedding (a step reads one row of it per
token; a tied one is also the LM head, so it is read whole), and the KV of every position a row
attends to, for every request (requests sharing a prefix each read it). It computes 2 FLOPs per
weight per row and 4 per attended (row, key, head dim) per query head. The AR floor is the tok/s
of a decoder that only does that, one token per request per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmark.common import best_seconds

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
GEMM_SIZE = 2048


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s
    peak: dict[str, float]  # FLOP/s by dtype name

    def floor(self, read_bytes: float, flops: float, dtype: str) -> tuple[float, str]:
        """(seconds, what bounds them)."""
        read_s, compute_s = read_bytes / self.bandwidth, flops / self.peak[dtype]
        return (read_s, "bytes") if read_s >= compute_s else (compute_s, "FLOPs")

    def better(self, other: Machine) -> Machine:
        """The better of two measurements of each figure (a shared machine drifts)."""
        peak = {name: max(self.peak[name], other.peak[name]) for name in self.peak}
        return Machine(max(self.bandwidth, other.bandwidth), peak)


def read_bandwidth() -> float:
    """Bytes/s this machine reads: a torch sum over 1 GiB of float32 (every core), best of 5."""
    data = torch.ones(2**28)
    return data.numel() * data.element_size() / best_seconds(data.sum)


def measure_machine() -> Machine:
    """The read bandwidth and the GEMM peaks (torch.mm of 2048², oneDNN) in bf16 and float32.
    A bf16 product can always run as float32 on its widened operands (our kernels do so where
    the CPU has no bf16 products), so the bf16 peak is never taken below the float32 one: on
    such a CPU oneDNN's bf16 GEMM is emulated and several times slower, and a floor from it
    would be one our kernels beat (`benchmark/results/roofline/`)."""
    peak = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        a = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        peak[name] = 2 * GEMM_SIZE**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b))
    peak["bfloat16"] = max(peak["bfloat16"], peak["float32"])
    return Machine(read_bandwidth(), peak)


@dataclass(frozen=True)
class ModelShape:
    """What a decode step of a model reads and computes."""

    weights: int  # parameters a step reads (see the module's docstring)
    lm_head: int  # of which the LM head's (a tied embedding's)
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, folder: str | Path) -> ModelShape:
        """From a model folder's config.json and safetensors files."""
        from safetensors import safe_open

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        shapes = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as tensors:
                for name in tensors.keys():
                    shapes[name] = tensors.get_slice(name).get_shape()
        untied = any(name.endswith("lm_head.weight") for name in shapes)
        weights = sum(
            math.prod(shape)
            for name, shape in shapes.items()
            if not (untied and name.endswith("embed_tokens.weight"))
        )
        heads = config["num_attention_heads"]
        head_name = "lm_head.weight" if untied else "embed_tokens.weight"
        lm_head = next(
            math.prod(shape) for name, shape in shapes.items() if name.endswith(head_name)
        )
        return cls(
            weights=weights,
            lm_head=lm_head,
            layers=config["num_hidden_layers"],
            q_heads=heads,
            kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )

    def weight_bytes(self, dtype: str) -> int:
        return self.weights * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one position, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def attention_flops(self, row_keys: float) -> float:
        """FLOPs of attention summed over rows of the keys each attends to (all layers)."""
        return 4 * self.layers * self.q_heads * self.head_dim * row_keys


@dataclass(frozen=True)
class Floors:
    """A step's floor, whole and by part (seconds, what bounds them)."""

    step: tuple[float, str]
    linear: tuple[float, str]
    attention: tuple[float, str]


def step_floors(
    machine: Machine,
    model: ModelShape,
    dtype: str,
    rows: int,
    keys_read: float,
    row_keys: float,
    head_rows: int | None = None,
) -> Floors:
    """`rows` token rows through every weight, `head_rows` of them through the LM head (all by
    default; a prefill computes logits for each request's last row only); `keys_read` KV
    positions read or written (all requests); `row_keys` the sum over rows of the keys each
    attends to."""
    head_rows = rows if head_rows is None else head_rows
    weight_bytes = model.weight_bytes(dtype)
    linear_flops = 2 * (model.weights - model.lm_head) * rows + 2 * model.lm_head * head_rows
    kv_bytes = keys_read * model.kv_bytes_per_token(dtype)
    attention_flops = model.attention_flops(row_keys)
    return Floors(
        machine.floor(weight_bytes + kv_bytes, linear_flops + attention_flops, dtype),
        machine.floor(weight_bytes, linear_flops, dtype),
        machine.floor(kv_bytes, attention_flops, dtype),
    )


def read_seconds(model: ModelShape, dtype: str, keys_read: float, bandwidth: float) -> float:
    """Seconds a step takes to read the weights and `keys_read` KV positions at `bandwidth`."""
    step_bytes = model.weight_bytes(dtype) + keys_read * model.kv_bytes_per_token(dtype)
    return step_bytes / bandwidth


def ar_floor_tok_s(model: ModelShape, dtype: str, contexts: list[float], bandwidth: float) -> float:
    """tok/s of an autoregressive decoder whose step reads the weights and every request's KV
    (`contexts`: each request's mean context over the decode) at `bandwidth`."""
    return len(contexts) / read_seconds(model, dtype, sum(contexts), bandwidth)
