"""Which blocks get an FSDP unit of their own (pure: no process group)."""

from __future__ import annotations

from torch import nn
from torchvision.models import VisionTransformer

from kaisoku.distributed.sharding import ROOT_SHARE, shard_units, units_of_their_own


def _numel(unit: nn.Module | list[nn.Module]) -> int:
    modules = unit if isinstance(unit, list) else [unit]
    return sum(p.numel() for m in modules for p in m.parameters())


def test_a_vits_embedding_and_head_join_the_root_and_every_encoder_layer_keeps_its_unit() -> None:
    model = VisionTransformer(
        image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512, num_classes=10
    )
    units = shard_units(model)
    total = sum(p.numel() for p in model.parameters())
    own = units_of_their_own(units, total)
    assert len(units) == 6  # embedding, 4 encoder layers, head
    assert own == list(model.encoder.layers)
    folded = sum(_numel(u) for u in units) - sum(_numel(u) for u in own)
    assert 0 < folded <= ROOT_SHARE * total


def test_units_join_the_root_smallest_first_and_never_beyond_the_share() -> None:
    units = [nn.Linear(10, 10, bias=False), nn.Linear(30, 10, bias=False), nn.Linear(1, 5, bias=False)]
    # 100, 300 and 5 parameters out of 10,000: a 2% share (200) takes the 5 and the 100, not the 300.
    assert units_of_their_own(units, 10_000) == [units[1]]
    assert units_of_their_own(units, 10_000, share=0.0) == units
    assert units_of_their_own(units, 405, share=1.0) == []
