"""Block-wise encoders: the output must not depend on the block size, and encoding must leave its inputs
untouched (some encoders write into per-block scratch arrays that, for some shapes, could be views)."""

import pytest
import torch

from sparse_formats import checks, get_format, lossless_formats


def case(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    return weight, torch.rand(rows, cols, generator=gen) < 0.4


@pytest.mark.parametrize("fmt_name", lossless_formats())
@pytest.mark.parametrize("shape", [(300, 200), (256, 128), (129, 65)])
def test_block_size_does_not_change_the_encoding(fmt_name, shape, monkeypatch):
    weight, mask = case(*shape, seed=shape[0])
    fmt = get_format(fmt_name)
    whole = fmt.encode(weight, mask)  # the default block covers every test shape in one block
    monkeypatch.setattr(checks, "ENCODE_BLOCK", 1)  # one row / group / tile per block
    blocked = fmt.encode(weight, mask)
    assert whole.keys() == blocked.keys()
    for key in whole:
        assert whole[key].dtype == blocked[key].dtype, key
        assert torch.equal(whole[key].view(torch.uint8), blocked[key].view(torch.uint8)), key


@pytest.mark.parametrize("fmt_name", lossless_formats())
@pytest.mark.parametrize("shape", [(128, 64), (64, 64), (8, 8)])
def test_encode_leaves_its_inputs_unchanged(fmt_name, shape):
    weight, mask = case(*shape, seed=1)
    weight_before, mask_before = weight.clone(), mask.clone()
    get_format(fmt_name).encode(weight, mask)
    assert torch.equal(weight.view(torch.int16), weight_before.view(torch.int16))
    assert torch.equal(mask, mask_before)


@pytest.mark.parametrize("fmt_name", lossless_formats())
def test_thread_count_does_not_change_the_encoding(fmt_name, monkeypatch):
    """Blocks (row blocks, row groups, tile rows) run on a thread pool; 1 thread is the serial loop."""
    weight, mask = case(300, 200, seed=5)
    fmt = get_format(fmt_name)
    monkeypatch.setattr(checks, "ENCODE_BLOCK", 1)
    encodings = []
    for threads in ("1", "4"):
        monkeypatch.setenv(checks.THREADS_ENV, threads)
        encodings.append(fmt.encode(weight, mask))
    serial, threaded = encodings
    for key in serial:
        assert torch.equal(serial[key].view(torch.uint8), threaded[key].view(torch.uint8)), key


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_thread_count_is_named(value, monkeypatch):
    monkeypatch.setenv(checks.THREADS_ENV, value)
    with pytest.raises(ValueError, match=checks.THREADS_ENV):
        get_format("bitmap").encode(*case(300, 200, seed=0))
