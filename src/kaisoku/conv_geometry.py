"""The geometry of a zero-padded convolution along one dimension: which output positions each kernel tap
reads from the input rather than from the padding. Pure; used by K-FAC's patch statistics
(:mod:`kaisoku.optim.kfac.patches`) and by the float32 fallback for tiny maps
(:mod:`kaisoku.precision.float32_layers`)."""

from __future__ import annotations


def tap_ranges(
    size: int, kernel: int, stride: int, padding: int, dilation: int
) -> tuple[int, list[tuple[int, int]]]:
    """Output length over an input of ``size`` and, per kernel tap, the output positions ``[lo, hi)`` whose
    input under that tap lies inside the map (``padding`` is the leading pad). An empty range: the tap
    only ever reads padding."""
    out = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    positions = max(out, 0)  # a kernel wider than the padded map has no output position
    ranges = []
    for tap in range(kernel):
        start = tap * dilation - padding  # input index under output position 0
        lo = min(positions, 0 if start >= 0 else -(start // stride))  # ceil(-start / stride)
        hi = min(positions, (size - 1 - start) // stride + 1) if size - 1 - start >= 0 else 0
        ranges.append((lo, max(lo, hi)))
    return out, ranges
