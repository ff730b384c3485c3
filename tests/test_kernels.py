"""The Triton tiled-bitmap kernel against a plain torch reference, on the CPU through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before Triton decorates the kernels, and it changes how every Triton
kernel imported later in the process behaves. So the interpreter tests run in a child pytest process
(this same file, with `_CHILD` set); the parent process only starts it and checks the CPU fallback.

Reference: x.float() @ (W * mask).float().T (+ b). The kernel accumulates in fp32 like the reference, so
the only difference is the final rounding to the output dtype: at most one unit in the last place
(the interpreter truncates fp32 -> bf16 instead of rounding, hence one ulp, not half).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_CHILD = os.environ.get("LEAPCTL_KERNEL_TEST_CHILD") == "1"
# One ulp relative to the value for each output dtype, plus an absolute floor for results near zero.
_TOLERANCE = {torch.float16: (2.0**-10, 1e-3), torch.bfloat16: (2.0**-7, 1e-2), torch.float32: (1e-5, 1e-5)}


def _problem(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int):
    from sparse_formats import get_format

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator).to(dtype)
    mask = torch.rand(rows, cols, generator=generator) < density
    tensors = get_format("tiled-bitmap").encode(weight, mask)
    dense = torch.where(mask, weight, torch.zeros((), dtype=dtype))
    return tensors, dense, generator


def _reference(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ dense.float().T
    return y if bias is None else y + bias.float()


def _assert_close(y: torch.Tensor, reference: torch.Tensor) -> None:
    rtol, atol = _TOLERANCE[y.dtype]
    torch.testing.assert_close(y.float(), reference, rtol=rtol, atol=atol)


if not _CHILD:

    def test_kernels_under_triton_interpreter():
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1", LEAPCTL_KERNEL_TEST_CHILD="1")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
        proc = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                              text=True, timeout=900)
        output = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, f"interpreter tests failed:\n{output}"
        assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]

    def test_cpu_without_interpreter_decodes_and_matches_reference():
        pytest.importorskip("triton")
        from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear

        tensors, dense, generator = _problem(37, 90, 0.5, torch.float32, seed=1)
        x = torch.randn(3, 90, generator=generator)
        bias = torch.randn(37, generator=generator)
        _assert_close(tiled_bitmap_linear(x, tensors, bias), _reference(x, dense, bias))

    def test_shape_off_the_cpu_is_refused():
        """Reading a device-side shape would sync the GPU every call and break CUDA-graph capture."""
        pytest.importorskip("triton")
        from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear

        tensors, _, _ = _problem(8, 16, 0.5, torch.float32, seed=10)
        with pytest.raises(ValueError, match="must stay on the CPU"):
            tiled_bitmap_linear(torch.zeros(2, 16), {**tensors, "shape": tensors["shape"].to("meta")})

else:
    from serving.kernels.tiled_bitmap_triton import (
        SPARSE_KERNEL_MAX_M,
        tiled_bitmap_decode,
        tiled_bitmap_linear,
    )

    # Shapes with tails in both directions (not multiples of the 64x64 group or of 8), M on both kernel
    # paths (M = 1: CUDA cores; M > 1: tl.dot), densities across 0.3..0.7.
    SHAPE_DENSITIES = (((70, 130), (0.3, 0.5, 0.6, 0.7)), ((130, 70), (0.7, 0.4, 0.5, 0.3)))
    CASES = [(rows, cols, m, density) for (rows, cols), densities in SHAPE_DENSITIES
             for m, density in zip((1, 3, 16, 40), densities, strict=True)]

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize(("rows", "cols", "m", "density"), CASES)
    def test_linear_matches_reference(rows, cols, m, density, dtype):
        tensors, dense, generator = _problem(rows, cols, density, dtype, seed=rows + m)
        x = torch.randn(m, cols, generator=generator).to(dtype)
        bias = torch.randn(rows, generator=generator).to(dtype)
        _assert_close(tiled_bitmap_linear(x, tensors, bias), _reference(x, dense, bias))

    @pytest.mark.parametrize("split_k", [1, 2, 3])
    @pytest.mark.parametrize("m", [1, 20])
    def test_split_k_partitions_agree(split_k, m):
        """Every split of the 3 column groups (even, uneven, one per program) sums the same products,
        and a second call gives the same result (the split-K ticket counters were reset)."""
        tensors, dense, generator = _problem(65, 150, 0.5, torch.float16, seed=7)
        x = torch.randn(m, 150, generator=generator).to(torch.float16)
        bias = torch.randn(65, generator=generator).to(torch.float16)
        y = tiled_bitmap_linear(x, tensors, bias, split_k=split_k)
        _assert_close(y, _reference(x, dense, bias))
        assert torch.equal(tiled_bitmap_linear(x, tensors, bias, split_k=split_k), y)

    def test_float32_without_bias_and_3d_input():
        tensors, dense, generator = _problem(33, 75, 0.6, torch.float32, seed=3)
        x = torch.randn(2, 3, 75, generator=generator)
        y = tiled_bitmap_linear(x, tensors)
        assert y.shape == (2, 3, 33)
        _assert_close(y.reshape(6, 33), _reference(x.reshape(6, 75), dense, None))

    def test_zero_rows_and_columns():
        """Pruned-away rows give exactly the bias; pruned-away columns make x there irrelevant."""
        from sparse_formats import get_format

        generator = torch.Generator().manual_seed(5)
        weight = torch.randn(90, 100, generator=generator).to(torch.float16)
        mask = torch.rand(90, 100, generator=generator) < 0.5
        mask[[0, 17, 64, 89]] = False
        mask[:, [0, 31, 32, 63, 64, 99]] = False
        tensors = get_format("tiled-bitmap").encode(weight, mask)
        x = torch.randn(5, 100, generator=generator).to(torch.float16)
        bias = torch.randn(90, generator=generator).to(torch.float16)
        y = tiled_bitmap_linear(x, tensors, bias)
        _assert_close(y, _reference(x, torch.where(mask, weight, 0), bias))
        assert torch.equal(y[:, [0, 17, 64, 89]], bias[[0, 17, 64, 89]].expand(5, 4))
        x_changed = x.clone()
        x_changed[:, [0, 31, 32, 63, 64, 99]] = 100.0
        assert torch.equal(tiled_bitmap_linear(x_changed, tensors, bias), y)

    def test_empty_matrix_gives_bias():
        tensors, _, generator = _problem(40, 50, 0.0, torch.bfloat16, seed=2)
        assert tensors["values"].numel() == 0
        bias = torch.randn(40, generator=generator).to(torch.bfloat16)
        x = torch.randn(3, 50, generator=generator).to(torch.bfloat16)
        assert torch.equal(tiled_bitmap_linear(x, tensors, bias), bias.expand(3, 40))
        assert torch.equal(tiled_bitmap_linear(x, tensors), torch.zeros(3, 40, dtype=torch.bfloat16))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_device_decode_is_bit_exact(dtype):
        from sparse_formats import get_format

        tensors, dense, _ = _problem(100, 140, 0.5, dtype, seed=4)
        decoded = tiled_bitmap_decode(tensors)
        assert torch.equal(decoded.view(torch.int16), dense.view(torch.int16))
        host_decoded = get_format("tiled-bitmap").decode(tensors)
        assert torch.equal(decoded.view(torch.int16), host_decoded.view(torch.int16))

    def test_large_m_takes_the_dense_path_and_matches():
        tensors, dense, generator = _problem(20, 70, 0.5, torch.float32, seed=6)
        x = torch.randn(SPARSE_KERNEL_MAX_M + 3, 70, generator=generator)
        _assert_close(tiled_bitmap_linear(x, tensors), _reference(x, dense, None))

    def test_non_contiguous_input():
        tensors, dense, generator = _problem(30, 64, 0.5, torch.float16, seed=8)
        x = torch.randn(64, 4, generator=generator).to(torch.float16).T  # stride (1, 4)
        _assert_close(tiled_bitmap_linear(x, tensors), _reference(x, dense, None))

    def test_rejects_mismatched_input():
        tensors, _, _ = _problem(30, 64, 0.5, torch.float16, seed=9)
        with pytest.raises(ValueError, match="features"):
            tiled_bitmap_linear(torch.zeros(2, 63, dtype=torch.float16), tensors)
        with pytest.raises(ValueError, match="values are torch.float16"):
            tiled_bitmap_linear(torch.zeros(2, 64, dtype=torch.bfloat16), tensors)
