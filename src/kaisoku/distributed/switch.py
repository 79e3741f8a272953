"""Switch-parallel: change the parallel layout inside one run, and layout-independent checkpoints.

A switch schedule says which layout trains which range of epochs (or steps), e.g.
``"dp2xpp2:0-10,dp4:10-"``: epochs 0..9 as 2 replicas of a 2-stage pipeline, epoch 10 onwards as 4
data-parallel replicas. At a boundary the whole model and optimizer state is gathered from the stages
(:meth:`HybridParallel.full_state_dict`), the new layout is built on the same model object and the
state loaded into it, so training goes on with identical weights and optimizer state.

The checkpoint form is that gathered state: the model's own ``state_dict`` names and an optimizer state
keyed by the same names, so a checkpoint written under one layout loads under any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisoku.distributed.mesh import ParallelLayout, ParallelMesh, build_mesh
from kaisoku.distributed.pipeline import HybridParallel
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.fsutil import atomic_open

#: Written into every layout-independent checkpoint; a loader refuses other formats.
CHECKPOINT_FORMAT = "kaisoku.layout-independent/1"
#: Units a switch schedule counts in.
SWITCH_UNITS: tuple[str, ...] = ("epoch", "step")

_SEGMENT = re.compile(r"^(?P<layout>[a-z0-9]+)(?::(?P<start>\d+)-(?P<end>\d*))?$")


@dataclass(frozen=True)
class SwitchSegment:
    """One layout for the half-open range ``[start, end)``; ``end`` None runs to the end of training."""

    layout: ParallelLayout
    start: int
    end: int | None

    def __str__(self) -> str:
        return f"{self.layout}:{self.start}-{'' if self.end is None else self.end}"


@dataclass(frozen=True)
class SwitchSchedule:
    """Contiguous segments from 0 whose last is open-ended, counted in ``unit`` (epochs or steps)."""

    segments: tuple[SwitchSegment, ...]
    unit: str = "epoch"

    def layout_at(self, index: int) -> ParallelLayout:
        """The layout that trains epoch (or step) ``index``."""
        if index < 0:
            raise KaisokuError(f"{self.unit} {index} is negative")
        for segment in self.segments:
            if segment.end is None or index < segment.end:
                return segment.layout
        raise AssertionError("unreachable: the last segment is open-ended")

    def switch_at(self, index: int) -> ParallelLayout | None:
        """The new layout if a segment other than the first starts at ``index``, else None."""
        for segment in self.segments[1:]:
            if segment.start == index:
                return segment.layout
        return None

    @property
    def switch_points(self) -> list[int]:
        """The epochs (or steps) at which the layout changes."""
        return [segment.start for segment in self.segments[1:]]

    def check_world(self, world_size: int) -> None:
        """Every layout of the schedule must fill ``world_size`` ranks."""
        for segment in self.segments:
            segment.layout.check_world(world_size)

    def __str__(self) -> str:
        return ",".join(str(segment) for segment in self.segments)


def parse_switch_schedule(text: str, unit: str = "epoch") -> SwitchSchedule:
    """Read ``"LAYOUT:START-END,...,LAYOUT:START-"`` (``LAYOUT`` as ``dp2xpp2``, ``dp4``, ``pp4``).

    Ranges are half-open and counted in ``unit`` ("epoch" or "step"); they start at 0, follow one another
    without gap or overlap, and only the last is open-ended. A single layout without a range (``"dp4"``)
    means that layout throughout.
    """
    option = "parallel.switch"
    if unit not in SWITCH_UNITS:
        raise ConfigError(f"unknown parallel.switch_unit '{unit}'; choose one of: {', '.join(SWITCH_UNITS)}")
    parts = [part.strip() for part in text.replace(" ", "").lower().split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ConfigError(f"{option} '{text}' has an empty segment; write it like 'dp2xpp2:0-10,dp4:10-'")
    segments: list[SwitchSegment] = []
    expected_start = 0
    for number, part in enumerate(parts):
        match = _SEGMENT.match(part)
        if match is None:
            raise ConfigError(f"{option} segment '{part}' should read LAYOUT:START-END, like 'dp2xpp2:0-10'")
        layout = ParallelLayout.parse(match["layout"])
        last = number == len(parts) - 1
        if match["start"] is None:
            if len(parts) != 1:
                raise ConfigError(
                    f"{option} segment '{part}' needs a range ({unit}s START-END) beside others"
                )
            return SwitchSchedule((SwitchSegment(layout, 0, None),), unit)
        start = int(match["start"])
        end = int(match["end"]) if match["end"] else None
        if start != expected_start:
            what = "start at 0" if number == 0 else f"start where the previous ended, at {expected_start}"
            raise ConfigError(f"{option} segment '{part}' should {what} ({unit}s)")
        if end is None and not last:
            raise ConfigError(f"{option} segment '{part}' is open-ended but is not the last")
        if end is not None and last:
            raise ConfigError(
                f"{option} last segment '{part}' must be open-ended ('{layout}:{start}-') "
                f"so that every {unit} has a layout"
            )
        if end is not None and end <= start:
            raise ConfigError(f"{option} segment '{part}' ends at {end}, not after its start {start}")
        segments.append(SwitchSegment(layout, start, end))
        expected_start = end if end is not None else start
    return SwitchSchedule(tuple(segments), unit)


def switch_layout(
    current: HybridParallel,
    target: ParallelLayout | ParallelMesh,
    *,
    ranks_per_node: int | None = None,
    device_type: str = "cpu",
    example_input: torch.Tensor | None = None,
) -> HybridParallel:
    """Gather ``current``'s model and optimizer state, build ``target`` on the same model, load it there.

    Every rank calls this at the same boundary. ``target`` is a layout (its mesh is built here) or a mesh
    built before (to reuse process groups when switching back and forth). ``current`` is closed.
    """
    state = current.full_state_dict()
    current.close()
    mesh = (
        target
        if isinstance(target, ParallelMesh)
        else build_mesh(target, ranks_per_node=ranks_per_node, device_type=device_type)
    )
    following = HybridParallel(
        current.model,
        mesh,
        loss_fn=current.loss_fn,
        optimizer_factory=current.optimizer_factory,
        options=current.options,
        example_input=example_input,
        device=current.device,
        sync_initial_state=False,
    )
    following.load_full_state_dict(state)
    return following


def save_full_state(path: Path, state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write a :meth:`HybridParallel.full_state_dict` (plus ``extra``, e.g. epoch and step) atomically.

    Call it on one rank (every rank holds the same state).
    """
    record = {"format": CHECKPOINT_FORMAT, **(extra or {}), **state}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as handle:
        torch.save(record, handle)


def load_full_state(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_full_state`; feed it to ``load_full_state_dict``."""
    if not path.exists():
        raise KaisokuError(f"checkpoint {path} does not exist")
    record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise KaisokuError(f"checkpoint {path} is not a layout-independent checkpoint ({found!r})")
    return record
