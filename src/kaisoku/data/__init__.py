"""Data I/O: shard format and packing, sharded datasets, late decoding and augmentation.

Names are imported on first use, so that packing worker processes do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IMAGENET_MEAN": "kaisoku.data.transforms",
    "IMAGENET_STD": "kaisoku.data.transforms",
    "AugmentSpec": "kaisoku.data.transforms",
    "augment": "kaisoku.data.transforms",
    "collate": "kaisoku.data.transforms",
    "decode_image": "kaisoku.data.transforms",
    "normalize": "kaisoku.data.transforms",
    "Field": "kaisoku.data.format",
    "Index": "kaisoku.data.format",
    "ShardInfo": "kaisoku.data.format",
    "CorruptRecordError": "kaisoku.data.records",
    "read_index": "kaisoku.data.format",
    "inspect_dataset": "kaisoku.data.inspect",
    "inspect_summary": "kaisoku.data.inspect",
    "parse_bytes": "kaisoku.units",
    "pack": "kaisoku.data.writer",
    "ShardedDataset": "kaisoku.data.dataset",
    "ImageLabelTransform": "kaisoku.data.dataset",
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
