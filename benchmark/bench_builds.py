"""The native kernels of this tree against those of another git revision, both builds loaded in
one process and timed in alternation (a shared machine drifts by tens of percent within minutes,
so only ratios taken side by side mean anything), with every output compared bit for bit.

    .venv/bin/python -m benchmark.bench_builds --ref HEAD          # uncommitted changes
    .venv/bin/python -m benchmark.bench_builds --ref 10b5873 --isa avx2

Per step of SmolLM2's shape (30 layers: hidden 576, 9 query and 3 KV heads of 64, MLP 1,536,
an LM head of 49,152 rows), at each row count (8: a decode or draft step at batch 8; 32: a γ = 3
verify):
- the linear layers and the LM head (`few_rows_linear`, every layer's own weights, so the
  weights stream from memory as a step's do), float32 and bfloat16, against the bytes floor at
  the read bandwidth measured in the same run;
- the per-token ops of the 30 layers: two `rms_norm`, one `rotary_embedding`, one `silu_and_mul`.

The reference's sources (`magicdec_kernels/csrc` at REF) are built once into a temporary folder
(a minute or two). Prints the median of `--repeats` alternating runs of each.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tarfile
import tempfile
import time
from functools import partial
from io import BytesIO
from pathlib import Path
from types import ModuleType

import torch

from benchmark.floors import read_bandwidth
from magicdec_kernels import cpu_native
from magicdec_kernels.loader import build, native

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def build_ref(rev: str, folder: Path) -> ModuleType:
    """The kernels of `rev`, built as this tree's are (`loader.build`) under another name."""
    archive = subprocess.run(
        ["git", "archive", rev, "magicdec_kernels/csrc"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return build(
        csrc=folder / "magicdec_kernels/csrc", build_dir=folder, name="magicdec_ref_kernels"
    )


def linear_step(module: ModuleType, isa: str, weights, packed, rows_in, outs) -> None:
    for weight, panels, out in zip(weights, packed, outs, strict=True):
        module.few_rows_linear(rows_in[weight.shape[1]], panels, weight.shape[0], out, isa)


def layer_ops_step(module: ModuleType, isa: str, tensors: dict) -> None:
    t = tensors
    for _ in range(LAYERS):
        module.rms_norm(t["x"], t["res"], t["w"], 1e-5, False, t["out"], t["res_out"], isa)
        module.rotary_embedding(t["pos"], t["q"], t["k"], t["cache"], HEAD_DIM, True, isa)
        module.silu_and_mul(t["gate_up"], t["act"], isa)
        module.rms_norm(t["x"], t["res"], t["w"], 1e-5, False, t["out"], t["res_out"], isa)


def alternate(run_new, run_ref, repeats: int) -> tuple[float, float]:
    """Median seconds of each, run in alternation (which goes first alternates too)."""
    seconds = {"new": [], "ref": []}
    runs = {"new": run_new, "ref": run_ref}
    for repeat in range(repeats):
        for name in ("new", "ref") if repeat % 2 else ("ref", "new"):
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return statistics.median(seconds["new"]), statistics.median(seconds["ref"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ref", required=True, help="the git revision to compare against")
    parser.add_argument("--isa", default=None, help="instruction set (default: the best here)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    new = native()
    assert new is not None, "the native kernels of this tree did not build or load"
    isa = args.isa or new.best_isa()
    with tempfile.TemporaryDirectory() as folder:
        ref = build_ref(args.ref, Path(folder))
    generator = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    weights32 = [torch.randn(s, generator=generator) for _ in range(LAYERS) for s in shapes]
    weights32.append(torch.randn(VOCAB, HIDDEN, generator=generator))
    bandwidth = read_bandwidth()
    print(f"isa {isa}, reference {args.ref}, read {bandwidth / 1e9:.1f} GB/s, ", end="")
    print(f"median of {args.repeats}")
    print("| part | dtype | rows | ref ms | new ms | new / ref | floor ms | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [w.to(dtype) for w in weights32]
        packed = [cpu_native.pack_rows(w) for w in weights]
        floor_ms = sum(w.numel() * w.element_size() for w in weights) / bandwidth * 1e3
        for rows in args.rows:
            rows_in = {
                depth: torch.randn(rows, depth, generator=generator).to(dtype)
                for depth in (HIDDEN, INTERMEDIATE)
            }
            outs = {
                name: [w.new_empty(rows, w.shape[0]) for w in weights] for name in ("new", "ref")
            }
            t_new, t_ref = alternate(
                partial(linear_step, new, isa, weights, packed, rows_in, outs["new"]),
                partial(linear_step, ref, isa, weights, packed, rows_in, outs["ref"]),
                args.repeats,
            )
            same = all(map(torch.equal, outs["new"], outs["ref"]))
            print(
                f"| linear + LM head | {str(dtype)[6:]} | {rows} | {t_ref * 1e3:.1f} | "
                f"{t_new * 1e3:.1f} | {t_new / t_ref:.2f} | {floor_ms:.1f} | {same} |"
            )
        for rows in args.rows:
            tensors = _layer_tensors(rows, dtype, generator)
            results = {}
            for name, module in (("new", new), ("ref", ref)):
                copy = {k: v.clone() for k, v in tensors.items()}
                layer_ops_step(module, isa, copy)
                results[name] = copy
            same = all(torch.equal(results["new"][k], results["ref"][k]) for k in tensors)
            t_new, t_ref = alternate(
                partial(layer_ops_step, new, isa, tensors),
                partial(layer_ops_step, ref, isa, tensors),
                args.repeats,
            )
            print(
                f"| norms, rotary, SiLU × 30 | {str(dtype)[6:]} | {rows} | {t_ref * 1e3:.2f} | "
                f"{t_new * 1e3:.2f} | {t_new / t_ref:.2f} | - | {same} |"
            )


def _layer_tensors(rows: int, dtype: torch.dtype, generator: torch.Generator) -> dict:
    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    q_k = randn(rows, (Q_HEADS + KV_HEADS) * HEAD_DIM)
    return {
        "x": randn(rows, HIDDEN),
        "res": randn(rows, HIDDEN),
        "w": randn(HIDDEN),
        "out": randn(rows, HIDDEN),
        "res_out": randn(rows, HIDDEN),
        "pos": torch.randint(0, 8192, (rows,), generator=generator),
        "q": q_k[:, : Q_HEADS * HEAD_DIM],
        "k": q_k[:, Q_HEADS * HEAD_DIM :],
        "cache": randn(8192, HEAD_DIM),
        # Gate values over the range where SiLU's exponential matters, and past its clamp.
        "gate_up": randn(rows, 2 * INTERMEDIATE, scale=8.0),
        "act": randn(rows, INTERMEDIATE),
    }


if __name__ == "__main__":
    main()
