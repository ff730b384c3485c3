"""`int8-rows` (sparse_formats.int8_rows): the 8-bit lm_head layout. Codes and scales round trip exactly,
every value is scale * code, the largest |w| of a row maps to 127, and `check` names corruption."""

import pytest
import torch

from sparse_formats import FormatError, get_format, nbytes

INT8 = get_format("int8-rows")


def weight(rows: int = 37, cols: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_values_are_scale_times_code_and_the_row_maximum_is_127():
    w = weight()
    w[3] = 0.0  # a row of zeros: any code decodes to 0
    encoded = INT8.encode(w)
    codes, scales = encoded["qweight"], encoded["scales"]
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (37,)
    decoded = INT8.decode(encoded)
    assert torch.equal(decoded, codes.float() * scales.float()[:, None])
    assert bool((decoded[3] == 0).all())
    top = codes.abs().amax(dim=1)
    assert bool((top[torch.arange(37) != 3] == 127).all())
    # nearest code: within half a step of the weight (the fp16 scale may move the row's top by its rounding)
    assert bool(((decoded - w).abs() <= scales.float()[:, None] / 2 * (1 + 2**-10)).all())
    assert nbytes(encoded) == 16 + 37 * 96 + 2 * 37


def test_codes_and_scales_round_trip_exactly():
    encoded = INT8.encode(weight(seed=1))
    again = INT8.encode(INT8.decode(encoded), scales=encoded["scales"])
    assert all(torch.equal(encoded[k], again[k]) for k in encoded)
    INT8.check(again)


def test_a_weight_off_the_given_grid_is_named():
    encoded = INT8.encode(weight(seed=2))
    values = INT8.decode(encoded)
    values[4, 7] += float(encoded["scales"][4]) / 3
    with pytest.raises(ValueError, match=r"weight \[4, 7\]"):
        INT8.encode(values, scales=encoded["scales"])


def test_a_mask_that_prunes_is_refused():
    mask = torch.ones(37, 96, dtype=torch.bool)
    mask[0, 0] = False
    with pytest.raises(ValueError, match="stores every weight"):
        INT8.encode(weight(), mask)


def damaged(edit) -> dict[str, torch.Tensor]:
    encoded = INT8.encode(weight(seed=3))
    edit(encoded)
    return encoded


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t["scales"].__setitem__(5, -1.0), r"scales\[5\] is -1.0"),
    (lambda t: t["scales"].__setitem__(6, 0.0), r"scales\[6\] is 0.0"),
    (lambda t: t["scales"].__setitem__(7, float("nan")), r"scales\[7\] is nan"),
    (lambda t: t["qweight"].__setitem__((9, 2), -128), "qweight row 9 holds -128"),
    (lambda t: t.__setitem__("scales", t["scales"][:-1]), "expected one per row"),
    (lambda t: t.__setitem__("qweight", t["qweight"][:, :-1]), "qweight has shape"),
    (lambda t: t.__setitem__("qweight", t["qweight"].to(torch.uint8)), "qweight has dtype"),
    (lambda t: t.pop("scales"), "'scales' is missing"),
])
def test_check_names_the_corruption(edit, message):
    with pytest.raises(FormatError, match=message):
        INT8.check(damaged(edit))
