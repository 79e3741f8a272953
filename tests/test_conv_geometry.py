"""The convolution tap geometry against its definition, position by position."""

from __future__ import annotations

import itertools

from kaisoku.conv_geometry import tap_ranges


def test_tap_ranges_hold_exactly_the_outputs_whose_input_is_inside_the_map() -> None:
    for size, kernel, stride, padding, dilation in itertools.product(
        range(1, 9), (1, 2, 3, 5, 7), (1, 2, 3), (0, 1, 2, 3), (1, 2)
    ):
        out, ranges = tap_ranges(size, kernel, stride, padding, dilation)
        assert out == (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
        for tap, (lo, hi) in enumerate(ranges):
            inside = [o for o in range(max(out, 0)) if 0 <= o * stride - padding + tap * dilation < size]
            case = (size, kernel, stride, padding, dilation, tap)
            assert list(range(lo, hi)) == inside, case
