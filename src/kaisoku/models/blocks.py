"""A model as an ordered list of blocks, the unit a pipeline is split on.

Applying the blocks one after the other computes exactly ``model(x)``. The blocks share their parameters
and buffers with the model (no copies), so a stage built from blocks trains the model itself, and every
tensor keeps its name in the model's ``state_dict`` (see :func:`state_names`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kaisoku.errors import KaisokuError


class ResNetStem(nn.Module):
    """A torchvision ResNet's input stem: conv1, bn1, relu, maxpool."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.conv1 = model.conv1
        self.bn1 = model.bn1
        self.relu = model.relu
        self.maxpool = model.maxpool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stem of ``ResNet._forward_impl``."""
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class ResNetHead(nn.Module):
    """A torchvision ResNet's head: average pool, flatten, fc."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.avgpool = model.avgpool
        self.fc = model.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Head of ``ResNet._forward_impl``."""
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ViTEmbedding(nn.Module):
    """A torchvision VisionTransformer's input: patch projection, class token, position embedding, dropout."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.conv_proj = model.conv_proj
        self.class_token = model.class_token
        self.pos_embedding = model.encoder.pos_embedding
        self.dropout = model.encoder.dropout
        self.hidden_dim: int = model.hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``VisionTransformer._process_input``, the class token and the start of ``Encoder.forward``."""
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class ViTHead(nn.Module):
    """A torchvision VisionTransformer's output: final layer norm, class token, classifier heads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln = model.encoder.ln
        self.heads = model.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The end of ``Encoder.forward`` and of ``VisionTransformer.forward``."""
        return self.heads(self.ln(x)[:, 0])


def ordered_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` in execution order; applied in turn they compute ``model(x)``.

    Understood: a model with its own ``ordered_blocks()`` method; torchvision ResNets (stem, every
    residual block of layer1..layer4, head); torchvision VisionTransformers (embedding, every encoder
    layer, head); ``nn.Sequential`` (its children).
    """
    own = getattr(model, "ordered_blocks", None)
    if callable(own):
        return list(own())
    from torchvision.models import ResNet, VisionTransformer

    if isinstance(model, ResNet):
        layers = [model.layer1, model.layer2, model.layer3, model.layer4]
        return [ResNetStem(model), *(block for layer in layers for block in layer), ResNetHead(model)]
    if isinstance(model, VisionTransformer):
        return [ViTEmbedding(model), *model.encoder.layers, ViTHead(model)]
    if isinstance(model, nn.Sequential):
        return list(model.children())
    raise KaisokuError(
        f"cannot split a {type(model).__name__} into pipeline stages; give it an ordered_blocks() method "
        "returning its blocks in execution order, or use an nn.Sequential, a torchvision ResNet or ViT"
    )


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Apply ``blocks`` one after the other."""
    for block in blocks:
        x = block(x)
    return x


def state_names(model: nn.Module) -> dict[int, str]:
    """``id(tensor) -> name`` for every parameter and persistent buffer in ``model.state_dict()``.

    A block's tensors are the model's own objects, so this names them as the model does, whatever
    wrapper (a stem, a head, a stage) holds them.
    """
    return {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}


def check_blocks_cover(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Raise :class:`KaisokuError` if some parameter of ``model`` is in none of ``blocks``."""
    held = {id(p) for block in blocks for p in block.parameters()}
    missing = [name for name, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise KaisokuError(
            f"the blocks of {type(model).__name__} leave out {len(missing)} parameters "
            f"(first: {missing[0]}); its ordered_blocks() must cover the whole model"
        )
