"""precision/scaler.py: the exponent from a known history, round-trip error bounds, overflow and underflow counts."""

from __future__ import annotations

import pytest
import torch

from kaisoku.precision.scaler import (
    FORMATS,
    AmaxHistory,
    ExponentScaler,
    exponent_of,
    quantize,
    shared_exponent,
)


@pytest.mark.parametrize(
    ("amax", "expected"),
    [(1.0, 0), (1.5, 1), (2.0, 1), (3.0, 2), (0.25, -2), (0.3, -1), (1000.0, 10), (0.0, 0)],
)
def test_shared_exponent_is_ceil_log2(amax: float, expected: int) -> None:
    assert int(shared_exponent(torch.tensor(amax))) == expected
    assert exponent_of([amax]) == expected


def test_exponent_comes_from_the_largest_maximum_of_the_last_h_uses() -> None:
    scaler = ExponentScaler("int8", history=3)
    for top in (5.0, 0.5, 0.5):
        scaler(torch.tensor([top, -0.1]))
    # History now 5.0, 0.5, 0.5: the next use takes ceil(log2(5)) = 3 whatever its own values.
    assert int(scaler.next_exponent(torch.tensor(0.1))) == 3
    scaler(torch.tensor([0.1]))  # 5.0 drops out of the 3-long history
    assert int(scaler.next_exponent(torch.tensor(0.1))) == -1  # ceil(log2(0.5))
    assert scaler.window()["exponent"] == 3  # the exponent the last use was rounded with


def test_first_use_takes_its_own_maximum_and_history_rings() -> None:
    history = AmaxHistory(2)
    assert float(history.reference(torch.tensor(7.0))) == 7.0
    for value in (1.0, 2.0, 3.0):
        history.append(torch.tensor(value))
    assert len(history) == 2
    assert float(history.reference(torch.tensor(0.0))) == 3.0


@pytest.mark.parametrize(("name", "bits"), [("int8", 8), ("int16", 16)])
def test_fixed_point_round_trip_error_is_half_a_step(name: str, bits: int) -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    e = shared_exponent(x.abs().amax())
    out, over, under = quantize(x, FORMATS[name], e)
    step = 2.0 ** (int(e) - (bits - 1))
    assert not over.any()
    assert (out - x).abs().max() <= step / 2 + 1e-7
    assert torch.equal(out / step, torch.round(out / step))  # on the grid


@pytest.mark.parametrize(("name", "mantissa"), [("e4m3", 3), ("e5m2", 2)])
def test_fp8_round_trip_relative_error(name: str, mantissa: int) -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    e = shared_exponent(x.abs().amax())
    out, over, under = quantize(x, FORMATS[name], e)
    normal = (x.abs() > x.abs().amax() * 2.0**-5) & ~under
    rel = ((out - x).abs() / x.abs())[normal]
    assert not over.any()
    assert rel.max() <= 2.0 ** -(mantissa + 1) + 1e-6


def test_overflow_saturates_and_is_counted() -> None:
    scaler = ExponentScaler("int8", history=4)
    scaler(torch.full((8,), 0.9))  # history max 0.9 -> e = 0, grid 2^-7, largest 127/128
    out = scaler(torch.tensor([4.0, -3.0, 0.5, 0.25]))
    assert torch.allclose(out, torch.tensor([127 / 128, -127 / 128, 0.5, 0.25]))
    figures = scaler.window()
    assert figures["overflow_count"] == 2
    assert figures["overflow_rate"] == pytest.approx(2 / 12)
    assert scaler.window()["overflow_count"] == 0  # a new window
    assert scaler.totals()["overflow_count"] == 2


def test_underflow_fraction_counts_nonzero_values_rounded_to_zero() -> None:
    scaler = ExponentScaler("int8", history=4)
    x = torch.tensor([0.75, 2.0**-9, -(2.0**-10), 0.0])  # e = 0, grid 2^-7: two tiny values vanish
    out = scaler(x)
    assert out[1] == 0 and out[2] == 0
    assert scaler.window()["underflow_fraction"] == pytest.approx(2 / 3)


def test_fixed_exponent_ignores_the_statistics() -> None:
    scaler = ExponentScaler("int8", fixed_exponent=0)
    out = scaler(torch.tensor([1e-4, 8.0]))  # gradients this small vanish, activations this large clip
    assert out.tolist() == [0.0, 127 / 128]
    assert scaler.window()["exponent"] == 0


def test_encode_gives_fp8_values_and_the_scale_back() -> None:
    scaler = ExponentScaler("e4m3")
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    q, scale = scaler.encode(x)
    assert q.dtype == torch.float8_e4m3fn
    emulated = ExponentScaler("e4m3")(x)
    assert torch.equal(q.float() * scale, emulated)


def test_stochastic_rounding_is_unbiased_and_keyed_by_its_seed() -> None:
    x = torch.full((20_000,), 2.0**-9)  # a quarter of the 2^-7 grid at e = 0: nearest rounds it all to 0
    x[0] = 0.75
    a = ExponentScaler("int8", stochastic_seed=5)(x)
    b = ExponentScaler("int8", stochastic_seed=5)(x)
    assert torch.equal(a, b)  # same key, same bits
    assert ExponentScaler("int8")(x)[1:].eq(0).all()
    assert float(a[1:].mean()) == pytest.approx(2.0**-9, rel=0.05)
