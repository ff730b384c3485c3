"""The GPU decode path of bitmap-q4 and of the 8-bit lm_head, on the CPU: the Triton tile kernel against the
dequantised dense matmul under Triton's interpreter (odd shapes, both grids, every group size the format
allows, M on each kernel path), and no host synchronisation anywhere on the path of any GPU op
(`serving.kernels.sync_guard`, which fails on CPU tensors where a CUDA host would wait); the plugin's GPU
branch chosen at load.

`TRITON_INTERPRET=1` must be set before Triton decorates the kernels, so the interpreter tests run in a child
pytest process (this same file with `_CHILD` set), as in test_kernels.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serving.kernels.sync_guard import HostSyncError, no_host_sync
from sparse_formats import get_format

_CHILD = os.environ.get("LEAPCTL_Q4_KERNEL_TEST_CHILD") == "1"
Q4 = get_format("bitmap-q4")
# Relative tolerance of one output ulp (the interpreter truncates to bf16) and an absolute floor.
_TOLERANCE = {torch.float16: (2.0**-10, 2e-3), torch.bfloat16: (2.0**-7, 2e-2), torch.float32: (1e-5, 1e-5)}


def _q4_problem(rows: int, cols: int, group_size: int, asymmetric: bool, seed: int, density: float = 0.5):
    """(stored tensors, their fp32 dequantised weight, dense codes, mask, scales, zeros, generator)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=generator) < density
    codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    groups = cols // group_size
    scales = (torch.rand(rows, groups, generator=generator) * 0.05 + 0.005).half()
    zeros = None
    if asymmetric:
        zeros = torch.randint(0, 16, (rows, groups), generator=generator, dtype=torch.uint8)
    stored = Q4.pack(codes, scales, mask, zeros)
    return stored, Q4.decode(stored), codes, mask, scales, zeros, generator


def _group_sizes(cols: int) -> list[int]:
    """Every group size the format allows for `cols` columns."""
    return [g for g in range(32, cols + 1, 32) if cols % g == 0]


def _assert_close(y: torch.Tensor, reference: torch.Tensor) -> None:
    rtol, atol = _TOLERANCE[y.dtype]
    torch.testing.assert_close(y.float(), reference, rtol=rtol, atol=atol)


