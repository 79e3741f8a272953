"""Saved activations kept compressed until backward needs them (``torch.autograd.graph.saved_tensors_hooks``).

- ``bf16``: a float32 activation is stored as bfloat16 (half the bytes, 8 mantissa bits) and widened back
  when backward unpacks it.
- ``int8``: stored as int8 with one scale per tensor. The scale comes from the tensor's recent history
  (the largest absolute maximum seen over the last :data:`HISTORY` steps at the same position in the
  step's sequence of saved tensors), not from the tensor itself; the new maximum is measured in the same
  pass and joins the history. A value beyond the history's range saturates (at -128..127 steps on the CPU,
  where one fused ``quantize_per_tensor`` pass packs a float32 tensor; +-127 elsewhere). The first step
  of a position has no history and uses the tensor's own maximum.

Parameters, integer tensors and small tensors (under :data:`MIN_ELEMENTS`) are kept as they are. Not
exact: the tests and ``kaisoku bench memory`` state the tolerance.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from kaisoku.precision.scaler import HISTORY, AmaxHistory

CompressMode = Literal["none", "bf16", "int8"]
"""What ``memory.compress`` does with saved activations."""

#: Tensors smaller than this are not worth a conversion.
MIN_ELEMENTS = 4096
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ZERO = torch.zeros((), dtype=torch.long)


def _compressible(tensor: torch.Tensor) -> bool:
    return (
        tensor.dtype in _FLOATS
        and tensor.numel() >= MIN_ELEMENTS
        and not isinstance(tensor, nn.Parameter)
        and tensor.layout == torch.strided
    )


class ActivationCompressor:
    """Packs saved activations as ``mode`` inside :meth:`step` (one forward pass)."""

    def __init__(self, mode: CompressMode) -> None:
        self.mode = mode
        self._history: dict[int, AmaxHistory] = {}
        self._position = 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.mode == "none" or not _compressible(tensor):
            return tensor
        if self.mode == "bf16":
            return ("bf16", tensor.dtype, tensor.to(torch.bfloat16))
        position = self._position
        self._position += 1
        history = self._history.setdefault(position, AmaxHistory(HISTORY))
        amax = torch.linalg.vector_norm(tensor.detach(), ord=math.inf).float()  # one pass, no temporary
        reference = history.reference(amax)
        history.append(amax)
        scale = torch.clamp(reference, min=1e-12) / 127.0
        if tensor.device.type == "cpu" and tensor.dtype == torch.float32:
            # One fused pass (round half to even); the same values as the general path short of
            # saturation, where it clips to -128..127 rather than +-127.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch marks quantized tensors as to be replaced
                quantized = torch.quantize_per_tensor(tensor.detach(), scale, _ZERO, torch.qint8)
            return ("qint8", tensor.dtype, quantized)
        quantized = torch.clamp(torch.round(tensor.detach() / scale.to(tensor.dtype)), -127, 127).to(
            torch.int8
        )
        return ("int8", tensor.dtype, quantized, scale)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0] == "bf16":
            return packed[2].to(packed[1])
        if packed[0] == "qint8":
            return packed[2].dequantize().to(packed[1])
        _, dtype, quantized, scale = packed
        return (quantized.float() * scale).to(dtype)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Compress what the forward pass inside saves for backward (a no-op for ``none``)."""
        if self.mode == "none":
            yield
            return
        self._position = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
