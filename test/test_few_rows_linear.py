"""The native few-row product (csrc/few_rows_linear.cpp), every instruction set the CPU has, and
its torch reference, against float64 on random ragged shapes; and the property verification
rests on: a row's result does not depend on the rows that share the call."""

from __future__ import annotations

import gc

import pytest
import torch

from magicdec_kernels import cpu_native
from magicdec_kernels.cpu_native import (
    few_rows_linear,
    pack_rows,
    packed_rows,
    supports_few_rows,
)
from magicdec_kernels.loader import capabilities, native
from sglang_magicdec.platforms.torch_ops import few_rows_product, weight_major_product
from test.references import few_rows_linear_torch

pytestmark = pytest.mark.skipif(
    native() is None,
    reason="the native CPU kernel extension did not build or load (see the logged warning)",
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# Ragged: rows 1 (decode at batch 1) to 64 (verify); K a multiple of the vector width or not
# (tails), and shorter than one vector; N not a multiple of the kernel's block of weight rows.
SHAPES = [
    (1, 576, 960),
    (3, 40, 5),
    (4, 16, 1),
    (5, 577, 13),
    (8, 1536, 576),
    (13, 100, 17),
    (32, 576, 3072),
    (64, 33, 4),
]


def _operands(rows: int, depth: int, outputs: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator).to(dtype)
    weight = torch.randn(outputs, depth, generator=generator).to(dtype)
    return x, weight


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within float32 accumulation of K products (and, in bf16, one rounding of the result)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], weight.shape[0])
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = 4e-7 * x.shape[1] ** 0.5 * magnitude + 1e-30
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"max error {(error - bound).max().item():.3g} over its bound"


def _native_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The native kernel itself (its checks raise), as `few_rows_linear` calls it."""
    return _product(x, weight, "auto")


def _product(x: torch.Tensor, weight: torch.Tensor, isa: str) -> torch.Tensor:
    out = x.new_full((x.shape[0], weight.shape[0]), 7.0)
    return native().few_rows_linear(x, pack_rows(weight), weight.shape[0], out, isa)


def _all_paths(x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    module = native()
    results = {}
    for isa in module.isas():
        results[isa] = _product(x, weight, isa)
    results["torch"] = few_rows_linear_torch(x, weight)
    return results


@DTYPES
@pytest.mark.parametrize("rows,depth,outputs", SHAPES)
def test_matches_float64(rows, depth, outputs, dtype):
    x, weight = _operands(rows, depth, outputs, dtype)
    for path, got in _all_paths(x, weight).items():
        try:
            _check(got, x, weight)
        except AssertionError as error:
            raise AssertionError(f"{path}: {error}") from None


@DTYPES
@pytest.mark.parametrize("rows,depth,outputs", SHAPES)
def test_a_row_does_not_depend_on_its_batch(rows, depth, outputs, dtype):
    """Verification computes a token's logits with γ other rows; a decode step with other
    requests' rows. Both must give exactly what the token alone would (greedy is lossless)."""
    x, weight = _operands(rows, depth, outputs, dtype, seed=1)
    module = native()
    for isa in module.isas():
        together = _product(x, weight, isa)
        for row in range(rows):
            alone = _product(x[row : row + 1], weight, isa)
            assert torch.equal(alone[0], together[row]), f"{isa}: row {row} of {rows}"


@DTYPES
def test_threads_do_not_change_results(dtype):
    x, weight = _operands(8, 576, 3072, dtype, seed=2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native_product(x, weight)
        torch.set_num_threads(2)
        two = _native_product(x, weight)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


@DTYPES
def test_strided_weight_rows(dtype):
    """A weight whose rows are further apart than K (a column slice of a wider matrix) and a
    row slice of a larger one pack as the rows they hold."""
    x, wide = _operands(6, 96, 40, dtype, seed=3)
    wider = torch.cat([wide, wide.flip(1)], dim=1)[:, :96]
    assert wider.stride(0) == 192
    _check(few_rows_linear(x, wider), x, wider)
    rows = wide[7:30]
    _check(few_rows_linear(x, rows), x, rows)


@DTYPES
def test_a_weight_is_packed_once_and_again_after_a_write(dtype):
    """The packed copy follows its weight: reused while the weight is unchanged, packed anew
    after an in-place write (SGLang's weight updates), dropped with the weight."""
    x, weight = _operands(3, 64, 20, dtype, seed=5)
    first = packed_rows(weight)
    assert packed_rows(weight) is first
    weight.mul_(2)
    again = packed_rows(weight)
    assert again is not first
    _check(few_rows_linear(x, weight), x, weight)
    key = id(weight)
    del weight
    gc.collect()
    assert key not in cpu_native._PACKED


def test_bad_operands_raise():
    x, weight = _operands(2, 32, 8, torch.float32)
    packed, out = pack_rows(weight), x.new_empty(2, 8)
    module = native()
    with pytest.raises(RuntimeError, match="share a dtype"):
        module.few_rows_linear(x, pack_rows(weight.bfloat16()), 8, out)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.few_rows_linear(torch.randn(32, 2).t(), packed, 8, out)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.few_rows_linear(x, pack_rows(weight[:, :16]), 8, out)
    with pytest.raises(RuntimeError, match="does not hold"):
        module.few_rows_linear(x, packed, 17, x.new_empty(2, 17))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.few_rows_linear(x.half(), pack_rows(weight).half(), 8, out.half())


@DTYPES
def test_the_linear_hook_takes_native_up_to_its_row_limit(dtype):
    """`few_rows_product` (the decode-sized linear hook) runs the native kernel up to
    `Capabilities.few_rows_max` rows, then the weight-major torch product, with the same
    results up to float rounding; over 64 rows it leaves the product to SGLang."""
    limit = capabilities().few_rows_max(dtype)
    x, weight = _operands(limit + 1, 192, 40, dtype, seed=4)
    native_rows = x[:limit]
    assert supports_few_rows(native_rows, weight) and not supports_few_rows(x, weight)
    assert torch.equal(few_rows_product(native_rows, weight), few_rows_linear(native_rows, weight))
    assert few_rows_linear(x, weight) is None
    if limit + 1 <= 64:
        assert torch.equal(few_rows_product(x, weight), weight_major_product(x, weight))
    batched = x[:limit].reshape(1, limit, 192)
    assert few_rows_product(batched, weight).shape == (1, limit, 40)
    assert few_rows_product(torch.randn(65, 192).to(dtype), weight) is None