def _reference(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in fp32; above the sparse kernels' M the weight is dequantised in x's dtype first."""
    from serving.kernels.bitmap_q4_triton import Q4_KERNEL_MAX_M

    rows_of_x = x.reshape(-1, x.shape[-1]).shape[0]
    weight = dense.to(x.dtype).float() if rows_of_x > Q4_KERNEL_MAX_M else dense
    y = x.float() @ weight.T
    return y if bias is None else y + bias.float()


if not _CHILD:

    def test_q4_kernels_under_triton_interpreter():
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1", LEAPCTL_Q4_KERNEL_TEST_CHILD="1")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
        proc = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                              text=True, timeout=900)
        output = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, f"interpreter tests failed:\n{output}"
        assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]

    @pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
    def test_tiles_hold_the_stored_weight(asymmetric):
        """The tile-major layout made from the stored tensors equals the one made from dense codes, and
        decodes (in torch) to the format's own decode, bit for bit; its bytes are the format's plus the tile
        offsets and padding."""
        pytest.importorskip("triton")
        from serving.kernels.bitmap_q4_triton import Q4Tiles, _reference_dense

        stored, dense, codes, mask, scales, zeros, _ = _q4_problem(150, 224, 32, asymmetric, seed=1)
        tiles = Q4Tiles.from_stored(stored)
        again = Q4Tiles.from_dense(codes, mask, scales, zeros)
        assert all(torch.equal(a, b) for a, b in zip(tiles.tensors(), again.tensors(), strict=True))
        assert torch.equal(_reference_dense(tiles), dense)
        assert tiles.codes.view(torch.uint8)[:stored["codes"].numel()].sort().values.equal(
            stored["codes"].sort().values)

    def test_cpu_without_interpreter_matches_reference():
        pytest.importorskip("triton")
        from serving.kernels.bitmap_q4_triton import Q4Tiles, q4_tiles_linear

        stored, dense, *_, generator = _q4_problem(37, 96, 32, True, seed=2)
        x = torch.randn(3, 96, generator=generator)
        bias = torch.randn(37, generator=generator)
        _assert_close(q4_tiles_linear(x, Q4Tiles.from_stored(stored), bias), _reference(x, dense, bias))

    @pytest.mark.parametrize("m", [1, 5, 20])
    def test_gpu_int8_head_matches_the_portable_op_without_host_sync(m):
        """torch._int_mm (on CPU here) of x rounded per row against `int8_rows_linear`; columns and rows not
        multiples of 8 (padded at construction) and fewer than 17 rows of x (padded per call)."""
        from serving.int8_linear import GpuInt8, Int8Weight, int8_rows_linear

        encoded = get_format("int8-rows").encode(torch.randn(37, 45))
        weight = Int8Weight(encoded["qweight"], encoded["scales"])
        head = GpuInt8(weight)
        x = torch.randn(m, 45).to(torch.bfloat16)
        with no_host_sync():
            got = head(x)
        expected = int8_rows_linear(x, weight.qweight, weight.scales)
        assert got.shape == (m, 37) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-7, atol=1e-2)

    def test_the_guard_refuses_what_would_synchronise_a_cuda_host():
        from serving.q4_linear import bitmap_q4_linear

        stored, *_ = _q4_problem(8, 64, 64, False, seed=3)
        t = torch.arange(4)
        for action in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t[t > 1], lambda: t.nonzero(),
                       lambda: t.tolist(), lambda: torch.repeat_interleave(t, t)):
            with pytest.raises(HostSyncError), no_host_sync():
                action()
        with no_host_sync(allow=[t]):
            assert t.tolist() == [0, 1, 2, 3]
        x = torch.randn(1, 64)
        with pytest.raises(HostSyncError), no_host_sync():  # today's portable op: boolean indexing
            bitmap_q4_linear(x, stored["bitmap"], stored["codes"], stored["scales"], stored["row_offsets"],
                             64)

    def test_plugin_gpu_branch_holds_tiles_and_calls_the_tiled_op(monkeypatch):
        """A vLLM gate_up layer on bitmap-q4, its device taken for a GPU: the layer holds the tile layout
        (no stored tensors) and computes through `leap_sparse::bitmap_q4_tiled_linear`."""
        pytest.importorskip("triton")
        plugin = pytest.importorskip("test_serve_plugin")
        from serving.contract import LeapSparseSettings
        from serving.leap_sparse import LeapSparseConfig, q4_tiles_kernel

        monkeypatch.setattr(LeapSparseConfig, "gpu_kernel", lambda self, device, available: available)
        config = LeapSparseConfig(LeapSparseSettings("bitmap-q4", 0.5))
        layer = plugin.build_layer(monkeypatch, "gate_up", config, 0, 1)
        plugin.load(layer, "bitmap-q4", plugin.LAYERS["gate_up"])
        assert layer.leap_q4_tiles is not None and not hasattr(layer, "codes")
        assert layer.leap_kernel is q4_tiles_kernel  # chosen at load
        dense = torch.cat([Q4.decode(Q4.encode(*plugin.PROJECTIONS[name]))
                           for name in ("gate_proj", "up_proj")])
        x = torch.randn(4, plugin.HIDDEN)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = layer.quant_method.apply(layer, x)
        assert "leap_sparse::bitmap_q4_tiled_linear" in {event.name for event in prof.events()}
        torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=1e-5)

else:
    from serving.kernels.bitmap_q4_triton import Q4Tiles, q4_tiles_decode, q4_tiles_linear

    # (rows, cols): tails in rows (not multiples of the 64-row tile), columns of 1..7 tiles; every group size.
    SHAPES = [(70, 192), (130, 160), (1, 32), (65, 96)]
    CASES = [(rows, cols, group, asymmetric) for rows, cols in SHAPES for group in _group_sizes(cols)
             for asymmetric in (False, True)]
    DTYPES = [torch.float16, torch.bfloat16]

    @pytest.mark.parametrize(("rows", "cols", "group", "asymmetric"), CASES)
    def test_kernel_equals_the_dequantised_dense_matmul(rows, cols, group, asymmetric):
        """M = 1 (CUDA-core kernel), 7 and 16 (tl.dot kernel), 17 (dequantise + dense matmul), with a
        bias, without host synchronisation."""
        seed = rows * 1000 + cols + group + asymmetric
        stored, dense, *_, generator = _q4_problem(rows, cols, group, asymmetric, seed)
        tiles = Q4Tiles.from_stored(stored)
        for index, m in enumerate((1, 7, 16, 17)):
            dtype = DTYPES[(index + seed) % 2]
            x = torch.randn(m, cols, generator=generator).to(dtype)
            bias = torch.randn(rows, generator=generator).to(dtype) if index % 2 else None
            with no_host_sync():
                y = q4_tiles_linear(x, tiles, bias)
            assert y.dtype == dtype and y.shape == (m, rows)
            _assert_close(y, _reference(x, dense, bias))

    @pytest.mark.parametrize("split_k", [1, 2, 3, 5])
    @pytest.mark.parametrize("m", [1, 9])
    def test_split_k_partitions_agree(split_k, m):
        """Every split of the 5 column tiles sums the same products, and a second call gives the same result
        (the split-K tickets were reset)."""
        stored, dense, *_, generator = _q4_problem(100, 160, 32, True, seed=7)
        tiles = Q4Tiles.from_stored(stored)
        x = torch.randn(m, 160, generator=generator).to(torch.float16)
        y = q4_tiles_linear(x, tiles, split_k=split_k)
        _assert_close(y, _reference(x, dense, None))
        assert torch.equal(q4_tiles_linear(x, tiles, split_k=split_k), y)

    @pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
    def test_device_decode_is_exact(asymmetric):
        stored, dense, *_ = _q4_problem(90, 128, 64, asymmetric, seed=4)
        tiles = Q4Tiles.from_stored(stored)
        with no_host_sync():
            decoded = q4_tiles_decode(tiles, torch.float32)
        assert torch.equal(decoded, dense)

    def test_pruned_rows_columns_and_dense_words():
        """Rows with nothing kept give the bias; pruned columns ignore x; fully kept words (16 code bytes)
        and a fully pruned tile are read right; float32 x, 3-D and non-contiguous."""
        stored, dense, codes, mask, scales, zeros, generator = _q4_problem(80, 96, 32, True, seed=5)
        mask[[0, 17, 64, 79]] = False
        mask[:, [0, 31, 32, 95]] = False
        mask[5:9] = True
        mask[:64, 64:] = False
        tiles = Q4Tiles.from_dense(codes, mask, scales, zeros)
        dense = Q4.decode(Q4.pack(codes, scales, mask, zeros))
        bias = torch.randn(80, generator=generator)
        for m in (1, 6):
            x = torch.randn(96, 2 * m, generator=generator).T.reshape(2, m, 96)
            y = q4_tiles_linear(x, tiles, bias)
            assert y.shape == (2, m, 80)
            _assert_close(y.reshape(-1, 80), _reference(x.reshape(-1, 96), dense, bias))
            assert torch.equal(y[..., [0, 17, 64, 79]], bias[[0, 17, 64, 79]].expand(2, m, 4))

    def test_all_pruned_weight_gives_bias():
        stored, *_, generator = _q4_problem(40, 64, 64, False, seed=6, density=0.0)
        tiles = Q4Tiles.from_stored(stored)
        bias = torch.randn(40, generator=generator).to(torch.float16)
        x = torch.randn(3, 64, generator=generator).to(torch.float16)
        assert torch.equal(q4_tiles_linear(x, tiles, bias), bias.expand(3, 40))

    def test_every_gpu_op_of_the_decode_path_makes_no_host_synchronisation():
        """The plugin's ops as vLLM calls them: bitmap-q4's tiled op, tiled-bitmap's (its `shape` is host
        metadata by contract) and the 8-bit lm_head, each at decoding and prefill sizes."""
        from serving.int8_linear import GpuInt8, Int8Weight
        from serving.q4_linear import bitmap_q4_tiled_linear
        from serving.sparse_linear import tiled_bitmap_linear

        stored, *_, generator = _q4_problem(70, 128, 64, True, seed=8)
        tiles = Q4Tiles.from_stored(stored)
        weight = torch.randn(70, 128, generator=generator).to(torch.float16)
        tiled = get_format("tiled-bitmap").encode(weight, torch.rand(70, 128, generator=generator) < 0.5)
        encoded = get_format("int8-rows").encode(torch.randn(70, 128, generator=generator))
        head = GpuInt8(Int8Weight(encoded["qweight"], encoded["scales"]))
        for m in (1, 4, 16, 40):
            x = torch.randn(m, 128, generator=generator).to(torch.float16)
            with no_host_sync(allow=[tiled["shape"]]):
                bitmap_q4_tiled_linear(x, tiles.tensors(), tiles.n_rows, tiles.n_cols, tiles.group_size)
                tiled_bitmap_linear(x, list(tiled.values()), ",".join(tiled), 70)
                head(x)
