"""Convolution activation statistics without the unfolded patch matrix.

The A factor of a convolution is ``sum over patches a a^T`` (a: the input patch under one output position).
With ``F.unfold`` that is one product of an (N*L, C*K) matrix with itself (K = kh*kw kernel offsets), the
matrix materialised and, for wide patches, copied once more. Here the patch matrix is laid out by kernel
offset instead: ``U[k]`` is the (C, N*L) slice of the input under offset ``k`` (a strided view of the
input, copied once), and block ``(k, k')`` of A is ``U[k] U[k']^T``. So

- only the blocks with ``k <= k'`` are computed (A is symmetric): (K+1)/(2K) of the multiply-adds, 5/9
  for a 3x3 kernel;
- a block whose two offsets both fall in the zero padding for a share of the output positions is
  computed over the positions where both are inside the image only (copying those two crops), when the
  work saved outweighs the copies: this matters on small feature maps (2x2 and 4x4 in a ResNet at 32 px),
  where most patch entries are padding;
- the batch is taken in chunks so that ``U`` stays a few MiB rather than the unfolded tensor's size.

The result equals ``F.unfold``'s within float round-off, in the same (channel, kh, kw) order.
"""

from __future__ import annotations

import torch

from kaisoku.conv_geometry import tap_ranges

#: Samples per chunk are chosen so that ``U`` holds about this many elements (16 MiB of float32).
CHUNK_ELEMENTS = 1 << 22
#: A block is computed on cropped copies when ``C * (positions saved)`` exceeds this many times the
#: positions kept: a copy costs tens of multiply-adds per element, a block's row C of them.
CROP_RATIO = 64.0


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo = max(a[0], b[0])
    return lo, max(lo, min(a[1], b[1]))


def patch_sums(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(sum of a a^T, sum of a, number of patches)`` over the patches ``a`` of a zero-padded 2-D convolution.

    ``x`` is (N, C, H, W); the patches are ordered like ``F.unfold``'s rows (channel, kernel row, kernel
    column). The products take inputs in ``compute_dtype`` (float32 or bfloat16); the sums are float32.
    """
    n, channels, height, width = x.shape
    kh, kw = kernel_size
    out_h, rows_h = tap_ranges(height, kh, stride[0], padding[0], dilation[0])
    out_w, rows_w = tap_ranges(width, kw, stride[1], padding[1], dilation[1])
    offsets = [(i, j) for i in range(kh) for j in range(kw)]
    k = len(offsets)
    positions = out_h * out_w
    valid = [(rows_h[i], rows_w[j]) for i, j in offsets]

    def window(xt: torch.Tensor, q: int, rh: tuple[int, int], rw: tuple[int, int]) -> torch.Tensor:
        """The input under kernel offset ``q`` for output rows ``rh`` and columns ``rw`` (non-empty)."""
        i, j = offsets[q]
        h0 = rh[0] * stride[0] + i * dilation[0] - padding[0]
        w0 = rw[0] * stride[1] + j * dilation[1] - padding[1]
        h1 = h0 + (rh[1] - rh[0] - 1) * stride[0] + 1
        w1 = w0 + (rw[1] - rw[0] - 1) * stride[1] + 1
        return xt[:, :, h0 : h1 : stride[0], w0 : w1 : stride[1]]

    # Per block: None (the full-grid slices of U) or the common crop (rows, columns) to compute it on.
    crops: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]] | None] = {}
    for q in range(k):
        for q2 in range(q, k):
            rh = _intersect(valid[q][0], valid[q2][0])
            rw = _intersect(valid[q][1], valid[q2][1])
            kept = (rh[1] - rh[0]) * (rw[1] - rw[0])
            crops[q, q2] = (rh, rw) if channels * (positions - kept) > CROP_RATIO * kept else None

    acc = torch.zeros(k * channels, k * channels, dtype=torch.float32, device=x.device)
    column = torch.zeros(k, channels, dtype=torch.float32, device=x.device)
    per_sample = max(1, k * channels * positions)
    chunk = max(1, min(n, CHUNK_ELEMENTS // per_sample))
    buffer: torch.Tensor | None = None
    for start in range(0, n, chunk):
        xt = x[start : start + chunk].transpose(0, 1)  # (C, n, H, W), a view
        size = xt.shape[1]
        if buffer is None or buffer.shape[2] != size:
            # Zeros stay where an offset falls in the padding: only the valid windows are written.
            buffer = torch.zeros(k, channels, size, out_h, out_w, dtype=compute_dtype, device=x.device)
        for q in range(k):
            rh, rw = valid[q]
            if rh[1] > rh[0] and rw[1] > rw[0]:
                buffer[q, :, :, rh[0] : rh[1], rw[0] : rw[1]].copy_(window(xt, q, rh, rw))
        flat = buffer.view(k, channels, size * positions)
        column += flat.sum(dim=2, dtype=torch.float32)
        for q in range(k):
            q2 = q
            while q2 < k:
                crop = crops[q, q2]
                if crop is not None:
                    rh, rw = crop
                    if rh[1] > rh[0] and rw[1] > rw[0]:
                        left = window(xt, q, rh, rw).reshape(channels, -1).to(compute_dtype)
                        right = window(xt, q2, rh, rw).reshape(channels, -1).to(compute_dtype)
                        block = acc[q * channels : (q + 1) * channels, q2 * channels : (q2 + 1) * channels]
                        block += (left @ right.T).float()
                    q2 += 1
                    continue
                # A run of uncropped blocks is one product with a (run * C, positions) slice of U.
                end = q2 + 1
                while end < k and crops[q, end] is None:
                    end += 1
                right = flat[q2:end].reshape((end - q2) * channels, -1)
                acc[q * channels : (q + 1) * channels, q2 * channels : end * channels] += (
                    flat[q] @ right.T
                ).float()
                q2 = end

    # Mirror the upper blocks and reorder from (offset, channel) to unfold's (channel, offset).
    result = torch.empty(channels, k, channels, k, dtype=torch.float32, device=x.device)
    for q in range(k):
        for q2 in range(q, k):
            block = acc[q * channels : (q + 1) * channels, q2 * channels : (q2 + 1) * channels]
            result[:, q, :, q2] = block
            if q2 != q:
                result[:, q2, :, q] = block.T
    return result.view(channels * k, channels * k), column.T.reshape(-1), n * positions
