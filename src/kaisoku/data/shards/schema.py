"""The record schema of a packed dataset: its fields and what the dataset is for (its task)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kaisoku.errors import KaisokuError

FIELD_KINDS = ("image", "int", "bytes", "str", "array")
"""Field kinds: ``image`` encoded image bytes (never compressed again, decoded late); ``int`` a
64-bit integer (also kept as an index column); ``bytes``/``str``/``array`` payloads passed through
the codec (``array`` has a fixed dtype and shape)."""

_ARRAY_DTYPE_KINDS = "biufc"  # numeric only: no object dtype, so nothing can smuggle pickle in


@dataclass(frozen=True, kw_only=True)
class Field:
    """One named field of every record."""

    name: str
    """Field name, the key in a sample dict (e.g. ``image``, ``label``)."""

    kind: str
    """One of :data:`FIELD_KINDS`."""

    dtype: str | None = None
    """``array`` fields only: numpy dtype string with explicit byte order (``"|u1"``, ``"<f4"``)."""

    shape: tuple[int, ...] | None = None
    """``array`` fields only: the shape of every value."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise KaisokuError(f"field names must be non-empty strings, got {self.name!r}")
        if self.kind not in FIELD_KINDS:
            raise KaisokuError(
                f"field {self.name!r} has unknown kind {self.kind!r}; use one of {', '.join(FIELD_KINDS)}"
            )
        if self.kind == "array":
            if self.dtype is None or self.shape is None:
                raise KaisokuError(f"array field {self.name!r} needs a dtype and a shape")
            dtype = np.dtype(self.dtype)
            if dtype.kind not in _ARRAY_DTYPE_KINDS or dtype.fields is not None:
                raise KaisokuError(
                    f"array field {self.name!r} has dtype {self.dtype!r}; "
                    "only plain numeric dtypes are stored"
                )
            if any(int(d) < 0 for d in self.shape):
                raise KaisokuError(f"array field {self.name!r} has a negative dimension in {self.shape}")
        elif self.dtype is not None or self.shape is not None:
            raise KaisokuError(f"field {self.name!r} of kind {self.kind!r} takes no dtype or shape")

    @property
    def compressed(self) -> bool:
        """Whether this field's payload goes through the codec."""
        return self.kind in ("bytes", "str", "array")

    def to_json(self) -> dict[str, Any]:
        """The field as it appears in the index."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "array":
            out["dtype"] = self.dtype
            out["shape"] = list(self.shape or ())
        return out


TASKS = ("classification", "regression")
"""Dataset tasks an index can declare."""


def task_of(fields: Sequence[Field]) -> dict[str, str]:
    """``{"task", "target"}`` of a schema: regression when a float array field ``y`` holds the targets
    (a packed ``.npz`` whose ``y_<split>`` is float), else classification."""
    for f in fields:
        if f.name == "y" and f.kind == "array" and f.dtype is not None and np.dtype(f.dtype).kind == "f":
            return {"task": "regression", "target": f.name}
    return {"task": "classification", "target": "label"}
