"""CosmoFlow: the 3D CNN of the MLPerf HPC reference that regresses cosmological parameters from volumes.

Five convolution blocks ``Conv3d(32 * 2**i, k=3, same padding) -> LeakyReLU -> MaxPool3d(2)``, then
``flatten -> Linear 128 -> Linear 64`` (each with LeakyReLU and dropout 0.5) ``-> Linear 4 -> tanh * 1.2``.
The input is channels-first ``[N, 4, D, D, D]`` (``log1p`` of the counts, applied in the loader). For
small volumes (32³ or 64³ crops that train on a CPU) the blocks past the point where the volume is
1 voxel wide skip their pooling, so any side from 2 up works.
"""

from __future__ import annotations

import torch
from torch import nn

from kaisoku.errors import ConfigError

CONV_BLOCKS = 5
"""Convolution blocks of the reference model."""

OUTPUT_SCALE = 1.2
"""The head's ``tanh`` output is multiplied by this, so targets in [-1, 1] sit inside its range."""

LEAKY_SLOPE = 0.3
"""Negative slope of the LeakyReLUs: the reference's (Keras's default), not torch's 0.01."""


def pooling_stages(size: int, blocks: int = CONV_BLOCKS) -> int:
    """How many of ``blocks`` blocks pool (halve the volume): as many as keep the side >= 1, at most all.

    128³ pools 5 times (4³ into the head, as in the reference); 32³ pools 5 (1³); 16³ pools 4.
    """
    if size < 1:
        raise ConfigError(f"cosmoflow: the volume side must be >= 1, got {size}")
    stages = 0
    while stages < blocks and size // 2 >= 1 and size % 2 == 0:
        size //= 2
        stages += 1
    return stages


class CosmoFlow(nn.Module):
    """The CosmoFlow regression network for ``[N, in_channels, size, size, size]`` volumes.

    ``outputs`` targets come out of ``tanh * 1.2``; ``dropout`` follows each of the two hidden dense
    layers. ``width`` is the first block's channels (32 in the reference), doubled at each block.
    """

    def __init__(
        self,
        *,
        size: int = 128,
        in_channels: int = 4,
        outputs: int = 4,
        width: int = 32,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.size = int(size)
        self.in_channels = int(in_channels)
        pools = pooling_stages(self.size)
        blocks: list[nn.Module] = []
        channels, side = in_channels, self.size
        for i in range(CONV_BLOCKS):
            out = width * 2**i
            layers: list[nn.Module] = [nn.Conv3d(channels, out, 3, padding=1), nn.LeakyReLU(LEAKY_SLOPE)]
            if i < pools:
                layers.append(nn.MaxPool3d(2))
                side //= 2
            blocks.append(nn.Sequential(*layers))
            channels = out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * side**3, 128),
            nn.LeakyReLU(LEAKY_SLOPE),
            nn.Dropout(dropout),
            nn.Linear(128, 64),
            nn.LeakyReLU(LEAKY_SLOPE),
            nn.Dropout(dropout),
            nn.Linear(64, outputs),
            _ScaledTanh(OUTPUT_SCALE),
        )
        # The reference's initialisation (Keras's defaults): Glorot-uniform weights, zero biases. torch's
        # default shrinks the signal through the five blocks until the head sees almost constant features.
        for module in self.modules():
            if isinstance(module, nn.Conv3d | nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[N, outputs]`` predictions for a batch of volumes."""
        if x.ndim != 5 or x.shape[1] != self.in_channels or tuple(x.shape[2:]) != (self.size,) * 3:
            raise ConfigError(
                f"cosmoflow expects volumes [N, {self.in_channels}, {self.size}, {self.size}, {self.size}], "
                f"got {list(x.shape)}"
            )
        return self.head(self.features(x))

    def ordered_blocks(self) -> list[nn.Module]:
        """The blocks in execution order, where a pipeline may be cut: each conv block, then the head."""
        return [*self.features, self.head]


class _ScaledTanh(nn.Module):
    """``tanh(x) * scale``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bounded outputs in ``(-scale, scale)``."""
        return torch.tanh(x) * self.scale

    def extra_repr(self) -> str:
        """The scale, for printing."""
        return f"scale={self.scale}"
