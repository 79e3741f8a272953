"""Vision transformers on torchvision's :class:`~torchvision.models.VisionTransformer`.

``vit-tiny`` (6 encoder layers, width 192, 3 heads, MLP 768) is sized for small images: patch 4 for 32 to
64 px, so a 32 px image is 8 x 8 = 64 patches plus the class token. ``vit-b16`` is torchvision's ViT-B/16
(12 layers, width 768, 12 heads, MLP 3072, patch 16). Both take the image size from the data (any side
that the patch divides) and any number of input channels (grayscale: 1).

The model splits into ordered blocks (:func:`kaisoku.models.blocks.ordered_blocks`): the patch embedding
with the class token and the position embedding, each encoder layer, then the final norm with the head.
The pipeline split, activation recompute and K-FAC all work on those blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn
from torchvision.models import VisionTransformer

from kaisoku.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ViTSpec:
    """The shape of a vision transformer."""

    layers: int
    """Encoder layers."""
    width: int
    """Hidden size (token width)."""
    heads: int
    """Attention heads; must divide ``width``."""
    mlp_dim: int
    """Hidden size of each encoder layer's MLP."""
    patch: int
    """Patch side in pixels at ``image_size``; 0: chosen from the image size (:func:`default_patch`)."""
    image_size: int
    """Image side when the data does not say."""


#: Model name -> its shape.
VITS: dict[str, ViTSpec] = {
    "vit-tiny": ViTSpec(layers=6, width=192, heads=3, mlp_dim=768, patch=0, image_size=32),
    "vit-b16": ViTSpec(layers=12, width=768, heads=12, mlp_dim=3072, patch=16, image_size=224),
}


def default_patch(image_size: int) -> int:
    """vit-tiny's patch side: 4 up to 64 px, then 8 up to 128 px, then 16 (8 x 8 to 16 x 16 patches)."""
    if image_size <= 64:
        return 4
    return 8 if image_size <= 128 else 16


def check_vit_size(name: str, image_size: int) -> None:
    """For a vision transformer ``name``: a :class:`ConfigError` when its patch does not divide ``image_size``.

    Other model names pass. ``kaisoku train`` calls it while validating, before any rank starts.
    """
    spec = VITS.get(name)
    if spec is None:
        return
    patch = spec.patch or default_patch(image_size)
    if image_size % patch:
        raise ConfigError(
            f"model {name}: image size {image_size} px is not a multiple of its patch size {patch} px; "
            f"set data.image_size to a multiple of {patch}"
        )


def build_vit(
    name: str,
    *,
    num_classes: int,
    image_size: int | None = None,
    in_channels: int = 3,
    layers: int | None = None,
    width: int | None = None,
    heads: int | None = None,
    mlp_dim: int | None = None,
    patch: int | None = None,
    dropout: float = 0.0,
) -> VisionTransformer:
    """Vision transformer ``name`` (a key of :data:`VITS`) for ``image_size`` px images of ``in_channels``.

    ``layers``, ``width``, ``heads``, ``mlp_dim`` and ``patch`` override the named shape (tests build a
    2-layer, width-32 model this way). A patch that does not divide the image side, or heads that do not
    divide the width, is a :class:`ConfigError` naming both numbers.
    """
    if name not in VITS:
        raise ConfigError(
            f"model.name: unknown vision transformer '{name}'; choose one of: {', '.join(VITS)}"
        )
    spec = VITS[name]
    size = image_size or spec.image_size
    patch = patch or spec.patch or default_patch(size)
    width = width or spec.width
    heads = heads or spec.heads
    if size % patch:
        raise ConfigError(
            f"model {name}: image size {size} px is not a multiple of its patch size {patch} px; "
            f"set data.image_size to a multiple of {patch}"
        )
    if width % heads:
        raise ConfigError(f"model {name}: width {width} is not divisible by its {heads} attention heads")
    if in_channels < 1:
        raise ConfigError(f"model {name}: in_channels must be >= 1 (got {in_channels})")
    model = VisionTransformer(
        image_size=size,
        patch_size=patch,
        num_layers=layers or spec.layers,
        num_heads=heads,
        hidden_dim=width,
        mlp_dim=mlp_dim or (spec.mlp_dim * width // spec.width),
        dropout=dropout,
        num_classes=num_classes,
    )
    if in_channels != 3:
        # Grayscale (or any channel count): a patch projection over in_channels, initialised as torchvision's.
        model.conv_proj = nn.Conv2d(in_channels, width, kernel_size=patch, stride=patch)
        fan_in = in_channels * patch * patch
        nn.init.trunc_normal_(model.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(model.conv_proj.bias)
    return model
