"""Model builders: torchvision ResNets (with a small-image stem) and a small CNN for digit-sized inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from kaisoku.errors import ConfigError
from kaisoku.models.blocks import ordered_blocks
from kaisoku.models.cosmoflow import CosmoFlow
from kaisoku.models.vit import VITS, build_vit

_RESNETS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    "resnet10": (BasicBlock, [1, 1, 1, 1]),
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


#: Stem name -> (kernel, stride) of the first convolution.
STEMS: dict[str, tuple[int, int]] = {"imagenet": (7, 2), "small": (3, 1), "compact": (3, 2)}


def build_resnet(
    name: str,
    *,
    num_classes: int,
    stem: str = "imagenet",
    zero_init_residual: bool = True,
    bn_momentum: float = 0.1,
    in_channels: int = 3,
) -> ResNet:
    """A torchvision ResNet with a choice of stem for the input size.

    ``stem``: ``imagenet`` (7x7/2 conv + 3x3/2 max-pool, for 224 px), ``small`` (3x3/1 conv, no pool:
    CIFAR-style, full resolution into layer1) or ``compact`` (3x3/2 conv, no pool: half resolution into
    layer1, a quarter of ``small``'s cost, for images of 24 to 64 px).

    ``zero_init_residual`` starts the last BatchNorm gamma of each residual block at zero (each block
    begins as the identity), a standard part of the large-batch recipe.
    """
    block, layers = _RESNETS[name]
    model = ResNet(block, layers, num_classes=num_classes, zero_init_residual=zero_init_residual)
    if stem not in STEMS:
        raise ConfigError(f"model.stem: unknown stem '{stem}'; choose one of: {', '.join(STEMS)}")
    if stem != "imagenet" or in_channels != 3:
        kernel, stride = STEMS[stem]
        model.conv1 = nn.Conv2d(in_channels, 64, kernel, stride, kernel // 2, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        if stem != "imagenet":
            model.maxpool = nn.Identity()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = bn_momentum
    return model


class SmallCNN(nn.Module):
    """A BatchNorm CNN for 28x28 digits: three conv blocks and a linear head."""

    def __init__(self, *, num_classes: int = 10, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(
            block(in_channels, width), block(width, 2 * width), block(2 * width, 4 * width)
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of images."""
        return self.head(self.features(x))

    def ordered_blocks(self) -> list[nn.Module]:
        """The blocks in execution order, where a pipeline may be cut: each conv block, then the head."""
        return [*self.features, self.head]


def _resnet_builder(name: str) -> Callable[..., nn.Module]:
    def build(**kwargs: object) -> nn.Module:
        return build_resnet(name, **kwargs)  # type: ignore[arg-type]

    return build


#: Model name -> builder taking num_classes, stem, zero_init_residual, bn_momentum, in_channels.
MODELS: dict[str, Callable[..., nn.Module]] = {name: _resnet_builder(name) for name in _RESNETS}


def zoo_names() -> list[str]:
    """Every model name the zoo builds."""
    return [*MODELS, "small-cnn", "cosmoflow", *VITS]


def is_zoo_model(name: str) -> bool:
    """Whether ``model.name`` names a model of the zoo (rather than the user's, by import path)."""
    return name in zoo_names()


def build_model(
    name: str,
    *,
    num_classes: int,
    stem: str = "imagenet",
    zero_init_residual: bool = True,
    bn_momentum: float = 0.1,
    in_channels: int = 3,
    size: int = 0,
    width: int = 0,
) -> nn.Module:
    """Build model ``name``; an unknown name is a ConfigError listing the choices.

    ``size``: the volume side for ``cosmoflow`` (0: the reference's 128), whose ``num_classes`` is the
    number of regression targets (``width``: its first block's channels, 0: 32); the image side for the vision transformers (0: vit-tiny's 32, vit-b16's 224).
    """
    if name == "small-cnn":
        return SmallCNN(num_classes=num_classes, in_channels=in_channels, width=width or 32)
    if name == "cosmoflow":
        return CosmoFlow(size=size or 128, in_channels=in_channels, outputs=num_classes, width=width or 32)
    if name in VITS:
        return build_vit(name, num_classes=num_classes, image_size=size or None, in_channels=in_channels)
    if name not in MODELS:
        raise ConfigError(
            f"model.name: unknown model '{name}'; choose one of: {', '.join(zoo_names())}, or your own as "
            "package.module:factory"
        )
    return MODELS[name](
        num_classes=num_classes,
        stem=stem,
        zero_init_residual=zero_init_residual,
        bn_momentum=bn_momentum,
        in_channels=in_channels,
    )


def block_count(name: str, *, stem: str = "imagenet") -> int:
    """How many ordered blocks model ``name`` splits into (the most pipeline stages it can have).

    Built on the meta device: no memory and no initialisation cost.
    """
    with torch.device("meta"):
        return len(ordered_blocks(build_model(name, num_classes=10, stem=stem)))
