"""Data I/O: shard format and packing, sharded datasets, late decoding and augmentation.

Names are imported on first use, so that packing worker processes do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IMAGENET_MEAN": "kaisoku.data.loading.transforms",
    "IMAGENET_STD": "kaisoku.data.loading.transforms",
    "AugmentSpec": "kaisoku.data.loading.transforms",
    "augment": "kaisoku.data.loading.transforms",
    "collate": "kaisoku.data.loading.transforms",
    "decode_image": "kaisoku.data.loading.transforms",
    "normalize": "kaisoku.data.loading.transforms",
    "Field": "kaisoku.data.shards.format",
    "Index": "kaisoku.data.shards.format",
    "ShardInfo": "kaisoku.data.shards.format",
    "CorruptRecordError": "kaisoku.data.shards.records",
    "read_index": "kaisoku.data.shards.format",
    "inspect_dataset": "kaisoku.data.shards.inspect",
    "inspect_summary": "kaisoku.data.shards.inspect",
    "parse_bytes": "kaisoku.units",
    "pack": "kaisoku.data.shards.writer",
    "ShardedDataset": "kaisoku.data.loading.dataset",
    "ImageLabelTransform": "kaisoku.data.loading.dataset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import an exported name from its module on first access."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kaisoku.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
